"""Shared-prefix serving load: `quantkit serve` with and without prefix caching vs vLLM's CPU build (with,
and optionally without, its prefix caching), same model, prompts and machine, in one run.

Workload: one ~1,500-token system prompt (random SYLLABLES words, sized with the model's tokenizer) shared by
32 /v1/completions requests, each the system prompt plus ~50 tokens of its own, sent by 8 concurrent streaming
clients (serve_load's client: async httpx, SSE parsed by hand, TCP_NODELAY), 16 output tokens, temperature 0.
Before measuring, each server gets one warm-up request of the same length that does not contain the system
prompt, so the measured run starts with a cold prefix cache and its first requests fill it.
Reported per server configuration: TTFT p50/p99, TPOT p50, output tokens/s over the wall time, wall time,
errors, and the prefix-cache hit and query tokens from the server's /metrics (delta over the measured run).

Usage: .venv/bin/python benchmarks/prefix_load.py --vllm /tmp/vllmvenv/bin/vllm [--models tiny mid] [--vllm-no-cache]
(vLLM venv: docs/benchmarks.md, "Installing the peers"; without --vllm only quantkit is measured; models per serve_load.py.)
--uds and --tpu as serve_load.py's: quantkit on a Unix socket in --dir, on the machine's TPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import serve_load  # noqa: E402 - also puts scripts/ on sys.path

MAX_LEN = 2048
METRICS = {"quantkit": ("quantkit_prefix_cache_queries_total", "quantkit_prefix_cache_hits_total"),
           "vllm": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}


def words_to(codec, rng, n_tokens: int) -> str:
    """Random SYLLABLES words, the shortest run of them that encodes to at least n_tokens tokens."""
    from make_tiny_model import SYLLABLES

    words = ["".join(rng.choice(SYLLABLES, size=rng.integers(1, 4))) for _ in range(2 * n_tokens + 16)]
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if len(codec.encode(" ".join(words[:mid]), special=False)) < n_tokens else (lo, mid)
    return " ".join(words[:lo])


def workload(path: Path, n: int, system_tokens: int, own_tokens: int) -> tuple[list[str], str, dict]:
    """(prompts sharing one system prompt, a warm-up prompt of the same length without it, token counts)."""
    import numpy as np

    from quantkit.runtime.tokenizer import TextCodec

    codec = TextCodec(path)
    system = words_to(codec, np.random.default_rng(11), system_tokens)
    texts = [f"{system}\n\nRequest {i}: {words_to(codec, np.random.default_rng(1000 + i), own_tokens)}"
             for i in range(n)]
    warm = words_to(codec, np.random.default_rng(5), system_tokens + own_tokens)
    lens = [len(codec.encode(t)) for t in texts]
    return texts, warm, {"system": len(codec.encode(system)), "prompt_min": min(lens), "prompt_max": max(lens),
                         "warmup": len(codec.encode(warm))}


def prefix_counters(at: serve_load.Address, server: str) -> tuple[float, float]:
    """(queries, hits) in prompt tokens from /metrics, summed over label sets."""
    want = METRICS[server]
    vals = dict.fromkeys(want, 0.0)
    for line in at.request("GET", "/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{")[0].split()[0]
        if name in vals:
            vals[name] += float(line.rsplit(maxsplit=1)[1])  # no timestamps on either server
    return vals[want[0]], vals[want[1]]


def measure(at: serve_load.Address, server: str, model: str, texts: list[str], warm: str, args) -> dict:
    asyncio.run(serve_load.load(at, model, 1, [warm], args.out_tokens))  # no system prompt: the prefix cache stays cold
    time.sleep(1)  # let the server's counters settle (vLLM records stats after it streams the last chunk)
    q0, h0 = prefix_counters(at, server)
    r = asyncio.run(serve_load.load(at, model, args.concurrency, texts, args.out_tokens))
    time.sleep(1)
    q1, h1 = prefix_counters(at, server)
    r["prefix_query_tokens"], r["prefix_hit_tokens"] = q1 - q0, h1 - h0
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm", help="path of the vllm executable in its own venv")
    ap.add_argument("--vllm-no-cache", action="store_true", help="also run vLLM with --no-enable-prefix-caching")
    ap.add_argument("--models", nargs="+", default=["tiny"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--own-tokens", type=int, default=50)
    ap.add_argument("--out-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--dir", default="/tmp/qk-serve-bench")
    ap.add_argument("--port", type=int, default=8331)
    ap.add_argument("--uds", action="store_true", help="quantkit on a Unix socket in --dir (no TCP)")
    ap.add_argument("--tpu", action="store_true", help="quantkit on this machine's TPU (else the CPU)")
    args = ap.parse_args()
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "requests": args.requests, "concurrency": args.concurrency, "out_tokens": args.out_tokens,
              "max_model_len": MAX_LEN, "max_num_seqs": args.max_num_seqs, "models": {}}
    qk, tcp = serve_load.addresses(args, ["quantkit"])["quantkit"], serve_load.Address(args.port)
    for name in args.models:
        path = serve_load.build(work, name)
        texts, warm, counts = workload(path, args.requests, args.system_tokens, args.own_tokens)
        entry = report["models"][name] = {"prompt_tokens": counts, "runs": {}}
        cache = Path(tempfile.mkdtemp(prefix="qk-jax-cache-"))
        configs = [("quantkit", "prefix caching", []),
                   ("quantkit", "no prefix caching", ["--no-enable-prefix-caching"])]
        if args.vllm:
            configs.append(("vllm", "prefix caching", ["--enable-prefix-caching"]))
            if args.vllm_no_cache:
                configs.append(("vllm", "no prefix caching", ["--no-enable-prefix-caching"]))
        for server, label, flags in configs:
            log = work / f"prefix-{server}-{name}-{'off' if flags and flags[0].startswith('--no') else 'on'}.log"
            if server == "quantkit":
                at = qk
                cmd = serve_load.quantkit_serve(path, at, "--max-model-len", str(MAX_LEN), "--max-num-seqs",
                                                str(args.max_num_seqs), "--served-model-name", name, *flags)
                p = serve_load.Proc(cmd, serve_load.server_env(args, cache), "/ready", log, address=at)
            else:
                cmd = [args.vllm, "serve", str(path), "--host", "127.0.0.1", "--port", str(args.port),
                       "--max-model-len", str(MAX_LEN), "--max-num-seqs", str(args.max_num_seqs), "--dtype",
                       "bfloat16", "--served-model-name", name, *flags]
                at = tcp
                p = serve_load.Proc(cmd, {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"},
                                    "/v1/models", log, address=at)
            try:
                r = measure(at, server, name, texts, warm, args)
            finally:
                p.stop()
            r["ready_s"] = p.ready_s
            entry["runs"][f"{server}, {label}"] = r
            print(json.dumps({f"{name} {server}, {label}": r}), flush=True)
        shutil.rmtree(cache, ignore_errors=True)
    (work / "prefix_results.json").write_text(json.dumps(report, indent=1))
    print_table(report)


def print_table(report: dict) -> None:
    print(f"\nmachine: {report['machine']}; {report['requests']} requests, concurrency {report['concurrency']}, "
          f"{report['out_tokens']} output tokens per request, temperature 0")
    for name, e in report["models"].items():
        c = e["prompt_tokens"]
        print(f"\n{name}: system prompt {c['system']} tokens, prompts {c['prompt_min']}-{c['prompt_max']} tokens, "
              f"warm-up {c['warmup']} tokens (no system prompt)")
        print("| model | server | TTFT p50 / p99 ms | TPOT p50 ms | output tok/s | wall s | errors "
              "| prefix-cache hit / query tokens |")
        print("|---|---|---|---|---|---|---|---|")
        for server, r in e["runs"].items():
            q = r["prefix_query_tokens"]
            hit = f"{r['prefix_hit_tokens'] / q:.0%}" if q else "no lookups"
            print(f"| {name} | {server} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} "
                  f"| {r['tok_s']:.0f} | {r['wall_s']:.2f} | {r['errors']} | {r['prefix_hit_tokens']:.0f} / "
                  f"{q:.0f} ({hit}) |")
        runs = e["runs"]
        ttft = {k: v["ttft_p50_ms"] for k, v in runs.items()}
        parts = [f"quantkit TTFT p50 without / with prefix caching: "
                 f"{ttft['quantkit, no prefix caching'] / ttft['quantkit, prefix caching']:.2f}x"]
        if "vllm, no prefix caching" in ttft:
            parts.append(f"vLLM without / with: {ttft['vllm, no prefix caching'] / ttft['vllm, prefix caching']:.2f}x")
        if "vllm, prefix caching" in runs:
            q, v = runs["quantkit, prefix caching"], runs["vllm, prefix caching"]
            parts.append(f"with prefix caching, quantkit vs vLLM: TTFT p50 {q['ttft_p50_ms'] / v['ttft_p50_ms']:.2f}x "
                         f"(<1 = quantkit faster), output tok/s {q['tok_s'] / v['tok_s']:.2f}x")
        print(f"\n{name}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
