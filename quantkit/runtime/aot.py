"""Deviceless TPU compilation (docs/plan.md): compile for v5e / v6e / v7x on a machine without a TPU.

libtpu compiles against a described topology; nothing runs. Used by `plan` and by the kernel checks.
"""

from __future__ import annotations

import contextlib
import contextvars
import gzip
import hashlib
import json
import os
import time
from functools import cache
from types import SimpleNamespace

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


_LOG: contextvars.ContextVar[list | None] = contextvars.ContextVar("compile_log", default=None)


@contextlib.contextmanager
def compile_log():
    """Within it, each compile_for call appends {label, trace_s, lower_s, compile_s, cached} to the list it
    yields: where a plan's time goes (`plan --timings`); `cached`: the program's Facts were read back, not
    compiled."""
    log: list = []
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


class Facts:
    """What `plan` reads of a compiled program (its temporaries, argument layouts, cost analysis and HLO text),
    kept where JAX's own persistent cache cannot help: a deviceless executable is written there but cannot be
    read back ("PjRtCompiler must be constructed with a Client"). The same methods as a compiled program's."""

    def __init__(self, temp: int, layouts: list, cost: dict, hlo: str):
        self.temp, self.layouts, self.cost, self.hlo = temp, layouts, cost, hlo

    @classmethod
    def of(cls, compiled) -> "Facts":
        import jax

        cost = compiled.cost_analysis()
        cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
        layouts = [None if (lay := getattr(f, "layout", None)) is None else
                   [list(lay.major_to_minor), [list(t) for t in lay.tiling]]
                   for f in jax.tree_util.tree_leaves(compiled.input_formats)]
        return cls(compiled.memory_analysis().temp_size_in_bytes, layouts,
                   {k: float(v) for k, v in cost.items() if isinstance(v, (int, float))}, compiled.as_text())

    def memory_analysis(self):
        return SimpleNamespace(temp_size_in_bytes=self.temp)

    def cost_analysis(self) -> dict:
        return self.cost

    def as_text(self) -> str:
        return self.hlo

    @property
    def input_formats(self) -> list:
        return [SimpleNamespace(layout=None if x is None else SimpleNamespace(
            major_to_minor=tuple(x[0]), tiling=tuple(tuple(t) for t in x[1]))) for x in self.layouts]

    def save(self, path: str) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        with gzip.open(tmp, "wt") as f:
            json.dump({"temp": self.temp, "layouts": self.layouts, "cost": self.cost, "hlo": self.hlo}, f)
        os.replace(tmp, path)  # whole or absent: a reader never sees half a file

    @classmethod
    def load(cls, path: str) -> "Facts | None":
        try:
            with gzip.open(path, "rt") as f:
                d = json.load(f)
            return cls(d["temp"], d["layouts"], d["cost"], d["hlo"])
        except (OSError, ValueError, KeyError, EOFError):
            return None


def facts_dir() -> str:
    """Where compiled programs' Facts are kept: beside JAX's persistent cache (runtime/engine.py)."""
    base = os.environ.get("QUANTKIT_JAX_CACHE") or os.path.expanduser("~/.cache/quantkit/jax")
    return os.path.join(base, "plan-facts")


def compile_for(chip: str, fn, *args, donate: tuple[int, ...] = (), pinned: tuple[int, ...] = (), tp: int = 1,
                label: str = "", facts: bool = False):
    """Compiles `fn` for `tp` devices of `chip` on abstract args (pytrees of jax.ShapeDtypeStruct; those
    without a sharding go on the one device, or are replicated over the mesh); `donate`: argument positions
    whose buffers the outputs may reuse (the KV cache); `pinned`: argument positions laid out row-major, as
    the Runner places weights (runtime/sharding.py row_major); the others in layouts XLA chooses.

    Returns (compiled, seconds). Lowering runs under the target device so that Pallas rules that
    consult the chip see the target, not the host CPU. `label` names the program in `compile_log`. `facts`:
    return the program's Facts instead, read from `facts_dir()` when a program of the same lowered text was
    compiled for the same target before (its fingerprint: the text, the target and the jax and libtpu
    versions), else compiled and written there.
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
    t, cached = [time.perf_counter()], False
    with jax.default_device(devices[0]):
        traced = jax.jit(fn, donate_argnums=donate).trace(*placed)
        t.append(time.perf_counter())
        lowered = traced.lower(lowering_platforms=("tpu",))
        t.append(time.perf_counter())
        path = compiled = None
        if facts:
            path = os.path.join(facts_dir(), _fingerprint(lowered.as_text(), chip, tp, donate) + ".json.gz")
            compiled = Facts.load(path)
        if compiled is None:
            compiled = lowered.compile()
            if facts:
                compiled = Facts.of(compiled)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                compiled.save(path)
        else:
            cached = True
        t.append(time.perf_counter())
    if (log := _LOG.get()) is not None:
        log.append({"label": label, "trace_s": round(t[1] - t[0], 2), "lower_s": round(t[2] - t[1], 2),
                    "compile_s": round(t[3] - t[2], 2), "cached": cached})
    return compiled, t[3] - t[0]


def _fingerprint(text: str, chip: str, tp: int, donate) -> str:
    import importlib.metadata

    import jax

    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = "?"
    key = f"{chip}|{tp}|{tuple(donate)}|jax {jax.__version__}|libtpu {libtpu}\n{text}"
    return hashlib.sha256(key.encode()).hexdigest()
