"""Model configuration: one frozen dataclass built from config.json by `runtime.models.from_hf` (docs/architecture.md,
rule 4); each family's module fills its own fields."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Callable

from quantkit.errors import InvalidInput, Unsupported

# serve's defaults, which plan, the Runner and the cache layout share: the tokens a KV page holds, and the
# most tokens one step runs (--max-num-batched-tokens: the largest token bucket)
PAGE_SIZE, MAX_NUM_BATCHED_TOKENS = 16, 512


@dataclass(frozen=True)
class ModelConfig:
    """What the model functions need. Fields follow Hugging Face names where they exist."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    # llama3: (factor, low, high, original max); linear: (factor,); YaRN: ("yarn", factor, beta_fast, beta_slow,
    # original max, truncate, attention factor)
    rope_scaling: tuple | None = None
    qk_norm: bool = False  # Qwen3, Gemma 3
    # MoE (Qwen3-MoE)
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Gemma 3
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()  # per layer: local sliding-window attention
    rope_local_theta: float = 10000.0
    query_scale: float = 0.0  # 0: 1/sqrt(head_dim)
    embed_scale: float = 1.0
    final_logit_softcap: float | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 4: full layers have their own head size and KV head count, and with k_eq_v no v_proj (V is the
    # k_proj output); "proportional" RoPE on their first rope_partial of the dims; V RMS-normed without a
    # weight; norms scale by w (norm_offset 0); each layer's output times its layer_scalar; MoE layers run
    # the dense MLP beside the routed experts (moe_dense)
    full_head_dim: int = 0  # 0: head_dim
    full_kv_heads: int = 0  # 0: num_kv_heads
    k_eq_v: bool = False
    rope_partial: float = 1.0
    v_norm: bool = False
    norm_offset: float = 0.0
    moe_dense: bool = False
    prefix: str = "model."  # checkpoint name prefix of the decoder (embed_tokens, layers, norm)
    # Qwen3.5: Gated DeltaNet ("linear") layers beside gated full attention (q_proj doubled: [query | gate]
    # per head, output times sigmoid(gate)); RoPE on the first rope_dims of each head; a shared expert
    # (shared_intermediate_size) beside the routed ones, scaled by sigmoid(shared_expert_gate)
    linear_layers: tuple[bool, ...] = ()  # per layer: a Gated DeltaNet layer
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 0
    attn_gate: bool = False
    rope_dims: int = 0  # 0: the whole head (or rope_partial)
    shared_intermediate_size: int = 0
    # gpt-oss: sliding-window layers rotate as the full ones (YaRN); the experts' clamped SwiGLU
    # (gate <= limit, |up| <= limit, gate * sigmoid(alpha * gate) * (up + 1))
    rope_local_scaled: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0

    @property
    def scale(self) -> float:
        return self.query_scale or 1.0 / math.sqrt(self.head_dim)

    def kv_shape(self, kind: str) -> tuple[int, int]:
        """(KV heads, head size) of the attention layers of `kind`."""
        if kind == "full":
            return self.full_kv_heads or self.num_kv_heads, self.full_head_dim or self.head_dim
        return self.num_kv_heads, self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window) and bool(self.sliding_layers) and self.sliding_layers[layer]

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Per layer, its kind: "sliding" (sliding-window attention), "full" or "linear" (Gated DeltaNet).
        Layers of one kind share their weight shapes and cache; each kind's weights are stacked and scanned
        (models/common.py)."""
        return tuple("linear" if self.linear_layers and self.linear_layers[i] else
                     "sliding" if self.is_sliding(i) else "full" for i in range(self.num_layers))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds present, in a fixed order."""
        return tuple(k for k in ("full", "sliding", "linear") if k in self.layer_kinds)

    @property
    def paged_kinds(self) -> tuple[str, ...]:
        """The kinds with a paged KV cache (attention); "linear" layers keep a state per sequence instead."""
        return tuple(k for k in self.kinds if k != "linear")

    @property
    def gdn_dims(self) -> tuple[int, int]:
        """(conv channels: q, k and v, one Gated DeltaNet layer's recurrent state elements)."""
        conv = 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim
        return conv, self.linear_v_heads * self.linear_k_dim * self.linear_v_dim


# ---- config.json fields: each one a family reads, with its type and range, checked before use ----------------

@dataclass(frozen=True)
class Field:
    """What a config.json field must hold: `expected` says it in words, `ok` tests a value (not null: an absent
    or null field takes its default, unless `required`)."""

    expected: str
    ok: Callable[[object], bool]
    required: bool = False


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v) -> bool:
    return (isinstance(v, float) or _int(v)) and math.isfinite(v)


def count(most: int, least: int = 1) -> Field:
    """An integer in [least, most], by default positive (sizes: a bound keeps what is built per layer or
    expert finite)."""
    what = "a positive integer" if least == 1 else f"an integer from {least:,}"
    return Field(f"{what} up to {most:,}", lambda v: _int(v) and least <= v <= most)


def number(low: float = 0.0, high: float = math.inf, open_low: bool = True) -> Field:
    """A finite number in (low, high] (`open_low`) or [low, high]."""
    what = ("a positive number" if open_low else "a number >= 0") if low == 0 and high == math.inf else \
        f"a number in {'(' if open_low else '['}{low:g}, {high:g}]"
    return Field(what, lambda v: _finite(v) and (v > low if open_low else v >= low) and v <= high)


def required(f: Field) -> Field:
    return replace(f, required=True)


LAYERS, WIDTH, HEADS, EXPERTS = 1024, 1 << 20, 4096, 2048  # the most any published model has, many times over
SIZE = count(WIDTH)
POSITIVE = number()
FLAG = Field("true or false", lambda v: isinstance(v, bool))
TEXT = Field("a string", lambda v: isinstance(v, str))
OBJECT = Field("an object", lambda v: isinstance(v, dict))
CAP = number(0.0, open_low=False)  # a soft cap: null or 0 for none
INDEX = count(WIDTH, least=0)
TOKEN_IDS = Field("a token id or a list of them", lambda v: _int(v) and v >= 0 or isinstance(v, list) and all(
    _int(x) and x >= 0 for x in v))
LAYER_TYPES = Field("a list of strings, one per layer", lambda v: isinstance(v, list) and all(
    isinstance(x, str) for x in v))
FRACTION = number(0.0, 1.0)

# what every decoder's config.json is read for (runtime.models.from_hf)
COMMON = {"architectures": Field("a list of architecture names", lambda v: isinstance(v, list) and all(
              isinstance(x, str) for x in v)),
          "vocab_size": required(count(1 << 24)), "hidden_size": required(SIZE),
          "num_hidden_layers": required(count(LAYERS)), "num_attention_heads": required(count(HEADS)),
          "num_key_value_heads": count(HEADS), "head_dim": count(1 << 16), "intermediate_size": SIZE,
          "rms_norm_eps": number(high=1.0), "max_position_embeddings": count(1 << 30), "rope_theta": POSITIVE,
          "rope_local_base_freq": POSITIVE, "rope_scaling": OBJECT, "rope_parameters": OBJECT,
          "tie_word_embeddings": FLAG, "attention_bias": FLAG, "eos_token_id": TOKEN_IDS, "layer_types": LAYER_TYPES}
# one rope description (rope_scaling, rope_parameters or one of its per-layer-type entries)
ROPE = {"rope_type": TEXT, "type": TEXT, "rope_theta": POSITIVE, "factor": POSITIVE, "low_freq_factor": POSITIVE,
        "high_freq_factor": POSITIVE, "original_max_position_embeddings": count(1 << 30),
        "partial_rotary_factor": FRACTION, "beta_fast": POSITIVE, "beta_slow": POSITIVE, "attention_factor": POSITIVE,
        "mscale": POSITIVE, "mscale_all_dim": POSITIVE, "truncate": FLAG}


def check_fields(cfg: dict, fields: dict[str, Field], where: str = "config.json") -> None:
    """Raises InvalidInput, one line naming the field, what it holds and what it should, for the first field
    of `fields` whose value `cfg` holds wrongly: `config.json: num_hidden_layers is null; expected a positive
    integer up to 1,024`."""
    for name, f in fields.items():
        v = cfg.get(name)
        if v is None and not f.required:
            continue
        if v is None or not f.ok(v):
            raise InvalidInput(f"{where}: {name} is {'missing' if name not in cfg else _shown(v)}; expected {f.expected}")


def check_top_k(hf: dict, experts: str, top_k: str) -> None:
    """A MoE config's experts a token (field `top_k`) are at most its experts (field `experts`), both given."""
    check_fields(hf, {experts: required(count(EXPERTS)), top_k: required(count(EXPERTS))})
    if hf[top_k] > hf[experts]:
        raise InvalidInput(f"config.json: {top_k} is {hf[top_k]}, more than the {hf[experts]} experts ({experts})")


def check_layers(cfg: dict, where: str = "config.json") -> None:
    """layer_types, when given, names every layer (num_hidden_layers, checked before) once."""
    types, n = cfg.get("layer_types"), cfg["num_hidden_layers"]
    if types is not None and len(types) != n:
        raise InvalidInput(f"{where}: layer_types has {len(types)} entries for {n} layers (num_hidden_layers)")


def _shown(v) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def rope(d: dict, where: str) -> tuple[float, tuple | None]:
    """(theta, scaling) from one rope description (rope_parameters or rope_theta + rope_scaling), its fields
    checked (`where` names it)."""
    check_fields(d, ROPE, where)
    kind = d.get("rope_type") or d.get("type") or "default"
    for name in {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                 "linear": ("factor",), "yarn": ("original_max_position_embeddings",)}.get(kind, ()):
        check_fields(d, {name: required(ROPE[name])}, f"{where} ({kind})")
    theta = float(d.get("rope_theta") or 10000.0)
    if kind == "default" or kind == "proportional" and (d.get("factor") or 1.0) == 1.0:  # partial: the family's configure
        return theta, None
    if kind == "llama3":
        return theta, (d["factor"], d["low_freq_factor"], d["high_freq_factor"], d["original_max_position_embeddings"])
    if kind == "linear":
        return theta, (d["factor"],)
    if kind == "yarn" and d.get("factor") and d.get("partial_rotary_factor", 1.0) == 1.0:
        return theta, yarn(d)
    raise Unsupported(f"{where}: rope type {kind!r} is not supported (default, linear, llama3, yarn with a factor, "
                      "unscaled proportional are)")


def yarn(d: dict) -> tuple:
    """A YaRN rope description's constants (transformers' _compute_yarn_parameters): the factor, the beta_fast /
    beta_slow rotation bounds of the ramp between interpolated and original frequencies (defaults 32 / 1),
    the original context, whether the ramp's ends are rounded outwards (truncate, default true) and the
    factor cos and sin are scaled by: attention_factor, else 0.1 ln(factor) + 1 (with mscale / mscale_all_dim
    both set, their ratio of that form)."""
    factor = float(d["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    att = d.get("attention_factor")
    if att is None:
        att = mscale(d["mscale"]) / mscale(d["mscale_all_dim"]) if d.get("mscale") and d.get("mscale_all_dim") \
            else mscale()
    return ("yarn", factor, float(d.get("beta_fast") or 32), float(d.get("beta_slow") or 1),
            float(d["original_max_position_embeddings"]), bool(d.get("truncate", True)), float(att))
