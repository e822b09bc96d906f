"""Serving throughput and latency: `quantkit serve` vs vLLM's CPU build, same models, prompts and machine,
in one run. Also start-to-ready of quantkit with a cold and a warm compilation cache.

Models (random weights, the default model's tokenizer): `tiny` = the issue's 2-layer hidden-256 Llama,
and `mid` = a ~190M Llama (16 layers, hidden 1024), each dense bf16 and W4A16 g128 (made by `quantkit convert`;
quantkit serves W4A16 on CPU with its weights dequantized once at load, `Runner.weights`).
Load: N concurrent streaming clients (async httpx, SSE parsed by hand, the same client for both servers)
send a fixed number of /v1/completions requests with 64 output tokens (temperature 0); reported: output
tokens/s over the wall time, time to first token and time per output token p50/p99, errors, and quantkit's
engine a step (its /metrics): the host's milliseconds outside read-backs, and those it waited on a read-back
(the device still running the step; where ~0, the device waited for the host instead).

Usage: .venv/bin/python benchmarks/serve_load.py --vllm /tmp/vllmvenv/bin/vllm [--models tiny tiny-w4a16 mid mid-w4a16]
(vLLM venv: docs/benchmarks.md, "Installing the peers"; without --vllm only quantkit is measured.)
--uds: quantkit's servers listen on Unix sockets in --dir instead of loopback ports (a TPU VM without TCP);
--tpu: they run on the machine's TPU (JAX_PLATFORMS left to `serve`), not on the CPU.

--structured: structured outputs instead, on the default model (assets/tiny-llama): 16 concurrent clients,
64 requests of 64 tokens, unconstrained and under a JSON schema (an array of at least 64 short strings, so
both kinds write exactly 64 tokens), the two kinds alternating over --runs runs in one server; reported:
median output tokens/s of each and their ratio, and the server's mask time per step (/metrics).

--speculative: speculative decoding on the default model, servers side by side (plain, and one per
--spec-config: by default n-gram with 4 drafts (lookups of 1 to 5 tokens) and the default model's EAGLE-3
head with 3), the same load alternating between them over --runs runs, at
concurrency 1 (8 requests) and 16 (64 requests) of 64 tokens, temperature 0, on two workloads:
`code-edit`, a prompt that quotes code the answer repeats (a held-out stdlib function, the model's own
greedy continuation of it, then the function's first lines again: a model that copies continues with the
quoted code), `random`, random syllables (the model falls into loops that drafts predict), and the same at
temperature 1 (drafts mostly rejected); reported: median output tokens/s of each server, their ratio, and
the acceptance counts from the speculative server's /metrics. --workloads: only the named ones (e.g.
--workloads "random, temperature 1").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
MODELS = {"tiny": {"num_hidden_layers": 2},
          "mid": {"num_hidden_layers": 16, "hidden_size": 1024, "intermediate_size": 2816,
                  "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64},
          # Qwen3.5's hybrid stack (3 Gated DeltaNet layers, then gated attention, twice), random, the tiny
          # model's tokenizer: the hybrid prefix-caching benchmark's (prefix_load.py)
          "qwen3.5-tiny": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
                           "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4}}
OUT_TOKENS, MAX_LEN = 64, 512


def build(work: Path, name: str) -> Path:
    if name == "default":  # the embedded default model, as `quantkit serve` users first meet it
        return ROOT / "assets/tiny-llama"
    if name == "llama3-8b-w4a16":  # Llama-3-8B's config, W4A16 g128 as `convert` writes it, the default model's
        return _shape(work / name)  # tokenizer: served with --load-format dummy (random weights)
    import make_tiny_model

    base = name.removesuffix("-w4a16")
    dense = work / base
    if not (dense / "config.json").exists() and base.startswith("qwen3.5"):
        _qwen3_5(dense, MODELS[base])
    elif not (dense / "config.json").exists():
        make_tiny_model.build(dense, **MODELS[base])
    if name == base:
        return dense
    q = work / name
    if not (q / "config.json").exists():
        subprocess.run([str(ROOT / ".venv/bin/quantkit"), "convert", str(dense), str(q), "--scheme", "W4A16",
                        "--force"], check=True, capture_output=True)
    return q


def _shape(out: Path) -> Path:
    """A model directory without weights: Llama-3-8B's config.json with a W4A16 g128 quantization_config
    (lm_head left bf16) and the default model's tokenizer (its ids are a subset of the 128,256)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plan_table import LLAMA3_8B

    from quantkit.formats.ct_writer import writable_config
    from quantkit.formats.hf import GROUP_IGNORE

    out.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "assets/tiny-llama" / f, out / f)
    cfg = {**LLAMA3_8B, "bos_token_id": 1, "eos_token_id": 2,
           "quantization_config": writable_config("W4A16", 128, ["lm_head", *GROUP_IGNORE])}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def _qwen3_5(out: Path, shape: dict) -> None:
    """A random Qwen3.5 (transformers' class, seed 0, bf16) with make_tiny_model's tokenizer; built in a
    process of its own (transformers would take this folder's kernels.py for the `kernels` package)."""
    import make_tiny_model

    c = make_tiny_model.CONFIG
    code = ("import sys, json, torch, transformers as T; torch.manual_seed(0); "
            "T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**json.loads(sys.argv[2]))).to(torch.bfloat16)"
            ".save_pretrained(sys.argv[1])")
    cfg = {**shape, "vocab_size": c["vocab_size"], "max_position_embeddings": c["max_position_embeddings"],
           "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
    subprocess.run([sys.executable, "-c", code, str(out), json.dumps(cfg)], check=True, cwd=ROOT)
    make_tiny_model.train_tokenizer(make_tiny_model.pseudo_text(0), out, c["vocab_size"])


def prompts(n: int) -> list[str]:
    import numpy as np

    from make_tiny_model import SYLLABLES

    rng = np.random.default_rng(7)
    return [" ".join("".join(rng.choice(SYLLABLES, size=2)) for _ in range(rng.integers(20, 40))) for _ in range(n)]


class Address:
    """Where a quantkit server listens: a loopback TCP port, or a Unix socket (`uds`)."""

    def __init__(self, port: int, uds: str | None = None):
        self.port, self.uds = port, uds
        self.base = "http://localhost" if uds else f"http://127.0.0.1:{port}"

    def flags(self) -> list[str]:
        return ["--uds", self.uds] if self.uds else ["--port", str(self.port)]

    def transport(self, aio: bool = False, **kw):
        kind = httpx.AsyncHTTPTransport if aio else httpx.HTTPTransport
        if self.uds:
            return kind(uds=self.uds, **kw)
        # TCP_NODELAY: without it httpx's separate header and body writes meet the server's delayed ACK and
        # every request waits ~40 ms before the server sees its body
        return kind(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)], **kw)

    def request(self, method: str, path: str, **kw) -> httpx.Response:
        with httpx.Client(transport=self.transport(), timeout=kw.pop("timeout", 600)) as c:
            return c.request(method, self.base + path, **kw)


def addresses(args, names: list[str]) -> dict[str, Address]:
    """An address a server: ports from --port on, or with --uds a socket each in --dir."""
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    return {n: Address(args.port + i, str(Path(args.dir) / f"qk-{i}.sock") if args.uds else None)
            for i, n in enumerate(names)}


def quantkit_serve(path, address: Address, *flags: str) -> list[str]:
    return [sys.executable, "-m", "quantkit.cli", "serve", str(path), *address.flags(), *flags]


def server_env(args, cache: Path) -> dict:
    return {"QUANTKIT_JAX_CACHE": str(cache), **({} if args.tpu else {"JAX_PLATFORMS": "cpu"})}


class Proc:
    """A server process; `ready_s` = spawn to first successful readiness probe, `compiled_s` = to every program
    compiled (quantkit: /ready counts those it compiles while serving)."""

    def __init__(self, cmd: list[str], env: dict, probe: str, log: Path, timeout: float = 900,
                 address: Address | None = None):
        self.log = open(log, "w")
        address = address or Address(0)
        t0 = time.monotonic()
        self.p = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT)
        while time.monotonic() - t0 < timeout:
            if self.p.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited {self.p.returncode}; see {log}")
            try:
                r = address.request("GET", probe, timeout=2)
                if r.status_code == 200:
                    self.ready_s = time.monotonic() - t0
                    # quantkit compiles its larger token buckets while it serves: measure once all are
                    while "programs" in (j := r.json()) and j["programs_compiled"] < j["programs"]:
                        time.sleep(0.5)
                        r = address.request("GET", probe, timeout=2)
                    self.compiled_s = time.monotonic() - t0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"not ready after {timeout} s; see {log}")

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
        self.log.close()


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, out: list, max_tokens: int = OUT_TOKENS,
              extra: dict | None = None) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **(extra or {})}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                out.append(("error", r.status_code))
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    last = time.perf_counter()
                    first = first or last
        out.append(("ok", first - t0, (last - first) / max(tokens - 1, 1), tokens))
    except (httpx.HTTPError, TypeError) as e:
        out.append(("error", type(e).__name__))


async def load(address: Address, model: str, concurrency: int, texts: list[str], max_tokens: int = OUT_TOKENS,
               extra: dict | None = None) -> dict:
    """The prompts `texts` sent by `concurrency` clients, in order; latency and throughput figures."""
    out: list = []
    queue = list(texts)
    transport = address.transport(aio=True, limits=httpx.Limits(max_connections=concurrency + 4))
    async with httpx.AsyncClient(timeout=600, transport=transport) as client:
        async def worker():
            while queue:
                await one(client, f"{address.base}/v1/completions", model, queue.pop(0), out, max_tokens, extra)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [o for o in out if o[0] == "ok"]

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")

    ttft, tpot = [o[1] for o in ok], [o[2] for o in ok]
    return {"concurrency": concurrency, "requests": len(texts), "errors": len(out) - len(ok), "wall_s": wall,
            "tokens": sum(o[3] for o in ok), "tok_s": sum(o[3] for o in ok) / wall,
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
            "tpot_p50_ms": pct(tpot, 0.5), "tpot_p99_ms": pct(tpot, 0.99)}


ENGINE = ("quantkit_engine_steps_total", "quantkit_engine_host_seconds_total",
          "quantkit_engine_readback_wait_seconds_total", "quantkit_engine_readbacks_ready_total")


def engine_counters(address: Address) -> list[float]:
    """quantkit's engine counters (steps, host seconds, read-back wait seconds) from /metrics."""
    import re

    text = address.request("GET", "/metrics").text
    return [float(re.search(rf"^{k} ([0-9.e+-]+)$", text, re.M).group(1)) for k in ENGINE]


def measure(address: Address, model: str, runs: int, engine: bool = False, levels=(1, 16)) -> list[dict]:
    """Each concurrency's median run (`levels`: 12 requests at 1, 4 a client at more); `engine` (quantkit): also
    its steps and, a step, the host's ms outside read-backs, the ms it waited on them (the device still busy)
    and the share of read-backs that found their step finished (only then can the device have idled), over
    all the runs."""
    asyncio.run(load(address, model, 4, prompts(8)))  # warm-up traffic (also lets vLLM settle)
    rows = []
    for conc, n in ((c, 12 if c == 1 else 4 * c) for c in levels):
        before = engine_counters(address) if engine else None
        results = [asyncio.run(load(address, model, conc, prompts(n))) for _ in range(runs)]
        best = sorted(results, key=lambda r: r["tok_s"])[len(results) // 2]  # the median run
        best["tok_s_runs"] = [round(r["tok_s"]) for r in results]
        if engine:
            steps, host, wait, ready = (a - b for a, b in zip(engine_counters(address), before))
            best |= {"steps": steps, "host_ms_a_step": host / max(steps, 1) * 1e3,
                     "wait_ms_a_step": wait / max(steps, 1) * 1e3, "ready_share": ready / max(steps, 1)}
        rows.append(best)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm", help="path of the vllm executable in its own venv")
    ap.add_argument("--models", nargs="+", default=["tiny", "tiny-w4a16", "mid", "mid-w4a16"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/qk-serve-bench")
    ap.add_argument("--port", type=int, default=8311)
    ap.add_argument("--uds", action="store_true", help="quantkit's servers on Unix sockets in --dir (no TCP)")
    ap.add_argument("--tpu", action="store_true", help="quantkit's servers on this machine's TPU (else the CPU), "
                    "one at a time (one process holds the chip), each started once")
    ap.add_argument("--concurrency", default="1,16", help="concurrent clients, e.g. 1,16,64 (--max-num-seqs: the "
                    "largest)")
    ap.add_argument("--structured", action="store_true", help="structured outputs vs unconstrained (see above)")
    ap.add_argument("--speculative", action="store_true", help="speculative decoding vs plain (see above)")
    ap.add_argument("--spec-config", nargs="+", default=[
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 5}',
        '{"method": "eagle3", "model": "assets/tiny-llama-eagle3", "num_speculative_tokens": 3}'],
        help="one speculative server per config, beside the plain one")
    ap.add_argument("--workloads", nargs="+", choices=["code-edit", "random", "random, temperature 1"],
                    help="--speculative: only these workloads (default: all three)")
    args = ap.parse_args()
    if args.structured:
        return structured(args)
    if args.speculative:
        return speculative(args)
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "out_tokens": OUT_TOKENS, "max_model_len": MAX_LEN, "models": {}}
    at = addresses(args, ["quantkit"])["quantkit"]
    levels = [int(c) for c in args.concurrency.split(",")]
    for name in args.models:
        path = build(work, name)
        entry = report["models"][name] = {}
        cache = Path(tempfile.mkdtemp(prefix="qk-jax-cache-"))
        qk = quantkit_serve(path, at, "--max-model-len", str(MAX_LEN), "--max-num-seqs", str(max(16, *levels)),
                            "--served-model-name", name, *(["--load-format", "dummy"] if name.startswith("llama3")
                                                           else []))
        env = server_env(args, cache)
        starts = []
        for attempt in ("cold",) if args.tpu else ("cold", "warm"):  # the chip's minutes: one start
            p = Proc(qk, env, "/ready", work / f"quantkit-{name}-{attempt}.log", address=at)
            starts.append(p.ready_s)
            if attempt == "warm" or args.tpu:
                entry["quantkit"] = measure(at, name, args.runs, engine=True, levels=levels)
            p.stop()
        entry["quantkit_ready_s"] = dict(zip(("cold", "warm"), starts))
        shutil.rmtree(cache, ignore_errors=True)
        if args.vllm:
            cmd = [args.vllm, "serve", str(path), "--host", "127.0.0.1", "--port", str(args.port),
                   "--max-model-len", str(MAX_LEN), "--dtype", "bfloat16", "--served-model-name", name]
            tcp = Address(args.port)
            p = Proc(cmd, {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}, "/v1/models",
                     work / f"vllm-{name}.log", address=tcp)
            entry["vllm_ready_s"] = p.ready_s
            entry["vllm"] = measure(tcp, name, args.runs, levels=levels)
            p.stop()
        print(json.dumps({name: entry}, indent=1), flush=True)
    (work / "results.json").write_text(json.dumps(report, indent=1))
    print_table(report)


SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 64}


def structured(args) -> None:
    """The --structured mode (module docstring)."""
    import re

    at, name = addresses(args, ["quantkit"])["quantkit"], "tiny-llama"
    cache = Path(tempfile.mkdtemp(prefix="qk-jax-cache-"))
    p = Proc(quantkit_serve(ROOT / "assets/tiny-llama", at, "--max-model-len", str(MAX_LEN), "--max-num-seqs", "16",
                            "--served-model-name", name),
             server_env(args, cache), "/ready", Path(args.dir) / "quantkit-structured.log", address=at)
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "words", "schema": SCHEMA}}}

    def metric(key: str) -> float:
        m = re.search(rf"^{key} ([0-9.e+-]+)$", at.request("GET", "/metrics").text, re.M)
        return float(m.group(1))

    try:
        asyncio.run(load(at, name, 4, prompts(8)))  # warm-up
        asyncio.run(load(at, name, 4, prompts(8), extra=extra))
        runs = {"unconstrained": [], "json_schema": []}
        steps0, secs0 = metric("quantkit_structured_mask_steps_total"), metric("quantkit_structured_mask_seconds_total")
        masks0 = metric("quantkit_structured_masks_total")
        for _ in range(args.runs):
            for kind in runs:
                runs[kind].append(asyncio.run(load(at, name, 16, prompts(64), extra=extra if kind != "unconstrained"
                                                   else None)))
        steps = metric("quantkit_structured_mask_steps_total") - steps0
        secs = metric("quantkit_structured_mask_seconds_total") - secs0
        masks = metric("quantkit_structured_masks_total") - masks0
    finally:
        p.stop()
        shutil.rmtree(cache, ignore_errors=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {name}, 16 concurrent clients, 64 requests of "
          f"{OUT_TOKENS} tokens, temperature 0, {args.runs} runs alternating")
    print("| requests | output tok/s (median; runs) | TPOT p50 ms | tokens | errors |")
    print("|---|---|---|---|---|")
    med = {}
    for kind, rs in runs.items():
        r = sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2]
        med[kind] = r["tok_s"]
        each = ", ".join(f"{x['tok_s']:.0f}" for x in rs)
        print(f"| {kind} | {r['tok_s']:.0f} ({each}) | {r['tpot_p50_ms']:.1f} | "
              f"{r['tokens']} | {sum(x['errors'] for x in rs)} |")
    print(f"json_schema / unconstrained: {med['json_schema'] / med['unconstrained']:.2f}x; masks: {masks:.0f} in "
          f"{steps:.0f} steps, {secs / max(steps, 1) * 1e3:.2f} ms a step, {secs / max(masks, 1) * 1e6:.0f} us a row")


def code_prompts(n: int) -> list[str]:
    """n top-level functions of 200-1500 characters from the held-out stdlib files (the default model never
    trained on them), in file order."""
    import re

    import train_default_model

    out = []
    for f in train_default_model.heldout_files():
        for m in re.finditer(r"^def .*?(?=^\S)", f.read_text(encoding="utf-8", errors="replace"), re.M | re.S):
            if 200 < len(m.group(0)) < 1500:
                out.append(m.group(0).rstrip() + "\n")
                if len(out) == n:
                    return out
    raise RuntimeError(f"only {len(out)} functions found")


def speculative(args) -> None:
    """The --speculative mode (module docstring)."""
    import re

    name, model = "tiny-llama", str(ROOT / "assets/tiny-llama")
    Path(args.dir).mkdir(parents=True, exist_ok=True)  # the servers' logs
    specs = {}  # one server each, named by its method (a second config of a method: by its place too)
    for c in args.spec_config:
        method = json.loads(c)["method"]
        specs[method if method not in specs else f"{method}-{len(specs) + 1}"] = c
    ports = addresses(args, ["plain", *specs])
    flags = {"plain": [], **{k: ["--speculative-config", c] for k, c in specs.items()}}
    # the servers up at once: all, alternating run by run; on the chip one at a time (one process holds it)
    groups = [[k] for k in ports] if args.tpu else [list(ports)]

    def metric(kind: str, key: str) -> float:
        text = ports[kind].request("GET", "/metrics").text
        m = re.search(rf"^{re.escape(key)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1))

    def counts(kinds) -> dict:
        return {kind: tuple(metric(kind, f"vllm:spec_decode_num_{k}_total")
                            for k in ("drafts", "draft_tokens", "accepted_tokens")) for kind in kinds if kind in specs}

    chosen = args.workloads or ["code-edit", "random", "random, temperature 1"]
    base = code_prompts(64) if "code-edit" in chosen else []
    edits = None
    results: dict = {}  # (workload, concurrency) -> ({kind: runs}, {kind: count differences})
    for group in groups:
        procs, caches = {}, []
        try:
            for kind in group:
                caches.append(Path(tempfile.mkdtemp(prefix="qk-jax-cache-")))
                procs[kind] = Proc(quantkit_serve(model, ports[kind], "--max-model-len", "2048", "--max-num-seqs", "16",
                                                  "--served-model-name", name, *flags[kind]),
                                   server_env(args, caches[-1]), "/ready", Path(args.dir) / f"quantkit-{kind}.log",
                                   address=ports[kind])
            if edits is None:
                # each function, the model's own greedy continuation of it, then the function's start again;
                # asked of every server (greedy: the same text), so that all hold the same prefixes in their caches
                edits = []
                for text in base:
                    made = {ports[k].request("POST", "/v1/completions", json={
                        "model": name, "prompt": text, "max_tokens": OUT_TOKENS, "temperature": 0}).json()[
                        "choices"][0]["text"] for k in group}
                    head = "\n".join(text.splitlines()[:2]) + "\n"
                    edits.append(text + min(made) + "\n\n\n" + head)
            workloads = {"code-edit": (edits, None), "random": (prompts(64), None),
                         "random, temperature 1": (prompts(64), {"temperature": 1.0, "seed": 0})}
            for kind in group:  # warm-up traffic
                asyncio.run(load(ports[kind], name, 4, (edits or prompts(8))[:8]))
            for wl, (texts, extra) in ((k, v) for k, v in workloads.items() if k in chosen):
                for conc, n in ((1, 8), (16, 64)):
                    runs, diffs = results.setdefault((wl, conc), ({}, {}))
                    before = counts(group)
                    for _ in range(args.runs):
                        for kind in group:
                            runs.setdefault(kind, []).append(asyncio.run(load(ports[kind], name, conc, texts[:n],
                                                                              extra=extra)))
                    diffs |= {k: [a - b for a, b in zip(v, before[k])] for k, v in counts(group).items()}
                    print(json.dumps({"workload": wl, "concurrency": conc, **{k: [round(r["tok_s"]) for r in runs[k]]
                                                                              for k in group}}), flush=True)
        finally:
            for p in procs.values():
                p.stop()
            for c in caches:
                shutil.rmtree(c, ignore_errors=True)
    rows = [(wl, conc, {k: sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2] for k, rs in runs.items()}, runs, d)
            for (wl, conc), (runs, d) in results.items()]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {name}, {OUT_TOKENS} output tokens a request, "
          f"{args.runs} runs alternating; speculative: {'; '.join(specs.values())}")
    print("| workload | concurrency | method | plain tok/s (median; runs) | speculative tok/s (median; runs) | ratio | "
          "accepted / drafted tokens | tokens a drafted step |")
    print("|---|---|---|---|---|---|---|---|")
    for wl, conc, med, runs, d in rows:
        each = {k: ", ".join(f"{r['tok_s']:.0f}" for r in rs) for k, rs in runs.items()}
        for kind, (drafts, drafted, accepted) in d.items():
            print(f"| {wl} | {conc} | {kind} | {med['plain']['tok_s']:.0f} ({each['plain']}) | "
                  f"{med[kind]['tok_s']:.0f} ({each[kind]}) | {med[kind]['tok_s'] / med['plain']['tok_s']:.2f}x | "
                  f"{accepted:.0f} / {drafted:.0f} ({accepted / max(drafted, 1):.0%}) | "
                  f"{1 + accepted / max(drafts, 1):.2f} |")


def print_table(report: dict) -> None:
    print(f"\nmachine: {report['machine']}; {report['out_tokens']} output tokens per request, temperature 0")
    print("| model | server | concurrency | output tok/s (median of runs) | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
          "| errors | engine: host / read-back wait ms a step / read-backs found ready |")
    print("|---|---|---|---|---|---|---|---|")
    for name, e in report["models"].items():
        for server in ("quantkit", "vllm"):
            for r in e.get(server, []):
                steps = f"{r['host_ms_a_step']:.2f} / {r['wait_ms_a_step']:.2f} / {r['ready_share']:.0%}" \
                    if "steps" in r else "-"
                print(f"| {name} | {server} | {r['concurrency']} | {r['tok_s']:.0f} {r['tok_s_runs']} | "
                      f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} / "
                      f"{r['tpot_p99_ms']:.1f} | {r['errors']} | {steps} |")
        s = e["quantkit_ready_s"]
        warm = f", warm {s['warm']:.1f} s ({s['cold'] / s['warm']:.1f}x)" if "warm" in s else ""
        print(f"| {name} | quantkit start-to-ready | cold {s['cold']:.1f} s{warm} | vLLM "
              f"{e.get('vllm_ready_s', float('nan')):.1f} s | | | |")


if __name__ == "__main__":
    main()
