"""What a draft head costs on a v6e, by `quantkit plan` (deviceless compile; roofline estimates, not
measurements): Llama-3-8B (benchmarks/plan_table.py's config) W4A16 g128, 16 sequences of 2,048 tokens,
with n-gram drafts and with the published EAGLE-3 head for it (EAGLE3-LLaMA3.1-Instruct-8B's config.json:
one layer of hidden 4096, 32 / 8 heads, MLP 14336, a 32,000-token draft vocabulary), each with k drafts.

The head's checkpoint is written here with the published config and tensor shapes and zero data (a sparse
file: plan reads only its config and safetensors headers). Reported: weights, the head's part, KV cache,
the decode and verifying steps' bytes (XLA's cost analysis) and their ratio.

Usage: .venv/bin/python benchmarks/draft_head_plan.py [--k 3]   (about 4 minutes on a 2-core CPU)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_table import LLAMA3_8B  # noqa: E402
from quantkit.plan import plan  # noqa: E402
from quantkit.runtime.speculative import SpeculativeConfig  # noqa: E402

HEAD = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 1,
        "vocab_size": 128256, "draft_vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 2048, "tie_word_embeddings": False}


def write_head(path: Path) -> None:
    """The published head's config and tensors (stored [out, in], bf16; d2t int64) with zero data."""
    h, m, kv, vd = 4096, 14336, 1024, 32000
    shapes = {"fc.weight": (h, 3 * h), "midlayer.self_attn.q_proj.weight": (h, 2 * h),
              "midlayer.self_attn.k_proj.weight": (kv, 2 * h), "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, h), "midlayer.mlp.gate_proj.weight": (m, h),
              "midlayer.mlp.up_proj.weight": (m, h), "midlayer.mlp.down_proj.weight": (h, m),
              "lm_head.weight": (vd, h), "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
              "midlayer.post_attention_layernorm.weight": (h,), "norm.weight": (h,), "d2t": (vd,)}
    header, at = {}, 0
    for name, shape in shapes.items():
        size = (8 if name == "d2t" else 2) * math.prod(shape)
        header[name] = {"dtype": "I64" if name == "d2t" else "BF16", "shape": list(shape),
                        "data_offsets": [at, at + size]}
        at += size
    raw = json.dumps(header).encode()
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(HEAD))
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + at)  # zeros, not written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=3, help="drafts a row")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(LLAMA3_8B))
        write_head(Path(tmp) / "head")
        print("| drafts | weights GB (head) | KV cache GB | decode step GB | verifying step GB | ratio | fits |")
        print("|---|---|---|---|---|---|---|")
        for spec in (SpeculativeConfig("ngram", args.k, 2, 5),
                     SpeculativeConfig("eagle3", args.k, model=str(Path(tmp) / "head"))):
            r = plan(Path(tmp) / "config.json", "v6e", 2048, 16, scheme="W4A16", group_size=128, search=False,
                     prefill_cost=False, speculative=spec)
            h, v = r["hbm_bytes"], r["verify_step_cost"]
            head = h["of_weights_draft_head"] / 1e9
            print(f"| {spec.method}, k = {spec.k} | {h['weights'] / 1e9:.2f} ({head:.2f}) | "
                  f"{h['kv_cache'] / 1e9:.2f} | {r['decode_step_cost']['bytes_accessed'] / 1e9:.2f} | "
                  f"{v['bytes_accessed'] / 1e9:.2f} | {v['ratio_to_decode_step']:.2f}x | {r['fits']} |", flush=True)


if __name__ == "__main__":
    main()
