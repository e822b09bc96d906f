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
}


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

    @property
    def scale(self) -> float:
        return self.query_scale or 1.0 / math.sqrt(self.head_dim)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window) and bool(self.sliding_layers) and self.sliding_layers[layer]

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Per layer, its kind: "sliding" (sliding-window attention) or "full". Layers of one kind share
        their weight shapes and KV cache; each kind's weights are stacked and scanned (models/common.py)."""
        return tuple("sliding" if self.is_sliding(i) else "full" for i in range(self.num_layers))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds present, in a fixed order."""
        return tuple(k for k in ("full", "sliding") if k in self.layer_kinds)


def _rope(d: dict, where: str) -> tuple[float, tuple | None]:
    """(theta, scaling) from one rope description (rope_parameters or rope_theta + rope_scaling)."""
    kind = d.get("rope_type", d.get("type", "default"))
    theta = float(d.get("rope_theta", 10000.0))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, (d["factor"], d["low_freq_factor"], d["high_freq_factor"], d["original_max_position_embeddings"])
    if kind == "linear":
        return theta, (d["factor"],)
    raise Unsupported(f"{where}: rope type {kind!r} is not supported (default, linear, llama3 are)")


def from_hf(cfg: dict, eos: tuple[int, ...] = ()) -> ModelConfig:
    """Builds the ModelConfig of a Hugging Face config.json; refuses unknown architectures by name."""
    arch = (cfg.get("architectures") or [None])[0]
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise Unsupported(f"architecture {arch!r} is not supported by the runtime; supported: "
                          f"{', '.join(ARCHITECTURES)}")
    if family == "gemma3" and "text_config" in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "full_attention" in rp:  # per layer type (transformers 5, Gemma 3)
        glob, local = rp["full_attention"], rp.get("sliding_attention", {})
    elif isinstance(rp, dict):
        glob, local = rp, {}
    else:
        glob = {"rope_theta": cfg.get("rope_theta", 10000.0), **(cfg.get("rope_scaling") or {})}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    theta, rope_scaling = _rope(glob, arch)
    local_theta, local_scaling = _rope({"rope_theta": 10000.0, **local}, arch)
    if local_scaling is not None:
        raise Unsupported(f"{arch}: scaled rope on sliding-window layers is not supported")
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
        rope_scaling=rope_scaling, qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"), eos_token_ids=eos,
    )
    if family == "qwen3_moe":
        common.update(num_experts=cfg.get("num_experts") or cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                      moe_intermediate_size=cfg["moe_intermediate_size"],
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise Unsupported("Qwen3-MoE with dense (mlp_only) layers is not supported yet")
    if family == "gemma3":
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
    return ModelConfig(**common)
