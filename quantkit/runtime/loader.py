"""Checkpoint -> weight pytree on device. Quantized weights are unpacked once into QTensors (int4 stays
int4); dense weights become bf16 [in, out] arrays; nothing is ever dequantized. Which module fills which
leaf is runtime/layout.py's skeleton; a missing module is an error naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from quantkit.errors import InvalidInput, Unsupported
from quantkit.formats.compressed_tensors import QuantConfig, activation_qtype, quantization_config_of, weight_qtype
from quantkit.formats.ct_writer import divisor_hint
from quantkit.formats.ct_tensors import (KV_SCALES, input_rotation, kernel_layout, kernel_shapes, kv_head_scales,
                                        logical_shape, stored_transforms, transform_size)
from quantkit.formats.hf import Checkpoint, group_modules, read_json
from quantkit.quant.qtensor import STORAGE, QTensor, check_qtensor
from quantkit.runtime.config import ModelConfig
from quantkit.runtime.family import Slot
from quantkit.runtime.layout import lane_widths, skeleton
from quantkit.runtime.models import from_hf
from quantkit.runtime.sharding import AXIS, expert_rows, group_sharding, place_row_major, shardings
from quantkit.runtime.validate import config_findings, validate_checkpoint



def abstract(cfg: ModelConfig, qc: QuantConfig | None, dtype=jnp.bfloat16, mtp: bool = False) -> dict:
    """The weight pytree of `cfg` quantized as `qc` says, as jax.ShapeDtypeStruct leaves (no data): the
    argument `plan` compiles with. Scales are assumed bfloat16 (what `quantkit convert` writes). mtp: with
    Qwen3.5's MTP layer as params["draft"], as `load(..., mtp=True)` holds it."""
    def leaf(s: Slot):
        if s.kind == "stack":
            one = leaf(s.module[0])
            n = len(s.module)
            if isinstance(one, QTensor):
                return one.with_arrays({f: jax.ShapeDtypeStruct((n * a.shape[0], *a.shape[1:]), a.dtype)
                                        for f, a in one.arrays.items()})
            return jax.ShapeDtypeStruct((n, *one.shape), one.dtype)
        linear = s.kind in ("linear", "experts")
        scheme = qc.scheme_for(s.module[0] if s.kind == "experts" else s.module, "Linear") if qc and linear else None
        quantized = linear and weight_qtype(scheme) != "dense"
        if not quantized:
            return jax.ShapeDtypeStruct(s.shape, jnp.float32 if s.kind in ("norm", "router", "tensor", "conv") else dtype)
        *g, k, n = s.shape
        ks, act = kernel_shapes(scheme, (n, k)), activation_qtype(scheme)
        if k % ks.group:  # as convert refuses it (a model whose widths are not multiples of 128: gpt-oss's 2880)
            raise InvalidInput(f"{s.module[0] if s.kind == 'experts' else s.module}: {k} input features are not "
                               f"divisible by group size {ks.group}; {divisor_hint(k)}")
        rot = [transform_size(t, k) for t in qc.input_transforms(s.module[0] if s.kind == "experts" else s.module,
                                                                  "Linear")]
        g = g[0] if g else 1
        return QTensor(jax.ShapeDtypeStruct((g, k, n), STORAGE[ks.qtype]),
                       jax.ShapeDtypeStruct((g, *ks.scales), jnp.dtype(ks.scale_dtype)), ks.qtype, ks.group,
                       zeros=jax.ShapeDtypeStruct((g, *ks.scales), jnp.int8) if ks.zeros else None,
                       gscale=jax.ShapeDtypeStruct((g,), jnp.float32) if ks.qtype == "nvfp4" else None,
                       perm=jax.ShapeDtypeStruct((g, k), jnp.int32) if ks.perm else None, act=act,
                       act_gscale=jax.ShapeDtypeStruct((g,), jnp.float32) if act == "nvfp4" else None,
                       rot=jax.ShapeDtypeStruct((g, rot[0], rot[0]), jnp.int8) if rot else None)

    slots = skeleton(cfg, lane_widths(cfg, qc))
    if mtp:
        from quantkit.runtime.models.qwen3_5 import mtp_slots

        slots["draft"] = mtp_slots(cfg, lane_widths(cfg, qc))
    return jax.tree_util.tree_map(leaf, slots, is_leaf=lambda x: isinstance(x, Slot))


@dataclass
class LoadedModel:
    """A model ready to run: its config, its weight pytree (on device) and the HBM the weights take;
    kv_scales: the checkpoint's KV cache scales (kv_cache_scheme), per kind [layers, 2 (k, v), kv_heads];
    mesh, ep, dp: the mesh the weights were placed on (runtime/sharding.py), whether experts are split whole
    (expert parallelism) and whether the mesh is data parallel; None, False, False on one device."""

    path: Path
    cfg: ModelConfig
    params: dict
    dtype: jnp.dtype
    kv_scales: dict | None = None
    mesh: object = None
    ep: bool = False
    dp: bool = False

    @property
    def weight_bytes(self) -> int:
        return sum(x.nbytes if not isinstance(x, QTensor) else x.nbytes()
                   for x in jax.tree_util.tree_leaves(self.params, is_leaf=lambda a: isinstance(a, QTensor)))


class _Reader:
    """Reads one Slot's data from the checkpoint onto the host (numpy): dense [in, out] in the checkpoint's
    dtype (a view of the file where no padding or stacking copies it), or a QTensor of numpy arrays."""

    def __init__(self, ckpt: Checkpoint, qc: QuantConfig | None):
        self.ckpt, self.qc = ckpt, qc
        self.modules = group_modules(ckpt.tensors)
        self.transforms = stored_transforms(qc, ckpt.tensors) if qc is not None and qc.transforms else {}

    def params(self, module: str) -> dict[str, str]:
        found = self.modules.get(module)
        if found is None:
            raise InvalidInput(f"{self.ckpt.root}: module {module!r} is missing from the checkpoint")
        return found

    def array(self, module: str, param: str = "weight") -> np.ndarray:
        name = self.params(module).get(param)
        if name is None:
            raise InvalidInput(f"{self.ckpt.root}: tensor {module}.{param} is missing from the checkpoint")
        return np.asarray(self.ckpt.read(name))  # as stored (bf16 stays a view of the file); cast on device

    def _layout(self, module: str):
        pnames = self.params(module)
        scheme = self.qc.scheme_for(module, "Linear") if self.qc is not None else None
        if scheme is None or scheme.weights is None or scheme.format == "dense":
            return None
        arrays = {p: np.asarray(self.ckpt.read(n)) for p, n in pnames.items()}
        shape = logical_shape({p: a.shape for p, a in arrays.items()}, arrays.get("weight_shape"), scheme.format)
        layout = kernel_layout(scheme, arrays, shape, module)
        for t in self.qc.input_transforms(module, "Linear"):  # one at most (validate)
            matrix, perm = self.transforms[(t.group, t.location, transform_size(t, shape[1]))]
            layout = layout._replace(rot=input_rotation(t, self.ckpt.read(matrix), None if perm is None else
                                                        self.ckpt.read(perm), matrix))
        if layout.scales.dtype == np.float16:
            layout = layout._replace(scales=layout.scales.astype(np.float32))
        return layout

    def linear(self, module: str, shape: tuple[int, int]):
        """A Linear's weight, zero-padded to `shape` [in, out]: a QTensor [1, in, out] on the host if quantized, else dense."""
        layout = self._layout(module)
        if layout is None:
            return _pad(self.array(module).T, shape)
        return _padded_qtensor([layout], shape)

    def experts(self, modules: list[str], packed: tuple[str, int, int] | None, shape: tuple[int, int, int]):
        """Stacked expert weights, a host QTensor or dense [experts, in, out], zero-padded to `shape`; from `packed`,
        the 3-D tensor [experts, chunks * out, in] of a bf16 checkpoint without per-expert modules, when
        those are absent."""
        if packed is not None and modules[0] not in self.modules:
            module, chunk, chunks = packed
            t = np.asarray(self.ckpt.read(self.params(module)["tensor"]))
            m = t.shape[1] // chunks
            return _pad(t[:, chunk * m:(chunk + 1) * m].transpose(0, 2, 1), shape)
        layouts = [self._layout(m) for m in modules]
        if all(la is None for la in layouts):
            return np.stack([self.linear(m, shape[1:]) for m in modules])
        if any(la is None for la in layouts) or len({(la.qtype, la.group, la.zeros is None, la.scales.dtype,
                                                      la.perm is None, la.act, la.rot is None)
                                                     for la in layouts}) != 1:
            raise Unsupported(f"experts {modules[0]}..: mixed quantization across experts is not supported")
        return _padded_qtensor(layouts, shape[1:])

    def slot(self, s: Slot):
        """One Slot's host data (not a stack)."""
        if s.kind == "linear":
            return self.linear(s.module, s.shape)
        if s.kind == "experts":
            return self.experts(list(s.module), s.packed, s.shape)
        if s.kind == "router":
            return self.array(s.module).T  # [hidden, experts]
        if s.kind == "conv":  # [K, channels]: channels on the lanes (as stored, [channels, 1, K], a TPU pads
            return self.array(s.module)[:, 0, :].T  # each channel's K taps to 128)
        if s.kind == "experts_bias":
            return _pad(np.stack([self.array(m, "bias") for m in s.module]), s.shape)
        return self.array(s.module, {"tensor": "tensor", "bias": "bias"}.get(s.kind, "weight"))


def _pad(w: np.ndarray, shape: tuple[int, ...], value=0) -> np.ndarray:
    """w [..., k, n] padded at the end of its last two dims to shape's last two with `value`."""
    if tuple(w.shape[-2:]) == tuple(shape[-2:]):
        return w
    if w.shape[-2] > shape[-2] or w.shape[-1] > shape[-1]:
        raise InvalidInput(f"a weight [in, out] = {list(w.shape[-2:])} is larger than config.json describes "
                           f"({list(shape[-2:])})")
    return np.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, shape[-2] - w.shape[-2]), (0, shape[-1] - w.shape[-1])],
                  constant_values=value)


def _padded_qtensor(layouts: list, shape: tuple[int, int]) -> QTensor:
    """The g KernelLayouts (formats/ct_tensors.py) of one weight or of g experts stacked into a host QTensor
    [g, *shape], zero-padded (lane_widths): zero values and zero points add nothing whatever their scale;
    the new scales are 1 (E8M0 127). A channel scale and zero point span the padded rows too: their inputs
    are the zero outputs of the padded columns of the layer before."""
    first, (k, n) = layouts[0], shape
    group = k if first.group == first.values.shape[0] else first.group
    one = 127 if first.scales.dtype == np.uint8 else 1
    values = _pad(np.stack([la.values for la in layouts]), shape)
    scales = _pad(np.stack([la.scales for la in layouts]), (k // group, n), one)
    zeros = None if first.zeros is None else _pad(np.stack([la.zeros for la in layouts]), (k // group, n))
    gscale = None if first.gscale is None else np.array([la.gscale for la in layouts], np.float32)
    act_gscale = None if first.act_gscale is None else np.array([la.act_gscale for la in layouts], np.float32)
    rot = None if first.rot is None else np.stack([la.rot for la in layouts])
    if rot is not None and k % rot.shape[-1]:
        raise Unsupported(f"an online input transform of size {rot.shape[-1]} over {k} padded inputs: the padding "
                          "would break its blocks (use a transform head_dim that divides the padded width)")
    perm = None  # padded rows (zero values) keep their place
    if first.perm is not None:
        perm = np.stack([np.concatenate([la.perm, np.arange(len(la.perm), k, dtype=np.int32)]) for la in layouts])
    check_qtensor(values.shape, scales.shape, first.qtype, group, None if zeros is None else zeros.shape,
                  None if gscale is None else gscale.shape, None if perm is None else perm.shape)
    return QTensor(values, scales, first.qtype, group, zeros=zeros, gscale=gscale, perm=perm, act=first.act,
                   act_gscale=act_gscale, rot=rot)


@partial(jax.jit, donate_argnums=0)
def _write(buf: jax.Array, piece: jax.Array, at) -> jax.Array:
    """buf with rows [at, at + len(piece)) replaced by piece (cast to buf's dtype), in place."""
    return jax.lax.dynamic_update_slice_in_dim(buf, piece.astype(buf.dtype), at, 0)


def _assemble(read, n: int, outs: list, rows) -> list[jax.Array]:
    """Global arrays placed on their shardings, filled from n host parts read one at a time.

    read(i) -> a host array per output (part i: [r, ...] rows of each); outs: (shape, dtype, sharding) per
    output; rows(i, r) -> the global rows [r] that part i's rows go to. Each of this process's devices gets
    an empty buffer of its shard, then each part's pieces in place: no device and no host buffer ever holds
    more than its shard plus one part."""
    bufs = []  # per output: device -> [buffer, (first, last + 1) of its leading-axis slice, other slices]
    for shape, dtype, sharding in outs:
        # np.zeros is calloc: untouched pages cost no host memory (jnp.zeros made a shard-sized temporary)
        bufs.append({d: [jax.device_put(np.zeros(sharding.shard_shape(shape), dtype), d),
                         index[0].indices(shape[0])[:2], index[1:]]
                     for d, index in sharding.addressable_devices_indices_map(shape).items()})
    for i in range(n):
        parts = read(i)
        for part, per_device in zip(parts, bufs):
            dst = rows(i, part.shape[0])  # [r] global rows, in runs of consecutive rows
            breaks = np.flatnonzero(np.diff(dst) != 1) + 1
            for run in np.split(np.arange(len(dst)), breaks):
                g0, g1 = dst[run[0]], dst[run[-1]] + 1
                for d, entry in per_device.items():
                    _, (a, b), rest = entry
                    lo, hi = max(g0, a), min(g1, b)
                    if lo < hi:
                        piece = part[run[0] + lo - g0:run[0] + hi - g0][(slice(None), *rest)]
                        entry[0] = _write(entry[0], jax.device_put(piece, d), lo - a)
        # the writes run asynchronously: wait, or the host runs ahead holding every part's pieces
        jax.block_until_ready([e[0] for per_device in bufs for e in per_device.values()])
        del parts
    return [jax.make_array_from_single_device_arrays(shape, sharding, [e[0] for e in per_device.values()])
            for (shape, _, sharding), per_device in zip(outs, bufs)]


def load(path: str | Path, dtype=jnp.bfloat16, check: bool = True, mesh=None, ep: bool = False,
         mtp: bool = False, dp: bool = False) -> LoadedModel:
    """Loads a dense or compressed-tensors checkpoint that `quantkit inspect` accepts, each tensor read from
    its safetensors file and placed straight onto the devices that hold its parts.

    Args:
        path: checkpoint directory.
        dtype: activation and dense-weight dtype (bf16; float32 for parity tests).
        check: validate first, as `quantkit inspect` does (errors and unsupported layers stop the load).
        mesh: place the weights tensor-parallel on this mesh (runtime/sharding.py); None: on one device.
        ep: with `mesh`, split MoE experts whole over the mesh (expert parallelism).
        dp: with `mesh`, data parallel: every weight but split experts replicated on every device.
        mtp: also load Qwen3.5's MTP layer (`mtp.*`) as params["draft"] (speculative method `mtp`).
    """
    path = Path(path)
    checked = validate_checkpoint(Checkpoint.open(path))
    if check:
        checked.raise_first(path)
    if checked.ckpt.config is None:
        raise InvalidInput(f"{path}: no config.json")
    if checked.cfg is None:  # an architecture the runtime refuses, or a config.json it cannot read
        checked.raise_first(path)
    ckpt, cfg, qc = checked.ckpt, checked.cfg, checked.qc
    r = _Reader(ckpt, qc)
    tp = 1 if mesh is None else mesh.shape[AXIS]
    if mesh is not None and cfg.num_heads % tp and not dp:
        raise InvalidInput(f"{cfg.num_heads} attention heads do not split over {tp} devices")
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def leaf(key: str, s: Slot, kind: str = "full"):
        entries = s.module if s.kind == "stack" else (s,)
        n = len(entries)
        first = r.slot(entries[0])
        quantized = isinstance(first, QTensor)
        if not quantized:
            shape = (n, *first.shape) if s.kind == "stack" else first.shape
            wdtype = jnp.float32 if entries[0].kind in ("norm", "router", "tensor", "conv") else dtype
            sh, split = (one, "") if mesh is None else shardings(key, cfg, mesh, shape, kind, ep, dp=dp)
            outs = [(shape, wdtype, sh)]
        else:
            g = first.values.shape[0]
            shape = (n * g, *first.values.shape[1:])
            (vs, ss), split = ((one, one), "") if mesh is None else \
                shardings(key, cfg, mesh, shape, kind, ep, first.scales.shape[1], dp)
            where = first.per_array(vs, ss, one if mesh is None else group_sharding(mesh, split))
            outs = [((n * g, *a.shape[1:]), STORAGE[first.qtype] if f == "values" else a.dtype, where[f])
                    for f, a in first.arrays.items()]
        cache = {0: first}

        def read(i):
            h = cache.pop(i) if i in cache else r.slot(entries[i])
            if quantized:
                if (h.qtype, h.group, *((f, a.dtype) for f, a in h.arrays.items())) != \
                        (first.qtype, first.group, *((f, a.dtype) for f, a in first.arrays.items())):
                    raise Unsupported(f"{entries[0].module}..: layers quantized differently are not supported")
                return tuple(h.arrays.values())
            return (h[None] if s.kind == "stack" else h,)

        # expert parallel: layer-major rows go where sharding.expert_rows puts them
        order = np.argsort(expert_rows(n, g, tp)) if quantized and split == "e" else None

        def rows(i, count):  # part i's rows: layer i's, at i * count (a stack) or 0 (one tensor)
            start = i * count if s.kind == "stack" else 0
            return np.arange(start, start + count) if order is None else order[start:start + count]

        placed = _assemble(read, n, outs, rows)
        if quantized:
            return first.with_arrays(dict(zip(first.arrays, placed)), mesh=mesh, split=split)
        return placed[0]

    widths = lane_widths(cfg, qc)
    sk = skeleton(cfg, widths)
    params = {k: leaf(k, s) for k, s in sk.items() if k != "layers"}
    params["layers"] = {kind: {key: leaf(key, s, kind) for key, s in stack.items()}
                        for kind, stack in sk["layers"].items()}
    if mtp:
        from quantkit.runtime.models.qwen3_5 import mtp_slots

        if cfg.family != "qwen3_5" or "mtp.fc" not in r.modules:
            raise Unsupported(f"{path}: method 'mtp' needs a Qwen3.5 checkpoint with its MTP layer (mtp.*)")
        if mesh is not None:
            raise InvalidInput("draft heads (eagle3, mtp) run on one device; serve the target with --tp 1")
        d = mtp_slots(cfg, widths)
        params["draft"] = {k: leaf(k, s) for k, s in d.items() if k != "layer"} | {
            "layer": {key: leaf(key, s) for key, s in d["layer"].items()}}
    params = place_row_major(params)  # the layout the Runner compiles for (sharding.row_major)
    kv_scales = None
    if qc is not None and qc.kv_cache_scheme is not None:
        per_layer = [np.stack([kv_head_scales(ckpt.read(name), cfg.kv_shape(kind)[0], name)
                               for n in KV_SCALES for name in [f"{cfg.prefix}layers.{i}.self_attn.{n}"]])
                     if kind != "linear" else None for i, kind in enumerate(cfg.layer_kinds)]
        kv_scales = {kind: np.stack([s for s, k in zip(per_layer, cfg.layer_kinds) if k == kind])
                     for kind in cfg.paged_kinds}
    return LoadedModel(path, cfg, params, jnp.dtype(dtype), kv_scales, mesh, ep and mesh is not None,
                       dp and mesh is not None)


def random_weights(shapes: dict) -> dict:
    """Device arrays for the weight tree `shapes` (ShapeDtypeStructs; QTensors of them), made by one jitted
    program (leaf by leaf, every eager op compiles anew: ~150 s for a Llama-3-8B shape): integer values over
    their type's range, other values and dense weights N(0, 0.02), scales 1/400, norms 1; a stacked array
    repeats its first slice (fp8 and e2m1 codes come out of the same integers' bits: valid codes)."""

    def fill(s, kind, key):
        one = s.shape[1:] if len(s.shape) == 3 else s.shape
        if kind == "values" and jnp.issubdtype(s.dtype, jnp.integer):
            lo, hi = (-8, 8) if s.dtype == jnp.int4 else (-128, 128)
            x = jax.random.randint(key, one, lo, hi, jnp.int32).astype(s.dtype)
        elif kind == "scales":
            x = jnp.full(one, 1 / 400, s.dtype)
        elif kind == "norm":
            x = jnp.ones(one, s.dtype)
        else:
            x = (jax.random.normal(key, one, jnp.float32) * 0.02).astype(s.dtype)
        return jnp.broadcast_to(x, s.shape)

    def make():
        leaves, tree = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, QTensor))
        keys = iter(jax.random.split(jax.random.key(0), len(leaves) * 8))

        def leaf(path, s):
            if isinstance(s, QTensor):
                return s.with_arrays({f: fill(a, f if f in ("values", "scales") else "other", next(keys))
                                      for f, a in s.arrays.items()})
            return fill(s, "norm" if "norm" in jax.tree_util.keystr(path) else "other", next(keys))

        return jax.tree_util.tree_unflatten(tree, [leaf(p, s) for p, s in leaves])

    return jax.jit(make)()


def dummy(path: str | Path, dtype=jnp.bfloat16) -> LoadedModel:
    """vLLM's `--load-format dummy`: the model PATH's config.json describes, its weights random (`random_weights`)
    in the types its quantization_config gives them, on one device; no safetensors file is read. For
    measuring published shapes without their weights (benchmarks/serve_load.py on the TPU)."""
    path = Path(path)
    where = path / "config.json"
    if not where.is_file():
        raise InvalidInput(f"{path}: no config.json (--load-format dummy needs the model's config.json)")
    raw = read_json(where)
    qraw, qc = quantization_config_of(raw, str(where))
    refused = [message for severity, message in config_findings(qraw, qc) if severity == "unsupported"]
    if refused:
        raise Unsupported(f"{where}: {refused[0]}")
    cfg = from_hf(raw)
    return LoadedModel(path, cfg, place_row_major(random_weights(abstract(cfg, qc, dtype))), jnp.dtype(dtype))


def densify(params: dict, dtype) -> dict:
    """The weight pytree with every QTensor dequantized once into a dense `dtype` array of the layout its
    slot has when unquantized (stacked linears [layers, in, out], experts [layers, experts, in, out],
    lm_head [in, out]). Off TPU this is what serves fastest: the XLA path would otherwise dequantize each
    weight on every call (runtime/step.py `Runner.weights`)."""
    def dense(key, w, layers=None):
        if not isinstance(w, QTensor) or w.act or w.rot is not None:  # the quantized matmul quantizes or rotates the rows
            return w
        d = jax.jit(QTensor.dequantize)(w).astype(dtype)  # [G, k, n]
        if w.perm is not None:  # activation order: rows back to input-feature order
            d = jnp.take_along_axis(d, jnp.argsort(w.perm, axis=1)[..., None], axis=1)
        if layers is None:
            return d[0]
        if w.split == "e":  # device-major rows (sharding.expert_rows) back to layer-major
            d = d[np.argsort(expert_rows(layers, d.shape[0] // layers, w.mesh.shape[AXIS]))]
        return d if d.shape[0] == layers else d.reshape(layers, -1, *d.shape[1:])

    out = {k: dense(k, v) for k, v in params.items() if k not in ("layers", "draft")}
    out["layers"] = {kind: {k: dense(k, v, stack["attn_norm"].shape[0]) for k, v in stack.items()}
                     for kind, stack in params["layers"].items()}
    if "draft" in params:  # a draft head's weights (an MTP layer: its own, then a stack of one layer)
        d = params["draft"]
        out["draft"] = {k: dense(k, v) for k, v in d.items() if k != "layer"}
        if "layer" in d:
            out["draft"]["layer"] = {k: dense(k, v, 1) for k, v in d["layer"].items()}
    return out
