"""Quality table for the trained default model: every scheme `quantkit convert` makes, against bf16, with
`quantkit eval` on held-out text (standard-library files the model never saw in training).

Usage: .venv/bin/python benchmarks/quality.py [--model assets/tiny-llama] [--max-tokens 16384]
Prints a markdown table (docs/quality.md) and writes results.json next to the converted checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from quantkit.convert import convert  # noqa: E402
from quantkit.evaluate import evaluate  # noqa: E402

VARIANTS = [  # label, scheme (None: the bf16 weights), group size, observer, the candidate's KV cache (, the
    # label of the row whose checkpoint is the reference: the same weights with bf16 activations; else bf16)
    ("W4A16 g32 min-max", "W4A16", 32, "minmax", "auto"), ("W4A16 g32 mse", "W4A16", 32, "mse", "auto"),
    ("W4A16 g128 min-max", "W4A16", 128, "minmax", "auto"), ("W4A16 g128 mse", "W4A16", 128, "mse", "auto"),
    ("W4A16 channel min-max", "W4A16", -1, "minmax", "auto"), ("W4A16 channel mse", "W4A16", -1, "mse", "auto"),
    ("FP8_DYNAMIC", "FP8_DYNAMIC", 128, "minmax", "auto"), ("MXFP4A16", "MXFP4A16", 32, "minmax", "auto"),
    ("MXFP4A16 mse", "MXFP4A16", 32, "mse", "auto"),
    ("bf16 weights, FP8 E4M3 KV (scale 1)", None, 0, "", "fp8_e4m3"),
    ("bf16 weights, FP8 E5M2 KV (scale 1)", None, 0, "", "fp8_e5m2"),
    # 8-bit activations (dynamic per token): against bf16, and against the same weights with bf16 activations
    ("W8A16 channel", "W8A16", -1, "minmax", "auto"), ("W8A8", "W8A8", 0, "minmax", "auto"),
    ("W8A8 vs W8A16 channel", "W8A8", 0, "minmax", "auto", "W8A16 channel"),
    ("W4A8 g128", "W4A8", 128, "minmax", "auto"),
    ("W4A8 g128 vs W4A16 g128 min-max", "W4A8", 128, "minmax", "auto", "W4A16 g128 min-max"),
    ("W4AFP8 g128", "W4AFP8", 128, "minmax", "auto"),
    ("W4AFP8 g128 vs W4A16 g128 min-max", "W4AFP8", 128, "minmax", "auto", "W4A16 g128 min-max"),
]


def main() -> None:
    from train_default_model import heldout_files

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "assets/tiny-llama"))
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--only", nargs="*", help="labels of the rows to run")
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="qk-quality-"))
    text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in heldout_files())
    rows = []
    def made(label: str, scheme: str | None, group: int, observer: str) -> Path:
        """The checkpoint of a row: the model itself, or its conversion (once)."""
        dst = work / label.replace(" ", "_")
        if scheme is not None and not dst.exists():
            convert(args.model, dst, scheme, group, observer=observer, force=True)
        return Path(args.model) if scheme is None else dst

    rows_by_label = {v[0]: v for v in VARIANTS}
    for label, scheme, group, observer, kv, *against in VARIANTS:
        if args.only and label not in args.only:
            continue
        dst = made(label.split(" vs ")[0], scheme, group, observer)
        ref = made(*rows_by_label[against[0]][:4]) if against else Path(args.model)
        r = evaluate(ref, dst, text, max_tokens=args.max_tokens, kv_cache_dtype=kv)
        rows.append({"label": label, **r})
        print(f"{label}: ppl {r['ppl_candidate']:.3f} (reference {r['ppl_reference']:.3f}), mean KLD "
              f"{r['kl']['mean']:.5f}, same top-1 {100 * r['top1_agreement']['value']:.2f}%", flush=True)
    (work / "results.json").write_text(json.dumps(rows, indent=1))
    ref = rows[0]  # (the bf16 perplexity: from a row against bf16)
    print(f"\nheld-out text: {ref['tokens']} predicted tokens in {ref['windows']} windows of {ref['window']}; "
          f"bf16 perplexity {ref['ppl_reference']:.3f} [{ref['ppl_reference_ci95'][0]:.3f}, "
          f"{ref['ppl_reference_ci95'][1]:.3f}]\n")
    print("| weights | perplexity [95% CI] | PPL ratio [95% CI] | mean KLD [95% CI] | median / p99 / max KLD "
          "| same top-1 % [95% CI] |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        kl, top = r["kl"], r["top1_agreement"]
        print(f"| {r['label']} | {r['ppl_candidate']:.3f} [{r['ppl_candidate_ci95'][0]:.3f}, "
              f"{r['ppl_candidate_ci95'][1]:.3f}] | {r['ppl_ratio']['value']:.4f} [{r['ppl_ratio']['ci95'][0]:.4f}, "
              f"{r['ppl_ratio']['ci95'][1]:.4f}] | "
              f"{kl['mean']:.5f} [{kl['ci95'][0]:.5f}, {kl['ci95'][1]:.5f}] | {kl['median']:.5f} / "
              f"{kl['p99']:.4f} / {kl['max']:.4f} | {100 * top['value']:.2f} [{100 * top['ci95'][0]:.2f}, "
              f"{100 * top['ci95'][1]:.2f}] |")


if __name__ == "__main__":
    main()
