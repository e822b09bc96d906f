"""What 8-bit activations buy a prefill step: `quantkit plan` of Llama-3-8B per scheme and chip (deviceless
libtpu compilation on this CPU), the 512-token prefill program's matmul FLOPs by MXU operand type (from the
compiled HLO) and its compute-bound roofline time (each type at the chip's rate for it), the time to read the
weights once at the HBM rate and the larger of the two, each against the same model with bf16 activations;
XLA's own bytes-accessed count of the program at the HBM rate (it counts a gather's or in-place scatter's whole
table: the embedding, each layer's KV cache); the decode step's bytes accessed against its floor. Every time
here is a roofline estimate from a compiled program, not a measurement: no TPU runs it.

Usage: .venv/bin/python benchmarks/prefill_roofline.py [--only TARGET:SCHEME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_table import LLAMA3_8B  # noqa: E402

from quantkit.kernels.tiling import CHIPS  # noqa: E402
from quantkit.plan import plan  # noqa: E402

# (target, scheme, group size, the row it is compared with: the same weights' bf16-activation scheme)
ROWS = [("v6e", "W4A16", 128, None), ("v6e", "W4A8", 128, "W4A16"), ("v6e", "W8A8", 0, "W4A16"),
        ("v7x", "DENSE", 0, None), ("v7x", "FP8_DYNAMIC", 0, "DENSE"), ("v7x", "W4A16", 128, None),
        ("v7x", "W4AFP8", 128, "W4A16"), ("v7x", "FP8_BLOCK", 0, "DENSE")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="rows to run, as TARGET:SCHEME (e.g. v6e:W8A8)")
    args = ap.parse_args()
    lines = ["| target | scheme | prefill TFLOP by MXU type | compute-bound ms | vs bf16 activations | weights GB → ms "
             "at HBM rate | max(compute, weights) ms | vs bf16 activations | XLA bytes accessed ms | decode bytes / "
             "floor | plan s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    seen, results = {}, []
    for target, scheme, group, base in ROWS:
        if args.only and f"{target}:{scheme}" not in args.only:
            continue
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_text(json.dumps(LLAMA3_8B))
            t0 = time.perf_counter()
            r = plan(Path(d) / "config.json", target, 2048, 16, scheme=scheme, group_size=group, search=False)
            wall = time.perf_counter() - t0
        p, dc = r["prefill_step_cost"], r["decode_step_cost"]
        weights = r["hbm_bytes"]["weights"]
        read = weights / CHIPS[target].hbm_bytes_per_s
        bound = max(p["roofline_seconds"], read)
        seen[(target, scheme)] = (p["roofline_seconds"], bound)
        b = seen.get((target, base))
        ratios = [f"{x / y:.2f}×" for x, y in zip(seen[(target, scheme)], b)] if b else ["1 (baseline)"] * 2
        flops = ", ".join(f"{t} {f / 1e12:.2f}" for t, f in p["flops_by_mxu_type"].items() if f)
        lines.append(f"| {target} | {scheme}{f' g{group}' if group else ''} | {flops} | {p['roofline_seconds'] * 1e3:.2f} | "
                     f"{ratios[0]} | {weights / 1e9:.2f} → {read * 1e3:.2f} | {bound * 1e3:.2f} | {ratios[1]} | "
                     f"{p['memory_seconds'] * 1e3:.2f} | {dc['ratio_to_floor']:.2f}× | {wall:.0f} |")
        results.append({"target": target, "scheme": scheme, "group": group, "wall_seconds": wall,
                        "weight_bytes": weights, "prefill_step_cost": p, "decode_step_cost": dc})
        print(lines[-1], flush=True)
    print("\n".join(lines))
    Path(tempfile.gettempdir(), "qk-prefill-roofline.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
