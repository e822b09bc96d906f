"""One ragged step on CPU with long cached contexts: what prompt chunks over a shared 1,504-token prefix cost
(the shared-prefix load of benchmarks/prefix_load.py), with and without attention.

Cases (8 slots, the serve model `tiny` of serve_load.py, bf16): 7 chunks of 57 tokens at position 1,504 +
1 decode (a wave of newcomers that hit the prefix cache), 1 such chunk + 1 decode (one newcomer), a decode
alone, and 7 chunks at position 0. Median of 10 runs of `Runner.run` after a warm-up.

Usage: .venv/bin/python benchmarks/cpu_step.py [--model /tmp/qk-serve-bench/tiny]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/qk-serve-bench/tiny")
    ap.add_argument("--no-attention", action="store_true", help="replace attention by the identity")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    if not Path(args.model, "config.json").exists():
        import serve_load

        serve_load.build(Path(args.model).parent, Path(args.model).name)
    import quantkit.runtime.attention as attention

    if args.no_attention:
        attention.attention = lambda q, *a, **k: q
    from quantkit.runtime.loader import load
    from quantkit.runtime.step import Row, Runner

    runner = Runner(load(args.model, dtype=jnp.bfloat16), max_model_len=2048, max_num_seqs=8)
    for n_new, n_tok, ctx in ((7, 57, 1504), (1, 57, 1504), (0, 0, 0), (7, 57, 0)):
        for i in range(8):
            runner.pool.reserve(i, 0, ctx + 64)
        b = runner.batch([Row(i, ctx, n_tok, list(range(3, 3 + n_tok))) for i in range(n_new)] + [Row(7, 1560, 1)])
        jax.block_until_ready(runner.run(b))
        ts = []
        for _ in range(10):
            t = time.perf_counter()
            jax.block_until_ready(runner.run(b))
            ts.append(time.perf_counter() - t)
        print(f"{n_new} chunks of {n_tok} tokens at position {ctx} + 1 decode (T = {b['tokens'].shape[0]}): "
              f"{np.median(ts) * 1e3:.1f} ms{' (no attention)' if args.no_attention else ''}", flush=True)


if __name__ == "__main__":
    main()
