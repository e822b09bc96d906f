"""Llama 3.x, Mistral, Qwen2 and Qwen3 (q/k norms): pre-norm decoder, SwiGLU MLP, RoPE, GQA."""

from __future__ import annotations

from quantkit.runtime.config import ModelConfig
from quantkit.runtime.family import PRE_POST_NORMS, QK_NORMS, Family, attention, mlp, norms


def configure(hf: dict, common: dict, rope: dict) -> dict:
    """Qwen2 has attention biases unless its config says otherwise."""
    return {"attention_bias": bool(hf.get("attention_bias", hf["architectures"][0] == "Qwen2ForCausalLM"))}


def layer(cfg: ModelConfig, pre: str, kind: str, widths: tuple[int, int]) -> dict:
    table = PRE_POST_NORMS | (QK_NORMS if cfg.qk_norm else {})
    return (attention(cfg, pre, kind) | norms(pre, table, cfg.hidden_size, cfg.head_dim)
            | mlp(pre, cfg.hidden_size, widths[0] or cfg.intermediate_size))


def swiglu(p: dict, x, cfg: ModelConfig, batch: dict):
    import jax

    from quantkit.runtime.models.common import linear

    return linear(jax.nn.silu(linear(x, p["gate"])) * linear(x, p["up"]), p["down"])


def forward(params: dict, cfg: ModelConfig, tokens, kv: dict, batch: dict, ffn=swiglu):
    """Final hidden states [T, hidden] of the step's flattened tokens [T] (runtime/step.py's batch), and
    the updated cache (per kind, stacked pages)."""
    from quantkit.runtime.models.common import attention_block, layer_params, rms_norm, run_layers

    eps = cfg.rms_norm_eps

    def body(kind, i, carry):
        x, kv = carry
        p = layer_params(params["layers"][kind], i)
        a, kv_kind = attention_block(p, rms_norm(x, p["attn_norm"], eps), kv[kind], i, batch, cfg, kind)
        x = x + a
        x = x + ffn(p, rms_norm(x, p["mlp_norm"], eps), cfg, batch)
        return x, {**kv, kind: kv_kind}

    x, kv = run_layers(body, cfg.layer_kinds, (params["embed"][tokens], kv), batch.get("unroll", False))
    return rms_norm(x, params["final_norm"], eps), kv


LLAMA = Family("llama", ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"), configure, layer, forward)
QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), lambda hf, common, rope: {"qk_norm": True}, layer, forward)
