"""Speculative decoding's step cost on this machine, in process (no server): the default model generating
128 greedy tokens after one prompt (the first 600 characters of quantkit/runtime/cache.py), plain and with
each --spec-config; reported: tokens/s (best of --runs), steps, ms a step, accepted / drafted tokens.

Usage: .venv/bin/python benchmarks/speculative_step.py [--runs 3] [--spec-config JSON ...]
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

from tokenizers import Tokenizer  # noqa: E402

from quantkit.runtime.engine import Engine, Request  # noqa: E402
from quantkit.runtime.loader import load  # noqa: E402
from quantkit.runtime.speculative import drafter_for, parse  # noqa: E402
from quantkit.runtime.step import Runner  # noqa: E402

TOKENS = 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--spec-config", nargs="+", default=[
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}',
        *(f'{{"method": "eagle3", "model": "assets/tiny-llama-eagle3", "num_speculative_tokens": {k}}}'
          for k in (2, 3, 4))])
    args = ap.parse_args()
    model = load(ROOT / "assets/tiny-llama")
    tok = Tokenizer.from_file(str(ROOT / "assets/tiny-llama/tokenizer.json"))
    prompt = tok.encode((ROOT / "quantkit/runtime/cache.py").read_text()[:600]).ids
    print("| config | tok/s (best of runs) | steps | ms a step | accepted / drafted |")
    print("|---|---|---|---|---|")
    plain = None
    for text in [None, *args.spec_config]:
        spec = parse(text)
        os.chdir(ROOT)  # draft paths are relative to the checkout
        runner = Runner(model, max_model_len=1024, max_num_seqs=16, speculative=spec.k if spec else 0,
                        drafter=drafter_for(spec, model))
        engine = Engine(runner, speculative=spec)
        engine.warmup()
        best = None
        for _ in range(args.runs):
            engine.submit(Request(list(prompt), TOKENS))
            t, steps = time.perf_counter(), 0
            while engine.busy():
                engine.step()
                steps += 1
            best = min(best or (1e9, 0), (time.perf_counter() - t, steps))
        rate = TOKENS / best[0]
        plain = plain or rate
        print(f"| {text or 'plain'} | {rate:.0f} ({rate / plain:.2f}x) | {best[1]} | {best[0] / best[1] * 1e3:.2f} | "
              f"{engine.accepted} / {engine.draft_tokens} |", flush=True)


if __name__ == "__main__":
    main()
