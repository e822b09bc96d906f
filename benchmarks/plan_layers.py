"""What one layer of each kind adds to a step's compiled bytes: `quantkit plan`'s decode step compiled as its
cost analysis compiles it (shallow variants, layers unrolled), but reported variant by variant: the base (one
layer of the first kind: embedding, lm_head, sampling and that layer) and the base plus one layer of each kind.
XLA's cost analysis (Pallas calls by their declared CostEstimate); deviceless libtpu on this CPU.

Usage: .venv/bin/python benchmarks/plan_layers.py CONFIG_JSON --target v7x --max-model-len 9216 --max-num-seqs 512
       --data-parallel-size 8 --enable-expert-parallel [--set num_experts_per_tok=1 ...]
       (--set: config.json values changed before planning, in its text_config where it has one)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import quantkit.plan as plan_module  # noqa: E402


class _Done(Exception):
    pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("--target", default="v6e")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--data-parallel-size", type=int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    ap.add_argument("--scheme", default="W4A16")
    ap.add_argument("--set", nargs="*", default=[], help="KEY=INT config values to change")
    args = ap.parse_args()
    cfg = json.loads(args.config.read_text())
    for kv in args.set:
        key, value = kv.split("=")
        cfg.get("text_config", cfg)[key] = int(value)
    out = {}

    def variants(c, compile_layers):
        first = c.layer_kinds[0]
        for kinds in ((first,), *((first, k) for k in dict.fromkeys(c.layer_kinds))):
            v = dataclasses.replace(c, num_layers=len(kinds), sliding_layers=tuple(x == "sliding" for x in kinds),
                                    linear_layers=tuple(x == "linear" for x in kinds) if c.linear_layers else ())
            ca = compile_layers(v).cost_analysis()
            out[kinds] = ((ca[0] if isinstance(ca, (list, tuple)) else ca) or {}).get("bytes accessed", 0.0)
        raise _Done

    plan_module._step_cost = variants
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        try:
            plan_module.plan(Path(d) / "config.json", args.target, args.max_model_len, args.max_num_seqs, tp=args.tp,
                             dp=args.data_parallel_size, ep=args.enable_expert_parallel, scheme=args.scheme,
                             search=False, prefill_cost=False)
        except _Done:
            pass
    base = min(out, key=len)
    print(f"base ({base[0]}): {out[base] / 1e9:.3f} GB")
    for kinds, b in out.items():
        if len(kinds) == 2:
            print(f"one {kinds[1]} layer: {(b - out[base]) / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
