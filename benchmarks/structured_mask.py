"""What a structured-output token mask costs on this CPU: per row, for a 150k-token vocabulary, along real
constrained outputs (docs/benchmarks.md, "Structured outputs").

The vocabulary is synthetic but shaped like a real byte-level BPE one: the 256 byte tokens, then merges of
two earlier tokens (up to 16 bytes) until 150,000 entries, saved as a tokenizers JSON file. For each
constraint (a nested JSON schema, any JSON object, a regex), a matcher is advanced along 200 tokens: at
each position the mask is computed (timed), and a token is drawn uniformly from the allowed ones with a
fixed seed (a stand-in for a model, the worst case for the mask: it wanders over the whole grammar).
Reported: compile seconds and the median, 95th percentile and largest mask time per row. With outlines-core
installed (`pip install outlines-core`; not a quantkit dependency), its index build and per-token mask for
the regex are measured the same way, for comparison.

Usage: .venv/bin/python benchmarks/structured_mask.py [--vocab 150000] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.runtime.structured import Constraints  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "role", "tags", "address"]}
REGEX = r"[A-Z][a-z]{2,9}( [A-Z][a-z]{2,9}){0,3}: [0-9]{1,4}(\.[0-9]{1,2})?"


def bpe_tokenizer(path: Path, vocab: int, seed: int = 0) -> Path:
    """A byte-level BPE tokenizers file of `vocab` tokens: byte tokens, </s>, then random merges."""
    from tokenizers import pre_tokenizers

    rng = np.random.default_rng(seed)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens, merges, seen = list(alphabet), [], set(alphabet)
    while len(tokens) < vocab - 1:
        a, b = tokens[rng.integers(len(tokens))], tokens[rng.integers(min(len(tokens), 4096))]
        if a + b not in seen and len(a + b) <= 16:
            seen.add(a + b)
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
             "vocab": {t: i for i, t in enumerate(tokens)} | {"</s>": vocab - 1}, "merges": merges}
    spec = {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": vocab - 1, "content": "</s>", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}],
            "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                                  "use_regex": True},
            "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                                "use_regex": True}, "model": model}
    path.write_text(json.dumps(spec))
    return path


def walk(fill, accept, allowed_of, steps: int, rng, eos: int) -> list[float]:
    """Mask times (seconds) along a walk of up to `steps` tokens drawn uniformly from each mask (until the
    end of sequence is drawn)."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        ok = fill()
        times.append(time.perf_counter() - t)
        allowed = allowed_of()
        if not ok or not len(allowed):
            break
        token = int(rng.choice(allowed))
        if token == eos:
            break
        accept(token)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=150_000)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    t = time.perf_counter()
    file = bpe_tokenizer(tmp / "tokenizer.json", args.vocab)
    t_vocab = time.perf_counter() - t
    t = time.perf_counter()
    constraints = Constraints(file, args.vocab, {args.vocab - 1})
    t_tok = time.perf_counter() - t
    print(f"vocabulary {args.vocab} tokens (built in {t_vocab:.1f} s); llguidance tokenizer {t_tok:.2f} s")
    print("| library | constraint | compile s | masks | median ms / row | p95 ms / row | max ms / row |")
    print("|---|---|---|---|---|---|---|")
    for name, kind, spec in (("nested JSON schema", "json", SCHEMA), ("any JSON object", "json_object", None),
                             ("regex", "regex", REGEX)):
        t = time.perf_counter()
        g = constraints.matcher(constraints.grammar(kind, spec))
        compile_s = time.perf_counter() - t
        bits = lambda: np.flatnonzero(np.unpackbits(g.mask.view(np.uint8), bitorder="little")[:args.vocab])  # noqa: E731
        times = walk(g.fill, g.accept, bits, args.steps, np.random.default_rng(0), args.vocab - 1)
        print(f"| llguidance | {name} | {compile_s:.3f} | {len(times)} | {np.median(times) * 1e3:.3f} | "
              f"{np.percentile(times, 95) * 1e3:.3f} | {max(times) * 1e3:.3f} |")
    try:
        import outlines_core
    except ImportError:
        print("(outlines-core not installed: `pip install outlines-core` to compare)")
        return
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(file))
    decoder = tok.decoder
    vocab = {}
    for piece, i in tok.get_vocab().items():
        if i != args.vocab - 1:
            vocab.setdefault(decoder.decode([piece]), []).append(i)
    t = time.perf_counter()
    index = outlines_core.Index(REGEX, outlines_core.Vocabulary(args.vocab - 1, vocab))
    compile_s = time.perf_counter() - t
    guide = outlines_core.Guide(index)
    state = {"allowed": np.array(guide.get_tokens())}

    def fill():
        state["allowed"] = np.array(guide.get_tokens())
        return len(state["allowed"]) > 0

    times = walk(fill, guide.advance, lambda: state["allowed"], args.steps, np.random.default_rng(0), args.vocab - 1)
    print(f"| outlines-core | regex | {compile_s:.3f} | {len(times)} | {np.median(times) * 1e3:.3f} | "
          f"{np.percentile(times, 95) * 1e3:.3f} | {max(times) * 1e3:.3f} |")


if __name__ == "__main__":
    main()
