"""Gemma 3 (text): local sliding-window and global layers, (1 + w) RMSNorms before and after each block,
q/k norms, embeddings scaled by sqrt(hidden), GeGLU (tanh) MLP, tied embeddings."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from quantkit.runtime.config import ModelConfig
from quantkit.runtime.models.common import attention_block, linear, logits, rms_norm


def forward(params: dict, cfg: ModelConfig, tokens, positions, cache, block_tables, last=None):
    """As llama.forward, for Gemma 3's decoder."""
    eps = cfg.rms_norm_eps
    x = params["embed"][tokens]
    x = x * jnp.asarray(cfg.embed_scale, x.dtype)  # the scale is rounded to the activation dtype, as in HF
    new_cache = []
    for i, p in enumerate(params["layers"]):
        a, kv = attention_block(p, rms_norm(x, p["attn_norm"], eps, 1.0), cache[i], positions, block_tables,
                                cfg, i, norm_offset=1.0)
        x = x + rms_norm(a, p["post_attn_norm"], eps, 1.0)
        h = rms_norm(x, p["mlp_norm"], eps, 1.0)
        m = linear(jax.nn.gelu(linear(h, p["gate"]), approximate=True) * linear(h, p["up"]), p["down"])
        x = x + rms_norm(m, p["post_mlp_norm"], eps, 1.0)
        new_cache.append(kv)
    return logits(params, rms_norm(x, params["final_norm"], eps, 1.0), cfg, last), new_cache
