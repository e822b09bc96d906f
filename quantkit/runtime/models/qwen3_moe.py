"""Qwen3-MoE: the Qwen3 decoder with a top-k routed expert MLP; experts go through the grouped matmul."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from quantkit.runtime.config import ModelConfig
from quantkit.runtime.models import llama
from quantkit.runtime.models.common import At


def grouped(x: jax.Array, w, sizes: jax.Array) -> jax.Array:
    """x [rows, in] sorted by expert, w one layer's experts [experts, in, out] (an At view of the stacked
    QTensor, or dense) -> [rows, out]."""
    if isinstance(w, At):
        from quantkit.runtime.ops import grouped_matmul

        return grouped_matmul(x, w.w, sizes, w.index * w.groups)
    return jax.lax.ragged_dot(x, w.astype(x.dtype), sizes, preferred_element_type=jnp.float32).astype(x.dtype)


def moe(p: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Router softmax -> top-k (renormalized if configured) -> experts on tokens sorted by expert."""
    probs = jax.nn.softmax(jnp.dot(x.astype(jnp.float32), p["router"]), axis=-1)  # [T, experts]
    weights, experts = jax.lax.top_k(probs, cfg.top_k)  # [T, k]
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // cfg.top_k
    sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    xs = x[token]  # [T * k, hidden], grouped by expert
    h = jax.nn.silu(grouped(xs, p["gate"], sizes)) * grouped(xs, p["up"], sizes)
    y = grouped(h, p["down"], sizes).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros(x.shape, jnp.float32).at[token].add(y).astype(x.dtype)


def forward(params, cfg, tokens, kv, batch):
    """As llama.forward, with the routed-expert MLP."""
    return llama.forward(params, cfg, tokens, kv, batch, ffn=moe)
