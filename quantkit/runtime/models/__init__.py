"""The model families, found by architecture name: each module here defines a `runtime.family.Family` (its
config fields, weight slots and forward), and FAMILIES lists them. Adding a family is one new module and its
line below. Importing this package imports no jax (the forwards import it when a step is traced)."""

from __future__ import annotations

from quantkit.errors import Unsupported
from quantkit.runtime.config import ModelConfig, rope
from quantkit.runtime.family import Family
from quantkit.runtime.models.gemma import GEMMA3, GEMMA4
from quantkit.runtime.models.gpt_oss import GPT_OSS
from quantkit.runtime.models.llama import LLAMA, QWEN3
from quantkit.runtime.models.qwen3_5 import QWEN3_5
from quantkit.runtime.models.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN3, QWEN3_MOE, GEMMA3, GEMMA4, QWEN3_5, GPT_OSS)}
ARCHITECTURES: dict[str, Family] = {a: f for f in FAMILIES.values() for a in f.architectures}
MULTIMODAL_PREFIX = "model.language_model."  # where a *ForConditionalGeneration checkpoint keeps the decoder


def family_of(cfg: ModelConfig) -> Family:
    return FAMILIES[cfg.family]


def forward_for(family: str):
    """The forward function of a family."""
    return FAMILIES[family].forward


def from_hf(cfg: dict, eos: tuple[int, ...] = ()) -> ModelConfig:
    """Builds the ModelConfig of a Hugging Face config.json: the fields every decoder has here, then its
    family's (`Family.configure`); refuses unknown architectures by name."""
    arch = (cfg.get("architectures") or [None])[0]
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise Unsupported(f"architecture {arch!r} is not supported by the runtime; supported: "
                          f"{', '.join(ARCHITECTURES)}")
    if "text_config" in cfg:  # a multimodal config: the decoder's fields are in text_config (the top
        # level's end-of-sequence ids, e.g. Gemma 4's end-of-turn 106, are the ones generation uses)
        text = cfg["text_config"]
        cfg = {**cfg, **text, "eos_token_id": cfg.get("eos_token_id", text.get("eos_token_id"))}
    cfg = cfg | {k: v for k, v in family.defaults.items() if not cfg.get(k) and cfg.get(k) is not False}
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
    theta, rope_scaling = rope(glob, arch)
    local_theta, local_scaling = rope({"rope_theta": 10000.0, **local}, arch)
    if local_scaling is not None or local.get("partial_rotary_factor", 1.0) != 1.0:
        raise Unsupported(f"{arch}: scaled or partial rope on sliding-window layers is not supported")
    eos_cfg = cfg.get("eos_token_id")
    eos = eos or tuple(eos_cfg if isinstance(eos_cfg, list) else [eos_cfg] if eos_cfg is not None else [])
    common = dict(
        family=family.name, vocab_size=cfg["vocab_size"], hidden_size=hidden, num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or hidden // heads, intermediate_size=cfg.get("intermediate_size", 0),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096), rope_theta=theta,
        rope_local_theta=local_theta, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)), rope_scaling=rope_scaling, eos_token_ids=eos,
        prefix=MULTIMODAL_PREFIX if arch.endswith("ForConditionalGeneration") else "model.",
    )
    return ModelConfig(**(common | family.configure(cfg, common, glob)))
