"""Where gmm_v2's decode time goes on a real TPU (exploration: variants of the dense W4A16 g128 kernel).

Each variant is timed per call as tpu_gmm.per_call does: N calls chained in one jitted program, the device's
time from a profile of it. Variants: the production kernel; scales on each group's [m, tn] partial sums (no
per-element scale multiply); pre-dot with int4 -> bf16 directly; m = 1 on the vector unit alone.
--controls (dense shapes): partial sums at several tiles beside three controls: the streamed int4 tile only
converted to bf16 and stored (DMA + conversion), barely touched (DMA and the grid's steps), and a bf16 tile
read once and multiplied as the kernel's K = 128 dots at every step (the MXU alone).

Usage (on the chip): python3 benchmarks/tpu_gmm_variants.py [--controls] --out $OUT/probe.jsonl
Run 1's figures in docs/benchmarks.md ("Measured on a TPU v5e") were taken with the kernel of c1ddedc as
"prod", timed on the host (the chain less a one-call chain); run 5's (--controls) likewise, at 62060d7.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from quantkit.kernels.gmm_v2 import gmm_v2  # noqa: E402
from tpu_gmm import open_run, per_call  # noqa: E402
from quantkit.quant.qtensor import make_qtensor  # noqa: E402

HBM = 819e9


def _kernel(x_ref, q_ref, s_ref, o_ref, acc_ref, *scratch, mode, tk, nk, group):
    ki = pl.program_id(1)

    @pl.when(ki == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[:, pl.ds(pl.multiple_of(ki * tk, 128), tk)]
    if mode in ("post", "post_f32", "mxu_k128"):  # unscaled int4 -> bf16 per group (post_f32: through float32;
        acc = acc_ref[...]           # mxu_k128: q_ref holds a bf16 tile, read once), scales on the partial sums
        for j in range(tk // group):
            q = q_ref[j * group:(j + 1) * group, :]
            q = q if mode == "mxu_k128" else (q.astype(jnp.float32) if mode == "post_f32" else q).astype(jnp.bfloat16)
            y = jnp.dot(x[:, j * group:(j + 1) * group], q, preferred_element_type=jnp.float32)
            acc += y * s_ref[j:j + 1, :].astype(jnp.float32)
        acc_ref[...] = acc
    elif mode == "pre_bf16":  # production math, int4 -> bf16 directly and scaled in bf16
        q = q_ref[...].astype(jnp.bfloat16).reshape(tk // group, group, -1)
        w = (q * s_ref[...].astype(jnp.bfloat16)[:, None, :]).reshape(tk, -1)
        acc_ref[...] += jnp.dot(x, w, preferred_element_type=jnp.float32)
    elif mode == "cvt_only":  # the streamed int4 tile converted to bf16 and stored whole (no dot): DMA + VPU
        scratch[0][...] = q_ref[...].astype(jnp.bfloat16)
    elif mode == "dma_only":  # the streamed tile barely touched: DMA and the grid's steps alone
        acc_ref[0:1, :] += q_ref[0:1, :].astype(jnp.float32)

    @pl.when(ki == nk - 1)
    def _():
        o_ref[...] = acc_ref[0:o_ref.shape[0], :].astype(o_ref.dtype)  # the scratch has at least 8 rows


def _kernel2(x_ref, qa_ref, qb_ref, s_ref, o_ref, acc_ref, *, mode, tk, nk, group):
    """post / dma_only with the weight tile as two blocks (its upper and lower halves of k): two DMAs in
    flight at once instead of one."""
    ki = pl.program_id(1)

    @pl.when(ki == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[:, pl.ds(pl.multiple_of(ki * tk, 128), tk)]
    if mode == "post2":
        acc = acc_ref[...]
        for j in range(tk // group):
            q_ref, r = (qa_ref, j) if j < tk // group // 2 else (qb_ref, j - tk // group // 2)
            q = q_ref[r * group:(r + 1) * group, :].astype(jnp.bfloat16)
            y = jnp.dot(x[:, j * group:(j + 1) * group], q, preferred_element_type=jnp.float32)
            acc += y * s_ref[j:j + 1, :].astype(jnp.float32)
        acc_ref[...] = acc
    else:
        acc_ref[0:1, :] += qa_ref[0:1, :].astype(jnp.float32) + qb_ref[0:1, :].astype(jnp.float32)

    @pl.when(ki == nk - 1)
    def _():
        o_ref[...] = acc_ref[0:o_ref.shape[0], :].astype(o_ref.dtype)


def _vpu_kernel(x_ref, q_ref, s_ref, o_ref, acc_ref, *, tk, nk, group):
    """m = 1 without the MXU: x as a column, each group's products summed over its rows on the VPU."""
    ki = pl.program_id(1)

    @pl.when(ki == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    q = q_ref[...].astype(jnp.float32).reshape(tk // group, group, -1)
    xc = x_ref[pl.ds(pl.multiple_of(ki * tk, 128), tk), :].reshape(tk // group, group, 1)
    p = jnp.sum(q * xc, axis=1)  # [tk/group, tn]
    acc_ref[0:1, :] += jnp.sum(p * s_ref[...].astype(jnp.float32), axis=0, keepdims=True)

    @pl.when(ki == nk - 1)
    def _():
        o_ref[...] = acc_ref[0:1, :].astype(o_ref.dtype)


def _stream_kernel(x_ref, *refs, nw, chunks, nbuf, cn, group, compute):
    """Manual DMA: the weights' column slabs [k, cn] (and their scale slabs) streamed through `nbuf` VMEM
    buffers, each slab's output columns computed whole (all k) as soon as it lands; several weights (q, k, v)
    one continuous stream."""
    q_hbm, s_hbm, outs = refs[:nw], refs[nw:2 * nw], refs[2 * nw:3 * nw]
    qbuf, sbuf, sem = refs[3 * nw:]
    k = x_ref.shape[1]

    def copy(i):
        j, c = chunks[i]
        slot = i % nbuf
        return (pltpu.make_async_copy(q_hbm[j].at[:, pl.ds(c * cn, cn)], qbuf.at[slot], sem.at[0, slot]),
                pltpu.make_async_copy(s_hbm[j].at[:, pl.ds(c * cn, cn)], sbuf.at[slot], sem.at[1, slot]))

    for i in range(min(nbuf, len(chunks))):
        for cp in copy(i):
            cp.start()
    for i, (j, c) in enumerate(chunks):
        slot = i % nbuf
        for cp in copy(i):
            cp.wait()
        if compute:  # 16 groups an iteration: their bf16 scale rows one aligned block
            def body(r, acc):
                s16 = sbuf[slot, pl.ds(pl.multiple_of(r * 16, 16), 16), :].astype(jnp.float32)
                for j in range(16):
                    rows = pl.ds(pl.multiple_of((r * 16 + j) * group, group), group)
                    p = jnp.dot(x_ref[:, rows], qbuf[slot, rows, :].astype(jnp.bfloat16),
                                preferred_element_type=jnp.float32)
                    acc = acc + p * s16[j:j + 1, :]
                return acc
            acc = jax.lax.fori_loop(0, k // group // 16, body, jnp.zeros((x_ref.shape[0], cn), jnp.float32))
        else:
            acc = jnp.broadcast_to(qbuf[slot, 0:1, :].astype(jnp.float32), (x_ref.shape[0], cn))
        outs[j][:, pl.ds(c * cn, cn)] = acc.astype(outs[j].dtype)
        if i + nbuf < len(chunks):
            for cp in copy(i + nbuf):
                cp.start()


@functools.partial(jax.jit, static_argnames=("cn", "nbuf", "compute", "interpret"))
def stream(x, qs, ss, *, cn=256, nbuf=3, compute=True, interpret=False):
    """x [m, k] bf16 against weights qs[j] [k, n_j] int4 with g128 scales ss[j]: one call, outputs per weight."""
    m, k = x.shape
    nw = len(qs)
    chunks = tuple((j, c) for j, q in enumerate(qs) for c in range(q.shape[1] // cn))
    return pl.pallas_call(
        functools.partial(_stream_kernel, nw=nw, chunks=chunks, nbuf=nbuf, cn=cn, group=128, compute=compute),
        out_shape=[jax.ShapeDtypeStruct((m, q.shape[1]), jnp.bfloat16) for q in qs],
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)] + [pl.BlockSpec(memory_space=pl.ANY)] * (2 * nw),
        out_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)] * nw,
        scratch_shapes=[pltpu.VMEM((nbuf, k, cn), qs[0].dtype), pltpu.VMEM((nbuf, k // 128, cn), ss[0].dtype),
                        pltpu.SemaphoreType.DMA((2, nbuf))],
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=100 << 20),
        name="variant", interpret=interpret,
    )(x, *qs, *ss)


@functools.partial(jax.jit, static_argnames=("mode", "tk", "tn", "group", "const", "n"))
def variant(x, q, s, *, mode, tk, tn, group=128, const=False, n=0):
    """One variant's call; `const`: q (and s) hold one tile, read once, used at every step of the n x k grid."""
    m, k = x.shape
    n = n or q.shape[1]
    nk = k // tk
    cmap = (lambda ni, ki: (0, 0))
    qmap = cmap if const else (lambda ni, ki: (ki, ni))
    smap = cmap if const else (lambda ni, ki: (ki, ni))
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=100 << 20)
    if mode == "vpu":  # x as a column, one row per input feature
        return pl.pallas_call(
            functools.partial(_vpu_kernel, tk=tk, nk=nk, group=group),
            out_shape=jax.ShapeDtypeStruct((m, n), jnp.bfloat16), grid=(n // tn, nk),
            in_specs=[pl.BlockSpec((k, 1), lambda ni, ki: (0, 0)), pl.BlockSpec((tk, tn), qmap),
                      pl.BlockSpec((tk // group, tn), smap)],
            out_specs=pl.BlockSpec((m, tn), lambda ni, ki: (0, ni)),
            scratch_shapes=[pltpu.VMEM((max(m, 8), tn), jnp.float32)], compiler_params=params, name="variant",
        )(x.reshape(k, 1).astype(jnp.float32), q, s)
    if mode in ("post2", "dma2"):
        return pl.pallas_call(
            functools.partial(_kernel2, mode=mode, tk=tk, nk=nk, group=group),
            out_shape=jax.ShapeDtypeStruct((m, n), jnp.bfloat16), grid=(n // tn, nk),
            in_specs=[pl.BlockSpec((m, k), lambda ni, ki: (0, 0)),
                      pl.BlockSpec((tk // 2, tn), lambda ni, ki: (2 * ki, ni)),
                      pl.BlockSpec((tk // 2, tn), lambda ni, ki: (2 * ki + 1, ni)),
                      pl.BlockSpec((tk // group, tn), smap)],
            out_specs=pl.BlockSpec((m, tn), lambda ni, ki: (0, ni)),
            scratch_shapes=[pltpu.VMEM((max(m, 8), tn), jnp.float32)], compiler_params=params, name="variant",
        )(x, q, q, s)
    extra = [pltpu.VMEM((tk, tn), jnp.bfloat16)] if mode == "cvt_only" else []
    return pl.pallas_call(
        functools.partial(_kernel, mode=mode, tk=tk, nk=nk, group=group),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.bfloat16), grid=(n // tn, nk),
        in_specs=[pl.BlockSpec((m, k), lambda ni, ki: (0, 0)), pl.BlockSpec((tk, tn), qmap),
                  pl.BlockSpec((tk // group, tn), smap)],
        out_specs=pl.BlockSpec((m, tn), lambda ni, ki: (0, ni)),
        scratch_shapes=[pltpu.VMEM((max(m, 8), tn), jnp.float32)] + extra, compiler_params=params, name="variant",
    )(x, q, s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe.jsonl")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default="", help="dense shapes whose name holds one of these, e.g. q/o,k/v")
    ap.add_argument("--tiles", default="", help="tk x tn tiles to try instead of the defaults, e.g. 512x4096,1024x1024; "
                    "with --controls: post and dma_only only")
    ap.add_argument("--controls", action="store_true", help="dense shapes only: where a call's time goes (DMA, "
                    "int4 conversion, the MXU in either orientation)")
    ap.add_argument("--stream", action="store_true", help="the manual-DMA column-slab stream beside production, "
                    "one weight and q+k+v / gate+up as one stream")
    ap.add_argument("--no-prod", action="store_true", help="--stream: without production's figures")
    a = ap.parse_args()
    _, log = open_run(a.out)
    rng = np.random.default_rng(0)
    if a.stream:
        return stream_table(rng, log, a.shapes.split(",") if a.shapes else (), prod=not a.no_prod)

    shapes = {"q/o": (4096, 4096), "k/v": (4096, 1024), "gate/up": (4096, 14336), "down": (14336, 4096)}
    for name, (k, n) in shapes.items():
        if a.controls and name == "gate/up":
            continue
        vals = rng.integers(-8, 8, (1, k, n)).astype(np.int8)
        sc = (rng.uniform(0.5, 2, (1, k // 128, n)) / 64).astype(np.float32)
        rhs = make_qtensor(vals, jnp.asarray(sc, jnp.bfloat16), "int4", 128)
        q, s = rhs.values[0], rhs.scales[0]
        wbf = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
        floor_w = (k * n / 2 + k // 128 * n * 2) / HBM
        if a.shapes and not any(w in name for w in a.shapes.split(",")):
            continue
        for m in (1, 8, 64) if not a.quick else (8,):
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            ref = np.asarray(jnp.dot(x.astype(jnp.float32), (q.astype(jnp.float32).reshape(k // 128, 128, n)
                                     * s.astype(jnp.float32)[:, None]).reshape(k, n),
                                     precision=jax.lax.Precision.HIGHEST))
            floor = floor_w + (m * k * 2 + m * n * 2) / HBM
            sizes = jnp.array([m], jnp.int32)
            runs = [("prod", lambda x, rhs: gmm_v2(x, rhs, jnp.array([x.shape[0]], jnp.int32), chip="v5e"), (x, rhs)),
                    ("xla_bf16", lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16), (x, wbf))]
            tiles = [tuple(map(int, t.split("x"))) for t in a.tiles.split(",")] if a.tiles else \
                ((1024, 4096), (2048, 2048), (4096, 1024), (1024, 1024))
            for tk, tn in tiles:
                if k % tk or n % tn or not a.tiles and (k // tk * (n // tn) < 2 and k * n > 4096 * 4096
                                                         or (tk, tn) == (1024, 1024) and n > 1024):
                    continue
                modes = (("post", "dma_only") if a.controls else ("post",)) if a.tiles else \
                    ("post", "post2", "dma_only", "dma2") if a.controls else ("post", "pre_bf16")
                for mode in modes + (("vpu",) if m == 1 and not a.controls else ()):
                    runs.append((f"{mode} {tk}x{tn}", functools.partial(variant, mode=mode, tk=tk, tn=tn), (x, q, s)))
                if a.controls and not a.tiles:  # the MXU alone on a bf16 tile read once, as the kernel's K=128 dots (a K=tk dot and
                    # the transposed orientation, the weights streaming against the stationary lhs, took 1.2-2x and
                    # 2.5-3.5x as long: run 5)
                    runs.append((f"mxu_k128 {tk}x{tn}", functools.partial(variant, mode="mxu_k128", tk=tk, tn=tn, n=n,
                                                                          const=True), (x, wbf[:tk, :tn], s)))
            for label, fn, args in runs:
                try:
                    t0 = time.perf_counter()
                    res = np.asarray(fn(*args)).astype(np.float32)
                    err = float(np.linalg.norm(res - ref) / np.linalg.norm(ref)) if label.split()[0] in \
                        ("prod", "post", "post2", "pre_bf16", "vpu", "xla_bf16") else None  # controls compute nothing useful
                    t = per_call(fn, args, whole=label.startswith("xla"), match="" if label.startswith("xla") else
                                 "gmm_v2" if label == "prod" else "variant")
                    log(shape=name, m=m, variant=label, us=round(t * 1e6, 2), floor_us=round(floor * 1e6, 2),
                        ratio=round(t / floor, 3), err=err, wall=round(time.perf_counter() - t0, 1))
                except Exception as e:  # noqa: BLE001
                    log(shape=name, m=m, variant=label, error=f"{type(e).__name__}: {str(e)[:300]}")

    if a.controls or a.tiles or a.shapes:
        return
    # Qwen3-30B-A3B experts: 128 experts, top 8, gated pair gate/up [2048, 768] x2, down [768, 2048]
    for name, (k, n, pair) in {"moe gate/up": (2048, 768, True), "moe down": (768, 2048, False)}.items():
        g = 128
        mk = lambda: make_qtensor(rng.integers(-8, 8, (g, k, n)).astype(np.int8),  # noqa: E731
                                  jnp.asarray((rng.uniform(0.5, 2, (g, k // 128, n)) / 64), jnp.bfloat16), "int4", 128)
        a_, b_ = mk(), mk() if pair else None
        wbf = jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16)
        for tokens in (1, 8, 64, 512):
            m = tokens * 8
            experts = rng.choice(g, size=(tokens, 8), replace=True)
            sizes = jnp.asarray(np.bincount(experts.ravel(), minlength=g), jnp.int32)
            active = int((np.asarray(sizes) > 0).sum())
            floor = active * (k * n / 2 + k // 128 * n * 2) * (2 if pair else 1) / HBM + (m * k * 2 + m * n * 2) / HBM
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            kw = dict(up=b_, gate="silu") if pair else {}
            runs = [("prod", lambda x, a_, sizes: gmm_v2(x, a_, sizes, chip="v5e", **kw), (x, a_, sizes)),
                    ("ragged_dot bf16", lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes), (x, wbf, sizes))]
            try:
                from jax.experimental.pallas.ops.tpu.megablox import gmm as mb
                runs.append(("megablox bf16", lambda x, w, sizes: mb(x, w, sizes, preferred_element_type=jnp.bfloat16,
                                                                      tiling=(min(128, m), 128 if k % 128 == 0 else k, 128)),
                             (x, wbf, sizes)))
            except Exception as e:  # noqa: BLE001
                log(shape=name, variant="megablox import", error=str(e)[:200])
            for label, fn, args in runs:
                try:
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(*args))
                    t = per_call(fn, args, whole=not label.startswith("prod"), match="gmm_v2" if label == "prod" else "")
                    log(shape=name, tokens=tokens, active=active, variant=label, us=round(t * 1e6, 2),
                        floor_us=round(floor * 1e6, 2), ratio=round(t / floor, 3), wall=round(time.perf_counter() - t0, 1))
                except Exception as e:  # noqa: BLE001
                    log(shape=name, tokens=tokens, variant=label, error=f"{type(e).__name__}: {str(e)[:300]}")


def stream_table(rng, log, only=(), prod=True):
    def w(k, n):
        return make_qtensor(rng.integers(-8, 8, (1, k, n)).astype(np.int8),
                            jnp.asarray(rng.uniform(0.5, 2, (1, k // 128, n)) / 64, jnp.bfloat16), "int4", 128)

    qo, kv, gu, dn = w(4096, 4096), w(4096, 1024), w(4096, 14336), w(14336, 4096)
    sets = {"q/o": [qo], "k/v": [kv], "down": [dn], "q+k+v": [qo, kv, kv], "gate+up": [gu, gu]}
    for m in (8, 64):
        for name, ws in sets.items():
            if only and name not in only:
                continue
            k = ws[0].shape[1]
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            floor = (sum(a.shape[1] * a.shape[2] / 2 + a.scales.nbytes for a in ws) + m * k * 2
                     + sum(m * a.shape[2] * 2 for a in ws)) / HBM
            refs = [np.asarray(jnp.dot(x.astype(jnp.float32), (a.values[0].astype(jnp.float32).reshape(k // 128, 128, -1)
                    * a.scales[0].astype(jnp.float32)[:, None]).reshape(k, -1), precision=jax.lax.Precision.HIGHEST))
                    for a in ws]
            qs, ss = [a.values[0] for a in ws], [a.scales[0] for a in ws]
            sizes = jnp.array([m], jnp.int32)
            runs = []
            if prod and name == "gate+up":
                runs.append(("prod pair", lambda x, a, b: gmm_v2(x, a, sizes, chip="v5e", up=b, gate="silu"), (x, ws[0], ws[1]), "gmm_v2"))
            elif prod:
                for i, a in enumerate(ws):
                    runs.append((f"prod {i}", lambda x, a: gmm_v2(x, a, sizes, chip="v5e"), (x, a), "gmm_v2"))
            for cn, nbuf, compute in ((256, 2, True), (256, 3, True), (512, 2, True), (512, 3, True), (128, 4, True),
                                      (512, 3, False)):
                runs.append((f"stream cn{cn} buf{nbuf}" + ("" if compute else " dma_only"),
                             functools.partial(lambda x, qs, ss, **kw: stream(x, qs, ss, **kw)[0], cn=cn, nbuf=nbuf,
                                               compute=compute), (x, qs, ss), "variant"))
            prod_total = 0.0
            for label, fn, args, match in runs:
                try:
                    t0 = time.perf_counter()
                    res = fn(*args)
                    err = None
                    if label.startswith("stream") and "dma_only" not in label:
                        outs = stream(x, qs, ss, cn=int(label.split()[1][2:]), nbuf=int(label.split()[2][3:]))
                        err = max(float(np.linalg.norm(np.asarray(o, np.float32) - r) / np.linalg.norm(r))
                                  for o, r in zip(outs, refs))
                    elif label.startswith("prod") and name != "gate+up":
                        r = refs[int(label.split()[1])]
                        err = float(np.linalg.norm(np.asarray(res, np.float32) - r) / np.linalg.norm(r))
                    t = per_call(fn, args, match=match)
                    if label.startswith("prod"):
                        prod_total += t
                    log(shape=name, m=m, variant=label, us=round(t * 1e6, 2), floor_us=round(floor * 1e6, 2),
                        ratio=round(t / floor, 3), err=err, wall=round(time.perf_counter() - t0, 1))
                except Exception as e:  # noqa: BLE001
                    log(shape=name, m=m, variant=label, error=f"{type(e).__name__}: {str(e)[:300]}")
            log(shape=name, m=m, variant="prod total", us=round(prod_total * 1e6, 2), floor_us=round(floor * 1e6, 2),
                ratio=round(prod_total / floor, 3))


if __name__ == "__main__":
    main()
