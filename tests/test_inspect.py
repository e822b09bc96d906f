"""`inspect` on checkpoints made by the compressed-tensors library, and on broken ones.

Classification and exit codes per scheme; bit-exact dequantization against the library's own
decompressor; structural and --deep errors on checkpoints mutated after the library wrote them.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import jax.numpy as jnp
import pytest
import torch
from safetensors.torch import load_file, save_file

from ct_oracle import EXPECTED_FORMAT, SCHEMES, library_decompress_torch, make_checkpoint
from quantkit.formats.compressed_tensors import parse_quantization_config
from quantkit.formats.ct_tensors import dequantize
from quantkit.formats.hf import Checkpoint, classify_module, group_modules
from quantkit.inspect import inspect_checkpoint

SERVABLE = ["W4A16", "W4A16_G32", "W4A16_CHANNEL", "W4A16_ASYM", "W8A16", "W8A16_INT", "W8A16_ASYM", "W3A16",
            "W6A16", "W4AFP8", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "MXFP4A16", "MXFP6A16", "MXFP8A16", "NVFP4A16",
            "MIXED", "W8A8", "W4A8", "NVFP4"]
UNSUPPORTED = {"W4A4": "int4 token input activation"}  # int4 activations: not served
QUANTKIT = [sys.executable, "-m", "quantkit.cli"]


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {s: make_checkpoint(root / s, s) for s in (*SCHEMES, "W8A8", "W4A8", "NVFP4", *UNSUPPORTED)}


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, fn) -> None:
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, fn) -> None:
    f = path / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


@pytest.mark.parametrize("scheme", SERVABLE)
def test_servable_schemes(ckpts, scheme):
    r = inspect_checkpoint(ckpts[scheme], "v6e")
    assert r["exit_code"] == 0 and r["servable"], r["problems"]
    assert r["format"] == EXPECTED_FORMAT[scheme] and r["architecture"] == "LlamaForCausalLM"
    quantized = [layer for layer in r["layers"] if layer["scheme"] is not None]
    assert len(quantized) == 14  # 2 layers x (q, k, v, o, gate, up, down); lm_head ignored
    assert {layer["path"] for layer in quantized} == {"gmm_v2"}
    lm_head = next(layer for layer in r["layers"] if layer["name"] == "lm_head")
    assert lm_head["path"] == "dense" and lm_head["scheme"] is None
    assert {layer["kind"] for layer in r["layers"]} == {"linear", "embedding", "norm"}
    cpu = inspect_checkpoint(ckpts[scheme], "cpu")
    assert {layer["path"] for layer in cpu["layers"] if layer["scheme"]} == {"xla"}


INT8_ROWS = (("v5e", "int8 x int8 on the MXU"), ("v6e", "int8 x int8 on the MXU"),
             ("v7x", "int8 activations emulated exactly in bf16 (v7x has no int8 MXU)"))
FP8_ROWS = (("v5e", "fp8 activations multiplied exactly in bf16 (v5e multiplies fp8 at the bf16 rate)"),
            ("v6e", "fp8 activations multiplied exactly in bf16 (v6e multiplies fp8 at the bf16 rate)"),
            ("v7x", "fp8 x fp8 on the MXU"))
BLOCK_ROWS = tuple((c, why.replace("fp8 activations", "fp8 activations (a scale per 128 inputs)") if c != "v7x" else
                    why + " (a scale per 128 inputs)") for c, why in FP8_ROWS)


def test_8bit_activation_schemes_say_how_each_chip_multiplies(ckpts):
    """W8A8 and W4A8 are served on gmm_v2 with int8 rows: on the int8 MXU of a v5e/v6e, emulated on a v7x;
    FP8_DYNAMIC and W4AFP8 with fp8 rows: on the fp8 MXU of a v7x, exactly in bf16 elsewhere; FP8_BLOCK's fp8
    rows with a scale per 128 inputs likewise."""
    for scheme, rows in (("W8A8", INT8_ROWS), ("W4A8", INT8_ROWS), ("FP8_DYNAMIC", FP8_ROWS), ("W4AFP8", FP8_ROWS),
                         ("FP8_BLOCK", BLOCK_ROWS)):
        for target, says in rows:
            q = [la for la in inspect_checkpoint(ckpts[scheme], target)["layers"] if la["scheme"]]
            assert len(q) == 14 and {la["path"] for la in q} == {"gmm_v2"}, (scheme, target)
            assert {la["reason"] for la in q} == {says}, (scheme, target)


@pytest.mark.parametrize("scheme", sorted(UNSUPPORTED))
def test_unsupported_schemes_name_each_layer_and_reason(ckpts, scheme):
    r = inspect_checkpoint(ckpts[scheme], "v6e")
    assert r["exit_code"] == 3 and not r["servable"]
    bad = [layer for layer in r["layers"] if not layer["servable"]]
    assert len(bad) == 14 and all(UNSUPPORTED[scheme] in layer["reason"] for layer in bad)
    assert all(layer["path"] is None for layer in bad)
    assert sum(p["severity"] == "unsupported" for p in r["problems"]) == 14


_ACTS = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}


@pytest.mark.parametrize("edit,expect,code", [
    ({"input_activations": {**_ACTS, "strategy": "tensor", "dynamic": False}},
     "int8 tensor input activation quantization with static scales (they need calibration)", 1),
    ({"input_activations": {**_ACTS, "symmetric": False}}, "int8 token input activation quantization with zero points",
     3),
    ({"output_activations": _ACTS}, "output activation quantization (int8 token) is not supported", 3),
    ({"input_activations": {**_ACTS, "type": "float", "strategy": "group", "group_size": 512}},
     "input activations quantized in groups of 512, which do not divide the 256 inputs", 3),
])
def test_activation_schemes_the_runtime_cannot_serve_name_each_layer(ckpts, tmp_path, edit, expect, code):
    """W8A8's layers refused, each by name and reason, when its activations are static (without the scales
    that needs: also an error per layer, exit 1), asymmetric, on the outputs, or in groups that do not divide
    a layer's inputs (the layers whose inputs they do divide stay servable)."""
    path = _copy(ckpts["W8A8"], tmp_path)
    _edit_config(path, lambda qc: qc["config_groups"]["group_0"].update(edit))
    r = inspect_checkpoint(path, "v6e")
    assert r["exit_code"] == code and not r["servable"]
    bad = {la["name"]: la["reason"] for la in r["layers"] if not la["servable"]}
    assert len(bad) == (12 if "512" in expect else 14) and all(expect in why for why in bad.values()), bad
    assert {p["where"] for p in r["problems"] if p["severity"] == "unsupported"} == set(bad)
    if code == 1:
        assert {p["where"] for p in r["problems"] if "missing tensor" in p["message"]} == set(bad)


def test_scheme_fields_in_json(ckpts):
    layers = {la["name"]: la for la in inspect_checkpoint(ckpts["MIXED"])["layers"]}
    assert layers["model.layers.0.mlp.down_proj"]["scheme"] == {
        "type": "int", "num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": True,
        "dynamic": False, "actorder": None}
    assert layers["model.layers.0.mlp.down_proj"]["format"] == "pack-quantized"
    assert layers["model.layers.0.self_attn.q_proj"]["scheme"]["type"] == "float"
    assert layers["model.layers.0.self_attn.q_proj"]["format"] == "float-quantized"
    assert layers["model.layers.0.mlp.down_proj"]["shape"] == [256, 512]


@pytest.mark.parametrize("scheme", SERVABLE)
def test_dequantize_equals_library_bit_for_bit(ckpts, scheme):
    path = ckpts[scheme]
    lib = library_decompress_torch(path)
    ck = Checkpoint.open(path)
    qc = parse_quantization_config(ck.config["quantization_config"])
    n = 0
    for module, pnames in group_modules(ck.tensors).items():
        params = {p: ck.tensors[t] for p, t in pnames.items()}
        kind, cls = classify_module(module, params)
        scheme_ = qc.scheme_for(module, cls)
        if scheme_ is None:
            continue
        shape = tuple(int(x) for x in ck.read(pnames["weight_shape"])) if "weight_shape" in pnames else \
            lib[module + ".weight"].shape
        ours = dequantize(scheme_, {p: ck.read(t) for p, t in pnames.items()}, tuple(shape))
        theirs = lib[module + ".weight"]
        ours_t = torch.from_numpy(np.ascontiguousarray(ours)).to(theirs.dtype)
        assert ours_t.shape == theirs.shape
        assert torch.equal(ours_t.view(torch.int16), theirs.view(torch.int16)), module
        n += 1
    assert n == 14


def test_hbm_bytes_of_one_int4_layer(ckpts):
    """down_proj [out=256, in=512] int4 g128, bf16 scales, runtime layout [in, out] and [groups, out]."""
    for target, expect in [("cpu", 512 * 256 // 2 + 4 * 256 * 2),
                           # TPU tiles: int4 rows pad to 64 (512 ok); the 4 scale rows pad to 16 for bf16.
                           ("v6e", 512 * 256 // 2 + 16 * 256 * 2)]:
        layers = {la["name"]: la for la in inspect_checkpoint(ckpts["W4A16"], target)["layers"]}
        assert layers["model.layers.0.mlp.down_proj"]["hbm_bytes"] == expect
    r = inspect_checkpoint(ckpts["W4A16"], "cpu")
    assert r["bits_per_weight"] == pytest.approx(4 + 16 / 128, abs=0.02)
    assert r["bytes_on_disk"] == (ckpts["W4A16"] / "model.safetensors").stat().st_size


def test_hbm_bytes_of_zero_points_are_what_the_loader_places(ckpts):
    """W4A16_ASYM down_proj: zero points stored packed 8 to an int32 along the rows ([32, 4]) are served as one
    int8 per group and column ([4, 256], padded to 32 rows on a TPU), beside the scales; inspect's CPU bytes
    are the loaded QTensor's."""
    from quantkit.runtime.loader import load

    for target, expect in [("cpu", 512 * 256 // 2 + 4 * 256 * 2 + 4 * 256),
                           ("v6e", 512 * 256 // 2 + 16 * 256 * 2 + 32 * 256)]:
        layers = {la["name"]: la for la in inspect_checkpoint(ckpts["W4A16_ASYM"], target)["layers"]}
        assert layers["model.layers.0.mlp.down_proj"]["hbm_bytes"] == expect, target
    down = load(ckpts["W4A16_ASYM"]).params["layers"]["full"]["down"]  # both layers stacked
    assert down.zeros.dtype == jnp.int8 and down.nbytes() == 2 * (512 * 256 // 2 + 4 * 256 * 2 + 4 * 256)
    assert inspect_checkpoint(ckpts["W4A16_ASYM"], "cpu")["bits_per_weight"] == pytest.approx(4 + 16 / 128 + 4 / 128,
                                                                                             abs=0.02)


def test_actorder_group_is_served_and_a_bad_g_idx_refused_naming_it(tmp_path):
    """An activation-ordered checkpoint (g_idx scattering whole groups) is valid and served on gmm_v2 with its
    int32 row order counted in HBM; a g_idx that is not a permutation of whole groups, or out of range, is an
    error of `inspect --deep` and of the loader naming the tensor."""
    from ct_oracle import make_actorder_checkpoint
    from quantkit.errors import InvalidInput
    from quantkit.runtime.loader import load

    path, _ = make_actorder_checkpoint(tmp_path / "ao")
    r = inspect_checkpoint(path, "v6e", deep=True)
    assert r["exit_code"] == 0 and r["servable"], r["problems"]
    q = [la for la in r["layers"] if la["scheme"] is not None]
    assert len(q) == 14 and {la["path"] for la in q} == {"gmm_v2"} and all(la["scheme"]["actorder"] == "group" for la in q)
    down = "model.layers.1.mlp.down_proj.weight_g_idx"
    for value, expect in ((lambda g: g.clamp(max=0) + torch.arange(512, dtype=torch.int32) % 3, "not a permutation of whole groups"),
                          (lambda g: g + 16, "out of range")):
        bad = _copy(path, tmp_path / f"bad-{expect[:3]}")
        _edit_tensors(bad, lambda t: t.update({down: value(t[down]).to(torch.int32)}))
        r = inspect_checkpoint(bad, deep=True)
        assert r["exit_code"] == 1 and any(p["where"] == down and expect in p["message"] for p in r["problems"])
        with pytest.raises(InvalidInput, match=re.escape(down) + ".*" + expect):
            load(bad)


@pytest.mark.parametrize("edit,expect", [
    (lambda qc: qc["config_groups"]["group_0"].update(
        input_activations={"num_bits": 4, "type": "int", "strategy": "token", "dynamic": True}), "activation"),
    (lambda qc: qc.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparse"),
    (lambda qc: (qc.update(format="sparse-bitmask"), qc["config_groups"]["group_0"].update(format="sparse-bitmask")),
     "sparse format"),
    (lambda qc: qc.update(transform_config={"config_groups": {"u": {"type": "hadamard", "apply": [
        {"targets": ["Linear"], "location": "output"}]}}}), "hadamard transform at location 'output' is not supported"),
    (lambda qc: qc.update(transform_config={"config_groups": {"r": {"type": "random-matrix", "apply": [
        {"targets": ["Linear"], "location": "input"}]}}}), "online input transforms must be hadamard or random-hadamard"),
    (lambda qc: qc.update(quant_method="gptq"), "not compressed-tensors"),
])
def test_config_level_unsupported(ckpts, tmp_path, edit, expect):
    path = _copy(ckpts["W4A16"], tmp_path)
    _edit_config(path, edit)
    r = inspect_checkpoint(path)
    assert r["exit_code"] == 3
    assert any(expect in p["message"] for p in r["problems"] if p["severity"] == "unsupported")


def test_online_input_transforms_are_servable_and_their_matrices_checked(tmp_path):
    """A checkpoint rotated by the library (an online hadamard at every Linear's input, its inverse in the
    weights) is served on gmm_v2, the matrices' own modules not taken for layers; without the stored matrix of
    a size, each layer that needs it is an error by name; a matrix that is not +-1 is refused at load."""
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme, apply_transform_config

    from ct_oracle import tiny_llama
    from quantkit.errors import InvalidInput
    from quantkit.runtime.loader import load

    rotated = tiny_llama(0)
    apply_transform_config(rotated, TransformConfig(config_groups={"v": TransformScheme(type="hadamard", apply=[
        TransformArgs(targets=["Linear"], location="input", ignore=["lm_head"]),
        TransformArgs(targets=["Linear"], location="weight_input", inverse=True, ignore=["lm_head"])])}))
    path = make_checkpoint(tmp_path / "q", "W4A16", model=rotated)
    r = inspect_checkpoint(path, "v6e")
    assert r["exit_code"] == 0 and r["servable"], r["problems"]
    q = [la for la in r["layers"] if la["scheme"] is not None]
    assert len(q) == 14 and {la["path"] for la in q} == {"gmm_v2"} and len(r["layers"]) == 14 + 1 + 1 + 5
    assert {la["name"]: la["reason"] for la in q}["model.layers.1.mlp.down_proj"] == \
        "inputs rotated online by hadamard 'v' of size 512"
    matrix = "model.layers.0.mlp.down_proj.v_input.weight"  # the one 512 x 512 matrix, shared by both down_proj
    missing = _copy(path, tmp_path / "missing")
    _edit_tensors(missing, lambda t: t.pop(matrix))
    r = inspect_checkpoint(missing, "v6e")
    assert r["exit_code"] == 1
    assert {p["where"] for p in r["problems"] if "no v_input transform matrix of size 512" in p["message"]} == {
        f"model.layers.{i}.mlp.down_proj" for i in (0, 1)}
    odd = _copy(path, tmp_path / "odd")
    _edit_tensors(odd, lambda t: t[matrix].__setitem__((3, 4), 0.5))
    with pytest.raises(InvalidInput, match=re.escape(matrix) + ": a hadamard transform matrix must hold only"):
        load(odd)


def test_odd_bit_ints_of_the_old_packing_are_refused(ckpts, tmp_path):
    """3-bit values are read in compressed-tensors' layout since 0.18 (across int32 words); the same bytes under
    an older version's config would be read wrong, so they are refused with the reason (2-bit ones are not:
    16 to a word in both layouts)."""
    path = _copy(ckpts["W3A16"], tmp_path)
    assert inspect_checkpoint(path)["exit_code"] == 0
    _edit_config(path, lambda qc: qc.update(version="0.17.1"))
    r = inspect_checkpoint(path)
    assert r["exit_code"] == 3 and any("int3 weights packed by compressed-tensors 0.17.1" in p["message"]
                                       for p in r["problems"] if p["severity"] == "unsupported")


@pytest.mark.parametrize("scheme,edit,expect", [
    ("W4A16", lambda t: t.update({"model.layers.0.mlp.down_proj.weight_scale": torch.ones(256, 3, dtype=torch.bfloat16)}),
     "model.layers.0.mlp.down_proj.weight_scale: shape [256, 3], expected [256, 4]"),
    ("W4A16", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight_packed"),
     "missing tensor model.layers.1.self_attn.k_proj.weight_packed"),
    ("W4A16", lambda t: t.update({"model.layers.0.mlp.up_proj.weight_packed":
                                  t["model.layers.0.mlp.up_proj.weight_packed"].to(torch.int64)}),
     "weight_packed: dtype I64, expected I32"),
    ("FP8_DYNAMIC", lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale": torch.ones(1, dtype=torch.bfloat16)}),
     "expected [512, 1]"),
    ("FP8_BLOCK", lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale": torch.ones(4, 4, dtype=torch.bfloat16)}),
     "expected [4, 2]"),
    ("MXFP4A16", lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale": torch.ones(512, 4, dtype=torch.uint8)}),
     "expected [512, 8]"),
    ("FP8", lambda t: t.pop("model.layers.0.self_attn.q_proj.input_scale"), "missing tensor"),
    ("NVFP4", lambda t: t.pop("model.layers.1.mlp.up_proj.input_global_scale"),
     "missing tensor model.layers.1.mlp.up_proj.input_global_scale"),
    # tensors a symmetric / un-reordered scheme would ignore: serving without them would be wrong
    ("W8A16", lambda t: t.update({"model.layers.0.mlp.up_proj.weight_zero_point": torch.zeros(128, 4, dtype=torch.int32)}),
     "model.layers.0.mlp.up_proj.weight_zero_point: present, but the scheme is symmetric"),
    ("W4A16", lambda t: t.update({"model.layers.1.mlp.down_proj.weight_g_idx": torch.zeros(512, dtype=torch.int32)}),
     "model.layers.1.mlp.down_proj.weight_g_idx: present, but the scheme's actorder is None"),
    # zero points: packed 8 (int4) or 4 (int8) rows to an int32 word, one column per scale group
    ("W4A16_ASYM", lambda t: t.pop("model.layers.0.mlp.up_proj.weight_zero_point"),
     "missing tensor model.layers.0.mlp.up_proj.weight_zero_point"),
    ("W8A16_ASYM", lambda t: t.update({"model.layers.0.mlp.down_proj.weight_zero_point": torch.zeros(32, 4, dtype=torch.int32)}),
     "model.layers.0.mlp.down_proj.weight_zero_point: shape [32, 4], expected [64, 4]"),
    ("W4A16_ASYM", lambda t: t.update({"model.layers.0.mlp.down_proj.weight_zero_point": torch.zeros(32, 4, dtype=torch.int8)}),
     "model.layers.0.mlp.down_proj.weight_zero_point: dtype I8, expected I32"),
    # nvfp4 global scales the library would reject (read by every validation, not only --deep)
    ("NVFP4A16", lambda t: t.update({"model.layers.1.mlp.down_proj.weight_global_scale": torch.zeros(1)}),
     "model.layers.1.mlp.down_proj.weight_global_scale is [0.0]: a global scale must be finite and > 0"),
    ("NVFP4A16", lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_global_scale": torch.tensor([float("nan")])}),
     "model.layers.0.self_attn.o_proj.weight_global_scale is [nan]"),
    ("NVFP4A16", lambda t: t.update({"model.layers.1.self_attn.v_proj.weight_global_scale":
                                     t["model.layers.1.self_attn.v_proj.weight_global_scale"] * 2}),
     "model.layers.1.self_attn.v_proj.weight_global_scale is [") ,
    ("NVFP4A16", lambda t: t.update({"model.layers.0.mlp.up_proj.weight_global_scale": torch.ones(2)}),
     "model.layers.0.mlp.up_proj.weight_global_scale: shape [2], expected [1]"),
])
def test_structural_errors_exit_1(ckpts, tmp_path, scheme, edit, expect):
    path = _copy(ckpts[scheme], tmp_path)
    _edit_tensors(path, edit)
    r = inspect_checkpoint(path)
    assert r["exit_code"] == 1 and not r["servable"]
    assert any(expect in p["message"] for p in r["problems"] if p["severity"] == "error"), r["problems"]
    if scheme == "NVFP4A16":  # the loader refuses it the same way, before placing anything
        from quantkit.errors import InvalidInput
        from quantkit.runtime.loader import load

        with pytest.raises(InvalidInput, match=re.escape(expect)):
            load(path)


@pytest.mark.parametrize("scheme,tensor,value,expect", [
    ("W4A16", "model.layers.0.mlp.down_proj.weight_scale", float("nan"), "NaN or Inf"),
    ("W4A16", "model.layers.0.mlp.down_proj.weight_scale", 0.0, "zero scale"),
    ("FP8_DYNAMIC", "model.layers.1.self_attn.o_proj.weight", float("nan"), "NaN or Inf"),
    ("W4A16", "model.norm.weight", float("inf"), "NaN or Inf"),
    ("W4A16", "model.layers.0.mlp.down_proj.weight_shape", 500, "weight_shape"),
    ("MXFP4A16", "model.layers.0.mlp.down_proj.weight_scale", 255, "NaN or Inf"),
])
def test_deep_finds_bad_values(ckpts, tmp_path, scheme, tensor, value, expect):
    path = _copy(ckpts[scheme], tmp_path)

    def poison(t):
        x = t[tensor].clone()
        x.view(-1)[-1] = value
        t[tensor] = x
    _edit_tensors(path, poison)
    assert inspect_checkpoint(path)["exit_code"] == 0  # headers alone cannot see it
    r = inspect_checkpoint(path, deep=True)
    assert r["exit_code"] == 1
    assert any(expect in p["message"] and p["severity"] == "error" for p in r["problems"]), r["problems"]


@pytest.mark.parametrize("scheme", SERVABLE)
def test_deep_passes_clean_checkpoints(ckpts, scheme):
    r = inspect_checkpoint(ckpts[scheme], deep=True)
    assert r["exit_code"] == 0, r["problems"]


def test_single_file_and_sharded(ckpts, tmp_path):
    r = inspect_checkpoint(ckpts["W4A16"] / "model.safetensors")
    assert r["exit_code"] == 0 and r["format"] == "pack-quantized"  # config.json beside the file is used
    # Re-shard with an index: same verdicts.
    path = _copy(ckpts["W4A16"], tmp_path)
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, members in shards.items():
        save_file({n: tensors[n] for n in members}, path / fname, metadata={"format": "pt"})
    weight_map = {n: f for f, members in shards.items() for n in members}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    r2 = inspect_checkpoint(path)
    assert r2["num_files"] == 2 and r2["exit_code"] == 0
    strip = lambda r: [(la["name"], la["path"], la["hbm_bytes"]) for la in r["layers"]]  # noqa: E731
    assert sorted(strip(r2)) == sorted(strip(inspect_checkpoint(ckpts["W4A16"])))


# ---- the command line ---------------------------------------------------------------------------

def _run(*args):
    return subprocess.run([*QUANTKIT, *map(str, args)], capture_output=True, text=True, timeout=120)


def test_cli_json_contract(ckpts):
    p = _run("inspect", ckpts["W4A4"], "--json", "--target", "v5e")
    assert p.returncode == 3
    r = json.loads(p.stdout)
    for key in ("path", "architecture", "quant_method", "format", "version", "num_tensors", "bytes_on_disk",
                "servable", "target", "hbm_bytes_weights", "layers", "problems"):
        assert key in r
    assert r["target"] == "v5e" and r["quant_method"] == "compressed-tensors" and r["version"]
    for layer in r["layers"]:
        assert set(layer) >= {"name", "kind", "format", "scheme", "path", "servable", "reason"}
    for prob in r["problems"]:
        assert set(prob) == {"severity", "where", "message"}


def test_cli_human_output_and_exit_codes(ckpts, tmp_path):
    p = _run("inspect", ckpts["W4A16"])
    assert p.returncode == 0 and "gmm_v2" in p.stdout and "servable" in p.stdout
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    for args, code in [(("inspect", bad), 1), (("inspect", tmp_path / "nope"), 1), (("inspect", "--bogus"), 2),
                       (("inspect", ckpts["W4A16"], "--target", "tpu9"), 2)]:
        p = _run(*args)
        assert p.returncode == code, (args, p.stderr)
        assert "Traceback" not in p.stderr and p.stdout == ""
        if code == 1:
            assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("error: ")


def test_cli_help_example_runs_as_the_help_says(ckpts):
    """Runs the example of `inspect --help` on checkpoints of its scheme (the path substituted): the exit
    code is the one the help's "Exit codes:" sentence gives, and the flags shown take effect."""
    p = subprocess.run([*QUANTKIT, "inspect", "--help"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "200"})  # no wrapping of the example line
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    codes = {what: int(code) for code, what in re.findall(r"(\d) ([a-z ]+?)[,.]", text.split("Exit codes:")[1])}
    examples = [line.split("Example:", 1)[1].strip() for line in p.stdout.splitlines() if "Example:" in line]
    assert examples, p.stdout
    for example in examples:
        argv = shlex.split(example)
        assert argv[:2] == ["quantkit", "inspect"], example
        i = next(i for i in range(2, len(argv)) if not argv[i].startswith("-") and not argv[i - 1].startswith("-"))
        for scheme, verdict in ((max((s for s in SCHEMES if s in argv[i]), key=len, default="W4A16"),
                                 "valid and servable"), ("W4A4", "valid but not servable")):
            run = _run(*argv[1:i], ckpts[scheme], *argv[i + 1:])
            assert run.returncode == codes[verdict], (example, scheme, run.stderr)
            if "--json" in argv:
                r = json.loads(run.stdout)
                assert r["path"] == str(ckpts[scheme]) and r["servable"] == (verdict == "valid and servable")
                if "--target" in argv:
                    assert r["target"] == argv[argv.index("--target") + 1]


def _corrupt_scale(ckpts, tmp_path) -> Path:
    path = _copy(ckpts["W4A16"], tmp_path)
    _edit_tensors(path, lambda t: t.update(
        {"model.layers.0.mlp.down_proj.weight_scale": torch.ones(256, 3, dtype=torch.bfloat16)}))
    return path


@pytest.mark.parametrize("json_out", [False, True])
def test_cli_invalid_checkpoint_one_error_line_and_the_report(ckpts, tmp_path, json_out):
    path = _corrupt_scale(ckpts, tmp_path)
    p = _run("inspect", path, *(["--json"] if json_out else []))
    assert p.returncode == 1
    (line,) = p.stderr.splitlines()
    assert line.startswith(f"error: {path}: ") and "model.layers.0.mlp.down_proj.weight_scale" in line
    assert "shape [256, 3], expected [256, 4]" in line
    if json_out:
        r = json.loads(p.stdout)
        assert r["exit_code"] == 1 and r["problems"][0]["message"] in line
    else:
        assert "model.layers.0.mlp.down_proj.weight_scale: shape [256, 3]" in p.stdout and "invalid" in p.stdout


@pytest.mark.parametrize("json_out", [False, True])
def test_cli_unsupported_checkpoint_one_error_line_and_the_report(ckpts, json_out):
    p = _run("inspect", ckpts["W4A4"], *(["--json"] if json_out else []))
    assert p.returncode == 3
    (line,) = p.stderr.splitlines()
    assert line.startswith(f"error: {ckpts['W4A4']}: model.layers.0.mlp.down_proj: int4 token input activation")
    assert "(and 13 more problems" in line  # the other 13 quantized layers
    if json_out:
        r = json.loads(p.stdout)
        first = r["problems"][0]
        assert r["exit_code"] == 3 and f"{first['where']}: {first['message']}" in line
    else:
        assert "int4 token input activation" in p.stdout and "not servable" in p.stdout


def test_inspect_path_imports_no_heavy_library(ckpts):
    code = ("import sys; from quantkit.cli import main; sys.argv=['quantkit','inspect',sys.argv[1],'--json'];\n"
            "import atexit; atexit.register(lambda: print('HEAVY', [m for m in ('torch','jax','compressed_tensors',"
            "'transformers') if m in sys.modules], file=sys.stderr))\nmain()")
    p = subprocess.run([sys.executable, "-c", code, str(ckpts["W4A16"])], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in p.stderr, p.stderr


def test_architecture_the_runtime_lacks_is_unsupported(ckpts, tmp_path):
    path = _copy(ckpts["W4A16"], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    r = inspect_checkpoint(path)
    assert r["exit_code"] == 3
    assert any("'GPT2LMHeadModel' is not supported by the runtime; supported: LlamaForCausalLM" in p["message"]
               for p in r["problems"])


def test_opened_once_with_the_generation_eos(ckpts, tmp_path):
    """The one ModelConfig the checkpoint is served with stops on generation_config.json's ids (over
    config.json's); a malformed one is one line naming the file, for inspect as for the loader."""
    from quantkit.errors import InvalidInput
    from quantkit.runtime.validate import validate_checkpoint

    path = _copy(ckpts["W4A16"], tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    checked = validate_checkpoint(Checkpoint.open(path))
    assert checked.cfg.eos_token_ids == (5, 7) and checked.qc.groups[0].weights.group_size == 128
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(InvalidInput, match="generation_config.json: eos_token_id must be a token id"):
        inspect_checkpoint(path)


@pytest.mark.parametrize("name,scheme,group", [("llama", "W4A16_ASYM", 32), ("gemma4_moe", "W4A16", -1),
                                               ("qwen3_5_moe", "W4A16", 32), ("qwen3_moe", "MXFP4A16", 32),
                                               ("gemma3", "FP8_BLOCK", 0)])
def test_inspect_reports_the_path_plan_compiles(name, scheme, group, tmp_path):
    """For every quantized weight of a converted tiny model, the path `inspect --target v6e` reports is the
    one the runtime takes in the step `plan` compiles: gmm_v2 exactly where the kernel accepts the weight as
    the abstract pytree holds it (lane-padded, stacked, one layer's groups per call), else the XLA path.
    The widths make both happen: 64-wide experts are padded to 128 lanes (gmm_v2), Qwen3.5's 96-wide shared
    expert is not (the loader pads only the routed and dense MLP widths: XLA), 64-wide k/v projections are
    XLA; inspect once padded every *_proj by its name and reported the shared expert on gmm_v2."""
    import torch

    from helpers import family
    from quantkit.convert import convert
    from quantkit.kernels.gmm_v2 import check_gmm_v2
    from quantkit.kernels.tiling import CHIPS
    from quantkit.quant.qtensor import QTensor
    from quantkit.runtime.models import from_hf
    from quantkit.runtime.layout import lane_widths, skeleton, slots
    from quantkit.runtime.loader import abstract

    torch.manual_seed(0)
    family(name).to(torch.bfloat16).save_pretrained(tmp_path / "dense")
    convert(tmp_path / "dense", tmp_path / "q", scheme, group)
    report = inspect_checkpoint(tmp_path / "q", target="v6e")
    reported = {layer["name"]: layer["path"] for layer in report["layers"] if layer["path"] in ("gmm_v2", "xla")}
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg, qc = from_hf(config), parse_quantization_config(config["quantization_config"])
    params, sk = abstract(cfg, qc), skeleton(cfg, lane_widths(cfg, qc))
    compiled = {}
    for kind, stack in params["layers"].items():
        for key, leaf in stack.items():
            if isinstance(leaf, QTensor):
                per_layer = slots(sk["layers"][kind][key])
                groups = len(per_layer[0].module) if per_layer[0].kind == "experts" else 1  # one layer's, per call
                tiles, _ = check_gmm_v2((256, leaf.shape[1]), leaf, CHIPS["v6e"], groups)
                modules = [m for s in per_layer for m in (s.module if s.kind == "experts" else (s.module,))]
                compiled |= dict.fromkeys(modules, "gmm_v2" if tiles else "xla")
    assert compiled
    assert reported == compiled
    experts = {p for m, p in compiled.items() if ".experts." in m}
    assert experts == ({"gmm_v2"} if "moe" in name else set())  # 64 wide, padded to 128
    shared = {p for m, p in compiled.items() if ".shared_expert." in m}
    assert shared == ({"xla"} if name == "qwen3_5_moe" else set())  # 96 wide, left unpadded
