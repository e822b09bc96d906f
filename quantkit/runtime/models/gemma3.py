"""Gemma 3 (text): local sliding-window and global layers, (1 + w) RMSNorms before and after each block,
q/k norms, embeddings scaled by sqrt(hidden), GeGLU (tanh) MLP, tied embeddings."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from quantkit.runtime.config import ModelConfig
from quantkit.runtime.models.common import attention_block, layer_params, linear, rms_norm, run_layers


def forward(params: dict, cfg: ModelConfig, tokens, kv: dict, batch: dict):
    """As llama.forward, for Gemma 3's decoder."""
    eps = cfg.rms_norm_eps
    x = params["embed"][tokens]
    x = x * jnp.asarray(cfg.embed_scale, x.dtype)  # the scale is rounded to the activation dtype, as in HF

    def layer(kind, i, carry):
        x, kv = carry
        p = layer_params(params["layers"][kind], i)
        a, kv_kind = attention_block(p, rms_norm(x, p["attn_norm"], eps, 1.0), kv[kind], i, batch, cfg, kind,
                                     norm_offset=1.0)
        x = x + rms_norm(a, p["post_attn_norm"], eps, 1.0)
        h = rms_norm(x, p["mlp_norm"], eps, 1.0)
        m = linear(jax.nn.gelu(linear(h, p["gate"]), approximate=True) * linear(h, p["up"]), p["down"])
        return x + rms_norm(m, p["post_mlp_norm"], eps, 1.0), {**kv, kind: kv_kind}

    x, kv = run_layers(layer, cfg.layer_kinds, (x, kv), batch.get("unroll", False))
    return rms_norm(x, params["final_norm"], eps, 1.0), kv
