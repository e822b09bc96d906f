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

        fc = params["draft"]["fc"]
        return linear(aux.astype(fc.dtype), fc)

    def embed(self, params: dict):
        return params["draft"].get("embed", params["embed"])

    def run(self, params: dict, emb, hidden, attend):
        return layer(params["draft"], self.cfg, emb.astype(hidden.dtype), hidden, lambda x: attend(params["draft"], x))

    def tokens(self, params: dict, g):
        return tokens_of(params["draft"], self.cfg, g)


def aux_layers(draft_cfg: dict, target_layers: int) -> tuple[int, ...]:
    ids = draft_cfg.get("eagle_aux_hidden_state_layer_ids") or (draft_cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else (2, target_layers // 2, target_layers - 3)


def _checked(path: str | Path, target: ModelConfig) -> tuple[Eagle3, dict]:
    """The draft checkpoint at `path` checked for `target` from its config.json and its safetensors headers
    (no tensor data read): its static part, and {param: TensorInfo} of the tensors it has (`NAMES`, `TOP`;
    "embed" and "d2t" may be absent). InvalidInput / Unsupported naming what does not fit."""
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
    tensors = {}
    for f in files:
        for name, info in SafetensorsFile(f).tensors.items():  # headers only
            for prefix in ("model.", "midlayer.", "layers.0."):
                name = name.removeprefix(prefix)
            tensors[name] = info
    h, th = cfg.hidden_size, target.hidden_size
    dh, dkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    vd = hf.get("draft_vocab_size") or target.vocab_size
    shapes = {"fc": (3 * th, h), "q": (2 * h, dh), "k": (2 * h, dkv), "v": (2 * h, dkv), "o": (dh, h),
              "gate": (h, cfg.intermediate_size), "up": (h, cfg.intermediate_size), "down": (cfg.intermediate_size, h),
              "attn_norm": (h,), "hidden_norm": (h,), "mlp_norm": (h,), "norm": (h,), "lm_head": (h, vd),
              "embed": (target.vocab_size, h), "d2t": (vd,)}
    found = {}
    for key, name in {**NAMES, **TOP}.items():
        if name not in tensors:
            if key in ("embed", "d2t"):
                continue
            raise InvalidInput(f"draft model {path}: tensor {name!r} is missing")
        shape = tuple(tensors[name].shape)
        if (shape[::-1] if len(shape) == 2 else shape) != shapes[key]:  # stored [out, in]
            raise InvalidInput(f"draft model {path}: {tensors[name].name} has shape {shape}, expected "
                               f"{shapes[key][::-1] if len(shapes[key]) == 2 else shapes[key]}")
        found[key] = tensors[name]
    if "embed" not in found and h != target.hidden_size:
        raise InvalidInput(f"draft model {path}: hidden size {h} differs from the target's and it has no embedding")
    if "d2t" not in found and vd != target.vocab_size:
        raise InvalidInput(f"draft model {path}: draft vocabulary {vd} without a d2t map")
    return Eagle3(cfg, aux), found


def _dtype(key: str, ndim: int, dtype):
    """A head weight's dtype as the Runner holds it: d2t int32 (target ids), vectors float32, matrices `dtype`."""
    import jax.numpy as jnp

    return jnp.int32 if key == "d2t" else jnp.float32 if ndim == 1 else dtype


def load(path: str | Path, target: ModelConfig, dtype) -> tuple[Eagle3, dict]:
    """Reads an EAGLE-3 draft checkpoint for `target`: (its static part, its weights); InvalidInput /
    Unsupported naming what does not fit."""
    import jax.numpy as jnp

    from quantkit.formats.safetensors_io import SafetensorsFile

    head, found = _checked(path, target)
    opened = {f: SafetensorsFile(f) for f in {info.file for info in found.values()}}
    try:
        params = {}
        for key, info in found.items():
            a = np.asarray(opened[info.file].read(info.name))
            if key == "d2t":  # offsets: draft id i is target id i + d2t[i]
                a = np.arange(len(a)) + a.astype(np.int64)
            else:
                a = (a.T if a.ndim == 2 else a).astype(np.float32)  # stored [out, in]
            params[key] = jnp.asarray(a, _dtype(key, a.ndim, dtype))
    finally:
        for st in opened.values():
            st.close()
    params.setdefault("d2t", jnp.arange(target.vocab_size, dtype=jnp.int32))
    if not np.isfinite(np.asarray(jnp.stack([jnp.sum(v.astype(jnp.float32)) for k, v in params.items()
                                             if k != "d2t"]))).all():
        raise InvalidInput(f"draft model {path}: non-finite weights")
    return head, params


def abstract(path: str | Path, target: ModelConfig, dtype) -> tuple[Eagle3, dict]:
    """The draft checkpoint at `path` as `plan` compiles it: its static part and its weights as
    jax.ShapeDtypeStruct leaves, as `load` holds them (no tensor data read)."""
    import jax

    head, found = _checked(path, target)
    shapes = {k: tuple(info.shape[::-1]) for k, info in found.items()}  # matrices stored [out, in]
    shapes.setdefault("d2t", (target.vocab_size,))
    return head, {k: jax.ShapeDtypeStruct(s, _dtype(k, len(s), dtype)) for k, s in shapes.items()}


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
