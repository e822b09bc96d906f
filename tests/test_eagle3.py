"""EAGLE-3 draft heads (runtime/models/eagle3.py, step.draft_rows): the drafts a step proposes against a
reference built from transformers' own Llama modules, and greedy output with the default model's trained
head identical to the target alone.

Oracles: transformers' LlamaForCausalLM (the target's hidden states entering each layer), LlamaAttention,
LlamaMLP, LlamaRMSNorm and LlamaRotaryEmbedding assembled into the EAGLE-3 layer as vLLM's loader defines it
(a causal pass over the whole sequence each draft, no cache: nothing shared with the paged code under test);
the plain forward step one token at a time for greedy output.
"""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from quantkit.errors import InvalidInput, Unsupported
from quantkit.formats.safetensors_io import write_safetensors
from quantkit.runtime.engine import Engine, Request, Runner, Sampling
from quantkit.runtime.loader import load
from quantkit.runtime.models import eagle3
from quantkit.runtime.speculative import Drafter, SpeculativeConfig, drafter_for
from quantkit.runtime.step import VERIFY
from helpers import check_draft_head, greedy_reference

ROOT = Path(__file__).resolve().parents[1]
H, VD, V, AUX = 64, 100, 128, (0, 2, 3)


def _head(path: Path, target_vocab: int = V, **config) -> dict:
    """A random EAGLE-3 head for a hidden-64 target, in vLLM's layout (midlayer.*, fc, norm, lm_head, d2t
    over a 100-token draft vocabulary); returns its tensors [out, in] as float32 numpy."""
    rng = np.random.default_rng(1)

    def w(o, i):
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    keep = np.sort(rng.choice(target_vocab, VD, replace=False))
    t = {"fc.weight": w(H, 3 * H), "norm.weight": 1 + 0.1 * rng.standard_normal(H).astype(np.float32),
         "lm_head.weight": w(VD, H), "d2t": (keep - np.arange(VD)).astype(np.int64),
         "t2d": np.isin(np.arange(target_vocab), keep)}
    for name, shape in {"self_attn.q_proj": (64, 2 * H), "self_attn.k_proj": (32, 2 * H),
                        "self_attn.v_proj": (32, 2 * H), "self_attn.o_proj": (H, 64), "mlp.gate_proj": (96, H),
                        "mlp.up_proj": (96, H), "mlp.down_proj": (H, 96)}.items():
        t[f"midlayer.{name}.weight"] = w(*shape)
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[f"midlayer.{name}.weight"] = 1 + 0.1 * rng.standard_normal(H).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(path / "model.safetensors", t, {"format": "pt"})
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "num_hidden_layers": 1, "vocab_size": target_vocab, "draft_vocab_size": VD, "rms_norm_eps": 1e-5,
           "rope_theta": 5000.0, "max_position_embeddings": 256, "eagle_aux_hidden_state_layer_ids": list(AUX)}
    (path / "config.json").write_text(json.dumps(cfg | config))
    return t


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A 4-layer random Llama (transformers, float32) and a random head for it."""
    import torch
    import transformers as T

    root = tmp_path_factory.mktemp("eagle3")
    torch.manual_seed(0)
    target = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=H, intermediate_size=128, num_hidden_layers=4,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=V, head_dim=16,
                                              max_position_embeddings=256)).eval()
    target.save_pretrained(root / "target")
    return target, _head(root / "head"), root


def _reference(target, head: dict):
    """drafts(seq, next_token, k): the head's k greedy drafts after seq + [next_token], from transformers'
    modules (the EAGLE-3 layer as vLLM's llama_eagle3 defines it)."""
    import torch
    import transformers as T
    from transformers.models.llama import modeling_llama as M

    t = {k: torch.from_numpy(np.asarray(v)) for k, v in head.items()}
    wide = T.LlamaConfig(hidden_size=2 * H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rope_theta=5000.0, max_position_embeddings=256, rms_norm_eps=1e-5)
    wide._attn_implementation = "eager"
    attn = M.LlamaAttention(wide, layer_idx=0)
    attn.o_proj = torch.nn.Linear(64, H, bias=False)
    rope = M.LlamaRotaryEmbedding(wide)
    mlp = M.LlamaMLP(T.LlamaConfig(hidden_size=H, intermediate_size=96))
    norms = {n: M.LlamaRMSNorm(H, eps=1e-5) for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                                       "norm")}
    with torch.no_grad():
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(attn, n).weight.copy_(t[f"midlayer.self_attn.{n}.weight"])
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, n).weight.copy_(t[f"midlayer.mlp.{n}.weight"])
        for n, m in norms.items():
            m.weight.copy_(t["norm.weight" if n == "norm" else f"midlayer.{n}.weight"])

    def layer(emb, hidden):  # [1, n, H] each: a causal pass over the whole sequence
        n = emb.shape[1]
        x = torch.cat([norms["input_layernorm"](emb), norms["hidden_norm"](hidden)], dim=-1)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        a, _ = attn(x, rope(x, torch.arange(n)[None]), mask)
        h = hidden + a
        return h + mlp(norms["post_attention_layernorm"](h))

    def token(g):
        i = int(torch.argmax(torch.nn.functional.linear(norms["norm"](g), t["lm_head.weight"])))
        return i + int(t["d2t"][i])

    @torch.no_grad()
    def drafts(seq: list, nxt: int, k: int) -> list:
        states = target(torch.tensor([seq]), output_hidden_states=True).hidden_states  # [i]: entering layer i
        hidden = torch.nn.functional.linear(torch.cat([states[i] for i in AUX], dim=-1), t["fc.weight"])
        emb = target.model.embed_tokens(torch.tensor([seq[1:] + [nxt]]))
        out = []
        for _ in range(k):
            g = layer(emb, hidden)[:, -1:]
            out.append(token(g[0, 0]))
            emb = torch.cat([emb, target.model.embed_tokens(torch.tensor([[out[-1]]]))], dim=1)
            hidden = torch.cat([hidden, g], dim=1)
        return out

    return drafts


def test_drafts_match_a_transformers_reference(pair):
    """Two sequences in one ragged step (prompts), then a step where one verifies three drafts (two accepted:
    the head must restart from the last kept position, not the last drafted one) beside a plain decode:
    every draft the step proposes equals the reference's, through the d2t vocabulary map."""
    target, head, root = pair
    model = load(root / "target", dtype=jnp.float32)
    runner = Runner(model, max_model_len=128, max_num_seqs=2, page_size=8, max_num_batched_tokens=64, speculative=3,
                    drafter=Drafter(*eagle3.load(root / "head", model.cfg, jnp.float32)))
    rng = np.random.default_rng(2)
    check_draft_head(runner, target, [rng.integers(3, V, 21).tolist(), rng.integers(3, V, 10).tolist()],
                     _reference(target, head), V)


def test_plans_view_of_a_head_is_what_load_holds(pair, tmp_path):
    """`plan` compiles a head from eagle3.abstract (config.json and the safetensors headers, no data): the
    same parameters, shapes and dtypes as the weights eagle3.load reads, for the pair's head (a d2t map over
    its 100-token vocabulary) and for one over the target's whole vocabulary without a d2t map (its identity
    map made by both)."""
    _, head, root = pair
    cfg = load(root / "target", dtype=jnp.float32).cfg
    whole = {k: v for k, v in head.items() if k != "d2t"}
    whole["lm_head.weight"] = np.ones((V, H), np.float32)
    (tmp_path / "whole").mkdir()
    write_safetensors(tmp_path / "whole" / "model.safetensors", whole, {"format": "pt"})
    (tmp_path / "whole" / "config.json").write_text(json.dumps(
        json.loads((root / "head" / "config.json").read_text()) | {"draft_vocab_size": V}))

    def describe(params):
        return {k: (tuple(v.shape), str(v.dtype)) for k, v in params.items()}

    for path, vd in ((root / "head", VD), (tmp_path / "whole", V)):
        loaded, abstract = eagle3.load(path, cfg, jnp.bfloat16), eagle3.abstract(path, cfg, jnp.bfloat16)
        assert loaded[0] == abstract[0] and describe(loaded[1]) == describe(abstract[1])
        assert describe(abstract[1])["d2t"] == ((vd,), "int32") and describe(abstract[1])["fc"][1] == "bfloat16"


def test_served_head_is_float32_on_this_cpu(pair):
    """serve and generate (`drafter_for`) hold the head's matrices in float32 on CPU, where XLA's bf16 dots
    take about twice as long, beside a bf16 target (the head casts the target's states to its type; greedy
    output with it equals the target's: test_speculative's generate test)."""
    _, _, root = pair
    model = load(root / "target")  # bf16, as serve loads it
    d = drafter_for(SpeculativeConfig("eagle3", 3, model=str(root / "head")), model)
    assert str(model.dtype) == "bfloat16"
    assert {str(v.dtype) for v in d.params.values() if v.ndim == 2} == {"float32"}


def test_bad_draft_checkpoints_are_refused(pair, tmp_path):
    _, head, root = pair
    cfg = load(root / "target", dtype=jnp.float32).cfg
    _head(tmp_path / "arch", architectures=["LlamaForCausalLM"])
    with pytest.raises(Unsupported, match="not an EAGLE-3 head"):
        eagle3.load(tmp_path / "arch", cfg, jnp.float32)
    _head(tmp_path / "aux", eagle_aux_hidden_state_layer_ids=[0, 2, 9])
    with pytest.raises(InvalidInput, match=r"auxiliary layers \(0, 2, 9\) do not fit a 4-layer target"):
        eagle3.load(tmp_path / "aux", cfg, jnp.float32)
    _head(tmp_path / "wide", intermediate_size=80)
    with pytest.raises(InvalidInput, match=r"midlayer.mlp.gate_proj.weight has shape \(96, 64\), expected \(80, 64\)"):
        eagle3.load(tmp_path / "wide", cfg, jnp.float32)
    t = dict(head)
    del t["fc.weight"]
    write_safetensors(tmp_path / "wide" / "model.safetensors", t, {"format": "pt"})
    (tmp_path / "wide" / "config.json").write_text(json.dumps(json.loads((root / "head" / "config.json").read_text())))
    with pytest.raises(InvalidInput, match="tensor 'fc.weight' is missing"):
        eagle3.load(tmp_path / "wide", cfg, jnp.float32)
    with pytest.raises(InvalidInput, match="cannot read config.json"):
        eagle3.load(tmp_path / "nowhere", cfg, jnp.float32)


# ---- the default model and its trained head ---------------------------------------------------------------

@pytest.fixture(scope="module")
def default():
    """The default model, its head, code prompts and the model's own greedy tokens after each."""
    model = load(ROOT / "assets" / "tiny-llama", dtype=jnp.float32)
    prompts = _code_prompts(4)
    return (model, Drafter(*eagle3.load(ROOT / "assets" / "tiny-llama-eagle3", model.cfg, jnp.float32)), prompts,
            [greedy_reference(model, p, 24) for p in prompts])


def _code_prompts(n: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ROOT / "assets" / "tiny-llama" / "tokenizer.json"))
    text = (ROOT / "quantkit" / "runtime" / "cache.py").read_text()
    return [tok.encode(text[i * 700:i * 700 + 400]).ids[:40 + 8 * i] for i in range(n)]


@pytest.mark.parametrize("budget, fill_only", [(16, False), (512, True)])
def test_greedy_with_the_trained_head_gives_the_targets_tokens(default, budget, fill_only):
    """Staggered requests (prompts chunked by a 16-token budget beside drafted decodes; or drafts only in
    decode steps' padding), one stopping on a stop id and one on max_tokens inside accepted runs: every
    request's tokens equal the target's own one at a time, and the trained head's drafts are mostly
    accepted (a head fed the wrong hidden states or positions is accepted far less: a random one ~0%)."""
    model, drafter, prompts, greedy = default
    spec = SpeculativeConfig("eagle3", 3, model="assets/tiny-llama-eagle3")
    engine = Engine(Runner(model, max_model_len=128, max_num_seqs=4, page_size=8, max_num_batched_tokens=budget,
                           speculative=3, drafter=drafter), speculative=spec)
    engine.fill_only = fill_only
    if budget == 16:  # warm-up compiles both programs of every bucket (with and without the head): no more later
        engine.warmup()
        r = engine.runner
        warmed = (r._step._cache_size(), r._programs[VERIFY]._cache_size())
        assert warmed == (len(r.buckets), len(r.buckets))
    stop = greedy[1][13]
    kw = [dict(max_tokens=24), dict(max_tokens=24, stop_ids=frozenset({stop})), dict(max_tokens=19),
          dict(max_tokens=24)]
    reqs = []
    for p, extra in zip(prompts, kw):
        reqs.append(engine.submit(Request(p, **extra)))
        engine.step()
    while engine.busy():
        engine.step()
    assert engine.pages_used == 0
    assert reqs[0].out == greedy[0] and reqs[3].out == greedy[3]
    assert reqs[1].out == greedy[1][:greedy[1].index(stop)] and reqs[1].finish_reason == "stop"
    assert reqs[2].out == greedy[2][:19] and reqs[2].finish_reason == "length"
    assert engine.drafts > 0 and engine.accepted / engine.draft_tokens > 0.4, (engine.accepted, engine.draft_tokens)
    if budget == 16:
        assert (r._step._cache_size(), r._programs[VERIFY]._cache_size()) == warmed


def test_a_head_whose_drafts_fail_runs_only_before_each_probe(default):
    """A sampled stream the target makes all but uniform (temperature 50) rejects the trained head's drafts
    and stops drafting; from then on the head runs once for each later drafted step (a probe: SPEC_PROBE
    steps apart), on the step before it, not on the probe itself as well (whose drafts may fail again)."""
    model, drafter, prompts, _ = default
    engine = Engine(Runner(model, max_model_len=128, max_num_seqs=4, page_size=8, max_num_batched_tokens=16,
                           speculative=3, drafter=drafter),
                    speculative=SpeculativeConfig("eagle3", 3, model="assets/tiny-llama-eagle3"))
    steps, run = [], engine.runner.run
    engine.runner.run = lambda batch, head=True, decode=None: steps.append(
        (head, bool(batch["drafts"].any()))) or run(batch, head, decode)
    engine.submit(Request(prompts[0], max_tokens=80, sampling=Sampling(50.0, seed=1)))
    while engine.busy():
        engine.step()
    heads, drafted = np.array(steps).T
    stopped = np.flatnonzero(drafted)[0] + np.flatnonzero(~drafted[np.flatnonzero(drafted)[0]:])[0]
    probes = np.flatnonzero(drafted[stopped:]) + stopped
    assert len(probes) >= 1 and heads[stopped:].sum() == len(probes) and heads[probes - 1].all(), steps


def test_seeded_sampling_with_the_head_overlaps_its_steps(default):
    """Seeded sampled requests (temperature 0.5, top-k on one) side by side: the same tokens with the head's
    drafts as without (a row scheduled before the previous verifying step is read back is moved by the
    device to where its acceptance left it; the draws' keys follow those positions), drafts both accepted
    and rejected, and most verifying steps with drafts are followed by the next step's dispatch before
    they are read back (the host does not wait between them)."""
    model, drafter, prompts, _ = default
    reqs = [dict(prompt=p, max_tokens=30, sampling=Sampling(0.5, 8 * (i == 1), 1.0, seed=i))
            for i, p in enumerate(prompts[:3])]
    outs, events = [], []
    for spec in (SpeculativeConfig("eagle3", 3, model="assets/tiny-llama-eagle3"), None):
        engine = Engine(Runner(model, max_model_len=128, max_num_seqs=4, page_size=8, max_num_batched_tokens=16,
                               speculative=spec.k if spec else 0, drafter=drafter if spec else None),
                        speculative=spec)
        if spec:
            run, collect = engine.runner.run, engine._collect
            # (the outputs kept in `events`: their ids stay unique)
            engine.runner.run = lambda batch, *a: events.append(
                ("run", out := run(batch, *a), bool(batch["drafts"].any()))) or out
            engine._collect = lambda out, rows: events.append(("read", out, None)) or collect(out, rows)
        done = []
        for kw in reqs:
            done.append(engine.submit(Request(**kw)))
            engine.step()
        while engine.busy():
            engine.step()
        outs.append([r.out for r in done])
        if spec:
            assert 0 < engine.accepted < engine.draft_tokens, (engine.accepted, engine.draft_tokens)
    assert outs[0] == outs[1]
    at = {(kind, id(out)): i for i, (kind, out, _) in enumerate(events)}
    runs = [i for i, (kind, _, _) in enumerate(events) if kind == "run"]
    drafted = [(i, nxt) for i, nxt in zip(runs, runs[1:]) if events[i][2]]
    overlapped = sum(nxt < at[("read", id(events[i][1]))] for i, nxt in drafted)
    assert overlapped >= 0.8 * len(drafted) > 0, (overlapped, len(drafted))
