"""The n-gram drafter's host time a step: 16 sequences, each a prompt of L tokens (a 32k vocabulary, with a
stretch that the output then quotes) growing by 1-3 accepted tokens a step for 64 steps; at each step every
sequence looks up its drafts (k 4, prompt_lookup_min 2, max 5) and checks whether its known tokens can
match (the engine's `_may_draft`: n = 1). Reported: the median host milliseconds a step for all 16, for
quantkit's index (runtime/speculative.PromptLookup), the whole-sequence numpy scan it replaced (the
`ngram` function of quantkit before, reproduced below) and, with --vllm, vLLM's own n-gram proposer
(`vllm.v1.spec_decode.ngram_proposer.batch_propose_numba`, numba, in vLLM's venv, on the same sequences
kept in a token table as its runner keeps them: one call a step for all 16, on one thread as vLLM runs it);
with the lookups that found drafts, the index's first step (which indexes the 16 prompts at once) and one
index's memory after its prompt (tracemalloc).

Usage: .venv/bin/python benchmarks/ngram_lookup.py [--lengths 500 2000 8000 32000] [--vllm /tmp/vllmvenv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ROWS, STEPS, K, LO, HI, VOCAB = 16, 64, 4, 2, 5, 32000


def sequences(length: int, seed: int = 0):
    """Per row: its prompt, and the tokens it accepts at each step (the first of them quoting the prompt)."""
    rng = np.random.default_rng(seed + length)
    rows = []
    for _ in range(ROWS):
        prompt = rng.integers(0, VOCAB, length).tolist()
        start = int(rng.integers(0, max(length - 200, 1)))
        out = prompt[start:start + 100] + rng.integers(0, VOCAB, 3 * STEPS).tolist()  # quotes, then new text
        sizes = rng.integers(1, 4, STEPS).tolist()
        rows.append((prompt, out, sizes))
    return rows


def scan(tokens: np.ndarray, k: int, lo: int, hi: int) -> list[int]:
    """quantkit's n-gram lookup before the index (f53501c's speculative.ngram): the whole sequence compared
    with its last n tokens, for each n from hi down."""
    from numpy.lib.stride_tricks import sliding_window_view

    size = len(tokens)
    for n in range(min(hi, size - 1), lo - 1, -1):
        hits = np.flatnonzero((sliding_window_view(tokens[:size - 1], n) == tokens[size - n:]).all(axis=1))
        if hits.size:
            start = hits[-1] + n
            return tokens[start:start + k].tolist()
    return []


def _index():
    """quantkit's PromptLookup class (imported here only: vLLM's venv, which runs `--only vllm`, has no jax)."""
    sys.path.insert(0, str(ROOT))
    from quantkit.runtime.speculative import PromptLookup

    return PromptLookup


def run(length: int, method: str) -> tuple[float, int, float]:
    """(median host ms a step after the first, drafts found, ms of the first step) of `method` over the 64
    steps (the index's first step indexes the prompts; the engine does that while prompt chunks run)."""
    rows = sequences(length)
    done = [0] * ROWS
    times, found = [], 0
    if method == "index":
        index = [_index()(range(LO - 1, HI + 1)) for _ in rows]
    elif method == "vllm":  # its runner's persistent token table [rows, max_model_len], appended to a step
        from vllm.v1.spec_decode.ngram_proposer import batch_propose_numba

        width = max(len(p) + len(o) for p, o, _ in rows) + K
        table, lens = np.zeros((ROWS, width), np.int32), np.zeros(ROWS, np.int32)
        drafts, counts = np.zeros((ROWS, K), np.int32), np.zeros(ROWS, np.int32)
        for i, (prompt, _, _) in enumerate(rows):
            table[i, :len(prompt)], lens[i] = prompt, len(prompt)
        batch_propose_numba(list(range(ROWS)), lens, table, LO, HI, width, K, drafts, counts)  # compiles
    for step in range(STEPS):
        for i, (_, _, sizes) in enumerate(rows):
            done[i] += sizes[step]
        t = time.perf_counter()
        if method == "vllm":
            for i, (prompt, out, sizes) in enumerate(rows):
                new = out[done[i] - sizes[step]:done[i]]
                table[i, lens[i]:lens[i] + len(new)] = new
                lens[i] += len(new)
            batch_propose_numba(list(range(ROWS)), lens, table, LO, HI, width, K, drafts, counts)
            found += int((counts > 0).sum())
        for i, (prompt, out, _) in enumerate(rows if method != "vllm" else ()):
            if method == "index":
                look = index[i].extend(prompt, out[:done[i]])
                if look.draft(1, LO - 1, LO - 1):
                    found += bool(look.draft(K, LO, HI))
            else:
                tokens = np.asarray(prompt + out[:done[i]])
                if scan(tokens, 1, LO - 1, LO - 1):
                    found += bool(scan(tokens, K, LO, HI))
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1e3, found, times[0] * 1e3


def index_bytes(length: int) -> float:
    """MB of Python objects one sequence's index holds after its prompt (tracemalloc)."""
    import tracemalloc

    PromptLookup, prompt = _index(), sequences(length)[0][0]
    tracemalloc.start()
    look = PromptLookup(range(LO - 1, HI + 1)).extend(prompt, [])
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert look.tokens
    return size / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", nargs="+", type=int, default=[500, 2000, 8000, 32000])
    ap.add_argument("--vllm", help="python of vLLM's venv: also time vLLM's n-gram proposer")
    ap.add_argument("--only", help=argparse.SUPPRESS)  # (a method, in this process; JSON out)
    args = ap.parse_args()
    if args.only:
        print(json.dumps({n: run(n, args.only) for n in args.lengths}))
        return
    peer = None
    if args.vllm:
        out = subprocess.run([args.vllm, "-P", __file__, "--only", "vllm", "--lengths", *map(str, args.lengths)],
                             capture_output=True, text=True, check=True).stdout
        peer = {int(n): v for n, v in json.loads(out.splitlines()[-1]).items()}
    print(f"{ROWS} sequences, {STEPS} steps of 1-3 accepted tokens, k {K}, prompt_lookup {LO}-{HI}; "
          "median host ms a step (drafts found over the run)")
    print("| prompt tokens | index (quantkit) | its first step: indexing 16 prompts | MB an index | "
          "whole-sequence scan (before) | vLLM's proposer |")
    print("|---|---|---|---|---|---|")
    for n in args.lengths:
        (a, fa, first), (b, fb, _) = run(n, "index"), run(n, "scan")
        v = f"{peer[n][0]:.3f} ({peer[n][1]})" if peer else "—"
        print(f"| {n} | {a:.3f} ({fa}) | {first:.1f} | {index_bytes(n):.1f} | {b:.3f} ({fb}) | {v} |", flush=True)


if __name__ == "__main__":
    main()
