"""How much of the code-editing workload's time at concurrency 16 is its prompts' on this machine, in process:
the bound that leaves on any speed-up of decoding (speculative decoding's included).

The default model, `serve_load.py --speculative`'s code-edit prompts built the same way in tokens (each
held-out function, the model's own greedy continuation of it, then the function's first two lines again),
64 requests through one engine at --max-num-seqs 16 and its servers' flags (--max-model-len 2048, serve's
512-token steps), alternately with max_tokens 1 (the prompts' steps and one token each) and 64 (serve_load's requests);
reported: the median seconds of each over --runs, the prompts' share f of the 64-token run, the bound
1 / f on any speed-up of decoding alone, and the decoding speed-up that 1.3x end to end takes:
(1 - f) / (1 / 1.3 - f).

Usage: .venv/bin/python benchmarks/prefill_share.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))

from tokenizers import Tokenizer  # noqa: E402

from quantkit.runtime.engine import Engine, Request  # noqa: E402
from quantkit.runtime.loader import load  # noqa: E402
from quantkit.runtime.step import Runner  # noqa: E402
from serve_load import OUT_TOKENS, code_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(ROOT / "assets/tiny-llama/tokenizer.json"))
    engine = Engine(Runner(load(ROOT / "assets/tiny-llama"), max_model_len=2048, max_num_seqs=16,
                           max_num_batched_tokens=512))
    engine.warmup()

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
        reqs = [engine.submit(Request(list(p), max_tokens)) for p in prompts]
        t = time.perf_counter()
        while engine.busy():
            engine.step()
        return time.perf_counter() - t, [r.out for r in reqs]

    texts = code_prompts(64)
    _, made = run([tok.encode(t).ids for t in texts], OUT_TOKENS)
    edits = [tok.encode(t).ids + out + tok.encode("\n\n\n" + "\n".join(t.splitlines()[:2]) + "\n").ids
             for t, out in zip(texts, made)]
    times = {1: [], OUT_TOKENS: []}
    for _ in range(args.runs):
        for n in times:
            times[n].append(run(edits, n)[0])
    one, full = (statistics.median(times[n]) for n in times)
    f = one / full
    print(f"| prompt tokens (mean, max) | max_tokens 1 (s) | max_tokens {OUT_TOKENS} (s) | prompts' share f | "
          "bound on a decoding speed-up, 1 / f | decoding speed-up for 1.3x |")
    print("|---|---|---|---|---|---|")
    lens = [len(e) for e in edits]
    print(f"| {statistics.mean(lens):.0f}, {max(lens)} | {one:.2f} | {full:.2f} | {f:.2f} | {1 / f:.1f}x | "
          f"{(1 - f) / (1 / 1.3 - f):.2f}x |")


if __name__ == "__main__":
    main()
