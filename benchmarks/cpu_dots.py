"""Matrix products on this CPU: why XLA:CPU bounds the runtime's CPU speed, measured beside torch.

The figures docs/benchmarks.md cites for the CPU path's limits (issues 5, 6 and 12):
- a bf16 vector-matrix product against the same weight read by 8 rows (1×1024 @ 1024×32000 and 8×1024 @ ...),
  which is why decode rows are padded to 8 on CPU;
- 16 rows against 64 independent [1024, 2816] weights in one jitted program (the shape of a ~190M model's
  decode step): bf16 weights; int8 / int4 weights converted to bf16 for the dot (the W4A16 fallback);
  int8 activations × int8 weights accumulated in int32; and torch's bf16 `linear` over the same weights.
Each case: median of --reps timed calls after a warm-up; "GB/s" is weight bytes read per second.

Usage: .venv/bin/python benchmarks/cpu_dots.py [--reps 10]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _median_s(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    rows: list[tuple[str, float, float]] = []  # (case, seconds, weight bytes)

    def dot(x, w):  # the runtime's form (runtime/models/common.py): bf16 operands, float32 accumulation
        return jnp.dot(x, w, preferred_element_type=jnp.float32)

    def jax_case(name, f, x, w, nbytes):
        jf = jax.jit(f)
        rows.append((name, _median_s(lambda: jax.block_until_ready(jf(x, w)), args.reps), nbytes))

    # vector-matrix vs 8 rows over one bf16 [1024, 32000] weight
    w = jnp.asarray(rng.standard_normal((1024, 32000), np.float32), jnp.bfloat16)
    for m in (1, 8):
        x = jnp.asarray(rng.standard_normal((m, 1024), np.float32), jnp.bfloat16)
        jax_case(f"jax bf16 {m}×1024 @ 1024×32000", lambda x, w: dot(x, w), x, w, w.nbytes)

    # 16 rows against 64 independent [1024, 2816] weights, one program
    n, k, o = 64, 1024, 2816
    x = rng.standard_normal((16, k), np.float32)
    wf = rng.standard_normal((n, k, o), np.float32) * 0.02
    scale = np.abs(wf).max(axis=1, keepdims=True) / 7  # [n, 1, o]
    q = np.clip(np.round(wf / scale), -8, 7).astype(np.int8)  # int4 values held in int8
    xb = jnp.asarray(x, jnp.bfloat16)
    wb = [jnp.asarray(wf[i], jnp.bfloat16) for i in range(n)]  # separate arrays: no slicing inside the program
    sb = [jnp.asarray(scale[i], jnp.bfloat16) for i in range(n)]
    nbytes = sum(w.nbytes for w in wb)
    jax_case("jax bf16 weights, 16 rows × 64 [1024, 2816]",
             lambda x, w: sum(dot(x, w[i]) for i in range(n)), xb, wb, nbytes)
    q8 = [jnp.asarray(q[i]) for i in range(n)]
    jax_case("jax int8 weights → bf16, scale after the dot",
             lambda x, w: sum(dot(x, w[i].astype(jnp.bfloat16)) * sb[i] for i in range(n)), xb, q8, nbytes // 2)
    q4 = [jnp.asarray(q[i], jnp.int4) for i in range(n)]
    jax_case("jax int4 weights → bf16, scale after the dot",
             lambda x, w: sum(dot(x, w[i].astype(jnp.bfloat16)) * sb[i] for i in range(n)), xb, q4, nbytes // 4)
    xq = jnp.asarray(np.clip(np.round(x * 20), -127, 127), jnp.int8)
    jax_case("jax int8 activations × int8 weights → int32",
             lambda x, w: sum(jnp.dot(x, w[i], preferred_element_type=jnp.int32) for i in range(n)),
             xq, q8, nbytes // 2)
    tx = torch.from_numpy(x).to(torch.bfloat16)
    tw = [torch.from_numpy(np.ascontiguousarray(wf[i].T)).to(torch.bfloat16) for i in range(n)]  # [o, k]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        with torch.inference_mode():
            rows.append((f"torch bf16 linear, {threads} thread(s), same weights",
                         _median_s(lambda: sum(torch.nn.functional.linear(tx, w_) for w_ in tw), args.reps),
                         nbytes))

    print(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}, median of {args.reps}\n")
    print("| case | ms | weight GB/s |\n|---|---|---|")
    for name, s, nbytes in rows:
        print(f"| {name} | {s * 1e3:.1f} | {nbytes / s / 1e9:.1f} |")


if __name__ == "__main__":
    main()
