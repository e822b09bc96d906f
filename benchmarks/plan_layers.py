"""What one layer of each kind adds to a step's compiled bytes: `quantkit plan`'s decode step compiled as its
cost analysis compiles it (plan._layer_costs: a base of one layer of each kind, then one more layer of each
kind, layers unrolled), reported kind by kind, and the rest (embedding, lm_head, sampling). XLA's cost
analysis (Pallas calls by their declared CostEstimate); deviceless libtpu on this CPU.

Usage: .venv/bin/python benchmarks/plan_layers.py CONFIG_JSON --target v7x --max-model-len 9216 --max-num-seqs 512
       --data-parallel-size 8 --enable-expert-parallel [--set num_experts_per_tok=1 ...]
       (--set: config.json values changed before planning, in its text_config where it has one)
"""

from __future__ import annotations

import argparse
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

    def layers(c, compile_layers, later=True):  # plan._step_cost's signature; the decode step: later
        out.update(zip(("kinds", "base", "per"), plan_module._layer_costs(c, compile_layers, later)))
        raise _Done

    plan_module._step_cost = layers
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        try:
            plan_module.plan(Path(d) / "config.json", args.target, args.max_model_len, args.max_num_seqs, tp=args.tp,
                             dp=args.data_parallel_size, ep=args.enable_expert_parallel, scheme=args.scheme,
                             search=False, prefill_cost=False)
        except _Done:
            pass
    per = out["per"]
    rest = out["base"]["bytes_accessed"] - sum(p["bytes_accessed"] for p in per.values())
    print(f"the rest (embedding, lm_head, sampling): {rest / 1e9:.3f} GB")
    for kind, p in per.items():
        print(f"one {kind} layer: {p['bytes_accessed'] / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
