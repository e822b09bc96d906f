"""Decode and prefill steps of a Llama-3-8B-shaped model (and a Qwen3-30B-A3B-shaped MoE) on a TPU, against
each decode step's byte floor, side by side in one run.

Random weights are made on the chip from the weight tree the loader would build (loader.abstract: the same
QTensors, stacked layers and layouts as a converted checkpoint), one layer's values repeated over the stack:
what a step costs does not depend on the values. The Runner is the one `generate` and `serve` use
(runtime/step.py). Per configuration:
- the time from Runner creation to the first token of a 128-token prompt (its compiles included);
- decode: one Runner per configuration, the largest batch's sequences of 128-token prompts (with --context N,
  each sequence's pages reserved to N tokens, the ones past its prompt not prefilled: what a step costs does
  not depend on the values its keys hold), then for each batch the decode step (one token a sequence, sampled on the
  device) dispatched 16 times back to back, wall time over 16 (the host's dispatch overlaps the device);
  the floor: every weight byte once (int4 at 4 bits; the embedding table only its rows; a MoE's routed experts
  only those its token hits at batch 1, and no floor at larger batches: `experts_hit`) plus the KV pages the
  step reads (every sequence's context, all layers) / the chip's HBM bandwidth; beside it the MXU's
  floor (`step_flops` at the chip's peak for the scheme's operands: from ~60 rows on, a v5e's int4 decode is
  bound by its 197 TFLOP/s, not its bytes) and the ratio to the larger of the two;
- prefill: one step of 2048 prompt tokens (16 sequences x 128), tokens/s.

Usage (on the chip): python3 benchmarks/tpu_decode.py [--configs W4A16,bf16] [--layers 32] [--batches 1,64]
[--context 1024] [--out F]
Configurations: W4A16 (g128), W8A16 (channel), W8A8 (int8 rows on the int8 MXU), bf16, W4A16-fp8kv, moe
(Qwen3-30B-A3B W4A16 g128, --moe-layers layers).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from plan_table import LLAMA3_8B, QWEN3_30B_A3B  # noqa: E402
from tpu_gmm import device_ops, open_run  # noqa: E402
from quantkit.kernels.tiling import CHIPS  # noqa: E402
from quantkit.plan import _quantization  # noqa: E402
from quantkit.quant.qtensor import BITS, QTensor  # noqa: E402
from quantkit.runtime.loader import LoadedModel, abstract, random_weights  # noqa: E402
from quantkit.runtime.models import from_hf  # noqa: E402
from quantkit.runtime.step import Row, Runner  # noqa: E402

PROMPT, STEPS = 128, 16
# name -> (config, scheme, group size, KV cache dtype)
CONFIGS = {"W4A16": (LLAMA3_8B, "W4A16", 128, "auto"), "W8A16": (LLAMA3_8B, "W8A16", -1, "auto"),
           "W8A8": (LLAMA3_8B, "W8A8", -1, "auto"), "bf16": (LLAMA3_8B, "DENSE", 128, "auto"),
           "W4A16-fp8kv": (LLAMA3_8B, "W4A16", 128, "fp8"), "moe": (QWEN3_30B_A3B, "W4A16", 128, "auto")}


def weight_bytes(params, experts: float = 1.0) -> int:
    """Bytes a decode step must read of the weights: all of them at their stored width, but the embedding;
    routed experts' only the share `experts` of them (those the step's tokens hit)."""
    total = 0
    for path, w in jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, QTensor))[0]:
        key = jax.tree_util.keystr(path)
        if "embed" in key:
            continue
        if isinstance(w, QTensor):
            b = w.values.size * BITS[w.qtype] // 8 + sum(a.size * a.dtype.itemsize for f, a in w.arrays.items()
                                                          if f != "values")
        else:
            b = w.size * w.dtype.itemsize
        total += b * experts if "experts_" in key else b
    return int(total)


def experts_hit(cfg, tokens: int) -> float | None:
    """The share of a MoE layer's experts that `tokens` tokens hit: top_k of them for one token; None for
    more (random routers do not spread tokens uniformly: run 14's batch of 8 took less time than the bytes
    of the experts a uniform router would hit); 1 for a dense model."""
    return 1.0 if not cfg.num_experts else cfg.top_k / cfg.num_experts if tokens == 1 else None


def step_flops(params, cfg, tokens: int, keys: int) -> float:
    """The MXU work of a decode step of `tokens` tokens with `keys` keys each: 2 a weight a token for every
    matrix (the embedding table a lookup; a MoE's routed experts top_k of num_experts of them a token) and
    4 a key a query head's lane for attention (QK and PV)."""
    macs = 0
    for path, w in jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, QTensor))[0]:
        key = jax.tree_util.keystr(path)
        n = w.values.size if isinstance(w, QTensor) else w.size if (w.ndim == 3 or "lm_head" in key) else 0
        macs += n * (cfg.top_k / cfg.num_experts if "experts_" in key else 1) if "embed" not in key else 0
    heads = cfg.num_layers * cfg.num_heads * cfg.head_dim
    return 2 * tokens * macs + 4 * tokens * keys * heads


def kv_bytes_per_token(cfg, itemsize: int) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


def top_ops(trace_dir: str, steps: int, top: int = 40) -> list[dict]:
    """The device's time per step by XLA op, from a jax.profiler trace: the `top` ops by total time, µs per
    step (the op's HLO text names the kernel or fusion)."""
    total, count = collections.Counter(), collections.Counter()
    for name, ns in device_ops(trace_dir):
        total[name] += ns
        count[name] += 1
    return [dict(op=k[:300], us=round(v / 1e3 / steps, 2), calls=count[k] / steps) for k, v in total.most_common(top)]


def run(name, layers, batches, log, chip, prefill=True, profile="", context=PROMPT):
    raw, scheme, group, kv = CONFIGS[name]
    raw = dict(raw, num_hidden_layers=layers)
    cfg = from_hf(raw)
    qc = _quantization(raw, scheme, group)
    t0 = time.perf_counter()
    params = jax.block_until_ready(random_weights(abstract(cfg, qc)))
    made = time.perf_counter() - t0
    model = LoadedModel(Path("."), cfg, params, jnp.bfloat16)
    wbytes = weight_bytes(params)
    base = dict(config=name, layers=layers, context=context, weight_gb=round(wbytes / 1e9, 3),
                weights_made_s=round(made, 1))
    try:
        t0 = time.perf_counter()
        most = max(batches)
        runner = Runner(model, max_model_len=max(256, context + 2 * STEPS), max_num_seqs=max(most, 16),
                        page_size=16, max_num_batched_tokens=2048 if prefill else 128, kv_cache_dtype=kv)
        # a prompt of its own a sequence: a MoE's tokens then route apart, as a served batch's do
        prompts = [[int(i) for i in np.random.default_rng(s).integers(3, 1000, PROMPT)] for s in range(max(most, 16))]
        runner.pool.reserve(0, 0, PROMPT - 1)
        jax.block_until_ready(runner.run(runner.batch([Row(0, 0, PROMPT, prompts[0])])))
        base["first_token_s"] = round(time.perf_counter() - t0, 1)
        for s in range(max(most, 16)):
            runner.pool.reserve(s, 0, PROMPT - 1)
        if prefill:  # 16 sequences x 128 tokens in one step (twice: the first compiles), the rest likewise
            b = runner.batch([Row(s, 0, PROMPT, prompts[s]) for s in range(16)])
            jax.block_until_ready(runner.run(b))
            t0 = time.perf_counter()
            jax.block_until_ready(runner.run(b))
            took = time.perf_counter() - t0
            base |= dict(prefill_2048_ms=round(took * 1e3, 2), prefill_tokens_per_s=round(2048 / took))
            if profile:
                trace = f"{profile}/{name}-prefill"
                with jax.profiler.trace(trace):
                    jax.block_until_ready(runner.run(b))
                log(**base, prefill_ops=top_ops(trace, 1, 20))
        for s in range(most):
            if s >= 16 or not prefill:
                jax.block_until_ready(runner.run(runner.batch([Row(s, 0, PROMPT, prompts[s])])))
            runner.pool.reserve(s, PROMPT, context + STEPS)
    except Exception as e:  # noqa: BLE001 -- one configuration failing is reported, the rest still run
        log(**base, error=f"{type(e).__name__}: {str(e)[:400]}")
        return
    for batch in batches:
        try:
            step = runner.batch([Row(s, context, 1) for s in range(batch)])
            jax.block_until_ready(runner.run(step))  # compiles the decode bucket
            t0 = time.perf_counter()
            out = None
            for _ in range(STEPS):
                out = runner.run(step)
            jax.block_until_ready(out)
            decode = (time.perf_counter() - t0) / STEPS
            kvb = batch * (context + 1) * kv_bytes_per_token(cfg, jnp.dtype(runner.kv_dtype).itemsize)
            hit = experts_hit(cfg, batch)
            floor = None if hit is None else (weight_bytes(params, hit) + kvb) / CHIPS[chip].hbm_bytes_per_s
            mxu = CHIPS[chip].peak_flops("int8" if scheme == "W8A8" else "bf16")
            flops = step_flops(params, cfg, batch, context + 1) / mxu
            floors = {} if floor is None else dict(
                floor_ms=round(floor * 1e3, 3), ratio=round(decode / floor, 3), mxu_floor_ms=round(flops * 1e3, 3),
                ratio_roofline=round(decode / max(floor, flops), 3))
            log(**base, batch=batch, decode_ms=round(decode * 1e3, 3), **floors, tokens_per_s=round(batch / decode, 1),
                kv_gb=round(kvb / 1e9, 3))
            if profile:  # where the step's time goes, op by op
                trace = f"{profile}/{name}-{batch}"
                with jax.profiler.trace(trace):
                    for _ in range(4):
                        out = runner.run(step)
                    jax.block_until_ready(out)
                log(**base, batch=batch, ops=top_ops(trace, 4))
        except Exception as e:  # noqa: BLE001
            log(**base, batch=batch, error=f"{type(e).__name__}: {str(e)[:400]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="W4A16,bf16")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--bf16-layers", type=int, default=16, help="bf16 weights of 32 layers do not fit a v5e")
    ap.add_argument("--moe-layers", type=int, default=24)
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--no-prefill", action="store_true", help="skip the 2048-token prefill step (its compile)")
    ap.add_argument("--context", type=int, default=PROMPT, help="decode at this many tokens a sequence "
                    "(pages past the 128-token prompt reserved, not prefilled)")
    ap.add_argument("--out", default="tpu_decode.jsonl")
    ap.add_argument("--profile", default="", help="also trace 4 decode steps a batch (and the prefill step) into "
                    "this folder and log the device's time by XLA op")
    a = ap.parse_args()
    chip, log = open_run(a.out)
    for name in a.configs.split(","):
        layers = a.moe_layers if name == "moe" else a.bf16_layers if name == "bf16" else a.layers
        run(name, layers, [int(b) for b in a.batches.split(",")], log, chip, not a.no_prefill, a.profile,
            max(a.context, PROMPT))
        jax.clear_caches()


if __name__ == "__main__":
    main()
