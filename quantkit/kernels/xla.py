"""The XLA paths: the signatures of the Pallas kernels (gmm_v2, paged_attention), used on CPU and as the
fallback on TPU.

gmm_xla dequantizes the whole weight to bf16 before the dot (XLA may fuse it, but nothing guarantees the
weight stays packed), which is exactly what gmm_v2 exists to avoid on TPU. paged_attention_xla reads only
the pages each sequence needs, in chunks, with an online softmax (pure JAX; also the test reference of the
Pallas attention kernel, and checked itself against jax's `ref_ragged_paged_attention`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from quantkit.quant.qtensor import QTensor


@jax.jit
def gmm_xla(lhs: jax.Array, rhs: QTensor, group_sizes: jax.Array, group_offset: jax.Array | None = None
            ) -> jax.Array:
    """[m, k] x QTensor [G, k, n] -> [m, n] in lhs.dtype over groups offset .. offset + len(group_sizes) - 1
    (as gmm_v2); rows past sum(group_sizes) are zero."""
    g = group_sizes.shape[0]
    if group_offset is not None or g != rhs.shape[0]:
        off = jnp.zeros((), jnp.int32) if group_offset is None else jnp.asarray(group_offset, jnp.int32)
        rhs = rhs.with_arrays({f: jax.lax.dynamic_slice_in_dim(a, off, g) for f, a in rhs.arrays.items()})
    w = (rhs.values if rhs.qtype == "bf16" else rhs.dequantize()).astype(lhs.dtype)  # [g, k, n]
    if g == 1:
        out = jnp.dot(lhs, w[0], preferred_element_type=jnp.float32)
        rows = jnp.arange(lhs.shape[0])[:, None] < group_sizes[0]
        return jnp.where(rows, out, 0.0).astype(lhs.dtype)
    return jax.lax.ragged_dot(lhs, w, group_sizes.astype(jnp.int32),
                              preferred_element_type=jnp.float32).astype(lhs.dtype)


# ---- paged attention --------------------------------------------------------------------------------

def _attend_chunks(q, qpos, tables, kv, layer, kv_lens, *, scale, window, soft_cap, chunk, sinks=None):
    """Online-softmax attention of q [B, R, H, D] at positions qpos [B, R] (negative: no query) over the
    paged keys of B sequences (tables [B, pages], kv_lens [B]), `chunk` pages at a time, visiting only
    the chunks that hold a visible key of some row; sinks [H]: one more logit per head in the softmax's
    denominator, with no value (the running max and sum start from it)."""
    b, r, h, d = q.shape
    ps, kvh = kv.shape[2], kv.shape[3] // (2 * d)
    pages = tables.shape[1]
    n_chunks = -(-pages // chunk)
    tables = jnp.pad(tables, ((0, 0), (0, n_chunks * chunk - pages)))
    qg = q.reshape(b, r, kvh, h // kvh, d).astype(jnp.float32)
    live = qpos >= 0
    hi = jnp.max(jnp.where(live, qpos, -1))  # the last visible key of any row
    lo = jnp.min(jnp.where(live, qpos - (window - 1 if window else qpos), 1 << 30))
    first, last = jnp.maximum(lo, 0) // (chunk * ps), jnp.maximum(hi, 0) // (chunk * ps)
    start = jnp.min(jnp.where(live, qpos - (window - 1 if window else qpos), 1 << 30), axis=1)  # [B]

    def body(c, carry):
        m, l, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(tables, c * chunk, chunk, axis=1)  # [B, chunk]
        kpos = c * chunk * ps + jnp.arange(chunk * ps)  # [L]
        # keys no row of a sequence sees (past its length, out of its window: freed pages) are zeroed, not
        # just masked: their pages may hold anything, and 0 * NaN would leak
        seen = (kpos[None] < kv_lens[:, None]) & (kpos[None] >= start[:, None])  # [B, L]
        blk = jnp.where(seen[:, :, None, None, None],
                        kv[layer, ids].reshape(b, chunk * ps, kvh, 2, d).astype(jnp.float32), 0.0)  # one gather
                        # from the stack: slicing the layer out first copies it (16 MB a layer, 2 ms, on CPU)
        if r == 1:  # one row (decodes): multiply-reduce fusions read the block in place; a dot would first
            # transpose it to [B, KVH, L, D] (a 2-layer hidden-256 step, one decode: 1.67 -> 1.44 ms on CPU)
            s = (qg[:, 0, None] * blk[:, :, :, 0, None, :]).sum(-1).transpose(0, 2, 3, 1)[:, None] * scale
        else:
            s = jnp.einsum("brkgd,blkd->brkgl", qg, blk[..., 0, :]) * scale
        if soft_cap:
            s = soft_cap * jnp.tanh(s / soft_cap)
        vis = (kpos[None, None] <= qpos[..., None]) & (kpos[None, None] < kv_lens[:, None, None])  # [B, R, L]
        if window:
            vis &= kpos[None, None] > qpos[..., None] - window
        s = jnp.where(vis[:, :, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - safe[..., None])
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m, -jnp.inf) - safe)
        l = l * corr + p.sum(-1)
        if r == 1:
            pv = (p[:, 0].transpose(0, 3, 1, 2)[..., None] * blk[:, :, :, 1, None, :]).sum(1)[:, None]
        else:
            pv = jnp.einsum("brkgl,blkd->brkgd", p, blk[..., 1, :])
        acc = acc * corr[..., None] + pv
        return m_new, l, acc

    if sinks is None:
        m0, l0 = jnp.full((b, r, kvh, h // kvh), -jnp.inf), jnp.zeros((b, r, kvh, h // kvh))
    else:  # a query row with no visible key (padding) still has l = 0 and comes out 0
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(kvh, h // kvh), (b, r, kvh, h // kvh))
        l0 = jnp.broadcast_to((qpos >= 0)[..., None, None], m0.shape).astype(jnp.float32)
    init = (m0, l0, jnp.zeros((b, r, kvh, h // kvh, d)))
    m, l, acc = jax.lax.fori_loop(first, last + 1, body, init)
    out = jnp.where((l > 0)[..., None], acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.reshape(b, r, h, d)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "chunk_pages", "block", "short"))
def paged_attention_xla(q, kv, layer, kv_lens, block_tables, cu_q_lens, num_seqs, *, scale: float,
                        sliding_window: int | None = None, soft_cap: float | None = None,
                        chunk_pages: int = 4, block: int = 32, sinks: jax.Array | None = None,
                        short: int = 1) -> jax.Array:
    """Ragged paged attention (the contract of kernels/paged_attention.py, pure JAX).

    Args:
        q: [T, H, D] queries of the flattened step; sequence s owns rows cu_q_lens[s] .. cu_q_lens[s+1]-1,
            the last q_len positions of its kv_lens[s] tokens.
        kv: [L, P, page_size, KVH * 2 * D] stacked pages; per token, KV head h's key is lanes [2hD, 2hD+D)
            and its value the next D lanes.
        layer: int32 index into L. kv_lens [S], block_tables [S, pages], cu_q_lens [S + 1], num_seqs [1].
        scale, sliding_window, soft_cap: as jax's ref_ragged_paged_attention.
        sinks: [H] float32 or None: a learned logit per query head that joins each row's softmax and
            contributes no value (gpt-oss's attention sinks, as transformers' GptOss attention).
    Returns:
        [T, H, D] in q.dtype; rows of no sequence are zero.

    The rows of sequences with at most `short` queries (decodes; a verifying step's rows of a token and its
    drafts, short = 1 + drafts) are computed together, `short` rows per sequence (only the first such
    sequence's when no other has any), each sequence's keys read once for its rows; the rows of sequences
    with more (prompt chunks) in blocks of `block` rows of one sequence each (a chunk's last block may be
    partial), one block after another, only those in use, each over the key chunks its own rows see.
    """
    t, h, d = q.shape
    s = block_tables.shape[0]
    layer = jnp.asarray(layer, jnp.int32).reshape(())
    n = num_seqs.reshape(())
    start, q_len = cu_q_lens[:-1], cu_q_lens[1:] - cu_q_lens[:-1]
    real = jnp.arange(s) < n
    kw = dict(scale=scale, window=sliding_window, soft_cap=soft_cap, chunk=chunk_pages, sinks=sinks)
    qp = jnp.pad(q, ((0, 1), (0, 0), (0, 0)))  # row t: no query
    # short rows: all S sequences' together, one row each when none has more than one (decodes), or only
    # the first such sequence's when no other has any (one stream decoding: the S - 1 padding sequences'
    # rows would cost as much as its own)
    few = real & (q_len <= short)

    def together(idx, width):
        def run(out):
            j = jnp.arange(width)
            ok = few[idx][:, None] & (j < q_len[idx][:, None])  # [B, width]
            rows = jnp.where(ok, start[idx][:, None] + j, t)
            qpos = jnp.where(ok, kv_lens[idx][:, None] - q_len[idx][:, None] + j, -1)
            return out.at[rows].set(_attend_chunks(qp[rows], qpos, block_tables[idx], kv, layer, kv_lens[idx], **kw))
        return run

    out, every = jnp.zeros((t + 1, h, d), jnp.float32), together(jnp.arange(s), 1)
    if s > 1:
        cases = [together(jnp.argmax(few)[None], short), every]  # one sequence's rows; every sequence's one row
        if short > 1:  # every sequence's `short` rows (with short = 1 the second case is that)
            cases.append(together(jnp.arange(s), short))
        case = jnp.where(jnp.sum(few) <= 1, 0, jnp.where(jnp.max(jnp.where(few, q_len, 0)) <= 1, 1, 2))
        out = jax.lax.switch(case, cases, out)
    else:
        out = together(jnp.arange(s), short)(out)
    # several queries: block b holds rows start[seq[b]] + offset[:, b] of sequence seq[b] (t: none)
    r = min(block, t)
    nb = t // r + s
    per_seq = jnp.where(real & (q_len > short), -(-q_len // r), 0)
    ends = jnp.cumsum(per_seq)
    b = jnp.arange(nb)
    seq = jnp.minimum(jnp.searchsorted(ends, b, side="right"), s - 1)
    offset = (b - (ends[seq] - per_seq[seq])) * r + jnp.arange(r)[:, None]  # [r, nb] rows into the chunk
    valid = (b < ends[-1]) & (offset < q_len[seq])
    rows = jnp.where(valid, start[seq] + offset, t).T  # [nb, r]
    qpos = jnp.where(valid, kv_lens[seq] - q_len[seq] + offset, -1).T

    def one_block(b, out):  # each block over the key chunks its own rows see
        o = _attend_chunks(qp[rows[b]][None], qpos[b][None], block_tables[seq[b]][None], kv, layer,
                           kv_lens[seq[b]][None], **kw)
        return out.at[rows[b]].set(o[0])

    # the blocks in use one after another (none: decode-only steps); a padding block would cost as much as
    # a real one, and a short chunk's block need not visit a long one's keys
    out = jax.lax.fori_loop(0, ends[-1], one_block, out)
    return out[:t].astype(q.dtype)
