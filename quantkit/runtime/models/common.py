"""Building blocks shared by the model families: pure functions over arrays and weight pytrees.

Weights: a linear weight is either a dense array [in, out] or a QTensor [1, in, out] (quant/qtensor.py);
`linear` sends the latter through the one quantized matmul (gmm_v2 on TPU, the XLA path elsewhere).

KV cache (paged, vLLM's design): per layer, keys and values live in `pages` [num_pages, page_size,
kv_heads, head_dim]; a sequence owns the pages listed in its row of a block table [batch, max_pages].
Page 0 is reserved as scratch: padding tokens write there and no block table lists it.
`block_tables` is a pair (full, ring): full-attention layers keep every position of a sequence (position
p in page full[p // page_size]); sliding-window layers, when `ring` is not None, keep only a ring of
`ring_pages` pages, the last `window` positions or more (position p in slot p mod ring length), so their
cache does not grow with the model length. ring None: sliding layers use the full layout too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from quantkit.quant.qtensor import QTensor
from quantkit.runtime.config import ModelConfig


def linear(x: jax.Array, w, bias: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ w [in, out] (+ bias), f32 accumulation, result in x.dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if rows < 8 and jax.default_backend() == "cpu":
        # XLA:CPU runs a bf16 matrix-vector product ~10x slower than an 8-row matrix product
        # (measured: 1x1024 @ 1024x32000 in 50 ms vs 8 rows in 6 ms), so decode pads to 8 rows.
        x2 = jnp.pad(x2, ((0, 8 - rows), (0, 0)))
    if isinstance(w, QTensor):
        from quantkit.runtime.ops import qmatmul

        y = qmatmul(x2, w)
    else:
        y = jnp.dot(x2, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    y = y[:rows]
    if bias is not None:
        y = (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)
    return y.reshape(*lead, y.shape[-1])


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm in float32; Gemma scales by (1 + w), hence `offset`."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (offset + w.astype(jnp.float32))).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig, local: bool = False) -> jax.Array:
    """Inverse frequencies [head_dim / 2]: global layers use rope_theta with the configured scaling
    (Llama 3 long-context, or linear), sliding-window layers rope_local_theta unscaled (Gemma 3)."""
    d = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if local or cfg.rope_scaling is None:
        return inv
    if len(cfg.rope_scaling) == 1:
        return inv / cfg.rope_scaling[0]
    if cfg.rope_scaling is not None:
        factor, low, high, original = cfg.rope_scaling
        wavelen = 2 * jnp.pi / inv
        low_wl, high_wl = original / low, original / high
        smooth = (original / wavelen - low) / (high - low)
        scaled = jnp.where(wavelen > low_wl, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = jnp.where((wavelen <= low_wl) & (wavelen >= high_wl), mid, scaled)
    return inv


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates x [b, t, heads, d] by positions [b, t] (rotate-half convention of Hugging Face)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [b, t, d/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def ring_pages(cfg: ModelConfig, page_size: int, max_model_len: int) -> int | None:
    """Pages per sequence of the sliding-window layers' ring, or None when no layer slides or the window
    spans the model length (then a ring would save nothing)."""
    sliding = any(cfg.is_sliding(i) for i in range(cfg.num_layers))
    return -(-cfg.sliding_window // page_size) if sliding and cfg.sliding_window < max_model_len else None


def write_kv(pages: jax.Array, new: jax.Array, positions: jax.Array, block_tables: jax.Array,
             ring: int = 0) -> jax.Array:
    """Stores new [b, t, kvh, d] at their positions [b, t] (negative: padding -> scratch page 0); with a
    ring of `ring` tokens, at position mod ring, and only a row's last `ring` positions."""
    page_size = pages.shape[1]
    pos, keep = jnp.maximum(positions, 0), positions >= 0
    if ring:
        keep &= positions > positions.max(axis=1, keepdims=True) - ring  # older ones would be overwritten
        pos = pos % ring
    page = jnp.take_along_axis(block_tables, pos // page_size, axis=1)
    slot = jnp.where(keep, page * page_size + pos % page_size, 0)  # [b, t]
    flat = pages.reshape(-1, *pages.shape[2:])
    flat = flat.at[slot.reshape(-1)].set(new.reshape(-1, *new.shape[2:]).astype(pages.dtype))
    return flat.reshape(pages.shape)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, kpos: jax.Array, positions: jax.Array, scale: float,
           window: int | None = None) -> jax.Array:
    """Causal attention of q [b, t, h, d] at positions [b, t] over keys/values [b, L, kvh, d] held at
    kpos [b, L] or [L] (negative: empty) (pure JAX path).

    A query at position p sees keys at positions <= p (and > p - window with a sliding window); queries
    with negative positions (padding) produce zeros.
    """
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d).astype(jnp.float32)
    scores = jnp.einsum("btgrd,blgd->bgrtl", qg, k.astype(jnp.float32)) * scale
    kp, qp = jnp.atleast_2d(kpos)[:, None, :], positions[:, :, None]
    visible = (kp >= 0) & (kp <= qp)  # [b, t, L]
    if window:
        visible &= kp > qp - window
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible[:, None, None].any(-1, keepdims=True), probs, 0.0)
    out = jnp.einsum("bgrtl,blgd->btgrd", probs, v.astype(jnp.float32))
    return out.reshape(b, t, h * d).astype(q.dtype)


def attention_block(p: dict, x: jax.Array, cache: tuple, positions, block_tables, cfg: ModelConfig,
                    layer: int, norm_offset: float = 0.0) -> tuple[jax.Array, tuple]:
    """q/k/v projections (+ optional q/k norms), RoPE, cache update, attention, output projection."""
    b, t, _ = x.shape
    q = linear(x, p["q"], p.get("q_bias")).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = linear(x, p["k"], p.get("k_bias")).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = linear(x, p["v"], p.get("v_bias")).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps, norm_offset)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps, norm_offset)
    sliding = cfg.is_sliding(layer)
    inv = rope_frequencies(cfg, local=sliding)
    q, k = apply_rope(q, positions, inv), apply_rope(k, positions, inv)
    full, ring_tables = block_tables
    window, ps = cfg.sliding_window if sliding else None, cache[0].shape[1]

    def cached(pages, tables):
        return pages[tables].reshape(b, -1, *pages.shape[2:])  # [b, L, kvh, d]

    if sliding and ring_tables is not None:
        # read the ring before writing: this step's keys may overwrite slots its first queries still see.
        # Slot j holds the latest position <= first - 1 that is j mod ring (negative: none yet).
        ring = -(-cfg.sliding_window // ps) * ps
        first = jnp.min(jnp.where(positions >= 0, positions, 1 << 30), axis=1, keepdims=True)
        held = first - 1 - (first - 1 - jnp.arange(ring_tables.shape[1] * ps)) % ring  # [b, L]
        out = attend(q, jnp.concatenate([cached(cache[0], ring_tables), k], 1),
                     jnp.concatenate([cached(cache[1], ring_tables), v], 1),
                     jnp.concatenate([held, positions], 1), positions, cfg.scale, window)
        new = tuple(write_kv(c, x, positions, ring_tables, ring) for c, x in zip(cache, (k, v)))
    else:
        new = tuple(write_kv(c, x, positions, full) for c, x in zip(cache, (k, v)))
        out = attend(q, cached(new[0], full), cached(new[1], full), jnp.arange(full.shape[1] * ps), positions,
                     cfg.scale, window)
    return linear(out, p["o"]), new


def logits(params: dict, h: jax.Array, cfg: ModelConfig, last: jax.Array | None = None) -> jax.Array:
    """Final projection to the vocabulary (tied to the embedding when configured), float32.

    last: [b] index into t of each row's one wanted position (a prefill needs only its last token's
    logits; the rest of the vocabulary projection would be wasted work); None: every position.
    """
    if last is not None:
        h = h[jnp.arange(h.shape[0]), last][:, None]  # [b, 1, hidden]
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    out = linear(h, w).astype(jnp.float32)
    if cfg.final_logit_softcap:
        out = jnp.tanh(out / cfg.final_logit_softcap) * cfg.final_logit_softcap
    return out
