"""EAGLE-3 draft heads (vLLM's `"method": "eagle3"` with `"model": PATH`), for Llama-family targets.

A draft checkpoint as published (config.json with `LlamaForCausalLMEagle3`, one decoder layer): `fc`
[hidden, 3 x target hidden] fuses the target's hidden states entering three of its layers (vLLM's choice,
layers 2, L // 2 and L - 3, unless the config's `eagle_aux_hidden_state_layer_ids` names others); the layer
(`midlayer.*`) takes [input_layernorm(embedding of the next token) | hidden_norm(hidden)] (2 x hidden wide)
into its q/k/v projections, adds its attention output and then its SwiGLU MLP to the un-normed hidden
(the residual); `norm` and `lm_head` give logits over the draft vocabulary, whose id i is target id
i + d2t[i] (identity without `d2t`). The token embedding is the target's unless the draft has its own.

Drafting (runtime/step.py `draft_rows`): the layer runs over the step's tokens, position i taking the
target's fused hidden at i and the token at i + 1 (each row's last kept position: the token the target just
chose), writing its own KV pages (the target's full-attention page tables); its output at a row's last kept
position gives the first draft; each further draft feeds the previous draft token and the layer's own
output back in, one position further. vLLM's loader semantics; the math is own code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantkit.errors import InvalidInput, Unsupported
from quantkit.runtime.config import ModelConfig

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NAMES = {  # draft param -> checkpoint tensor (after dropping a "midlayer." / "layers.0." / "model." prefix)
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight", "attn_norm": "input_layernorm.weight", "hidden_norm": "hidden_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight"}
TOP = {"fc": "fc.weight", "norm": "norm.weight", "lm_head": "lm_head.weight", "embed": "embed_tokens.weight",
       "d2t": "d2t"}


@dataclass(frozen=True)
class Eagle3:
    """The static part of a loaded draft (hashable: a key of the jitted step): the layer's attention shapes
    as a one-layer Llama config, and the target layers whose inputs fc fuses."""

    cfg: ModelConfig
    aux: tuple[int, ...]

    # the head as step.draft_rows runs it; its weights params["draft"]: fc [3H, H], q/k/v [2H, .], o, gate,
    # up, down, norms, lm_head [H, Vd], d2t [Vd] (target ids), embed (if its own)
    def hidden(self, params: dict, h, aux):
        from quantkit.runtime.models.common import linear

        return linear(aux, params["draft"]["fc"])

    def embed(self, params: dict):
        return params["draft"].get("embed", params["embed"])

    def run(self, params: dict, emb, hidden, attend):
        return layer(params["draft"], self.cfg, emb, hidden, lambda x: attend(params["draft"], x))

    def tokens(self, params: dict, g):
        return tokens_of(params["draft"], self.cfg, g)


def aux_layers(draft_cfg: dict, target_layers: int) -> tuple[int, ...]:
    ids = draft_cfg.get("eagle_aux_hidden_state_layer_ids") or (draft_cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else (2, target_layers // 2, target_layers - 3)


def load(path: str | Path, target: ModelConfig, dtype) -> tuple[Eagle3, dict]:
    """Reads an EAGLE-3 draft checkpoint for `target`: (its static part, its weights); InvalidInput /
    Unsupported naming what does not fit."""
    import jax.numpy as jnp

    from quantkit.formats.safetensors_io import SafetensorsFile
    from quantkit.runtime.models import from_hf

    path = Path(path)
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InvalidInput(f"draft model {path}: cannot read config.json: {e}") from None
    arch = (hf.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise Unsupported(f"draft model {path}: architecture {arch!r} is not an EAGLE-3 head "
                          f"({', '.join(ARCHITECTURES)})")
    if target.family not in ("llama", "qwen3") or set(target.layer_kinds) != {"full"}:
        raise Unsupported(f"EAGLE-3 drafts serve Llama-family targets; this target is {target.family}")
    if hf.get("num_hidden_layers", 1) != 1:
        raise Unsupported(f"draft model {path}: {hf['num_hidden_layers']} layers; EAGLE-3 heads have one")
    if hf.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise InvalidInput(f"draft model {path}: vocabulary {hf['vocab_size']} is not the target's "
                           f"{target.vocab_size}")
    cfg = from_hf({**hf, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
    aux = aux_layers(hf, target.num_layers)
    if len(aux) != 3 or not all(0 <= i < target.num_layers for i in aux):
        raise InvalidInput(f"draft model {path}: auxiliary layers {aux} do not fit a {target.num_layers}-layer "
                           "target (three, each below the target's depth)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InvalidInput(f"draft model {path}: no .safetensors file")
    tensors, opened = {}, [SafetensorsFile(f) for f in files]
    for st in opened:
        for name in st.tensors:
            key = name
            for prefix in ("model.", "midlayer.", "layers.0."):
                key = key.removeprefix(prefix)
            tensors[key] = (st, name)
    h, th = cfg.hidden_size, target.hidden_size
    dh, dkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    vd = hf.get("draft_vocab_size") or target.vocab_size
    shapes = {"fc": (3 * th, h), "q": (2 * h, dh), "k": (2 * h, dkv), "v": (2 * h, dkv), "o": (dh, h),
              "gate": (h, cfg.intermediate_size), "up": (h, cfg.intermediate_size), "down": (cfg.intermediate_size, h),
              "attn_norm": (h,), "hidden_norm": (h,), "mlp_norm": (h,), "norm": (h,), "lm_head": (h, vd),
              "embed": (target.vocab_size, h), "d2t": (vd,)}
    try:
        params = _read(tensors, shapes, vd, path, dtype)
    finally:
        for st in opened:
            st.close()
    if "embed" not in params and h != target.hidden_size:
        raise InvalidInput(f"draft model {path}: hidden size {h} differs from the target's and it has no embedding")
    if "d2t" not in params:
        if vd != target.vocab_size:
            raise InvalidInput(f"draft model {path}: draft vocabulary {vd} without a d2t map")
        params["d2t"] = jnp.arange(vd, dtype=jnp.int32)
    if not np.isfinite(np.asarray(jnp.stack([jnp.sum(v.astype(jnp.float32)) for k, v in params.items()
                                             if k != "d2t"]))).all():
        raise InvalidInput(f"draft model {path}: non-finite weights")
    return Eagle3(cfg, aux), params


def _read(tensors: dict, shapes: dict, vd: int, path: Path, dtype) -> dict:
    """The head's weights from `tensors` (param name -> (file, tensor)), checked against `shapes`."""
    import jax.numpy as jnp

    params = {}
    for key, name in {**NAMES, **TOP}.items():
        if name not in tensors:
            if key in ("embed", "d2t"):
                continue
            raise InvalidInput(f"draft model {path}: tensor {name!r} is missing")
        st, full = tensors[name]
        a = np.asarray(st.read(full))
        a = a.T if a.ndim == 2 else a  # stored [out, in]
        if a.shape != shapes[key]:
            raise InvalidInput(f"draft model {path}: {full} has shape {a.shape[::-1] if a.ndim == 2 else a.shape}, "
                               f"expected {shapes[key][::-1] if a.ndim == 2 else shapes[key]}")
        if key == "d2t":
            params[key] = jnp.asarray(np.arange(vd) + a.astype(np.int64), jnp.int32)
        else:
            params[key] = jnp.asarray(a.astype(np.float32), jnp.float32 if a.ndim == 1 else dtype)
    return params


def layer(p: dict, cfg: ModelConfig, emb, hidden, attend):
    """The draft layer's output (before `norm`) [n, H] for token embeddings emb and hidden states hidden
    [n, H]; attend(x [n, 2H]) -> the attention block's output [n, H] (q/k/v, RoPE, KV, o). The next draft
    takes this output as its hidden state."""
    import jax.numpy as jnp

    from quantkit.runtime.models.common import rms_norm
    from quantkit.runtime.models.llama import swiglu

    eps = cfg.rms_norm_eps
    x = hidden + attend(jnp.concatenate([rms_norm(emb, p["attn_norm"], eps), rms_norm(hidden, p["hidden_norm"], eps)],
                                        axis=-1))
    return x + swiglu(p, rms_norm(x, p["mlp_norm"], eps), cfg, {})


def scores(p: dict, cfg: ModelConfig, x):
    """Float32 logits over the draft vocabulary [..., Vd] of the layer's outputs x [..., H]."""
    import jax.numpy as jnp

    from quantkit.runtime.models.common import linear, rms_norm

    return linear(rms_norm(x, p["norm"], cfg.rms_norm_eps), p["lm_head"]).astype(jnp.float32)


def tokens_of(p: dict, cfg: ModelConfig, x):
    """Greedy draft tokens (target ids) [n] of the layer's outputs x [n, H]."""
    from quantkit.runtime.models.common import argmax

    return p["d2t"][argmax(scores(p, cfg, x))]
