"""Llama 3.x, Mistral, Qwen2 and Qwen3 (q/k norms): pre-norm decoder, SwiGLU MLP, RoPE, GQA."""

from __future__ import annotations

import jax

from quantkit.runtime.config import ModelConfig
from quantkit.runtime.models.common import attention_block, layer_params, linear, rms_norm, run_layers


def mlp(p: dict, x: jax.Array, cfg: ModelConfig, batch: dict) -> jax.Array:
    return linear(jax.nn.silu(linear(x, p["gate"])) * linear(x, p["up"]), p["down"])


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, kv: dict, batch: dict, ffn=mlp
            ) -> tuple[jax.Array, dict]:
    """Final hidden states [T, hidden] of the step's flattened tokens [T] (runtime/step.py's batch), and
    the updated cache (per kind, stacked pages)."""
    eps = cfg.rms_norm_eps

    def layer(kind, i, carry):
        x, kv = carry
        p = layer_params(params["layers"][kind], i)
        a, kv_kind = attention_block(p, rms_norm(x, p["attn_norm"], eps), kv[kind], i, batch, cfg, kind)
        x = x + a
        x = x + ffn(p, rms_norm(x, p["mlp_norm"], eps), cfg, batch)
        return x, {**kv, kind: kv_kind}

    x, kv = run_layers(layer, cfg.layer_kinds, (params["embed"][tokens], kv), batch.get("unroll", False))
    return rms_norm(x, params["final_norm"], eps), kv
