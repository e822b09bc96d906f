"""paged_attention: ragged paged attention over a stacked multi-layer KV cache (Pallas TPU).

out[t] = softmax(scale * q[t] . K_s^T, causal, optional window and soft cap) @ V_s   for t a query row of s

Same semantics as jax's `ref_ragged_paged_attention` (mixed prefill chunks and decodes in one flattened
batch), with three differences from jax's shipped kernel: the cache is all layers' pages `[L, P, ps, KVH*2*D]`
plus a layer index (the runtime's `lax.scan` carries the stacked cache; a layer slice handed to a custom call
would be materialized), head sizes 64..512 with any KV head count, and a declared `pl.CostEstimate`.

Design
- Grid: one axis over query blocks of `block_q` rows of the flattened batch ("arbitrary": the DMA of the next
  block's first pages is started by the previous step). A block may hold rows of several sequences; the step
  visits each sequence that overlaps it (bounds precomputed per block in the wrapper) and masks rows that are
  not that sequence's.
- Rows per KV head: the G = H / KVH query heads of a KV group are stacked into one [G * block_q, Dp] operand
  (built once per block in VMEM scratch, scale folded in), so each KV head costs two MXU matmuls per chunk.
  Default block_q makes G * block_q ~ 64 rows: for decode only 1 row in block_q is real, and the vector-unit
  work per KV byte (mask, exp) grows with the rows; 64 rows keeps it near the HBM time of the chunk on v6e.
- KV: stays in HBM (`memory_space=ANY`). For a (block, sequence) pair only the pages holding keys some row of
  the block can see are copied: from the page of the window start of the block's first row (0 without a
  window) to the page of its last row's position. Pages are gathered `pages_per_chunk` at a time by one
  async copy each into a double buffer [2, C * ps, KVH * 2D]; the copies of the next chunk (next sequence, or
  the next block's first chunk) start before the current chunk is waited on. Pages past the needed range are
  not copied (their rows are masked and zeroed), so bytes moved are exactly the needed pages.
- q and out blocks (D >= 128): [block_q, H * D], the layout of the projections that make q and take the
  output (the wrapper's reshapes of [T, H, D] are free there); [T, H, D]'s tiles of heads x lanes had XLA
  relay both out around the call.
- D = 64: a head's [k | v] pair is one 128-lane slab. q is zero-padded to 128 lanes in VMEM (q . [k|v] = q . k)
  and p @ [k|v] leaves p @ v in lanes 64..127; heads are moved between lane halves with `pltpu.roll`.
- Online softmax in float32 scratch (running max m, sum l, accumulator), probabilities cast to the KV dtype
  before the PV matmul (as the reference does); an fp8 cache (e4m3fn / e5m2: storage only, the caller applies
  per-layer scales to q and the output) is upcast to q's dtype in VMEM, so both matmuls run in q's dtype.
  Masked scores are selected away (never multiplied), and V rows outside the needed key range are zeroed, so
  NaN/garbage in unused cache slots or padding q rows cannot leak.
  Rows past cu_q_lens[num_seqs] come out zero.

File order (docs/architecture.md, rule 5): configs -> validation -> tiling -> cost estimate -> pallas_call ->
one jitted public entry.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from quantkit.kernels.tiling import CHIPS, Chip

# ---- configs --------------------------------------------------------------------------------------

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: m - MASK_VALUE never makes inf - inf
ROWS_PER_KV_HEAD = 64  # target G * block_q (see module docstring)
CHUNK_BYTES = 1 << 20  # target KV bytes per chunk: big DMAs, few loop iterations
MIN_CHUNK_KEYS, MAX_CHUNK_KEYS = 128, 512  # >= one lane width of scores; bounds wasted masked compute
HEAD_SIZES = (64, 128, 256, 512)
FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))  # KV storage only: pages upcast in VMEM


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Blocks:
    """Static tiling of one call."""

    block_q: int  # query rows of the flattened batch per grid step (power of two, >= 8)
    pages_per_chunk: int  # pages gathered per DMA chunk
    vmem_bytes: int  # estimated peak VMEM
    vmem_limit: int  # limit passed to Mosaic


# ---- validation -----------------------------------------------------------------------------------

def _check(q_shape, q_dtype, kv_shape, kv_dtype, bt_shape, kv_lens_shape, cu_shape, sliding_window, soft_cap):
    t, h, d = q_shape
    nl, p, ps, w = kv_shape
    s, pps = bt_shape
    if d not in HEAD_SIZES:
        raise ValueError(f"head size {d} not in {HEAD_SIZES}")
    if w % (2 * d) or w % 128:
        raise ValueError(f"kv last dim {w} must be KVH * 2 * {d} and a multiple of 128")
    kvh = w // (2 * d)
    if h % kvh:
        raise ValueError(f"{h} query heads not a multiple of {kvh} KV heads")
    if t % 8:
        raise ValueError(f"token count {t} must be a multiple of 8")
    if ps % 8:
        raise ValueError(f"page size {ps} must be a multiple of 8")
    if kv_lens_shape != (s,) or cu_shape != (s + 1,):
        raise ValueError(f"kv_lens {kv_lens_shape} / cu_q_lens {cu_shape} do not match {s} sequences")
    if jnp.dtype(q_dtype) != jnp.dtype(kv_dtype) and jnp.dtype(kv_dtype) not in (jnp.float32, *FP8):
        raise ValueError(f"q {q_dtype} and kv {kv_dtype} dtypes differ")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window {sliding_window} must be positive")
    if soft_cap is not None and soft_cap == 0.0:
        raise ValueError("soft_cap must not be 0")
    return kvh


# ---- tiling ---------------------------------------------------------------------------------------

def choose_blocks(t: int, h: int, d: int, kvh: int, ps: int, pps: int, q_bytes: int, kv_bytes: int,
                  chip: Chip, block_q: int | None = None, pages_per_chunk: int | None = None) -> Blocks:
    """block_q: largest power of two <= 64 / G dividing T (at least 8). pages_per_chunk: ~1 MiB of KV per
    chunk, at least 128 and at most 512 keys, at most pages_per_seq. VMEM limit: twice the estimate, at least
    XLA's 32 MiB default and at most 64 MiB (v7x's capacity); realistic shapes need 2-10 MiB."""
    g = h // kvh
    if block_q is None:
        block_q = 8
        while block_q * 2 * g <= ROWS_PER_KV_HEAD and t % (block_q * 2) == 0:
            block_q *= 2
    if block_q < 8 or block_q & (block_q - 1) or t % block_q:
        raise ValueError(f"block_q {block_q} must be a power of two >= 8 dividing {t}")
    page_bytes = ps * kvh * 2 * d * kv_bytes
    if pages_per_chunk is None:
        c = max(CHUNK_BYTES // page_bytes, _cdiv(MIN_CHUNK_KEYS, ps))
        pages_per_chunk = max(1, min(c, MAX_CHUNK_KEYS // ps, pps))
    if not 1 <= pages_per_chunk <= pps:
        raise ValueError(f"pages_per_chunk {pages_per_chunk} not in [1, {pps}]")
    dp = max(d, 128)
    rows, keys = g * block_q, pages_per_chunk * ps
    # q / out blocks [bq, H * D] (D = 64: [bq, H/2, 128], tiled over the last two dims: heads pad to sublanes)
    q_tile = h * d if d >= 128 else _cdiv(_cdiv(h, 2), 32 // q_bytes) * (32 // q_bytes) * 128
    vmem = (2 * keys * kvh * 2 * d * kv_bytes  # KV double buffer
            + 2 * 2 * block_q * q_tile * q_bytes  # q and out blocks, pipelined
            + kvh * rows * dp * (q_bytes + 4)  # stacked q, f32 accumulator
            + 2 * kvh * rows * 128 * 4  # m, l
            + 4 * rows * keys * 4 + 2 * keys * dp * 4)  # scores / probabilities, K / V values
    limit = min(64 << 20, max(32 << 20, 2 * vmem))
    if vmem > limit or limit > chip.vmem_bytes:
        raise ValueError(f"paged_attention needs ~{vmem >> 20} MiB of VMEM; lower block_q or pages_per_chunk")
    return Blocks(block_q, pages_per_chunk, vmem, limit)


def window_pages(pps: int, ps: int, sliding_window: int | None, rows: int = 1) -> int:
    """Most pages one (block, sequence) pair with `rows` query rows copies: its keys span
    [first row's position - W + 1, last row's position], W - 1 + rows keys, starting anywhere in a page."""
    if sliding_window is None:
        return pps
    return min(pps, _cdiv(sliding_window - 1 + rows - 1, ps) + 1)


# ---- cost estimate --------------------------------------------------------------------------------

def cost(t: int, h: int, d: int, kvh: int, s: int, pps: int, ps: int, q_bytes: int, kv_bytes: int,
         blocks: Blocks, sliding_window: int | None, soft_cap: float | None, sinks: bool = False) -> pl.CostEstimate:
    """Static bound for one pass per sequence (decode, and chunks within one query block).

    bytes = q + out                         2 * T * H * D * q_bytes
          + KV pages                        S * pages * ps * KVH * 2 * D * kv_bytes
          + metadata (int32)                4 * (S * pps + 2 * S + 3 + 2 * T / block_q)
          + attention sinks (float32)       4 * H, when set
    with pages = pps (no window) or min(pps, cdiv(W - 1, ps) + 1) (the pages a decode token's window can
    touch). A query span that crosses b block boundaries re-reads its needed pages b more times (not counted:
    long prefill chunks, which are compute-bound). A full-context decode batch copies exactly S * pps pages.
    flops / transcendentals: what the units execute, masked rows and keys included: per chunk and KV head,
    two [G * block_q, Dp] x [Dp, C * ps] matmuls (Dp = max(D, 128)) and one exp per score (plus one tanh
    with a soft cap).
    """
    pages = window_pages(pps, ps, sliding_window)
    kv = s * pages * ps * kvh * 2 * d * kv_bytes
    io = 2 * t * h * d * q_bytes + 4 * (s * pps + 2 * s + 3 + 2 * (t // blocks.block_q)) + (4 * h if sinks else 0)
    keys = s * _cdiv(pages, blocks.pages_per_chunk) * blocks.pages_per_chunk * ps
    scores = h * blocks.block_q * keys
    return pl.CostEstimate(flops=4 * scores * max(d, 128), transcendentals=scores * (2 if soft_cap else 1),
                           bytes_accessed=kv + io)


# ---- the kernel -----------------------------------------------------------------------------------

def _kernel(layer_ref, kv_lens_ref, bt_ref, cu_ref, ns_ref, lo_ref, hi_ref, *rest,  # scalar prefetch (SMEM)
            h: int, d: int, kvh: int, ps: int, pps: int, block_q: int, chunk: int, scale: float,
            window: int | None, soft_cap: float | None, count: bool, sinks: bool):
    sink_ref, rest = (rest[0], rest[1:]) if sinks else (None, rest)  # [H] float32 attention sinks
    q_ref, kv_hbm, *rest = rest
    if count:
        o_ref, cnt_ref, kv_buf, sems, qs_ref, m_ref, l_ref, acc_ref, slot_ref = rest
    else:
        o_ref, kv_buf, sems, qs_ref, m_ref, l_ref, acc_ref, slot_ref = rest
        cnt_ref = None
    b, nb = pl.program_id(0), pl.num_programs(0)
    g = h // kvh
    dp = max(d, 128)
    rows, keys = g * block_q, chunk * ps
    layer = layer_ref[0]
    total = cu_ref[ns_ref[0]]

    def span(blk, s):
        """Rows of sequence s in block blk and the pages they need."""
        qe, kvl = cu_ref[s + 1], kv_lens_ref[s]
        rlo = jnp.maximum(cu_ref[s], blk * block_q)
        rhi = jnp.minimum(qe, blk * block_q + block_q)
        off = kvl - qe  # position of flattened row r of s is off + r
        key_hi = off + rhi - 1
        key_lo = jnp.maximum(off + rlo - window + 1, 0) if window is not None else jnp.int32(0)
        first = key_lo // ps
        npages = jnp.where(rhi > rlo, jnp.maximum(key_hi // ps - first + 1, 0), 0)
        nchunks = jnp.maximum((npages + chunk - 1) // chunk, 1)  # >= 1: every pair is one item of the loop
        return dict(rlo=rlo, rhi=rhi, off=off, key_lo=key_lo, key_hi=key_hi, first=first, npages=npages,
                    nchunks=nchunks)

    def copies(blk, s, c, slot):
        """(needed?, descriptor) per page slot of chunk c of pair (blk, s)."""
        sp = span(blk, s)
        out = []
        for i in range(chunk):
            idx = sp["first"] + c * chunk + i
            page = bt_ref[s * pps + jnp.clip(idx, 0, pps - 1)]
            cp = pltpu.make_async_copy(kv_hbm.at[layer, page], kv_buf.at[slot, pl.ds(i * ps, ps)], sems.at[slot])
            out.append((c * chunk + i < sp["npages"], cp))
        return out, sp

    def start(blk, s, c, slot):
        cps, sp = copies(blk, s, c, slot)
        for need, cp in cps:
            pl.when(need)(cp.start)
        if count:
            cnt_ref[s] += jnp.clip(sp["npages"] - c * chunk, 0, chunk)

    def wait(blk, s, c, slot):
        for need, cp in copies(blk, s, c, slot)[0]:
            pl.when(need)(cp.wait)

    @pl.when(b == 0)
    def _():
        if count:
            def zero(i, _):
                cnt_ref[i] = 0
            jax.lax.fori_loop(0, cnt_ref.shape[0], zero, None)
        slot_ref[0] = 0

        @pl.when(lo_ref[0] < hi_ref[0])
        def _():
            start(0, lo_ref[0], 0, 0)

    # Stack the G query heads of each KV group: [G * block_q, Dp], scale folded in, zero-padded for D = 64.
    lane = jax.lax.broadcasted_iota(jnp.int32, (block_q, 128), 1)
    for kg in range(kvh):
        parts = []
        for hh in range(kg * g, kg * g + g):
            if d >= 128:  # q_ref is [bq, H * D]: head hh is lanes hh * D .. (hh + 1) * D
                x = q_ref[:, hh * d:(hh + 1) * d].astype(jnp.float32)  # [bq, D]
            else:  # q_ref is [bq, H/2, 128]: head hh is lane half hh % 2 of pair hh // 2
                x = q_ref[:, hh // 2, :].astype(jnp.float32)  # [bq, 128]
                if hh % 2:
                    x = pltpu.roll(x, 64, 1)
                x = jnp.where(lane < 64, x, 0.0)  # zero upper half: q . [k|v] = q . k
            parts.append(x * scale)
        qs_ref[kg] = (jnp.concatenate(parts, axis=0) if g > 1 else parts[0]).astype(qs_ref.dtype)
    if sink_ref is None:
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    else:  # each head's sink: one more logit in its rows' softmax, with no value (m starts there, l at 1)
        for kg in range(kvh):
            m_ref[kg] = jnp.concatenate([jnp.full((block_q, 128), sink_ref[hh], jnp.float32)
                                         for hh in range(kg * g, kg * g + g)], axis=0)
        l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    t_row = jax.lax.broadcasted_iota(jnp.int32, (rows, keys), 0) & (block_q - 1)  # block row of each score row
    k_col = jax.lax.broadcasted_iota(jnp.int32, (rows, keys), 1)
    k_row = jax.lax.broadcasted_iota(jnp.int32, (keys, dp), 0)

    def compute(sp, c, slot):
        key0 = (sp["first"] + c * chunk) * ps  # position of the chunk's first key
        base = b * block_q
        qpos = sp["off"] + base + t_row
        kpos = key0 + k_col
        vis = (t_row >= sp["rlo"] - base) & (t_row < sp["rhi"] - base) & (kpos <= qpos)
        if window is not None:
            vis &= kpos > qpos - window
        # Rows outside the copied range hold stale or uninitialized data: zero them so 0 * NaN cannot happen.
        krow = key0 + k_row
        kv_ok = (krow >= sp["key_lo"]) & (krow <= sp["key_hi"])
        # fp8 pages: upcast to q's dtype here, so that both matmuls (and p) run in q's dtype.
        cd = qs_ref.dtype if kv_buf.dtype.itemsize == 1 else kv_buf.dtype
        for kg in range(kvh):
            if d >= 128:
                kk = kv_buf[slot, :, 2 * kg * d:2 * kg * d + d].astype(cd)  # [C*ps, D]
                vv = jnp.where(kv_ok, kv_buf[slot, :, 2 * kg * d + d:2 * kg * d + 2 * d].astype(cd), 0)
            else:  # one slab [k | v]; q's zero upper half drops v from q . [k|v]
                kk = vv = jnp.where(kv_ok, kv_buf[slot, :, 128 * kg:128 * kg + 128].astype(cd), 0)
            qg = qs_ref[kg]  # [G*bq, Dp]
            sc = jax.lax.dot_general(qg, kk.astype(qg.dtype), (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)  # [G*bq, C*ps]
            if soft_cap is not None:
                sc = soft_cap * jnp.tanh(sc / soft_cap)
            sc = jnp.where(vis, sc, MASK_VALUE)
            m_prev = jnp.max(m_ref[kg], axis=1, keepdims=True)  # [G*bq, 1] (stored lane-broadcast)
            m_next = jnp.maximum(m_prev, jnp.max(sc, axis=1, keepdims=True))
            p = jnp.where(vis, jnp.exp(sc - m_next), 0.0)
            alpha = jnp.exp(m_prev - m_next)
            l_next = alpha * jnp.max(l_ref[kg], axis=1, keepdims=True) + jnp.sum(p, axis=1, keepdims=True)
            pv = jnp.dot(p.astype(vv.dtype), vv, preferred_element_type=jnp.float32)  # [G*bq, Dp]
            acc_ref[kg] = alpha * acc_ref[kg] + pv
            m_ref[kg] = jnp.broadcast_to(m_next, (rows, 128))
            l_ref[kg] = jnp.broadcast_to(l_next, (rows, 128))

    has_next_block = (b + 1 < nb) & ((b + 1) * block_q < total)
    lo_next = lo_ref[jnp.minimum(b + 1, nb - 1)]

    def seq_body(s, slot):
        sp = span(b, s)

        def chunk_body(c, slot):
            last = c + 1 >= sp["nchunks"]
            cross = last & (s + 1 >= hi_ref[b])
            nblk = jnp.where(cross, b + 1, b)
            ns = jnp.where(cross, lo_next, jnp.where(last, s + 1, s))
            nc = jnp.where(last, 0, c + 1)

            @pl.when(jnp.logical_not(cross) | has_next_block)
            def _():
                start(nblk, ns, nc, 1 - slot)

            wait(b, s, c, slot)
            compute(sp, c, slot)
            return 1 - slot

        return jax.lax.fori_loop(0, sp["nchunks"], chunk_body, slot)

    slot_ref[0] = jax.lax.fori_loop(lo_ref[b], hi_ref[b], seq_body, slot_ref[0])

    # Normalize; rows no sequence owns have acc = 0 (and l = 0, or 1 from a sink) and come out 0.
    res = []
    for hh in range(h):
        kg, gi = divmod(hh, g)
        l = jnp.max(l_ref[kg, gi * block_q:(gi + 1) * block_q], axis=1, keepdims=True)
        res.append(acc_ref[kg, gi * block_q:(gi + 1) * block_q] / jnp.where(l == 0.0, 1.0, l))  # [bq, Dp]
    if d >= 128:
        for hh in range(h):
            o_ref[:, hh * d:(hh + 1) * d] = res[hh].astype(o_ref.dtype)
    else:  # p @ [k|v] left p @ v in lanes 64..127; pair heads (2i, 2i+1) into one 128-lane row
        for i in range(o_ref.shape[1]):
            upper = res[2 * i + 1] if 2 * i + 1 < h else jnp.zeros_like(res[2 * i])
            o_ref[:, i, :] = jnp.where(lane < 64, pltpu.roll(res[2 * i], 64, 1), upper).astype(o_ref.dtype)


# ---- pallas_call ----------------------------------------------------------------------------------

def _seq_bounds(cu_q_lens, num_seqs, t: int, block_q: int):
    """Per query block: the first and one-past-last sequence with rows in it (empty for padding blocks).

    The sequence of row r is the last s <= num_seqs with cu[s] <= r (a count of a [blocks, S + 1] compare,
    cheaper here than searchsorted's loop)."""
    s1 = cu_q_lens.shape[0]
    ns = num_seqs.reshape(-1)[0]
    total = cu_q_lens[ns]
    live = jnp.arange(s1) <= ns
    starts = jnp.arange(0, t, block_q, dtype=jnp.int32)
    last = jnp.minimum(starts + block_q, total) - 1

    def seq_of(r):  # [blocks] -> [blocks]
        return jnp.sum((cu_q_lens[None, :] <= r[:, None]) & live[None, :], axis=1, dtype=jnp.int32) - 1

    lo = jnp.clip(seq_of(starts), 0, s1 - 2)
    hi = jnp.where(starts < total, jnp.clip(seq_of(last) + 1, 0, s1 - 1), lo)
    return lo, hi


def _call(q, kv, layer, kv_lens, block_tables, cu_q_lens, num_seqs, sinks, *, blocks: Blocks, scale,
          sliding_window, soft_cap, count, interpret):
    t, h, d = q.shape
    nl, p, ps, w = kv.shape
    s, pps = block_tables.shape
    kvh = w // (2 * d)
    g = h // kvh
    bq, chunk = blocks.block_q, blocks.pages_per_chunk
    dp = max(d, 128)
    if d < 128:  # D = 64: head pairs share 128 lanes, [T, H/2, 128] (free reshape, no lane padding)
        hp = h + h % 2
        q = jnp.pad(q, ((0, 0), (0, hp - h), (0, 0))) if hp != h else q
        q = q.reshape(t, hp // 2, 128)
    else:  # [T, H * D] as the q projection gives it: no relayout to [T, H, D]'s tiles of heads x lanes
        q = q.reshape(t, h * d)
    lo, hi = _seq_bounds(cu_q_lens, num_seqs, t, bq)
    prefetch = (jnp.asarray(layer, jnp.int32).reshape(1), kv_lens.astype(jnp.int32),
                block_tables.astype(jnp.int32).reshape(-1), cu_q_lens.astype(jnp.int32),
                jnp.asarray(num_seqs, jnp.int32).reshape(1), lo, hi)
    if sinks is not None:
        prefetch += (sinks.astype(jnp.float32).reshape(h),)
    kernel = functools.partial(_kernel, h=h, d=d, kvh=kvh, ps=ps, pps=pps, block_q=bq, chunk=chunk, scale=scale,
                               window=sliding_window, soft_cap=soft_cap, count=count, sinks=sinks is not None)
    qspec = pl.BlockSpec((bq,) + q.shape[1:], lambda i, *_: (i,) + (0,) * (q.ndim - 1))
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [qspec]
    if count:
        out_shape.append(jax.ShapeDtypeStruct((s,), jnp.int32))
        out_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    est = cost(t, h, d, kvh, s, pps, ps, q.dtype.itemsize, kv.dtype.itemsize, blocks, sliding_window, soft_cap,
               sinks=sinks is not None)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(t // bq,),
            in_specs=[qspec, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((2, chunk * ps, w), kv.dtype),  # KV double buffer
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((kvh, g * bq, dp), q.dtype),  # stacked, scaled q
                pltpu.VMEM((kvh, g * bq, 128), jnp.float32),  # m (lane-broadcast)
                pltpu.VMEM((kvh, g * bq, 128), jnp.float32),  # l
                pltpu.VMEM((kvh, g * bq, dp), jnp.float32),  # accumulator
                pltpu.SMEM((1,), jnp.int32),  # buffer slot holding the next chunk, across grid steps
            ],
        ),
        # Sequential: each step starts the copy of the next step's first chunk.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=blocks.vmem_limit),
        cost_estimate=est,
        name="paged_attention", metadata={"mxu": "bf16"},  # q and the KV chunk (fp8 widened) meet in bf16
        interpret=interpret,
    )(*prefetch, q, kv)
    out = outs[0].reshape(t, -1, d)[:, :h]
    return (out, outs[1]) if count else out


# ---- public entry ---------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "chip", "interpret", "block_q",
                                             "pages_per_chunk", "count_pages"))
def paged_attention(q, kv, layer, kv_lens, block_tables, cu_q_lens, num_seqs, sinks=None, *, scale: float,
                    sliding_window: int | None = None, soft_cap: float | None = None, chip: str = "v6e",
                    interpret=False, block_q: int | None = None, pages_per_chunk: int | None = None,
                    count_pages: bool = False):
    """Ragged paged attention of one layer of a stacked KV cache.

    Args:
        q: [T, H, D] queries, sequence s at rows cu_q_lens[s] .. cu_q_lens[s+1]-1 (bf16; f32 for interpret).
        kv: [L, P, page_size, KVH * 2 * D]; KV head h's key at lanes [2hD, 2hD+D), value at [2hD+D, 2hD+2D).
        layer: int32 [1] or scalar, the layer of the stack.
        kv_lens: int32 [S], keys per sequence (the step's own keys included).
        block_tables: int32 [S, pages_per_seq], page of the layer for each page slot of a sequence.
        cu_q_lens: int32 [S + 1]; num_seqs: int32 [1], sequences s >= num_seqs[0] are ignored.
        sinks: [H] float32 or None: gpt-oss's attention sinks, a learned logit per query head in each row's
            softmax denominator with no value (kernels/xla.py); in SMEM with the scalar prefetch.
        scale: multiplies q . k; sliding_window: keys p with p > qpos - W are seen (pages wholly below the
            window of a block's first row are never read); soft_cap: cap * tanh(score / cap).
        chip: target generation (VMEM size); interpret: Pallas interpret mode (e.g. pltpu.InterpretParams()).
        block_q, pages_per_chunk: tiling overrides (see choose_blocks).
        count_pages: also return int32 [S], pages DMA'd per sequence (tests of the cost estimate).
    Returns:
        [T, H, D] in q.dtype (rows past cu_q_lens[num_seqs] are zero), and the page counts if count_pages.
    """
    kvh = _check(q.shape, q.dtype, kv.shape, kv.dtype, block_tables.shape, kv_lens.shape, cu_q_lens.shape,
                 sliding_window, soft_cap)
    t, h, d = q.shape
    blocks = choose_blocks(t, h, d, kvh, kv.shape[2], block_tables.shape[1], q.dtype.itemsize, kv.dtype.itemsize,
                           CHIPS[chip], block_q, pages_per_chunk)
    return _call(q, kv, layer, kv_lens, block_tables, cu_q_lens, num_seqs, sinks, blocks=blocks, scale=float(scale),
                 sliding_window=sliding_window, soft_cap=soft_cap, count=count_pages, interpret=interpret)
