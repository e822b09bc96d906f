"""Qwen3-MoE: the Qwen3 decoder with a top-k routed expert MLP; experts go through the grouped matmul."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from quantkit.quant.qtensor import QTensor
from quantkit.runtime.config import ModelConfig
from quantkit.runtime.models import llama


def grouped(x: jax.Array, w, sizes: jax.Array) -> jax.Array:
    """x [rows, in] sorted by expert, w [experts, in, out] (QTensor or dense) -> [rows, out]."""
    if isinstance(w, QTensor):
        from quantkit.runtime.ops import grouped_matmul

        return grouped_matmul(x, w, sizes)
    return jax.lax.ragged_dot(x, w.astype(x.dtype), sizes, preferred_element_type=jnp.float32).astype(x.dtype)


def moe(p: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Router softmax -> top-k (renormalized if configured) -> experts on tokens sorted by expert."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])  # [tokens, hidden]
    probs = jax.nn.softmax(jnp.dot(xf.astype(jnp.float32), p["router"]), axis=-1)  # [tokens, experts]
    weights, experts = jax.lax.top_k(probs, cfg.top_k)  # [tokens, k]
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // cfg.top_k
    sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    xs = xf[token]  # [tokens * k, hidden], grouped by expert
    h = jax.nn.silu(grouped(xs, p["gate"], sizes)) * grouped(xs, p["up"], sizes)
    y = grouped(h, p["down"], sizes).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    out = jnp.zeros((xf.shape[0], shape[-1]), jnp.float32).at[token].add(y)
    return out.astype(x.dtype).reshape(shape)


def forward(params, cfg, tokens, positions, cache, block_tables, last=None):
    """As llama.forward, with the routed-expert MLP."""
    return llama.forward(params, cfg, tokens, positions, cache, block_tables, last,
                         ffn=functools.partial(lambda p, x, c: moe(p, x, c), c=cfg))
