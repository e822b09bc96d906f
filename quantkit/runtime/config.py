"""Model configuration: one frozen dataclass built from config.json (ARCHITECTURE.md rule 4)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantkit.errors import Unsupported

ARCHITECTURES = {  # config.json "architectures"[0] -> family
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",  # the text decoder under model.language_model.
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
}
PREFIX = {a: "model.language_model." for a in ARCHITECTURES if a.endswith("ForConditionalGeneration")}  # where
# the decoder's modules live in a multimodal checkpoint


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
    rope_scaling: tuple | None = None  # llama3: (factor, low, high, original max); linear: (factor,)
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


def _rope(d: dict, where: str) -> tuple[float, tuple | None]:
    """(theta, scaling) from one rope description (rope_parameters or rope_theta + rope_scaling)."""
    kind = d.get("rope_type", d.get("type", "default"))
    theta = float(d.get("rope_theta", 10000.0))
    if kind == "default" or kind == "proportional" and d.get("factor", 1.0) == 1.0:  # partial: see from_hf
        return theta, None
    if kind == "llama3":
        return theta, (d["factor"], d["low_freq_factor"], d["high_freq_factor"], d["original_max_position_embeddings"])
    if kind == "linear":
        return theta, (d["factor"],)
    raise Unsupported(f"{where}: rope type {kind!r} is not supported (default, linear, llama3, unscaled "
                      "proportional are)")


def from_hf(cfg: dict, eos: tuple[int, ...] = ()) -> ModelConfig:
    """Builds the ModelConfig of a Hugging Face config.json; refuses unknown architectures by name."""
    arch = (cfg.get("architectures") or [None])[0]
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise Unsupported(f"architecture {arch!r} is not supported by the runtime; supported: "
                          f"{', '.join(ARCHITECTURES)}")
    if "text_config" in cfg:  # a multimodal config: the decoder's fields are in text_config (the top
        # level's end-of-sequence ids, e.g. Gemma 4's end-of-turn 106, are the ones generation uses)
        text = cfg["text_config"]
        cfg = {**cfg, **text, "eos_token_id": cfg.get("eos_token_id", text.get("eos_token_id"))}
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    rp = cfg.get("rope_parameters")
    if family == "gemma4" and not rp:  # transformers' defaults
        rp = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
              "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
    if isinstance(rp, dict) and "full_attention" in rp:  # per layer type (transformers 5, Gemma 3)
        glob, local = rp["full_attention"], rp.get("sliding_attention", {})
    elif isinstance(rp, dict):
        glob, local = rp, {}
    else:
        glob = {"rope_theta": cfg.get("rope_theta", 10000.0), **(cfg.get("rope_scaling") or {})}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    theta, rope_scaling = _rope(glob, arch)
    local_theta, local_scaling = _rope({"rope_theta": 10000.0, **local}, arch)
    if local_scaling is not None or local.get("partial_rotary_factor", 1.0) != 1.0:
        raise Unsupported(f"{arch}: scaled or partial rope on sliding-window layers is not supported")
    eos_cfg = cfg.get("eos_token_id")
    eos = eos or tuple(eos_cfg if isinstance(eos_cfg, list) else [eos_cfg] if eos_cfg is not None else [])
    common = dict(
        family=family, vocab_size=cfg["vocab_size"], hidden_size=hidden, num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or hidden // heads, intermediate_size=cfg.get("intermediate_size", 0),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096), rope_theta=theta,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma3")),
        attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
        rope_scaling=rope_scaling, qk_norm=family in ("qwen3", "qwen3_moe", "gemma3", "gemma4", "qwen3_5"),
        eos_token_ids=eos,
        prefix=PREFIX.get(arch, "model."),
    )
    if family == "qwen3_moe":
        common.update(num_experts=cfg.get("num_experts") or cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                      moe_intermediate_size=cfg["moe_intermediate_size"],
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise Unsupported("Qwen3-MoE with dense (mlp_only) layers is not supported yet")
    if family in ("gemma3", "gemma4"):
        types = cfg.get("layer_types")
        if types:
            sliding = tuple(t == "sliding_attention" for t in types)
        else:
            pattern = cfg.get("sliding_window_pattern", 6)
            sliding = tuple((i + 1) % pattern != 0 for i in range(cfg["num_hidden_layers"]))
        common.update(sliding_window=cfg.get("sliding_window"), sliding_layers=sliding, rope_local_theta=local_theta,
                      query_scale=cfg.get("query_pre_attn_scalar", common["head_dim"]) ** -0.5,
                      embed_scale=math.sqrt(hidden), final_logit_softcap=cfg.get("final_logit_softcapping"))
        if cfg.get("attn_logit_softcapping"):
            raise Unsupported("attention logit soft-capping (Gemma 2) is not supported")
    if family == "gemma3":
        common.update(norm_offset=1.0)
    if family == "gemma4":
        common.update(_gemma4(cfg, common, glob))
    if family == "qwen3_5":
        common.update(_qwen3_5(cfg, common, glob))
    return ModelConfig(**common)


def _qwen3_5(cfg: dict, common: dict, rope: dict) -> dict:
    """Qwen3.5 and Qwen3.5-MoE (transformers models/qwen3_5, qwen3_5_moe): layer_types name the Gated
    DeltaNet ("linear_attention") layers; zero-centred (1 + w) norms; the MTP head is not used."""
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0
                                       else "linear_attention" for i in range(common["num_layers"])]
    if set(types) - {"full_attention", "linear_attention"}:
        raise Unsupported(f"Qwen3.5 layer types {sorted(set(types))} are not supported")
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("attention_bias"):
        raise Unsupported("Qwen3.5 with a hidden_act other than silu or attention biases is not supported")
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    out = dict(linear_layers=tuple(t == "linear_attention" for t in types), norm_offset=1.0, attn_gate=True,
               rope_dims=int(common["head_dim"] * partial), linear_k_heads=cfg.get("linear_num_key_heads", 16),
               linear_v_heads=cfg.get("linear_num_value_heads", 32), linear_k_dim=cfg.get("linear_key_head_dim", 128),
               linear_v_dim=cfg.get("linear_value_head_dim", 128), conv_kernel=cfg.get("linear_conv_kernel_dim", 4))
    if out["linear_v_heads"] % out["linear_k_heads"]:
        raise Unsupported("Qwen3.5 with value heads that are not a multiple of the key heads is not supported")
    if cfg.get("num_experts"):
        out.update(num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                   moe_intermediate_size=cfg["moe_intermediate_size"], norm_topk_prob=True,
                   shared_intermediate_size=cfg.get("shared_expert_intermediate_size", 0))
    return out


def _gemma4(cfg: dict, common: dict, full_rope: dict) -> dict:
    """Gemma 4's fields (transformers models/gemma4): what differs from Gemma 3, and what is refused."""
    refuse = [(cfg.get("hidden_size_per_layer_input"), "per-layer input embeddings (Gemma 4 E2B/E4B)"),
              (cfg.get("num_kv_shared_layers"), "KV sharing across layers (Gemma 4 E2B/E4B)"),
              (cfg.get("use_bidirectional_attention") == "all", "bidirectional attention"),
              (cfg.get("attention_bias"), "attention biases"),
              (cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
               f"hidden_activation {cfg.get('hidden_activation')!r}")]
    for bad, what in refuse:
        if bad:
            raise Unsupported(f"Gemma 4 with {what} is not supported (the 31B dense and 26B-A4B MoE models are)")
    # full layers' geometry: the published config's global_* fields, or transformers' per_layer_config
    override = [v for k, v in (cfg.get("per_layer_config") or {}).items()
                if isinstance(v, dict) and common["sliding_layers"] and not common["sliding_layers"][int(k)]]
    if any(o != override[0] for o in override):
        raise Unsupported("Gemma 4 full-attention layers of different shapes are not supported")
    over = override[0] if override else {}
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    kv_heads = over.get("num_key_value_heads", cfg.get("num_global_key_value_heads") if k_eq_v else None)
    out = dict(query_scale=1.0, norm_offset=0.0, v_norm=True, k_eq_v=k_eq_v,
               full_head_dim=over.get("head_dim", cfg.get("global_head_dim", 512)), full_kv_heads=kv_heads or 0,
               rope_partial=float(full_rope.get("partial_rotary_factor", 1.0))
               if full_rope.get("rope_type") == "proportional" else 1.0)
    if cfg.get("enable_moe_block"):
        out.update(num_experts=cfg["num_experts"], top_k=cfg["top_k_experts"],
                   moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["expert_intermediate_size"],
                   moe_dense=True)
    return out
