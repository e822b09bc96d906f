"""Deviceless TPU compilation (docs/plan.md): compile for v5e / v6e / v7x on a machine without a TPU.

libtpu compiles against a described topology; nothing runs. Used by `plan` and by the kernel checks.
"""

from __future__ import annotations

import os
import time
from functools import cache

TOPOLOGIES = {  # chip -> (topology name prefix, accelerator type of one chip)
    "v5e": ("v5e", "v5litepod-1"),
    "v6e": ("v6e", "v6e-1"),
    "v7x": ("tpu7x", "tpu7x-2"),
}
# devices -> chip grid. A v5e / v6e chip is one JAX device; a v7x chip has two TensorCores, each its own device
# (libtpu: `tpu7x:1x1x1` lists 2 devices, `tpu7x:1x2x1` 4, `tpu7x:2x2x1` 8), so 1 or 2 devices take one chip.
GRIDS = {1: (1, 1), 2: (1, 2), 4: (2, 2), 8: (2, 4)}
V7X_GRIDS = {1: (1, 1), 2: (1, 1), 4: (1, 2), 8: (2, 2)}


@cache
def tpu_devices(chip: str, tp: int = 1) -> tuple:
    """`tp` devices of the smallest topology of `chip` that has them (needs libtpu: `pip install
    quantkit[tpu]`): `tp` chips of a v5e / v6e; `tp` TensorCores of a v7x, two a chip (one: half a chip)."""
    accel = TOPOLOGIES[chip][1]
    if tp not in GRIDS:
        from quantkit.errors import Unsupported

        raise Unsupported(f"--tp {tp} on {chip}: plans cover 1, 2, 4 or 8 devices")
    # libtpu reads these when it first loads; they tell it not to look for real hardware, and (deviceless
    # compilation touches no chip) not to take the one-process lockfile that another compiling process holds.
    for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", accel),
                       ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_WORKER_ID", "0"),
                       ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
        os.environ.setdefault(key, value)
    from jax.experimental import topologies

    x, y = _grid(chip, tp)
    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=topology_name(chip, tp),
                                              chips_per_host_bounds=(x, y, 1)).devices[:tp])


def _grid(chip: str, tp: int) -> tuple[int, int]:
    return (V7X_GRIDS if chip == "v7x" else GRIDS)[tp]


def topology_name(chip: str, tp: int) -> str:
    x, y = _grid(chip, tp)
    return f"tpu7x:{x}x{y}x1" if chip == "v7x" else f"{TOPOLOGIES[chip][0]}:{x}x{y}"


def chips(chip: str, tp: int) -> int:
    """How many chips `tp` devices of `chip` take."""
    return (tp + 1) // 2 if chip == "v7x" else tp


@cache
def target_mesh(chip: str, tp: int):
    """The tensor-parallel mesh over a `tp`-chip topology (one object per target, so that weights placed on
    it and the programs compiled for it agree)."""
    from quantkit.runtime.sharding import make_mesh

    return make_mesh(tp, list(tpu_devices(chip, tp)))


def compile_for(chip: str, fn, *args, donate: tuple[int, ...] = (), pinned: tuple[int, ...] = (), tp: int = 1):
    """Compiles `fn` for `tp` devices of `chip` on abstract args (pytrees of jax.ShapeDtypeStruct; those
    without a sharding go on the one device, or are replicated over the mesh); `donate`: argument positions
    whose buffers the outputs may reuse (the KV cache); `pinned`: argument positions laid out row-major, as
    the Runner places weights (runtime/sharding.py row_major); the others in layouts XLA chooses.

    Returns (compiled, seconds). Lowering runs under the target device so that Pallas rules that
    consult the chip see the target, not the host CPU.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    from quantkit.runtime.sharding import row_major

    devices = tpu_devices(chip, tp)
    default = NamedSharding(target_mesh(chip, tp), PartitionSpec()) if tp > 1 else SingleDeviceSharding(devices[0])

    def place(a, pin: bool):
        sharding = getattr(a, "sharding", None) or default
        sharding = row_major(sharding, len(a.shape)) if pin else sharding
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    placed = [jax.tree_util.tree_map(lambda a, pin=i in pinned: place(a, pin), x) for i, x in enumerate(args)]
    t = time.perf_counter()
    with jax.default_device(devices[0]):
        compiled = jax.jit(fn, donate_argnums=donate).trace(*placed).lower(lowering_platforms=("tpu",)).compile()
    return compiled, time.perf_counter() - t
