"""FP8 KV cache: runtime logits against transformers whose cached keys and values are rounded the same way.

The oracle is a transformers forward in float32 with an attention function that replaces each layer's keys
and values by fp8(x / scale) * scale (clamped to the format's range first, as compressed-tensors and vLLM
do; torch rounds to nearest even, as XLA's convert does). Both sides then attend over the same rounded
values and differ only by float32 summation order (~1e-6 relative), unless a key lands within that much of
a rounding midpoint and rounds the other way: with 3 (E4M3) or 2 (E5M2) mantissa bits the chance per value
is ~2e-6 / 2^-3, and ~8k values give a few percent chance of one flip, which moves the logits by ~1e-3 of
their norm. Tolerance 2e-3; the rounding itself moves them by 1e-2 or more (asserted, so the oracle's
rounding is what the runtime matched).

Checkpoints with a `kv_cache_scheme` are made by the compressed-tensors library (tests/ct_oracle.py).
"""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import ct_oracle
from helpers import gemma4_config, perturbed, rel_err
from quantkit.errors import InvalidInput, Unsupported
from quantkit.inspect import inspect_checkpoint
from quantkit.runtime.engine import Runner
from quantkit.runtime.loader import load

MODEL = dict(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, vocab=256, dtype=torch.float32)
PROMPT = list(np.random.default_rng(0).integers(3, 256, 40))
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _oracle_logits(scales, fp8, model=None):
    """transformers logits of PROMPT with K/V rounded to `fp8` under per-layer scales [(k [KVH], v [KVH])]
    (None: no rounding); `model`: this float32 model instead of the tiny Llama."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def rounded(module, query, key, value, *args, **kwargs):  # key, value [B, KVH, S, D]
        if scales is not None:
            big = torch.finfo(fp8).max
            k_s, v_s = (torch.as_tensor(x, dtype=torch.float32)[None, :, None, None] for x in scales[module.layer_idx])
            key = (key / k_s).clamp(-big, big).to(fp8).float() * k_s
            value = (value / v_s).clamp(-big, big).to(fp8).float() * v_s
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("qk_fp8_oracle", rounded)
    # a custom attention name gets no mask from transformers unless one is registered for it: without
    # this, sliding-window layers (Gemma 4) would attend to every earlier token
    AttentionMaskInterface.register("qk_fp8_oracle", sdpa_mask)
    model = model or ct_oracle.tiny_llama(0, **MODEL)
    model.set_attn_implementation("qk_fp8_oracle")
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].numpy()


def _calibrated(per_head: bool):
    """absmax / 448 of each layer's keys and values on PROMPT (what llm-compressor's calibration computes),
    halved so that the largest values saturate: per tensor or per KV head."""
    model = ct_oracle.tiny_llama(0, **MODEL)
    with torch.no_grad():
        cache = model(torch.tensor([PROMPT]), use_cache=True).past_key_values
    out = []
    for layer in cache.layers:
        k, v = (x.abs().amax(dim=(0, 2, 3)) / 448 / 2 for x in (layer.keys, layer.values))  # [KVH]
        out.append((k.tolist(), v.tolist()) if per_head else (float(k.max()), float(v.max())))
    return out


def _runtime_logits(path, kv_cache_dtype="auto"):
    runner = Runner(load(path, dtype=jnp.float32), max_model_len=64, page_size=8, kv_cache_dtype=kv_cache_dtype)
    return runner.kv_dtype, runner.forward([(0, PROMPT, 0)])[0]


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_checkpoint_kv_scales_match_transformers_with_rounded_kv(tmp_path, strategy):
    scales = _calibrated(strategy == "attn_head")
    path = ct_oracle.make_checkpoint(tmp_path / strategy, None, kv_scales=scales, kv_strategy=strategy, **MODEL)
    report = inspect_checkpoint(path, "cpu")
    assert report["servable"] and report["kv_cache_scheme"]["strategy"] == strategy
    dtype, got = _runtime_logits(path)  # auto: the checkpoint's scheme means FP8 E4M3 with its scales
    per_head = [tuple(np.broadcast_to(np.float32(x), (2,)).copy() for x in s) for s in scales]
    want = _oracle_logits(per_head, FP8["e4m3"])
    assert dtype == "float8_e4m3fn"
    assert rel_err(got, want) < 2e-3, rel_err(got, want)
    assert rel_err(want, _oracle_logits(None, None)) > 1e-2  # the rounding is what was matched


@pytest.mark.parametrize("name,fmt", [("fp8_e5m2", "e5m2"), ("fp8", "e4m3")])
def test_fp8_without_checkpoint_scales_uses_one(tmp_path, name, fmt):
    """A dense checkpoint served with an FP8 cache: scales 1.0 (vLLM's default)."""
    path = tmp_path / "dense"
    ct_oracle.tiny_llama(0, **MODEL).save_pretrained(path)
    dtype, got = _runtime_logits(path, name)
    assert dtype == {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}[fmt]
    ones = [(np.ones(2), np.ones(2))] * MODEL["layers"]
    want = _oracle_logits(ones, FP8[fmt])
    assert rel_err(got, want) < 2e-3, rel_err(got, want)
    assert rel_err(want, _oracle_logits(None, None)) > 1e-2
    assert _runtime_logits(path)[0] == "float32"  # auto without a kv_cache_scheme: the model's dtype


def test_gemma4_fp8_cache_with_kinds_of_their_own_heads(tmp_path):
    """Gemma 4: sliding layers' pages hold 2 KV heads of 32, full layers' one K = V head of 64 (each with
    its own scales, [layers, 2, kv_heads] per kind): E5M2 with scale 1 against the rounded oracle."""
    import transformers as T

    torch.manual_seed(0)
    model = perturbed(T.Gemma4ForCausalLM(gemma4_config())).eval()
    model.save_pretrained(tmp_path / "g4")
    dtype, got = _runtime_logits(tmp_path / "g4", "fp8_e5m2")
    heads = [2 if t == "sliding_attention" else 1 for t in model.config.layer_types]
    want = _oracle_logits([(np.ones(n), np.ones(n)) for n in heads], FP8["e5m2"], model)
    assert dtype == "float8_e5m2" and rel_err(got, want) < 2e-3, rel_err(got, want)
    assert rel_err(want, _oracle_logits(None, None, model)) > 1e-2


def test_w4a16_checkpoint_with_kv_scheme_loads_its_scales(tmp_path):
    scales = [(0.011, 0.021), (0.031, 0.041)]
    path = ct_oracle.make_checkpoint(tmp_path / "w4", "W4A16", kv_scales=scales, **{**MODEL, "dtype": torch.bfloat16})
    model = load(path)
    assert np.allclose(model.kv_scales["full"], np.array(scales, np.float32)[:, :, None] * np.ones(2), rtol=1e-2)
    runner = Runner(model, max_model_len=64, page_size=8)
    assert runner.kv_dtype == "float8_e4m3fn"
    assert np.array_equal(np.asarray(runner.params["layers"]["full"]["kv_scale"][0]), model.kv_scales["full"][0])
    assert Runner(model, max_model_len=64, page_size=8, kv_cache_dtype="bf16").kv_dtype == "bfloat16"
    with pytest.raises(InvalidInput, match="unknown KV cache dtype 'fp4'"):
        Runner(model, max_model_len=64, page_size=8, kv_cache_dtype="fp4")
    shown = subprocess.run([sys.executable, "-m", "quantkit.cli", "inspect", str(path), "--target", "cpu"],
                           capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert shown.returncode == 0 and "KV cache scheme: float8 tensor scales" in shown.stdout, shown.stdout


def _tamper(path, tensor, value):
    file = next(path.glob("*.safetensors"))
    tensors = load_file(file)
    if value is None:
        del tensors[tensor]
    else:
        tensors[tensor] = np.asarray(value, np.float32)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("value,message", [([float("nan")], "contains NaN or Inf"), ([0.0], "scale <= 0"),
                                           ([0.1, 0.2, 0.3], "has shape \\[3\\]"), (None, "is missing")])
def test_inspect_rejects_bad_kv_scales(tmp_path, value, message):
    path = ct_oracle.make_checkpoint(tmp_path / "bad", None, kv_scales=[(0.01, 0.02)] * 2, **MODEL)
    _tamper(path, "model.layers.1.self_attn.v_scale", value)
    report = inspect_checkpoint(path, "cpu")
    errors = [p for p in report["problems"] if p["severity"] == "error"]
    assert report["exit_code"] == 1 and len(errors) == 1
    assert errors[0]["where"] == "model.layers.1.self_attn.v_scale"
    assert __import__("re").search(message, errors[0]["message"])
    with pytest.raises(InvalidInput, match="v_scale"):
        load(path)


def test_inspect_reports_unservable_kv_schemes(tmp_path):
    path = ct_oracle.make_checkpoint(tmp_path / "int8", None, kv_scales=[(0.01, 0.02)] * 2, **MODEL)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"].update(type="int", dynamic=True)
    (path / "config.json").write_text(json.dumps(cfg))
    report = inspect_checkpoint(path, "cpu")
    assert report["exit_code"] == 3
    assert any("only an FP8 (float, 8-bit) KV cache" in p["message"] for p in report["problems"])
    with pytest.raises(Unsupported, match="FP8"):
        load(path)
