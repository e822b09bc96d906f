"""quantization_config parsing and module matching, checked against the compressed-tensors library."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES, preset_name_to_scheme

from quantkit.errors import InvalidInput
from quantkit.formats.compressed_tensors import PRESETS, parse_quantization_config
from quantkit.formats.hf import classify_module, group_modules
from quantkit.formats.safetensors_io import TensorInfo

from ct_oracle import tiny_llama


def _lib_args(a):
    if a is None:
        return None
    d = a.model_dump() if hasattr(a, "model_dump") else dict(a)
    return (d["num_bits"], str(d["type"]), d["symmetric"], d["group_size"], str(d["strategy"]),
            tuple(d["block_structure"]) if d.get("block_structure") else None,
            d["dynamic"] if isinstance(d["dynamic"], bool) else str(d["dynamic"]))


def _our_args(a):
    if a is None:
        return None
    return (a.num_bits, a.type, a.symmetric, a.group_size, a.strategy, a.block_structure, a.dynamic)


def test_preset_table_covers_the_library():
    assert set(PRESETS) == set(PRESET_SCHEMES)


@pytest.mark.parametrize("name", sorted(PRESET_SCHEMES))
def test_preset_shorthand_expands_like_the_library(name):
    lib = preset_name_to_scheme(name, ["Linear"])
    ours = parse_quantization_config({"format": "pack-quantized", "config_groups": {name: ["Linear"]}}).groups[0]
    for field in ("weights", "input_activations", "output_activations"):
        assert _our_args(getattr(ours, field)) == _lib_args(getattr(lib, field)), field
    assert ours.targets == ("Linear",)


CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mixed-precision",
    "config_groups": {
        "g_all": {"targets": ["Linear"], "format": "pack-quantized",
                  "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}},
        "g_attn": {"targets": ["re:.*self_attn\\.(q|k)_proj$"], "format": "float-quantized",
                   "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}},
        "g_exact": {"targets": ["model.layers.1.mlp.up_proj", "re:.*o_proj"], "format": "pack-quantized",
                    "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}},
        "g_regex2": {"targets": ["re:.*layers\\.0\\..*"], "format": "float-quantized",
                     "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
    },
    "ignore": ["lm_head", "re:.*layers\\.1\\.self_attn\\.v_proj"],
}


def test_matching_agrees_with_apply_quantization_config():
    """Exact names beat regexes beat class names; ignore wins; as the library decides."""
    model = tiny_llama(0, layers=2)
    lib_cfg = QuantizationConfig.model_validate(CONFIG)
    apply_quantization_config(model, lib_cfg)
    ours = parse_quantization_config(CONFIG)
    checked = 0
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        lib_scheme = getattr(module, "quantization_scheme", None)
        cls = "Linear" if isinstance(module, torch.nn.Linear) else "Embedding"
        our_scheme = ours.scheme_for(name, cls)
        if lib_scheme is None:
            assert our_scheme is None, name
        else:
            assert our_scheme is not None, name
            assert _our_args(our_scheme.weights) == _lib_args(lib_scheme.weights), name
            checked += 1
    assert checked >= 10


def test_mixed_precision_group_without_format_is_invalid():
    bad = {"format": "mixed-precision", "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4}}}}
    with pytest.raises(InvalidInput, match="needs its own 'format'"):
        parse_quantization_config(bad)


@pytest.mark.parametrize("bad,expect", [
    ({"config_groups": []}, "config_groups"),
    ({"config_groups": {"NOPE": ["Linear"]}}, "not a preset"),
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "bogus": 1}}}}, "unknown key"),
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": "4"}}}}, "num_bits"),
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"strategy": "group"}}}}, "positive group_size"),
    ({"config_groups": {"g": {"targets": ["re:("], "weights": {}}}}, "invalid regex"),
    ({"config_groups": {"g": {"targets": "Linear", "weights": {}}}}, "list of strings"),
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"strategy": "block"}}}}, "block_structure"),
])
def test_bad_configs_raise_invalid_input(bad, expect):
    with pytest.raises(InvalidInput, match=expect):
        parse_quantization_config(bad)


def test_legacy_actorder_group_is_parsed_not_rejected():
    qc = parse_quantization_config({"format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 128, "actorder": "group"}}}})
    assert qc.groups[0].weights.actorder == "group"


def _info(name, shape, dtype="BF16"):
    return TensorInfo(name, dtype, tuple(shape), None, 0, 0)


def test_module_kinds_from_tensor_names():
    names = {
        "model.embed_tokens.weight": (512, 64), "model.norm.weight": (64,),
        "model.layers.0.self_attn.q_proj.weight_packed": (64, 8),
        "model.layers.0.mlp.experts.3.down_proj.weight": (64, 128),
        "model.layers.0.mlp.experts.gate_up_proj": (8, 256, 64),
        "model.layers.0.mlp.gate.weight": (8, 64), "lm_head.weight": (512, 64),
        "vision.patch_embed.proj.weight": (64, 3, 14, 14),
    }
    modules = group_modules(names)
    kinds = {m: classify_module(m, {p: _info(n, names[n]) for p, n in ps.items()})[0] for m, ps in modules.items()}
    assert kinds == {
        "model.embed_tokens": "embedding", "model.norm": "norm", "model.layers.0.self_attn.q_proj": "linear",
        "model.layers.0.mlp.experts.3.down_proj": "moe_experts",
        "model.layers.0.mlp.experts.gate_up_proj": "moe_experts", "model.layers.0.mlp.gate": "linear",
        "lm_head": "linear", "vision.patch_embed.proj": "other",
    }
