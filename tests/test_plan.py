"""`quantkit plan`: abstract weights agree with what the loader builds, and deviceless compilation for a
v6e of a Gemma-3-27B-shaped model reports the HBM the arithmetic predicts.

Analytical bytes (Gemma-3-27B: hidden 5376, MLP 21504, 62 layers, 32/16 heads of 128, vocab 262208, tied
embedding): 25.60e9 linear weights -> int4 12.80e9 B + group-32 bf16 scales 1.60e9 B; embedding
bf16 2.82e9 B; norms ~5 MB. The plan must agree within 2% (TPU tiles pad some arrays).
"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import torch

from helpers import family as _family
from quantkit.convert import convert
from quantkit.errors import InvalidInput
from quantkit.formats.compressed_tensors import parse_quantization_config
from quantkit.plan import _quantization
from quantkit.quant.qtensor import QTensor
from quantkit.runtime.loader import abstract, load

GEMMA_27B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 5376,
    "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
    "head_dim": 128, "vocab_size": 262208, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 1024,
    "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window_pattern": 6,
}


def _describe(tree):
    def leaf(x):
        if isinstance(x, QTensor):
            return ("q", x.qtype, x.group, tuple(x.values.shape), str(x.values.dtype), tuple(x.scales.shape),
                    str(x.scales.dtype))
        return (tuple(x.shape), str(x.dtype))

    return jax.tree_util.tree_map(leaf, tree, is_leaf=lambda x: isinstance(x, QTensor))


@pytest.mark.parametrize("family,scheme,group", [("llama", None, 0), ("llama", "W4A16", 32),
                                                 ("gemma3", "W4A16", -1), ("qwen3_moe", "W4A16_ASYM", 32),
                                                 ("qwen3", "MXFP4A16", 32), ("llama", "FP8_BLOCK", 0),
                                                 ("gemma4", "W4A16", 32), ("gemma4_moe", "W4A16", 32),
                                                 ("qwen3_5_moe", "W4A16", 32)])
def test_abstract_weights_equal_the_loaded_ones(family, scheme, group, tmp_path):
    torch.manual_seed(0)
    _family(family).to(torch.bfloat16).save_pretrained(tmp_path / "dense")  # convert keeps bf16 scales
    path = tmp_path / "dense"
    if scheme:
        convert(path, tmp_path / "q", scheme, group)
        path = tmp_path / "q"
    model = load(path)
    raw = json.loads((path / "config.json").read_text()).get("quantization_config")
    assert _describe(abstract(model.cfg, parse_quantization_config(raw) if raw else None)) == _describe(model.params)
    # `plan CONFIG --scheme S` plans what `convert --scheme S` writes (Qwen3.5: GDN projections left bf16)
    planned = _quantization(json.loads((tmp_path / "dense" / "config.json").read_text()), scheme, group)
    assert _describe(abstract(model.cfg, planned)) == _describe(model.params)


def _plan(tmp_path, config=None, **kw):
    """plan() in this process on GEMMA_27B (or `config`) for a v6e at 2048 tokens: (the CLI's exit code, report)."""
    from quantkit.plan import plan

    (tmp_path / "config.json").write_text(config.read_text() if config else json.dumps(GEMMA_27B))
    r = plan(tmp_path / "config.json", "v6e", 2048, **kw)
    return (0 if r["fits"] else 4), json.loads(json.dumps(r))  # as the CLI's --json writes it


def _kv_bytes(n: int) -> int:
    """Gemma-3-27B KV at 2048 tokens, 16-token pages of 16 heads x 128 x bf16, keys and values: 10 global
    layers keep 128 pages per sequence; the 52 sliding-window layers' pool holds the 1024-token window
    (64 pages) + 2 pages per sequence and the 512-token budget's 32 pages of one step's chunks; + scratch."""
    page = 16 * 16 * 128 * 2 * 2
    return page * (10 * (1 + n * 128) + 52 * (1 + n * (64 + 2) + 32))


def test_search_finds_the_largest_concurrency_that_fits(tmp_path):
    """The search for the largest max_num_seqs, on a model whose KV cache fills the v6e at long context (4
    layers of 8 KV heads x 128 at 32768 tokens: 2048 pages of 64 KiB a layer and sequence, 0.5 GiB a
    sequence): the answer is the last n whose weights + KV + temporaries fit, n + 1 does not; the compiled
    KV bytes are the analytic ones; an FP8 cache would hold about twice as many."""
    from quantkit.plan import plan

    cfg = {**SMALL, "num_hidden_layers": 4, "num_key_value_heads": 8, "max_position_embeddings": 32768}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = plan(tmp_path / "config.json", "v6e", 32768, 16, scheme="W4A16", group_size=128, cost=False)

    def kv(n: int) -> int:  # + one scratch page a layer
        return 4 * (1 + n * 2048) * 16 * 8 * 128 * 2 * 2

    h, n = r["hbm_bytes"], r["max_num_seqs_that_fit"]
    assert r["fits"] and h["kv_cache"] == kv(16)
    assert n > 16 and h["weights"] + kv(n) + h["temporaries"] <= h["capacity"] < h["weights"] + kv(n + 1)
    assert r["kv_cache_by_dtype"]["fp8"]["max_num_seqs_that_fit"] >= 2 * n - 1


@pytest.mark.parametrize("grow, curve, slack, per_seq, said", [
    (0, 0, 0, 100_000_000, "required"), (4_000_000, 0, 200_000_000, 100_000_000, "required"),
    (4_000_000, 0, 200_000_000, 100_000_000, "exceeded"), (20_000_000, 0, 1_500_000_000, 100_000_000, "required"),
    (4_000_000, 0, 3_000_000_000, 100_000_000, "required"), (0, 60_000, 3_000_000_000, 100_000_000, "required"),
    (1_000_000, 0, 0, 20_000_000, "required")])
def test_search_finds_the_edge_in_few_compiles(grow, curve, slack, per_seq, said):
    """The search against a simulated compiler (no libtpu): m sequences need m * per_seq + temporaries that
    grow by `grow` bytes a sequence (gpt-oss-20b's budget program: ~4 MB), or by `curve` m^2; the compiler
    refuses past `slack` bytes over the HBM with one of libtpu's two messages (`said`: the totals in GiB to
    two decimals, or the excess in MiB), and below
    that compiles what plan's own sum may still reject; and it refuses a block table (2 KiB a sequence, plus
    ~11 KiB) over 1 MiB of SMEM with its own message (the last case, where SMEM binds first: gpt-oss-120b
    on a TPU7x with an FP8 cache). The answer is the brute-force largest m, found in at most two compiles
    from a first guess that overshoots (temporaries taken as constant) or stops at SMEM's cap, three where
    they curve;
    with the overshoot compiled, its temporaries bound the answer's (no compile to confirm it)."""
    from quantkit.plan import _largest_fit

    gib, room, base, table = 2 ** 30, 18 * 2 ** 30, 13 * 2 ** 30, 2048
    temp = lambda m: 50_000_000 + grow * m + curve * m * m  # noqa: E731
    smem = lambda m: m * table + 10_952  # noqa: E731  (gpt-oss-120b's other SMEM on TPU7x)
    calls = []

    def fits_at(m, decode=True):
        calls.append(m)
        total = base + m * per_seq + temp(m)
        if total > base + room + slack:  # refused outright
            over = total - base - room
            return False, 0, 1.0, (f"RESOURCE_EXHAUSTED: the total memory required for HLO temporaries "
                                   f"({total / gib:.2f}G) exceeds available HBM ({(base + room) / gib:.2f}G)."
                                   if said == "required" else "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: "
                                   f"Ran out of memory in memory space hbm. Exceeded hbm capacity by "
                                   f"{over / 2 ** 20:.2f}M."), []
        if smem(m) > 2 ** 20:
            return False, 0, 1.0, (f"RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in "
                                   f"memory space smem. Used 1.01M of 1.00M smem. Exceeded smem capacity by "
                                   f"{(smem(m) - 2 ** 20) / 1024:.1f}K."), []
        return m * per_seq + temp(m) <= room, temp(m), 1.0, "", []

    best = max(m for m in range(1, 2000) if m * per_seq + temp(m) <= room and smem(m) <= 2 ** 20)
    found, seconds = _largest_fit(fits_at, 16, True, temp(16), "", room, per_seq, table, None)
    most = 3 if curve else 1 if slack > 2 * 10 ** 9 else 2
    assert found == best and len(calls) <= most and seconds == len(calls), (found, best, calls)


@pytest.mark.slow
def test_gemma3_27b_bf16_does_not_fit(tmp_path):
    code, r = _plan(tmp_path, scheme="DENSE", max_num_seqs=16, search=False, cost=False)
    assert code == 4 and not r["fits"] and r["hbm_bytes"]["weights"] > 50 * 10**9 > r["hbm_bytes"]["capacity"]
    assert r["kernels"] == [] and r["decode_step_cost"] is None  # cost=False: no shallow variants compiled


GEMMA4_31B = Path(__file__).resolve().parents[1] / "benchmarks" / "configs" / "gemma-4-31B-it.json"
QWEN35_35B = GEMMA4_31B.with_name("qwen3.5-35B-A3B.json")  # Gated DeltaNet + gated attention + shared expert


@pytest.mark.slow
def test_gemma4_31b_published_multimodal_config_fits_a_v6e_with_fp8_kv(tmp_path):
    """`plan` on the published Gemma4ForConditionalGeneration config.json as it is (nested text_config):
    W4A16 g32 with an FP8 KV cache fits one v6e at 16 x 2048 (--max-num-batched-tokens 128: steps of at
    most 128 tokens), with the cache laid out per layer kind.

    Analytical bytes (text_config: hidden 5376, MLP 21504, 60 layers of which 10 full, 32 heads; sliding
    layers 16 KV heads x 256, full layers 4 KV heads x 512 with K = V (no v_proj), vocab 262144 tied):
    linear weights 50 x 5376 x (8192 + 4096 + 4096 + 8192 + 3 x 21504) + 10 x 5376 x (16384 + 2048 + 16384
    + 3 x 21504) -> int4 + g32 bf16 scales; the embedding bf16. KV at 1 byte a value: 16-token pages of
    the kind's width; full layers 128 pages a sequence, the sliding pool 64 + 2 a sequence + 8 for one
    step's chunks (128 tokens), + scratch.

    No weight-sized temporary: no float array of a weight's shape in the compiled steps (test_dequantized_
    weight_detector: the control); the temporaries are activations of the 128-token step, the attention kernel
    reads pages in place. The compiled decode step reads about the weights and the KV cache once (XLA's own
    cost analysis; the Pallas kernels count by their declared CostEstimates): within 1.15x, which a per-step
    copy of the 2.8 GB embedding or weights staged into VMEM before each gmm_v2 call (1.69x) would break."""
    code, r = _plan(tmp_path, GEMMA4_31B, scheme="W4A16", group_size=32, max_num_seqs=16, search=False,
                    kv_cache_dtype="fp8", prefill_cost=False, max_num_batched_tokens=128)
    # (the prefill cost: test_plan_counts_each_...; 128-token steps: a third less compile time than 512's)
    assert code == 0 and r["fits"] and r["kv_cache_dtype"] == "float8_e4m3fn" and r["target"] == "v6e"
    assert r["max_num_batched_tokens"] == 128
    linear = 50 * 5376 * (8192 + 4096 + 4096 + 8192 + 3 * 21504) + 10 * 5376 * (16384 + 2048 + 16384 + 3 * 21504)
    analytical = linear // 2 + linear // 32 * 2 + 262144 * 5376 * 2
    h = r["hbm_bytes"]
    assert abs(h["weights"] - analytical) < 0.02 * analytical
    kv = 16 * (50 * 16 * 2 * 256 * (1 + 16 * 66 + 8) + 10 * 4 * 2 * 512 * (1 + 16 * 128))
    assert h["kv_cache"] == kv and h["total"] <= h["capacity"]
    assert r["dequantized_weight_buffers"] == [] and 0 < h["temporaries"] < 1 << 30
    c = r["decode_step_cost"]
    assert c["floor_bytes"] == h["weights"] + h["kv_cache"] and 0.95 < c["ratio_to_floor"] < 1.15
    assert {k["path"] for k in r["kernels"]} == {"gmm_v2"}
    assert all(0 < k["vmem_bytes"] <= 128 << 20 for k in r["kernels"]) and r["compile_seconds"] > 0
    assert r["max_num_seqs_that_fit"] is None  # search=False (the search: test_search_finds_...)
    assert r["prefill_step_cost"] is None


def test_plan_without_libtpu_says_how_to_install_it(tmp_path, monkeypatch):
    import importlib.util

    from quantkit.errors import Unsupported
    from quantkit.plan import plan

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    (tmp_path / "config.json").write_text(json.dumps(GEMMA_27B))
    with pytest.raises(Unsupported, match=r"pip install 'quantkit\[tpu\]'"):
        plan(tmp_path / "config.json")



@pytest.mark.slow
@pytest.mark.parametrize("hidden,dequantized", [(384, False), (320, True)])
def test_dequantized_weight_detector(tmp_path, hidden, dequantized):
    """Control for the Gemma 4 31B check above: a 320-wide input has no 128-multiple tile, so gmm_v2 cannot serve those
    layers and the XLA path dequantizes their weights in HBM; the plan must see those buffers, and none at
    384. (Shapes chosen so that no activation [128 or 4 rows, d] has a weight's shape.)"""
    cfg = {**GEMMA_27B, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": 2 * hidden, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "vocab_size": 1024, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from quantkit.plan import plan

    r = plan(tmp_path / "config.json", "v6e", 128, 4, scheme="W4A16", group_size=32, search=False, cost=False,
             max_num_batched_tokens=128)
    assert r["fits"] and bool(r["dequantized_weight_buffers"]) == dequantized
    assert any(k["path"].startswith("xla") for k in r["kernels"]) == dequantized


SMALL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024, "intermediate_size": 2048,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
         "vocab_size": 4096, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "tie_word_embeddings": False}


def _eagle3_head(path: Path) -> tuple[int, int]:
    """A random EAGLE-3 head for SMALL at `path` (hidden 1024, 8 / 4 heads of 128, MLP 2048, a 1024-token draft
    vocabulary with its d2t map; every dimension a multiple of 128, so that no TPU tile pads it): (the bytes
    the Runner holds it in: matrices bf16, norms float32, d2t int32; those of its matrices alone)."""
    import numpy as np
    from safetensors.numpy import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps({**SMALL, "architectures": ["LlamaForCausalLMEagle3"],
                                                  "num_hidden_layers": 1, "draft_vocab_size": 1024,
                                                  "eagle_aux_hidden_state_layer_ids": [0, 1, 1]}))
    h, m, kv = 1024, 2048, 4 * 128
    shapes = {"fc.weight": (h, 3 * h), "midlayer.self_attn.q_proj.weight": (h, 2 * h),
              "midlayer.self_attn.k_proj.weight": (kv, 2 * h), "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, h), "midlayer.mlp.gate_proj.weight": (m, h),
              "midlayer.mlp.up_proj.weight": (m, h), "midlayer.mlp.down_proj.weight": (h, m),
              "lm_head.weight": (1024, h)}
    norms = ["midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
             "midlayer.post_attention_layernorm.weight", "norm.weight"]
    rng = np.random.default_rng(0)
    tensors = {k: rng.standard_normal(s).astype(np.float16) for k, s in shapes.items()}
    tensors |= {k: np.ones(h, np.float16) for k in norms} | {"d2t": np.arange(1024, dtype=np.int64) * 3}
    save_file(tensors, path / "model.safetensors")
    matrices = int(sum(np.prod(s) for s in shapes.values()))
    return 2 * matrices + len(norms) * h * 4 + 1024 * 4, matrices


def test_draft_heads_are_refused_where_serve_refuses_them(tmp_path):
    """A draft head on several chips, or `mtp` for a model without an MTP layer: one line, before anything
    compiles (serve refuses both)."""
    from quantkit.errors import Unsupported
    from quantkit.plan import plan
    from quantkit.runtime.speculative import SpeculativeConfig

    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    _eagle3_head(tmp_path / "head")
    with pytest.raises(InvalidInput, match="run on one device"):
        plan(tmp_path / "config.json", "v6e", 128, 4, tp=2, speculative=SpeculativeConfig("eagle3", 3, model=str(
            tmp_path / "head")))
    with pytest.raises(Unsupported, match="method 'mtp' needs a Qwen3.5 model with its MTP layer"):
        plan(tmp_path / "config.json", "v6e", 128, 4, speculative=SpeculativeConfig("mtp", 3))


def test_tensor_parallel_plan_on_a_2x2_slice(tmp_path):
    """--tp 4 compiles for v6e:2x2 with weights and KV heads split as the runtime splits them; HBM is per
    chip. Per chip, analytically: q/k/v/gate/up split by output columns and o/down by input rows, so a
    quarter of the int4 values and group-32 bf16 scales of the 9M linear parameters per layer; the bf16
    lm_head split by columns and the embedding (8 MiB) by vocabulary rows. KV: one of 4 heads per chip. Each
    layer all-reduces its attention and MLP outputs: what crosses the chips is within 2x that floor, nothing
    weight-sized, and no other kind of collective."""
    from quantkit.plan import plan

    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    r = plan(tmp_path / "config.json", "v6e", 128, 4, tp=4, scheme="W4A16", group_size=32, search=False,
             prefill_cost=False, max_num_batched_tokens=128)
    c = r["decode_step_collectives"]
    assert c["floor_bytes"] <= c["total"] < 2 * c["floor_bytes"], c
    assert set(c["bytes"]) <= {"all-reduce", "all-gather"}, c  # no collective-permute (RoPE after the split)
    assert r["fits"] and r["topology"] == "v6e:2x2" and r["tp"] == 4
    linear = 2 * (1024 * 1024 * 2 + 1024 * 512 * 2 + 3 * 1024 * 2048)
    analytical = (linear // 2 + linear // 32 * 2) // 4 + 4096 * 1024 * 2 * (1 / 4 + 1 / 4)
    assert abs(r["hbm_bytes"]["weights"] - analytical) < 0.02 * analytical
    assert r["hbm_bytes"]["kv_cache"] == 2 * 2 * (1 + 4 * 8) * 16 * 1 * 128 * 2
    shapes = {k["name"]: k["shape"] for k in r["kernels"]}
    assert shapes == {"layers.*.q": [1, 1024, 256], "layers.*.k": [1, 1024, 128], "layers.*.o": [1, 256, 1024],
                      "layers.*.gate": [1, 1024, 512], "layers.*.down": [1, 512, 1024]}
    # (128-token prefill chunks, so no activation has a weight shard's shape; see the detector's control)
    assert {k["path"] for k in r["kernels"]} == {"gmm_v2"} and r["dequantized_weight_buffers"] == []


@pytest.mark.slow
def test_gated_deltanet_decode_program_on_two_devices(tmp_path):
    """A Qwen3.5-MoE plan with expert parallelism over 2 devices (v6e:1x2) compiles its decode bucket as the
    DECODE program, whose GDN layers run the decode kernel on every device under shard_map (their states and
    inputs replicated; a Mosaic kernel cannot be partitioned by XLA, which refuses such a program), and
    counts that program's collectives and bytes; Gated DeltaNet models compile one DECODE program for each
    bucket a decode step takes, beside the one step program per bucket (steps of at most 32 tokens here:
    buckets 8, 16, 32)."""
    from helpers import qwen3_5_model
    from quantkit.plan import plan

    qwen3_5_model(True, head_dim=64).save_pretrained(tmp_path)
    r = plan(tmp_path / "config.json", "v6e", 256, 8, tp=2, ep=True, scheme="W4A16", group_size=32, search=False,
             prefill_cost=False, max_num_batched_tokens=32)
    assert r["fits"] and r["topology"] == "v6e:1x2"
    h = r["hbm_bytes"]
    assert r["decode_step_cost"]["bytes_accessed"] > h["recurrent_state"] - h["of_recurrent_state_snapshots"]
    assert r["step_programs"] == len((8, 16, 32)) + 1  # + the DECODE program of bucket 8


def test_prefix_snapshot_slots_are_counted(tmp_path):
    """As serve runs a Qwen3.5 with prefix caching, its cache holds max_num_seqs more GDN state slots for the
    prefix snapshots (runtime/cache.py): 8 + 1 + 8 slots against 9 without, so the state grows by 8 / 9 of
    its size, which `of_recurrent_state_snapshots` reports; the decode step's floor is the same either way
    (a step reads the sequences' slots, not the snapshots). Steps of at most 16 tokens: smaller compiles."""
    from helpers import qwen3_5_model
    from quantkit.plan import plan

    qwen3_5_model(True, head_dim=64).save_pretrained(tmp_path)
    reports = [plan(tmp_path / "config.json", "v6e", 256, 8, scheme="W4A16", group_size=32, search=False, cost=False,
                    max_num_batched_tokens=16, prefix_caching=p) for p in (True, False)]
    assert reports[0]["decode_step_estimate"]["bytes"] == reports[1]["decode_step_estimate"]["bytes"]
    on, off = (r["hbm_bytes"] for r in reports)
    assert off["of_recurrent_state_snapshots"] == 0 and off["recurrent_state"] > 0
    assert on["of_recurrent_state_snapshots"] == on["recurrent_state"] - off["recurrent_state"]
    assert on["of_recurrent_state_snapshots"] * 9 == off["recurrent_state"] * 8
    assert on["total"] - off["total"] == on["of_recurrent_state_snapshots"] + on["temporaries"] - off["temporaries"]


def test_fp8_kv_cache_halves_the_kv_bytes(tmp_path):
    """--kv-cache-dtype compiles the step with an FP8 cache (and its per-layer scales): 2 layers x 33 pages x
    16 tokens x 4 KV heads x (k, v) x 128 x 1 byte, half the bf16 cache, in the compiled layout."""
    from quantkit.plan import plan

    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    r = {kv: plan(tmp_path / "config.json", "v6e", 128, 4, scheme="W4A16", group_size=32, search=False,
                  max_num_batched_tokens=128, kv_cache_dtype=kv, cost=False) for kv in ("auto", "fp8_e5m2")}
    assert r["auto"]["kv_cache_dtype"] == "bfloat16" and r["fp8_e5m2"]["kv_cache_dtype"] == "float8_e5m2"
    assert r["fp8_e5m2"]["hbm_bytes"]["kv_cache"] == 2 * 33 * 16 * 4 * 2 * 128 == r["auto"]["hbm_bytes"]["kv_cache"] // 2
    assert r["fp8_e5m2"]["fits"]
    # each plan also estimates the other KV dtype from its own compile
    assert r["auto"]["kv_cache_by_dtype"]["fp8"] == {"kv_cache": r["fp8_e5m2"]["hbm_bytes"]["kv_cache"],
                                                     "max_num_seqs_that_fit": None, "compiled": False}
    assert r["fp8_e5m2"]["kv_cache_by_dtype"]["bf16"]["kv_cache"] == r["auto"]["hbm_bytes"]["kv_cache"]
    assert r["auto"]["kv_cache_by_dtype"]["bf16"]["compiled"] and r["fp8_e5m2"]["kv_cache_by_dtype"]["fp8"]["compiled"]


def test_tensor_parallel_plan_refuses_what_it_cannot_place(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, "num_attention_heads": 12, "head_dim": 64}))
    cmd = [sys.executable, "-m", "quantkit.cli", "plan", str(tmp_path / "config.json"), "--scheme", "W4A16"]
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    usage = subprocess.run(cmd + ["--tp", "3"], capture_output=True, text=True, timeout=300, env=env)
    assert usage.returncode == 2 and "1, 2, 4 or 8" in usage.stderr
    heads = subprocess.run(cmd + ["--tp", "8"], capture_output=True, text=True, timeout=300, env=env)
    assert heads.returncode == 1 and "12 attention heads do not split over 8 devices" in heads.stderr
    assert "Traceback" not in heads.stderr and heads.stdout == ""
    # widths a group size does not divide (gpt-oss's 2880 at g128): refused as convert refuses them, not a crash
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, "hidden_size": 96}))
    groups = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert groups.returncode == 1 and "96 input features are not divisible by group size 128; group sizes that " \
        "divide it: 16, 32, or -1" in groups.stderr and "Traceback" not in groups.stderr


@pytest.mark.slow
def test_gemma3_27b_bf16_on_a_2x2_slice(tmp_path):
    """Gemma-3-27B in bf16 does not fit one v6e (above) but fits a v6e:2x2 slice: per chip a quarter of every
    linear weight (heads, columns or rows) and of the tied 262208 x 5376 embedding (vocabulary rows), and a
    quarter of the KV cache (16 KV heads, 4 a chip). (What crosses the chips: the small 2x2 plan below.)"""
    code, r = _plan(tmp_path, scheme="DENSE", max_num_seqs=16, search=False, tp=4, cost=False)
    assert code == 0 and r["fits"] and r["topology"] == "v6e:2x2"
    linear = 62 * (5376 * 4096 * 2 + 5376 * 2048 * 2 + 3 * 5376 * 21504)
    analytical = (linear * 2 + 262208 * 5376 * 2) / 4
    h = r["hbm_bytes"]
    assert abs(h["weights"] - analytical) < 0.02 * analytical and h["kv_cache"] == _kv_bytes(16) // 4


@pytest.mark.slow
def test_qwen3_30b_a3b_expert_parallel_on_a_2x2_slice(tmp_path):
    """Qwen3-30B-A3B W4A16 g128 with --enable-expert-parallel on v6e:2x2: each chip holds 32 of the 128
    experts of all 48 layers, a quarter of the expert bytes (48 x 128 x 3 x 2048 x 768 int4 values + g128
    bf16 scales), and runs each projection as one gmm_v2 call over its local group [32, k, n]; no weight is
    dequantized or gathered: what crosses the chips is the per-layer all-reduces of [16, 2048] activations
    and a few bytes of sampling candidates, within 2x the floor. Without expert parallelism each expert
    would be split four ways, which its down projection's 6 scale groups of 128 inputs cannot: refused."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    from quantkit.plan import plan

    ep = plan(tmp_path / "config.json", "v6e", 2048, 16, tp=4, scheme="W4A16", group_size=128, search=False, ep=True,
              prefill_cost=False)
    experts = 48 * 128 * 3 * 2048 * 768 * (1 / 2 + 2 / 128)
    h = ep["hbm_bytes"]
    assert ep["fits"] and ep["expert_parallel"] and abs(h["of_weights_experts"] - experts / 4) < 0.01 * experts / 4
    kernels = {k["name"]: (k["shape"], k["path"]) for k in ep["kernels"]}
    assert kernels["layers.*.experts_gate"] == ([32, 2048, 768], "gmm_v2") and kernels["layers.*.experts_down"] == ([32, 768, 2048], "gmm_v2")
    assert ep["dequantized_weight_buffers"] == []
    c = ep["decode_step_collectives"]
    assert c["floor_bytes"] <= c["total"] < 2 * c["floor_bytes"], c
    with pytest.raises(InvalidInput, match="down: 6 scale groups along the input features do not split over 4"):
        plan(tmp_path / "config.json", "v6e", 2048, 16, tp=4, scheme="W4A16", group_size=128, search=False)


SMALL_MOE = {**SMALL, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_key_value_heads": 2,
             "moe_intermediate_size": 256, "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True}


@pytest.mark.slow
def test_data_parallel_expert_parallel_plan_on_tpu7x(tmp_path):
    """--data-parallel-size 8 --enable-expert-parallel on tpu7x 2x2x1 (8 TensorCores), 64 sequences: each
    device holds 8 sequences' KV pages (2 layers x (1 + 8 x 16) pages x 16 tokens x 2 KV heads x (k, v) x
    128 x 2 bytes, the heads not split) and 2 of the 16 experts of each layer (an eighth of the expert
    bytes), the attention weights whole. The compiled decode step (8 tokens a device) gathers per MoE layer
    every device's tokens (64 x 1024 bf16) and their packed routing (64 x 2 x 4 int32), and reduce-scatters
    its own 8 rows back: exactly those bytes, the rest (the sampled tokens' gathers) within 1.1x of that
    floor."""
    from quantkit.plan import plan

    (tmp_path / "config.json").write_text(json.dumps(SMALL_MOE))
    r = plan(tmp_path / "config.json", "v7x", 256, 64, dp=8, ep=True, scheme="W4A16", group_size=128, search=False,
             prefill_cost=False, max_num_batched_tokens=256)
    assert r["fits"] and r["topology"] == "tpu7x:2x2x1" and r["data_parallel_size"] == 8 and r["expert_parallel"]
    h = r["hbm_bytes"]
    assert h["kv_cache"] == 2 * (1 + 8 * 16) * 16 * 2 * 2 * 128 * 2
    experts = 2 * 16 * 3 * 1024 * 256 * (1 / 2 + 2 / 128)
    assert abs(h["of_weights_experts"] - experts / 8) < 0.01 * experts / 8
    shapes = {k["name"]: k["shape"] for k in r["kernels"]}
    assert shapes["layers.*.o"] == [1, 1024, 1024] and shapes["layers.*.experts_gate"] == [2, 1024, 256]
    c = r["decode_step_collectives"]
    assert c["bytes"]["all-gather"] == 2 * 64 * (1024 * 2 + 2 * 4 * 4)
    assert c["bytes"]["reduce-scatter"] == 2 * 8 * 1024 * 2
    assert c["floor_bytes"] <= c["total"] <= 1.1 * c["floor_bytes"], c


LLAMA_70B = {**SMALL, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0}


@pytest.mark.slow
def test_v7x_plans_count_tensorcores(tmp_path):
    """A v7x chip is two JAX devices (TensorCores) with 94.75 GiB each, libtpu's own limit: a Llama-3-70B-shaped
    bf16 model (80 x (2 x 8192 x 8192 + 2 x 8192 x 1024 + 3 x 8192 x 28672) + 2 x 128256 x 8192 parameters x 2
    bytes = 141.1 GB) does not fit one TensorCore (libtpu refuses the program: exit 4) although it is below a
    chip's 192 GiB; --tp 4 is two chips (tpu7x:1x2x1), a quarter of the weights on each TensorCore. Steps of
    --max-num-batched-tokens 256, as serve would run them at --max-model-len 128 (several sequences' chunks)."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    cmd = [sys.executable, "-m", "quantkit.cli", "plan", str(tmp_path / "config.json"), "--target", "v7x",
           "--scheme", "DENSE", "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
           "--no-search", "--no-cost", "--json"]
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    one, four = (subprocess.run(cmd + ["--tp", tp], capture_output=True, text=True, timeout=900, env=env)
                 for tp in ("1", "4"))
    assert one.returncode == 4 and four.returncode == 0, (one.stderr[-2000:], four.stderr[-2000:])
    one, four = json.loads(one.stdout), json.loads(four.stdout)
    assert not one["fits"] and "HBM" in one["compiler_message"] and "94.75G" in one["compiler_message"]
    assert four["fits"] and four["topology"] == "tpu7x:1x2x1" and four["chips"] == 2
    assert four["max_num_batched_tokens"] == 256  # serve's budget, though longer than one sequence: 4 share it
    assert four["hbm_bytes"]["capacity"] == int(94.75 * (1 << 30))
    weights = (80 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672) + 2 * 128256 * 8192) * 2
    assert abs(four["hbm_bytes"]["weights"] - weights / 4) < 0.01 * weights / 4


def test_fp8_estimate_scales_the_kv_pages_not_the_recurrent_state():
    """kv_cache_by_dtype's other-dtype estimate: KV pages take half the bytes in FP8, a Gated DeltaNet state
    slot (float32) the same; with 10 GiB of room, 1 GiB fixed (0.5 pages + 0.5 state) and 0.1 GiB a sequence
    (0.06 pages + 0.04 state), bf16 -> fp8 fits (10 - 0.25 - 0.5) / (0.03 + 0.04) = 132 sequences."""
    from quantkit.plan import _kv_by_dtype

    g = 1 << 30
    by = _kv_by_dtype(4 * g, 2, False, 90, True, 10 * g, (g // 2, g // 2), (int(0.06 * g), int(0.04 * g)))
    assert by["bf16"] == {"kv_cache": 4 * g, "max_num_seqs_that_fit": 90, "compiled": True}
    assert by["fp8"] == {"kv_cache": 2 * g, "max_num_seqs_that_fit": 132, "compiled": False}


LLAMA_8B = {**SMALL, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "num_experts": 128,
                 "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                 "tie_word_embeddings": False}


@pytest.mark.slow
@pytest.mark.parametrize("name,cfg", [("llama-3-8b", LLAMA_8B), ("qwen3-30b-a3b", QWEN3_30B_A3B),
                                      ("head-64", {**SMALL, "head_dim": 64, "num_attention_heads": 16}),
                                      ("head-256", {**SMALL, "head_dim": 256, "num_attention_heads": 8}),
                                      ("head-512", {**SMALL, "head_dim": 512, "num_attention_heads": 8,
                                                    "num_key_value_heads": 2}),
                                      ("qwen3.5-35b-a3b", json.loads(QWEN35_35B.read_text()))])
def test_step_compiles_deviceless_for_v6e(name, cfg):
    """The serving step (decode bucket, 16 sequences of 2048 tokens, W4A16 g128) compiles for a v6e with
    every quantized matmul on gmm_v2 and attention on the paged-attention kernel, for the families' and
    Gemma 4's head sizes and Qwen3.5 (its Gated DeltaNet layers with their state slots); its temporaries
    stay small (the kernel reads pages in place, a GDN layer updates its 16 rows' states)."""
    import jax.numpy as jnp

    from quantkit.formats.ct_writer import writable_config
    from quantkit.runtime.aot import compile_for
    from quantkit.runtime.cache import cache_layout
    from quantkit.runtime.models import from_hf
    from quantkit.runtime.step import empty_batch, step_function

    c = from_hf(cfg)
    params = abstract(c, parse_quantization_config(writable_config("W4A16", 128, ["lm_head"])))
    layout = cache_layout(c, 2048, 16)
    kv = layout.cache(lambda k, s, d: jax.ShapeDtypeStruct(s, d or jnp.bfloat16))
    batch = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), empty_batch(16, 16, layout, 16, c.vocab_size))
    compiled, seconds = compile_for("v6e", step_function(c, 16), params, kv, jax.ShapeDtypeStruct((17,), jnp.int32),
                                    batch, donate=(1, 2), pinned=(0,))
    hlo = compiled.as_text()
    assert hlo.count("custom_call_target=\"tpu_custom_call\"") >= 2, name  # gmm_v2 and attention kernels
    # weights row-major as the Runner places them: left to XLA, Qwen3-30B-A3B's stacked down-proj expert scales
    # [6144, 6, 2048] (6 scale rows per expert) were laid out transposed and copied back for the kernel every
    # step, 151 MB of its 231 MB of temporaries (seen in the HLO)
    # a GDN layer also holds its 16 rows' states as gathered, as updated, and two state-sized intermediates
    # of the recurrence (float32; 33.5 MB a copy for Qwen3.5-35B-A3B, measured 122 MiB in all)
    states = 4 * 16 * c.gdn_dims[1] * 4
    assert compiled.memory_analysis().temp_size_in_bytes < 0.1 * (1 << 30) + states, name


@pytest.mark.parametrize("target,scheme,mxu", [("v6e", "W8A8", "int8"), ("v7x", "FP8_DYNAMIC", "fp8")])
def test_plan_counts_each_programs_matmul_flops_by_mxu_type(tmp_path, monkeypatch, target, scheme, mxu):
    """The decode (8-token bucket of 4 sequences) and prefill (the 512-token budget) programs' matmul FLOPs
    by the MXU operand type, from the compiled HLO: every quantized linear multiplies 8-bit rows on the
    chip's 8-bit MXU (v6e: int8, v7x: fp8), exactly 2 x tokens x the 9.4M linear weights of the two layers;
    what stays bf16 is attention and the lm_head (bf16, ignored by the scheme); nothing lands under the
    other 8-bit type. The compute-bound roofline takes each type's FLOPs at the chip's published rate (v6e:
    918 TFLOP/s bf16, 1,836 TOP/s int8; a v7x TensorCore: 1,153.5 bf16, 2,307 fp8), the memory time the
    bytes at its HBM bandwidth (1.64, 3.685 TB/s).

    The v6e plan also serves an EAGLE-3 head (`_eagle3_head`, 3 drafts; its programs shared, not compiled
    again): the weights hold exactly the head's bytes more, the KV cache one more full-attention layer of
    the target's shape (2 layers x 129 pages -> 3), the decode step neither (its floor and FLOPs above are
    the target's), and the verifying step (4 rows x 4 tokens: the 16-token bucket) runs the target once over
    all 16 tokens (int8 FLOPs exactly 2 x 16 x its linear weights) and the bf16 head over them too (at least
    2 x 16 x its 15M matrix weights), reading at least the head's matrices beyond the decode step. The fit
    counts the temporaries of the verifying program serve runs at the full budget (compiled with the
    head's longer `last`: step.head_entry), not only the plain programs'."""
    from quantkit.plan import plan
    from quantkit.runtime import aot
    from quantkit.runtime.speculative import SpeculativeConfig

    compiled, compile_for = [], aot.compile_for

    def recording(chip, fn, *args, **kw):  # (tokens, length of `last`, temporary bytes) of each compile
        out = compile_for(chip, fn, *args, **kw)
        compiled.append((args[-1]["tokens"].shape[0], args[-2].shape[0], out[0].memory_analysis().temp_size_in_bytes))
        return out

    monkeypatch.setattr(aot, "compile_for", recording)

    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    head = target == "v6e"
    if head:
        head_bytes, matrices = _eagle3_head(tmp_path / "head")
    r = plan(tmp_path / "config.json", target, 512, 4, scheme=scheme, search=False,
             speculative=SpeculativeConfig("eagle3", 3, model=str(tmp_path / "head")) if head else None)
    linear = 2 * (1024 * 1024 * 2 + 1024 * 512 * 2 + 3 * 1024 * 2048)
    bf16, fast = {"v6e": (918e12, 1836e12), "v7x": (1153.5e12, 2307e12)}[target]
    other = {"int8": "fp8", "fp8": "int8"}[mxu]
    for key, tokens in (("decode_step_cost", 8), ("prefill_step_cost", 512)):
        c = r[key]
        flops = c["flops_by_mxu_type"]
        assert flops[mxu] == 2 * tokens * linear and flops[other] == 0, (key, flops)
        assert 2 * 1024 * 4096 <= flops["bf16"] < flops[mxu], (key, flops)  # at least one row's logits
        assert c["roofline_seconds"] == pytest.approx(flops["bf16"] / bf16 + flops[mxu] / fast, rel=1e-3)
        assert c["memory_seconds"] == pytest.approx(c["bytes_accessed"] / {"v6e": 1.64e12, "v7x": 3.685e12}[target])
    assert r["prefill_step_cost"]["tokens"] == 512
    assert {k["path"] for k in r["kernels"]} == {"gmm_v2"} and {k["mxu"] for k in r["kernels"]} == {mxu}
    h = r["hbm_bytes"]
    if not head:
        assert h["of_weights_draft_head"] == 0 and r["verify_step_cost"] is None
        return
    kv = 2 * 129 * 16 * 2 * 4 * 128 * 2  # the target's: layers x pages x tokens x (k, v) x heads x dims x bf16
    assert h["of_weights_draft_head"] == head_bytes and h["kv_cache"] == kv * 3 // 2
    assert r["decode_step_cost"]["floor_bytes"] == h["weights"] - head_bytes + kv
    v = r["verify_step_cost"]
    assert v["draft_head"] and v["tokens"] == 16 and v["flops_by_mxu_type"][mxu] == 2 * 16 * linear
    assert v["flops_by_mxu_type"]["bf16"] >= 2 * 16 * matrices
    assert v["bytes_accessed"] - r["decode_step_cost"]["bytes_accessed"] >= 2 * matrices
    verifying = [temp for t, last, temp in compiled if t == 512 and last == (4 + 1) * (2 + 3)]
    assert verifying and h["temporaries"] >= max(verifying) > 0, (compiled, h["temporaries"])


def test_mxu_flops_of_xla_dots(tmp_path):
    """XLA's own dots in a compiled v6e program, by operand type: a bf16 [256, 1024] x [1024, 512] matmul, a
    batched bf16 [4, 64, 1024] x [4, 1024, 64] one (which XLA:TPU rewrites as a convolution with a dilated
    window: only the taps that land on input count) and an int8 x int8 -> int32 [128, 512] x [512, 256]."""
    import jax.numpy as jnp

    from quantkit.plan import _mxu_flops
    from quantkit.runtime.aot import compile_for

    def f(x, w, b, i, j):
        return x @ w, jnp.einsum("bqd,bdk->bqk", b, b.swapaxes(1, 2)), jnp.dot(i, j, preferred_element_type=jnp.int32)

    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((256, 1024), jnp.bfloat16), ((1024, 512), jnp.bfloat16),
                                                   ((4, 64, 1024), jnp.bfloat16), ((128, 512), jnp.int8),
                                                   ((512, 256), jnp.int8)]]
    compiled, _ = compile_for("v6e", f, *args)
    assert _mxu_flops(compiled.as_text()) == {"bf16": 2 * 256 * 1024 * 512 + 2 * 4 * 64 * 64 * 1024,
                                              "int8": 2 * 128 * 512 * 256, "fp8": 0}


def test_a_second_plan_reads_its_programs_back_with_the_same_report(tmp_path, monkeypatch):
    """A plan's programs are kept by fingerprint (runtime/aot.py Facts): the same plan again compiles
    nothing (every program of `compile_timings` read back) and reports the same, byte for byte, temporaries,
    argument layouts (the weights' and cache's HBM), cost analysis and HLO-derived figures included; another
    --max-model-len is other programs (its cache and block tables), compiled (without the cost variants:
    one program); `plan --timings` lists them."""
    from typer.testing import CliRunner

    from quantkit.cli import app

    monkeypatch.setenv("QUANTKIT_JAX_CACHE", str(tmp_path / "cache"))
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    # a step budget of 8 tokens: the decode bucket's program is the budget's (fewer compiles, the same checks)
    args = ["plan", str(tmp_path / "config.json"), "--scheme", "W4A16", "--max-model-len", "512", "--max-num-seqs",
            "4", "--max-num-batched-tokens", "8", "--no-search", "--json"]
    runs = [CliRunner().invoke(app, a) for a in (args, args, args[:5] + ["256"] + args[6:] + ["--no-cost"])]
    first, again, other = (json.loads(r.stdout) for r in runs)
    assert not any(x["cached"] for x in first["compile_timings"]) and len(first["compile_timings"]) >= 3
    assert all(x["cached"] for x in again["compile_timings"]) and len(again["compile_timings"]) == len(
        first["compile_timings"])
    drop = ("compile_timings", "compile_seconds")
    assert {k: v for k, v in again.items() if k not in drop} == {k: v for k, v in first.items() if k not in drop}
    assert not any(x["cached"] for x in other["compile_timings"]) and other["hbm_bytes"] != first["hbm_bytes"]
    text = CliRunner().invoke(app, args[:-1] + ["--timings"]).stdout
    assert "read back: compiled before" in text and "budget step, 8 tokens, 4 sequences, 2 layers" in text
