"""The TPU lane (`scripts/test.sh --tpu`, README): every TPU-only path run for real on an attached TPU.

- The kernel tests of test_kernels (gmm_v2: every weight type, zero points, group and channel scales, 8-bit
  rows on the int8 MXU, the gated pair, activation order), test_paged_attention (head sizes 64-512, windows,
  soft caps, FP8 KV, ragged prefill + decode batches), test_sample_kernel (the sampler, drawing jax.random's
  noise bit for bit) and test_gdn_decode (the Gated DeltaNet kernels), each with its own inputs, oracle and
  tolerance, but its kernels compiled by Mosaic and run on the chip (the module's INTERPRET off).
- Attention with sinks (gpt-oss) on the chip against the CPU path, which CI holds against transformers.
- Every tiny family's forward on the chip against what the same TPU program computed for it on a CPU, its
  kernels in Pallas interpret mode (scripts/tpu_models.py, run on a machine with transformers: the checkpoints
  and `expected.npz`, carried to the chip), teacher-forced along that run's greedy tokens: logits close, and
  the chip's choice the CPU's but at a near tie, which the CPU's own margin identifies. (The CPU suite holds
  that interpreted program to the CPU path: test_runtime, test_qwen3_5. Against the CPU path itself, the tiny
  MoE families part on the chip by more than any tolerance: the gated pair rounds its products once where
  the XLA path rounds thrice, ~4e-3, enough to pick another of two near-tied experts, and a recurrent or
  attended state carries that to every later position.)
Without a TPU (CI) every test here is skipped, with that reason (conftest.py).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import jax
import numpy as np
import pytest

import test_gdn_decode
import test_kernels
import test_paged_attention
import test_sample_kernel
from helpers import rel_err

pytestmark = pytest.mark.tpu
ROOT = Path(__file__).resolve().parents[1]


def attached_chip() -> str | None:
    from quantkit.runtime.ops import chip_of

    return chip_of(jax.devices()[0].device_kind) if jax.default_backend() == "tpu" else None


# what a module's tests hold differently on a TPU: its exp and log are approximations (test_sample_kernel), its
# MXU multiplies float32 operands as bf16 (test_paged_attention)
ON_CHIP = {test_sample_kernel: {"LOGPROB_TOL": 1e-4}, test_paged_attention: {"F32_TOL": 5e-3}}


def on_chip(module, name: str):
    """`module.name` with its parametrization, fixtures, inputs and oracle, but the kernels compiled and run on
    the TPU (module.INTERPRET off; ON_CHIP's tolerances). A case for a chip whose 8-bit MXU types differ from
    the attached one's (v7x's fp8 on a v5e) is skipped: its program cannot run here."""
    from quantkit.kernels.tiling import CHIPS

    fn = getattr(module, name)

    def test(*args, **kwargs):
        chip, here = kwargs.get("chip"), attached_chip()
        if chip and here and CHIPS[chip].mxu_8bit != CHIPS[here].mxu_8bit:  # e.g. fp8 x fp8 on a v5e: no such MXU
            pytest.skip(f"{chip}'s 8-bit MXU types {CHIPS[chip].mxu_8bit} are not this {here}'s")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(module, "INTERPRET", False)
            for attr, value in ON_CHIP.get(module, {}).items():
                mp.setattr(module, attr, value)
            fn(*args, **kwargs)

    test.__signature__ = inspect.signature(fn)
    test.__name__ = test.__qualname__ = name
    test.__doc__ = f"{module.__name__}.{name}, run on the chip."
    test.pytestmark = list(getattr(fn, "pytestmark", []))
    return test


for _module, _names in [
    (test_kernels, ["test_kernel_matches_reference", "test_dense_bf16_weight_matches_its_product",
                    "test_quantized_activations_match_reference", "test_gated_pair_matches_the_gate_of_two_products",
                    "test_activation_order_gathers_each_rows_group_order"]),
    (test_paged_attention, ["test_matches_jax_reference", "test_fp8_cache_matches_jax_reference",
                            "test_long_chunks_across_blocks", "test_kernel_in_interpret_mode_equals_cpu_path",
                            "test_cost_estimate_matches_copied_pages"]),
    (test_sample_kernel, ["test_kernel_draws_what_numpy_draws_with_jax_noise"]),
    (test_gdn_decode, ["test_decode_kernel_matches_the_recurrence", "test_conv_kernel_matches_the_conv",
                       "test_prefill_kernel_matches_the_chunked_rule"]),
]:
    for _name in _names:
        globals()[_name] = on_chip(_module, _name)


@pytest.mark.parametrize("window", [None, 20])
def test_sinks_on_chip_equal_the_cpu_path(window):
    """gpt-oss's attention sinks (head size 64, 2 KV heads of 2 queries) on a ragged batch of decodes and
    chunks: the kernel on the chip against the CPU path on the host's CPU (float32, HIGHEST precision there;
    the kernel's dots on the MXU round their float32 operands to bf16: tolerance 1e-2, where a missing sink
    moves the result by more than 1e-2, checked below)."""
    from quantkit.kernels.paged_attention import paged_attention
    from quantkit.kernels.xla import paged_attention_xla

    seed = test_paged_attention._seed()
    rng = np.random.default_rng(seed)
    args, n, info = test_paged_attention.make_batch(rng, d=64, kvh=2, g=2, window=window, page0=0.0)
    sinks = jax.numpy.asarray(rng.uniform(1.0, 3.0, 4) * np.array([1, -1, 1, 1]), jax.numpy.float32)
    kw = dict(scale=0.125, sliding_window=window)
    out = np.asarray(paged_attention(*args, sinks, **kw, block_q=8, pages_per_chunk=2))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), jax.default_matmul_precision("highest"):
        host = [jax.device_put(a, cpu) for a in args]
        want = np.asarray(paged_attention_xla(*host, **kw, sinks=jax.device_put(sinks, cpu)))[:n]
        plain = np.asarray(paged_attention_xla(*host, **kw))[:n]
    assert np.all(out[n:] == 0), f"seed={seed} {info}"
    assert rel_err(out[:n], want) < 1e-2, f"seed={seed} {info}"
    assert rel_err(plain, want) > 1e-2, f"seed={seed}"


MODELS = Path(os.environ.get("QUANTKIT_TPU_MODELS", ROOT / ".tpu-models"))
FAMILIES = ["llama", "qwen3", "qwen3_moe", "gemma3", "gemma4", "gemma4_moe", "qwen3_5", "qwen3_5_moe", "gpt_oss",
            "tiny-llama"]
# the same program, its kernels compiled by Mosaic rather than interpreted: other summation orders, and the
# chip's exp and log; every step one position late (RoPE off by one) gives 0.11 and wrong tokens
TOL = 3e-2


@pytest.mark.parametrize("name", FAMILIES)
def test_family_forward_on_chip_matches_the_cpu_path(name):
    """The family's checkpoint on the chip (packed weights: gmm_v2, the paged-attention kernel, the family's
    own kernels) fed the interpreted run's prompt and greedy tokens: every position's logits within TOL
    (relative norm) of that run's, and each position's best token its, unless its own margin between its best
    and the chip's choice is under TOL x its largest logit (a near tie, which the tolerated error may break
    either way; such positions are counted in the failure message of the other checks)."""
    from quantkit.runtime.loader import load
    from quantkit.runtime.step import Runner

    path = MODELS / name
    if not (path / "expected.npz").exists():  # the chip has no transformers to build them: they are carried there
        pytest.skip(f"no {path}/expected.npz: build the lane's models with scripts/tpu_models.py (transformers)")
    want = np.load(path / "expected.npz")
    ids, ref, p = [int(i) for i in want["ids"]], want["logits"], int(want["prompt"])
    runner = Runner(load(path), max_model_len=128, page_size=8)
    rows = [runner.forward([(0, ids[:p], 0)])[0]]
    for i in range(p, len(ids)):
        rows.append(runner.forward([(0, [ids[i]], i)])[0])
    got = np.concatenate(rows)
    assert got.shape == ref.shape
    err = rel_err(got, ref)
    ties, wrong = [], []
    for i, (g_, r) in enumerate(zip(got, ref)):
        choice = int(g_.argmax())
        if choice != int(r.argmax()):
            margin = float(r.max() - r[choice]) / float(np.abs(r).max())
            (ties if margin < TOL else wrong).append((i, round(margin, 4)))
    far = [(i, round(float(rel_err(g_, r)), 3)) for i, (g_, r) in enumerate(zip(got, ref)) if rel_err(g_, r) > TOL]
    print(f"{name}: relative error {err:.2e}; near ties {ties}; positions past {TOL} {far}")
    assert err < TOL and not wrong, \
        f"{name}: relative error {err:.2e}, differing best tokens {wrong}, ties {ties}, positions past {TOL} {far}"
