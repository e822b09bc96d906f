"""Prefill and decode throughput of the JAX runtime vs transformers (torch CPU), same weights, one run.

Model: a synthetic Llama of ~220M parameters (hidden 1024, 12 layers, MLP 2816, 16 heads / 4 KV heads,
vocab 32000), random weights (bf16), written with quantkit's own writer; its W4A16 g128 version made
with `quantkit convert`. Measured: prefill tokens/s for a 128-token prompt and decode tokens/s over 32
steps, at batch 1 and 8, for quantkit bf16, quantkit W4A16 and transformers float32 (its fastest CPU
dtype here) and bfloat16. Medians of 3; compilations counted per runner (they happen in a warm-up that
is not timed; the persistent compilation cache is off).

Usage: .venv/bin/python benchmarks/runtime_cpu.py [--dir /tmp/qk-rt-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from quantkit.formats.safetensors_io import write_safetensors  # noqa: E402

CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
       "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
       "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
       "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu"}
PROMPT, STEPS, RUNS = 128, 32, 3


def build(path: Path) -> None:
    if (path / "model.safetensors").exists():
        return
    rng = np.random.default_rng(0)
    c = CFG
    h, i, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * c["head_dim"]

    def w(*shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    t = {"model.embed_tokens.weight": w(c["vocab_size"], h), "model.norm.weight": np.ones(h, ml_dtypes.bfloat16),
         "lm_head.weight": w(c["vocab_size"], h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t |= {p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
              p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
              p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
              p + "mlp.down_proj.weight": w(h, i), p + "input_layernorm.weight": np.ones(h, ml_dtypes.bfloat16),
              p + "post_attention_layernorm.weight": np.ones(h, ml_dtypes.bfloat16)}
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(path / "model.safetensors", t, {"format": "pt"})
    (path / "config.json").write_text(json.dumps(CFG))


def time_quantkit(path: Path, batch: int) -> tuple[float, float, int]:
    import jax
    import jax.numpy as jnp

    from quantkit.runtime.step import Row, Runner
    from quantkit.runtime.loader import load

    model = load(path, dtype=jnp.bfloat16)
    rng = np.random.default_rng(1)
    prompts = rng.integers(0, CFG["vocab_size"], (batch, PROMPT)).tolist()

    def run():
        """One ragged step prefilling every prompt, then STEPS steps of one decode token per sequence."""
        r = Runner(model, max_model_len=PROMPT + STEPS + 8, max_num_seqs=batch, page_size=16,
                   max_num_batched_tokens=batch * PROMPT)
        r._step = shared[0] or r._step
        shared[0] = r._step
        for i in range(batch):
            r.pool.reserve(i, 0, PROMPT + STEPS)
        t0 = time.perf_counter()
        jax.block_until_ready(r.run(r.batch([Row(i, 0, PROMPT, p) for i, p in enumerate(prompts)])))
        t1 = time.perf_counter()
        for s in range(STEPS):
            out = r.run(r.batch([Row(i, PROMPT + s, 1) for i in range(batch)]))
        jax.block_until_ready(out)
        return t1 - t0, time.perf_counter() - t1, r

    shared = [None]
    _, _, r = run()  # warm-up: compiles the prefill and decode buckets
    pre, dec = zip(*[run()[:2] for _ in range(RUNS)])
    return batch * PROMPT / statistics.median(pre), batch * STEPS / statistics.median(dec), len(r.compiled)


def time_transformers(path: Path, batch: int, dtype: str) -> tuple[float, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    rng = np.random.default_rng(1)
    prompt = torch.tensor(rng.integers(0, CFG["vocab_size"], (batch, PROMPT)))

    def run():
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model(prompt, use_cache=True)
            t1 = time.perf_counter()
            past = out.past_key_values
            tok = torch.zeros((batch, 1), dtype=torch.long)
            for _ in range(STEPS):
                out = model(tok, past_key_values=past, use_cache=True)
                past = out.past_key_values
            return t1 - t0, time.perf_counter() - t1

    run()
    pre, dec = zip(*[run() for _ in range(RUNS)])
    return batch * PROMPT / statistics.median(pre), batch * STEPS / statistics.median(dec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/qk-rt-bench"))
    args = ap.parse_args()
    dense, w4 = args.dir / "bf16", args.dir / "w4a16"
    build(dense)
    if not w4.exists():
        from quantkit.convert import convert

        convert(dense, w4, "W4A16", 128)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"prompt {PROMPT}, {STEPS} decode steps, median of {RUNS}")
    print("| engine | weights | batch | prefill tok/s | decode tok/s | compilations |")
    print("|---|---|---|---|---|---|")
    rows = {}
    for batch in (1, 8):
        for label, path in (("bf16", dense), ("W4A16 g128", w4)):
            p, d, n = time_quantkit(path, batch)
            rows[("quantkit", label, batch)] = d
            print(f"| quantkit (JAX, XLA path) | {label} | {batch} | {p:.0f} | {d:.1f} | {n} |", flush=True)
        for dtype in ("float32", "bfloat16"):
            p, d = time_transformers(dense, batch, dtype)
            rows[("transformers", dtype, batch)] = d
            print(f"| transformers (torch CPU) | {dtype} | {batch} | {p:.0f} | {d:.1f} | - |", flush=True)
    for batch in (1, 8):
        best = max(rows[("transformers", "float32", batch)], rows[("transformers", "bfloat16", batch)])
        print(f"batch {batch}: quantkit bf16 decode / best transformers = "
              f"{rows[('quantkit', 'bf16', batch)] / best:.2f}x; W4A16: {rows[('quantkit', 'W4A16 g128', batch)] / best:.2f}x")


if __name__ == "__main__":
    main()
