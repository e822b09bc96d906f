"""quantization_config parsing and module matching, checked against the compressed-tensors library."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES, preset_name_to_scheme
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from quantkit.errors import InvalidInput, QuantkitError
from quantkit.formats.compressed_tensors import PRESETS, STRATEGIES, parse_quantization_config, weight_qtype
from quantkit.formats.ct_tensors import check_module_tensors
from quantkit.formats.ct_writer import GROUPED, SCHEMES, writable_config
from quantkit.runtime.validate import config_findings, kv_scheme_reason, unsupported_reason
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


@pytest.mark.parametrize("name,group", [(s, g) for s in SCHEMES if s != "DENSE" for g in
                                        ((32, -1) if s in GROUPED else (0,))])
def test_writable_schemes_are_the_library_presets(name, group):
    """What convert writes and plan --scheme plans for each --scheme is the library's preset (W4A16 and W8A16
    with --group-size), and the library accepts the config it serializes to."""
    qc = writable_config(name, group, ["lm_head"])
    lib = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    want = preset_name_to_scheme(name if name in PRESET_SCHEMES else name.removesuffix("_ASYM"), ["Linear"])
    if name.endswith("_ASYM"):  # W8A16_ASYM: the W8A16 preset with zero points
        want.weights = want.weights.model_copy(update={"symmetric": False})
    if group:
        want.weights = want.weights.model_copy(update={"group_size": group,
                                                       "strategy": "channel" if group == -1 else "group"})
    ours = parse_quantization_config(qc).groups[0]
    for field in ("weights", "input_activations", "output_activations"):
        assert _our_args(getattr(ours, field)) == _lib_args(getattr(want, field)) == _lib_args(getattr(lib, field))
    assert ours.weights.scale_dtype == (str(want.weights.scale_dtype) if want.weights.scale_dtype else None)


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
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": None}}}},
     r"^quantization_config\.config_groups\.g\.weights\.num_bits: expected an integer, got null$"),
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"group_size": "x"}}}},
     r"\.weights\.group_size: expected an integer or null, got string 'x'$"),
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"strategy": 3}}}},
     r"\.weights\.strategy: expected a strategy name or null, got integer 3$"),
    ({"config_groups": {"g": {"targets": 5, "weights": {}}}},
     r"\.g\.targets: expected a list of strings, got integer 5"),
    ({"format": {}, "config_groups": {}}, r"^quantization_config\.format: expected a format name, got object \{\}$"),
    ({"config_groups": {}, "kv_cache_scheme": {"num_bits": 2**200}},
     r"kv_cache_scheme\.num_bits: .* integer of 201 bits"),
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


# ---- wrong types and values anywhere in quantization_config -------------------------------------------

def _base_config() -> dict:
    """A quantization_config with every kind of field: a W4A16 group, an FP8_BLOCK group (input activations),
    a preset shorthand group, ignore and an FP8 kv_cache_scheme."""
    qc = writable_config("W4A16", 128, ["lm_head"])
    qc["config_groups"]["group_1"] = {**writable_config("FP8_BLOCK", 128, [])["config_groups"]["group_0"],
                                      "targets": ["re:.*self_attn.*"]}
    qc["config_groups"]["W4A16"] = ["re:.*mlp\\.down_proj$"]
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
    return qc


def _key_paths(d: dict, prefix: tuple = ()) -> list[tuple]:
    """Every key of a nested dict, as a path of keys from the top."""
    out = []
    for k, v in d.items():
        out.append((*prefix, k))
        if isinstance(v, dict):
            out += _key_paths(v, (*prefix, k))
    return out


_JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
    st.sampled_from([-2, -1, 0, 1, 3, 4, 8, 16, 32, 33, 128, 2**31, 2**63]),
    st.text(max_size=6),
    st.sampled_from(["int", "float", "group", "channel", "tensor", "block", "token", "tensor_group", "attn_head",
                     "local", "weight", "static", "group", "128x128", "0x5", "re:(", "re:.*", "Linear", "W4A16",
                     "dense", "pack-quantized", "float-quantized", "mxfp4-pack-quantized", "nvfp4-pack-quantized",
                     "mixed-precision", "sparse-bitmask", "compressed", "torch.uint8"]),
    st.lists(st.one_of(st.integers(-3, 300), st.text(max_size=3), st.none()), max_size=3),
    st.dictionaries(st.sampled_from(["num_bits", "targets", "weights", "strategy", "bogus"]),
                    st.one_of(st.integers(-1, 64), st.none(), st.just(["Linear"]), st.just("group")), max_size=2),
)

# Every tensor a Linear [256, 512] may carry, so that each format's checks find something to read.
_PARAMS = {p: TensorInfo(p, dtype, shape, None, 0, 0) for p, dtype, shape in [
    ("weight_packed", "I32", (256, 64)), ("weight_scale", "BF16", (256, 4)), ("weight_shape", "I64", (2,)),
    ("weight", "F8_E4M3", (256, 512)), ("weight_zero_point", "I32", (32, 4)), ("weight_g_idx", "I32", (512,)),
    ("weight_global_scale", "F32", (1,)), ("input_scale", "F32", (1,)),
]}


def _assert_valid_args(a) -> None:
    assert isinstance(a.num_bits, int) and 1 <= a.num_bits <= 32 and a.type in ("int", "float")
    assert a.strategy in STRATEGIES and isinstance(a.symmetric, bool) and a.dynamic in (True, False, "local")
    assert a.group_size is None or (isinstance(a.group_size, int) and a.group_size >= -1)
    if a.strategy in ("group", "tensor_group"):
        assert a.group_size > 0
    assert (a.strategy == "block") == (a.block_structure is not None)
    assert a.block_structure is None or all(isinstance(b, int) and b > 0 for b in a.block_structure)
    assert a.actorder in (None, "weight", "group") and (a.scale_dtype is None or isinstance(a.scale_dtype, str))


def _parses_or_names_the_field(qc: dict) -> None:
    """`qc` parses into valid schemes that every reader of schemes takes, or raises one InvalidInput line
    naming the field; anything else (TypeError, KeyError, ...) propagates and fails the calling test."""
    raw = copy.deepcopy(qc)
    try:
        parsed = parse_quantization_config(qc)
    except QuantkitError as e:
        assert isinstance(e, InvalidInput) and "\n" not in str(e) and str(e).startswith("quantization_config")
        return
    assert qc == raw  # parsing does not modify its input
    for scheme in parsed.groups:
        assert all(isinstance(t, str) for t in scheme.targets) and isinstance(scheme.format, str)
        for args in (scheme.weights, scheme.input_activations, scheme.output_activations):
            if args is not None:
                _assert_valid_args(args)
                assert isinstance(args.as_json(), dict)
        unsupported_reason(scheme)
        weight_qtype(scheme)
        check_module_tensors("model.layers.0.mlp.down_proj", scheme, _PARAMS)
    parsed.scheme_for("model.layers.0.mlp.down_proj", "Linear")
    if parsed.kv_cache_scheme is not None:
        _assert_valid_args(parsed.kv_cache_scheme)
        kv_scheme_reason(parsed.kv_cache_scheme)
    config_findings(qc, parsed)


def _mutate(qc: dict, path: tuple, value) -> None:
    parent = qc
    for k in path[:-1]:
        parent = parent[k]
    if value is _DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value


_DELETE = object()
# One value of each JSON kind, and the edge numbers: every key of the base config gets each in turn.
_EACH_KIND = [_DELETE, None, True, False, 0, -1, -2, 2**64, 1.5, "", "x", [], [0, 0], ["Linear"], {}, {"x": 1}]


def test_every_key_retyped_parses_or_names_the_field():
    base = _base_config()
    assert parse_quantization_config(base).kv_cache_scheme is not None  # the base is valid
    for path in _key_paths(base):
        for value in _EACH_KIND:
            qc = copy.deepcopy(base)
            _mutate(qc, path, value)
            _parses_or_names_the_field(qc)


@settings(max_examples=1500, deadline=None)
@given(data=st.data())
def test_mutated_quantization_config_parses_or_names_the_field(data):
    """Delete or retype up to three keys anywhere in quantization_config, its groups and their arguments."""
    qc = _base_config()
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_key_paths(qc)))
        _mutate(qc, path, _DELETE if data.draw(st.booleans()) else data.draw(_JSON_VALUES))
    _parses_or_names_the_field(qc)


def _checkpoint(path, qc: dict):
    """A directory that `inspect` and the loader open: config.json with `qc`, one small shard."""
    path.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "quantization_config": qc}
    (path / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": np.zeros((8, 4), np.float32)}, str(path / "model.safetensors"))
    return path


def _w4a16_with(where: str, key: str, value) -> dict:
    qc = writable_config("W4A16", 128, ["lm_head"])
    group = qc["config_groups"]["group_0"]
    {"config": qc, "group": group, "weights": group["weights"]}[where][key] = value
    return qc


@pytest.mark.parametrize("where,key,value,field", [
    ("weights", "num_bits", None, "config_groups.group_0.weights.num_bits: expected an integer, got null"),
    ("group", "targets", 5, "config_groups.group_0.targets: expected a list of strings, got integer 5"),
    ("config", "format", {}, "quantization_config.format: expected a format name, got object {}"),
])
def test_cli_inspect_names_the_bad_field_in_one_line(tmp_path, where, key, value, field):
    path = _checkpoint(tmp_path / "ckpt", _w4a16_with(where, key, value))
    p = subprocess.run([sys.executable, "-m", "quantkit.cli", "inspect", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == InvalidInput.exit_code == 1, p.stderr
    assert p.stdout == "" and "Traceback" not in p.stderr
    (line,) = p.stderr.splitlines()
    assert line.startswith(f"error: {path / 'config.json'}: quantization_config") and field in line, line


def test_loader_validates_without_the_inspect_command(tmp_path, monkeypatch):
    """The runtime validates through quantkit.runtime.validate, never by importing the `inspect` command module."""
    from quantkit.runtime.loader import load

    path = _checkpoint(tmp_path / "ckpt", _w4a16_with("weights", "num_bits", None))
    monkeypatch.delitem(sys.modules, "quantkit.inspect", raising=False)
    with pytest.raises(InvalidInput, match=r"weights\.num_bits: expected an integer, got null"):
        load(path)
    assert "quantkit.inspect" not in sys.modules


def test_docs_preset_table_is_what_quantkit_says(capsys):
    """docs/formats.md's table of every preset per chip is scripts/scheme_table.py's output as the code is now:
    serving a new scheme without regenerating it fails here."""
    import runpy

    root = Path(__file__).resolve().parents[1]
    runpy.run_path(str(root / "scripts" / "scheme_table.py"), run_name="__main__")
    table = capsys.readouterr().out.strip().splitlines()
    docs = (root / "docs" / "formats.md").read_text().splitlines()
    assert len(table) > 30 and all(line in docs for line in table), [line for line in table if line not in docs]
