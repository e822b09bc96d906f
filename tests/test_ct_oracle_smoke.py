"""Smoke tests for tests/ct_oracle.py: the checkpoints it builds with the
compressed-tensors library are real (right format, tensors, and they decompress
close to the original weights)."""

import json
import pathlib
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import ct_oracle  # noqa: E402
from ct_oracle import (  # noqa: E402
    EXPECTED_DECOMPRESSED_DTYPE,
    EXPECTED_DOWN_PROJ,
    EXPECTED_FORMAT,
    MIXED_GROUPS,
    SCHEMES,
)
from helpers import rel_err  # noqa: E402

# relative Frobenius error bound of the library's dequantized weight per scheme
REL_ERR = {
    "W4A16": 0.2,
    "W4A16_G32": 0.2,
    "W4A16_CHANNEL": 0.2,
    "W4A16_ASYM": 0.2,
    "W8A16": 0.02,
    "W8A16_INT": 0.02,
    "W8A16_ASYM": 0.02,
    "W3A16": 0.4,
    "W6A16": 0.05,
    "W4AFP8": 0.2,
    "FP8": 0.1,
    "FP8_DYNAMIC": 0.1,
    "FP8_BLOCK": 0.1,
    "MXFP4A16": 0.2,
    "MXFP6A16": 0.1,
    "MXFP8A16": 0.1,
    "NVFP4A16": 0.2,
    "MIXED": 0.2,  # mlp: 4-bit; attention (fp8) checked against 0.1 below
}

DOWN = "model.layers.0.mlp.down_proj"


@pytest.fixture(scope="module")
def original():
    return ct_oracle.original_weights(seed=0)


@pytest.fixture(scope="module")
def linear_modules():
    return ct_oracle.linear_names(ct_oracle.tiny_llama(0))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_checkpoint_is_real(scheme, tmp_path, original, linear_modules):
    path = ct_oracle.make_checkpoint(tmp_path / scheme, scheme)
    assert path == tmp_path / scheme
    assert (path / "model.safetensors").exists()

    # ---- config.json
    with open(path / "config.json") as f:
        config = json.load(f)
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == EXPECTED_FORMAT[scheme]
    assert qc["quantization_status"] == "compressed"
    assert qc["ignore"] == ["lm_head"]
    groups = qc["config_groups"]
    if scheme == "MIXED":
        assert len(groups) == 2
        by_target = {tuple(g["targets"]): g["format"] for g in groups.values()}
        assert by_target == {(t,): fmt for t, (_, fmt) in MIXED_GROUPS.items()}
    else:
        assert len(groups) == 1
        (group,) = groups.values()
        assert group["targets"] == ["Linear"]
        assert group["format"] == EXPECTED_FORMAT[scheme]

    # ---- tensors on disk
    tensors = ct_oracle.read_tensors(path)
    down = {
        k[len(DOWN) + 1 :]: (str(v.dtype).removeprefix("torch."), tuple(v.shape))
        for k, v in tensors.items()
        if k.startswith(DOWN + ".")
    }
    assert down == EXPECTED_DOWN_PROJ[scheme]
    if "weight_shape" in down:
        assert tensors[f"{DOWN}.weight_shape"].tolist() == [256, 512]
    # ignored / non-Linear tensors are stored unchanged in the model dtype
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert tensors[name].dtype == torch.bfloat16
    np.testing.assert_array_equal(tensors["lm_head.weight"].float().numpy(), original["lm_head.weight"])

    # ---- library decompression
    quantized = [n for n in linear_modules if n != "lm_head"]
    deq = ct_oracle.library_decompress(path)
    dtypes = ct_oracle.library_decompress_dtype(path)
    assert sorted(deq) == sorted(f"{n}.weight" for n in quantized)
    assert set(dtypes.values()) == {EXPECTED_DECOMPRESSED_DTYPE[scheme]}
    for name, w in deq.items():
        assert w.dtype == np.float32
        assert w.shape == original[name].shape
        # the float32 values are exactly the library's bf16 values
        back = torch.from_numpy(w).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(back, w)
        bound = REL_ERR[scheme]
        if scheme == "MIXED" and ".self_attn." in name:
            bound = 0.1
        err = rel_err(w, original[name])
        assert 0 < err < bound, (name, err)


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s not in ("FP8", "W8A16_INT", "W4AFP8")])
def test_convert_checkpoint_agrees(scheme, tmp_path):
    """The library's model-free dequantizer (convert_checkpoint +
    CompressedTensorsDequantizer, bf16 output) gives the same weights as
    library_decompress.  FP8 and int-quantized W8A16 are left out: in
    compressed-tensors 0.20.1 the dequantizer rejects FP8's static
    ``input_scale`` and int-quantized's ``weight_scale`` tensors as "residual
    quantization params"."""
    src = ct_oracle.make_checkpoint(tmp_path / "src", scheme)
    dst = ct_oracle.library_convert_dequantize(src, tmp_path / "dst")
    converted = ct_oracle.read_tensors(dst)
    ours = ct_oracle.library_decompress_torch(src)
    for name, w in ours.items():
        assert torch.equal(w.to(torch.bfloat16), converted[name]), name
    with open(dst / "config.json") as f:
        assert "quantization_config" not in json.load(f)


def test_checkpoints_are_deterministic(tmp_path):
    a = ct_oracle.read_tensors(ct_oracle.make_checkpoint(tmp_path / "a", "NVFP4A16", seed=3))
    b = ct_oracle.read_tensors(ct_oracle.make_checkpoint(tmp_path / "b", "NVFP4A16", seed=3))
    c = ct_oracle.read_tensors(ct_oracle.make_checkpoint(tmp_path / "c", "NVFP4A16", seed=4))
    assert a.keys() == b.keys()
    for k in a:  # compare raw bytes (torch.equal is not defined for every dtype)
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    assert not torch.equal(a[f"{DOWN}.weight_packed"], c[f"{DOWN}.weight_packed"])


def test_nvfp4_global_scales_fused(tmp_path):
    """llm-compressor convention reproduced by make_checkpoint: q/k/v and
    gate/up share one global scale (the minimum); without fusing each is
    448*6/absmax computed by the library IN THE WEIGHT DTYPE (bf16) and only then
    stored as float32, so it is a bf16-representable number."""
    fused = ct_oracle.read_tensors(ct_oracle.make_checkpoint(tmp_path / "f", "NVFP4A16"))
    plain = ct_oracle.read_tensors(
        ct_oracle.make_checkpoint(tmp_path / "p", "NVFP4A16", fuse_global_scales=False)
    )
    original = ct_oracle.original_weights(seed=0)
    attn = "model.layers.0.self_attn"
    g = [fused[f"{attn}.{p}_proj.weight_global_scale"] for p in "qkv"]
    assert g[0] == g[1] == g[2] == min(plain[f"{attn}.{p}_proj.weight_global_scale"] for p in "qkv")
    for p in ("q", "k", "v", "o"):
        name = f"{attn}.{p}_proj"
        absmax = torch.tensor(np.abs(original[f"{name}.weight"]).max()).to(torch.bfloat16)
        expect = (448.0 * 6.0 / absmax).to(torch.float32)  # bf16 arithmetic
        got = plain[f"{name}.weight_global_scale"]
        assert got.dtype == torch.float32 and got.shape == (1,)
        assert got.item() == expect.item()
    assert plain[f"{attn}.o_proj.weight_global_scale"] == fused[f"{attn}.o_proj.weight_global_scale"]
