"""Qwen3.5 and Qwen3.5-MoE (text): three of every four layers are Gated DeltaNet (GDN) linear attention
with a fixed-size state per sequence (runtime/models/gdn.py), the fourth gated full attention over the paged
KV cache; zero-centred (1 + w) RMSNorms; a SwiGLU MLP, or routed experts plus a gated shared expert."""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.errors import Unsupported
from quantkit.runtime.config import (EXPERTS, FRACTION, HEADS, INDEX, LAYERS, SIZE, TEXT, ModelConfig, check_fields,
                                     check_top_k, count, required)
from quantkit.runtime.family import MLP, PRE_POST_NORMS, QK_NORMS, Family, Slot, attention, experts, mlp, norms

GDN = {"in_qkv": "linear_attn.in_proj_qkv", "in_z": "linear_attn.in_proj_z", "in_b": "linear_attn.in_proj_b",
       "in_a": "linear_attn.in_proj_a", "out": "linear_attn.out_proj"}  # the Gated DeltaNet Linears
SHARED = {"shared_gate": "mlp.shared_expert.gate_proj", "shared_up": "mlp.shared_expert.up_proj",
          "shared_down": "mlp.shared_expert.down_proj"}


FIELDS = {"full_attention_interval": count(LAYERS), "hidden_act": TEXT, "partial_rotary_factor": FRACTION,
          "linear_num_key_heads": count(HEADS), "linear_num_value_heads": count(HEADS),
          "linear_key_head_dim": count(1 << 16), "linear_value_head_dim": count(1 << 16),
          "linear_conv_kernel_dim": count(64), "num_experts": count(EXPERTS, least=0),
          "num_experts_per_tok": count(EXPERTS), "moe_intermediate_size": SIZE, "shared_expert_intermediate_size": INDEX}


def configure(hf: dict, common: dict, rope: dict) -> dict:
    """Qwen3.5 and Qwen3.5-MoE (transformers models/qwen3_5, qwen3_5_moe): layer_types name the Gated
    DeltaNet ("linear_attention") layers; zero-centred (1 + w) norms; the MTP layer is loaded only as a
    draft head (`Mtp`)."""
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % (hf.get("full_attention_interval") or 4) == 0
                                      else "linear_attention" for i in range(common["num_layers"])]
    if set(types) - {"full_attention", "linear_attention"}:
        raise Unsupported(f"Qwen3.5 layer types {sorted(set(types))} are not supported")
    if (hf.get("hidden_act") or "silu") != "silu" or hf.get("attention_bias"):
        raise Unsupported("Qwen3.5 with a hidden_act other than silu or attention biases is not supported")
    partial = float(rope.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 0.25)
    out = dict(qk_norm=True, linear_layers=tuple(t == "linear_attention" for t in types), norm_offset=1.0,
               attn_gate=True, rope_dims=int(common["head_dim"] * partial),
               linear_k_heads=hf.get("linear_num_key_heads") or 16, linear_v_heads=hf.get("linear_num_value_heads") or 32,
               linear_k_dim=hf.get("linear_key_head_dim") or 128, linear_v_dim=hf.get("linear_value_head_dim") or 128,
               conv_kernel=hf.get("linear_conv_kernel_dim") or 4)
    if out["linear_v_heads"] % out["linear_k_heads"]:
        raise Unsupported("Qwen3.5 with value heads that are not a multiple of the key heads is not supported")
    if hf.get("num_experts"):
        check_top_k(hf, "num_experts", "num_experts_per_tok")
        check_fields(hf, {"moe_intermediate_size": required(SIZE)})
        out.update(num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                   moe_intermediate_size=hf["moe_intermediate_size"], norm_topk_prob=True,
                   shared_intermediate_size=hf.get("shared_expert_intermediate_size") or 0)
    return out


def layer(cfg: ModelConfig, pre: str, kind: str, widths: tuple[int, int]) -> dict:
    """A Gated DeltaNet ("linear") or gated attention layer (q_proj doubled: [query | gate] per head), then a
    SwiGLU MLP or routed experts (per-expert Linears, or a bf16 checkpoint's packed 3-D tensors) with a
    shared expert."""
    h, e = cfg.hidden_size, cfg.num_experts
    out = norms(pre, PRE_POST_NORMS, h)
    if kind == "linear":
        conv, _ = cfg.gdn_dims
        hv, dv = cfg.linear_v_heads, cfg.linear_v_dim
        dims = {"in_qkv": (h, conv), "in_z": (h, hv * dv), "in_b": (h, hv), "in_a": (h, hv), "out": (hv * dv, h)}
        out |= {key: Slot("linear", pre + mod, dims[key]) for key, mod in GDN.items()}
        out |= {"conv": Slot("conv", pre + "linear_attn.conv1d", (cfg.conv_kernel, conv)),
                "A_log": Slot("tensor", pre + "linear_attn.A_log", (hv,)),
                "dt_bias": Slot("tensor", pre + "linear_attn.dt_bias", (hv,)),
                "gdn_norm": Slot("norm", pre + "linear_attn.norm", (dv,))}
    else:
        out |= attention(cfg, pre, kind, q_width=2 * cfg.num_heads * cfg.head_dim)
        out |= norms(pre, QK_NORMS, h, cfg.head_dim)
    if not e:
        return out | mlp(pre, h, widths[0] or cfg.intermediate_size, MLP)
    out |= experts(pre + "mlp.experts.", e, h, widths[1] or cfg.moe_intermediate_size, True)
    out |= mlp(pre, h, cfg.shared_intermediate_size, SHARED)
    return out | {"router": Slot("router", pre + "mlp.gate", (h, e)),
                  "shared_expert_gate": Slot("router", pre + "mlp.shared_expert_gate", (h, 1))}


def moe(p: dict, x, cfg: ModelConfig, batch: dict):
    """Routed experts (softmax, top-k, renormalised; SwiGLU) plus the shared expert times
    sigmoid(shared_expert_gate x)."""
    import jax
    import jax.numpy as jnp

    from quantkit.runtime.models.common import gated, linear, live_tokens, routed_experts, router_logits

    probs = jax.nn.softmax(router_logits(x, p["router"]), axis=-1)  # [T, experts]
    weights, chosen = jax.lax.top_k(probs, cfg.top_k)
    weights = weights / weights.sum(-1, keepdims=True)
    routed = routed_experts(x, weights, chosen, (p["experts_gate"], p["experts_up"], p["experts_down"]),
                            cfg.num_experts, "silu", batch.get("ep_mesh"), live=live_tokens(batch, x.shape[0]))
    shared = linear(gated(x, p["shared_gate"], p["shared_up"], "silu"), p["shared_down"])
    gate = jax.nn.sigmoid(router_logits(x, p["shared_expert_gate"]))  # [T, 1]
    return (routed.astype(jnp.float32) + gate * shared.astype(jnp.float32)).astype(x.dtype)


def ffn(p: dict, h, cfg: ModelConfig, batch: dict):
    """The layer's MLP: SwiGLU, or routed experts with the shared expert (`moe`)."""
    from quantkit.runtime.models.common import gated, linear

    if cfg.num_experts:
        return moe(p, h, cfg, batch)
    return linear(gated(h, p["gate"], p["up"], "silu"), p["down"])


def mtp_slots(cfg: ModelConfig, widths: tuple[int, int]) -> dict:
    """The MTP layer's weights (the checkpoint's `mtp.*`, vLLM's Qwen3_5MultiTokenPredictor): fc [2H, H] over
    [embedding | hidden], its two pre-fc norms, one gated-attention decoder layer (a stack of one, as the
    model's own "full" layers) and its final norm."""
    from quantkit.runtime.family import Slot

    h = cfg.hidden_size
    one = layer(cfg, "mtp.layers.0.", "full", widths)
    return {"fc": Slot("linear", "mtp.fc", (2 * h, h)),
            "pre_fc_norm_embedding": Slot("norm", "mtp.pre_fc_norm_embedding", (h,)),
            "pre_fc_norm_hidden": Slot("norm", "mtp.pre_fc_norm_hidden", (h,)), "norm": Slot("norm", "mtp.norm", (h,)),
            "layer": {key: Slot("stack", (s,), (1, *s.shape)) for key, s in one.items()}}


@dataclass(frozen=True)
class Mtp:
    """Qwen3.5's multi-token-prediction layer as a draft head (speculative `"method": "mtp"`; step.draft_rows):
    fc over [pre_fc_norm_embedding(embedding of the next token) | pre_fc_norm_hidden(hidden)], a decoder
    layer of the model's full-attention kind with its own KV, `norm`; the target's lm_head gives its token,
    and its normed output is the next draft's hidden. The first draft takes the target's final (normed)
    hidden state, as vLLM's proposer does. Weights: params["draft"] (`mtp_slots`)."""

    cfg: ModelConfig
    aux: tuple = ()

    def hidden(self, params: dict, h, aux):
        return h

    def embed(self, params: dict):
        return params["embed"]

    def run(self, params: dict, emb, hidden, attend):
        import jax.numpy as jnp

        from quantkit.runtime.models.common import layer_params, linear, rms_norm

        d, eps, off = params["draft"], self.cfg.rms_norm_eps, self.cfg.norm_offset
        x = linear(jnp.concatenate([rms_norm(emb, d["pre_fc_norm_embedding"], eps, off),
                                    rms_norm(hidden, d["pre_fc_norm_hidden"], eps, off)], axis=-1), d["fc"])
        p = layer_params(d["layer"], 0)
        x = x + attend(p, rms_norm(x, p["attn_norm"], eps, off))
        x = x + ffn(p, rms_norm(x, p["mlp_norm"], eps, off), self.cfg, {})
        return rms_norm(x, d["norm"], eps, off)

    def tokens(self, params: dict, g):
        from quantkit.runtime.models.common import argmax, logits

        return argmax(logits(params, g, self.cfg))


def forward(params: dict, cfg: ModelConfig, tokens, kv: dict, batch: dict):
    """As llama.forward; kv["linear"] is the GDN layers' (conv, recurrent) state."""
    from quantkit.runtime.models.common import attention_block, layer_params, rms_norm, run_layers
    from quantkit.runtime.models.gdn import gdn_block

    eps, off = cfg.rms_norm_eps, cfg.norm_offset

    def layer(kind, i, carry):
        x, kv = carry
        p = layer_params(params["layers"][kind], i)
        h = rms_norm(x, p["attn_norm"], eps, off)
        if kind == "linear":
            a, c = gdn_block(p, h, kv[kind], i, batch, cfg)
        else:
            a, c = attention_block(p, h, kv[kind], i, batch, cfg, kind)
        x = x + a
        return x + ffn(p, rms_norm(x, p["mlp_norm"], eps, off), cfg, batch), {**kv, kind: c}

    x, kv = run_layers(layer, cfg.layer_kinds, (params["embed"][tokens], kv), batch.get("unroll", False))
    return rms_norm(x, params["final_norm"], eps, off), kv


QWEN3_5 = Family("qwen3_5", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                             "Qwen3_5MoeForConditionalGeneration"), configure, layer, forward, packed_experts=True,
                 fields=FIELDS)
