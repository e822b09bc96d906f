"""The ragged paged-attention kernel on a TPU, per call, against its KV bytes, side by side in one run.

Llama-3-8B's attention (32 query heads, 8 KV heads of 128, 16-token pages, bf16 cache): decode batches of
B sequences with C keys each (one query row a sequence), and a prefill chunk; for each, the kernel's tilings
(block_q: query rows a grid step; pages_per_chunk: pages a DMA chunk) around its default, timed on the device
(tpu_gmm.per_call: 32 calls chained in one jitted program, the kernel's own time from a profile of it). Floor:
the pages the call must read (every sequence's keys, its last page whole) / the chip's HBM bandwidth.

--page-sizes: the same cases at other page sizes (the runtime's is 16; each page is one DMA descriptor), at the
default tiling only (--default-only: likewise at 16).

Usage (on the chip): python3 benchmarks/tpu_attention.py [--page-sizes 16,32,64] [--default-only] [--out F]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tpu_gmm import open_run, per_call  # noqa: E402
from quantkit.kernels.paged_attention import choose_blocks, paged_attention  # noqa: E402
from quantkit.kernels.tiling import CHIPS  # noqa: E402

H, KVH, D = 32, 8, 128


def case(rng, seqs: int, keys: int, rows: int, ps: int):
    """seqs sequences of `keys` keys, the last `rows` of each the step's queries."""
    pps = -(-keys // ps)
    pages = seqs * pps + 1
    kv = jnp.asarray(rng.standard_normal((1, pages, ps, KVH * 2 * D), np.float32), jnp.bfloat16)
    tables = jnp.asarray(1 + np.arange(seqs * pps).reshape(seqs, pps), jnp.int32)
    t = -(-seqs * rows // 8) * 8  # the runtime's token buckets are multiples of 8; rows past the last are padding
    q = jnp.asarray(rng.standard_normal((t, H, D), np.float32), jnp.bfloat16)
    lens = jnp.full((seqs,), keys, jnp.int32)
    cu = jnp.asarray(np.arange(seqs + 1) * rows, jnp.int32)
    return q, kv, lens, tables, cu, seqs * pps * ps * KVH * 2 * D * 2


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tpu_attention.jsonl")
    ap.add_argument("--page-sizes", default="16")
    ap.add_argument("--default-only", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="also each case with an FP8 (e4m3) cache, default tiling")
    a = ap.parse_args()
    chip, log = open_run(a.out)
    rng = np.random.default_rng(0)
    hbm = CHIPS[chip].hbm_bytes_per_s
    sizes = [int(x) for x in a.page_sizes.split(",")]
    for (seqs, keys, rows), ps in ((c, ps) for c in ((64, 145, 1), (16, 145, 1), (1, 145, 1), (128, 145, 1),
                                                      (64, 1024, 1), (16, 512, 128)) for ps in sizes):
        q, kv, lens, tables, cu, nbytes = case(rng, seqs, keys, rows, ps)
        t = q.shape[0]
        default = choose_blocks(t, H, D, KVH, ps, tables.shape[1], 2, 2, CHIPS[chip])
        only = a.default_only or sizes != [16]
        bqs = {default.block_q} if only else {8, 16, 32, default.block_q} & {b for b in (8, 16, 32, 64) if t % b == 0}
        ppcs = {default.pages_per_chunk} if only else \
            {4, 8, 16, default.pages_per_chunk} & set(range(1, tables.shape[1] + 1))
        runs = [(bq, ppc, "bf16") for bq in sorted(bqs) for ppc in sorted(ppcs)]
        if a.fp8:  # the default tiling again with the cache in e4m3
            runs.append((default.block_q, default.pages_per_chunk, "fp8"))
        for bq, ppc, kind in runs:
            cache = kv.astype(jnp.float8_e4m3fn) if kind == "fp8" else kv
            fn = lambda q, kv, l, bt, cu: paged_attention(  # noqa: E731
                q, kv, jnp.zeros((1,), jnp.int32), l, bt, cu, jnp.array([seqs], jnp.int32), scale=D ** -0.5,
                chip=chip, block_q=bq, pages_per_chunk=ppc).reshape(t, H * D)
            what = dict(seqs=seqs, keys=keys, rows=rows, page_size=ps, kv=kind, block_q=bq, pages_per_chunk=ppc)
            try:
                us = per_call(fn, (q, cache, lens, tables, cu), match="paged_attention") * 1e6
            except Exception as e:  # noqa: BLE001 -- a tiling that does not fit is reported, the rest run
                log(**what, error=str(e)[:200])
                continue
            floor = nbytes / (2 if kind == "fp8" else 1) / hbm * 1e6
            log(**what, default=(bq, ppc) == (default.block_q, default.pages_per_chunk), us=round(us, 2),
                floor_us=round(floor, 2), ratio=round(us / floor, 2))

if __name__ == "__main__":
    main()
