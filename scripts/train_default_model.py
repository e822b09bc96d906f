"""Trains the embedded default model: a ~5M-parameter Llama on the Python standard library's own sources,
with the runtime's layer pieces (`runtime/models/common.py`; dense attention) under `jax.grad`, on CPU,
deterministically.

Usage: .venv/bin/python scripts/train_default_model.py [OUT_DIR] [--steps N] [--minutes M]
       .venv/bin/python scripts/train_default_model.py --eagle3 [--steps N] [--minutes M]
Default OUT_DIR: assets/tiny-llama (committed; README's set-up converts and serves it).
`--eagle3`: trains an EAGLE-3 draft head (runtime/models/eagle3.py) for the model already in OUT_DIR, on the
same training files, and writes it to OUT_DIR-eagle3 (committed: assets/tiny-llama-eagle3, served with
`--speculative-config '{"method": "eagle3", "model": "assets/tiny-llama-eagle3", "num_speculative_tokens": 3}'`).

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


def dense_logits(params: dict, cfg, tokens):
    """The Llama's logits [b, n, vocab] for tokens [b, n]: runtime/models/llama.py's layer (its norms, RoPE,
    projections and SwiGLU from models/common.py) with dense causal attention in place of the paged
    kernel, whose loop over pages jax.grad cannot differentiate."""
    from quantkit.runtime.models.common import apply_rope, linear, logits, rms_norm, rope_frequencies

    b, n = tokens.shape
    nh, kvh, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    inv, pos = rope_frequencies(cfg), jnp.tile(jnp.arange(n), b)
    causal = jnp.arange(n)[:, None] >= jnp.arange(n)[None]
    x = params["embed"][tokens]
    for p in params["layers"]:
        y = rms_norm(x, p["attn_norm"], eps)
        q = apply_rope(linear(y, p["q"]).reshape(b * n, nh, d), pos, inv).reshape(b, n, kvh, nh // kvh, d)
        k = apply_rope(linear(y, p["k"]).reshape(b * n, kvh, d), pos, inv).reshape(b, n, kvh, d)
        v = linear(y, p["v"]).reshape(b, n, kvh, d)
        w = jnp.where(causal, jnp.einsum("bthgd,bshd->bhgts", q, k) * cfg.scale, -jnp.inf)
        x = x + linear(jnp.einsum("bhgts,bshd->bthgd", jax.nn.softmax(w, -1), v).reshape(b, n, nh * d), p["o"])
        y = rms_norm(x, p["mlp_norm"], eps)
        x = x + linear(jax.nn.silu(linear(y, p["gate"])) * linear(y, p["up"]), p["down"])
    return logits(params, rms_norm(x, params["final_norm"], eps).reshape(b * n, -1), cfg).reshape(b, n, -1)


def make_step(cfg):
    def loss_fn(params, batch):  # batch [b, SEQ + 1]
        logits = dense_logits(params, cfg, batch[:, :-1])
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


# ---- the EAGLE-3 draft head ----------------------------------------------------------------------------

DRAFT_PASSES = 3  # training-time test: the head also learns from its own outputs, DRAFT_PASSES - 1 deep
AUX_LAYERS = (1, 2, 3)  # the hidden states entering these target layers feed the head's fc
DRAFT_VOCAB = 1024  # the head's vocabulary: the training data's most frequent tokens (EAGLE-3's d2t map)


def target_features(params, cfg, tokens):
    """The target's (the runtime's Llama forward, one ragged step of b sequences) logits [b, n, vocab] and
    fused hidden states entering AUX_LAYERS [b, n, 3 * hidden] for tokens [b, n]."""
    from quantkit.runtime.models.common import logits

    b, n = tokens.shape
    pages = -(-n // 16)
    tables = 1 + jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    pos = jnp.tile(jnp.arange(n, dtype=jnp.int32), b)
    seq = jnp.repeat(jnp.arange(b), n)
    meta = {"positions": pos, "tables": {"full": tables}, "slots": {"full": tables[seq, pos // 16] * 16 + pos % 16},
            "cu_q_lens": jnp.arange(b + 1, dtype=jnp.int32) * n, "kv_lens": jnp.full(b, n, jnp.int32),
            "num_seqs": jnp.array([b], jnp.int32), "unroll": True, "aux_layers": AUX_LAYERS}
    width = 2 * cfg.num_kv_heads * cfg.head_dim
    kv = {"full": jnp.zeros((cfg.num_layers, 1 + b * pages, 16, width), jnp.float32)}
    h, _, aux = forward(params, cfg, tokens.reshape(-1), kv, meta)
    return logits(params, h, cfg).reshape(b, n, -1), aux.reshape(b, n, -1)


def init_draft(key, target: dict, keep: np.ndarray) -> dict:
    h, i, hd = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["head_dim"]
    q, kv = CONFIG["num_attention_heads"] * hd, CONFIG["num_key_value_heads"] * hd
    keys = iter(jax.random.split(key, 16))

    def w(n_in, n_out, scale=1.0):
        return jax.random.normal(next(keys), (n_in, n_out), jnp.float32) * scale / math.sqrt(n_in)

    return {"fc": w(3 * h, h), "q": w(2 * h, q), "k": w(2 * h, kv), "v": w(2 * h, kv), "o": w(q, h, 0.5),
            "gate": w(h, i), "up": w(h, i), "down": w(i, h, 0.5), "attn_norm": jnp.ones(h), "hidden_norm": jnp.ones(h),
            "mlp_norm": jnp.ones(h), "norm": jnp.ones(h),
            "lm_head": jnp.asarray(target["lm_head"], jnp.float32)[:, keep]}


def draft_passes(dp, dcfg, embed, tokens, aux):
    """The head's logits [passes, b, n, vocab] under the training-time test: pass 0 at position t takes the
    target's fused hidden at t and token t + 1; pass j the head's own pass j - 1 output at t - 1 and token t + 1,
    attending to pass 0's keys up to t - j and pass m's key at t - j + m (m = 1..j): the keys a draft j
    positions past the last verified token sees when drafting (runtime/step.py draft_rows)."""
    from quantkit.runtime.models import eagle3
    from quantkit.runtime.models.common import apply_rope, linear, rope_frequencies

    b, n, _ = aux.shape
    nh, kvh, d = dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim
    inv = rope_frequencies(dcfg)
    pos = jnp.tile(jnp.arange(n), b)
    emb = embed[jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)]  # token t + 1 at t
    hidden = linear(aux, dp["fc"])
    keys, values, out = [], [], []
    t = jnp.arange(n)
    for j in range(DRAFT_PASSES):
        def attend(x):
            q = apply_rope(linear(x, dp["q"]).reshape(b * n, nh, d), pos, inv).reshape(b, n, kvh, nh // kvh, d)
            keys.append(apply_rope(linear(x, dp["k"]).reshape(b * n, kvh, d), pos, inv).reshape(b, n, kvh, d))
            values.append(linear(x, dp["v"]).reshape(b, n, kvh, d))
            s = jnp.arange(n)
            mask = jnp.concatenate([s[None] <= t[:, None] - j] + [s[None] == t[:, None] - j + m for m in range(1, j + 1)],
                                   axis=1)  # [n, (j + 1) n]
            k, v = jnp.concatenate(keys, axis=1), jnp.concatenate(values, axis=1)
            w = jnp.einsum("bthgd,bshd->bhgts", q, k) * dcfg.scale
            w = jax.nn.softmax(jnp.where(mask, w, -jnp.inf), axis=-1)
            o = jnp.einsum("bhgts,bshd->bthgd", w, v).reshape(b, n, nh * d)
            return linear(o, dp["o"])

        g = eagle3.layer(dp, dcfg, emb, hidden, attend)
        out.append(eagle3.scores(dp, dcfg, g))
        hidden = jnp.concatenate([jnp.zeros_like(g[:, :1]), g[:, :-1]], axis=1)
    return jnp.stack(out)


def make_draft_step(params, cfg, dcfg, keep: np.ndarray):
    embed = params["embed"]

    def loss_fn(dp, tokens):  # tokens [b, n]: pass j's position t predicts the target's distribution at t + 1
        target, aux = jax.lax.stop_gradient(target_features(params, cfg, tokens))
        p = jax.nn.softmax(target[:, 1:, keep], axis=-1)  # over the head's vocabulary
        logits = draft_passes(dp, dcfg, embed, tokens, aux)[:, :, :-1]
        n = tokens.shape[1] - 1
        losses, agree = [], []
        for j in range(DRAFT_PASSES):
            valid = (jnp.arange(n) >= j)[None, :]
            ce = -jnp.sum(p * jax.nn.log_softmax(logits[j], axis=-1), axis=-1)
            losses.append(jnp.sum(jnp.where(valid, ce, 0.0)) / (valid.sum() * tokens.shape[0]))
            same = jnp.asarray(keep)[jnp.argmax(logits[j], -1)] == jnp.argmax(target[:, 1:], -1)
            agree.append(jnp.sum(jnp.where(valid, same, False)) / (valid.sum() * tokens.shape[0]))
        return sum(0.8 ** j * l for j, l in enumerate(losses)), jnp.stack(agree)

    @jax.jit
    def step(dp, opt, tokens, lr):
        (loss, agree), grads = jax.value_and_grad(loss_fn, has_aux=True)(dp, tokens)
        dp, opt = adam(dp, opt, grads, lr)
        return dp, opt, loss, agree

    return step, jax.jit(loss_fn)


def adam(params, opt, grads, lr):
    """One AdamW step (gradients clipped at norm 1, weight decay on matrices only)."""
    t = opt["t"] + 1
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
    grads = jax.tree_util.tree_map(lambda g: g * jnp.minimum(1.0, 1.0 / (norm + 1e-6)), grads)
    m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, opt["m"], grads)
    v = jax.tree_util.tree_map(lambda v, g: 0.95 * v + 0.05 * g * g, opt["v"], grads)

    def update(p, m, v):
        u = (m / (1 - 0.9 ** t)) / (jnp.sqrt(v / (1 - 0.95 ** t)) + 1e-8)
        return p - lr * (u + (0.1 * p if p.ndim == 2 else 0.0))

    return jax.tree_util.tree_map(update, params, m, v), {"m": m, "v": v, "t": t}


def train_draft(model_dir: Path, steps: int, minutes: float | None) -> None:
    from tokenizers import Tokenizer

    from quantkit.runtime.loader import load

    model = load(model_dir, dtype=jnp.float32)
    params, cfg = model.params, model.cfg
    out = Path(str(model_dir).rstrip("/") + "-eagle3")
    out.mkdir(parents=True, exist_ok=True)
    hf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
          "draft_vocab_size": DRAFT_VOCAB, "eagle_aux_hidden_state_layer_ids": list(AUX_LAYERS),
          **{k: CONFIG[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                    "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                                    "rope_theta", "hidden_act", "tie_word_embeddings", "torch_dtype")}}
    dcfg = from_hf({**hf, "architectures": ["LlamaForCausalLM"]})
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = np.concatenate([np.array(e.ids + [2], np.int32) for e in tok.encode_batch(_read(training_files()))])
    held = np.concatenate([np.array(e.ids, np.int32) for e in tok.encode_batch(_read(heldout_files()))])
    keep = np.sort(np.argsort(-np.bincount(ids, minlength=CONFIG["vocab_size"]), kind="stable")[:DRAFT_VOCAB])
    print(f"draft vocabulary: the {DRAFT_VOCAB} most frequent tokens, {np.isin(ids, keep).mean():.1%} of the "
          "training tokens", flush=True)
    dp = init_draft(jax.random.PRNGKey(1), params, keep)
    print(f"draft head: {sum(x.size for x in jax.tree_util.tree_leaves(dp)) / 1e6:.2f}M parameters", flush=True)
    opt = {"m": jax.tree_util.tree_map(jnp.zeros_like, dp), "v": jax.tree_util.tree_map(jnp.zeros_like, dp),
           "t": jnp.zeros((), jnp.int32)}
    step, loss_fn = make_draft_step(params, cfg, dcfg, keep)
    rng = np.random.default_rng(1)
    n, b = 128, 16
    eval_batch = jnp.asarray(np.stack([held[i:i + n] for i in range(0, 16 * n, n)]))
    t0 = time.perf_counter()
    for s in range(steps):
        lr = LR * min(1.0, (s + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * s / steps))
        batch = jnp.asarray(np.stack([ids[i:i + n] for i in rng.integers(0, len(ids) - n, b)]))
        dp, opt, loss, agree = step(dp, opt, batch, lr)
        if s % 50 == 0 or s == steps - 1:
            _, held_agree = loss_fn(dp, eval_batch)
            print(f"step {s} loss {float(loss):.3f} held-out top-1 agreement by pass "
                  f"{np.round(np.asarray(held_agree), 3).tolist()} {time.perf_counter() - t0:.0f}s", flush=True)
        if minutes and time.perf_counter() - t0 > 60 * minutes:
            print(f"stopped after {s + 1} steps ({minutes} min)", flush=True)
            break

    def bf16(x):
        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)

    from quantkit.runtime.models.eagle3 import NAMES

    t = {"fc.weight": bf16(dp["fc"].T), "norm.weight": bf16(dp["norm"]), "lm_head.weight": bf16(dp["lm_head"].T),
         "d2t": (keep - np.arange(DRAFT_VOCAB)).astype(np.int64), "t2d": np.isin(np.arange(CONFIG["vocab_size"]), keep)}
    t |= {"midlayer." + name: bf16(dp[k].T if dp[k].ndim == 2 else dp[k]) for k, name in NAMES.items()}
    write_safetensors(out / "model.safetensors", t, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    print(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="assets/tiny-llama")
    ap.add_argument("--steps", type=int, default=None, help="default 1200, with --eagle3 2400")
    ap.add_argument("--minutes", type=float, default=None, help="stop early after this much training time")
    ap.add_argument("--eagle3", action="store_true", help="train the EAGLE-3 draft head of the model in OUT")
    args = ap.parse_args()
    if args.eagle3:
        train_draft(Path(args.out), args.steps or 2400, args.minutes)
        return
    args.steps = args.steps or 1200
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
