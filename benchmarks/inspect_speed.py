"""Wall time of `quantkit inspect` (process start included) on a multi-GB and a tiny checkpoint.

Both checkpoints have the same 500 tensors in a W4A16 (pack-quantized, group 128) layout: 125 linear
modules (weight_packed, weight_scale, weight_shape) and 125 norms; only the tensor sizes differ. The data
is really written (zeros), so the big one is several GB on disk.

Peer, same run: the least a loader does before it can name the scheme — open every shard with the
`safetensors` library (header only) and validate quantization_config with compressed-tensors'
`QuantizationConfig` (vLLM's path). Needs the dev extra for the peer.

Usage: .venv/bin/python benchmarks/inspect_speed.py [--runs 7] [--gb 4] [--dir /tmp/qk-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

QCONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "version": "0.20.1", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128, "dynamic": False}}},
}


def build(path: Path, out: int, inp: int, modules: int = 125) -> int:
    """Writes a one-shard checkpoint of `modules` int4 linears [out, inp] plus norms; returns its size."""
    path.mkdir(parents=True, exist_ok=True)
    header, sizes, pos = {}, [], 0
    for i in range(modules):
        p = f"model.layers.{i}."
        for name, dtype, shape, itemsize in [
            (p + "mlp.down_proj.weight_packed", "I32", [out, inp // 8], 4),
            (p + "mlp.down_proj.weight_scale", "BF16", [out, inp // 128], 2),
            (p + "mlp.down_proj.weight_shape", "I64", [2], 8),
            (p + "input_layernorm.weight", "BF16", [inp], 2),
        ]:
            n = itemsize
            for d in shape:
                n *= d
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
            sizes.append(n)
            pos += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    chunk = bytes(1 << 24)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        left = pos
        while left:
            left -= f.write(chunk[: min(left, len(chunk))])
    shape = {"hidden_size": inp, "intermediate_size": out, "num_attention_heads": inp // 128,
             "num_key_value_heads": inp // 128, "num_hidden_layers": modules, "vocab_size": 32000}  # what inspect's
    # architecture check reads; the tensors stay these 500 (inspect reads headers, it does not build the model)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                  **shape, "quantization_config": QCONFIG}))
    return (path / "model.safetensors").stat().st_size


PEER = """
import json, sys, glob
from safetensors import safe_open
from compressed_tensors.quantization import QuantizationConfig
d = sys.argv[1]
n = 0
for f in sorted(glob.glob(d + '/*.safetensors')):
    with safe_open(f, 'np') as h:
        n += len(list(h.keys()))
QuantizationConfig.model_validate(json.load(open(d + '/config.json'))['quantization_config'])
print(n)
"""


def wall(cmd: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True)
        times.append(time.perf_counter() - t)
        if p.returncode != 0:
            raise SystemExit(f"{cmd} failed ({p.returncode}): {p.stderr.decode()[-500:]}")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--gb", type=float, default=4.0, help="approximate size of the big checkpoint")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/qk-bench"))
    args = ap.parse_args()
    inp = 16384
    out = max(128, int(args.gb * 1e9 / 125 / (inp // 2)) // 128 * 128)
    sizes = {"big": build(args.dir / "big", out, inp), "tiny": build(args.dir / "tiny", 128, 256)}
    os.sync()  # let writeback of the fresh GBs finish before timing anything
    quantkit = str(Path(sys.executable).parent / "quantkit")
    cmds = {(name, tool): ([quantkit, "inspect", str(args.dir / name), "--json"] if tool == "quantkit"
                           else [sys.executable, "-c", PEER, str(args.dir / name)])
            for name in ("big", "tiny") for tool in ("quantkit", "peer")}
    times: dict = {key: [] for key in cmds}
    for key, cmd in cmds.items():
        wall(cmd, 1)  # warm-up: page cache and .pyc files, alike for both tools
    for _ in range(args.runs):  # interleaved, so that machine noise hits every row alike
        for key, cmd in cmds.items():
            times[key] += wall(cmd, 1)
    rows = {name: {tool: statistics.median(times[(name, tool)]) for tool in ("quantkit", "peer")}
            for name in ("big", "tiny")}
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"median of {args.runs} runs, process start included")
    print("| checkpoint | tensors | size on disk | quantkit inspect | peer (safetensors + compressed-tensors) |")
    print("|---|---|---|---|---|")
    for name in ("big", "tiny"):
        r = rows[name]
        print(f"| {name} | 500 | {sizes[name] / 1e9:.3f} GB | {r['quantkit']:.3f} s | {r['peer']:.3f} s |")
    ratio = rows["big"]["quantkit"] / rows["tiny"]["quantkit"]
    print(f"\nbig/tiny wall-time ratio (quantkit): {ratio:.2f} (goal <= 1.3); "
          f"peer/quantkit on big: {rows['big']['peer'] / rows['big']['quantkit']:.1f}x")
    from quantkit.inspect import inspect_checkpoint  # in-process: the inspection without start-up and imports

    for name in ("big", "tiny"):
        inspect_checkpoint(args.dir / name)
        ts = []
        for _ in range(args.runs):
            t = time.perf_counter()
            inspect_checkpoint(args.dir / name)
            ts.append(time.perf_counter() - t)
        print(f"in-process inspect_checkpoint({name}): {statistics.median(ts) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
