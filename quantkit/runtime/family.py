"""What a model family is to quantkit, and the weight slots families share. No jax: `inspect` reads a family's
config and slots on its header-only path.

A family is one module under runtime/models/ that defines a `Family`: the architectures it serves, its
ModelConfig fields from the Hugging Face config, the Slots of one layer (which checkpoint module fills which
pytree leaf, with its logical shape) and its forward function. runtime/models/__init__.py registers it.

Pytree keys are the same across families where the part is the same, so that sharding (runtime/sharding.py),
lane padding (runtime/layout.py) and plan read them without knowing the family: q, k, v, o (attention),
gate, up, down (the dense MLP), experts_gate, experts_up, experts_down (routed experts), router.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from quantkit.formats.hf import PACKED_EXPERTS
from quantkit.runtime.config import ModelConfig


@dataclass(frozen=True)
class Slot:
    """One leaf of the weight pytree: its kind, checkpoint module(s) and logical shape.

    kinds: "linear" [in, out] (QTensor [1, in, out] when quantized), "experts" [experts, in, out] (modules: one
    per expert), "embed" [vocab, hidden], "bias" [out], "norm" [d] (float32), "router" [hidden, experts]
    (float32), "experts_bias" [experts, out] (modules: one per expert, their biases; gpt-oss), "tensor" (a bare
    parameter, float32: Gemma 4's layer_scalar, router scales, Qwen3.5's A_log, gpt-oss's sinks),
    "conv" (Qwen3.5's conv1d, stored [channels, 1, K], as [K, channels], float32) and "stack": the
    same leaf of every layer of a kind (module: their Slots), stacked along a new leading axis (QTensors
    along their group axis: [layers * groups, in, out]).
    packed (experts only): where a bf16 checkpoint keeps all experts in one 3-D tensor instead (Gemma 4:
    `experts.gate_up_proj` [experts, 2 * inter, hidden]): (tensor module, chunk, chunks along axis 1).
    """

    kind: str
    module: str | tuple[str, ...]
    shape: tuple[int, ...]
    packed: tuple[str, int, int] | None = None


@dataclass(frozen=True)
class Family:
    """One model family (see the module docstring).

    configure(hf, common, rope) -> the family's ModelConfig fields (overriding `common`'s), from the decoder's
        config.json fields `hf` (a multimodal config's text_config merged in) and the full-attention layers'
        rope description; raises Unsupported for variants the runtime refuses.
    layer(cfg, pre, kind, widths) -> {pytree key: Slot} of one layer of `kind` whose modules are named
        `pre` + ... ("model.layers.3."); widths: the (dense MLP, experts) intermediate widths as served
        (runtime/layout.py lane_widths).
    forward(params, cfg, tokens, kv, batch) -> (hidden [T, hidden], kv): the decoder over one ragged step's
        flattened tokens (runtime/step.py). Family modules import jax inside it, never at the top.
    defaults: config.json fields assumed when absent (transformers' defaults for the family).
    fields: the config.json fields `configure` reads beyond config.COMMON, with their types and ranges
        (config.Field): from_hf checks them first, so that a wrong one is refused by name.
    packed_experts: a bf16 checkpoint keeps each layer's experts in 3-D tensors (formats/hf.py PACKED_EXPERTS),
        which `convert` splits into per-expert Linears.
    """

    name: str
    architectures: tuple[str, ...]
    configure: Callable[[dict, dict, dict], dict]
    layer: Callable[[ModelConfig, str, str, tuple[int, int]], dict]
    forward: Callable
    defaults: dict = field(default_factory=dict)
    packed_experts: bool = False
    fields: dict = field(default_factory=dict)


# ---- slots the families share -------------------------------------------------------------------------

ATTENTION = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj"}
MLP = {"gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
PRE_POST_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
QK_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


def attention(cfg: ModelConfig, pre: str, kind: str, q_width: int | None = None, v: bool = True) -> dict:
    """q, k, v, o Linears of a layer of `kind` (its KV heads and head size), with biases when the config has
    them; q_width: q's output width when it is not heads x head size (Qwen3.5's gated q); v=False: no v_proj
    (Gemma 4's K = V layers)."""
    h = cfg.hidden_size
    kvh, hd = cfg.kv_shape(kind)
    q = q_width or cfg.num_heads * hd
    dims = {"q": (h, q), "k": (h, kvh * hd), "v": (h, kvh * hd), "o": (cfg.num_heads * hd, h)}
    linears = {k: m for k, m in ATTENTION.items() if v or k != "v"}
    out = {key: Slot("linear", pre + mod, dims[key]) for key, mod in linears.items()}
    if cfg.attention_bias:
        out |= {f"{key}_bias": Slot("bias", pre + mod, dims[key][1:]) for key, mod in linears.items() if key != "o"}
    return out


def norms(pre: str, table: dict, width: int, head_dim: int = 0) -> dict:
    """RMSNorm Slots {key: module under `pre`}: q/k norms over a head (`head_dim`), the others over `width`."""
    return {key: Slot("norm", pre + mod, (head_dim,) if key in QK_NORMS else (width,)) for key, mod in table.items()}


def mlp(pre: str, h: int, inter: int, table: dict = MLP) -> dict:
    """gate, up, down Linears of a gated MLP [h -> inter -> h] (keys as `table` names them)."""
    gate, up, down = table
    dims = {gate: (h, inter), up: (h, inter), down: (inter, h)}
    return {key: Slot("linear", pre + mod, dims[key]) for key, mod in table.items()}


def experts(pre: str, e: int, h: int, m: int, packed: bool) -> dict:
    """experts_gate, experts_up, experts_down Slots of `e` experts [h -> m -> h]: per-expert Linears
    `{pre}{x}.gate_proj` (llm-compressor's and quantkit convert's layout), or with `packed` a bf16
    checkpoint's 3-D tensors (formats/hf.py PACKED_EXPERTS). The hidden side is served padded to a multiple
    of 128 lanes (gpt-oss: 2880 -> 2944), as the intermediate one is (runtime/layout.py lane_widths): zero
    rows and columns, the rows' activations padded with zeros (models/common.py routed_experts)."""
    from quantkit.kernels.tiling import LANES, round_up

    h = round_up(h, LANES)
    out = {}
    for key, shape in (("gate", (h, m)), ("up", (h, m)), ("down", (m, h))):
        proj = f"{key}_proj"
        src = next((pre + t, parts.index(proj), len(parts)) for t, parts in PACKED_EXPERTS.items() if proj in parts)
        out[f"experts_{key}"] = Slot("experts", tuple(f"{pre}{x}.{proj}" for x in range(e)), (e, *shape),
                                     src if packed else None)
    return out
