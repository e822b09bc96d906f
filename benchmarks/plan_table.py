"""`quantkit plan` for published model shapes at W4A16 on a v6e, bf16 ones on a v6e:2x2 slice and
Qwen3.5-397B-A17B on TPU7x (deviceless libtpu compilation on this CPU): HBM split (per chip; per TensorCore on
a v7x), the largest concurrency at 2048 tokens, compile seconds (all programs, and the slowest single one)
and the wall time of the whole plan (search included), XLA's bytes accessed by the compiled decode step
against its floor (weights + KV read once), and the decode step's roofline time (an estimate, not a
measurement). Configs are the models' published
config.json values (Gemma 4: the multimodal config.json files in benchmarks/configs/, read as they are).

Rows on several chips and MoE rows also go into a second table: expert bytes per chip, the expert kernel's path, and the
buffers the compiled decode step all-reduces or gathers across chips beside the floor (plan's
decode_step_collectives).

Usage: .venv/bin/python benchmarks/plan_table.py [--max-model-len 2048] [--max-num-seqs 16] [--only NAME:SCHEME:TP]
       [--no-search]
       (expert parallel rows: NAME:W4A16g128:EP:TP; gpt-oss: NAME:MXFP4:as:published[:EP]:TP)
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

import quantkit.runtime.aot as aot  # noqa: E402
from quantkit.plan import plan  # noqa: E402

COMPILES: list[float] = []  # seconds of each program compiled by the current row's plan
_compile_for = aot.compile_for


def _timed_compile_for(*args, **kw):
    compiled, seconds = _compile_for(*args, **kw)
    COMPILES.append(seconds)
    return compiled, seconds


aot.compile_for = _timed_compile_for  # plan imports it at call time

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
             "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
             "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
GEMMA3_27B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 5376,
              "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32,
              "num_key_value_heads": 16, "head_dim": 128, "vocab_size": 262208, "max_position_embeddings": 131072,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 1024,
              "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
              "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh", "sliding_window_pattern": 6}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
                 "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                 "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                 "tie_word_embeddings": False}
CONFIGS = Path(__file__).resolve().parent / "configs"  # published multimodal config.json files (README there)
GEMMA4_31B = json.loads((CONFIGS / "gemma-4-31B-it.json").read_text())
GEMMA4_26B_A4B = json.loads((CONFIGS / "gemma-4-26B-A4B-it.json").read_text())
QWEN35_35B_A3B = json.loads((CONFIGS / "qwen3.5-35B-A3B.json").read_text())
QWEN35_397B_A17B = json.loads((CONFIGS / "qwen3.5-397B-A17B.json").read_text())
GPT_OSS_20B = json.loads((CONFIGS / "gpt-oss-20b.json").read_text())
GPT_OSS_120B = json.loads((CONFIGS / "gpt-oss-120b.json").read_text())
ROWS = [  # name, config, scheme, group size, devices (, expert parallel (, target: v6e unless given))
    ("Llama-3-8B", LLAMA3_8B, "W4A16", 128, 1), ("Llama-3-8B", LLAMA3_8B, "W8A16", 128, 1),
    ("Llama-3-8B", LLAMA3_8B, "W4A16_ASYM", 128, 1), ("Llama-3-8B", LLAMA3_8B, "W8A16_ASYM", 128, 1),
    ("Llama-3-8B", LLAMA3_8B, "MXFP8A16", 32, 1), ("Llama-3-8B", LLAMA3_8B, "NVFP4A16", 16, 1),
    ("Gemma-3-27B", GEMMA3_27B, "W4A16", 128, 1),
    ("Gemma-3-27B", GEMMA3_27B, "W4A16", 32, 1), ("Qwen3-30B-A3B", QWEN3_30B_A3B, "W4A16", 128, 1),
    ("Gemma-3-27B", GEMMA3_27B, "DENSE", 0, 4),
    ("Gemma-4-31B", GEMMA4_31B, "W4A16", 128, 1), ("Gemma-4-31B", GEMMA4_31B, "W4A16", 32, 1),
    # the experts' 704 inputs are not a multiple of 128: g32 (704 = 22 x 32)
    ("Gemma-4-26B-A4B", GEMMA4_26B_A4B, "W4A16", 32, 1), ("Gemma-4-31B", GEMMA4_31B, "DENSE", 0, 4),
    # an MoE on 4 chips, its experts split whole (expert parallel; split four ways, the down projection's 6
    # scale groups of 128 inputs would not divide: refused)
    ("Qwen3-30B-A3B", QWEN3_30B_A3B, "W4A16", 128, 4, True),
    # Gated DeltaNet + gated attention + shared-expert MoE: KV for the 10 attention layers, a recurrent state
    # slot per sequence for the 30 GDN layers (the "state" column)
    ("Qwen3.5-35B-A3B", QWEN35_35B_A3B, "W4A16", 128, 1),
    # 512 experts x 60 layers: ~216 GB at W4A16 g128, more than one TPU7x chip (2 TensorCores of 94.75 GiB):
    # one chip (2 devices) and two chips (4 devices: tpu7x:1x2x1), experts split whole
    ("Qwen3.5-397B-A17B", QWEN35_397B_A17B, "W4A16", 128, 2, True, "v7x"),
    ("Qwen3.5-397B-A17B", QWEN35_397B_A17B, "W4A16", 128, 4, True, "v7x"),
    # gpt-oss as OpenAI publishes it (scheme None: the checkpoint's own MXFP4 experts, attention and router
    # bf16): the 20b on one v6e, the 120b on one TPU7x chip (2 TensorCores) and on a v6e:2x2, experts split whole
    # (split by columns, the experts' 2944 padded columns would leave 1472 a device, not a multiple of 128:
    # the XLA path, measured 21x the floor)
    ("gpt-oss-20b", GPT_OSS_20B, None, 32, 1), ("gpt-oss-120b", GPT_OSS_120B, None, 32, 2, True, "v7x"),
    ("gpt-oss-120b", GPT_OSS_120B, None, 32, 4, True),
    # data parallel + expert parallel (--data-parallel-size N --enable-expert-parallel, tp 1): each device its
    # own sequences, pages and state slots, the attention and GDN weights whole, num_experts / N experts. The
    # 397B on TPU7x 2x2x1 (8 TensorCores) at the Ironwood playbook's 512 sequences of 8K + 1K, beside tensor
    # parallelism over the same devices; the 35B-A3B on a v6e:2x2 and on one TPU7x chip
    ("Qwen3.5-397B-A17B", QWEN35_397B_A17B, "W4A16", 128, 8, True, "v7x", {"dp": 8, "len": 9216, "seqs": 512}),
    ("Qwen3.5-397B-A17B", QWEN35_397B_A17B, "W4A16", 128, 8, True, "v7x", {"len": 9216, "seqs": 512}),
    ("Qwen3.5-397B-A17B", QWEN35_397B_A17B, "W4A16", 128, 4, True, "v7x", {"dp": 4, "len": 9216, "seqs": 128}),
    ("Qwen3.5-35B-A3B", QWEN35_35B_A3B, "W4A16", 128, 4, True, "v6e", {"dp": 4, "seqs": 64}),
    ("Qwen3.5-35B-A3B", QWEN35_35B_A3B, "W4A16", 128, 2, True, "v7x", {"dp": 2, "seqs": 32})]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--only", nargs="*", help="rows to run, as NAME:SCHEME:TP (e.g. Gemma-3-27B:bf16:4)")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], help="each row with each of these KV caches")
    ap.add_argument("--no-search", action="store_true", help="skip the search for the largest concurrency")
    args = ap.parse_args()
    gib = 1 << 30
    lines = ["| model | weights | KV cache | chips | fits at 16 | weights GiB | KV GiB (16 × 2048) | recurrent state GiB | "
             "temporaries GiB | largest concurrency at 2048 | plan s (wall, this CPU) | compile s (all programs) | "
             "slowest compile s | decode step: XLA bytes accessed / floor | decode step, roofline estimate |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    par = ["| model | weights | chips | experts | experts GiB per chip | weights GiB per chip | largest concurrency "
           "at 2048 | expert kernel | collectives per decode step (16 tokens), MiB | floor, MiB |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    results = []
    for (name, cfg, scheme, group, tp, *rest), kv in ((row, kv) for row in ROWS for kv in args.kv_cache_dtype):
        ep, target = bool(rest and rest[0]), rest[1] if len(rest) > 1 else "v6e"
        shape = rest[2] if len(rest) > 2 else {}  # this row's own data parallelism, max_model_len, max_num_seqs
        dp, tp = shape.get("dp", 1), 1 if shape.get("dp") else tp
        label = ("MXFP4 as published" if scheme is None else f"{scheme}g{group}" if scheme != "DENSE" else "bf16") \
            + (" EP" if ep else "") + (" DP" if dp > 1 else "")
        if args.only and f"{name}:{label.replace(' ', ':')}:{max(tp, dp)}" not in args.only:
            continue
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_text(json.dumps(cfg))
            t0 = time.perf_counter()
            COMPILES.clear()
            r = plan(Path(d) / "config.json", target, shape.get("len", args.max_model_len),
                     shape.get("seqs", args.max_num_seqs), tp=tp, scheme=scheme, group_size=group, kv_cache_dtype=kv,
                     ep=ep, search=not args.no_search, dp=dp)
            wall = time.perf_counter() - t0
        h, est, cost = r["hbm_bytes"], r["decode_step_estimate"], r["decode_step_cost"]
        results.append({"model": name, "group": group, "wall_seconds": wall, "compiles": list(COMPILES), **r})
        at = f" ({r['max_num_seqs']} × {r['max_model_len']})" if shape else ""  # a row's own shape
        lines.append(f"| {name} | {label} | {r['kv_cache_dtype']} | {r['topology']} | {'yes' if r['fits'] else 'no'}{at} | "
                     f"{h['weights'] / gib:.2f} | "
                     f"{h['kv_cache'] / gib:.2f} | {h['recurrent_state'] / gib:.2f} | {h['temporaries'] / gib:.2f} | {r['max_num_seqs_that_fit']} | "
                     f"{wall:.0f} | {sum(COMPILES):.0f} | {max(COMPILES, default=0):.0f} | " + (
                         "— | — |" if cost is None else  # refused by the compiler (out of HBM): nothing to count
                         f"{cost['bytes_accessed'] / 1e9:.2f} GB / {cost['floor_bytes'] / 1e9:.2f} GB = "
                         f"{cost['ratio_to_floor']:.2f}× | {est['seconds'] * 1e3:.1f} ms → "
                         f"~{est['output_tokens_per_s']:.0f} tok/s at {r['max_num_seqs']} |"))
        print(lines[-1], flush=True)
        moe = cfg.get("num_experts") or cfg.get("num_local_experts")
        if max(tp, dp) > 1 or moe:
            c = r["decode_step_collectives"] or {"bytes": {}, "total": 0, "floor_bytes": 0}
            experts = [k for k in r["kernels"] if "gate" in k["name"] or "down" in k["name"]] if moe else []
            kinds = ", ".join(f"{op} {b / 2**20:.2f}" for op, b in sorted(c["bytes"].items()))
            paths = "; ".join(f"{k['shape']} {k['path'].split(' ')[0]}" for k in experts) or "—"
            par.append(f"| {name} | {label.split()[0]} | {r['topology']} | {('whole, expert parallel' if ep else 'split' if tp > 1 else 'all on the chip') if experts else '—'} | "
                       f"{h['of_weights_experts'] / gib:.2f} | {h['weights'] / gib:.2f} | {r['max_num_seqs_that_fit']} | "
                       f"{paths} | " +
                       (f"{c['total'] / 2**20:.2f} ({kinds}) | {c['floor_bytes'] / 2**20:.2f} |" if max(tp, dp) > 1
                        else "— | — |"))
            print(par[-1], flush=True)
    print("\n".join(lines))
    print("\n".join(par))
    Path(tempfile.gettempdir(), "qk-plan-table.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
