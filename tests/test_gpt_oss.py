"""gpt-oss in its own published layout: experts as MXFP4 blocks and E8M0 scales (quant_method "mxfp4"), read by
quantkit as they are (formats/gpt_oss.py), against transformers loading the same files and dequantizing them
(integrations/mxfp4.py), and the compressed-tensors library decompressing what `quantkit convert` makes of them.
The bf16 layout's parity (sinks, biases, YaRN, alternating windows, chunked and mixed steps) is test_runtime's
`gpt_oss` family.

Tolerance: float32 logits within 1e-4 of transformers on the dequantized model (both compute in float32 on the
same exactly-representable weights; only summation order differs); weights compared bit for bit.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as T
from safetensors.numpy import save_file

from ct_oracle import library_decompress
from helpers import gpt_oss_model, greedy_parity, rel_err
from quantkit.convert import convert
from quantkit.errors import InvalidInput

FP4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)  # e2m1 by code
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def pack_native(model, path, seed: int = 0) -> dict:
    """Writes `model` as OpenAI publishes gpt-oss (following transformers' loader): each expert tensor [E, in, out]
    as `_blocks` uint8 [E, out, in/32, 16] (random codes; the even input in the low nibble) and `_scales` uint8
    [E, out, in/32] (random E8M0 exponents around 2^-8), the rest float32, config.json with the mxfp4
    quantization_config. Returns the intended expert values {tensor name: [E, in, out]}."""
    rng = np.random.default_rng(seed)
    tensors, intended = {}, {}
    for name, w in model.state_dict().items():
        w = w.detach().numpy()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, k, n = w.shape
            blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
            scales = rng.integers(118, 122, (e, n, k // 32), dtype=np.uint8)
            codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(e, n, k)
            values = FP4[codes] * np.exp2(scales.astype(np.float32) - 127).repeat(32, axis=-1)
            intended[name] = values.transpose(0, 2, 1)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        else:
            tensors[name] = w
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    model.config.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config |= {"architectures": ["GptOssForCausalLM"],
               "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}}
    (path / "config.json").write_text(json.dumps(config))
    return intended


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """The tiny gpt-oss in the native MXFP4 layout, transformers' model of it (dequantized on load), and the
    intended expert values, which transformers must have loaded exactly."""
    path = tmp_path_factory.mktemp("gpt-oss") / "native"
    intended = pack_native(gpt_oss_model(), path)
    ref = T.GptOssForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              quantization_config=T.Mxfp4Config(dequantize=True)).eval()
    for name, values in intended.items():
        loaded = ref.get_parameter(name).detach().numpy()
        assert loaded.shape == values.shape and np.array_equal(loaded, values), name
    return path, ref, intended


def test_native_mxfp4_served_as_published_matches_transformers(native):
    """The published blocks and scales become the MXFP4 QTensor gmm_v2 serves (codes and E8M0 scales as stored,
    nothing dequantized): float32 logits within 1e-4 of transformers over a prompt (two sliding windows long)
    and ten greedy decode steps, the same tokens."""
    path, ref, _ = native
    model = greedy_parity(path, ref, jnp.float32, 1e-4)
    from safetensors.numpy import load_file

    stored = load_file(str(path / "model.safetensors"))
    w = model.params["layers"]["sliding"]["experts_up"]  # layer 0's experts first
    assert type(w).__name__ == "QTensor" and w.qtype == "mxfp4"
    up_scales = stored["model.layers.0.mlp.experts.gate_up_proj_scales"][:, 1::2]  # [E, I, in/32], odd rows: up
    e, i, g = up_scales.shape  # the served scales: [E, in/32, I], lane-padded (E8M0 127) beyond in/32 and I
    assert np.array_equal(np.asarray(w.scales)[:e, :g, :i], up_scales.transpose(0, 2, 1))


def test_convert_native_to_mxfp4a16_is_lossless(native, tmp_path):
    """convert --scheme MXFP4A16 copies the published bytes into compressed-tensors per-expert Linears: the
    library decompresses every expert to exactly the values transformers loads; attention and router stay as
    they were. quantkit serves the result with the same logits."""
    path, ref, intended = native
    report = convert(path, tmp_path / "ct", "MXFP4A16")
    assert report["quantized_tensors"] == 0 and all(r["action"] == "copy" for r in report["tensors"])
    lib = library_decompress(tmp_path / "ct")
    e = intended["model.layers.0.mlp.experts.gate_up_proj"].shape[0]
    assert len(lib) == 3 * 3 * e  # layers x (gate, up, down) x experts, nothing else quantized
    for name, values in intended.items():
        root = name.rsplit(".", 1)[0]
        for x in range(e):
            parts = [("down_proj", values[x])] if name.endswith("down_proj") else \
                [("gate_proj", values[x][:, 0::2]), ("up_proj", values[x][:, 1::2])]
            for part, v in parts:
                assert np.array_equal(lib[f"{root}.{x}.{part}.weight"], v.T), (name, x, part)
    greedy_parity(tmp_path / "ct", ref, jnp.float32, 1e-4, steps=2)


@pytest.mark.parametrize("scheme", ["DENSE", "W4A16"])
def test_convert_native_to_other_schemes_from_its_values(native, tmp_path, scheme):
    """Any other scheme starts from the dequantized experts: DENSE gives exactly the published values in bf16;
    W4A16 quantizes those (the library's decompression within int4's error of them, where gate and up swapped
    or a wrong nibble order would be ~100% off)."""
    path, _, intended = native
    convert(path, tmp_path / scheme, scheme, group_size=32)
    v = intended["model.layers.2.mlp.experts.gate_up_proj"][5][:, 1::2].T  # expert 5's up_proj [out, in]
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    if scheme == "DENSE":
        from safetensors.torch import load_file

        got = load_file(str(next((tmp_path / scheme).glob("*.safetensors"))))[name]
        assert got.dtype == torch.bfloat16 and np.array_equal(got.float().numpy(), v)
    else:
        assert rel_err(library_decompress(tmp_path / scheme)[name], v) < 0.12


def test_inspect_native_and_bad_native_tensors(native, tmp_path):
    """inspect reads the native checkpoint without converting it: quant_method mxfp4, experts served as MXFP4,
    exit 0; a _blocks tensor without its _scales is one error line naming it, nothing else read."""
    import shutil

    from quantkit.formats.hf import Checkpoint
    from quantkit.inspect import inspect_checkpoint

    path, _, _ = native
    r = inspect_checkpoint(path)
    assert r["quant_method"] == "mxfp4" and r["exit_code"] == 0 and r["servable"], r["problems"]
    experts = [x for x in r["layers"] if ".experts." in x["name"]]
    assert experts and {x["format"] for x in experts} == {"mxfp4-pack-quantized"}
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    from safetensors.numpy import load_file

    t = load_file(str(bad / "model.safetensors"))
    del t["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(InvalidInput, match=r"model\.layers\.1\.mlp\.experts\.down_proj: _blocks and _scales"):
        Checkpoint.open(bad)
