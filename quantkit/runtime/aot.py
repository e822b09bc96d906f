"""Deviceless TPU compilation (TPU.md): compile for v5e / v6e / v7x on a machine without a TPU.

libtpu compiles against a described topology; nothing runs. Used by `plan` and by the kernel checks.
"""

from __future__ import annotations

import os
import time
from functools import cache

TOPOLOGIES = {  # chip -> (topology name, chips per host, accelerator type)
    "v5e": ("v5e:1x1", (1, 1, 1), "v5litepod-1"),
    "v6e": ("v6e:1x1", (1, 1, 1), "v6e-1"),
    "v7x": ("tpu7x:1x1x1", (1, 1, 1), "tpu7x-2"),
}


@cache
def tpu_device(chip: str):
    """The first device of a single-chip topology for `chip` (needs libtpu: `pip install quantkit[tpu]`)."""
    name, bounds, accel = TOPOLOGIES[chip]
    # libtpu reads these when it first loads; they tell it not to look for real hardware, and (deviceless
    # compilation touches no chip) not to take the one-process lockfile that another compiling process holds.
    for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", accel),
                       ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_WORKER_ID", "0"),
                       ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
        os.environ.setdefault(key, value)
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name=name, chips_per_host_bounds=bounds).devices[0]


def compile_for(chip: str, fn, *args, donate: tuple[int, ...] = ()):
    """Compiles `fn` for `chip` on abstract args (pytrees of jax.ShapeDtypeStruct without sharding);
    `donate`: argument positions whose buffers the outputs may reuse (the KV cache).

    Returns (compiled, seconds). Lowering runs under the target device so that Pallas rules that
    consult the chip see the target, not the host CPU.
    """
    import jax

    dev = tpu_device(chip)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    placed = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    t = time.perf_counter()
    with jax.default_device(dev):
        compiled = jax.jit(fn, donate_argnums=donate).trace(*placed).lower(lowering_platforms=("tpu",)).compile()
    return compiled, time.perf_counter() - t
