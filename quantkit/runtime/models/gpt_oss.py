"""gpt-oss (20B, 120B): the pre-norm decoder with biases on q, k, v and o, a learned sink logit per head in
every attention softmax, layers alternating sliding-window (128) and full attention with the same YaRN rope,
and a MoE MLP on every layer: a router with bias whose top-k logits are softmaxed, experts with biases and
a clamped SwiGLU. Its own checkpoint layout (3-D expert tensors, bf16 or MXFP4) is read as per-expert Linears
by formats/gpt_oss.py."""

from __future__ import annotations

from quantkit.runtime.config import EXPERTS, POSITIVE, SIZE, ModelConfig, check_fields, check_top_k, count, required
from quantkit.runtime.family import PRE_POST_NORMS, Family, Slot, attention, experts, norms
from quantkit.runtime.models import llama


FIELDS = {"num_local_experts": count(EXPERTS), "num_experts_per_tok": count(EXPERTS), "sliding_window": count(1 << 30),
          "swiglu_limit": POSITIVE, "swiglu_alpha": POSITIVE}


def configure(hf: dict, common: dict, rope: dict) -> dict:
    check_top_k(hf, "num_local_experts", "num_experts_per_tok")
    check_fields(hf, {"intermediate_size": required(SIZE)})
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return dict(attention_bias=True, sliding_window=hf.get("sliding_window") or 128,
                sliding_layers=tuple(t == "sliding_attention" for t in types), rope_local_scaled=True,
                rope_local_theta=common["rope_theta"], num_experts=hf["num_local_experts"],
                top_k=hf["num_experts_per_tok"], moe_intermediate_size=hf["intermediate_size"],
                swiglu_limit=float(hf.get("swiglu_limit") or 7.0), swiglu_alpha=float(hf.get("swiglu_alpha") or 1.702))


def layer(cfg: ModelConfig, pre: str, kind: str, widths: tuple[int, int]) -> dict:
    h, e, m = cfg.hidden_size, cfg.num_experts, widths[1] or cfg.moe_intermediate_size
    ex = experts(pre + "mlp.experts.", e, h, m, False)
    return (attention(cfg, pre, kind) | norms(pre, PRE_POST_NORMS, h)
            | {"o_bias": Slot("bias", pre + "self_attn.o_proj", (h,)),
               "sinks": Slot("tensor", pre + "self_attn.sinks", (cfg.num_heads,)),
               "router": Slot("router", pre + "mlp.router", (h, e)),
               "router_bias": Slot("bias", pre + "mlp.router", (e,))}
            | ex | {f"{k}_bias": Slot("experts_bias", s.module, (e, s.shape[-1])) for k, s in ex.items()})


def moe(p: dict, x, cfg: ModelConfig, batch: dict):
    """Router logits (with bias) -> top-k -> softmax over those k -> experts with biases and the clamped SwiGLU."""
    import jax
    import jax.numpy as jnp

    from quantkit.runtime.models.common import live_tokens, routed_experts, router_logits

    logits = router_logits(x, p["router"]) + p["router_bias"].astype(jnp.float32)  # [T, experts]
    top, chosen = jax.lax.top_k(logits, cfg.top_k)
    limit, alpha = cfg.swiglu_limit, cfg.swiglu_alpha

    def act(g, u):
        g32 = jnp.minimum(g.astype(jnp.float32), limit)
        u32 = jnp.clip(u.astype(jnp.float32), -limit, limit)
        return (g32 * jax.nn.sigmoid(alpha * g32) * (u32 + 1)).astype(g.dtype)

    keys = ("experts_gate", "experts_up", "experts_down")
    return routed_experts(x, jax.nn.softmax(top, axis=-1), chosen, tuple(p[k] for k in keys), cfg.num_experts,
                          act, batch.get("ep_mesh"), bias=tuple(p[k + "_bias"] for k in keys),
                          live=live_tokens(batch, x.shape[0]))


def forward(params, cfg, tokens, kv, batch):
    """As llama.forward (attention biases, sinks and the rope are attention_block's), with the gpt-oss MoE."""
    return llama.forward(params, cfg, tokens, kv, batch, ffn=moe)


GPT_OSS = Family("gpt_oss", ("GptOssForCausalLM",), configure, layer, forward, fields=FIELDS)
