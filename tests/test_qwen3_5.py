"""Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet + gated attention, shared-expert MoE) against transformers, and
the per-sequence state slots through the Runner and the Engine.

Tolerances as in test_runtime.py: float32 runtime vs float32 transformers 1e-4 (measured ~6e-7: the same
maths, summed in another order; the chunked delta rule here is aligned to each step's tokens, transformers'
to the whole prompt, which changes only rounding); quantized checkpoints vs transformers on the library's
decompressed weights 1e-2 (the library rounds each dequantized weight to bf16). A state equality between
runs of the same model is 1e-5: the same sums in other chunk groupings.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as T
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
from safetensors.torch import save_file

from ct_oracle import library_convert_dequantize, library_decompress, make_checkpoint
from helpers import per_expert_linears, qwen3_5_model, rel_err
from quantkit.convert import convert
from quantkit.inspect import inspect_checkpoint
from quantkit.runtime.engine import Engine, Request, Runner
from quantkit.runtime.loader import load

# what llm-compressor's Qwen3.5 / Qwen3-Next examples leave unquantized
LLMC_IGNORE = ("lm_head", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$", "re:.*linear_attn.*")


def _saved(name: str, tmp_path_factory):
    model = qwen3_5_model(name == "moe")
    path = tmp_path_factory.mktemp(f"qwen3_5_{name}")
    model.save_pretrained(path)
    return name, path, model


@pytest.fixture(scope="module", params=["dense", "moe"])
def ckpt(request, tmp_path_factory):
    return _saved(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return _saved("moe", tmp_path_factory)


def _parity(path, ref, tol, cuts=(13, 30), prompt_len=40, steps=10, dtype=jnp.float32, greedy=True):
    """The prompt prefilled in steps split at `cuts`, then `steps` greedy decode steps: logits vs the
    reference's on the whole sequence, and (`greedy`) the greedy tokens vs transformers' generate (its own
    cache)."""
    runner = Runner(load(path, dtype=dtype), max_model_len=256, page_size=8, weights="packed", scan=True)
    ids = np.random.default_rng(0).integers(0, 256, prompt_len).tolist()
    bounds = [0, *cuts, prompt_len]
    ours = [x for a, b in zip(bounds, bounds[1:]) for x in runner.forward([(0, ids[a:b], a)])]
    for i in range(steps):
        ids.append(int(ours[-1][-1].argmax()))
        ours += runner.forward([(0, [ids[-1]], prompt_len + i)])
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float().numpy()
    assert rel_err(np.concatenate(ours), theirs) < tol
    if greedy:
        prompt = torch.tensor([ids[:prompt_len]])  # the mask given: generate masks pad_token_id otherwise
        with torch.no_grad():
            hf = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, prompt_len:].tolist()
        assert ids[prompt_len:] == hf
    return runner


def test_float32_parity_chunked_prefill_and_decode(ckpt):
    _, path, ref = ckpt
    _parity(path, ref, 1e-4)


def test_long_prompt_runs_several_delta_rule_chunks(moe_ckpt):
    """150 prompt tokens: a 113-token step holds two 64-token chunks of the delta rule (state carried from
    chunk to chunk inside the step), after a 37-token step (carried between steps). (The MoE model: its
    GDN layers are the dense model's.)"""
    _, path, ref = moe_ckpt
    _parity(path, ref, 1e-4, cuts=(37,), prompt_len=150, steps=3)


def test_packed_experts_of_a_bf16_checkpoint(tmp_path):
    """Qwen3.5-MoE saved as transformers holds it in memory: each layer's experts as 3-D gate_up_proj
    [experts, 2 * inter, hidden] and down_proj tensors. The loader splits them (gate first) and matches."""
    model = qwen3_5_model(True)
    tmp_path.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    model.config.architectures = ["Qwen3_5MoeForCausalLM"]
    model.config.save_pretrained(tmp_path)
    assert "model.layers.0.mlp.experts.gate_up_proj" in model.state_dict()
    _parity(tmp_path, model, 1e-4, steps=3)


@pytest.mark.parametrize("moe", [False, True])
def test_w4a16_made_by_the_library(moe, tmp_path):
    """W4A16 (group 32) by compressed-tensors with llm-compressor's Qwen3.5 ignore list: attention, MLP,
    experts and the shared expert int4, GDN projections, router and shared-expert gate dense. Every expert
    routed (top-k = all 8) in the MoE model, so bf16 rounding of the library's weights cannot flip a top-k
    near-tie (a flip moves a token's logits far more than the tolerance). The experts are per-expert Linears,
    as llm-compressor makes them before quantizing. Logits only, through chunked prefill and decode: the
    models' top-2 logit gaps go down to 0.008 (measured) against per-token errors up to 0.0075 from the
    library's bf16 rounding, so greedy identity would test rounding luck (the float32 tests check it)."""
    model = qwen3_5_model(moe, **({"top_k": 8} if moe else {})).to(torch.bfloat16)
    for layer in model.model.layers if moe else ():
        layer.mlp.experts = per_expert_linears(layer.mlp.experts).to(torch.bfloat16)
    q = make_checkpoint(tmp_path / "q", "W4A16_G32", model=model, ignore=LLMC_IGNORE)
    library_convert_dequantize(q, tmp_path / "dense")
    ref = T.AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32).eval()
    runner = _parity(q, ref, 1e-2, greedy=False)
    layers = runner.model.params["layers"]
    assert type(layers["full"]["q"]).__name__ == "QTensor" and type(layers["linear"]["in_qkv"]).__name__ != "QTensor"
    key = "experts_gate" if moe else "gate"
    assert type(layers["linear"][key]).__name__ == "QTensor"


def test_mixed_padded_steps_equal_each_sequence_alone(moe_ckpt):
    """One ragged step with a prompt continuing after 5 tokens, a first chunk, and two decode tokens,
    padded to its token bucket with padding rows (6 slots, 4 rows): each sequence's logits equal its run
    alone (one sequence a step); then the same slots go on after a step that did not include them (their
    states must not move), and a finished slot reused by a new prompt starts from a zero state. (The MoE
    model: everything the dense one has, and routing.)"""
    name, path, _ = moe_ckpt
    model = load(path, dtype=jnp.float32)
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, 256, n).tolist() for n in (16, 5, 14, 10)]
    cut = [5, 0, 13, 9]
    extra = [[7, 8], [9], [10, 11, 12], [13]]
    one = Runner(model, max_model_len=64, max_num_seqs=5, page_size=4, scan=True)  # each sequence alone
    solo = []
    for i, (s, c, e) in enumerate(zip(seqs, cut, extra)):
        if c:
            one.forward([(i, s[:c], 0)])
        solo.append((one.forward([(i, s[c:], c)])[0], one.forward([(i, e, len(s))])[0]))
    r = Runner(model, max_model_len=64, max_num_seqs=6, page_size=4, scan=True)
    r.forward([(i, s[:c], 0) for i, (s, c) in enumerate(zip(seqs, cut)) if c])
    mixed = r.forward([(3, seqs[3][9:], 9), (0, seqs[0][5:], 5), (2, seqs[2][13:], 13), (1, seqs[1], 0)])
    for got, i in zip(mixed, (3, 0, 2, 1)):
        assert got.shape == solo[i][0].shape and rel_err(got, solo[i][0]) < 1e-5, name
    r.forward([(4, [1, 2, 3], 0)])  # another slot only
    later = r.forward([(i, e, len(s)) for i, (s, e) in enumerate(zip(seqs, extra))])
    for i, got in enumerate(later):
        assert rel_err(got, solo[i][1]) < 1e-5, (name, i)
    fresh = one.forward([(4, seqs[2], 0)])[0]
    r.pool.release(0)
    assert rel_err(r.forward([(0, seqs[2], 0)])[0], fresh) < 1e-5  # slot 0 held sequence 0's state


def test_decode_steps_run_the_decode_program(moe_ckpt):
    """Steps of one token a row run the Runner's DECODE program, whose Gated DeltaNet layers hold only the
    one-token recurrence (the plain step program chooses it or the chunked rule on device, and XLA counts
    and compiles both): its traced step has one `cond` fewer, and from the same states it gives the plain
    program's tokens and the same GDN states (1e-5: the same sums)."""
    import jax

    from quantkit.runtime.step import Row, step_function

    _, path, _ = moe_ckpt
    model = load(path, dtype=jnp.float32)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, n).tolist() for n in (9, 5, 12)]
    runners = [Runner(model, max_model_len=64, max_num_seqs=4, page_size=4, scan=True) for _ in range(2)]
    outs = []
    for r, decode in zip(runners, (True, False)):
        assert r.has_decode_program
        r.forward([(i, p, 0) for i, p in enumerate(prompts)])
        for i, p in enumerate(prompts):
            assert r.pool.reserve(i, len(p), len(p))
        batch = r.batch([Row(i, len(p), 1, [p[-1]]) for i, p in enumerate(prompts)])
        outs.append((np.asarray(r.run(batch, decode=decode)[0]), [np.asarray(a) for a in r.kv["linear"]]))
    (tok_d, state_d), (tok_p, state_p) = outs
    assert (tok_d == tok_p).all()
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(state_d, state_p))
    conds = [str(jax.make_jaxpr(step_function(model.cfg, 4, decode=d))(
        runners[0].params, runners[0].kv, runners[0].last, runners[0].empty(8))).count(" cond[") for d in (True, False)]
    assert conds[0] == conds[1] - 1, conds


@pytest.mark.slow
def test_decode_kernel_in_the_interpreted_tpu_step(tmp_path):
    """On the TPU path (its kernels in Pallas interpret mode) the DECODE program's GDN layers update each
    row's states with the decode kernels (kernels/gdn_decode.py), in place in the state cache, and the prefill
    runs the chunked rule's kernel (kernels/gdn_prefill.py): after a prefill of three sequences, a decode step
    gives the CPU path's tokens and GDN states (1e-5; the attention kernel
    and the recurrence sum in other orders), and the traced step calls the kernel. (The MoE model at head size
    64, which the attention kernel takes.)"""
    import jax

    from quantkit.runtime.ops import interpreted_tpu_kernels
    from quantkit.runtime.step import Row, step_function

    qwen3_5_model(True, head_dim=64).save_pretrained(tmp_path)
    model = load(tmp_path, dtype=jnp.float32)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, n).tolist() for n in (9, 5, 12)]

    def decode_step(r):
        r.forward([(i, p, 0) for i, p in enumerate(prompts)])
        for i, p in enumerate(prompts):
            assert r.pool.reserve(i, len(p), len(p))
        out = r.run(r.batch([Row(i, len(p), 1, [p[-1]]) for i, p in enumerate(prompts)]), decode=True)
        return np.asarray(out[0]), [np.asarray(a) for a in r.kv["linear"]]

    tok_cpu, state_cpu = decode_step(Runner(model, max_model_len=64, max_num_seqs=4, page_size=8, scan=True))
    with interpreted_tpu_kernels():
        tpu = Runner(model, max_model_len=64, max_num_seqs=4, page_size=8, scan=True)
        tok_tpu, state_tpu = decode_step(tpu)
        jaxpr = str(jax.make_jaxpr(step_function(model.cfg, 8, decode=True))(tpu.params, tpu.kv, tpu.last, tpu.empty(8)))
        prefill = str(jax.make_jaxpr(step_function(model.cfg, 8))(tpu.params, tpu.kv, tpu.last, tpu.empty(32)))
    assert (tok_tpu == tok_cpu).all()
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(state_tpu, state_cpu))
    assert "name=gdn_decode" in jaxpr and "name=conv_decode" in jaxpr and "name=gdn_prefill" in prefill


def test_engine_serves_staggered_requests_without_prefix_caching(moe_ckpt):
    """Six requests of different lengths through four slots, one newcomer every other step, prompts
    chunked by a 16-token budget: each output equals its greedy run alone; prefix caching is off (no
    page holds a GDN state) even when asked for, without state snapshot slots, and every slot comes back. (The MoE model: its layers
    hold everything the dense one's do.)"""
    _, path, _ = moe_ckpt
    model = load(path, dtype=jnp.float32)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(3, 40, 6)]
    lengths = [5, 12, 9, 20, 3, 15]
    one = Runner(model, max_model_len=128, max_num_seqs=6, page_size=8, scan=True)

    def alone(slot, p, n):
        logits, out = one.forward([(slot, p, 0)])[0][-1], []
        for i in range(n):
            out.append(int(np.argmax(logits)))
            logits = one.forward([(slot, [out[-1]], len(p) + i)])[0][-1]
        return out

    engine = Engine(Runner(model, max_model_len=128, max_num_seqs=4, page_size=8, max_num_batched_tokens=16,
                           scan=True), prefix_caching=True)
    assert not engine.prefix_caching
    reqs = []
    for p, n in zip(prompts, lengths):
        reqs.append(engine.submit(Request(p, n)))
        engine.step()
        engine.step()
    while engine.busy():
        engine.step()
    for i, (r, p, n) in enumerate(zip(reqs, prompts, lengths)):
        assert r.out == alone(i, p, n)
    assert engine.pages_used == 0 and sorted(engine.free_slots) == [0, 1, 2, 3]


@pytest.mark.slow
def test_prefix_caching_with_gdn_state_snapshots(moe_ckpt):
    """Prefix caching for a hybrid model (cache.py, engine `_chunk` / `_snapshot` / `_reuse`): 8-token pages,
    16-token budget, so a 29-token prompt runs as chunks [0, 16), [16, 24) (its last chunk stopped at the last
    page boundary before its last token) and [24, 29), its states kept after 16 and after 24. A follow-up turn
    (the prompt, its answer and more: 39 tokens) hits 24 tokens and keeps its states after 32; a prompt
    sharing 20 tokens, diverging mid-page, hits 16 (the last snapshot within its whole shared pages). With
    one snapshot slot, the one after 16 is evicted by the one after 24, and that prompt hits nothing. A
    prompt whose cached KV pages end past its last snapshot ends a chunk there, so that the next prompt sharing
    them (a system prompt) hits all of them. Each hit's greedy tokens and their logprobs equal a run
    without prefix caching (1e-5: the same sums, in other chunk groupings)."""
    _, path, _ = moe_ckpt
    model = load(path, dtype=jnp.float32)
    rng = np.random.default_rng(6)
    first = rng.integers(3, 256, 29).tolist()
    other = first[:20] + rng.integers(3, 256, 11).tolist()

    def engine(snapshots: int) -> Engine:
        return Engine(Runner(model, max_model_len=128, max_num_seqs=2, page_size=8, max_num_batched_tokens=16,
                             scan=True, prefix_states=snapshots), prefix_caching=bool(snapshots))

    def run(e: Engine, prompt: list) -> tuple[list, list, int]:
        hits, got = e.prefix_hits, []
        r = e.submit(Request(prompt, 4, logprobs=0, on_update=lambda u: got.extend(lp for _, lp, _ in u.logprobs)))
        while e.busy():
            e.step()
        return r.out, got, e.prefix_hits - hits

    cold = engine(0)
    assert not cold.prefix_caching
    warm = engine(3)
    assert warm.prefix_caching and warm.pool.layout.snapshots == 3
    out, _, hits = run(warm, first)
    assert hits == 0 and len(warm.pool.snaps) == 2
    for prompt, want in ((first + out + rng.integers(3, 256, 6).tolist(), 24), (other, 16)):
        tokens, logprobs, hits = run(warm, prompt)
        ref_tokens, ref_logprobs, _ = run(cold, prompt)
        assert hits == want and tokens == ref_tokens
        assert np.allclose(logprobs, ref_logprobs, rtol=1e-5, atol=1e-5), (logprobs, ref_logprobs)
    small = engine(1)
    run(small, first)
    tokens, _, hits = run(small, other)
    assert hits == 0 and tokens == run(cold, other)[0]
    assert warm.pages_used == 0 and sorted(warm.free_slots) == [0, 1]
    # a 32-token budget: the first prompt runs as [0, 24) and [24, 29), states kept after 24 only; the
    # second (20 tokens shared) finds 16 tokens of KV pages but no states there, so its first chunk ends at
    # 16 and keeps them; the third (the same 20 tokens, then its own) hits those 16
    wide = Engine(Runner(model, max_model_len=128, max_num_seqs=2, page_size=8, max_num_batched_tokens=32,
                         scan=True, prefix_states=3), prefix_caching=True)
    third = first[:20] + rng.integers(3, 256, 9).tolist()
    assert [run(wide, p)[2] for p in (first, other, third)] == [0, 0, 16]
    assert run(wide, third)[0] == run(cold, third)[0]


def test_multimodal_checkpoint_serves_its_text_decoder(tmp_path):
    """Qwen3_5ForConditionalGeneration: the decoder under model.language_model., the vision tower and the
    MTP head (ignored, as transformers' CausalLM ignores `mtp.*`) left aside."""
    text = qwen3_5_model(False)
    vision = T.Qwen3_5VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128)
    full = T.Qwen3_5ForConditionalGeneration(T.Qwen3_5Config(text_config=text.config.to_dict(),
                                                             vision_config=vision.to_dict()))
    full.model.language_model.load_state_dict(text.model.state_dict())
    full.lm_head.load_state_dict(text.lm_head.state_dict())
    state = {k: v.contiguous() for k, v in full.state_dict().items()}
    state["mtp.fc.weight"] = torch.zeros(128, 256)  # what a published checkpoint carries beside the decoder
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    full.config.architectures = ["Qwen3_5ForConditionalGeneration"]
    full.config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    _parity(tmp_path, text, 1e-4, steps=2)


def test_convert_and_inspect_as_llm_compressor_leaves_it(tmp_path):
    """quantkit convert W4A16 (g32) of a bf16 Qwen3.5-MoE with packed 3-D experts and an MTP head: attention,
    the shared expert and every expert (split per expert) are int4; the Gated DeltaNet projections (one
    `ignore` pattern), the routers and shared-expert gates, lm_head and the MTP head stay bf16; the library
    marks exactly the modules we quantized; inspect accepts it and warns that the MTP head is unused; the
    runtime on it matches transformers on the library's decompressed weights."""
    model = qwen3_5_model(True, top_k=8)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    state["mtp.fc.weight"] = torch.zeros(128, 256, dtype=torch.bfloat16)
    (tmp_path / "src").mkdir()
    save_file(state, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    model.config.architectures = ["Qwen3_5MoeForCausalLM"]
    model.config.save_pretrained(tmp_path / "src")
    report = convert(tmp_path / "src", tmp_path / "w4", "W4A16", 32)
    qc = json.loads((tmp_path / "w4" / "config.json").read_text())["quantization_config"]
    assert {"re:.*linear_attn\\.", "re:^mtp\\.", "lm_head"} <= set(qc["ignore"])
    assert all(p.endswith(("mlp.gate", "shared_expert_gate")) for p in set(qc["ignore"]) - {
        "re:.*linear_attn\\.", "re:^mtp\\.", "lm_head"})
    dense = library_decompress(tmp_path / "w4")
    ours = {n.removesuffix(".weight") for n in dense}
    full = model.config.layer_types.count("full_attention")  # q k v o
    assert report["quantized_tensors"] == len(ours) == 4 * full + model.config.num_hidden_layers * (3 + 3 * 8)
    fresh = qwen3_5_model(True, top_k=8)
    for layer in fresh.model.layers:
        layer.mlp.experts = per_expert_linears(layer.mlp.experts)
    apply_quantization_config(fresh, QuantizationConfig.model_validate(qc))
    marked = {n for n, m in fresh.named_modules() if isinstance(m, torch.nn.Linear) and hasattr(m, "quantization_scheme")}
    assert marked == ours and not any("linear_attn" in n for n in ours)
    r = inspect_checkpoint(tmp_path / "w4", "v6e")
    assert r["servable"] and any(p["where"] == "mtp.*" and p["severity"] == "warning" for p in r["problems"])
    library_convert_dequantize(tmp_path / "w4", tmp_path / "dense")
    ref = T.AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32).eval()
    _parity(tmp_path / "w4", ref, 1e-2, greedy=False)
