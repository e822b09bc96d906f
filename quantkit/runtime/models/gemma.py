"""Gemma 3 and Gemma 4 (text): sliding-window and full layers, RMSNorms before and after each block
(Gemma 3: scale 1 + w, Gemma 4: w), q/k norms, embeddings scaled by sqrt(hidden), GeGLU (tanh) MLP, tied
embeddings. Gemma 4 adds (runtime/config.py): per-kind attention shapes, k_eq_v, the weightless v norm, a
per-layer output scalar, and on MoE models a routed expert block beside each layer's dense MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from quantkit.runtime.config import ModelConfig
from quantkit.runtime.models.common import attention_block, layer_params, linear, rms_norm, routed_experts, run_layers


def moe(p: dict, x: jax.Array, cfg: ModelConfig, batch: dict) -> jax.Array:
    """Gemma 4's expert block on the residual x [T, hidden]: the router sees x RMS-normed without a weight,
    times its `router_scale` and 1/sqrt(hidden); softmax, top-k, renormalised, times each chosen expert's
    `expert_scale`; the experts (GeGLU) see x through pre_mlp_norm_2."""
    eps = cfg.rms_norm_eps
    r = rms_norm(x, None, eps).astype(jnp.float32) * p["router_scale"] * (cfg.hidden_size ** -0.5)
    probs = jax.nn.softmax(jnp.dot(r, p["router"]), axis=-1)  # [T, experts]
    weights, experts = jax.lax.top_k(probs, cfg.top_k)  # [T, k]
    weights = weights / weights.sum(-1, keepdims=True) * p["expert_scale"][experts]
    h = rms_norm(x, p["pre_mlp_norm_2"], eps)
    return routed_experts(h, weights, experts, (p["experts_gate"], p["experts_up"], p["experts_down"]),
                          cfg.num_experts, lambda g, u: jax.nn.gelu(g, approximate=True) * u, batch.get("ep_mesh"))


def forward(params: dict, cfg: ModelConfig, tokens, kv: dict, batch: dict):
    """As llama.forward, for the Gemma 3 / Gemma 4 decoder."""
    eps, off = cfg.rms_norm_eps, cfg.norm_offset
    x = params["embed"][tokens]
    x = x * jnp.asarray(cfg.embed_scale, x.dtype)  # the scale is rounded to the activation dtype, as in HF

    def layer(kind, i, carry):
        x, kv = carry
        p = layer_params(params["layers"][kind], i)
        a, kv_kind = attention_block(p, rms_norm(x, p["attn_norm"], eps, off), kv[kind], i, batch, cfg, kind)
        x = x + rms_norm(a, p["post_attn_norm"], eps, off)
        h = rms_norm(x, p["mlp_norm"], eps, off)
        m = linear(jax.nn.gelu(linear(h, p["gate"]), approximate=True) * linear(h, p["up"]), p["down"])
        if cfg.moe_dense:
            m = rms_norm(m, p["post_mlp_norm_1"], eps) + rms_norm(moe(p, x, cfg, batch), p["post_mlp_norm_2"], eps)
        x = x + rms_norm(m, p["post_mlp_norm"], eps, off)
        if "layer_scalar" in p:
            x = x * p["layer_scalar"].astype(x.dtype)
        return x, {**kv, kind: kv_kind}

    x, kv = run_layers(layer, cfg.layer_kinds, (x, kv), batch.get("unroll", False))
    return rms_norm(x, params["final_norm"], eps, off), kv
