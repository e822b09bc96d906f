"""Builds the TPU lane's tiny checkpoints, one per model family, with what the CPU path computes for each:
the expected side of tests/test_tpu.py's on-chip forward (run here, on the CPU, where transformers and torch
are; the TPU machine has neither and no network).

For each family: a tiny random transformers model (tests/helpers.py `family`, seed 0; a MoE's tokens routed to
every expert: TOP_K below), converted to
compressed-tensors W4A16 where quantkit converts it (gpt-oss: OpenAI's MXFP4 layout), and the default model
(assets/tiny-llama) at W4A16 g32. Then a fixed 16-token prompt and 24 greedy tokens through the CPU path's
Runner (quantized weights kept packed, layers scanned: the TPU program's structure), saved as
`expected.npz` (ids, float32 logits of every position, the prompt's length) beside the checkpoint.

Usage: .venv/bin/python scripts/tpu_models.py [OUT [FAMILY ...]]   (default .tpu-models, git-ignored; carry it to
the chip; FAMILY: only those, tiny-llama among them)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402

# family -> W4A16 group size (None: served as built: bf16, or gpt-oss's own MXFP4)
FAMILIES = {"llama": 128, "qwen3": 32, "qwen3_moe": 32, "gemma3": 32, "gemma4": 32, "gemma4_moe": 32,
            "qwen3_5": 32, "qwen3_5_moe": 32, "gpt_oss": None}
PROMPT, STEPS = 16, 24
CHIP = "v5e"  # the lent chip: the interpreted kernels take its tiles
# A tiny random model's router gives every expert nearly the same score (weights N(0, 0.02)): which of two
# experts a token takes then hangs on ~1e-3, the difference between summation orders and the gated pair's
# rounding, and the chip's forward parts from the CPU's at every later position (gemma4_moe did by 0.13).
# Scaling the router does not help (the logits' error scales with them): the lane's MoE checkpoints route
# every token to every expert (top-k = the experts), so that the forward is continuous in its inputs; the
# kernels' tests on the chip cover empty and uneven expert groups.
TOP_K = ("num_experts_per_tok", "top_k_experts", "experts_per_token")
EXPERTS = ("num_experts", "num_local_experts")


def expected(path: Path, vocab: int) -> None:
    """The TPU program's greedy run of a fixed prompt through `path` on this CPU, its kernels in Pallas
    interpret mode (tiled for a v5e), saved as path/expected.npz."""
    from quantkit.runtime.loader import load
    from quantkit.runtime.ops import interpreted_tpu_kernels
    from quantkit.runtime.step import Runner

    with interpreted_tpu_kernels(CHIP):
        runner = Runner(load(path), max_model_len=128, page_size=8, weights="packed", scan=True)
        ids = [int(x) for x in np.random.default_rng(0).integers(3, min(vocab, 256), PROMPT)]
        logits = runner.forward([(0, ids, 0)])[0]
        rows = [logits]
        for i in range(STEPS):
            ids.append(int(rows[-1][-1].argmax()))
            rows.append(runner.forward([(0, [ids[-1]], PROMPT + i)])[0])
    np.savez(path / "expected.npz", ids=np.array(ids, np.int32), logits=np.concatenate(rows), prompt=PROMPT,
             chip=CHIP)


def main(out: Path, only: list[str]) -> None:
    import torch

    from helpers import family, pack_native

    quantkit = [sys.executable, "-m", "quantkit.cli"]
    out.mkdir(parents=True, exist_ok=True)
    for name, group in FAMILIES.items():
        if only and name not in only:
            continue
        torch.manual_seed(0)
        model = family(name)
        for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
            experts = next((getattr(cfg, e) for e in EXPERTS if getattr(cfg, e, None)), None)
            for key in TOP_K:
                if experts and getattr(cfg, key, None):
                    setattr(cfg, key, experts)
        src, dst = out / f"{name}-src", out / name
        shutil.rmtree(dst, ignore_errors=True)
        if name == "gpt_oss":
            pack_native(model, dst)
        else:
            model.save_pretrained(src)
            done = subprocess.run([*quantkit, "convert", str(src), str(dst), "--scheme", "W4A16", "--group-size",
                                   str(group), "--force"], capture_output=True, text=True)
            if done.returncode:
                print(f"{name}: kept bf16 ({done.stderr.strip()[-200:]})")
                shutil.copytree(src, dst)
            shutil.rmtree(src)
        expected(dst, model.config.get_text_config().vocab_size)
        print(f"{name}: {dst}")
    if only and "tiny-llama" not in only:
        return
    dst = out / "tiny-llama"
    subprocess.run([*quantkit, "convert", str(ROOT / "assets/tiny-llama"), str(dst), "--scheme", "W4A16",
                    "--group-size", "32", "--force"], check=True, capture_output=True)
    import json

    expected(dst, json.loads((dst / "config.json").read_text())["vocab_size"])
    print(f"tiny-llama: {dst}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / ".tpu-models", sys.argv[2:])
