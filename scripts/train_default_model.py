"""Trains the embedded default model: a ~5M-parameter Llama on the Python standard library's own sources,
with the runtime's model code (`runtime/models/llama.py`) under `jax.grad`, on CPU, deterministically.

Usage: .venv/bin/python scripts/train_default_model.py [OUT_DIR] [--steps N] [--minutes M]
Default OUT_DIR: assets/tiny-llama (committed; README's set-up converts and serves it).

Data: every `*.py` under the stdlib directory except tests, idlelib and lib2to3, in sorted path order;
every 20th file is held out (`heldout_files()`) for `quantkit eval` (docs/quality.md). Tokenizer: a
byte-level BPE of 4096 tokens trained on the training files. Same Python version, same seed, same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import make_tiny_model  # noqa: E402
import numpy as np  # noqa: E402

from quantkit.formats.safetensors_io import write_safetensors  # noqa: E402
from quantkit.runtime.models import from_hf  # noqa: E402
from quantkit.runtime.models.llama import forward  # noqa: E402

CONFIG = make_tiny_model.CONFIG | {"rope_theta": 10000.0}  # the tiny model's shape: 5.25M parameters
SEQ, BATCH, LR, WARMUP = 256, 16, 3e-3, 50
CHAT_TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}# assistant:\n{% endif %}")


def _files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}
    return [f for f in sorted(root.rglob("*.py")) if not skip & set(f.relative_to(root).parts)]


def heldout_files() -> list[Path]:
    return _files()[::20]


def training_files() -> list[Path]:
    held = set(heldout_files())
    return [f for f in _files() if f not in held]


def _read(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def init_params(key) -> dict:
    c = CONFIG
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv, v = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, c["vocab_size"]
    keys = iter(jax.random.split(key, 64))

    def w(n_in, n_out, scale=1.0):
        return jax.random.normal(next(keys), (n_in, n_out), jnp.float32) * scale / math.sqrt(n_in)

    depth = 1 / math.sqrt(2 * c["num_hidden_layers"])  # residual branches start small
    layers = [{"q": w(h, q), "k": w(h, kv), "v": w(h, kv), "o": w(q, h, depth), "gate": w(h, i), "up": w(h, i),
               "down": w(i, h, depth), "attn_norm": jnp.ones(h), "mlp_norm": jnp.ones(h)}
              for _ in range(c["num_hidden_layers"])]
    return {"embed": jax.random.normal(next(keys), (v, h)) * 0.02, "layers": layers, "final_norm": jnp.ones(h),
            "lm_head": w(h, v)}


def make_step(cfg):
    pages = SEQ // 16

    def loss_fn(params, batch):  # batch [b, SEQ + 1]
        b = batch.shape[0]
        cache = [(jnp.zeros((1 + b * pages, 16, cfg.num_kv_heads, cfg.head_dim)),) * 2
                 for _ in range(cfg.num_layers)]
        tables = 1 + jnp.arange(b * pages).reshape(b, pages)
        positions = jnp.broadcast_to(jnp.arange(SEQ), (b, SEQ))
        logits, _ = forward(params, cfg, batch[:, :-1], positions, cache, (tables, None))
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1).mean()

    @jax.jit
    def step(params, opt, batch, lr):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        t = opt["t"] + 1
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
        grads = jax.tree_util.tree_map(lambda g: g * jnp.minimum(1.0, 1.0 / (norm + 1e-6)), grads)  # clip at 1
        m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, opt["m"], grads)
        v = jax.tree_util.tree_map(lambda v, g: 0.95 * v + 0.05 * g * g, opt["v"], grads)

        def update(p, m, v):  # AdamW, weight decay on matrices only
            u = (m / (1 - 0.9 ** t)) / (jnp.sqrt(v / (1 - 0.95 ** t)) + 1e-8)
            return p - lr * (u + (0.1 * p if p.ndim == 2 else 0.0))

        params = jax.tree_util.tree_map(update, params, m, v)
        return params, {"m": m, "v": v, "t": t}, loss

    return step, jax.jit(loss_fn)


def save(params: dict, out: Path) -> None:
    def bf16(x):
        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)

    t = {"model.embed_tokens.weight": bf16(params["embed"]), "model.norm.weight": bf16(params["final_norm"]),
         "lm_head.weight": bf16(params["lm_head"].T)}
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    for i, layer in enumerate(params["layers"]):
        p = f"model.layers.{i}."
        t |= {p + n + ".weight": bf16(layer[k].T) for k, n in names.items()}  # [out, in] as Hugging Face stores
        t |= {p + "input_layernorm.weight": bf16(layer["attn_norm"]),
              p + "post_attention_layernorm.weight": bf16(layer["mlp_norm"])}
    write_safetensors(out / "model.safetensors", t, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="assets/tiny-llama")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--minutes", type=float, default=None, help="stop early after this much training time")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = _read(training_files())
    tok = make_tiny_model.train_tokenizer(texts, out, CONFIG["vocab_size"], CHAT_TEMPLATE)
    ids = np.concatenate([np.array(e.ids + [2], np.int32) for e in tok.encode_batch(texts)])  # </s> between files
    held = np.concatenate([np.array(e.ids, np.int32) for e in tok.encode_batch(_read(heldout_files()))])
    print(f"{len(ids)} training tokens, {len(held)} held out", flush=True)
    cfg = from_hf(CONFIG)
    params = init_params(jax.random.PRNGKey(0))
    print(f"{sum(x.size for x in jax.tree_util.tree_leaves(params)) / 1e6:.2f}M parameters", flush=True)
    opt = {"m": jax.tree_util.tree_map(jnp.zeros_like, params), "v": jax.tree_util.tree_map(jnp.zeros_like, params),
           "t": jnp.zeros((), jnp.int32)}
    step, loss_fn = make_step(cfg)
    rng = np.random.default_rng(0)
    starts = len(ids) - SEQ - 1
    eval_batch = jnp.asarray(np.stack([held[i:i + SEQ + 1] for i in range(0, 16 * SEQ, SEQ)]))
    t0 = time.perf_counter()
    for s in range(args.steps):
        lr = LR * min(1.0, (s + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * s / args.steps))
        batch = jnp.asarray(np.stack([ids[i:i + SEQ + 1] for i in rng.integers(0, starts, BATCH)]))
        params, opt, loss = step(params, opt, batch, lr)
        if s % 50 == 0 or s == args.steps - 1:
            print(f"step {s} loss {float(loss):.3f} held-out {float(loss_fn(params, eval_batch)):.3f} "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
        if args.minutes and time.perf_counter() - t0 > 60 * args.minutes:
            print(f"stopped after {s + 1} steps ({args.minutes} min)", flush=True)
            break
    save(params, out)
    print(out)


if __name__ == "__main__":
    main()
