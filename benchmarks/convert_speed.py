"""Throughput and peak memory of `quantkit convert` vs llm-compressor's `model_free_ptq` and a plain copy.

Builds synthetic bf16 Llama-shaped checkpoints (random normal * 0.02 weights, hidden 2048, MLP 8192,
vocab 32000, sharded at 1 GB like Hugging Face) of two sizes, then, for each size, in one run:
- `cp -r` of the directory (the physical floor: read + write the same bytes);
- `quantkit convert SRC DST --scheme S` (min-max; S = --scheme, default W4A16, group 128) with 1 and 2 workers;
- llm-compressor `model_free_ptq(src, dst, scheme=S, ignore=["lm_head"], max_workers=1, device="cpu")`,
  from its own virtual environment (it pins its own compressed-tensors; see docs/benchmarks.md, "Installing the peers").
Every run is a fresh process, timed from start to exit; peak RSS is the child's ru_maxrss. The input is
read once before each run so that every tool starts from the page cache.

Usage: .venv/bin/python benchmarks/convert_speed.py --llmc /path/to/llmc-venv/bin/python [--sizes 0.8 1.6]
       [--scheme NVFP4A16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quantkit.formats.safetensors_io import write_safetensors  # noqa: E402

H, I, V, HEADS, KV = 2048, 8192, 32000, 16, 4
LAYER_BYTES = 2 * (2 * H * H + 2 * H * (H * KV // HEADS) + 3 * H * I)


def build(path: Path, gb: float, seed: int = 0) -> int:
    """A bf16 Llama-shaped checkpoint of about `gb` GB, sharded at 1 GB, with config and index."""
    layers = max(1, round((gb * 1e9 - 2 * 2 * V * H) / LAYER_BYTES))
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    tensors: list[tuple[str, tuple]] = [("model.embed_tokens.weight", (V, H))]
    kv = H * KV // HEADS
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors += [(p + "self_attn.q_proj.weight", (H, H)), (p + "self_attn.k_proj.weight", (kv, H)),
                    (p + "self_attn.v_proj.weight", (kv, H)), (p + "self_attn.o_proj.weight", (H, H)),
                    (p + "mlp.gate_proj.weight", (I, H)), (p + "mlp.up_proj.weight", (I, H)),
                    (p + "mlp.down_proj.weight", (H, I)), (p + "input_layernorm.weight", (H,)),
                    (p + "post_attention_layernorm.weight", (H,))]
    tensors += [("model.norm.weight", (H,)), ("lm_head.weight", (V, H))]
    shards, cur, size = [], {}, 0
    for name, shape in tensors:
        arr = np.ones(shape, ml_dtypes.bfloat16) if len(shape) == 1 else w(*shape)
        if cur and size + arr.nbytes > 1e9:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = arr
        size += arr.nbytes
    shards.append(cur)
    weight_map = {}
    for k, members in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(path / fname, members, {"format": "pt"})
        weight_map |= {n: fname for n in members}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
        "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": KV, "vocab_size": V,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False}))
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


TIMED = ("import resource, subprocess, sys, time\n"
         "t = time.perf_counter(); r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL,"
         " stderr=subprocess.PIPE)\n"
         "dt = time.perf_counter() - t\n"
         "if r.returncode: sys.exit(r.stderr.decode()[-2000:])\n"
         "print(dt, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n")

LLMC = ("import sys\nfrom llmcompressor import model_free_ptq\n"
        "model_free_ptq(sys.argv[1], sys.argv[2], scheme=sys.argv[3], ignore=['lm_head'], max_workers=1,"
        " device='cpu')\n")


def timed(cmd: list[str]) -> tuple[float, int]:
    out = subprocess.run([sys.executable, "-c", TIMED, *cmd], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{cmd[:3]} failed: {out.stderr[-2000:]}")
    dt, rss = out.stdout.split()
    return float(dt), int(rss)


def warm(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llmc", help="python of a venv with llmcompressor installed (peer); omitted if not given")
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.8, 1.6], help="checkpoint sizes in GB")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--scheme", default="W4A16", help="a scheme both tools write (W4A16, NVFP4A16, MXFP4A16, ...)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/qk-convert-bench"))
    args = ap.parse_args()
    quantkit = str(Path(sys.executable).parent / "quantkit")
    tools = {
        "cp -r (floor)": lambda s, d: ["cp", "-r", str(s), str(d)],
        "quantkit, 1 worker": lambda s, d: [quantkit, "convert", str(s), str(d), "--scheme", args.scheme,
                                            "--workers", "1"],
        "quantkit, 2 workers": lambda s, d: [quantkit, "convert", str(s), str(d), "--scheme", args.scheme,
                                             "--workers", "2"],
    }
    if args.llmc:
        tools["llm-compressor model_free_ptq"] = lambda s, d: [args.llmc, "-c", LLMC, str(s), str(d), args.scheme]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"scheme {args.scheme}; median of {args.runs} runs, process start included; input warm in the page cache")
    print("| input | tool | wall s | input GB/s | peak RSS | vs model_free_ptq | vs copy |")
    print("|---|---|---|---|---|---|---|")
    for gb in args.sizes:
        src = args.dir / f"src-{gb}"
        if not src.exists():
            build(src, gb)
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        res = {}
        for _ in range(args.runs):  # interleaved, so that noise hits every tool alike
            for name, cmd in tools.items():
                dst = args.dir / "dst"
                shutil.rmtree(dst, ignore_errors=True)
                warm(src)
                dt, rss = timed(cmd(src, dst))
                res.setdefault(name, []).append((dt, rss))
                shutil.rmtree(dst, ignore_errors=True)
        med = {n: (statistics.median(t for t, _ in v), max(r for _, r in v)) for n, v in res.items()}
        peer = med.get("llm-compressor model_free_ptq", (None,))[0]
        floor = med["cp -r (floor)"][0]
        for name, (dt, rss) in med.items():
            vs_peer = f"{peer / dt:.2f}x" if peer else "-"
            print(f"| {size / 1e9:.2f} GB | {name} | {dt:.2f} | {size / 1e9 / dt:.3f} | {rss / 1e9:.2f} GB | "
                  f"{vs_peer} | {dt / floor:.1f}x |")


if __name__ == "__main__":
    main()
