"""gmm_v2 on real layer shapes: bytes moved, FLOPs, v6e roofline floor (ESTIMATE), tiles, VMEM, compile time.

For every distinct linear of Llama-3-8B, Gemma-3-27B and Qwen3-30B-A3B (experts: 128 groups, 8 active per
token) at decode (1..256 tokens) and prefill (2048) sizes, W4A16 group 128 on v6e:
- bytes moved per call: the kernel's own static cost estimate (gmm_v2.cost), and its ratio to the minimum
  any kernel must move: the packed weights + scales of the groups the call reads (min(groups, rows) for
  MoE) plus the activations read once and the output written once;
- FLOPs; the roofline time max(bytes / 1.64 TB/s, FLOPs / 918 TFLOP/s) -- an estimate, not a measurement;
- the tiles chosen, their VMEM estimate, and the deviceless v6e compile time on this machine (libtpu).
Then, informative only: the XLA path (dequantize + dot) against a bf16 matmul on this CPU.

Usage: .venv/bin/python benchmarks/kernels.py [--compile] [--cpu]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from quantkit.kernels.gmm_v2 import check_gmm_v2, cost, gmm_v2  # noqa: E402
from quantkit.kernels.tiling import CHIPS  # noqa: E402
from quantkit.kernels.xla import gmm_xla  # noqa: E402
from quantkit.quant.qtensor import STORAGE, QTensor, make_qtensor  # noqa: E402

LAYERS = {  # name -> (k, n, experts)
    "Llama-3-8B q/o": (4096, 4096, 1), "Llama-3-8B k/v": (4096, 1024, 1),
    "Llama-3-8B gate/up": (4096, 14336, 1), "Llama-3-8B down": (14336, 4096, 1),
    "Gemma-3-27B q": (5376, 4096, 1), "Gemma-3-27B k/v": (5376, 2048, 1), "Gemma-3-27B o": (4096, 5376, 1),
    "Gemma-3-27B gate/up": (5376, 21504, 1), "Gemma-3-27B down": (21504, 5376, 1),
    "Qwen3-30B-A3B q": (2048, 4096, 1), "Qwen3-30B-A3B k/v": (2048, 512, 1), "Qwen3-30B-A3B o": (4096, 2048, 1),
    "Qwen3-30B-A3B experts gate/up": (2048, 768, 128), "Qwen3-30B-A3B experts down": (768, 2048, 128),
}
TOKENS = (1, 16, 64, 256, 2048)
TOP_K = 8
V6E = CHIPS["v6e"]


def abstract(k, n, g, group=128):
    return QTensor(jax.ShapeDtypeStruct((g, k, n), STORAGE["int4"]),
                   jax.ShapeDtypeStruct((g, k // group, n), jnp.bfloat16), "int4", group)


def roofline_table(compile_times: bool) -> None:
    if compile_times:
        from quantkit.runtime.aot import compile_for
    print("| layer | tokens | rows | tiles (tm, tk, tn) | VMEM est. | bytes moved | packed weights | minimum |"
          " ratio | GFLOP | v6e roofline (estimate) | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst_decode = 0.0
    for name, (k, n, g) in LAYERS.items():
        rhs = abstract(k, n, g)
        per_group = k * n // 2 + (k // 128) * n * 2
        for t in TOKENS:
            m = t * TOP_K if g > 1 else t
            tiles, why = check_gmm_v2((m, k), rhs, V6E)
            if tiles is None:
                print(f"| {name} | {t} | {m} | XLA fallback: {why} |")
                continue
            c = cost(m, k, n, g, rhs, tiles)
            weights = min(g, m) * per_group
            floor = weights + m * k * 2 + m * n * 2
            ratio = c.bytes_accessed / floor
            if t <= 256:
                worst_decode = max(worst_decode, ratio)
            est = max(c.bytes_accessed / V6E.hbm_bytes_per_s, c.flops / V6E.bf16_flops)
            secs = "-"
            if compile_times and t in (1, 2048):
                lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
                gs = jax.ShapeDtypeStruct((g,), jnp.int32)
                _, s = compile_for("v6e", lambda a, b, cc: gmm_v2(a, b, cc, chip="v6e"), lhs, rhs, gs)
                secs = f"{s:.2f}"
            print(f"| {name} | {t} | {m} | {tiles.tm}, {tiles.tk}, {tiles.tn} | {tiles.vmem_bytes / 2**20:.1f} MiB | "
                  f"{c.bytes_accessed / 1e6:.2f} MB | {weights / 1e6:.2f} MB | {floor / 1e6:.2f} MB | {ratio:.3f} | "
                  f"{c.flops / 1e9:.2f} | "
                  f"{est * 1e6:.1f} us | {secs} |")
    print(f"\nworst decode (<= 256 tokens) bytes-moved / minimum ratio: {worst_decode:.3f} (goal <= 1.05)")


def cpu_table(runs: int = 5) -> None:
    print("\n| shape [m x k x n] | XLA path int4 g128 (dequantize + dot) | bf16 dot | ratio |")
    print("|---|---|---|---|")
    rng = np.random.default_rng(0)
    for m, k, n in [(1, 4096, 4096), (16, 4096, 4096), (1, 4096, 14336), (16, 14336, 4096)]:
        rhs = make_qtensor(rng.integers(-8, 8, (1, k, n)).astype(np.int8),
                           rng.uniform(0.01, 0.02, (1, k // 128, n)).astype(jnp.bfloat16), "int4", 128)
        w = jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        gs = jnp.array([m], jnp.int32)
        dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
        times = {}
        for label, fn in (("int4", lambda: gmm_xla(x, rhs, gs)), ("bf16", lambda: dot(x, w))):
            fn().block_until_ready()
            samples = []
            for _ in range(runs):
                t = time.perf_counter()
                fn().block_until_ready()
                samples.append(time.perf_counter() - t)
            times[label] = statistics.median(samples)
        print(f"| {m} x {k} x {n} | {times['int4'] * 1e3:.2f} ms | {times['bf16'] * 1e3:.2f} ms | "
              f"{times['int4'] / times['bf16']:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", action="store_true", help="also compile for v6e with libtpu and time it")
    ap.add_argument("--cpu", action="store_true", help="also time the XLA path on this CPU")
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}; W4A16 g128, v6e facts: "
          f"{V6E.hbm_bytes_per_s / 1e12:.2f} TB/s, {V6E.bf16_flops / 1e12:.0f} TFLOP/s bf16")
    roofline_table(args.compile)
    if args.cpu:
        cpu_table()


if __name__ == "__main__":
    main()
