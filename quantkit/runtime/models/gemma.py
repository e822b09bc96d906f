"""Gemma 3 and Gemma 4 (text): sliding-window and full layers, RMSNorms before and after each block
(Gemma 3: scale 1 + w, Gemma 4: w), q/k norms, embeddings scaled by sqrt(hidden), GeGLU (tanh) MLP, tied
embeddings. Gemma 4 adds: per-kind attention shapes, k_eq_v, the weightless v norm, a per-layer output
scalar, and on MoE models a routed expert block beside each layer's dense MLP."""

from __future__ import annotations

import json
import math

from quantkit.errors import InvalidInput, Unsupported
from quantkit.runtime.config import (CAP, EXPERTS, FLAG, HEADS, INDEX, LAYERS, OBJECT, POSITIVE, SIZE, TEXT, ModelConfig,
                                     check_fields, check_top_k, count, required)
from quantkit.runtime.family import QK_NORMS, Family, Slot, attention, experts, mlp, norms

NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
         "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm", **QK_NORMS}
MOE_NORMS = {"post_mlp_norm_1": "post_feedforward_layernorm_1", "pre_mlp_norm_2": "pre_feedforward_layernorm_2",
             "post_mlp_norm_2": "post_feedforward_layernorm_2"}  # Gemma 4's expert block


FIELDS = {"sliding_window_pattern": count(LAYERS), "sliding_window": count(1 << 30), "attn_logit_softcapping": CAP,
          "query_pre_attn_scalar": POSITIVE, "final_logit_softcapping": CAP}
FIELDS4 = FIELDS | {"hidden_size_per_layer_input": INDEX, "num_kv_shared_layers": INDEX, "use_bidirectional_attention": TEXT,
                    "hidden_activation": TEXT, "per_layer_config": OBJECT, "attention_k_eq_v": FLAG,
                    "num_global_key_value_heads": count(HEADS), "global_head_dim": count(1 << 16),
                    "enable_moe_block": FLAG, "num_experts": count(EXPERTS), "top_k_experts": count(EXPERTS),
                    "moe_intermediate_size": SIZE, "expert_intermediate_size": SIZE}
LAYER_GEOMETRY = {"head_dim": count(1 << 16), "num_key_value_heads": count(HEADS)}  # a per_layer_config entry


def configure(hf: dict, common: dict, rope: dict) -> dict:
    """Gemma 3's fields: which layers slide (layer_types, or every sliding_window_pattern-th layer full),
    query scale, embedding scale, final soft-capping; (1 + w) norms."""
    types = hf.get("layer_types")
    if types:
        sliding = tuple(t == "sliding_attention" for t in types)
    else:
        pattern = hf.get("sliding_window_pattern") or 6
        sliding = tuple((i + 1) % pattern != 0 for i in range(hf["num_hidden_layers"]))
    if hf.get("attn_logit_softcapping"):
        raise Unsupported("attention logit soft-capping (Gemma 2) is not supported")
    return dict(qk_norm=True, sliding_window=hf.get("sliding_window"), sliding_layers=sliding,
                query_scale=(hf.get("query_pre_attn_scalar") or common["head_dim"]) ** -0.5,
                embed_scale=math.sqrt(common["hidden_size"]), final_logit_softcap=hf.get("final_logit_softcapping"),
                norm_offset=1.0)


def configure_gemma4(hf: dict, common: dict, full_rope: dict) -> dict:
    """Gemma 4's fields (transformers models/gemma4): what differs from Gemma 3, and what is refused."""
    out = configure(hf, common, full_rope)
    refuse = [(hf.get("hidden_size_per_layer_input"), "per-layer input embeddings (Gemma 4 E2B/E4B)"),
              (hf.get("num_kv_shared_layers"), "KV sharing across layers (Gemma 4 E2B/E4B)"),
              (hf.get("use_bidirectional_attention") == "all", "bidirectional attention"),
              (hf.get("attention_bias"), "attention biases"),
              ((hf.get("hidden_activation") or "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
               f"hidden_activation {hf.get('hidden_activation')!r}")]
    for bad, what in refuse:
        if bad:
            raise Unsupported(f"Gemma 4 with {what} is not supported (the 31B dense and 26B-A4B MoE models are)")
    # full layers' geometry: the published config's global_* fields, or transformers' per_layer_config
    per_layer = hf.get("per_layer_config") or {}
    for k, v in per_layer.items():
        if not (k.isdigit() and int(k) < len(out["sliding_layers"])) or not isinstance(v, dict):
            raise InvalidInput(f"config.json: per_layer_config has an entry {k!r}: {json.dumps(v)[:40]}; expected "
                               f"layer indices under {len(out['sliding_layers'])}, each an object")
        check_fields(v, LAYER_GEOMETRY, f"config.json: per_layer_config.{k}")
    override = [v for k, v in per_layer.items() if not out["sliding_layers"][int(k)]]
    if any(o != override[0] for o in override):
        raise Unsupported("Gemma 4 full-attention layers of different shapes are not supported")
    over = override[0] if override else {}
    k_eq_v = bool(hf.get("attention_k_eq_v"))
    kv_heads = over.get("num_key_value_heads", hf.get("num_global_key_value_heads") if k_eq_v else None)
    out |= dict(query_scale=1.0, norm_offset=0.0, v_norm=True, k_eq_v=k_eq_v,
                full_head_dim=over.get("head_dim") or hf.get("global_head_dim") or 512, full_kv_heads=kv_heads or 0,
                rope_partial=float(full_rope.get("partial_rotary_factor") or 1.0)
                if full_rope.get("rope_type") == "proportional" else 1.0)
    if common["num_heads"] % (out["full_kv_heads"] or common["num_kv_heads"]):
        raise InvalidInput(f"config.json: num_attention_heads ({common['num_heads']}) is not a multiple of the full "
                           f"layers' KV heads ({out['full_kv_heads']})")
    if hf.get("enable_moe_block"):
        check_top_k(hf, "num_experts", "top_k_experts")
        width = "moe_intermediate_size" if hf.get("moe_intermediate_size") else "expert_intermediate_size"
        check_fields(hf, {width: required(SIZE)})
        out |= dict(num_experts=hf["num_experts"], top_k=hf["top_k_experts"], moe_intermediate_size=hf[width],
                    moe_dense=True)
    return out


def layer(cfg: ModelConfig, pre: str, kind: str, widths: tuple[int, int]) -> dict:
    h, e = cfg.hidden_size, cfg.num_experts
    out = attention(cfg, pre, kind, v=not (cfg.k_eq_v and kind == "full"))
    out |= norms(pre, NORMS | (MOE_NORMS if cfg.moe_dense else {}), h, cfg.kv_shape(kind)[1])
    out |= mlp(pre, h, widths[0] or cfg.intermediate_size)
    if cfg.family == "gemma4":
        out["layer_scalar"] = Slot("tensor", pre + "layer_scalar", (1,))
    if cfg.moe_dense:
        out |= {"router": Slot("router", pre + "router.proj", (h, e)),
                "router_scale": Slot("tensor", pre + "router.scale", (h,)),
                "expert_scale": Slot("tensor", pre + "router.per_expert_scale", (e,))}
        out |= experts(pre + "experts.", e, h, widths[1] or cfg.moe_intermediate_size, True)
    return out


def moe(p: dict, x, cfg: ModelConfig, batch: dict):
    """Gemma 4's expert block on the residual x [T, hidden]: the router sees x RMS-normed without a weight,
    times its `router_scale` and 1/sqrt(hidden); softmax, top-k, renormalised, times each chosen expert's
    `expert_scale`; the experts (GeGLU) see x through pre_mlp_norm_2."""
    import jax
    import jax.numpy as jnp

    from quantkit.runtime.models.common import live_tokens, rms_norm, routed_experts, router_logits

    eps = cfg.rms_norm_eps
    r = rms_norm(x, None, eps).astype(jnp.float32) * p["router_scale"] * (cfg.hidden_size ** -0.5)
    probs = jax.nn.softmax(router_logits(r, p["router"]), axis=-1)  # [T, experts]
    weights, chosen = jax.lax.top_k(probs, cfg.top_k)  # [T, k]
    weights = weights / weights.sum(-1, keepdims=True) * p["expert_scale"][chosen]
    h = rms_norm(x, p["pre_mlp_norm_2"], eps)
    return routed_experts(h, weights, chosen, (p["experts_gate"], p["experts_up"], p["experts_down"]),
                          cfg.num_experts, "gelu_tanh", batch.get("ep_mesh"), live=live_tokens(batch, h.shape[0]))


def forward(params: dict, cfg: ModelConfig, tokens, kv: dict, batch: dict):
    """As llama.forward, for the Gemma 3 / Gemma 4 decoder."""
    import jax.numpy as jnp

    from quantkit.runtime.models.common import attention_block, gated, layer_params, linear, rms_norm, run_layers

    eps, off = cfg.rms_norm_eps, cfg.norm_offset
    x = params["embed"][tokens]
    x = x * jnp.asarray(cfg.embed_scale, x.dtype)  # the scale is rounded to the activation dtype, as in HF

    def body(kind, i, carry):
        x, kv = carry
        p = layer_params(params["layers"][kind], i)
        a, kv_kind = attention_block(p, rms_norm(x, p["attn_norm"], eps, off), kv[kind], i, batch, cfg, kind)
        x = x + rms_norm(a, p["post_attn_norm"], eps, off)
        h = rms_norm(x, p["mlp_norm"], eps, off)
        m = linear(gated(h, p["gate"], p["up"], "gelu_tanh"), p["down"])
        if cfg.moe_dense:
            m = rms_norm(m, p["post_mlp_norm_1"], eps) + rms_norm(moe(p, x, cfg, batch), p["post_mlp_norm_2"], eps)
        x = x + rms_norm(m, p["post_mlp_norm"], eps, off)
        if "layer_scalar" in p:
            x = x * p["layer_scalar"].astype(x.dtype)
        return x, {**kv, kind: kv_kind}

    x, kv = run_layers(body, cfg.layer_kinds, (x, kv), batch.get("unroll", False))
    return rms_norm(x, params["final_norm"], eps, off), kv


GEMMA3 = Family("gemma3", ("Gemma3ForCausalLM",), configure, layer, forward, defaults={"tie_word_embeddings": True},
                fields=FIELDS)
GEMMA4 = Family("gemma4", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), configure_gemma4, layer, forward,
                defaults={"rope_parameters": {  # transformers' defaults
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}},
                packed_experts=True, fields=FIELDS4)
