"""gmm_v2 measured on a TPU, per call, against the HBM floor and the peers, side by side in one run.

Time per call with the host's dispatch removed: N calls chained in one jitted program (lax.fori_loop, each
call's input depending on the last output, so that none is skipped or overlapped), minus the same program
with one call, over N - 1; the median of 5 runs of each. Floors: the bytes a call must move (packed weights of
the groups holding rows, their scales, activations in, output out) / the chip's HBM bandwidth; at 2048 rows
also the share of the MXU's peak (2 m k n FLOPs).

Tables (--what, default all):
  llama: Llama-3-8B's linears at W4A16 g128 (gate/up as the runtime runs them: one gated pair), m = 1..2048,
         against XLA's bf16 dot of the same shape;
  qtypes: every weight type gmm_v2 serves at m = 8 and 2048 on q/o and down (W8A8 and W4A8: int8 rows on the
         int8 MXU);
  moe:   Qwen3-30B-A3B's experts (128, top 8; gate/up a gated pair) at 1..512 tokens, against lax.ragged_dot
         and JAX's own Pallas grouped matmul (megablox gmm), both bf16;
  sweep: tiles (tk, tn) around the chosen ones for the Llama shapes at m = 8 and 64;
  decode: gmm_v2 alone at decode sizes (Llama at m = 1, 8, 64; experts at 1 and 8 tokens).
Usage (on the chip; benchmarks/README or docs/benchmarks.md): python3 benchmarks/tpu_gmm.py [--what llama,moe] [--out F]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from quantkit.kernels.gmm_v2 import check_gmm_v2, gmm_v2  # noqa: E402
from quantkit.kernels.tiling import CHIPS  # noqa: E402
from quantkit.quant.qtensor import BITS, make_qtensor  # noqa: E402
from quantkit.runtime.ops import chip_of, quantize_rows  # noqa: E402

LLAMA = {"q/o": (4096, 4096), "k/v": (4096, 1024), "gate/up": (4096, 14336), "down": (14336, 4096)}
MOE = {"experts gate/up": (2048, 768, True), "experts down": (768, 2048, False)}


def device_ops(trace_dir: str) -> list[tuple[str, float]]:
    """(op, ns) of every XLA op the TPU ran in a jax.profiler trace: its "XLA Ops" lines, without the
    control-flow ops that enclose others (a while loop's event spans its body's)."""
    from jax.profiler import ProfileData
    path = max(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True), key=os.path.getmtime)
    return [(e.name, e.duration_ns) for plane in ProfileData.from_file(path).planes
            if plane.name.startswith("/device:TPU") for line in plane.lines if line.name == "XLA Ops"
            for e in line.events if not e.name.startswith(("%while", "%conditional", "%call"))]


def open_run(out_path: str):
    """(the attached TPU's chip, log): log(**fields) prints a record and appends it to out_path (JSON lines);
    its first record says the chip, jax, the date and the command. Exits with one line without a TPU that
    kernels/tiling.py has facts for."""
    dev = jax.devices()[0]
    chip = chip_of(dev.device_kind) if dev.platform == "tpu" else None
    if chip is None:
        sys.exit(f"error: needs a TPU with kernel facts (found {dev.device_kind})")
    out = open(out_path, "a")

    def log(**r):
        print(json.dumps(r), flush=True)
        out.write(json.dumps(r) + "\n")
        out.flush()

    log(chip=dev.device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(), command=" ".join(sys.argv))
    return chip, log


def per_call(fn, args, n: int = 32, whole: bool = False, match: str = "") -> float:
    """Seconds of device time per call of fn(x, *rest), chained n times in one program (each call's input
    depending on the last output, so that none is skipped or overlapped), from a profile of that program:
    the ops whose name holds `match` (a Pallas kernel's name), else every op, over n. The next input depends
    on one output element of a Pallas call, which XLA cannot see into; on the whole output of an XLA op
    (`whole`: its sum, a pass over [m, n], counted), whose one element XLA would compute alone. (Timing the
    chain on the host instead, less a one-call chain, gave per-call figures a few us apart from run to run.)"""
    @jax.jit
    def run(x, *rest):
        def body(i, c):
            x, acc = c
            out = fn(x, *rest)
            t = (jnp.sum(out, dtype=jnp.float32) if whole else out[0, 0]).astype(jnp.float32)
            return x + (t * 0).astype(x.dtype), acc + t
        return jax.lax.fori_loop(0, n, body, (x, jnp.float32(0)))

    jax.block_until_ready(run(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            jax.block_until_ready(run(*args))
        ops = device_ops(d)
    return sum(ns for name, ns in ops if match in name) / n * 1e-9


def weight(rng, qtype: str, g: int, k: int, n: int, group: int, zeros: bool = False, act: str = ""):
    """A random weight of `qtype` (values over the type's range, scales around 1 / (8 half-range))."""
    zp = gscale = None
    if qtype in ("int4", "int8"):
        half = 8 if qtype == "int4" else 128
        values = rng.integers(-half, half, (g, k, n), dtype=np.int8)
        scales = jnp.asarray(rng.uniform(0.5, 2.0, (g, k // group, n)) / (8 * half), jnp.bfloat16)
        zp = rng.integers(-half, half, (g, k // group, n), dtype=np.int8) if zeros else None
    elif qtype in ("fp8", "mxfp8"):
        values = jnp.asarray(rng.standard_normal((g, k, n), np.float32) * 64, jnp.float8_e4m3fn)
        scales = jnp.asarray(rng.uniform(0.5, 2.0, (g, k // group, n)) / 4096, jnp.bfloat16) if qtype == "fp8" else \
            rng.integers(113, 118, (g, k // group, n), dtype=np.uint8)
    else:  # e2m1 codes
        values = rng.integers(-8, 8, (g, k, n), dtype=np.int8)
        if qtype == "nvfp4":
            scales = jnp.asarray(rng.uniform(16, 448, (g, k // group, n)), jnp.float8_e4m3fn)
            gscale = (448 * 6 / rng.uniform(0.5, 4.0, g)).astype(np.float32)
        else:
            scales = rng.integers(119, 124, (g, k // group, n), dtype=np.uint8)
    w = make_qtensor(values, scales, qtype, group, zp, gscale)
    return dataclasses.replace(w, act=act)


def weight_bytes(w, groups: int = 1) -> float:
    """Bytes of `groups` of w's groups in HBM: packed values, scales, zero points."""
    g, k, n = w.shape
    per = k * n * BITS[w.qtype] / 8 + sum(a.nbytes for f, a in w.arrays.items() if f in ("scales", "zeros")) / g
    return groups * per


class Bench:
    def __init__(self, out, chip, shapes=""):
        self.out, self.chip, self.shapes = out, chip, shapes  # shapes: only those whose name holds it
        self.hbm, self.peak = CHIPS[chip].hbm_bytes_per_s, CHIPS[chip].bf16_flops

    def log(self, **r):
        print(json.dumps(r), flush=True)
        self.out.write(json.dumps(r) + "\n")
        self.out.flush()

    def time(self, table, label, fn, args, floor_bytes, flops=0, **meta):
        try:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            t = per_call(fn, args, whole=not label.startswith("gmm_v2"), match="gmm_v2" if label.startswith("gmm_v2") else "")
            r = dict(table=table, variant=label, us=round(t * 1e6, 2), floor_us=round(floor_bytes / self.hbm * 1e6, 2),
                     ratio=round(t / (floor_bytes / self.hbm), 3), **meta, wall_s=round(time.perf_counter() - t0, 1))
            if flops:
                r["mxu_share"] = round(flops / t / self.peak, 3)
            self.log(**r)
            return t
        except Exception as e:  # noqa: BLE001 -- a variant that does not compile or run is reported, not fatal
            self.log(table=table, variant=label, error=f"{type(e).__name__}: {str(e)[:400]}", **meta)


def llama(b: Bench, rng, ms=(1, 8, 16, 64, 128, 256, 2048), peers=True):
    for name, (k, n) in LLAMA.items():
        if b.shapes and b.shapes not in name:
            continue
        pair = name == "gate/up"
        w = weight(rng, "int4", 1, k, n, 128)
        up = weight(rng, "int4", 1, k, n, 128) if pair else None
        dense = jnp.asarray(rng.standard_normal((k, n), np.float32), jnp.bfloat16)
        for m in ms:
            x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
            sizes = jnp.array([m], jnp.int32)
            floor = weight_bytes(w) * (2 if pair else 1) + 2 * m * k + 2 * m * n
            kw = dict(up=up, gate="silu") if pair else {}
            tiles, _ = check_gmm_v2((m, k), w, CHIPS[b.chip], 1, pair)
            b.time("llama", "gmm_v2 W4A16 g128", lambda x, w: gmm_v2(x, w, sizes, chip=b.chip, **kw), (x, w), floor,
                   2 * m * k * n * (2 if pair else 1), shape=name, m=m, tiles=[tiles.tm, tiles.tk, tiles.tn])
            if peers:
                b.time("llama", "XLA bf16 dot", lambda x, d: jnp.dot(x, d), (x, dense), floor, 2 * m * k * n,
                       shape=name, m=m, note="one weight (a pair: x2)" if pair else "")


QTYPES = [("int4", 128, False, ""), ("int4", 32, False, ""), ("int4", 128, True, ""), ("int4", None, False, ""),
          ("int8", None, False, ""), ("int8", 128, False, ""), ("fp8", None, False, ""), ("mxfp4", 32, False, ""),
          ("mxfp8", 32, False, ""), ("nvfp4", 16, False, ""), ("int8", None, False, "int8"),
          ("int4", 128, False, "int8")]


def qtypes(b: Bench, rng):
    for name in ("q/o", "down"):
        k, n = LLAMA[name]
        for qtype, group, zeros, act in QTYPES:
            group = group or k
            w = weight(rng, qtype, 1, k, n, group, zeros, act)
            label = f"{qtype} {'g' + str(group) if group < k else 'channel'}{' zp' if zeros else ''}" + \
                (f" {act} rows" if act else "")
            for m in (8, 2048):
                x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
                sizes = jnp.array([m], jnp.int32)
                if act:
                    codes, rows = quantize_rows(x, act)
                    fn, args = (lambda c, w, r: gmm_v2(c, w, sizes, row_scales=r, chip=b.chip)), (codes, w, rows)
                else:
                    fn, args = (lambda x, w: gmm_v2(x, w, sizes, chip=b.chip)), (x, w)
                floor = weight_bytes(w) + (1 if act else 2) * m * k + 2 * m * n
                b.time("qtypes", label, fn, args, floor, 2 * m * k * n, shape=name, m=m)


def moe(b: Bench, rng, token_counts=(1, 8, 64, 512), peers=True):
    from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox

    g, top = 128, 8
    for name, (k, n, pair) in MOE.items():
        if b.shapes and b.shapes not in name:
            continue
        w = weight(rng, "int4", g, k, n, 128)
        up = weight(rng, "int4", g, k, n, 128) if pair else None
        dense = jnp.asarray(rng.standard_normal((g, k, n), np.float32), jnp.bfloat16)
        for tokens in token_counts:
            m = tokens * top
            experts = np.stack([rng.choice(g, top, replace=False) for _ in range(tokens)])
            counts = np.bincount(experts.ravel(), minlength=g)
            sizes = jnp.asarray(counts, jnp.int32)
            active = int((counts > 0).sum())
            x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
            kw = dict(up=up, gate="silu") if pair else {}
            floor = weight_bytes(w, active) * (2 if pair else 1) + 2 * m * k + 2 * m * n
            meta = dict(shape=name, tokens=tokens, active_experts=active)
            b.time("moe", "gmm_v2 W4A16 g128", lambda x, w, s: gmm_v2(x, w, s, chip=b.chip, **kw), (x, w, sizes),
                   floor, **meta)
            if not peers:
                continue
            dense_floor = active * k * n * 2 + 2 * m * k + 2 * m * n
            note = dict(note="one weight (a pair: x2)" if pair else "", bf16_floor_us=round(dense_floor / b.hbm * 1e6, 2))
            b.time("moe", "lax.ragged_dot bf16", lambda x, d, s: jax.lax.ragged_dot(x, d, s), (x, dense, sizes),
                   floor, **meta, **note)
            tm = 128 if m >= 128 else m
            b.time("moe", "megablox gmm bf16", lambda x, d, s: megablox(x, d, s, preferred_element_type=jnp.bfloat16,
                                                                        tiling=(tm, k if k < 512 else 512, 128 if n < 512 else 512)),
                   (x, dense, sizes), floor, **meta, **note)


def decode(b: Bench, rng):
    """gmm_v2 alone at decode sizes: the Llama-3-8B linears at m = 1, 8, 64, the experts at 1 and 8 tokens."""
    llama(b, rng, (1, 8, 64), peers=False)
    moe(b, rng, (1, 8), peers=False)


def sweep(b: Bench, rng):
    from quantkit.kernels.tiling import Tiles, vmem_estimate

    for name, (k, n) in LLAMA.items():
        pair = name == "gate/up"
        w = weight(rng, "int4", 1, k, n, 128)
        up = weight(rng, "int4", 1, k, n, 128) if pair else None
        kw = dict(up=up, gate="silu") if pair else {}
        for m in (8, 64):
            x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
            sizes = jnp.array([m], jnp.int32)
            floor = weight_bytes(w) * (2 if pair else 1) + 2 * m * k + 2 * m * n
            for tk in (512, 1024, 2048, 4096):
                for tn in (512, 1024, 2048, 4096):
                    if k % tk or n % tn or (k // tk) * (n // tn) < 2:
                        continue
                    vmem = vmem_estimate(m, tk, tn, k, 128, "int4", 2, True, weights=2 if pair else 1)
                    tiles = Tiles(m, tk, tn, False, True, vmem, 96 << 20)
                    b.time("sweep", f"{tk}x{tn}", lambda x, w: gmm_v2(x, w, sizes, chip=b.chip, tiles=tiles, **kw),
                           (x, w), floor, shape=name, m=m, tk=tk, tn=tn)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--what", default="llama,qtypes,moe,sweep")
    ap.add_argument("--out", default="tpu_gmm.jsonl")
    ap.add_argument("--shapes", default="", help="only the shapes whose name holds this text (e.g. down)")
    a = ap.parse_args()
    dev = jax.devices()[0]
    chip = chip_of(dev.device_kind)
    if dev.platform != "tpu" or chip is None:
        sys.exit(f"error: needs a TPU with kernel facts (found {dev.device_kind})")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:  # no git there: the checkout's HEAD as the device tool copies it
        commit = ""
    b = Bench(open(a.out, "a"), chip, a.shapes)
    b.log(table="run", chip=dev.device_kind, jax=jax.__version__, commit=commit or "?",
          date=datetime.date.today().isoformat(), command=" ".join(sys.argv))
    rng = np.random.default_rng(0)
    for what in a.what.split(","):
        {"llama": llama, "qtypes": qtypes, "moe": moe, "sweep": sweep, "decode": decode}[what](b, rng)


if __name__ == "__main__":
    main()
