"""Qwen3-MoE: the Qwen3 decoder with a top-k routed expert MLP; experts go through the grouped matmul."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from quantkit.runtime.config import ModelConfig
from quantkit.runtime.models import llama
from quantkit.runtime.models.common import routed_experts


def moe(p: dict, x: jax.Array, cfg: ModelConfig, batch: dict) -> jax.Array:
    """Router softmax -> top-k (renormalized if configured) -> SwiGLU experts (expert parallel when the step
    says so: batch["ep_mesh"])."""
    probs = jax.nn.softmax(jnp.dot(x.astype(jnp.float32), p["router"]), axis=-1)  # [T, experts]
    weights, experts = jax.lax.top_k(probs, cfg.top_k)  # [T, k]
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    return routed_experts(x, weights, experts, (p["gate"], p["up"], p["down"]), cfg.num_experts,
                          lambda g, u: jax.nn.silu(g) * u, batch.get("ep_mesh"))


def forward(params, cfg, tokens, kv, batch):
    """As llama.forward, with the routed-expert MLP."""
    return llama.forward(params, cfg, tokens, kv, batch, ffn=moe)
