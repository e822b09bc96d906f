"""The JAX runtime against transformers (float32 reference) for every family, dense and quantized.

Tolerances (relative Frobenius norm of the logits):
- float32 runtime vs float32 transformers on the same weights: 1e-4. Both compute in float32; what
  differs is summation order (einsum vs torch matmul, fused softmax), ~1e-6 per op, measured ≤ 1e-6;
- bfloat16 runtime: 4e-2. Activations and dense weights are rounded to bf16 (8-bit mantissa, relative
  2^-9 per rounding) at every layer boundary of a tiny random model whose logits are small; measured
  about 1e-2;
- quantized checkpoints vs transformers on the library's decompressed weights: 1e-2, because the
  library rounds each dequantized weight q·s to bf16 (relative up to 2^-9) while the runtime keeps q·s
  exact in float32.
Greedy tokens must be identical over ten decode steps (prefill + decode through the paged cache).
Everything runs through the one ragged step (runtime/step.py) with scanned layers.
"""

import re

import jax

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as T

from ct_oracle import (fake_quantize_inputs, input_global_scales, library_convert_dequantize, library_quantize_checkpoint,
                       make_actorder_checkpoint, make_checkpoint, online_input_transforms, tiny_llama,
                       to_activation_order, with_float32_scales, without_input_global_scales,
                       without_transform_matrices)
from helpers import (COMMON, activation_order_moe, family, gemma4_config, greedy_parity, perturbed, rel_err,
                     with_tokenizer)
from quantkit.errors import InvalidInput, Unsupported
from quantkit.quant.qtensor import QTensor
from quantkit.runtime.engine import Runner, Sampling, generate
from quantkit.runtime.loader import load


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe", "gemma3", "gemma4", "gemma4_moe", "gpt_oss"])
def family_ckpt(request, tmp_path_factory):
    torch.manual_seed(0)
    model = family(request.param).eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, path, model


def test_float32_parity_prefill_and_decode(family_ckpt):
    _, path, ref = family_ckpt
    greedy_parity(path, ref, jnp.float32, 1e-4)


# long-context RoPE over an original context of 8 < the 30 positions greedy_parity runs: Qwen3's YaRN (truncated
# ramp), gpt-oss's YaRN form (factor 32, untruncated ramp, explicit betas) and Llama 3.1's frequency bands
ROPES = [("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
         ("llama", {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                    "original_max_position_embeddings": 8}),
         ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8})]


@pytest.mark.parametrize("name,rope", ROPES, ids=["qwen3-yarn", "llama-yarn-gpt-oss", "llama-llama3"])
def test_scaled_rope_matches_transformers(name, rope, tmp_path):
    """Scaled RoPE as transformers computes it (its own rope initialisation from the same config.json):
    inverse frequencies and, for YaRN, the attention factor that scales cos and sin (0.1 ln(factor) + 1);
    float32 logits within 1e-4 over a prompt and decode steps past the original context, greedy tokens
    identical."""
    torch.manual_seed(0)
    base = family(name)
    config = type(base.config)(**{**base.config.to_dict(), "rope_parameters": {**rope, "rope_theta": 10000.0}})
    ref = type(base)(config).eval()
    ref.save_pretrained(tmp_path)
    model = greedy_parity(tmp_path, ref, jnp.float32, 1e-4)
    yarn = model.cfg.rope_scaling[0] == "yarn"
    assert yarn == (rope["rope_type"] == "yarn")
    assert ref.model.rotary_emb.attention_scaling == pytest.approx(model.cfg.rope_scaling[-1] if yarn else 1.0)


def test_bfloat16_logits_close(family_ckpt):
    """bf16 logits within 4e-2 of float32 transformers; for Gemma 4 MoE per token, the median: bf16 rounding
    flips near-ties in its top-2 of 8 experts at a few tokens (transformers' own bf16 run is 14-52% off at 6
    of 24 tokens, measured), so the whole-matrix norm measures which ties flipped, not the code."""
    name, path, ref = family_ckpt
    model = load(path, dtype=jnp.bfloat16)
    runner = Runner(model, max_model_len=64, page_size=8)
    ids = np.random.default_rng(1).integers(0, 256, (1, 24))
    ours = runner.forward([(0, ids[0].tolist(), 0)])[0]
    with torch.no_grad():
        theirs = ref(torch.tensor(ids)).logits[0].numpy()
    if name == "gemma4_moe":
        assert np.median([rel_err(a, b) for a, b in zip(ours, theirs)]) < 4e-2
    else:
        assert rel_err(ours, theirs) < 4e-2


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_CHANNEL", "W4A16_ASYM", "W8A16_ASYM", "W3A16",
                                    "MXFP4A16", "MXFP6A16", "MXFP8A16", "NVFP4A16"])
def test_quantized_checkpoints_match_transformers_on_decompressed_weights(scheme, tmp_path):
    """Each way a weight reaches the kernels (int4 group / channel / with zero points, int8 with zero points,
    3-bit in an int4 container, the MX types (mxfp6 in an fp8 container), nvfp4 with its global scales; fp8:
    the FP8_DYNAMIC test below, with its activations),
    end to end. g32, symmetric int8 and 6-bit weights take the
    same loader paths (test_kernels and test_inspect compare their layouts with the library; the MoE test
    below runs W8A16)."""
    q = make_checkpoint(tmp_path / "q", scheme)
    library_convert_dequantize(q, tmp_path / "dense")
    ref = T.AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32).eval()
    model = greedy_parity(q, ref, jnp.float32, 1e-2)
    ids = list(range(3, 20))
    packed, dense = (Runner(model, max_model_len=32, weights=w).forward([(0, ids, 0)])[0] for w in ("packed", "dense"))
    assert rel_err(dense, packed) < 1e-5  # dequantized once at load (CPU serving) == dequantized per call
    q = model.params["layers"]["full"]["q"]
    assert type(q).__name__ == "QTensor" and q.values.shape[0] == model.cfg.num_layers  # quantized, stacked
    assert model.weight_bytes < sum(f.stat().st_size for f in (tmp_path / "dense").glob("*.safetensors"))


ACTS = {"W8A8": ("int8", "int8"), "W4A8": ("int8", "int4"), "FP8_DYNAMIC": ("fp8", "fp8"), "W4AFP8": ("fp8", "int4"),
        "MXFP4": ("mxfp4", "mxfp4"), "MXFP8": ("mxfp8", "mxfp8"), "FP8_BLOCK": ("fp8_g128", "fp8"),
        "NVFP4": ("nvfp4", "nvfp4")}


@pytest.mark.parametrize("scheme", list(ACTS))
def test_quantized_activation_checkpoints_match_transformers_with_the_librarys_activation_quantization(scheme, tmp_path):
    """W8A8 (int8 channel weights) and W4A8 (int4 g128) made by the library: every quantized matmul quantizes
    its input rows to int8 per token (QTensor.act); FP8_DYNAMIC (fp8 channel) and W4AFP8 (int4 g128) to fp8
    e4m3 per token; MXFP4 and MXFP8 to e2m1 / e4m3 per 32 with E8M0 scales, FP8_BLOCK (128 x 128 weight
    blocks) to e4m3 per group of 128, NVFP4 (W4A4) to e2m1 per 16 with fp8 scales relative to each module's
    own static input_global_scale (quantize-dequantized); against transformers on the library's float32
    dequantized weights (each the exact product of code and scale, as the runtime's:
    ct_oracle.with_float32_scales; nvfp4: the library's bf16 rounding, as the runtime's) with the library's
    own dynamic activation quantization on each Linear's input (ct_oracle.fake_quantize_inputs).

    Each Linear alone, on the same rows (an outlier, a zero row): the same codes, scales and sums, 1e-5. The
    whole model: rounding a row to a few levels turns last-bit differences (float32 summation order) into
    whole steps where a value sits near a tie, and a random tiny model carries them to the logits: the
    library's own float32 forward differs from its float64 one by 1.2e-2 (int8 rows) and 3.2e-2 (FP8_BLOCK)
    here, ours from its float32 one by 1.3e-2 and 3.1e-2, from its float64 one by 1.3e-2 and 2.1e-2
    (measured; fp8 per token and MX: below 1e-6 to 6e-3), so 3e-2 against the float32 forward (FP8_BLOCK: the
    float64 one, closer to both), and greedy tokens identical."""
    q = make_checkpoint(tmp_path / "q", scheme)
    nv = scheme == "NVFP4"  # weights defined as their bf16 rounding, activations by their input_global_scale
    exact = q if scheme.startswith("MX") else without_input_global_scales(q, tmp_path / "q-") if nv else \
        with_float32_scales(q, tmp_path / "q32")  # E8M0: powers of two
    dense = library_convert_dequantize(exact, tmp_path / "dense", dtype=torch.bfloat16 if nv else torch.float32)
    gs = input_global_scales(q) if nv else None
    ref = fake_quantize_inputs(T.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval(), scheme,
                               global_scales=gs)
    whole = ref if scheme != "FP8_BLOCK" else fake_quantize_inputs(
        T.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float64).eval(), scheme)
    model = greedy_parity(q, whole, jnp.float32, 3e-2)
    from quantkit.runtime.ops import qmatmul

    x = np.random.default_rng(1).standard_normal((7, 512)).astype(np.float32)
    x[0, 5], x[3] = 40.0, 0.0
    layer = ref.model.layers[1]
    for key, lin in [("q", layer.self_attn.q_proj), ("k", layer.self_attn.k_proj), ("v", layer.self_attn.v_proj),
                     ("o", layer.self_attn.o_proj), ("gate", layer.mlp.gate_proj), ("up", layer.mlp.up_proj),
                     ("down", layer.mlp.down_proj)]:
        w = model.params["layers"]["full"][key]
        assert (w.act, w.qtype) == ACTS[scheme]
        k, n = lin.in_features, lin.out_features
        with torch.no_grad():
            theirs = lin(torch.from_numpy(x[None, :, :k]))[0].numpy()  # [batch, tokens, k]: per token
        ours = np.asarray(qmatmul(jnp.asarray(x[:, :k]), w, 1))[:, :n]
        assert rel_err(ours, theirs) < 1e-5, key


# online input transforms as the library applies them (transform_config), their inverse fused into the weights:
# QuIP's input half (one hadamard of each Linear's input width), W4A16; SpinQuant-like random hadamard blocks of
# 128 with random signs and a permutation, transposed online, ahead of W8A8's int8 rows
TRANSFORMS = {"W4A16": dict(type="hadamard", inverse=False, head_dim=None, randomize=False),
              "W8A8": dict(type="random-hadamard", inverse=True, head_dim=128, randomize=True)}


@pytest.mark.parametrize("scheme", list(TRANSFORMS))
def test_online_hadamard_transforms_match_transformers_with_the_librarys_transforms(scheme, tmp_path):
    """A tiny Llama rotated by the library (apply_transform_config: the online transform at every Linear's
    input but lm_head, its inverse fused into the weights), then quantized and saved by it: the runtime
    rotates each matmul's rows by the stored matrix (QTensor.rot: int8 +-1, permuted, transposed when
    inverse, / sqrt(size) in float32) before quantizing them, against transformers on the library's float32
    dequantized weights with the library's own HadamardTransform on each Linear's input (and, W8A8, its int8
    activation quantization after it). Tolerances as for the same schemes without transforms."""
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme, apply_transform_config

    t = TRANSFORMS[scheme]
    rotated = tiny_llama(0)
    apply_transform_config(rotated, TransformConfig(config_groups={"v": TransformScheme(
        type=t["type"], randomize=t["randomize"], head_dim=t["head_dim"], apply=[
            TransformArgs(targets=["Linear"], location="input", inverse=t["inverse"], ignore=["lm_head"]),
            TransformArgs(targets=["Linear"], location="weight_input", inverse=not t["inverse"], ignore=["lm_head"])])}))
    q = make_checkpoint(tmp_path / "q", scheme, model=rotated)
    exact = with_float32_scales(without_transform_matrices(q, tmp_path / "q-"), tmp_path / "q32")
    ref = T.AutoModelForCausalLM.from_pretrained(library_convert_dequantize(exact, tmp_path / "dense", dtype=torch.float32),
                                                 dtype=torch.float32).eval()
    int8 = scheme == "W8A8"
    ref = online_input_transforms(fake_quantize_inputs(ref, scheme) if int8 else ref, q)
    model = greedy_parity(q, ref, jnp.float32, 3e-2 if int8 else 1e-2)
    layer = model.params["layers"]["full"]
    for key, inputs in (("q", 256), ("down", 512)):
        size = t["head_dim"] or inputs
        assert layer[key].rot.shape == (2, size, size) and set(np.unique(np.asarray(layer[key].rot))) == {-1, 1}


@pytest.mark.parametrize("scheme", ["W4A16_ASYM"])
def test_activation_ordered_groups_match_transformers(scheme, tmp_path):
    """actorder group (weight_g_idx scattering whole groups over the input columns), with zero points g128
    (symmetric g32: the 4-device tensor-parallel test; per-expert orders: the MoE tests): stored rows sorted
    by group at load and the activations gathered into that order, against
    transformers on the library's dequantized weights with every column back in place (ct_oracle); packed and
    dense (densify puts the rows back) agree."""
    q, dense = make_actorder_checkpoint(tmp_path / "q", scheme)
    ref = T.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    model = greedy_parity(q, ref, jnp.float32, 1e-2)
    w = model.params["layers"]["full"]["down"]
    assert w.perm is not None and w.perm.shape == (2, 512)
    assert sorted(np.asarray(w.perm[1]).tolist()) == list(range(512)) and not np.array_equal(w.perm[0], w.perm[1])
    ids = list(range(3, 20))
    packed, dense_w = (Runner(model, max_model_len=32, weights=x).forward([(0, ids, 0)])[0] for x in ("packed", "dense"))
    assert rel_err(dense_w, packed) < 1e-5


def test_mixed_step_of_prompt_chunks_and_decodes_equals_each_alone(family_ckpt):
    """One ragged step holding a prompt chunk of one sequence (11 tokens, continuing after 5), the first
    chunk of another (5 tokens) and single decode tokens of two more: every sequence's logits equal its
    run alone, chunk by chunk."""
    name, path, _ = family_ckpt
    model = load(path, dtype=jnp.float32)
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, 256, n).tolist() for n in (16, 5, 14, 10)]
    cut = [5, 0, 13, 9]  # tokens already in the cache before the mixed step

    def alone(seq, c):
        r = Runner(model, max_model_len=32, page_size=4)
        return r.forward([(0, seq[c:], c)])[0] if c == 0 else (r.forward([(0, seq[:c], 0)]),
                                                                 r.forward([(0, seq[c:], c)])[0])[1]

    solo = [alone(s, c) for s, c in zip(seqs, cut)]
    r = Runner(model, max_model_len=32, max_num_seqs=4, page_size=4, scan=True)
    r.forward([(i, s[:c], 0) for i, (s, c) in enumerate(zip(seqs, cut)) if c])
    mixed = r.forward([(3, seqs[3][9:], 9), (0, seqs[0][5:], 5), (2, seqs[2][13:], 13), (1, seqs[1], 0)])
    for got, i in zip(mixed, (3, 0, 2, 1)):
        assert got.shape == solo[i].shape and rel_err(got, solo[i]) < 1e-5, name


def test_sampling_seed_and_stops(family_ckpt):
    _, path, _ = family_ckpt
    model = load(path, dtype=jnp.float32)
    prompt = [5, 17, 42, 7]
    runs = [generate(Runner(model, max_model_len=64), prompt, 12, Sampling(temperature=1.0, top_k=50, top_p=0.9,
                                                                         seed=s)) for s in (3, 3, 4)]
    assert runs[0] == runs[1] and len(runs[0]) == 12 and runs[0] != runs[2]
    greedy = generate(Runner(model, max_model_len=64), prompt, 12)
    stop = greedy[3]
    cut = generate(Runner(model, max_model_len=64), prompt, 12, stop_ids=(stop,))
    assert cut == greedy[: greedy.index(stop)]


# ---- bad input --------------------------------------------------------------------------------------

def test_rejected_checkpoint_unknown_architecture_and_long_prompt(tmp_path):
    w4a4 = make_checkpoint(tmp_path / "w4a4", "W4A4")
    with pytest.raises(Unsupported, match="int4 token input activation"):
        load(w4a4)
    T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=128)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(Unsupported, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load(tmp_path / "gpt2", check=False)
    torch.manual_seed(0)
    family("llama").save_pretrained(tmp_path / "llama")
    runner = Runner(load(tmp_path / "llama"), max_model_len=32)
    with pytest.raises(InvalidInput, match="prompt of 30 tokens \\+ max_tokens 8 exceeds the model length 32"):
        generate(runner, list(range(30)), 8)
    assert 0 < len(generate(runner, list(range(24)), 8)) <= 8  # exactly the model length is accepted


# ---- quantkit generate ------------------------------------------------------------------------------

def test_generate_cli_streams_what_the_library_generates(tmp_path):
    import subprocess
    import sys

    from quantkit.generate import generate as library_generate
    from quantkit.runtime.tokenizer import TextCodec

    torch.manual_seed(0)
    T.LlamaForCausalLM(T.LlamaConfig(**{**COMMON, "vocab_size": 320})).save_pretrained(tmp_path / "m")
    with_tokenizer(tmp_path / "m")
    cmd = [sys.executable, "-m", "quantkit.cli", "generate", str(tmp_path / "m"), "--prompt", "hello world",
           "--max-tokens", "8"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    codec = TextCodec(tmp_path / "m")
    ids = generate(Runner(load(tmp_path / "m"), max_model_len=2048), codec.encode("hello world"), 8)
    assert p.stdout == codec.decode(ids) + "\n" and len(ids) > 0
    chat = subprocess.run(cmd + ["--chat", "--temperature", "0.8", "--seed", "3"], capture_output=True, text=True,
                          timeout=300)
    assert chat.returncode == 0, chat.stderr
    # the same chat template and sampling through the library (bf16, as the command runs): the same text
    sampled = library_generate(tmp_path / "m", "hello world", 8, temperature=0.8, seed=3, chat=True)
    assert chat.stdout == sampled.text + "\n", (chat.stdout, sampled.text)
    (tmp_path / "m" / "tokenizer.json").unlink()
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "no tokenizer.json" in bad.stderr and "Traceback" not in bad.stderr
    usage = subprocess.run(cmd + ["--max-tokens", "0"], capture_output=True, text=True, timeout=300)
    assert usage.returncode == 2


TP_SCRIPT = r"""
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import numpy as np, jax, jax.numpy as jnp
from quantkit.runtime.loader import load
from quantkit.runtime.engine import Runner
assert len(jax.devices()) == 4
model = load(sys.argv[1], dtype=jnp.float32)
ids = np.random.default_rng(0).integers(0, 256, 20).tolist()
one_r = Runner(model, max_model_len=64, weights="packed")
one = one_r.forward([(0, ids, 0)])[0]
one_decode = one_r.forward([(0, [7], 20)])[0]
tp = Runner(model, max_model_len=64, tp=4, weights="packed", scan=True)
four = tp.forward([(0, ids, 0)])[0]
four_decode = tp.forward([(0, [7], 20)])[0]
q = tp.params["layers"]["full"]["o"]
spec = q.values.sharding.spec if hasattr(q, "values") else q.sharding.spec
print("REL", np.linalg.norm(four - one) / np.linalg.norm(one), np.linalg.norm(four_decode - one_decode) / np.linalg.norm(one_decode), spec)
"""


@pytest.mark.parametrize("scheme", ["dense", "W4A16_G32 actorder", "W4A16_CHANNEL"])
def test_tensor_parallel_on_four_devices_matches_one(scheme, tmp_path):
    """Column/row-parallel layers, including row-parallel grouped (in activation order: the gather of the whole
    activation before the split) and channel-scaled int4, on 4 fake CPU devices give the logits of one device
    (float32: only the all-reduce summation order differs). Zero points split with their scales: test_parallel's
    W4A16_ASYM MoE."""
    import subprocess
    import sys

    if scheme == "dense":
        torch.manual_seed(0)
        cfg = T.LlamaConfig(**{**COMMON, "num_key_value_heads": 4})  # 4 KV heads: split over 4 devices
        T.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    elif scheme.endswith("actorder"):
        make_actorder_checkpoint(tmp_path / "m", scheme.split()[0])
    else:
        make_checkpoint(tmp_path / "m", scheme)  # 2 KV heads on 4 devices: replicated too
    p = subprocess.run([sys.executable, "-c", TP_SCRIPT, str(tmp_path / "m")], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("REL"))
    prefill, decode = (float(x) for x in line.split()[1:3])
    assert prefill < 1e-5 and decode < 1e-5, line
    assert "'model'" in line  # the row-parallel weight really is split


def test_padding_tokens_reach_no_expert(tmp_path, monkeypatch):
    """A step's token bucket pads its tokens (a decode of one sequence runs 8 tokens): the padding tokens'
    rows go to no expert (models/common.py `live_tokens`), so the grouped matmuls are given top_k rows a
    live token, and on a TPU no expert is read for padding (a one-sequence Qwen3-30B-A3B decode step read
    up to 64 experts a layer for its 8). The live tokens' logits against transformers: the parity tests."""
    from quantkit.runtime.models import common

    torch.manual_seed(0)  # one layer: a configuration (and jitted step) of this test's own, traced with the spy
    T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 1}, moe_intermediate_size=64,
                                           num_experts=8, num_experts_per_tok=2)).save_pretrained(tmp_path)
    rows, real = [], common.gated

    def spy(x, gate, up, act, sizes=None):
        if sizes is not None:
            jax.debug.callback(lambda s: rows.append(int(np.sum(s))), sizes)
        return real(x, gate, up, act, sizes)

    monkeypatch.setattr(common, "gated", spy)
    runner = Runner(load(tmp_path), max_model_len=64, page_size=8, weights="packed", scan=True)
    runner.forward([(0, [5, 6, 7, 8, 9], 0)])  # 5 tokens in an 8-token bucket
    runner.forward([(0, [10], 5)])  # 1 in 8
    assert rows == [5 * 2, 1 * 2]


@pytest.mark.parametrize("scheme", ["W4A16", "W8A16", "W4A16_ASYM", "NVFP4A16"])
def test_quantized_moe_experts_match_transformers(scheme, tmp_path):
    """Qwen3-MoE converted by quantkit to int4 / int8 g32, int4 with zero points, nvfp4 (one global scale per
    expert, gate and up sharing theirs; MX and 3-bit experts: the library-quantized test below) (experts included,
    router kept
    dense): the runtime's grouped experts against transformers running the same checkpoint through
    compressed-tensors (which decompresses to bf16: tolerance 1e-2 as for the other quantized checkpoints).
    With zero points on the library's own dequantized copy: transformers 5.24 allocates unpacked zero-point
    shapes for packed asymmetric checkpoints and refuses to load them."""
    from quantkit.convert import convert

    torch.manual_seed(0)
    family("qwen3_moe").save_pretrained(tmp_path / "moe")
    convert(tmp_path / "moe", tmp_path / "q", scheme, 32)
    # the library's own dequantized copy for zero points (below) and nvfp4 (transformers runs it in bf16 only)
    lib_copy = scheme.endswith("_ASYM") or scheme == "NVFP4A16"
    ref_path = library_convert_dequantize(tmp_path / "q", tmp_path / "dense") if lib_copy else tmp_path / "q"
    ref = T.AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    model = greedy_parity(tmp_path / "q", ref, jnp.float32, 1e-2)
    experts = model.params["layers"]["full"]["experts_gate"]  # 3 layers x 8 experts, stacked
    assert type(experts).__name__ == "QTensor" and experts.values.shape[0] == 3 * 8
    assert experts.qtype == {"W8A16": "int8", "NVFP4A16": "nvfp4"}.get(scheme, "int4")
    assert experts.group == (16 if scheme == "NVFP4A16" else 32)
    assert (experts.zeros is not None) == scheme.endswith("_ASYM")
    if scheme == "NVFP4A16":  # one global scale per expert, all different, gate's equal to up's
        g = np.asarray(experts.gscale)
        assert g.shape == (24,) and len(set(g.tolist())) == 24
        assert np.array_equal(g, np.asarray(model.params["layers"]["full"]["experts_up"].gscale))


@pytest.mark.parametrize("scheme", ["MXFP6A8", "W3A16", "W4A8", "NVFP4", "FP8_DYNAMIC"])
def test_library_quantized_moe_experts_match_transformers(scheme, tmp_path):
    """Qwen3-MoE quantized by the library itself (its per-expert Linears: ct_oracle's model-free path) to
    MXFP6A8, served as fp8 values with E8M0 scales, each expert's input rows quantize-dequantized to MX e4m3
    per 32 (`mxfp8` activations), to 3-bit ints g128 (the 2-7 bit ints: one loader path,
    an int4 container) and to W4A8 (int4 g128, each expert's input rows quantized to int8 per token: the
    reference runs the library's activation quantization before every expert's F.linear), against
    transformers on the library's dequantized weights, dequantized by the library in float32 like the runtime
    here (in bf16 each code times its bf16 scale is rounded, 1.7e-3 of every weight: enough to flip
    near-tied top-2 routes of a random router; int-quantized W4A8 dequantizes in its scales' dtype: given
    float32), to NVFP4 (W4A4: e2m1 rows per 16 under each expert's own input global scale) and to
    FP8_DYNAMIC (fp8 channel weights, fp8 rows per token). Tolerance 1e-2; per-token 8-bit rows 3e-2, as for
    the dense W8A8 test, which alone would not tell quantized rows from unquantized ones here: one expert's
    projection is also checked alone, 1e-5. Experts 128 wide, so that down_proj's inputs hold a whole group
    of 128."""
    torch.manual_seed(0)
    T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**COMMON, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                                           norm_topk_prob=True)).save_pretrained(tmp_path / "moe")
    q = library_quantize_checkpoint(tmp_path / "moe", tmp_path / "q", scheme)
    act = {"W4A8": "int8", "MXFP6A8": "mxfp8", "NVFP4": "nvfp4", "FP8_DYNAMIC": "fp8"}.get(scheme, "")
    int8, nv = act in ("int8", "fp8"), act == "nvfp4"  # per-token rows: float32 scales, 3e-2 (see above)
    exact = with_float32_scales(q, tmp_path / "q32") if int8 else without_input_global_scales(q, tmp_path / "q-") \
        if nv else q
    dense = library_convert_dequantize(exact, tmp_path / "dense", dtype=torch.bfloat16 if nv else torch.float32)
    gs = input_global_scales(q) if nv else None
    # eager experts: one F.linear per expert, whose input the library's activation quantization is hooked on
    ref = T.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32, experts_implementation="eager").eval()
    # the router (`gate`, a Linear) is not quantized: its input stays as it is
    model = greedy_parity(q, fake_quantize_inputs(ref, scheme, skip=("lm_head", "gate"), global_scales=gs) if act
                          else ref, jnp.float32, 3e-2 if int8 else 1e-2)
    experts = model.params["layers"]["full"]["experts_gate"]
    assert experts.values.shape[0] == 3 * 8 and experts.act == act
    assert (experts.qtype, experts.group) == {"MXFP6A8": ("mxfp8", 32), "W3A16": ("int4", 128),
                                              "W4A8": ("int4", 128), "NVFP4": ("nvfp4", 16),
                                              "FP8_DYNAMIC": ("fp8", experts.values.shape[1])}[scheme]  # channel
    if nv:  # each expert's own input global scale, gate's equal to up's (one input)
        g = np.asarray(experts.act_gscale)
        assert g.shape == (24,) and len(set(g.tolist())) == 24
        assert np.array_equal(g, np.asarray(model.params["layers"]["full"]["experts_up"].act_gscale))
    if act:  # one expert's down projection alone on the same rows (an outlier, a zero row): 1e-5
        from quantkit.runtime.ops import qmatmul

        x = np.random.default_rng(1).standard_normal((7, 128)).astype(np.float32)
        x[0, 5], x[3] = 40.0, 0.0
        lin = torch.nn.Linear(128, 128, bias=False)
        lin.weight.data = ref.model.layers[1].mlp.experts.down_proj.data[5]  # [hidden, intermediate]
        with torch.no_grad():
            theirs = fake_quantize_inputs(torch.nn.Sequential(lin), scheme, global_scales=gs and {
                "0": gs["model.layers.1.mlp.experts.5.down_proj"]})(torch.from_numpy(x[None]))[0].numpy()
        ours = np.asarray(qmatmul(jnp.asarray(x), model.params["layers"]["full"]["experts_down"], 8 + 5))
        assert rel_err(ours, theirs) < 1e-5


def test_activation_ordered_moe_experts_match_transformers(tmp_path):
    """Qwen3-MoE in activation order, every expert with its own g_idx (gate and up sharing theirs): converted
    by quantkit to W4A16 g32 from column-permuted weights, the columns put back beside g_idx
    (ct_oracle.to_activation_order); each row's activations gathered by its expert's order, against
    transformers on the library's dequantized weights with the columns in place."""
    from quantkit.convert import convert

    torch.manual_seed(0)
    model = family("qwen3_moe")
    sigmas = activation_order_moe(model)
    model.save_pretrained(tmp_path / "moe")
    convert(tmp_path / "moe", tmp_path / "c", "W4A16", 32)
    q, dense = to_activation_order(tmp_path / "c", tmp_path / "q", sigmas, 32)
    ref = T.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    loaded = greedy_parity(q, ref, jnp.float32, 1e-2)
    down = loaded.params["layers"]["full"]["experts_down"]
    perm = np.asarray(down.perm)  # 64 inputs padded to the 128 lanes: the padded rows keep their place
    assert perm.shape == (3 * 8, 128) and (perm[:, 64:] == np.arange(64, 128)).all()
    assert len({tuple(r) for r in perm[:, :64].tolist()}) == 24 and sorted(perm[5, :64]) == list(range(64))


# ---- the TPU code path, run (Pallas interpret mode) on CPU -------------------------------------------

# q 256, kv 128 columns: every linear fits gmm_v2; two layers (interpret mode runs each kernel call element by
# element: its time grows with the layers, and two hold one of each kind)
TPU_SHAPES = dict(COMMON, head_dim=64, num_hidden_layers=2)


def _cpu_and_interpreted_tpu(m):
    """A 13-token prompt's logits and 3 greedy tokens on the CPU path and on the TPU path with its kernels in
    Pallas interpret mode (a Runner made inside `interpreted_tpu_kernels`: its own programs), and the TPU
    step's jaxpr: (tpu tokens, cpu tokens, tpu logits, cpu logits, jaxpr)."""
    from quantkit.runtime.ops import interpreted_tpu_kernels
    from quantkit.runtime.step import step_function

    prompt = np.random.default_rng(3).integers(0, 256, 13).tolist()
    cpu = Runner(m, max_model_len=64, page_size=8, weights="packed", scan=True)
    cpu_logits = cpu.forward([(0, prompt, 0)])[0]
    with interpreted_tpu_kernels():
        tpu = Runner(m, max_model_len=64, page_size=8, weights="packed", scan=True)
        tpu_logits = tpu.forward([(0, prompt, 0)])[0]
        tokens = generate(tpu, prompt, 3)
        jaxpr = str(jax.make_jaxpr(step_function(m.cfg, 8))(tpu.params, tpu.kv, tpu.last, tpu.empty(8)))
    return tokens, generate(cpu, prompt, 3), tpu_logits, cpu_logits, jaxpr


@pytest.mark.slow
@pytest.mark.parametrize("name,scheme", [("gemma3", None), ("qwen3_moe", "W4A16"), ("llama", "W4A16_ASYM"),
                                         ("gemma4", "W4A16")])
def test_tpu_kernels_in_interpret_mode_give_the_cpu_path_tokens(name, scheme, tmp_path):
    """The whole step with its TPU kernels (the paged-attention kernel; gmm_v2 for quantized weights) run in
    Pallas interpret mode gives the CPU path's greedy tokens, and logits within 2e-2 (dense: 1e-4): gmm_v2
    feeds the MXU bf16 operands, so each quantized matmul rounds its activations to bf16 (2^-9 relative per
    element, ~4e-3 on the logits of these tiny models, measured); the attention kernel alone differs from
    the CPU path only in summation order (float32, ~1e-6)."""
    from quantkit.convert import convert

    torch.manual_seed(0)
    model = family(name)
    if name == "gemma4":  # a sliding layer, then a full one: 4 heads x 128, one KV head of 128 (k_eq_v)
        model = perturbed(T.Gemma4ForCausalLM(gemma4_config(head_dim=64, global_head_dim=128,
                                                            num_hidden_layers=2))).eval()
    else:
        kinds = {"layer_types": ["sliding_attention", "full_attention"]} if name == "gemma3" else {}
        model = type(model)(type(model.config)(**{**model.config.to_dict(), **TPU_SHAPES, **kinds})).eval()
    model.save_pretrained(tmp_path / "m")
    path = tmp_path / "m"
    if scheme:
        convert(path, tmp_path / "q", scheme, 32)
        path = tmp_path / "q"
    tokens, cpu_tokens, tpu_logits, cpu_logits, jaxpr = _cpu_and_interpreted_tpu(load(path, dtype=jnp.float32))
    assert tokens == cpu_tokens
    assert rel_err(tpu_logits, cpu_logits) < (2e-2 if scheme else 1e-4)
    # the kernels really are in the traced step: attention's output is [T, heads, lanes], gmm_v2's [T, n]
    # (one output; the sampler's are four)
    ranks = [dims.count(",") + 1 for dims in re.findall(r"^\s+\w+:\w+\[([\d,]+)\] = pallas_call\[", jaxpr, re.M)]
    assert 3 in ranks and (2 in ranks) == bool(scheme), ranks
    assert re.search(r"i32\[\d+,1\] \w+:f32\[\d+,1\] \w+:i32\[\d+,20\] \w+:f32\[\d+,20\] = pallas_call", jaxpr)


@pytest.mark.slow
def test_dense_bf16_layers_go_through_gmm_v2_on_the_tpu_path(tmp_path):
    """A bf16 model's dense layer weights (q, k, v, o, gate, up, down) are read by gmm_v2 on the TPU path
    (runtime/ops.py dense_as_qtensor: XLA would stage each weight that fits VMEM whole before its dot), each
    layer's tiles straight from its kind's stack: the interpreted TPU step gives the CPU path's greedy tokens
    and its logits within 2e-2 (both bf16 with float32 sums, in another order: a bf16 rounding of 2^-9
    here and there, ~5e-3 measured), with 6 matmul kernels a layer in the traced step (q, k, v, o, down, and
    the gate and up projections' one gated call)."""
    torch.manual_seed(0)
    model = family("llama")
    model = type(model)(type(model.config)(**{**model.config.to_dict(), **TPU_SHAPES})).eval()
    model.save_pretrained(tmp_path / "m")
    tokens, cpu_tokens, tpu_logits, cpu_logits, jaxpr = _cpu_and_interpreted_tpu(load(tmp_path / "m", dtype=jnp.bfloat16))
    assert tokens == cpu_tokens
    assert rel_err(tpu_logits, cpu_logits) < 2e-2
    assert len(re.findall(r"jit\[name=gmm_v2 ", jaxpr)) == 6  # the scanned layer body's 7 dense weights


def test_place_row_major_keeps_row_major_arrays_and_converts_others(seed):
    """Weights are pinned row-major (sharding.row_major) without ever holding a model twice: an array already
    row-major is returned as is (no copy), another layout is converted with its values unchanged."""
    from jax.experimental.layout import Format, Layout

    from quantkit.runtime.sharding import place_row_major

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((6, 5, 4)), jnp.bfloat16)
    col = jax.device_put(x, Format(Layout((2, 1, 0)), x.sharding))  # dim 0 minor-most
    assert col.format.layout.major_to_minor == (2, 1, 0)
    kept, fixed = place_row_major({"a": x, "b": col}).values()
    assert kept is x
    assert fixed.format.layout.major_to_minor == (0, 1, 2)
    np.testing.assert_array_equal(np.asarray(fixed, np.float32), np.asarray(x, np.float32))


def test_dummy_load_format_builds_the_weight_tree_the_checkpoint_loads(tmp_path):
    """`--load-format dummy` (loader.dummy) from config.json alone: the same tree as the loader reading the
    converted checkpoint (every leaf's shape and dtype, each QTensor's type, group and arrays), random values
    over the type's range, and a model that runs; the serve CLI refuses it with several devices, one line."""
    import shutil
    import subprocess
    import sys

    from quantkit.convert import convert
    from quantkit.runtime.loader import dummy
    from quantkit.runtime.step import Row

    torch.manual_seed(0)
    family("qwen3_moe").to(torch.bfloat16).save_pretrained(tmp_path / "moe")  # bf16 scales, as published
    convert(tmp_path / "moe", tmp_path / "q", "W4A16", 32)
    (tmp_path / "shape").mkdir()
    shutil.copy(tmp_path / "q" / "config.json", tmp_path / "shape" / "config.json")
    real, fake = load(tmp_path / "q"), dummy(tmp_path / "shape")

    def described(params):
        leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, QTensor))[0]
        return {jax.tree_util.keystr(p): (w.qtype, w.group, {f: (a.shape, a.dtype) for f, a in w.arrays.items()})
                if isinstance(w, QTensor) else (w.shape, w.dtype) for p, w in leaves}

    assert described(fake.params) == described(real.params)
    experts = fake.params["layers"]["full"]["experts_gate"]
    values = np.asarray(experts.values.astype(jnp.int32))
    assert experts.qtype == "int4" and values.min() == -8 and values.max() == 7
    runner = Runner(fake, max_model_len=64, max_num_seqs=2, page_size=16, max_num_batched_tokens=32)
    runner.pool.reserve(0, 0, 8)
    out = runner.run(runner.batch([Row(0, 0, 8, list(range(3, 11)))]))
    assert np.isfinite(np.asarray(out[2] if isinstance(out, tuple) else out, np.float32)).all()

    cli = [sys.executable, "-m", "quantkit.cli", "serve", str(tmp_path / "shape")]
    for flags, message in ((["--load-format", "dummy", "--tp", "2"], "--load-format dummy serves on one device"),
                           ([], "no .safetensors files")):
        r = subprocess.run(cli + flags, capture_output=True, text=True, env={**__import__("os").environ,
                                                                            "JAX_PLATFORMS": "cpu"}, timeout=120)
        assert r.returncode != 0 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
