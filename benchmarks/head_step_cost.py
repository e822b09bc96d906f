"""What a draft head costs a step on this machine, in process: one sequence of 300 cached tokens of the
default model, its step timed as `Runner.run` (median of --steps): the plain decode step at --max-num-seqs 1
and 16, a 4-token chunk of the same sequence, the verifying step of 1 + 3 tokens with n-gram drafts, and with
the EAGLE-3 head drafting 1, 2 and 3 tokens (assets/tiny-llama-eagle3); then 16 such sequences: their
decode step, and the verifying step of 16 rows of 1 + k n-gram drafts, k = 1 to 4 (the program of k = 4).

Usage: .venv/bin/python benchmarks/head_step_cost.py [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from quantkit.runtime.loader import load  # noqa: E402
from quantkit.runtime.speculative import drafter_for, parse  # noqa: E402
from quantkit.runtime.step import Row, Runner  # noqa: E402

CACHED = 300


def timed(runner: Runner, rows: Row | list[Row], steps: int) -> float:
    """Median milliseconds of `runner.run` on the batch of `rows` (after 5 untimed runs)."""
    b = runner.batch(rows if isinstance(rows, list) else [rows])
    for _ in range(5):
        jax.block_until_ready(runner.run(b))
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(runner.run(b))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    os.chdir(ROOT)  # the draft path is relative to the checkout
    model = load("assets/tiny-llama")
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 4000, CACHED)]

    def runner(seqs: int, spec: str | None = None, cached: int = 1) -> Runner:
        s = parse(spec)
        r = Runner(model, max_model_len=1024, max_num_seqs=seqs, speculative=s.k if s else 0,
                   drafter=drafter_for(s, model))
        for i in range(cached):  # the prompt in each of `cached` slots, a prefill step each
            assert r.pool.reserve(i, 0, CACHED + 16)
            jax.block_until_ready(r.run(r.batch([Row(i, 0, CACHED, prompt)])))
        return r

    print("| step (one sequence, 300 cached tokens) | --max-num-seqs | ms (median) |")
    print("|---|---|---|")
    for seqs in (1, 16):
        r = runner(seqs)
        print(f"| plain decode, 1 token | {seqs} | {timed(r, Row(0, CACHED, 1, None), args.steps):.2f} |")
        print(f"| plain, a 4-token chunk | {seqs} | {timed(r, Row(0, CACHED, 4, prompt[:4]), args.steps):.2f} |")
    r = runner(16, '{"method": "ngram", "num_speculative_tokens": 3}')
    ms = timed(r, Row(0, CACHED, 4, None, drafts=tuple(prompt[:3])), args.steps)
    print(f"| verifying, 1 + 3 n-gram drafts | 16 | {ms:.2f} |")
    for k in (1, 2, 3):
        r = runner(16, f'{{"method": "eagle3", "model": "assets/tiny-llama-eagle3", "num_speculative_tokens": {k}}}')
        ms = timed(r, Row(0, CACHED, 1 + k, None, proposed=k), args.steps)
        print(f"| verifying, 1 + {k} drafts, the EAGLE-3 head drafting {k} | 16 | {ms:.2f} |")
    r = runner(16, '{"method": "ngram", "num_speculative_tokens": 4}', cached=16)
    ms = timed(r, [Row(i, CACHED, 1, None) for i in range(16)], args.steps)
    print(f"| 16 sequences: decode, 1 token each (the verifying program) | 16 | {ms:.2f} |")
    for k in (1, 2, 3, 4):
        ms = timed(r, [Row(i, CACHED, 1 + k, None, drafts=tuple(prompt[:k])) for i in range(16)], args.steps)
        print(f"| 16 sequences: verifying, 1 + {k} n-gram drafts each | 16 | {ms:.2f} |")
    r = runner(16, cached=16)
    ms = timed(r, [Row(i, CACHED, 1, None) for i in range(16)], args.steps)
    print(f"| 16 sequences: plain decode | 16 | {ms:.2f} |")


if __name__ == "__main__":
    main()
