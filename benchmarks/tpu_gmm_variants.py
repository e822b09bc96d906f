"""Where gmm_v2's decode time goes on a real TPU (exploration: variants of the dense W4A16 g128 kernel).

Each variant is timed per call with the host's dispatch removed: N calls chained in one jitted program
(lax.fori_loop, each input depending on the last output), minus the same program with one call, over N - 1.
Variants: the production kernel; scales on each group's [m, tn] partial sums (no per-element scale multiply);
int4 -> bf16 directly; an MXU-only control (a bf16 tile read once from HBM, multiplied at every step) and a
dequantize-only control (the int4 tile read once, dequantized and stored at every step).

Usage (on the chip): python3 benchmarks/tpu_gmm_variants.py --out $OUT/probe.jsonl
Its figures in docs/benchmarks.md ("Measured on a TPU v5e") were taken with the kernel of c1ddedc as
"prod" and before the fix of m < 8 rows in the variants' output write (those rows then failed).
"""

from __future__ import annotations

import argparse
import functools
import json
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
from tpu_gmm import per_call  # noqa: E402
from quantkit.quant.qtensor import make_qtensor  # noqa: E402

HBM = 819e9


def _kernel(x_ref, q_ref, s_ref, o_ref, acc_ref, *, mode, tk, nk, group):
    ki = pl.program_id(1)

    @pl.when(ki == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[:, pl.ds(pl.multiple_of(ki * tk, 128), tk)]
    if mode in ("post", "post_f32"):  # unscaled int4 -> bf16 per group (post_f32: through float32), scales on
        acc = acc_ref[...]           # the [m, tn] partial sums
        for j in range(tk // group):
            q = q_ref[j * group:(j + 1) * group, :]
            q = (q.astype(jnp.float32) if mode == "post_f32" else q).astype(jnp.bfloat16)
            y = jnp.dot(x[:, j * group:(j + 1) * group], q, preferred_element_type=jnp.float32)
            acc += y * s_ref[j:j + 1, :].astype(jnp.float32)
        acc_ref[...] = acc
    elif mode == "pre_bf16":  # production math, int4 -> bf16 directly and scaled in bf16
        q = q_ref[...].astype(jnp.bfloat16).reshape(tk // group, group, -1)
        w = (q * s_ref[...].astype(jnp.bfloat16)[:, None, :]).reshape(tk, -1)
        acc_ref[...] += jnp.dot(x, w, preferred_element_type=jnp.float32)
    elif mode == "mxu_only":  # q_ref holds a bf16 tile, read once
        acc_ref[...] += jnp.dot(x, q_ref[...], preferred_element_type=jnp.float32)
    elif mode == "deq_only":  # dequantize, store, no dot
        q = q_ref[...].astype(jnp.float32).reshape(tk // group, group, -1)
        w = (q * s_ref[...].astype(jnp.float32)[:, None, :]).reshape(tk, -1).astype(jnp.bfloat16)
        acc_ref[0:8, :] += w[0:8, :].astype(jnp.float32)

    @pl.when(ki == nk - 1)
    def _():
        o_ref[...] = acc_ref[0:o_ref.shape[0], :].astype(o_ref.dtype)  # the scratch has at least 8 rows


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


@functools.partial(jax.jit, static_argnames=("mode", "tk", "tn", "group", "const"))
def variant(x, q, s, *, mode, tk, tn, group=128, const=False):
    m, k = x.shape
    n = q.shape[1]
    nk = k // tk
    xk = x
    if mode == "vpu":  # x as a column, one row per input feature
        xk = x.reshape(k, 1).astype(jnp.float32)
    cmap = (lambda ni, ki: (0, 0))
    qmap = cmap if const else (lambda ni, ki: (ki, ni))
    smap = cmap if const else (lambda ni, ki: (ki, ni))
    x_spec = pl.BlockSpec((k, 1), lambda ni, ki: (0, 0)) if mode == "vpu" else pl.BlockSpec((m, k), lambda ni, ki: (0, 0))
    kern = functools.partial(_vpu_kernel if mode == "vpu" else functools.partial(_kernel, mode=mode),
                             tk=tk, nk=nk, group=group)
    return pl.pallas_call(
        kern, out_shape=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        grid=(n // tn, nk),
        in_specs=[x_spec, pl.BlockSpec((tk, tn), qmap), pl.BlockSpec((tk // group, tn), smap)],
        out_specs=pl.BlockSpec((m, tn), lambda ni, ki: (0, ni)),
        scratch_shapes=[pltpu.VMEM((max(m, 8), tn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=100 << 20),
    )(xk, q, s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe.jsonl")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    print(jax.devices(), flush=True)
    rng = np.random.default_rng(0)
    out = open(a.out, "a")

    def log(**r):
        print(json.dumps(r), flush=True)
        out.write(json.dumps(r) + "\n")
        out.flush()

    shapes = {"q/o": (4096, 4096), "k/v": (4096, 1024), "gate/up": (4096, 14336), "down": (14336, 4096)}
    for name, (k, n) in shapes.items():
        vals = rng.integers(-8, 8, (1, k, n)).astype(np.int8)
        sc = (rng.uniform(0.5, 2, (1, k // 128, n)) / 64).astype(np.float32)
        rhs = make_qtensor(vals, jnp.asarray(sc, jnp.bfloat16), "int4", 128)
        q, s = rhs.values[0], rhs.scales[0]
        wbf = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
        floor_w = (k * n / 2 + k // 128 * n * 2) / HBM
        for m in (1, 8, 64) if not a.quick else (8,):
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            ref = np.asarray(jnp.dot(x.astype(jnp.float32), (q.astype(jnp.float32).reshape(k // 128, 128, n)
                                     * s.astype(jnp.float32)[:, None]).reshape(k, n),
                                     precision=jax.lax.Precision.HIGHEST))
            floor = floor_w + (m * k * 2 + m * n * 2) / HBM
            sizes = jnp.array([m], jnp.int32)
            runs = [("prod", lambda x, rhs: gmm_v2(x, rhs, jnp.array([x.shape[0]], jnp.int32), chip="v5e"), (x, rhs)),
                    ("xla_bf16", lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16), (x, wbf))]
            for tk, tn in ((1024, 4096), (2048, 2048), (512, 4096), (4096, 1024)):
                if k % tk or n % tn or k // tk * (n // tn) < 2 and k * n > 4096 * 4096:
                    continue
                for mode in ("post", "pre_bf16") + (("vpu",) if m == 1 else ()):
                    runs.append((f"{mode} {tk}x{tn}", functools.partial(variant, mode=mode, tk=tk, tn=tn), (x, q, s)))
            tk, tn = (1024, 4096) if n >= 4096 else (4096, 1024)
            if k % tk == 0 and n % tn == 0:
                runs.append((f"mxu_only {tk}x{tn}", functools.partial(variant, mode="mxu_only", tk=tk, tn=tn, const=True),
                             (x, wbf[:tk, :tn], s)))
                runs.append((f"deq_only {tk}x{tn}", functools.partial(variant, mode="deq_only", tk=tk, tn=tn, const=True),
                             (x, q, s)))
            for label, fn, args in runs:
                try:
                    t0 = time.perf_counter()
                    res = np.asarray(fn(*args)).astype(np.float32)
                    err = float(np.linalg.norm(res - ref) / np.linalg.norm(ref))
                    t = per_call(fn, args, whole=label.startswith("xla"))
                    log(shape=name, m=m, variant=label, us=round(t * 1e6, 2), floor_us=round(floor * 1e6, 2),
                        ratio=round(t / floor, 3), err=err, wall=round(time.perf_counter() - t0, 1))
                except Exception as e:  # noqa: BLE001
                    log(shape=name, m=m, variant=label, error=f"{type(e).__name__}: {str(e)[:300]}")

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
                    t = per_call(fn, args, whole=not label.startswith("prod"))
                    log(shape=name, tokens=tokens, active=active, variant=label, us=round(t * 1e6, 2),
                        floor_us=round(floor * 1e6, 2), ratio=round(t / floor, 3), wall=round(time.perf_counter() - t0, 1))
                except Exception as e:  # noqa: BLE001
                    log(shape=name, tokens=tokens, variant=label, error=f"{type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
    main()
