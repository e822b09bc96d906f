"""Gemma 4 (31B dense and 26B-A4B MoE architectures) from checkpoint to runtime, against transformers and
compressed-tensors. The float32 parity of the bf16 models (dense with attention_k_eq_v and the 5:1 pattern,
and MoE) runs with the other families in test_runtime.py; here: checkpoints quantized by the library,
quantkit convert of a multimodal checkpoint with packed experts, and what inspect refuses.

Tolerance for quantized checkpoints (1e-2 relative on the logits): as in test_runtime.py, the library rounds
each dequantized weight to bf16 (relative 2^-9) while the runtime keeps q * s exact in float32.
"""

import json

import jax.numpy as jnp
import pytest
import torch
import transformers as T
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

from ct_oracle import (fake_quantize_inputs, library_convert_dequantize, library_decompress, make_checkpoint,
                       with_float32_scales)
from helpers import gemma4_config, greedy_parity, per_expert_linears, perturbed, rel_err
from quantkit.convert import convert
from quantkit.inspect import inspect_checkpoint


@pytest.mark.parametrize("scheme", ["W4A16_G32", "W4A16_CHANNEL", "FP8_DYNAMIC", "MXFP4A16"])
def test_checkpoints_quantized_by_the_library_match_transformers(scheme, tmp_path):
    """Dense Gemma 4 (k_eq_v full layers of their own head size) quantized by compressed-tensors: the runtime
    on the compressed checkpoint against transformers on the library's decompressed weights. FP8_DYNAMIC's
    activations are quantized per token to fp8 on both sides (the library's own on each Linear's input:
    ct_oracle.fake_quantize_inputs; weights dequantized in float32, as the runtime's), 3e-2 as in
    test_runtime's 8-bit activation test (255-level rows turn last-bit differences into steps)."""
    torch.manual_seed(0)
    model = perturbed(T.Gemma4ForCausalLM(gemma4_config())).to(torch.bfloat16).eval()
    q = make_checkpoint(tmp_path / "q", scheme, model=model)
    acts = scheme == "FP8_DYNAMIC"
    if acts:
        library_convert_dequantize(with_float32_scales(q, tmp_path / "q32"), tmp_path / "dense", dtype=torch.float32)
    else:
        library_convert_dequantize(q, tmp_path / "dense")
    ref = T.Gemma4ForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32).eval()
    m = greedy_parity(q, fake_quantize_inputs(ref, scheme) if acts else ref, jnp.float32, 3e-2 if acts else 1e-2)
    assert type(m.params["layers"]["full"]["k"]).__name__ == "QTensor" and "v" not in m.params["layers"]["full"]


def _multimodal_moe():
    """Every expert routed (top-k = all 8): the expert mix stays a smooth function of the weights, so that
    quantization (ours in float32, the library's in bf16) cannot flip a near-tie in the top-k choice, which
    moves a token's output by far more than the 1e-2 tolerance. Dense MLP 224 and experts 64 wide: both
    zero-padded to 128-lane multiples on load (loader.lane_widths), as the 26B-A4B's 2112 and 704 are."""
    vision = T.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=2, head_dim=16)
    text = gemma4_config(moe=True, top_k_experts=8, intermediate_size=224)
    cfg = T.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    torch.manual_seed(0)
    return perturbed(T.Gemma4ForConditionalGeneration(cfg)).eval()


def _linearized(model):
    for layer in model.model.language_model.layers:
        layer.experts = per_expert_linears(layer.experts)
    return model


def test_convert_splits_packed_experts_of_a_multimodal_checkpoint(tmp_path):
    """quantkit convert on Gemma4ForConditionalGeneration with packed 3-D experts: the experts come out as
    per-expert int4 Linears (llm-compressor's layout), router, vision tower and embedder stay bf16 and are
    recorded in `ignore`; the library marks exactly the modules we quantized; transformers reads every
    non-expert tensor under its names; the runtime on it matches transformers on the library's decompressed
    weights (repacked), so every expert's gate / up / down came from the right rows."""
    src = _multimodal_moe()
    src.to(torch.bfloat16).save_pretrained(tmp_path / "src")
    report = convert(tmp_path / "src", tmp_path / "w4", "W4A16", 32)
    qc = json.loads((tmp_path / "w4" / "config.json").read_text())["quantization_config"]
    assert {"re:.*vision_tower\\.", "re:.*embed_vision\\.", "lm_head"} <= set(qc["ignore"])
    assert all(p.endswith("router.proj") for p in set(qc["ignore"]) - {"re:.*vision_tower\\.", "re:.*embed_vision\\.",
                                                                      "lm_head"})
    dense = library_decompress(tmp_path / "w4")
    ours = {n.removesuffix(".weight") for n in dense}
    cfg = src.config.text_config
    sliding = cfg.layer_types.count("sliding_attention")  # q k v o gate up down; full layers have no v_proj
    assert report["quantized_tensors"] == len(ours) == cfg.num_hidden_layers * (6 + 3 * cfg.num_experts) + sliding
    fresh = _linearized(_multimodal_moe())
    apply_quantization_config(fresh, QuantizationConfig.model_validate(qc))
    marked = {n for n, m in fresh.named_modules()
              if isinstance(m, torch.nn.Linear) and hasattr(m, "quantization_scheme")}
    assert marked == ours and any(".experts.7.down_proj" in n for n in ours)
    r = inspect_checkpoint(tmp_path / "w4", "v6e")
    paths = {layer["name"]: layer["path"] for layer in r["layers"]}
    assert r["servable"] and r["architecture"] == "Gemma4ForConditionalGeneration"
    # 64 inputs: served padded to 128 lanes (the loader's lane_widths), so on the kernel path
    assert paths["model.language_model.layers.0.experts.7.down_proj"] == "gmm_v2"
    assert paths["model.language_model.layers.0.router.proj"] == "dense"

    # llm-compressor's split: expert e's gate_proj is rows [0, I) of gate_up_proj[e], up_proj rows [I, 2I)
    ex0, i = src.model.language_model.layers[0].experts, cfg.moe_intermediate_size
    for e in range(cfg.num_experts):
        for proj, want in (("gate_proj", ex0.gate_up_proj[e, :i]), ("up_proj", ex0.gate_up_proj[e, i:]),
                           ("down_proj", ex0.down_proj[e])):
            got = dense[f"model.language_model.layers.0.experts.{e}.{proj}.weight"]
            assert rel_err(got, want.detach().float().numpy()) < 0.15  # int4 g32 error of a random weight: ~0.1
    ref = _multimodal_moe().to(torch.bfloat16).float()  # the non-quantized weights as the checkpoint has them
    with torch.no_grad():
        for name, w in dense.items():
            module = name.removesuffix(".weight")
            if ".experts." not in module:
                ref.get_submodule(module).weight.copy_(torch.from_numpy(w))
                continue
            root, e, proj = module.rsplit(".", 2)
            ex, i = ref.get_submodule(root), cfg.moe_intermediate_size
            packed, rows = (ex.down_proj, slice(None)) if proj == "down_proj" else \
                (ex.gate_up_proj, slice(0, i) if proj == "gate_proj" else slice(i, 2 * i))
            packed[int(e), rows] = torch.from_numpy(w)
    greedy_parity(tmp_path / "w4", ref, jnp.float32, 1e-2)
    # transformers 5.24 reads every non-expert tensor of the checkpoint under its own names; it does not map
    # per-expert Linears (llm-compressor's layout, what vLLM reads) back onto Gemma 4's packed 3-D experts, so
    # it leaves exactly those missing: the experts are proven above through the library's decompression
    _, info = T.Gemma4ForConditionalGeneration.from_pretrained(tmp_path / "w4", dtype=torch.float32,
                                                               output_loading_info=True)
    assert info["missing_keys"] == {f"model.language_model.layers.{i}.experts.{p}"
                                    for i in range(cfg.num_hidden_layers) for p in ("gate_up_proj", "down_proj")}
    assert {k.rsplit(".", 1)[0] for k in info["unexpected_keys"]} == {
        n for n in ours if ".experts." in n} and not info["mismatched_keys"] and not info["error_msgs"]

def test_runtime_reads_packed_bf16_experts_of_a_multimodal_checkpoint(tmp_path):
    """The bf16 multimodal checkpoint as transformers saves it (packed experts under model.language_model.,
    vision tower beside): float32 parity with transformers."""
    src = _multimodal_moe()
    src.save_pretrained(tmp_path / "m")
    m = greedy_parity(tmp_path / "m", src, jnp.float32, 1e-4)
    # 5 sliding layers x 8 experts [hidden 128, intermediate 64 zero-padded to 128 lanes (loader.lane_widths)]
    assert m.params["layers"]["sliding"]["experts_gate"].shape == (5, 8, 128, 128)
    assert m.params["layers"]["full"]["down"].shape == (2, 256, 128)  # the dense MLP: 224 -> 256


@pytest.mark.parametrize("field,value,reason", [
    ("hidden_size_per_layer_input", 64, "per-layer input embeddings (Gemma 4 E2B/E4B)"),
    ("num_kv_shared_layers", 1, "KV sharing across layers (Gemma 4 E2B/E4B)")])
def test_inspect_refuses_e2b_e4b_features_with_the_reason(field, value, reason, tmp_path):
    torch.manual_seed(0)
    T.Gemma4ForCausalLM(gemma4_config(**{field: value})).save_pretrained(tmp_path / "m")
    r = inspect_checkpoint(tmp_path / "m")
    assert r["exit_code"] == 3 and not r["servable"]
    assert [p["message"] for p in r["problems"] if p["severity"] == "unsupported"] == [
        f"Gemma 4 with {reason} is not supported (the 31B dense and 26B-A4B MoE models are)"]
