"""Builds a tiny random Llama (bf16) with a byte-level BPE tokenizer and a chat template, deterministic,
with numpy and the tokenizers library only: the model of the serving tests and benchmarks (the trained
default model is scripts/train_default_model.py's).

Usage: python scripts/make_tiny_model.py [OUT_DIR] [--layers N]   (default: models/tiny-random, 4 layers)
The same seed gives the same bytes on every machine.
"""

import json
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


SYLLABLES = ("the", "of", "and", "to", "in", "is", "it", "for", "on", "as", "with", "be", "at", "by", "this",
             "an", "or", "from", "data", "value", "list", "file", "type", "return", "def", "class", "self", "int",
             "str", "none", "true", "false", "error", "test", "model", "token", "ing", "er", "ed", "ly", "tion",
             "re", "un", "pre", "con", "com", "pro", "ex", "de", "al", "ar", "en", "or", "an", "ch", "st")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def train_tokenizer(texts: list[str], out: Path, vocab_size: int, chat_template: str = CHAT_TEMPLATE):
    """Trains a byte-level BPE of `vocab_size` tokens (ids 0-2: <unk> <s> </s>) on `texts` and writes
    tokenizer.json and tokenizer_config.json (with the chat template) into `out`. Returns the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": CONFIG["max_position_embeddings"],
        "chat_template": chat_template}, indent=2) + "\n")
    return tok


def pseudo_text(seed: int = 0) -> list[str]:
    """Seeded pseudo-words and punctuation, in 10,000-character pieces."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(SYLLABLES, size=rng.integers(1, 4))) for _ in range(60000)]
    punct = rng.choice([" ", " ", " ", " ", ", ", ". ", "\n", "(", ") ", ": "], size=len(words))
    text = "".join(w + p for w, p in zip(words, punct))
    return [text[i:i + 10000] for i in range(0, len(text), 10000)]


def build(out: Path, seed: int = 0, **overrides) -> Path:
    c = CONFIG | overrides
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
    train_tokenizer(pseudo_text(seed), out, c["vocab_size"])
    return out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="models/tiny-random")
    ap.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    args = ap.parse_args()
    print(build(Path(args.out), num_hidden_layers=args.layers))
