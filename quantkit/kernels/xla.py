"""The XLA path: gmm_v2's signature, used on CPU and as the fallback on TPU.

It dequantizes the whole weight to bf16 before the dot (XLA may fuse it, but nothing guarantees the
weight stays packed), which is exactly what gmm_v2 exists to avoid on TPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from quantkit.quant.qtensor import QTensor
from quantkit.quant.reference import dequantize


@jax.jit
def gmm_xla(lhs: jax.Array, rhs: QTensor, group_sizes: jax.Array) -> jax.Array:
    """[m, k] x QTensor [g, k, n] -> [m, n] in lhs.dtype; rows past sum(group_sizes) are zero."""
    w = dequantize(rhs).astype(lhs.dtype)  # [g, k, n]
    if w.shape[0] == 1:
        out = jnp.dot(lhs, w[0], preferred_element_type=jnp.float32)
        rows = jnp.arange(lhs.shape[0])[:, None] < group_sizes[0]
        return jnp.where(rows, out, 0.0).astype(lhs.dtype)
    return jax.lax.ragged_dot(lhs, w, group_sizes.astype(jnp.int32),
                              preferred_element_type=jnp.float32).astype(lhs.dtype)
