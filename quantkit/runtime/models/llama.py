"""Llama 3.x, Mistral, Qwen2 and Qwen3 (q/k norms): pre-norm decoder, SwiGLU MLP, RoPE, GQA."""

from __future__ import annotations

import jax

from quantkit.runtime.config import ModelConfig
from quantkit.runtime.models.common import attention_block, linear, logits, rms_norm


def mlp(p: dict, x: jax.Array) -> jax.Array:
    return linear(jax.nn.silu(linear(x, p["gate"])) * linear(x, p["up"]), p["down"])


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, cache: list,
            block_tables: tuple, last: jax.Array | None = None, ffn=mlp) -> tuple[jax.Array, list]:
    """Logits [b, t, vocab] (float32) for tokens [b, t] at positions [b, t] (-1: padding), and the
    updated cache (one (key pages, value pages) pair per layer). With `last` [b], logits [b, 1, vocab]
    of that position of each row only."""
    x = params["embed"][tokens]
    new_cache = []
    for i, p in enumerate(params["layers"]):
        a, kv = attention_block(p, rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), cache[i], positions,
                                block_tables, cfg, i)
        x = x + a
        x = x + ffn(p, rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps))
        new_cache.append(kv)
    return logits(params, rms_norm(x, params["final_norm"], cfg.rms_norm_eps), cfg, last), new_cache
