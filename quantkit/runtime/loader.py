"""Checkpoint -> weight pytree on device. Quantized weights are unpacked once into QTensors (int4 stays
int4); dense weights become bf16 [in, out] arrays; nothing is ever dequantized.

Name mapping is an explicit table per family (ARCHITECTURE.md rule 8): every pytree leaf names exactly
one checkpoint module, and a missing module is an error naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from quantkit.errors import InvalidInput, Unsupported
from quantkit.formats.compressed_tensors import QuantConfig, kernel_layout, logical_shape, parse_quantization_config
from quantkit.formats.hf import Checkpoint, group_modules
from quantkit.quant.qtensor import QTensor, make_qtensor
from quantkit.runtime.config import ModelConfig, from_hf

LINEARS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj"}
MLP = {"gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
NORMS = {  # family -> pytree key -> module under model.layers.{i}
    "llama": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "qwen3": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
              "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
    "qwen3_moe": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                  "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
    "gemma3": {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
               "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
               "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
}


@dataclass
class LoadedModel:
    """A model ready to run: its config, its weight pytree (on device) and the HBM the weights take."""

    path: Path
    cfg: ModelConfig
    params: dict
    dtype: jnp.dtype

    @property
    def weight_bytes(self) -> int:
        return sum(x.nbytes if not isinstance(x, QTensor) else x.nbytes()
                   for x in jax.tree_util.tree_leaves(self.params, is_leaf=lambda a: isinstance(a, QTensor)))


class _Reader:
    def __init__(self, ckpt: Checkpoint, qc: QuantConfig | None, dtype):
        self.ckpt, self.qc, self.dtype = ckpt, qc, dtype
        self.modules = group_modules(ckpt.tensors)

    def params(self, module: str) -> dict[str, str]:
        found = self.modules.get(module)
        if found is None:
            raise InvalidInput(f"{self.ckpt.root}: module {module!r} is missing from the checkpoint")
        return found

    def array(self, module: str, param: str = "weight", dtype=None) -> jax.Array:
        name = self.params(module).get(param)
        if name is None:
            raise InvalidInput(f"{self.ckpt.root}: tensor {module}.{param} is missing from the checkpoint")
        return jnp.asarray(np.asarray(self.ckpt.read(name)).astype(np.float32), dtype or self.dtype)

    def _layout(self, module: str):
        pnames = self.params(module)
        scheme = self.qc.scheme_for(module, "Linear") if self.qc is not None else None
        if scheme is None or scheme.weights is None or scheme.format == "dense":
            return None
        arrays = {p: np.asarray(self.ckpt.read(n)) for p, n in pnames.items()}
        shape = logical_shape({p: a.shape for p, a in arrays.items()}, arrays.get("weight_shape"))
        values, scales, qtype, group = kernel_layout(scheme, arrays, shape)
        if scales.dtype == np.float16:
            scales = scales.astype(np.float32)
        return values, scales, qtype, group

    def linear(self, module: str):
        """A Linear's weight: QTensor [1, in, out] if quantized, else dense [in, out]."""
        layout = self._layout(module)
        if layout is None:
            return jnp.asarray(np.asarray(self.ckpt.read(self.params(module)["weight"])).astype(np.float32).T,
                               self.dtype)
        values, scales, qtype, group = layout
        return make_qtensor(values[None], scales[None], qtype, group)

    def experts(self, modules: list[str]):
        """Stacked expert weights: QTensor [experts, in, out], or dense [experts, in, out]."""
        layouts = [self._layout(m) for m in modules]
        if all(la is None for la in layouts):
            return jnp.stack([self.linear(m) for m in modules])
        if any(la is None for la in layouts) or len({(la[2], la[3]) for la in layouts}) != 1:
            raise Unsupported(f"experts {modules[0]}..: mixed quantization across experts is not supported")
        return make_qtensor(np.stack([la[0] for la in layouts]), np.stack([la[1] for la in layouts]),
                            layouts[0][2], layouts[0][3])


def load(path: str | Path, dtype=jnp.bfloat16, check: bool = True) -> LoadedModel:
    """Loads a dense or compressed-tensors checkpoint that `quantkit inspect` accepts.

    Args:
        path: checkpoint directory.
        dtype: activation and dense-weight dtype (bf16; float32 for parity tests).
        check: run inspect's validation first (errors and unsupported layers stop the load).
    """
    path = Path(path)
    if check:
        from quantkit.inspect import inspect_checkpoint

        report = inspect_checkpoint(path, "cpu" if jax.default_backend() != "tpu" else "v6e")
        for severity, exc in (("error", InvalidInput), ("unsupported", Unsupported)):
            probs = [p for p in report["problems"] if p["severity"] == severity]
            if probs:
                more = f" (and {len(probs) - 1} more; see `quantkit inspect`)" if len(probs) > 1 else ""
                raise exc(f"{path}: {probs[0]['where']}: {probs[0]['message']}{more}")
    ckpt = Checkpoint.open(path)
    if ckpt.config is None:
        raise InvalidInput(f"{path}: no config.json")
    eos = ()
    gen = path / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        eos = tuple(e if isinstance(e, list) else [e] if e is not None else [])
    cfg = from_hf(ckpt.config, eos)
    raw = ckpt.config.get("quantization_config")
    qc = parse_quantization_config(raw) if isinstance(raw, dict) else None
    r = _Reader(ckpt, qc, dtype)
    layers = []
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        layer = {key: r.linear(pre + mod) for key, mod in LINEARS.items()}
        if cfg.attention_bias:
            layer |= {f"{key}_bias": r.array(pre + mod, "bias") for key, mod in LINEARS.items() if key != "o"}
        layer |= {key: r.array(pre + mod, dtype=jnp.float32) for key, mod in NORMS[cfg.family].items()}
        if cfg.family == "qwen3_moe":
            layer["router"] = r.array(pre + "mlp.gate", dtype=jnp.float32).T  # [hidden, experts]
            for key, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                layer[key] = r.experts([f"{pre}mlp.experts.{e}.{proj}" for e in range(cfg.num_experts)])
        else:
            layer |= {key: r.linear(pre + mod) for key, mod in MLP.items()}
        layers.append(layer)
    params = {"embed": r.array("model.embed_tokens"), "layers": layers,
              "final_norm": r.array("model.norm", dtype=jnp.float32)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = r.linear("lm_head")
    return LoadedModel(path, cfg, params, jnp.dtype(dtype))
