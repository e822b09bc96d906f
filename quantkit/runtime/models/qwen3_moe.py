"""Qwen3-MoE: the Qwen3 decoder with a top-k routed expert MLP; experts go through the grouped matmul."""

from __future__ import annotations

from quantkit.errors import Unsupported
from quantkit.runtime.config import (EXPERTS, FLAG, LAYERS, SIZE, Field, ModelConfig, check_fields, check_top_k, count,
                                     required)
from quantkit.runtime.family import PRE_POST_NORMS, QK_NORMS, Family, Slot, attention, experts, norms
from quantkit.runtime.models import llama


FIELDS = {"num_experts": count(EXPERTS), "num_local_experts": count(EXPERTS), "num_experts_per_tok": count(EXPERTS),
          "moe_intermediate_size": SIZE, "norm_topk_prob": FLAG, "decoder_sparse_step": count(LAYERS),
          "mlp_only_layers": Field("a list of layer indices", lambda v: isinstance(v, list))}


def configure(hf: dict, common: dict, rope: dict) -> dict:
    if hf.get("mlp_only_layers") or (hf.get("decoder_sparse_step") or 1) != 1:
        raise Unsupported("Qwen3-MoE with dense (mlp_only) layers is not supported yet")
    experts = "num_experts" if hf.get("num_experts") else "num_local_experts"
    check_top_k(hf, experts, "num_experts_per_tok")
    check_fields(hf, {"moe_intermediate_size": required(SIZE)})
    return dict(qk_norm=True, num_experts=hf[experts], top_k=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"], norm_topk_prob=hf.get("norm_topk_prob") is not False)


def layer(cfg: ModelConfig, pre: str, kind: str, widths: tuple[int, int]) -> dict:
    h, e = cfg.hidden_size, cfg.num_experts
    return (attention(cfg, pre, kind) | norms(pre, PRE_POST_NORMS | QK_NORMS, h, cfg.head_dim)
            | {"router": Slot("router", pre + "mlp.gate", (h, e))}
            | experts(pre + "mlp.experts.", e, h, widths[1] or cfg.moe_intermediate_size, False))


def moe(p: dict, x, cfg: ModelConfig, batch: dict):
    """Router softmax -> top-k (renormalized if configured) -> SwiGLU experts (expert parallel when the step
    says so: batch["ep_mesh"])."""
    import jax

    from quantkit.runtime.models.common import live_tokens, routed_experts, router_logits

    probs = jax.nn.softmax(router_logits(x, p["router"]), axis=-1)  # [T, experts]
    weights, chosen = jax.lax.top_k(probs, cfg.top_k)  # [T, k]
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    return routed_experts(x, weights, chosen, (p["experts_gate"], p["experts_up"], p["experts_down"]),
                          cfg.num_experts, "silu", batch.get("ep_mesh"), live=live_tokens(batch, x.shape[0]))


def forward(params, cfg, tokens, kv, batch):
    """As llama.forward, with the routed-expert MLP."""
    return llama.forward(params, cfg, tokens, kv, batch, ffn=moe)


QWEN3_MOE = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), configure, layer, forward, fields=FIELDS)
