"""paged_attention (Pallas, interpret mode on CPU) against jax's ref_ragged_paged_attention, its declared cost
against the pages it really copies, and a deviceless compile for v6e.

Batches are fresh random draws each run (the seed is in every failure message)."""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

from quantkit.kernels.paged_attention import choose_blocks, cost, paged_attention
from quantkit.kernels.tiling import CHIPS

INTERPRET = pltpu.InterpretParams(detect_races=True)  # simulates DMAs and semaphores; flags buffer races
# The kernel's float32 tolerance: a few ulps an element in interpret mode. On a TPU (tests/test_tpu.py) the MXU
# multiplies float32 operands at its default precision as bf16 (2^-9 relative each): 1.9-3.3e-3 relative
# error seen on a v5e over 19 random batches, 5e-3 there; a wrong page, mask or row is O(1).
F32_TOL = 1e-5
LAYERS = 3


def _seed() -> int:
    return int(np.random.SeedSequence().entropy % (1 << 31))


def make_batch(rng, *, d, kvh, g, t=32, s_max=6, pps=6, ps=16, window=None, page0=np.nan, dtype=jnp.float32,
               q_lens=None):
    """A ragged batch on a stacked cache of LAYERS layers, poisoned wherever the kernel must not look.

    - pages come from a shuffled pool (never page 0); the other layers, pages no live sequence holds, the
      slots past each kv_len, padding q rows and the unused sequence slots are NaN;
    - with a window, block-table entries of pages wholly below each sequence's first visible key point to
      page 0 (filled with `page0`), and the pages they used to name are NaN.
    """
    h = kvh * g
    if q_lens is None:
        ns = int(rng.integers(1, s_max))  # num_seqs < S
        q_lens = [int(x) for x in rng.choice([1, 1, 1, 2, 5, 11], size=ns)]  # decodes and chunks
        while sum(q_lens) > t - 1:  # keep at least one padding row
            q_lens.pop()
    ns = len(q_lens)
    kv_lens = [int(rng.integers(max(ql, 1), pps * ps + 1)) for ql in q_lens]
    num_pages = s_max * pps + 3
    pool = rng.permutation(np.arange(1, num_pages))
    tables = pool[:s_max * pps].reshape(s_max, pps).astype(np.int32)
    layer = int(rng.integers(0, LAYERS))
    kv = np.full((LAYERS, num_pages, ps, kvh * 2 * d), np.nan, np.float32)
    for s in range(ns):
        for p in range(-(-kv_lens[s] // ps)):
            rows = min(ps, kv_lens[s] - p * ps)
            kv[layer, tables[s, p], :rows] = rng.standard_normal((rows, kvh * 2 * d))
    if window is not None:
        for s in range(ns):
            first_key = max(kv_lens[s] - q_lens[s] - window + 1, 0)
            for p in range(first_key // ps):
                kv[layer, tables[s, p]] = np.nan
                tables[s, p] = 0
    kv[layer, 0] = page0
    q = np.full((t, h, d), np.nan, np.float32)
    n = sum(q_lens)
    q[:n] = rng.standard_normal((n, h, d))
    cu = np.zeros(s_max + 1, np.int32)
    cu[1:ns + 1] = np.cumsum(q_lens)
    cu[ns + 1:] = n
    kvl = np.zeros(s_max, np.int32)
    kvl[:ns] = kv_lens
    tables[ns:] = 0
    args = (jnp.asarray(q, dtype), jnp.asarray(kv, dtype), jnp.asarray([layer], jnp.int32), jnp.asarray(kvl),
            jnp.asarray(tables), jnp.asarray(cu), jnp.asarray([ns], jnp.int32))
    return args, n, dict(q_lens=q_lens, kv_lens=kv_lens, layer=layer)


def reference(args, *, d, kvh, scale, window, soft_cap):
    q, kv, layer, kv_lens, tables, cu, ns = args
    lay = kv[int(layer[0])]
    pages = lay.reshape(lay.shape[0], lay.shape[1], 2 * kvh, d)
    # The oracle gathers every table entry (also the dropped window pages, now page 0); its mask discards them
    # unless they are NaN/inf: give it a clean page 0 (the kernel gets the poisoned one).
    pages = pages.at[0].set(0)
    return ref_ragged_paged_attention(q, pages, kv_lens, tables, cu, ns, sm_scale=scale, sliding_window=window,
                                      soft_cap=soft_cap)


# (d, kvh, g, window, soft_cap, dtype, block_q, pages_per_chunk, page0 fill)
CASES = [
    (64, 2, 2, None, None, jnp.float32, 8, 2, np.nan),
    (64, 1, 3, 20, None, jnp.float32, 8, 1, np.nan),  # odd head count: pair padding
    (128, 1, 4, 24, 20.0, jnp.float32, 8, 2, 1e30),
    (128, 2, 1, None, 30.0, jnp.float32, None, None, np.nan),  # default tiling
    (256, 1, 2, 40, None, jnp.float32, 8, 2, 1e30),
    (256, 2, 1, None, None, jnp.float32, 16, 3, np.nan),
    (512, 1, 2, 17, 10.0, jnp.float32, 8, 2, np.nan),
    (128, 2, 2, 24, 30.0, jnp.bfloat16, 8, 2, np.nan),
    (64, 2, 4, None, None, jnp.bfloat16, 8, 2, np.nan),
]


@pytest.mark.parametrize("d,kvh,g,window,soft_cap,dtype,block_q,chunk,page0", CASES)
def test_matches_jax_reference(d, kvh, g, window, soft_cap, dtype, block_q, chunk, page0):
    seed = _seed()
    rng = np.random.default_rng(seed)
    args, n, info = make_batch(rng, d=d, kvh=kvh, g=g, window=window, page0=page0, dtype=dtype)
    scale = d ** -0.5
    out = paged_attention(*args, scale=scale, sliding_window=window, soft_cap=soft_cap, interpret=INTERPRET,
                          block_q=block_q, pages_per_chunk=chunk)
    want = reference(args, d=d, kvh=kvh, scale=scale, window=window, soft_cap=soft_cap)
    out = np.asarray(out.astype(jnp.float32))
    want = np.asarray(want.astype(jnp.float32))
    msg = f"seed={seed} {info}"
    assert out.shape == args[0].shape and out.dtype == np.float32, msg
    assert np.all(np.isfinite(out[:n])), msg
    assert np.all(out[n:] == 0), msg  # padding rows: zeros, although their q rows are NaN
    err = np.linalg.norm(out[:n] - want) / np.linalg.norm(want)
    # float32: the same math as the oracle, only the summation order differs (online softmax over chunks,
    # scale folded into q): a few ulps of float32 per element, ~1e-7 relative; 1e-5 leaves room. bf16: q, k, v
    # are the same bf16 values, but the kernel scales q in bf16 and casts unnormalized probabilities to bf16
    # for the PV matmul while the oracle casts normalized ones; each costs one bf16 rounding (2^-9 relative) per
    # element, which averages to ~3e-3 in the norm: 1.5e-2.
    tol = F32_TOL if dtype == jnp.float32 else 1.5e-2
    assert err < tol, f"{msg} err={err:.2e}"


def test_long_chunks_across_blocks():
    """Prefill chunks spanning several query blocks (each block re-reads only its causal prefix), with a
    window and a decode packed in the same block as a chunk's tail."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    d, kvh, g, window = 128, 1, 2, 30
    args, n, info = make_batch(rng, d=d, kvh=kvh, g=g, window=window, q_lens=[19, 1, 9], s_max=4, pps=5)
    out = paged_attention(*args, scale=0.1, sliding_window=window, interpret=INTERPRET, block_q=8,
                          pages_per_chunk=2)
    want = reference(args, d=d, kvh=kvh, scale=0.1, window=window, soft_cap=None)
    err = np.linalg.norm(np.asarray(out)[:n] - np.asarray(want)) / np.linalg.norm(want)
    assert err < F32_TOL and np.all(np.asarray(out)[n:] == 0), f"seed={seed} {info} err={err:.2e}"


# ---- cost estimate honesty ---------------------------------------------------------------------------

def _decode_batch(s, pps, ps, d, kvh, g, kv_lens):
    """S sequences, one query token each, every page distinct."""
    rng = np.random.default_rng(0)
    h = kvh * g
    tables = (1 + rng.permutation(s * pps)).reshape(s, pps).astype(np.int32)
    kv = rng.standard_normal((2, s * pps + 1, ps, kvh * 2 * d)).astype(np.float32)
    q = rng.standard_normal((s, h, d)).astype(np.float32)
    cu = np.arange(s + 1, dtype=np.int32)
    return (jnp.asarray(q), jnp.asarray(kv), jnp.asarray([1], jnp.int32), jnp.asarray(kv_lens, jnp.int32),
            jnp.asarray(tables), jnp.asarray(cu), jnp.asarray([s], jnp.int32))


@pytest.mark.parametrize("window", [None, 33])
def test_cost_estimate_matches_copied_pages(window):
    """Full-context decode: the declared bytes equal q + out + metadata + the pages the kernel DMA'd (counted
    by the kernel itself); with a window each sequence copies only the pages of its window."""
    s, pps, ps, d, kvh, g = 8, 8, 16, 128, 1, 2
    kv_lens = np.full(s, pps * ps, np.int32)
    if window is not None:  # any alignment: with W - 1 a multiple of ps, every window spans (W-1)/ps + 1 pages
        kv_lens = np.random.default_rng(_seed()).integers(window, pps * ps + 1, size=s).astype(np.int32)
    args = _decode_batch(s, pps, ps, d, kvh, g, kv_lens)
    out, pages = paged_attention(*args, scale=0.1, sliding_window=window, interpret=INTERPRET,
                                 count_pages=True)
    pages = np.asarray(pages)
    if window is None:
        assert np.all(pages == pps)
    else:
        first = (kv_lens - window) // ps  # page of the first visible key (kv_len - 1 - W + 1)
        assert np.array_equal(pages, (kv_lens - 1) // ps - first + 1), (pages, kv_lens)
    h = kvh * g
    blocks = choose_blocks(s, h, d, kvh, ps, pps, 4, 4, CHIPS["v6e"])
    declared = cost(s, h, d, kvh, s, pps, ps, 4, 4, blocks, window, None).bytes_accessed
    measured = (2 * s * h * d * 4 + 4 * (s * pps + 2 * s + 3 + 2 * (s // blocks.block_q))
                + int(pages.sum()) * ps * kvh * 2 * d * 4)
    assert abs(measured - declared) <= 0.03 * declared, (measured, declared)
    want = reference(args, d=d, kvh=kvh, scale=0.1, window=window, soft_cap=None)
    assert np.linalg.norm(np.asarray(out) - np.asarray(want)) / np.linalg.norm(want) < F32_TOL


# ---- deviceless compile for v6e ----------------------------------------------------------------------

@pytest.mark.parametrize("fp8,d,kvh,g,window,ps", [(jnp.float8_e4m3fn, 128, 2, 2, 24, 16),
                                                    (jnp.float8_e5m2, 64, 2, 2, None, 16),
                                                    (jnp.float8_e4m3fn, 256, 1, 2, None, 32)])
def test_fp8_cache_matches_jax_reference(fp8, d, kvh, g, window, ps):
    """An FP8 cache (storage only: the pages are upcast in VMEM) against the oracle on the same fp8 values
    upcast to float32. q float32, so the tolerance is the float32 one above."""
    seed = _seed()
    args, n, info = make_batch(np.random.default_rng(seed), d=d, kvh=kvh, g=g, window=window, ps=ps,
                               pps=96 // ps)
    args = (args[0], args[1].astype(fp8), *args[2:])
    out = np.asarray(paged_attention(*args, scale=d ** -0.5, sliding_window=window, interpret=INTERPRET,
                                     block_q=8, pages_per_chunk=2))
    want = np.asarray(reference((args[0], args[1].astype(jnp.float32), *args[2:]), d=d, kvh=kvh,
                                scale=d ** -0.5, window=window, soft_cap=None))
    assert np.all(np.isfinite(out[:n])) and np.all(out[n:] == 0), f"seed={seed} {info}"
    err = np.linalg.norm(out[:n] - want) / np.linalg.norm(want)
    assert err < F32_TOL, f"seed={seed} {info} err={err:.2e}"


AOT = [(64, 8, 4, None, jnp.bfloat16), (128, 8, 4, None, jnp.bfloat16), (256, 16, 4, None, jnp.bfloat16),
       (512, 4, 4, None, jnp.bfloat16), (128, 8, 4, 256, jnp.bfloat16), (256, 8, 4, None, jnp.float8_e4m3fn)]


@pytest.mark.parametrize("d,kvh,g,window,kv_dtype", AOT)
def test_compiles_for_v6e_and_declares_its_bytes(d, kvh, g, window, kv_dtype):
    """Mosaic compiles the kernel for a v6e (no TPU needed) and XLA's count of the program's bytes is the
    declared estimate: the program is the kernel plus a few tiny metadata ops (and, for D = 64, a relayout of
    q and out between XLA's entry layout and the kernel's, ~3% here). q and out come and go as [T, H x D],
    as the projections give and take them (D >= 128: the kernel's own blocks, no relayout)."""
    from quantkit.runtime.aot import compile_for

    t, s, pps, ps, layers = 128, 16, 128, 16, 4
    h = kvh * g
    sds = jax.ShapeDtypeStruct
    args = (sds((t, h * d), jnp.bfloat16), sds((layers, s * pps + 1, ps, kvh * 2 * d), kv_dtype),
            sds((1,), jnp.int32), sds((s,), jnp.int32), sds((s, pps), jnp.int32), sds((s + 1,), jnp.int32),
            sds((1,), jnp.int32))

    def call(q, *a):  # q and out [T, H x D], as the projections give and take them
        out = paged_attention(q.reshape(t, h, d), *a, scale=d ** -0.5, sliding_window=window,
                              soft_cap=30.0 if window else None)
        return out.reshape(t, h * d)

    compiled, _ = compile_for("v6e", call, *args)
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    kv_bytes = jnp.dtype(kv_dtype).itemsize
    blocks = choose_blocks(t, h, d, kvh, ps, pps, 2, kv_bytes, CHIPS["v6e"])
    declared = cost(t, h, d, kvh, s, pps, ps, 2, kv_bytes, blocks, window, 30.0 if window else None).bytes_accessed
    assert abs(ca["bytes accessed"] - declared) <= 0.05 * declared, (ca["bytes accessed"], declared)


# ---- attention sinks (gpt-oss): one learned logit per head in the softmax, against transformers ---------

def _gpt_oss_reference(args, info, sinks, scale: float, window: int | None) -> np.ndarray:
    """transformers' GptOss eager attention (its own function, with the module's `sinks`) per sequence, on the
    keys and values the sequence's pages hold, causal (and windowed) by an additive mask: [n, H, D]."""
    import types

    import torch
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, kv, layer, _, tables, cu, _ = (np.asarray(a) for a in args)
    h, d = q.shape[1:]
    kvh = kv.shape[-1] // (2 * d)
    module = types.SimpleNamespace(sinks=torch.from_numpy(np.asarray(sinks)), num_key_value_groups=h // kvh,
                                   training=False)
    out = []
    for s, (ql, kl) in enumerate(zip(info["q_lens"], info["kv_lens"])):
        keys = kv[layer[0]][tables[s]].reshape(-1, kvh, 2, d)[:kl]  # [kl, KVH, 2, D]
        k, v = (torch.from_numpy(np.ascontiguousarray(keys[:, :, i].transpose(1, 0, 2)[None])) for i in (0, 1))
        qs = torch.from_numpy(np.ascontiguousarray(q[cu[s]:cu[s] + ql].transpose(1, 0, 2)[None]))  # [1, H, ql, D]
        qpos, kpos = np.arange(kl - ql, kl)[:, None], np.arange(kl)[None]
        vis = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
        mask = torch.from_numpy(np.where(vis, 0.0, -np.inf).astype(np.float32)[None, None])
        out.append(eager_attention_forward(module, qs, k, v, mask, scale)[0][0].numpy())  # [ql, H, D]
    return np.concatenate(out)


@pytest.mark.parametrize("window", [None, 20])
def test_sinks_match_transformers_gpt_oss_attention(window):
    """Both attention paths with gpt-oss's sinks (head size 64, 2 KV heads of 2 queries, sinks of either
    sign, most large enough to take a good part of a row's mass) on fresh ragged batches of decodes and chunks equal
    transformers' GptOss eager attention on the same keys and values: float32, the same math in another
    order (an online softmax whose running max and sum start at the sink), 1e-5; padding rows stay zero.
    Without the sinks the result is far from it (the test tells them apart)."""
    from quantkit.kernels.xla import paged_attention_xla

    seed = _seed()
    rng = np.random.default_rng(seed)
    args, n, info = make_batch(rng, d=64, kvh=2, g=2, window=window, page0=0.0)
    # sinks of either sign, three of them large enough against these scores (std 1) to take a good part of each
    # row's mass: so that the control below always tells the sinks apart (all-negative draws would not)
    sinks = jnp.asarray(rng.uniform(1.0, 3.0, 4) * np.array([1, -1, 1, 1]), jnp.float32)
    kw = dict(scale=0.125, sliding_window=window)
    want = _gpt_oss_reference(args, info, sinks, 0.125, window)
    for name, out in (("cpu", paged_attention_xla(*args, **kw, sinks=sinks)),
                      ("kernel", paged_attention(*args, sinks, **kw, interpret=INTERPRET, block_q=8, pages_per_chunk=2))):
        out = np.asarray(out)
        assert np.all(out[n:] == 0), f"{name} seed={seed} {info}"
        err = np.linalg.norm(out[:n] - want) / np.linalg.norm(want)
        assert err < 1e-5, f"{name} seed={seed} {info} err={err:.2e}"
    plain = np.asarray(paged_attention_xla(*args, **kw))[:n]
    assert np.linalg.norm(plain - want) / np.linalg.norm(want) > 1e-2, f"seed={seed}"


@pytest.mark.parametrize("chip", ["v6e", "v7x"])
def test_sinks_compile_and_declare_their_bytes(chip):
    """The kernel with sinks at gpt-oss's head size 64 (64 query heads over 8 KV heads) compiles deviceless
    for v6e and v7x, and XLA's count of the program's bytes is its declared estimate (the sinks: 4 bytes a
    head in SMEM), within the 5% of the D = 64 relayouts of q and out as above (a few MB here: 64 rows of 16
    sequences with 2048 cached tokens each)."""
    from quantkit.runtime.aot import compile_for

    t, s, pps, ps, layers, d, kvh, g, window = 64, 16, 128, 16, 2, 64, 8, 8, None
    h = kvh * g
    sds = jax.ShapeDtypeStruct
    args = (sds((t, h, d), jnp.bfloat16), sds((layers, s * pps + 1, ps, kvh * 2 * d), jnp.bfloat16),
            sds((1,), jnp.int32), sds((s,), jnp.int32), sds((s, pps), jnp.int32), sds((s + 1,), jnp.int32),
            sds((1,), jnp.int32), sds((h,), jnp.float32))
    compiled, _ = compile_for(chip, lambda *a: paged_attention(*a, scale=0.125, sliding_window=window, chip=chip),
                              *args)
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    blocks = choose_blocks(t, h, d, kvh, ps, pps, 2, 2, CHIPS[chip])
    declared = cost(t, h, d, kvh, s, pps, ps, 2, 2, blocks, window, None, sinks=True).bytes_accessed
    assert abs(ca["bytes accessed"] - declared) <= 0.05 * declared, (ca["bytes accessed"], declared)
    assert "paged_attention" in compiled.as_text()


# ---- the CPU path (kernels/xla.py): the runtime's attention off TPU -------------------------------------

@pytest.mark.parametrize("d,kvh,g,window,soft_cap,short", [(64, 2, 2, None, None, 1), (128, 1, 4, 24, 20.0, 5),
                                                           (256, 2, 1, 40, None, 1), (32, 2, 2, 9, 30.0, 2)])
def test_cpu_path_matches_jax_reference(d, kvh, g, window, soft_cap, short):
    """paged_attention_xla on fresh random ragged batches (decodes and chunks, poisoned pages; rows of up to
    `short` queries computed together) equals jax's ref_ragged_paged_attention. float32, same math, another
    summation order (chunked online softmax): 1e-5."""
    from quantkit.kernels.xla import paged_attention_xla

    seed = _seed()
    rng = np.random.default_rng(seed)
    args, n, info = make_batch(rng, d=d, kvh=kvh, g=g, window=window, ps=8 if d == 32 else 16)
    out = np.asarray(paged_attention_xla(*args, scale=d ** -0.5, sliding_window=window, soft_cap=soft_cap,
                                         chunk_pages=2, short=short))
    want = np.asarray(reference(args, d=d, kvh=kvh, scale=d ** -0.5, window=window, soft_cap=soft_cap))
    assert np.all(np.isfinite(out[:n])) and np.all(out[n:] == 0), f"seed={seed} {info}"
    err = np.linalg.norm(out[:n] - want) / np.linalg.norm(want)
    assert err < 1e-5, f"seed={seed} {info} err={err:.2e}"


@pytest.mark.parametrize("q_lens,short", [([40, 1, 1], 1), ([11, 5, 2, 40], 1), ([1, 1, 1], 1), ([5, 1], 1),
                                          ([20, 12], 1), ([5, 1, 3, 40], 5), ([4], 5), ([2, 5, 5, 1], 5),
                                          ([6, 5, 1], 5), ([1, 33], 3)])
def test_cpu_path_computes_every_block_it_needs(q_lens, short):
    """The CPU path computes the query blocks in use one after another (one, two, several; 32 rows a block
    here), and the rows of sequences with at most `short` queries (decodes; a verifying step's token and
    drafts) together, only one sequence's when at most one has such rows (here one beside a chunk), else
    all: each case against the oracle."""
    from quantkit.kernels.xla import paged_attention_xla

    seed = _seed()
    args, n, info = make_batch(np.random.default_rng(seed), d=64, kvh=2, g=2, t=64, q_lens=q_lens, pps=8)
    out = np.asarray(paged_attention_xla(*args, scale=0.125, short=short))
    want = np.asarray(reference(args, d=64, kvh=2, scale=0.125, window=None, soft_cap=None))
    assert np.all(out[n:] == 0) and np.linalg.norm(out[:n] - want) / np.linalg.norm(want) < 1e-5, f"seed={seed}"


def test_kernel_in_interpret_mode_equals_cpu_path():
    """The two attention paths of the runtime agree (float32, tolerance as against the oracle)."""
    from quantkit.kernels.xla import paged_attention_xla

    seed = _seed()
    args, n, info = make_batch(np.random.default_rng(seed), d=128, kvh=2, g=2, window=20)
    kw = dict(scale=0.1, sliding_window=20, soft_cap=None)
    tpu = np.asarray(paged_attention(*args, **kw, interpret=INTERPRET, block_q=8, pages_per_chunk=2))
    cpu = np.asarray(paged_attention_xla(*args, **kw))
    assert np.linalg.norm(tpu[:n] - cpu[:n]) / np.linalg.norm(cpu[:n]) < F32_TOL, f"seed={seed} {info}"
