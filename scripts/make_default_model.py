"""Builds the embedded default model: a tiny random Llama (bf16), deterministic, with numpy only.

Usage: python scripts/make_default_model.py [OUT_DIR]   (default: models/tiny-llama)
The same seed gives the same bytes on every machine.
"""

import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from quantkit.formats.safetensors_io import write_safetensors

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 768,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 4096, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2, "attention_bias": False, "mlp_bias": False,
}


def build(out: Path, seed: int = 0) -> Path:
    c = CONFIG
    rng = np.random.default_rng(seed)
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def w(*shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    tensors = {"model.embed_tokens.weight": w(c["vocab_size"], h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
            p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h), p + "mlp.down_proj.weight": w(h, i),
            p + "input_layernorm.weight": np.ones(h, ml_dtypes.bfloat16),
            p + "post_attention_layernorm.weight": np.ones(h, ml_dtypes.bfloat16),
        }
    tensors |= {"model.norm.weight": np.ones(h, ml_dtypes.bfloat16), "lm_head.weight": w(c["vocab_size"], h)}
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", tensors, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else "models/tiny-llama")))
