"""Tensor and expert parallelism: a 1-D mesh with a "model" axis; weights placed with NamedShardings, XLA's
SPMD partitioner inserting the collectives, and quantized matmuls run per shard (runtime/ops.py). One set of
rules for the loader (which places each tensor straight onto its shards), the Runner and `plan`.

- column-parallel (output features split, "n"): q, k, v (+ biases), gate, up, lm_head and, without expert
  parallelism, the experts' gate and up;
- row-parallel (input features split, "k", all-reduce after): o, down (experts' down too). A row-parallel
  QTensor splits its values along k and its scale rows with them (k/group rows per shard), so grouped int4
  works; channel scales (one row) are replicated, which is exact since every shard's partial sum uses the
  same scale. The embedding is split by vocabulary rows the same way ("k" of a [vocab, hidden] table).
- expert-parallel ("e", `ep`): each device holds experts/tp whole experts of every MoE layer and runs them
  through the grouped matmul (models/common.py `routed_experts`). A stacked expert QTensor [layers * experts,
  k, n] is then stored device-major (`expert_rows`), so that an even split of its leading axis gives each
  device its own experts of every layer, layer by layer contiguous; dense experts [layers, experts, k, n]
  split their experts axis.
- KV heads (and the KV cache) are split when their count divides the mesh, else replicated.
Everything else (norms, router, scalars) is replicated. A dimension that does not divide the mesh is refused
with its name, except KV heads and vocabulary rows, which fall back to replication.

Data parallelism (`dp`, vLLM's --data-parallel-size): every weight is replicated but the experts (split "e"
under expert parallelism), and each device serves its own sequences: the KV pages and state slots of every
kind are split along their second axis (pages, slots), a device's block tables pointing into its own
(`cache_sharding`); the step runs as one shard_map over the devices (runtime/step.py), where the weights are
each device's own (`local_view`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from quantkit.errors import InvalidInput
from quantkit.quant.qtensor import QTensor
from quantkit.runtime.config import ModelConfig

AXIS = "model"
EXPERTS = ("experts_gate", "experts_up", "experts_down")  # every family's routed experts (runtime/family.py)
COLUMN = ("q", "k", "v", "q_bias", "k_bias", "v_bias", "gate", "up", "lm_head", "experts_gate", "experts_up")
ROW = ("o", "down", "experts_down", "embed")


def row_major(sharding, ndim: int):
    """The placement of an array of `ndim` dims in row-major order on `sharding`. Weights are pinned to it (the
    Runner's arrays and plan's abstract ones alike): left free, XLA:TPU lays out an array with few rows per
    leading index otherwise (Gemma-3-27B g128: the [52, 42, 21504] stacked scales as [42, 52, 21504]) and the
    kernel, which reads one layer's rows, then gets a relayout copy of the whole stack every step (0.2 GiB
    of temporaries)."""
    from jax.experimental.layout import Format, Layout

    return Format(Layout(tuple(range(ndim))), sharding)


def place_row_major(tree):
    """`tree` with every array row-major on its own sharding; an array already so is kept, not copied (a copy
    of every weight would hold the model twice in HBM while the loader's arrays are alive)."""
    def put(x):
        if x.format.layout.major_to_minor == tuple(range(x.ndim)):
            return x
        return jax.device_put(x, row_major(x.sharding, x.ndim))

    return jax.tree_util.tree_map(put, tree)


def make_mesh(tp: int, devices=None) -> Mesh:
    """A mesh over the first `tp` of `devices` (default: every device of every process)."""
    devices = jax.devices() if devices is None else devices
    if tp > len(devices):
        raise InvalidInput(f"--tp {tp} needs {tp} devices, {len(devices)} available")
    return Mesh(np.array(devices[:tp]), (AXIS,))


def is_expert(cfg: ModelConfig, key: str) -> bool:
    return key in EXPERTS


def split_of(key: str, cfg: ModelConfig, tp: int, kind: str = "full", ep: bool = False, dp: bool = False) -> str:
    """How the leaf `key` of a layer of `kind` (or a top-level leaf) divides over `tp` devices: "n", "k",
    "e" or "" (replicated); see the module docstring (dp: data parallel)."""
    if ep and is_expert(cfg, key):
        if cfg.num_experts % tp:
            raise InvalidInput(f"{cfg.num_experts} experts do not split over {tp} devices (expert parallelism)")
        return "e"
    if dp:
        return ""
    if key in ("k", "v", "k_bias", "v_bias") and cfg.kv_shape(kind)[0] % tp:
        return ""
    if key in ("embed", "lm_head") and cfg.vocab_size % tp:
        return ""
    return "n" if key in COLUMN else "k" if key in ROW else ""


def spec(split: str, ndim: int) -> P:
    """PartitionSpec of an array [..., in, out] split along "n" (out), "k" (in), "e" (the axis before [in,
    out]: experts, or a stacked QTensor's device-major rows) or not at all ("")."""
    at = {"n": ndim - 1, "k": ndim - 2, "e": ndim - 3}.get(split)
    return P() if at is None else P(*([None] * at), AXIS, *([None] * (ndim - 1 - at)))


def shardings(key: str, cfg: ModelConfig, mesh: Mesh, shape: tuple, kind: str = "full", ep: bool = False,
              scale_rows: int | None = None, dp: bool = False):
    """(sharding, split) of a dense leaf of `shape`, or for a QTensor (scale_rows: its scales' row count)
    ((values sharding, scales sharding), split). Refuses a split dimension that does not divide the mesh."""
    tp = mesh.shape[AXIS]
    split = split_of(key, cfg, tp, kind, ep, dp)
    at = {"n": -1, "k": -2, "e": -3}.get(split)
    if at is not None and shape[at] % tp:
        what = "experts x layers" if split == "e" else "input features" if split == "k" else "output features"
        raise InvalidInput(f"{key}: {shape[at]} {what} do not split over {tp} devices")
    values = NamedSharding(mesh, spec(split, len(shape)))
    if scale_rows is None:
        return values, split
    if split == "k" and scale_rows > 1 and scale_rows % tp:
        raise InvalidInput(f"{key}: {scale_rows} scale groups along the input features do not split over {tp} "
                           "devices; use a smaller --tp or channel scales")
    scales = NamedSharding(mesh, spec("" if split == "k" and scale_rows == 1 else split, 3))
    return (values, scales), split


def group_sharding(mesh: Mesh, split: str) -> NamedSharding:
    """A QTensor's per-group array ([g]: nvfp4's global scales): split with the experts, else replicated."""
    return NamedSharding(mesh, P(AXIS) if split == "e" else P())


def expert_rows(layers: int, experts: int, tp: int) -> np.ndarray:
    """The device-major order of a stacked expert QTensor's rows under expert parallelism: row r of the
    placed array holds layer-major row expert_rows(...)[r] (layer * experts + expert); device d's rows are
    [d * layers * local, (d + 1) * layers * local), layer l's local experts at l * local (local =
    experts / tp), so that the grouped matmul finds one layer's experts contiguous at offset l * local."""
    local = experts // tp
    d, layer, j = np.meshgrid(np.arange(tp), np.arange(layers), np.arange(local), indexing="ij")
    return (layer * experts + d * local + j).reshape(-1)


def _put(x, sharding):
    """x placed on `sharding`: kept when already there, else copied; host data in a multi-process run goes
    through make_array_from_callback (every process passes the same x; each places its own devices' parts)."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    if jax.process_count() > 1 and not (isinstance(x, jax.Array) and not x.is_fully_addressable):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    return jax.device_put(x, sharding)


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh, put=_put, ep: bool = False, dp: bool = False) -> dict:
    """Places every leaf of the weight pytree on `mesh` by the rules above (`ep`: expert parallel, `dp`:
    data parallel).

    put(leaf, sharding): places real weights (default); `plan` passes one that makes abstract
    ShapeDtypeStructs. A layer-major expert QTensor (one loaded without the mesh) is reordered device-major
    first; one the loader placed (split "e") is kept."""
    tp = mesh.shape[AXIS]
    if cfg.num_heads % tp and not dp:
        raise InvalidInput(f"{cfg.num_heads} attention heads do not split over {tp} devices")

    def place(key: str, w, kind: str = "full", layers: int = 1):
        if not isinstance(w, QTensor):
            return put(w, shardings(key, cfg, mesh, w.shape, kind, ep, dp=dp)[0])
        (vs, ss), split = shardings(key, cfg, mesh, w.shape, kind, ep, w.scales.shape[1], dp)
        arrays = w.arrays
        if split == "e" and w.split != "e" and isinstance(w.values, jax.Array | np.ndarray):
            order = expert_rows(layers, w.shape[0] // layers, tp)
            arrays = {f: a[order] for f, a in arrays.items()}
        where = w.per_array(vs, ss, group_sharding(mesh, split))
        return w.with_arrays({f: put(a, where[f]) for f, a in arrays.items()}, mesh=mesh, split=split)

    out = {k: place(k, v) for k, v in params.items() if k != "layers"}
    out["layers"] = {kind: {key: place(key, w, kind, len(stack["attn_norm"])) for key, w in stack.items()}
                     for kind, stack in params["layers"].items()}
    return out


def cache_sharding(cfg: ModelConfig, mesh: Mesh, kind: str, dp: bool = False) -> NamedSharding:
    """Stacked KV pages of a kind [layers, pages, page_size, kv_heads * 2 * head_dim]: heads split when they
    divide the mesh (each head's keys and values are adjacent, so a split of the last axis is a split of heads),
    Gated DeltaNet states ("linear") replicated; data parallel (`dp`): pages and state slots split, each
    device's its own."""
    if dp:
        return NamedSharding(mesh, P(None, AXIS))
    tp = mesh.shape[AXIS]
    return NamedSharding(mesh, P(None, None, None, AXIS) if kind != "linear" and cfg.kv_shape(kind)[0] % tp == 0
                         else P())


def local_view(params: dict, ep: bool) -> tuple[dict, dict]:
    """(params as a device of the data-parallel step sees them: QTensors without their mesh, the
    PartitionSpec of each leaf): the shard_map's arguments and in_specs (every weight replicated, the experts
    split "e" under expert parallelism, as shard_params placed them with `dp`)."""
    def local(key: str, w):
        if isinstance(w, QTensor):
            s = spec(w.split, 3)
            specs = w.per_array(s, s, P(AXIS) if w.split == "e" else P())
            return w.with_arrays(w.arrays, mesh=None, split=""), w.with_arrays(specs, mesh=None, split="")
        split = "e" if ep and key in EXPERTS else ""
        return w, jax.tree_util.tree_map(lambda a: spec(split, a.ndim), w)  # an array or a layer tuple

    def apart(pairs: dict) -> tuple[dict, dict]:
        return {k: v[0] for k, v in pairs.items()}, {k: v[1] for k, v in pairs.items()}

    out, specs = apart({k: local(k, w) for k, w in params.items() if k != "layers"})
    layers = {kind: apart({k: local(k, w) for k, w in stack.items()}) for kind, stack in params["layers"].items()}
    out["layers"], specs["layers"] = apart(layers)
    return out, specs


def start(tp: int = 1, coordinator: str | None = None, num_processes: int | None = None,
          process_id: int | None = None, dp: int = 1) -> Mesh | None:
    """The mesh `serve`, `generate` and `eval` place a model on: None for one device, else `tp` devices
    (tensor parallel) or `dp` (data parallel; one of the two).

    coordinator: join a multi-process run first (jax.distributed, JAX's multi-controller runtime): "HOST:PORT"
    of process 0 with `num_processes` and this `process_id`, or "auto" on a TPU slice, where JAX finds all
    three itself. The mesh then spans the devices of every process."""
    if tp > 1 and dp > 1:
        raise InvalidInput("--data-parallel-size with --tp is not supported yet: use one of them")
    if coordinator is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices across processes
        if coordinator == "auto":
            jax.distributed.initialize()
        else:
            if num_processes is None or process_id is None:
                raise InvalidInput("--coordinator-address HOST:PORT needs --num-processes and --process-id")
            jax.distributed.initialize(coordinator, num_processes, process_id)
    elif num_processes not in (None, 1):
        raise InvalidInput("--num-processes needs --coordinator-address")
    if jax.process_count() > 1 and dp > 1:
        raise InvalidInput("--data-parallel-size runs in one process, not across hosts yet")
    tp = max(tp, dp)
    if jax.process_count() > 1 and tp != len(jax.devices()):
        raise InvalidInput(f"a run of {jax.process_count()} processes spans all {len(jax.devices())} of their "
                           f"devices: --tp {len(jax.devices())}, not {tp}")
    return make_mesh(tp) if tp > 1 else None
