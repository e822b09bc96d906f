"""Checkpoint -> weight pytree on device. Quantized weights are unpacked once into QTensors (int4 stays
int4); dense weights become bf16 [in, out] arrays; nothing is ever dequantized.

Name mapping is an explicit table per family (ARCHITECTURE.md rule 8): every pytree leaf names exactly
one checkpoint module, and a missing module is an error naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from quantkit.errors import InvalidInput, Unsupported
from quantkit.formats.compressed_tensors import (KV_SCALES, QuantConfig, kernel_layout, kernel_shapes, kv_head_scales,
                                                 logical_shape, parse_quantization_config, weight_qtype)
from quantkit.formats.hf import PACKED_EXPERTS, Checkpoint, group_modules
from quantkit.kernels.tiling import LANES, round_up
from quantkit.quant.qtensor import STORAGE, QTensor, check_qtensor
from quantkit.runtime.config import ModelConfig, from_hf
from quantkit.runtime.sharding import AXIS, expert_rows, place_row_major, shardings
from quantkit.validate import validate_checkpoint

LINEARS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj"}
MLP = {"gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
NORMS = {  # family -> pytree key -> module under model.layers.{i}
    "llama": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "qwen3": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
              "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
    "gemma3": {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
               "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
               "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
}
NORMS["qwen3_moe"], NORMS["gemma4"], NORMS["qwen3_5"] = NORMS["qwen3"], NORMS["gemma3"], NORMS["qwen3"]
GDN = {"in_qkv": "linear_attn.in_proj_qkv", "in_z": "linear_attn.in_proj_z", "in_b": "linear_attn.in_proj_b",
       "in_a": "linear_attn.in_proj_a", "out": "linear_attn.out_proj"}  # Qwen3.5's Gated DeltaNet Linears
SHARED = {"shared_gate": "mlp.shared_expert.gate_proj", "shared_up": "mlp.shared_expert.up_proj",
          "shared_down": "mlp.shared_expert.down_proj"}
GEMMA4_MOE_NORMS = {"post_mlp_norm_1": "post_feedforward_layernorm_1", "pre_mlp_norm_2": "pre_feedforward_layernorm_2",
                    "post_mlp_norm_2": "post_feedforward_layernorm_2"}


@dataclass(frozen=True)
class Slot:
    """One leaf of the weight pytree: its kind, checkpoint module(s) and logical shape.

    kinds: "linear" [in, out] (QTensor [1, in, out] when quantized), "experts" [experts, in, out] (modules: one
    per expert), "embed" [vocab, hidden], "bias" [out], "norm" [d] (float32), "router" [hidden, experts]
    (float32), "tensor" (a bare parameter, float32: Gemma 4's layer_scalar, router scales, Qwen3.5's A_log),
    "conv" (a module's weight as stored, float32: Qwen3.5's conv1d [channels, 1, K]) and "stack": the
    same leaf of every layer of a kind (module: their Slots), stacked along a new leading axis (QTensors
    along their group axis: [layers * groups, in, out]).
    packed (experts only): where a bf16 checkpoint keeps all experts in one 3-D tensor instead (Gemma 4:
    `experts.gate_up_proj` [experts, 2 * inter, hidden]): (tensor module, chunk, chunks along axis 1).
    """

    kind: str
    module: str | tuple[str, ...]
    shape: tuple[int, ...]
    packed: tuple[str, int, int] | None = None


def _experts(pre: str, e: int, h: int, m: int, packed: bool) -> dict:
    """(gate, up, down) expert Slots: per-expert Linears `{pre}{x}.gate_proj` (llm-compressor's and quantkit
    convert's layout), or with `packed` a bf16 checkpoint's 3-D tensors (formats/hf.py PACKED_EXPERTS)."""
    out = {}
    for key, shape in (("gate", (h, m)), ("up", (h, m)), ("down", (m, h))):
        proj = f"{key}_proj"
        src = next((pre + t, parts.index(proj), len(parts)) for t, parts in PACKED_EXPERTS.items() if proj in parts)
        out[key] = Slot("experts", tuple(f"{pre}{x}.{proj}" for x in range(e)), (e, *shape), src if packed else None)
    return out


def skeleton(cfg: ModelConfig, widths: tuple[int, int] = (0, 0)) -> dict:
    """The weight pytree of `cfg` with a Slot at every leaf: what `load` fills and `abstract` describes;
    `widths`: the (dense MLP, experts) intermediate widths (0: as configured; see `lane_widths`)."""
    h, e, m = cfg.hidden_size, cfg.num_experts, widths[1] or cfg.moe_intermediate_size
    layers = []
    for i, kind in enumerate(cfg.layer_kinds):
        if cfg.family == "qwen3_5":
            layers.append(_qwen3_5_layer(cfg, f"{cfg.prefix}layers.{i}.", kind, widths[0] or cfg.intermediate_size, m))
            continue
        kvh, hd = cfg.kv_shape(kind)
        inter = widths[0] or cfg.intermediate_size
        dims = {"q": (h, cfg.num_heads * hd), "k": (h, kvh * hd), "v": (h, kvh * hd), "o": (cfg.num_heads * hd, h),
                "gate": (h, inter), "up": (h, inter), "down": (inter, h)}
        pre = f"{cfg.prefix}layers.{i}."
        linears = {k: v for k, v in LINEARS.items() if not (k == "v" and cfg.k_eq_v and kind == "full")}
        layer = {key: Slot("linear", pre + mod, dims[key]) for key, mod in linears.items()}
        if cfg.attention_bias:
            layer |= {f"{key}_bias": Slot("bias", pre + mod, dims[key][1:])
                      for key, mod in linears.items() if key != "o"}
        norms = NORMS[cfg.family] | (GEMMA4_MOE_NORMS if cfg.moe_dense else {})
        layer |= {key: Slot("norm", pre + mod, (hd,) if key in ("q_norm", "k_norm") else (h,))
                  for key, mod in norms.items()}
        if cfg.family == "qwen3_moe":
            layer["router"] = Slot("router", pre + "mlp.gate", (h, e))
            layer |= _experts(pre + "mlp.experts.", e, h, m, False)
        else:
            layer |= {key: Slot("linear", pre + mod, dims[key]) for key, mod in MLP.items()}
        if cfg.family == "gemma4":
            layer["layer_scalar"] = Slot("tensor", pre + "layer_scalar", (1,))
        if cfg.moe_dense:
            layer |= {"router": Slot("router", pre + "router.proj", (h, e)),
                      "router_scale": Slot("tensor", pre + "router.scale", (h,)),
                      "expert_scale": Slot("tensor", pre + "router.per_expert_scale", (e,))}
            layer |= {f"experts_{k}": v for k, v in _experts(pre + "experts.", e, h, m, True).items()}
        layers.append(layer)
    stacks = {kind: {key: Slot("stack", tuple(layers[i][key] for i in ids), (len(ids), *layers[ids[0]][key].shape))
                     for key in layers[ids[0]]}
              for kind in cfg.kinds for ids in [[i for i, k in enumerate(cfg.layer_kinds) if k == kind]]}
    params = {"embed": Slot("embed", cfg.prefix + "embed_tokens", (cfg.vocab_size, h)), "layers": stacks,
              "final_norm": Slot("norm", cfg.prefix + "norm", (h,))}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = Slot("linear", "lm_head", (h, cfg.vocab_size))
    return params


def _qwen3_5_layer(cfg: ModelConfig, pre: str, kind: str, inter: int, m: int) -> dict:
    """One Qwen3.5 layer's Slots: a Gated DeltaNet ("linear") or gated attention layer, then a SwiGLU MLP or
    routed experts (per-expert Linears, or a bf16 checkpoint's packed 3-D tensors) with a shared expert."""
    h, e = cfg.hidden_size, cfg.num_experts
    layer = {"attn_norm": Slot("norm", pre + "input_layernorm", (h,)),
             "mlp_norm": Slot("norm", pre + "post_attention_layernorm", (h,))}
    if kind == "linear":
        conv, _ = cfg.gdn_dims
        hv, dv = cfg.linear_v_heads, cfg.linear_v_dim
        dims = {"in_qkv": (h, conv), "in_z": (h, hv * dv), "in_b": (h, hv), "in_a": (h, hv), "out": (hv * dv, h)}
        layer |= {key: Slot("linear", pre + mod, dims[key]) for key, mod in GDN.items()}
        layer |= {"conv": Slot("conv", pre + "linear_attn.conv1d", (conv, 1, cfg.conv_kernel)),
                  "A_log": Slot("tensor", pre + "linear_attn.A_log", (hv,)),
                  "dt_bias": Slot("tensor", pre + "linear_attn.dt_bias", (hv,)),
                  "gdn_norm": Slot("norm", pre + "linear_attn.norm", (dv,))}
    else:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        dims = {"q": (h, 2 * q), "k": (h, kv), "v": (h, kv), "o": (q, h)}
        layer |= {key: Slot("linear", pre + mod, dims[key]) for key, mod in LINEARS.items()}
        layer |= {key: Slot("norm", pre + f"self_attn.{key}", (cfg.head_dim,)) for key in ("q_norm", "k_norm")}
    if not e:
        return layer | {key: Slot("linear", pre + mod, d) for (key, mod), d in
                        zip(MLP.items(), ((h, inter), (h, inter), (inter, h)))}
    s = cfg.shared_intermediate_size
    layer |= {f"experts_{k}": v for k, v in _experts(pre + "mlp.experts.", e, h, m, True).items()}
    layer |= {key: Slot("linear", pre + mod, d) for (key, mod), d in zip(SHARED.items(), ((h, s), (h, s), (s, h)))}
    return layer | {"router": Slot("router", pre + "mlp.gate", (h, e)),
                    "shared_expert_gate": Slot("router", pre + "mlp.shared_expert_gate", (h, 1))}


def lane_widths(cfg: ModelConfig, qc: QuantConfig | None) -> tuple[int, int]:
    """(dense MLP, experts) intermediate widths on device: each rounded up to 128 lanes, since gmm_v2 serves
    only [k, n] in multiples of 128 and anything else falls back to dequantizing the weight in HBM every
    step (Gemma-4-26B-A4B: MLP 2112 -> 2176, experts 704 -> 768; unpadded, its compiled decode step read
    16x the weights). The padding is zero weights: act(0) * 0 = 0 into zero rows of down_proj, so every
    output is exactly unchanged. Not padded where the down projection's scale groups do not tile the
    padded width."""
    stack = skeleton(cfg)["layers"][cfg.layer_kinds[0]]

    def width(m: int, key: str) -> int:
        padded = round_up(m, LANES)
        if padded == m or key not in stack:
            return m
        down = stack[key].module[0]  # layer 0's Slot
        scheme = qc.scheme_for(down.module[0] if down.kind == "experts" else down.module, "Linear") if qc else None
        if weight_qtype(scheme) == "dense":
            return padded
        return padded if padded % kernel_shapes(scheme, (cfg.hidden_size, padded))[3] == 0 else m

    if cfg.family == "qwen3_moe":  # its MLP is the experts
        return 0, width(cfg.moe_intermediate_size, "down")
    return width(cfg.intermediate_size, "down"), width(cfg.moe_intermediate_size, "experts_down")


def abstract(cfg: ModelConfig, qc: QuantConfig | None, dtype=jnp.bfloat16) -> dict:
    """The weight pytree of `cfg` quantized as `qc` says, as jax.ShapeDtypeStruct leaves (no data): the
    argument `plan` compiles with. Scales are assumed bfloat16 (what `quantkit convert` writes)."""
    def leaf(s: Slot):
        if s.kind == "stack":
            one = leaf(s.module[0])
            n = len(s.module)
            if isinstance(one, QTensor):
                return QTensor(*(jax.ShapeDtypeStruct((n * a.shape[0], *a.shape[1:]), a.dtype)
                                 for a in (one.values, one.scales)), one.qtype, one.group)
            return jax.ShapeDtypeStruct((n, *one.shape), one.dtype)
        scheme = qc.scheme_for(s.module[0] if s.kind == "experts" else s.module, "Linear") if qc else None
        quantized = s.kind in ("linear", "experts") and weight_qtype(scheme) != "dense"
        if not quantized:
            return jax.ShapeDtypeStruct(s.shape, jnp.float32 if s.kind in ("norm", "router", "tensor", "conv") else dtype)
        *g, k, n = s.shape
        scales, sdtype, qtype, group = kernel_shapes(scheme, (n, k))
        g = g[0] if g else 1
        return QTensor(jax.ShapeDtypeStruct((g, k, n), STORAGE[qtype]),
                       jax.ShapeDtypeStruct((g, *scales), jnp.dtype(sdtype)), qtype, group)

    return jax.tree_util.tree_map(leaf, skeleton(cfg, lane_widths(cfg, qc)),
                                  is_leaf=lambda x: isinstance(x, Slot))


@dataclass
class LoadedModel:
    """A model ready to run: its config, its weight pytree (on device) and the HBM the weights take;
    kv_scales: the checkpoint's KV cache scales (kv_cache_scheme), per kind [layers, 2 (k, v), kv_heads];
    mesh, ep: the mesh the weights were placed on (runtime/sharding.py) and whether experts are split whole
    (expert parallelism); None, False on one device."""

    path: Path
    cfg: ModelConfig
    params: dict
    dtype: jnp.dtype
    kv_scales: dict | None = None
    mesh: object = None
    ep: bool = False

    @property
    def weight_bytes(self) -> int:
        return sum(x.nbytes if not isinstance(x, QTensor) else x.nbytes()
                   for x in jax.tree_util.tree_leaves(self.params, is_leaf=lambda a: isinstance(a, QTensor)))


@dataclass(frozen=True)
class HostQ:
    """A quantized weight read on the host, before placement: values [g, k, n] (codes), scales
    [g, k // group, n] (QTensor's invariants)."""

    values: np.ndarray
    scales: np.ndarray
    qtype: str
    group: int


class _Reader:
    """Reads one Slot's data from the checkpoint onto the host (numpy): dense [in, out] in the checkpoint's
    dtype (a view of the file where no padding or stacking copies it), or HostQ."""

    def __init__(self, ckpt: Checkpoint, qc: QuantConfig | None):
        self.ckpt, self.qc = ckpt, qc
        self.modules = group_modules(ckpt.tensors)

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
        shape = logical_shape({p: a.shape for p, a in arrays.items()}, arrays.get("weight_shape"))
        values, scales, qtype, group = kernel_layout(scheme, arrays, shape)
        if scales.dtype == np.float16:
            scales = scales.astype(np.float32)
        return values, scales, qtype, group

    def linear(self, module: str, shape: tuple[int, int]):
        """A Linear's weight, zero-padded to `shape` [in, out]: HostQ [1, in, out] if quantized, else dense."""
        layout = self._layout(module)
        if layout is None:
            return _pad(self.array(module).T, shape)
        values, scales, qtype, group = layout
        return _padded_qtensor(values[None], scales[None], qtype, group, shape)

    def experts(self, modules: list[str], packed: tuple[str, int, int] | None, shape: tuple[int, int, int]):
        """Stacked expert weights, HostQ or dense [experts, in, out], zero-padded to `shape`; from `packed`,
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
        if any(la is None for la in layouts) or len({(la[2], la[3]) for la in layouts}) != 1:
            raise Unsupported(f"experts {modules[0]}..: mixed quantization across experts is not supported")
        return _padded_qtensor(np.stack([la[0] for la in layouts]), np.stack([la[1] for la in layouts]),
                               *layouts[0][2:], shape[1:])

    def slot(self, s: Slot):
        """One Slot's host data (not a stack)."""
        if s.kind == "linear":
            return self.linear(s.module, s.shape)
        if s.kind == "experts":
            return self.experts(list(s.module), s.packed, s.shape)
        if s.kind == "router":
            return self.array(s.module).T  # [hidden, experts]
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


def _padded_qtensor(values, scales, qtype: str, group: int, shape: tuple[int, int]) -> HostQ:
    """values [g, k, n] and scales [g, k // group, n] zero-padded to [g, *shape] (lane_widths): zero values
    (whatever their scale) add nothing; the new scales are 1 (E8M0 127)."""
    k, n = shape
    group = k if group == values.shape[1] else group  # channel scales span the padded rows too
    one = 127 if scales.dtype == np.uint8 else 1
    values, scales = _pad(values, shape), _pad(scales, (k // group, n), one)
    check_qtensor(values.shape, scales.shape, qtype, group)
    return HostQ(values, scales, qtype, group)


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


def load(path: str | Path, dtype=jnp.bfloat16, check: bool = True, mesh=None, ep: bool = False) -> LoadedModel:
    """Loads a dense or compressed-tensors checkpoint that `quantkit inspect` accepts, each tensor read from
    its safetensors file and placed straight onto the devices that hold its parts.

    Args:
        path: checkpoint directory.
        dtype: activation and dense-weight dtype (bf16; float32 for parity tests).
        check: validate first, as `quantkit inspect` does (errors and unsupported layers stop the load).
        mesh: place the weights tensor-parallel on this mesh (runtime/sharding.py); None: on one device.
        ep: with `mesh`, split MoE experts whole over the mesh (expert parallelism).
    """
    path = Path(path)
    ckpt = Checkpoint.open(path)
    if check:
        problems = validate_checkpoint(ckpt).all_problems()
        for severity, exc in (("error", InvalidInput), ("unsupported", Unsupported)):
            probs = [p for p in problems if p["severity"] == severity]
            if probs:
                more = f" (and {len(probs) - 1} more; see `quantkit inspect`)" if len(probs) > 1 else ""
                raise exc(f"{path}: {probs[0]['where']}: {probs[0]['message']}{more}")
    if ckpt.config is None:
        raise InvalidInput(f"{path}: no config.json")
    eos = ()
    gen = path / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        eos = tuple(e if isinstance(e, list) else [e] if e is not None else [])
    cfg = from_hf(ckpt.config, eos)
    raw = ckpt.config.get("quantization_config")
    qc = parse_quantization_config(raw) if isinstance(raw, dict) else None
    r = _Reader(ckpt, qc)
    tp = 1 if mesh is None else mesh.shape[AXIS]
    if mesh is not None and cfg.num_heads % tp:
        raise InvalidInput(f"{cfg.num_heads} attention heads do not split over {tp} devices")
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def leaf(key: str, s: Slot, kind: str = "full"):
        entries = s.module if s.kind == "stack" else (s,)
        n = len(entries)
        first = r.slot(entries[0])
        quantized = isinstance(first, HostQ)
        if not quantized:
            shape = (n, *first.shape) if s.kind == "stack" else first.shape
            wdtype = jnp.float32 if entries[0].kind in ("norm", "router", "tensor", "conv") else dtype
            sh, split = (one, "") if mesh is None else shardings(key, cfg, mesh, shape, kind, ep)
            outs = [(shape, wdtype, sh)]
        else:
            g = first.values.shape[0]
            shape = (n * g, *first.values.shape[1:])
            scales = (n * g, *first.scales.shape[1:])
            (vs, ss), split = ((one, one), "") if mesh is None else \
                shardings(key, cfg, mesh, shape, kind, ep, first.scales.shape[1])
            outs = [(shape, STORAGE[first.qtype], vs), (scales, first.scales.dtype, ss)]
        cache = {0: first}

        def read(i):
            h = cache.pop(i) if i in cache else r.slot(entries[i])
            if quantized:
                if (h.qtype, h.group, h.scales.dtype) != (first.qtype, first.group, first.scales.dtype):
                    raise Unsupported(f"{entries[0].module}..: layers quantized differently are not supported")
                return h.values, h.scales
            return (h[None] if s.kind == "stack" else h,)

        # expert parallel: layer-major rows go where sharding.expert_rows puts them
        order = np.argsort(expert_rows(n, g, tp)) if quantized and split == "e" else None

        def rows(i, count):  # part i's rows: layer i's, at i * count (a stack) or 0 (one tensor)
            start = i * count if s.kind == "stack" else 0
            return np.arange(start, start + count) if order is None else order[start:start + count]

        placed = _assemble(read, n, outs, rows)
        if quantized:
            return QTensor(*placed, first.qtype, first.group, mesh, split)
        return placed[0]

    sk = skeleton(cfg, lane_widths(cfg, qc))
    params = {k: leaf(k, s) for k, s in sk.items() if k != "layers"}
    params["layers"] = {kind: {key: leaf(key, s, kind) for key, s in stack.items()}
                        for kind, stack in sk["layers"].items()}
    params = place_row_major(params)  # the layout the Runner compiles for (sharding.row_major)
    kv_scales = None
    if qc is not None and qc.kv_cache_scheme is not None:
        per_layer = [np.stack([kv_head_scales(ckpt.read(name), cfg.kv_shape(kind)[0], name)
                               for n in KV_SCALES for name in [f"{cfg.prefix}layers.{i}.self_attn.{n}"]])
                     if kind != "linear" else None for i, kind in enumerate(cfg.layer_kinds)]
        kv_scales = {kind: np.stack([s for s, k in zip(per_layer, cfg.layer_kinds) if k == kind])
                     for kind in cfg.paged_kinds}
    return LoadedModel(path, cfg, params, jnp.dtype(dtype), kv_scales, mesh, ep and mesh is not None)


def densify(params: dict, dtype) -> dict:
    """The weight pytree with every QTensor dequantized once into a dense `dtype` array of the layout its
    slot has when unquantized (stacked linears [layers, in, out], experts [layers, experts, in, out],
    lm_head [in, out]). Off TPU this is what serves fastest: the XLA path would otherwise dequantize each
    weight on every call (runtime/step.py `Runner.weights`)."""
    from quantkit.kernels.xla import dequantize

    def dense(key, w, layers=None):
        if not isinstance(w, QTensor):
            return w
        d = jax.jit(dequantize)(w).astype(dtype)  # [G, k, n]
        if layers is None:
            return d[0]
        if w.split == "e":  # device-major rows (sharding.expert_rows) back to layer-major
            d = d[np.argsort(expert_rows(layers, d.shape[0] // layers, w.mesh.shape[AXIS]))]
        return d if d.shape[0] == layers else d.reshape(layers, -1, *d.shape[1:])

    out = {k: dense(k, v) for k, v in params.items() if k != "layers"}
    out["layers"] = {kind: {k: dense(k, v, stack["attn_norm"].shape[0]) for k, v in stack.items()}
                     for kind, stack in params["layers"].items()}
    return out
