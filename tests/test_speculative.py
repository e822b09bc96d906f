"""Speculative decoding (runtime/speculative.py, step.verify_rows): vLLM's --speculative-config, the n-gram
drafter, and verification in the one ragged step.

Oracles: greedy output against the plain forward step run one token at a time (float32: identical token
ids, not merely close); the sampled rule against the target distribution computed here with numpy (a
chi-square test over thousands of seeds); the program count from jax's own compile cache.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from quantkit.runtime.engine import Engine, Request, Runner, Sampling
from quantkit.runtime.loader import load
from quantkit.runtime.speculative import Lookup, PromptLookup, SpeculativeConfig, drafter_for, parse
from quantkit.runtime.step import NO_TOKEN, STEP, VERIFY, sampling_arrays, verify_rows

from helpers import greedy_reference, tiny_gemma3, tiny_llama

NGRAM = SpeculativeConfig("ngram", 4, 2, 4)


@pytest.mark.parametrize("text, error", [
    ('{"method": "ngram", "num_speculative_tokens": 3, "foo": 1}', "unknown key(s) 'foo'"),
    ('{"method": "medusa", "num_speculative_tokens": 3}', "unknown method 'medusa'"),
    ('{"method": "ngram"}', "'num_speculative_tokens' is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "'num_speculative_tokens' must be a positive integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "'prompt_lookup_min' 4 is above 'prompt_lookup_max' 2"),
    ('{"method": "eagle3", "num_speculative_tokens": 3}', "method 'eagle3' needs 'model'"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "model": "x"}', "which method 'ngram' does not use"),
    ('{"method": "mtp", "num_speculative_tokens": 3, "model": "x"}', "which method 'mtp' does not use"),
    ('[1]', "must be a JSON object"), ('{"method": ', "not JSON")])
def test_config_errors_name_the_problem(text, error):
    with pytest.raises(ValueError, match=error.replace("(", "\\(").replace(")", "\\)")):
        parse(text)


def test_config_defaults_as_vllm():
    assert parse('{"method": "ngram", "num_speculative_tokens": 3}') == SpeculativeConfig("ngram", 3, 5, 5)
    assert parse('{"method": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4}') == \
        SpeculativeConfig("ngram", 3, 4, 4)
    assert parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}') == \
        SpeculativeConfig("ngram", 3, 2, 2)
    assert parse('{"method": "eagle3", "num_speculative_tokens": 2, "model": "d"}') == \
        SpeculativeConfig("eagle3", 2, 5, 5, "d")
    assert parse(None) is None and parse("{}") is None
    assert parse('{"method": "mtp", "num_speculative_tokens": 1}') == SpeculativeConfig("mtp", 1, 5, 5)


def _lookup(tokens, k, lo, hi, split=None):
    """PromptLookup's drafts after the whole of `tokens` (prompt: the first `split`), fed in one go."""
    split = len(tokens) if split is None else split
    return PromptLookup(range(lo, hi + 1)).extend(list(tokens[:split]), list(tokens[split:])).draft(k, lo, hi)


def test_ngram_prompt_lookup():
    t = [7, 1, 2, 3, 9, 8, 1, 2, 3, 5, 6, 4, 1, 2, 3]
    # the last 3 tokens (1 2 3) occurred twice before: the latest occurrence's followers
    assert _lookup(t, 3, 2, 3) == [5, 6, 4] and _lookup(t, 3, 2, 3, split=4) == [5, 6, 4]
    assert _lookup(t, 8, 2, 3) == [5, 6, 4, 1, 2, 3]  # up to the end of what is known
    # the longest suffix wins: "4 1 2 3" occurs nowhere else, "2 3" ... "9 2 3" prefers n = 3 over n = 2
    assert _lookup([2, 3, 0, 9, 2, 3, 1, 5, 9, 2, 3], 2, 2, 3) == [1, 5]
    assert _lookup([1, 2, 3, 4], 2, 1, 3) == []  # no earlier occurrence
    assert _lookup([5, 5, 5], 2, 2, 2) == [5]  # overlapping occurrences count


def scan(t, k, lo, hi, periodic=False):
    """A scan of the whole sequence t: for the largest n in [lo, hi] whose last n tokens occur earlier, the k
    tokens after the latest such occurrence (up to t's end; periodic: continued as a loop of what follows
    that occurrence)."""
    for n in range(min(hi, len(t) - 1), lo - 1, -1):
        starts = [i for i in range(len(t) - n) if t[i:i + n] == t[len(t) - n:]]
        if starts:
            s = starts[-1] + n
            return [t[s + i % (len(t) - s)] for i in range(k)] if periodic else t[s:s + k]
    return []


def test_ngram_index_as_it_grows_finds_what_a_scan_finds(seed):
    """The index, fed a sequence a few tokens at a time (the prompt, then output as steps accept it; then
    taken back by a stop string, then grown again), drafts at every length what a scan of the whole
    sequence finds: for the largest n in [lo, hi] whose last n tokens occur earlier, the tokens after the
    latest such occurrence. Few distinct tokens, so that most lookups find several occurrences."""
    rng = np.random.default_rng(seed)
    for lo, hi in [(1, 1), (2, 5), (3, 3)]:
        t = rng.integers(0, 4, 300).tolist()
        t[150:200] = t[20:70]  # a quoted stretch
        lookup, prompt, found, end, back = PromptLookup(range(lo, hi + 1)), t[:40], 0, 40, True
        while end < len(t):
            lookup.extend(prompt, t[40:end])
            got = lookup.draft(4, lo, hi)
            assert got == scan(t[:end], 4, lo, hi), (seed, lo, hi, end)
            found += bool(got)
            end += int(rng.integers(1, 4))
            if end >= 250 and back:
                end, back = end - 20, False  # tokens taken back
        assert found > 50, (seed, found)


def test_device_lookup_drafts_what_a_scan_finds(seed):
    """The device's lookup (speculative.Lookup, jitted), rows of different lengths in one array with junk past
    each length: a scan's drafts, continued periodically, or all `none` where nothing occurs earlier."""
    rng = np.random.default_rng(seed)
    for lo, hi, alphabet in [(1, 1, 6), (2, 5, 4), (3, 3, 3), (1, 4, 40)]:
        seqs = rng.integers(0, alphabet, (16, 96)).astype(np.int32)
        seqs[:4, 60:80] = seqs[:4, 10:30]  # quoted stretches
        lengths = rng.integers(1, 97, 16)
        got = np.asarray(jax.jit(Lookup(lo, hi).draft, static_argnums=(2, 3))(seqs, lengths, 5, -1))
        found = 0
        for row, n, drafts in zip(seqs.tolist(), lengths, got.tolist()):
            want = scan(row[:n], 5, lo, hi, periodic=True)
            assert drafts == (want or [-1] * 5), (lo, hi, row[:n], drafts, want)
            found += bool(want)
        assert 0 < found, (lo, hi)


# ---- greedy: the same tokens as the target alone --------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "llama"
    tiny_llama(path)
    return load(path, dtype=jnp.float32)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Gemma 3 with an 8-token window: pages leave the window while drafts are rolled back."""
    path = tmp_path_factory.mktemp("spec") / "gemma"
    tiny_gemma3(path)
    return load(path, dtype=jnp.float32)


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 128, int(rng.integers(3, 40))).tolist() for _ in range(6)]


def _run(model, budget, spec, reqs, page_size=8, fill_only=True, host=False):
    """reqs: Request kwargs; one newcomer every other step into 4 slots. fill_only=False: drafts up to the
    budget, beside prompt chunks (a TPU's rule). host: n-gram lookups on the host (a runner on several
    devices), not in the step."""
    engine = Engine(Runner(model, max_model_len=128, max_num_seqs=4, page_size=page_size,
                           max_num_batched_tokens=budget, speculative=spec.k if spec else 0,
                           drafter=None if host else drafter_for(spec, model)),
                    decode=lambda ids: " ".join(map(str, ids)), speculative=spec)
    engine.fill_only = fill_only
    out = []
    for kw in reqs:
        out.append(engine.submit(Request(**kw)))
        engine.step()
        engine.step()
    while engine.busy():
        engine.step()
    assert engine.pages_used == 0 and sorted(engine.free_slots) == [0, 1, 2, 3]
    return out, engine


@pytest.mark.parametrize("name, budget, fill_only, host", [("llama", 512, False, False), ("llama", 16, True, False),
                                                           ("gemma", 16, False, False), ("llama", 16, True, True)])
def test_greedy_ngram_gives_the_targets_tokens(request, name, budget, fill_only, host):
    """Staggered requests, prompts chunked by a 16-token budget beside others' drafted decodes (and, with
    fill_only, drafts only in decode steps' padding): every request's tokens equal the target's own one at
    a time; drafts were both accepted and rejected. N-gram lookups in the step (Gemma 3: its full-attention
    pages hold the tokens, its sliding ones leave the window), and on the host."""
    model = request.getfixturevalue(name)
    prompts, lengths = _prompts(), [40, 12, 33, 20, 3, 45]
    reqs, engine = _run(model, budget, NGRAM, [dict(prompt=p, max_tokens=n) for p, n in zip(prompts, lengths)],
                        fill_only=fill_only, host=host)
    assert (engine.runner.drafter is None) == host
    for r, p, n in zip(reqs, prompts, lengths):
        assert r.out == greedy_reference(model, p, n) and r.finish_reason == "length"
    assert 0 < engine.accepted < engine.draft_tokens and engine.drafts > 0
    assert engine.accepted == sum(engine.accepted_at) and engine.accepted_at == sorted(engine.accepted_at)[::-1]


def test_lookup_in_the_step_sees_a_cached_prefix(llama):
    """The device's lookup reads a prefix-cache hit's tokens (its token pages are shared with its KV pages),
    written by steps that verified nothing: B is A's prompt (every token of the vocabulary once) plus one
    token, all of A's pages cached while A still runs in another slot, A's prompt run by the plain program
    (A is sampled, and sampled sequences start below the floor here), so B prefills one token and looks up
    its first token in A's pages: the drafts it leaves on the device are what a scan of its whole sequence
    finds."""
    from quantkit.runtime.step import head_entry

    spec = SpeculativeConfig("ngram", 4, 1, 4)
    a = np.random.default_rng(3).permutation(128).tolist()
    engine = Engine(Runner(llama, max_model_len=256, max_num_seqs=4, page_size=8, max_num_batched_tokens=32,
                           speculative=4, drafter=drafter_for(spec, llama)), speculative=spec)
    engine.prior[False], ran, call = 0.0, [], engine.runner._call
    engine.runner._call = lambda program, batch: ran.append(program) or call(program, batch)
    ra = engine.submit(Request(a, 8, Sampling(1.0, seed=0)))
    while ra.done < len(a):
        engine.step()
    assert set(ran) == {STEP}
    rb = engine.submit(Request(a + a[:1], 1))
    engine.step()
    slot = rb.slot
    while rb.finish_reason is None:
        engine.step()
    assert engine.prefix_hits == 128 and slot not in (-1, ra.slot) and len(rb.out) == 1
    drafts = np.asarray(engine.runner.last)[head_entry(5, 4, slot, np.arange(4))].tolist()
    assert drafts == scan(a + a[:1] + rb.out, 4, 1, 4, periodic=True), drafts
    while engine.busy():
        engine.step()


def test_stops_inside_an_accepted_run(llama):
    """Stop ids, stop strings and max_tokens that fall among accepted drafts cut the output exactly where the
    target alone stops; min_tokens holds (no drafts before it)."""
    prompts = _prompts()
    greedy = [greedy_reference(llama, p, 40) for p in prompts[:4]]
    early = next(t for t in greedy[3][:12] if t in greedy[3][12:])  # a stop id min_tokens must skip
    plain = [dict(prompt=prompts[0], max_tokens=40, stop_ids=frozenset({greedy[0][25]})),
             dict(prompt=prompts[1], max_tokens=40, stop_strings=(" ".join(map(str, greedy[1][21:24])),)),
             dict(prompt=prompts[2], max_tokens=27),
             dict(prompt=prompts[3], max_tokens=40, stop_ids=frozenset({early}), min_tokens=12)]
    spec, engine = _run(llama, 512, NGRAM, plain)
    alone, _ = _run(llama, 512, None, plain)
    assert [r.out for r in spec] == [r.out for r in alone] and [r.text for r in spec] == [r.text for r in alone]
    assert [r.finish_reason for r in spec][:3] == ["stop", "stop", "length"]
    assert spec[0].out == greedy[0][:greedy[0].index(greedy[0][25])] and len(spec[2].out) == 27
    assert len(spec[3].out) >= 12 and early not in spec[3].out  # banned, not sampled, before min_tokens
    assert engine.accepted > 0


def test_seeded_sampling_gives_the_same_tokens(llama):
    """Sampled requests with seeds (temperature 0.3, top-k 5 on some): the same tokens with drafts as
    without (each position is drawn with the key a step without drafts uses, and a draft stands only where
    it is that token), with drafts both accepted and rejected."""
    reqs = [dict(prompt=p, max_tokens=40, sampling=Sampling(0.3, 5 * (i % 2), 1.0, seed=i))
            for i, p in enumerate(_prompts())]
    spec, engine = _run(llama, 16, SpeculativeConfig("ngram", 4, 1, 4), reqs)
    alone, _ = _run(llama, 16, None, reqs)
    assert [r.out for r in spec] == [r.out for r in alone]
    assert 0 < engine.accepted < engine.draft_tokens


def test_prompt_chunks_are_indexed_while_the_device_runs_them(llama):
    """The n-gram index takes each prompt chunk as its step is dispatched (not the whole prompt at the first
    lookup, after a step is read back), and the lookups then draft from it."""
    engine = Engine(Runner(llama, max_model_len=128, max_num_seqs=4, page_size=8, max_num_batched_tokens=16,
                           speculative=4), speculative=NGRAM)
    prompt = [5, 6, 7, 8, 9] * 8
    r = engine.submit(Request(list(prompt), 12))
    seen = []
    while r.done < len(prompt):
        engine.step()
        seen.append((list(r.lookup.tokens), r.lookup.indexed))
    assert seen == [(prompt[:16], 15), (prompt[:32], 31), (prompt, 39)], seen
    while engine.busy():
        engine.step()
    assert engine.draft_tokens > 0 and r.lookup is None  # drafted from it; dropped with the request


def test_lookups_that_find_nothing_stop_reading_steps_back(llama, monkeypatch):
    """A sampled sequence whose n-gram lookups find nothing (the lookup replaced by one that never does) stops
    looking, and with it reading each step back before the next is scheduled, once its moving average has
    fallen below the floor (0.5 x 0.9^n < 0.15 from n = 12), then after SPEC_PROBE decode steps without a
    look, and after twice that once that look has failed too; a greedy one looks at every step."""
    import quantkit.runtime.engine as eng

    at = []
    monkeypatch.setattr(eng.PromptLookup, "draft", lambda self, *_: at.append(len(self.tokens)) or [])
    _run(llama, 16, SpeculativeConfig("ngram", 4, 1, 4), [dict(prompt=list(range(3, 13)), max_tokens=118,
                                                                  sampling=Sampling(1.0, seed=0))], host=True)
    greedy = []
    monkeypatch.setattr(eng.PromptLookup, "draft", lambda self, *_: greedy.append(len(self.tokens)) or [])
    _run(llama, 16, SpeculativeConfig("ngram", 4, 1, 4), [dict(prompt=list(range(3, 13)), max_tokens=40)], host=True)
    gaps = np.diff(at).tolist()
    assert len(at) == 12 + 2 and gaps[:11] == [1] * 11 and gaps[11:] == [eng.SPEC_PROBE + 1, 2 * eng.SPEC_PROBE + 1], at
    assert greedy == list(range(11, 49))  # a greedy one looks at every step (not for its last token)


def test_rows_the_device_lookup_finds_nothing_for_take_no_draft_tokens(llama, monkeypatch):
    """The n-gram lookup in the step replaced by one that never finds anything (a config no other test
    compiles, so that the jitted step is traced with it): a greedy sequence carries draft tokens only in
    the steps scheduled before the first lookup is read back (two: the next step is scheduled while the
    previous runs), then plain one-token rows in the verifying program, which looks again every step; its
    tokens are the target's."""
    monkeypatch.setattr(Lookup, "draft", lambda self, seq, length, k, none: jnp.full((seq.shape[0], k), none))
    spec = SpeculativeConfig("ngram", 4, 3, 7)
    engine = Engine(Runner(llama, max_model_len=128, max_num_seqs=4, page_size=8, max_num_batched_tokens=16,
                           speculative=4, drafter=drafter_for(spec, llama)), speculative=spec)
    engine.fill_only = True
    run, drafts, heads = engine.runner.run, [], []

    def counted(batch, head=True, decode=None):
        drafts.append(int(batch["drafts"].sum()))
        heads.append(head)
        return run(batch, head, decode)

    engine.runner.run = counted
    prompt = list(range(3, 13))
    r = engine.submit(Request(prompt=prompt, max_tokens=30))
    while engine.busy():
        engine.step()
    assert r.out == greedy_reference(llama, prompt, 30)
    assert 0 < sum(d > 0 for d in drafts) <= 2 and drafts[-1] == 0 and all(heads), drafts
    assert engine.draft_tokens == engine.accepted == 0


def test_a_greedy_stream_drafts_down_to_its_own_floor():
    """Between the two floors (recent acceptance 0.1) a greedy sequence still drafts and a sampled one does
    not; below the greedy floor neither does, until SPEC_PROBE decode steps have passed without a look."""
    import quantkit.runtime.engine as eng

    wants = lambda temperature, acceptance, undrafted=0: eng.Engine._wants_drafts(  # noqa: E731
        None, Request([1], 8, Sampling(temperature), acceptance=acceptance, undrafted=undrafted))
    assert eng.SPEC_FLOOR_GREEDY < 0.1 < eng.SPEC_FLOOR
    assert wants(0.0, 0.1) and not wants(1.0, 0.1)
    assert not wants(0.0, 0.04) and not wants(1.0, 0.04) and wants(0.0, 0.04, eng.SPEC_PROBE)


def test_probes_that_fail_space_out_the_next():
    """A sampled sequence's look for drafts below the floor (a probe) that leaves it there doubles its probe
    interval, up to SPEC_PROBE_MAX (8 x); one that lifts it above resets it; looks above the floor, and a greedy
    sequence's, leave it."""
    import types

    import quantkit.runtime.engine as eng

    engine = types.SimpleNamespace(prior={True: 0.5, False: 0.5})
    r, g = Request([1], 8, Sampling(1.0), acceptance=0.1), Request([1], 8, acceptance=0.01)
    for want in (2, 4, 8, 8):
        eng.Engine._observe(engine, r, 0.0)
        eng.Engine._observe(engine, g, 0.0)
        assert (r.probe, g.probe) == (want * eng.SPEC_PROBE, eng.SPEC_PROBE)
    eng.Engine._observe(engine, r, 1.0)  # 0.1 x 0.75^5 + 0.25 > 0.15
    assert r.acceptance > eng.SPEC_FLOOR and r.probe == eng.SPEC_PROBE
    r.probe = 4 * eng.SPEC_PROBE
    eng.Engine._observe(engine, r, 0.0)  # from above the floor: not a probe
    assert r.probe == 4 * eng.SPEC_PROBE


def test_sampled_streams_whose_drafts_fail_start_the_next_without(llama):
    """Sampled requests at a temperature that makes the target all but uniform reject their drafts; once
    enough have, a new sampled request starts below the floor (it drafts nothing before SPEC_PROBE steps),
    while a greedy one starts from greedy streams' own record and drafts."""
    spec = SpeculativeConfig("ngram", 4, 1, 4)
    engine = Engine(Runner(llama, max_model_len=128, max_num_seqs=4, page_size=8, max_num_batched_tokens=16,
                           speculative=4), speculative=spec)
    drafted = []
    for i, p in enumerate(_prompts()[:5] + _prompts()[:1]):
        before = engine.drafts
        engine.submit(Request(prompt=p, max_tokens=24, sampling=Sampling(50.0 if i < 5 else 0.0, seed=i)))
        while engine.busy():
            engine.step()
        drafted.append(engine.drafts - before)
    assert drafted[0] > 0 and drafted[4] == 0 and drafted[5] > 0, drafted


@pytest.mark.parametrize("host", [False, True])
def test_one_program_per_bucket_whatever_the_drafts(llama, host):
    """Rows with 1 to 4 drafts, steps without: at most two programs per token bucket (the verifying one and
    the plain one; jax's own cache counts), whatever the drafts; with the lookup in the step, every step
    verifies (what it drafted)."""
    _, engine = _run(llama, 16, NGRAM, [dict(prompt=p, max_tokens=30) for p in _prompts()], page_size=4, host=host)
    r = engine.runner
    assert 0 < r._programs[VERIFY]._cache_size() <= len(r.buckets) == 2
    assert (0 if host else -1) < r._step._cache_size() <= len(r.buckets) * host
    # every sequence with all its drafts gets a bucket of its own (rounded up to 16), not the next power of 2
    assert Runner(llama, max_num_seqs=16, speculative=4).buckets == (8, 16, 32, 64, 80, 128, 256, 512)
    assert Runner(llama, max_num_seqs=6, speculative=3).buckets == (8, 16, 32, 64, 128, 256, 512)


# ---- the sampled rule ------------------------------------------------------------------------------------

def _verify(logits, drafts, last, batch):
    """step.verify_rows on logits [S, k + 1, vocab] of every row's positions, drafts [S, k]."""
    rows, k1, vocab = logits.shape
    draft = jnp.concatenate([jnp.asarray(drafts), jnp.full((rows, 1), NO_TOKEN, jnp.int32)], axis=1).reshape(-1)
    next_pos = ((batch["kv_lens"] - batch["drafts"])[:, None] + np.arange(k1)).reshape(-1)
    return verify_rows(jnp.reshape(logits, (-1, vocab)), jnp.repeat(jnp.arange(rows), k1), draft, next_pos,
                       jnp.arange(rows * k1).reshape(rows, k1), last, batch)


def _target(logits, temperature, top_k):
    """The distribution a sampled row draws from, computed here: softmax over temperature of the top k."""
    x = logits.astype(np.float64) / temperature
    x = np.where(x >= np.sort(x)[-top_k], x, -np.inf) if top_k else x
    p = np.exp(x - x.max())
    return p / p.sum()


@pytest.mark.parametrize("top_k", [0, 5])
def test_rejection_rule_keeps_the_targets_distribution(top_k):
    """8000 seeds, the same target logits, an adversarial draft (a token the target finds unlikely) and a
    likely one: the first token's empirical distribution matches the target's (chi-square, significance
    0.001); drafts are accepted about p(draft) of the time and the residual draw is exercised."""
    rng = np.random.default_rng(1)
    vocab, rows, k = 32, 8000, 2
    logits = rng.normal(0, 1.5, vocab).astype(np.float32)
    p = _target(logits, 0.8, top_k)
    order = np.argsort(p)
    for draft in (order[-top_k or 0] if top_k else order[0], order[-1]):  # unlikely (or filtered out), likely
        s = sampling_arrays(rows, vocab)
        s["temperature"][:] = 0.8
        s["top_k"][:] = top_k
        s["seed"][:] = np.arange(rows)
        batch = {"sampling": s, "kv_lens": np.full(rows, 10 + k, np.int32), "drafts": np.full(rows, k, np.int32),
                 "slot": np.zeros(rows, np.int32)}
        drafts = np.tile(np.array([draft, order[-2]], np.int32), (rows, 1))
        last = jnp.full(2, -7, jnp.int32)
        (tok, count, *_), _ = jax.jit(_verify)(jnp.broadcast_to(logits, (rows, k + 1, vocab)),
                                                        drafts, last, batch)
        first, count = np.asarray(tok[:, 0]), np.asarray(count)
        seen = np.bincount(first, minlength=vocab)
        live = p > 0
        assert seen[~live].sum() == 0
        assert scipy.stats.chisquare(seen[live], p[live] * rows).pvalue > 1e-3
        accepted = (count > 1).mean()
        assert abs(accepted - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / rows) + 1e-9
        assert (count == 1).sum() > 0  # rejected at the first draft: the residual draw ran


def test_greedy_verification_against_numpy():
    """Greedy rows keep the drafts equal to the argmax of each position, then the argmax after them; a row
    with fewer drafts than k ignores the padding, and one whose drafts are all NO_TOKEN (the device's lookup
    found nothing) keeps none and counts none offered; `last` gets each row's final token."""
    rng = np.random.default_rng(2)
    rows, k, vocab = 4, 3, 32
    logits = rng.normal(size=(rows, k + 1, vocab)).astype(np.float32)
    best = logits.argmax(-1)
    drafts = np.array([[best[0, 0], best[0, 1], (best[0, 2] + 1) % vocab],  # third rejected
                       [best[1, 0], best[1, 1], best[1, 2]],  # all accepted, the bonus token after
                       [best[2, 0], NO_TOKEN, NO_TOKEN],  # one draft
                       [NO_TOKEN] * 3], np.int32)  # none found
    batch = {"sampling": sampling_arrays(rows, vocab), "kv_lens": np.array([20, 30, 40, 50], np.int32),
             "drafts": np.array([3, 3, 1, 3], np.int32), "slot": np.array([2, 0, 1, 3], np.int32)}
    (tok, count, lp, _, _, offered), last = _verify(jnp.asarray(logits), drafts, jnp.zeros(5, jnp.int32), batch)
    assert np.asarray(count).tolist() == [3, 4, 2, 1] and np.asarray(offered).tolist() == [3, 3, 1, 0]
    for i, c in enumerate([3, 4, 2, 1]):
        assert np.asarray(tok)[i, :c].tolist() == best[i, :c].tolist()
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lp)[0, :3], ref[0, np.arange(3), best[0, :3]], rtol=1e-5)
    assert np.asarray(last).tolist() == [best[1, 3], best[2, 1], best[0, 2], best[3, 0], 0]


# ---- the command line ----------------------------------------------------------------------------------

def test_generate_json_reports_acceptance():
    """`quantkit generate --json` with n-gram drafts on the default model, a prompt whose answer repeats
    it: the same tokens as without, and the acceptance counts; the same with the default model's EAGLE-3
    head, and a draft path that does not exist: one line."""
    prompt = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):"
    base = [sys.executable, "-m", "quantkit.cli", "generate", "assets/tiny-llama", "--prompt", prompt,
            "--max-tokens", "40", "--json"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    plain = json.loads(subprocess.run(base, capture_output=True, text=True, check=True, env=env).stdout)
    spec = json.loads(subprocess.run(base + ["--speculative-config", json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2})], capture_output=True, text=True,
        check=True, env=env).stdout)
    assert spec["tokens"] == plain["tokens"] and spec["text"] == plain["text"] and plain["speculative"] is None
    s = spec["speculative"]
    assert s["method"] == "ngram" and s["num_speculative_tokens"] == 4 and 0 < s["accepted_tokens"] <= s[
        "draft_tokens"] <= 4 * s["drafts"]
    assert s["acceptance_rate"] == pytest.approx(s["accepted_tokens"] / s["draft_tokens"])
    eagle = json.loads(subprocess.run(base + ["--speculative-config", json.dumps(
        {"method": "eagle3", "model": "assets/tiny-llama-eagle3", "num_speculative_tokens": 3})],
        capture_output=True, text=True, check=True, env=env).stdout)
    assert eagle["tokens"] == plain["tokens"] and eagle["speculative"]["accepted_tokens"] > 0
    missing = subprocess.run(base + ["--speculative-config", '{"method": "eagle3", "model": "/nonexistent", '
                                     '"num_speculative_tokens": 3}'], capture_output=True, text=True, env=env)
    assert missing.returncode == 1 and "draft model /nonexistent: cannot read config.json" in missing.stderr
    assert "Traceback" not in missing.stderr
    bad = subprocess.run(base + ["--speculative-config", '{"method": "ngram", "k": 2}'], capture_output=True,
                         text=True, env=env)
    assert bad.returncode == 2 and "unknown key(s) 'k'" in bad.stderr and "Traceback" not in bad.stderr


def test_server_streams_verified_tokens_and_reports_vllm_metrics(tmp_path):
    """`serve --speculative-config` with the official openai client, greedy on the default model: every
    token is the top-1 of the target's own log-probabilities at its position (an accepted draft that
    the target would not have chosen breaks this), streamed == whole, and vLLM's spec_decode counters."""
    import openai

    from helpers import ServerProc

    prompt = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):"
    s = ServerProc("assets/tiny-llama", tmp_path / "log", tmp_path / "cache", "--max-model-len", "256",
                   "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--speculative-config",
                   '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}')
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=48, temperature=0, logprobs=1)
        lp = whole.choices[0].logprobs
        assert len(lp.tokens) == 48 and whole.choices[0].finish_reason == "length"
        for tok, top in zip(lp.tokens, lp.top_logprobs):
            assert max(top, key=top.get) == tok
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=48, temperature=0, stream=True) if c.choices)
        assert streamed == whole.choices[0].text
        m = s.metrics()
        drafts, accepted = (m['vllm:spec_decode_num_draft_tokens_total{model_name="tiny"}'],
                            m['vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"}'])
        assert 0 < accepted <= drafts <= 3 * m['vllm:spec_decode_num_drafts_total{model_name="tiny"}']
        per_pos = [m[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{j}"}}']
                   for j in range(3)]
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    finally:
        assert s.stop() == 0


def test_verifying_step_compiles_deviceless_for_v6e():
    """The verifying step (16 rows x (1 + 4) tokens: the 128-token bucket) compiles for a v6e with its
    quantized matmuls on gmm_v2 and attention on the paged-attention kernel, like the plain step."""
    from quantkit.formats.compressed_tensors import parse_quantization_config
    from quantkit.formats.ct_writer import writable_config
    from quantkit.runtime.aot import compile_for
    from quantkit.runtime.cache import cache_layout
    from quantkit.runtime.loader import abstract
    from quantkit.runtime.models import from_hf
    from quantkit.runtime.step import empty_batch, step_function

    c = from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
                 "intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 8,
                 "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 4096, "max_position_embeddings": 4096,
                 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False})
    params = abstract(c, parse_quantization_config(writable_config("W4A16", 128, ["lm_head"])))
    layout = cache_layout(c, 2048, 16)
    kv = layout.cache(lambda k, s, d: jax.ShapeDtypeStruct(s, d or jnp.bfloat16))
    batch = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                   empty_batch(128, 16, layout, 16, c.vocab_size))
    compiled, _ = compile_for("v6e", step_function(c, 16, spec=4), params, kv, jax.ShapeDtypeStruct((17,), jnp.int32),
                              batch, donate=(1, 2), pinned=(0,))
    assert compiled.as_text().count("custom_call_target=\"tpu_custom_call\"") >= 2
    out = jax.tree_util.tree_leaves(compiled.out_info[0])
    assert [o.shape for o in out] == [(16, 5), (16,), (16, 5), (16, 5, 20), (16, 5, 20), (16,)]


def test_constrained_row_beside_drafted_ones():
    """A regex-constrained request shares drafted steps with two unconstrained ones (the default model,
    float32): its text matches the regex (re.fullmatch, not quantkit's code) and every request's tokens
    equal those of the same requests without speculation."""
    import re

    from quantkit.runtime.structured import Constraints
    from quantkit.runtime.tokenizer import TextCodec

    path = "assets/tiny-llama"
    model, codec = load(path, dtype=jnp.float32), TextCodec(path)
    cons = Constraints(Path(path) / "tokenizer.json", model.cfg.vocab_size, {2})
    pattern = "(def|class) [a-z_]{1,12}\\(self(, [a-z]{1,6}){0,3}\\):"
    prompts = [codec.encode(t) for t in ("def add(a, b):\n    return a + b\n\n\ndef add(a, b):",
                                         "import os\nimport os\nimport os\nimport", "    def __init__(self")]

    def run(spec):
        engine = Engine(Runner(model, max_model_len=256, max_num_seqs=4, page_size=8, max_num_batched_tokens=64,
                               speculative=spec.k if spec else 0, drafter=drafter_for(spec, model)),
                        decode=codec.decode, speculative=spec)
        reqs = [engine.submit(Request(p, 40, ignore_eos=True)) for p in prompts[:2]]
        reqs.append(engine.submit(Request(prompts[2], 40, grammar=cons.matcher(cons.grammar("regex", pattern)))))
        while engine.busy():
            engine.step()
        return reqs, engine

    spec, engine = run(NGRAM)
    alone, _ = run(None)
    assert [r.out for r in spec] == [r.out for r in alone]
    assert re.fullmatch(pattern, spec[2].text) and spec[2].finish_reason == "stop"
    assert engine.accepted > 0 and engine.masks > 0


def test_qwen3_5_gdn_state_follows_the_kept_drafts(tmp_path):
    """Qwen3.5 (Gated DeltaNet layers): greedy n-gram drafts, partly rejected, give the same tokens as
    without speculation, and each slot's GDN conv and recurrent states at the end equal those of the same
    requests without speculation to 1e-5 (float32)."""
    from helpers import qwen3_5_model

    qwen3_5_model(False).save_pretrained(tmp_path / "qwen")
    model = load(tmp_path / "qwen", dtype=jnp.float32)
    # streams that repeat themselves, some drafts rejected (a row takes drafts only where its lookup found
    # some in the last step read back, and chance matches in random text seldom last: prompts that give both)
    reqs = [dict(prompt=_prompts()[i], max_tokens=n) for i, n in zip((0, 4, 5, 3), [30, 20, 24, 12])]
    spec, engine = _run(model, 64, SpeculativeConfig("ngram", 4, 1, 4), reqs, fill_only=False)
    alone, plain = _run(model, 64, None, reqs)
    slots = [0, 1, 2, 3]  # each request's state stays in its slot after it finished
    for a, b in zip(engine.runner.kv["linear"][:2], plain.runner.kv["linear"]):
        ref = np.asarray(b)[:, slots]
        assert np.abs(np.asarray(a)[:, slots] - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())
    assert [r.out for r in alone] == [r.out for r in spec]
    assert 0 < engine.accepted < engine.draft_tokens
