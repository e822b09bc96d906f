"""Sharded loading: load time and peak host memory of a synthetic bf16 Llama-shaped checkpoint (about 1.1 GB by
default) at --tp 1 and 4 on fake CPU devices, with Hugging Face transformers' `from_pretrained` of the same
checkpoint measured in the same run as the peer.

On CPU the "devices" are host memory, so what the placed weights take is counted apart: the figure that
matters is the transient, peak anonymous RSS during the load minus RSS before it minus the bytes the loaded
arrays hold at the end (mmap'd file pages are page cache, not counted). It is compared with the largest
tensor of the checkpoint.

Usage: python benchmarks/parallel_load.py [--layers 12] [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
             vocab_size=4096)


def rss_anon() -> int:
    """This process's anonymous resident memory (bytes): heap and device buffers, not file pages."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class Peak:
    """Samples rss_anon every millisecond in a thread while active."""

    def __enter__(self):
        self.before, self.peak, self._stop = rss_anon(), 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_anon())


def measure(path: str, tp: int, peer: bool) -> dict:
    """One load in this process (run in a fresh subprocess per measurement)."""
    from quantkit.formats.hf import Checkpoint

    largest = max(t.nbytes for t in Checkpoint.open(path).tensors.values())
    if peer:
        import torch
        import transformers

        with Peak() as p:
            t = time.perf_counter()
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
            seconds = time.perf_counter() - t
        held = sum(x.numel() * x.element_size() for x in model.state_dict().values())
    else:
        import jax

        from quantkit.runtime.loader import load
        from quantkit.runtime.sharding import start

        mesh = start(tp)
        jax.block_until_ready(jax.numpy.zeros(1))  # backend up before the baseline
        with Peak() as p:
            t = time.perf_counter()
            model = load(path, mesh=mesh)
            jax.block_until_ready(model.params)
            seconds = time.perf_counter() - t
        held = sum(s.data.nbytes for x in jax.tree_util.tree_leaves(model.params) for s in x.addressable_shards)
    return {"tp": tp, "peer": peer, "seconds": seconds, "rss_before": p.before, "rss_peak": p.peak, "held": held,
            "transient": p.peak - p.before - held, "largest_tensor": largest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--measure", nargs=3, metavar=("PATH", "TP", "PEER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        path, tp, peer = args.measure
        print(json.dumps(measure(path, int(tp), peer == "1")))
        return
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model.build(Path(tmp) / "synthetic", num_hidden_layers=args.layers, **SHAPE)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
        rows = []
        for _ in range(args.runs):  # interleaved, so that drift hits every row alike
            for tp, peer in ((1, False), (4, False), (1, True)):
                out = subprocess.run([sys.executable, __file__, "--measure", str(path), str(tp), str(int(peer))],
                                     capture_output=True, text=True, env=env, check=True)
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    table = []
    for tp, peer in ((1, False), (4, False), (1, True)):
        runs = sorted((r for r in rows if r["tp"] == tp and r["peer"] == peer), key=lambda r: r["seconds"])
        med = runs[len(runs) // 2]
        table.append({**med, "name": "transformers from_pretrained (bf16)" if peer else f"quantkit load --tp {tp}",
                      "seconds_all": [round(r["seconds"], 2) for r in runs],
                      "transient_max": max(r["transient"] for r in runs)})
    report = {"checkpoint_bytes": size, "layers": args.layers, "rows": table}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    mib = 2 ** 20
    print(f"checkpoint: {size / 1e9:.2f} GB bf16, {args.layers} layers, largest tensor "
          f"{table[0]['largest_tensor'] / mib:.0f} MiB; median of {args.runs} runs")
    print(f"{'loader':38} {'seconds':>8} {'held MiB':>9} {'peak-before MiB':>16} {'transient MiB':>14} "
          f"{'x largest':>9}")
    for r in table:
        print(f"{r['name']:38} {r['seconds']:8.2f} {r['held'] / mib:9.0f} {(r['rss_peak'] - r['rss_before']) / mib:16.0f} "
              f"{r['transient'] / mib:14.0f} {r['transient'] / r['largest_tensor']:9.2f}")


if __name__ == "__main__":
    main()
