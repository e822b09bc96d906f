"""The quantized matmuls of the runtime: gmm_v2 on TPU when it can serve the shape, the XLA path otherwise."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from quantkit.kernels.tiling import CHIPS
from quantkit.kernels.xla import gmm_xla
from quantkit.quant.qtensor import QTensor


def _tpu_chip() -> str | None:
    """The TPU generation being traced for: the default device's (set by `with jax.default_device(...)`
    for deviceless compilation in `plan`), else the backend's; None off TPU."""
    dev = jax.config.jax_default_device
    dev = dev if isinstance(dev, jax.Device) else (jax.devices()[0] if jax.default_backend() == "tpu" else None)
    if dev is None or dev.platform != "tpu":
        return None
    kind = dev.device_kind.lower()
    return "v5e" if "v5" in kind else "v7x" if "7" in kind else "v6e"


def grouped_matmul(x: jax.Array, w: QTensor, group_sizes: jax.Array) -> jax.Array:
    """x [m, k] rows sorted by group, w [g, k, n] -> [m, n]."""
    chip = _tpu_chip()
    if chip is not None:
        from quantkit.kernels.gmm_v2 import check_gmm_v2, gmm_v2

        tiles, _ = check_gmm_v2(x.shape, w, CHIPS[chip])
        if tiles is not None:
            return gmm_v2(x, w, group_sizes, chip=chip, tiles=tiles)
    return gmm_xla(x, w, group_sizes)


def qmatmul(x: jax.Array, w: QTensor) -> jax.Array:
    """x [m, k] @ one-group QTensor [1, k, n] -> [m, n]."""
    return grouped_matmul(x, w, jnp.full((1,), x.shape[0], jnp.int32))
