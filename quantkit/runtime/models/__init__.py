"""The model families, found by architecture name: each module here defines a `runtime.family.Family` (its
config fields, weight slots and forward), and FAMILIES lists them. Adding a family is one new module and its
line below. Importing this package imports no jax (the forwards import it when a step is traced)."""

from __future__ import annotations

from quantkit.errors import InvalidInput, Unsupported
from quantkit.runtime.config import COMMON, OBJECT, ModelConfig, check_fields, check_layers, rope
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
    family's (`Family.configure`); refuses unknown architectures by name, and a field of the wrong type or
    range (config.COMMON, the family's `fields`) with one line naming it (InvalidInput)."""
    check_fields(cfg, {"architectures": COMMON["architectures"], "text_config": OBJECT})
    arch = (cfg.get("architectures") or [None])[0]
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise Unsupported(f"architecture {arch!r} is not supported by the runtime; supported: "
                          f"{', '.join(ARCHITECTURES)}")
    where = "config.json"
    if "text_config" in cfg:  # a multimodal config: the decoder's fields are in text_config (the top
        # level's end-of-sequence ids, e.g. Gemma 4's end-of-turn 106, are the ones generation uses)
        text, where = cfg["text_config"], "config.json: text_config"
        cfg = {**cfg, **text, "eos_token_id": cfg.get("eos_token_id", text.get("eos_token_id"))}
    cfg = cfg | {k: v for k, v in family.defaults.items() if not cfg.get(k) and cfg.get(k) is not False}
    check_fields(cfg, COMMON | family.fields, where)
    check_layers(cfg, where)
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise InvalidInput(f"{where}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                           f"({kv_heads})")
    if not cfg.get("head_dim") and hidden % heads:
        raise InvalidInput(f"{where}: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) "
                           "and no head_dim is given")
    rp = cfg.get("rope_parameters")
    if rp is not None and "full_attention" in rp:  # per layer type (transformers 5, Gemma 3)
        check_fields(rp, {"full_attention": OBJECT, "sliding_attention": OBJECT}, f"{where}: rope_parameters")
        glob, local, names = rp["full_attention"] or {}, rp.get("sliding_attention") or {}, (
            "rope_parameters.full_attention", "rope_parameters.sliding_attention")
    elif rp is not None:
        glob, local, names = rp, {}, ("rope_parameters", "rope_parameters")
    else:
        glob = {"rope_theta": cfg.get("rope_theta") or 10000.0, **(cfg.get("rope_scaling") or {})}
        local = {"rope_theta": cfg.get("rope_local_base_freq") or 10000.0}
        names = ("rope_scaling", "rope_local_base_freq")
    theta, rope_scaling = rope(glob, f"{where}: {names[0]}")
    local_theta, local_scaling = rope({"rope_theta": 10000.0, **local}, f"{where}: {names[1]}")
    if local_scaling is not None or local.get("partial_rotary_factor", 1.0) != 1.0:
        raise Unsupported(f"{arch}: scaled or partial rope on sliding-window layers is not supported")
    eos_cfg = cfg.get("eos_token_id")
    eos = eos or tuple(eos_cfg if isinstance(eos_cfg, list) else [eos_cfg] if eos_cfg is not None else [])
    common = dict(
        family=family.name, vocab_size=cfg["vocab_size"], hidden_size=hidden, num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=kv_heads, head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=cfg.get("intermediate_size") or 0, rms_norm_eps=cfg.get("rms_norm_eps") or 1e-6,
        max_position_embeddings=cfg.get("max_position_embeddings") or 4096, rope_theta=theta,
        rope_local_theta=local_theta, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)), rope_scaling=rope_scaling, eos_token_ids=eos,
        prefix=MULTIMODAL_PREFIX if arch.endswith("ForConditionalGeneration") else "model.",
    )
    return ModelConfig(**(common | family.configure(cfg, common, glob)))
