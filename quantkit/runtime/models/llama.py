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
    from quantkit.runtime.models.common import gated, linear

    return linear(gated(x, p["gate"], p["up"], "silu"), p["down"])


def forward(params: dict, cfg: ModelConfig, tokens, kv: dict, batch: dict, ffn=swiglu):
    """Final hidden states [T, hidden] of the step's flattened tokens [T] (runtime/step.py's batch), and
    the updated cache (per kind, stacked pages); with batch["aux_layers"] (EAGLE-3) a third output, the
    hidden states entering those layers side by side [T, len * hidden]."""
    import jax.numpy as jnp

    from quantkit.runtime.models.common import attention_block, layer_params, rms_norm, run_layers

    eps = cfg.rms_norm_eps
    ids = batch.get("aux_layers", ())  # EAGLE-3: the hidden states entering these layers (models/eagle3.py)

    def body(kind, i, carry):
        x, kv, aux = carry
        aux = tuple(jnp.where(i == j, x, a) for j, a in zip(ids, aux))
        p = layer_params(params["layers"][kind], i)
        a, kv_kind = attention_block(p, rms_norm(x, p["attn_norm"], eps), kv[kind], i, batch, cfg, kind)
        x = x + a
        x = x + ffn(p, rms_norm(x, p["mlp_norm"], eps), cfg, batch)
        return x, {**kv, kind: kv_kind}, aux

    x0 = params["embed"][tokens]
    x, kv, aux = run_layers(body, cfg.layer_kinds, (x0, kv, (x0,) * len(ids)), batch.get("unroll", False))
    out = rms_norm(x, params["final_norm"], eps)
    return (out, kv, jnp.concatenate(aux, axis=-1)) if ids else (out, kv)


LLAMA = Family("llama", ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"), configure, layer, forward)
QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), lambda hf, common, rope: {"qk_norm": True}, layer, forward)
