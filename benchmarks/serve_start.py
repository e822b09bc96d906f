"""`quantkit serve` from start to ready, cold (an empty compilation cache) and warm (the same cache again), and
the first request's latency, for the default model as served plainly, with a structured-output request as the
first one, and with speculative decoding (n-gram; the default model's EAGLE-3 head).

Per start: seconds from spawning the server to /ready 200; the first request's seconds (16 tokens, greedy, a
prompt of ~30 tokens; with `structured`, under a JSON schema), sent as soon as /ready answers; a second
request's; and, where /ready reports its compiled programs (`programs_compiled` of `programs`: the rest
compile while serving), the seconds until all are. --root runs another checkout's server (the same model,
prompts and machine): the row of the code before a change, side by side with it.

Usage: .venv/bin/python benchmarks/serve_start.py [--root /path/to/other/checkout] [--configs plain,structured]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"plain": [], "structured": [],
           "ngram": ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}'],
           "eagle3": ["--speculative-config",
                      '{"method": "eagle3", "model": "assets/tiny-llama-eagle3", "num_speculative_tokens": 3}']}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
PROMPTS = ("def fibonacci(n):\n    " * 3, "import os\nimport sys\n" * 8)


def start(root: Path, cache: Path, config: str, log: Path) -> dict:
    sock = Path(tempfile.mkdtemp(prefix="qk-start-")) / "s.sock"
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "quantkit.cli", "serve", "assets/tiny-llama", "--uds", str(sock),
                          "--served-model-name", "tiny", *CONFIGS[config]], cwd=root, stdout=subprocess.DEVNULL,
                         stderr=open(log, "w"), env={**os.environ, "JAX_PLATFORMS": "cpu", "QUANTKIT_JAX_CACHE": str(cache),
                                                     "PYTHONPATH": str(root)})
    c = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=600)
    try:
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"the server exited {p.returncode}; see {log}")
            try:
                if c.get("http://x/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        row = {"ready_s": time.monotonic() - t0}
        extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}} \
            if config == "structured" else {}
        for key, prompt in zip(("first_request_s", "second_request_s"), PROMPTS):
            t = time.monotonic()
            r = c.post("http://x/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 16,
                                                         "temperature": 0, **extra})
            assert r.status_code == 200, r.text
            row[key] = time.monotonic() - t
        while "programs" in (ready := c.get("http://x/ready").json()) and ready["programs_compiled"] < ready["programs"]:
            time.sleep(0.2)
        row["all_compiled_s"] = time.monotonic() - t0
        row["programs"] = ready.get("programs")
        return row
    finally:
        p.terminate()
        p.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(ROOT), help="the checkout whose server runs")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    a = ap.parse_args()
    root = Path(a.root).resolve()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {root} at {commit}", flush=True)
    print("| config | start | ready s | first request s | second request s | all programs compiled s |")
    print("|---|---|---|---|---|---|")
    for config in a.configs.split(","):
        cache = Path(tempfile.mkdtemp(prefix="qk-start-cache-"))
        for kind in ("cold", "warm"):
            r = start(root, cache, config, Path(tempfile.gettempdir()) / f"serve_start-{config}-{kind}.log")
            print(json.dumps({"config": config, "start": kind, "commit": commit, **r}), file=sys.stderr, flush=True)
            print(f"| {config} | {kind} | {r['ready_s']:.1f} | {r['first_request_s']:.3f} | {r['second_request_s']:.3f} "
                  f"| {r['all_compiled_s']:.1f} ({r['programs'] or '-'} programs) |", flush=True)


if __name__ == "__main__":
    main()
