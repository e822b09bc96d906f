"""The continuous-batching engine without HTTP: batching, chunked prefill, page accounting, aborts, limits.

Outputs are compared in float32 (greedy token ids must be identical): a request's tokens may not depend on
when it arrived, on what shares its step (prompt chunks and decodes of others), or on how its prompt was
chunked by the token budget. Reference: one request alone through `Runner.forward`, token by token.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as T

from quantkit.errors import InvalidInput
from quantkit.runtime.engine import Engine, QueueFull, Request, Runner, Sampling
from quantkit.runtime.loader import load

from helpers import greedy_reference, tiny_gemma3, tiny_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "llama"
    tiny_llama(path)
    return load(path, dtype=jnp.float32)


def _prompts(k, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 128, int(rng.integers(3, 40))).tolist() for _ in range(k)]


@pytest.mark.parametrize("budget", [512, 16])
def test_staggered_requests_match_each_alone(model, budget):
    _staggered(model, budget)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Gemma 3 with an 8-token window."""
    path = tmp_path_factory.mktemp("engine") / "gemma"
    tiny_gemma3(path)
    return load(path, dtype=jnp.float32)


def test_sliding_window_pages_with_chunked_prompts(gemma):
    """Gemma 3's local layers hold only the pages a query can still see (pages that leave the window go
    back to their pool), so their pool is sized by the window, not the model length; prompts up to 40
    tokens in chunks of a 16-token budget."""
    runner = _staggered(gemma, 16)
    # 4 sequences x (8 / 8 + 2) pages + 16 / 8 for one step's chunks + scratch, vs 4 x 16 + 1 for full layers
    assert runner.layout.pages == {"full": 1 + 4 * 16, "sliding": 1 + 4 * 3 + 2}
    assert {k: v.shape[:2] for k, v in runner.kv.items()} == {"full": (1, 65), "sliding": (2, 15)}


def _staggered(model, budget):
    prompts = _prompts(6)
    lengths = [5, 12, 9, 20, 3, 15]
    engine = Engine(Runner(model, max_model_len=128, max_num_seqs=4, page_size=8, max_num_batched_tokens=budget))
    reqs = []
    for i, (p, n) in enumerate(zip(prompts, lengths)):  # one newcomer every other step, 6 requests, 4 slots
        reqs.append(engine.submit(Request(p, n)))
        engine.step()
        engine.step()
    while engine.busy():
        engine.step()
    for r, p, n in zip(reqs, prompts, lengths):
        assert r.out == greedy_reference(model, p, n) and r.finish_reason == "length"
    assert engine.pages_used == 0 and sorted(engine.free_slots) == [0, 1, 2, 3]
    return engine.runner


def test_long_prompt_is_prefilled_in_chunks_while_others_decode(model):
    engine = Engine(Runner(model, max_model_len=128, max_num_seqs=2, page_size=8, max_num_batched_tokens=16))
    short, long = _prompts(1, 1)[0][:4], (np.arange(90) % 120 + 3).tolist()
    a = engine.submit(Request(short, 30))
    engine.step()
    b = engine.submit(Request(long, 5))
    seen = []
    while engine.busy():
        engine.step()
        seen.append((len(a.out), b.done))
    # while b's 90-token prompt went in 15 tokens per step (beside a's decode token in the same step), a
    # kept producing a token every iteration
    chunked = [(n, d) for n, d in seen if 0 < d < 90]
    assert len(chunked) >= 5 and all(n2 == n1 + 1 for (n1, _), (n2, _) in zip(chunked, chunked[1:]))
    assert a.out == greedy_reference(model, short, 30) and b.out == greedy_reference(model, long, 5)


def test_abort_frees_pages_and_slot_at_once(model):
    updates = []
    engine = Engine(Runner(model, max_model_len=128, max_num_seqs=2, page_size=8))
    r = engine.submit(Request(_prompts(1)[0], 80, on_update=updates.append))
    for _ in range(5):
        engine.step()
    assert engine.pages_used > 0 and len(r.out) == 4  # 5 steps dispatched, tokens delivered one step late
    engine.abort(r.id)
    engine.step()
    assert r.finish_reason == "abort" and updates[-1].finish_reason == "abort"
    assert engine.pages_used == 0 and not engine.busy()
    waiting = engine.submit(Request([5, 6], 3))  # aborted while still waiting: never runs
    engine.abort(waiting.id)
    engine.step()
    assert waiting.finish_reason == "abort" and waiting.out == [] and engine.pages_used == 0


def test_limits_queue_and_stops(model):
    engine = Engine(Runner(model, max_model_len=32, max_num_seqs=1, page_size=8), max_waiting=1)
    with pytest.raises(InvalidInput, match="prompt of 30 tokens \\+ max_tokens 5 exceeds the model length 32"):
        engine.submit(Request(list(range(3, 33)), 5))
    with pytest.raises(InvalidInput, match="empty prompt"):
        engine.submit(Request([], 5))
    engine.submit(Request([5, 6, 7], 4))
    engine.step()  # running: one slot
    engine.submit(Request([5, 6, 7], 4))  # waiting: one place
    with pytest.raises(QueueFull):
        engine.submit(Request([5, 6, 7], 4))
    while engine.busy():
        engine.step()
    greedy = greedy_reference(model, [5, 6, 7], 8)
    stop = engine.submit(Request([5, 6, 7], 8, stop_ids=frozenset({greedy[3]})))
    while engine.busy():
        engine.step()
    assert stop.out == greedy[:greedy.index(greedy[3])] and stop.finish_reason == "stop"


def test_seeded_sampling_does_not_depend_on_batch_neighbours(model):
    s = Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=11)

    def run(neighbours):
        engine = Engine(Runner(model, max_model_len=128, max_num_seqs=4, page_size=8))
        r = engine.submit(Request([9, 8, 7], 16, s))
        for p in _prompts(neighbours, 5):
            engine.submit(Request(p, 10, Sampling(temperature=0.7, seed=1)))
        while engine.busy():
            engine.step()
        return r.out

    alone, crowded = run(0), run(3)
    assert alone == crowded and alone != greedy_reference(model, [9, 8, 7], 16)


@pytest.mark.parametrize("k,p", [(5, 1.0), (0, 0.5), (40, 0.9)])
def test_top_k_top_p_keep_what_a_sorted_vocabulary_keeps(k, p):
    """The bisection cut-offs of `sample` against the textbook filter on a sorted vocabulary (numpy): every
    draw lies in the allowed set, and 400 draws from these small sets reach all of it."""
    import jax

    from quantkit.runtime.step import sample

    rng = np.random.default_rng(k)
    x = rng.standard_normal((3, 500)).astype(np.float32) * 3
    allowed = []
    for row in x.copy():
        if k:
            row[row < np.sort(row)[::-1][k - 1]] = -np.inf
        pr = np.exp(row - row.max())
        pr /= pr.sum()
        order = np.argsort(-pr)
        allowed.append(set(order[:np.searchsorted(np.cumsum(pr[order]), p) + 1 if p < 1 else k].tolist()))
    draw = jax.jit(sample)
    seen = [set() for _ in allowed]
    for i in range(400):
        toks = draw(jnp.asarray(x), jax.random.split(jax.random.PRNGKey(i), 3), jnp.ones(3), jnp.full(3, k),
                    jnp.full(3, p, jnp.float32))
        for s, t in zip(seen, np.asarray(toks)):
            s.add(int(t))
    assert seen == allowed


def test_greedy_and_draws_are_numpys_argmax_and_jax_categoricals(seed):
    """`pick`'s argmax (two reductions, cheaper to compile for a TPU) is numpy's: the first index of the
    largest value, ties and all--inf rows included; an unfiltered draw is jax.random.categorical's."""
    import jax

    from quantkit.runtime.step import _argmax, sample

    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, (64, 300)).astype(np.float32)  # few values: many tied maxima
    x[0] = -np.inf
    x[1, [7, 200]] = 50.0
    assert (np.asarray(_argmax(jnp.asarray(x))) == np.argmax(x, axis=-1)).all(), seed
    logits = jnp.asarray(rng.standard_normal((64, 300)).astype(np.float32) * 2)
    keys = jax.random.split(jax.random.PRNGKey(seed), 64)
    drawn = sample(logits, keys, jnp.ones(64), jnp.zeros(64, jnp.int32), jnp.ones(64))
    expect = jax.vmap(jax.random.categorical)(keys, logits)
    assert (np.asarray(drawn) == np.asarray(expect)).all() and len(set(np.asarray(drawn).tolist())) > 20, seed



@pytest.mark.parametrize("sampled", [False, True])
def test_pick_against_numpy_and_jax_categorical(sampled):
    """`pick` (the step's sampler) against references it does not share code with: a greedy row's token is
    numpy's argmax of its logits with its banned ids removed, a sampled row's (temperature 0.7, no filter) is
    jax.random.categorical's draw from the unbanned logits over temperature with the key of its seed and
    position; each row's log-probability and top alternatives are numpy's log-softmax of the raw logits (the
    banned ids included: vLLM's raw logprobs). Rows 0-2 ban their own
    best tokens, so that a ban changes a token; the sampled case mixes greedy rows in."""
    import jax

    from quantkit.runtime.step import BANNED, NO_TOKEN, TOP_LOGPROBS, pick, sampling_arrays

    b, vocab = 6, 700
    rng = np.random.default_rng()
    logits = (rng.standard_normal((b, vocab)) * 3).astype(np.float32)
    s = sampling_arrays(b, vocab)
    del s["allow"]
    for r in range(3):  # each bans its 1..3 best tokens
        best = np.argsort(-logits[r])[:r + 1]
        s["banned"][r, :len(best)] = best
    s["banned"][3, :BANNED] = rng.choice(vocab, BANNED, replace=False)
    s["logprobs"][:] = [True, False, True, True, False, True]
    s["seed"][:] = rng.integers(0, 2**31, b)
    if sampled:
        s["temperature"][[1, 2, 4]] = 0.7
    pos = rng.integers(0, 1000, b).astype(np.int32)
    tok, lp, top_ids, top_lps = (np.asarray(x) for x in jax.jit(pick)(
        jnp.asarray(logits), {k: jnp.asarray(v) for k, v in s.items()}, jnp.asarray(pos)))

    logp = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    for r in range(b):
        unbanned = logits[r].copy()
        unbanned[[i for i in s["banned"][r] if i != NO_TOKEN]] = -np.inf
        if s["temperature"][r] > 0:
            key = jax.random.fold_in(jax.random.PRNGKey(s["seed"][r]), pos[r])
            expect = int(jax.random.categorical(key, jnp.asarray(unbanned / np.float32(0.7))))
        else:
            expect = int(np.argmax(unbanned))
        assert tok[r] == expect and tok[r] not in s["banned"][r], (r, tok[r], expect)
        assert abs(lp[r] - logp[r, tok[r]]) < 1e-5, r
        if s["logprobs"][r]:
            order = np.argsort(-logp[r])[:TOP_LOGPROBS]
            assert (top_ids[r] == order).all() and np.abs(top_lps[r] - logp[r, order]).max() < 1e-5, r
    assert tok[0] != np.argmax(logits[0])  # the ban took effect

# ---- prefix caching -------------------------------------------------------------------------------------

def _expected_hit(prompt, earlier, ps=8):
    """Tokens a prompt should find cached: its longest common prefix with what earlier requests wrote
    (their prompts and all but their last output token), in whole pages, leaving its last token."""
    best = 0
    for seq in earlier:
        n = next((i for i, (a, b) in enumerate(zip(prompt, seq)) if a != b), min(len(prompt), len(seq)))
        best = max(best, n)
    return min(best, len(prompt) - 1) // ps * ps


def _run_one_by_one(engine, prompts, n):
    reqs, written = [], []
    for p in prompts:
        reqs.append(engine.submit(Request(p, n)))
        while engine.busy():
            engine.step()
        written.append(p + reqs[-1].out[:-1])
    return reqs, written


def test_prefix_caching_reuses_shared_pages_and_outputs_match(model):
    """Prompts sharing prefixes of 16 (page-aligned), 20 and 27 tokens with earlier ones, one identical to an
    earlier prompt, one extending an earlier conversation (its prompt + output: generated pages are cached
    too), and one made of a cached first page and a second page cached only under another first page (one
    page hit: the hash is chained). Hits equal the common prefixes in whole pages; outputs equal each
    request alone."""
    rng = np.random.default_rng(3)
    base = rng.integers(3, 128, 27).tolist()
    own = [rng.integers(3, 128, int(k)).tolist() for k in (5, 9, 1, 12, 7)]
    prompts = [base + own[0], base[:16] + own[1], base[:20] + own[2], base + own[0], base[:27] + own[3]]
    engine = Engine(Runner(model, max_model_len=128, max_num_seqs=4, page_size=8))
    reqs, written = _run_one_by_one(engine, prompts, 6)
    x = rng.integers(3, 128, 8).tolist()
    follow = [written[0] + [reqs[0].out[-1]] + own[4], [5] * 8 + x + own[1], base[:8] + x + own[2]]
    more, written2 = _run_one_by_one(engine, follow, 6)
    expected = [_expected_hit(p, written[:i]) for i, p in enumerate(prompts)]
    expected += [_expected_hit(p, written + written2[:i]) for i, p in enumerate(follow)]
    assert expected == [0, 16, 16, 24, 24, 32, 0, 8]  # the cases the docstring names
    assert engine.prefix_hits == sum(expected)
    assert engine.prefix_queries == sum(map(len, prompts + follow))
    for r, p in zip(reqs + more, prompts + follow):
        assert r.out == greedy_reference(model, p, 6)
    assert engine.pages_used == 0 and engine.pool.cached_pages > 0


@pytest.mark.parametrize("budget", [512, 16])
def test_prefix_caching_with_staggered_overlapping_requests(model, budget):
    """Requests sharing prefixes of 8-27 tokens arrive every other step while others still prefill and
    decode (with a 16-token budget, prompts go in chunks beside others' decodes): pages named in one step
    are shared in the next, and every output equals the request alone, with prefix caching and without."""
    rng = np.random.default_rng(8)
    base = rng.integers(3, 128, 27).tolist()
    prompts = [base[:k] + rng.integers(3, 128, int(rng.integers(1, 12))).tolist() for k in (27, 8, 20, 27, 16, 24)]
    outs = {}
    for caching in (True, False):
        engine = Engine(Runner(model, max_model_len=128, max_num_seqs=4, page_size=8, max_num_batched_tokens=budget),
                        prefix_caching=caching)
        reqs = []
        for p in prompts:
            reqs.append(engine.submit(Request(p, 5)))
            engine.step()
            engine.step()
        while engine.busy():
            engine.step()
        outs[caching] = [r.out for r in reqs]
        assert (engine.prefix_hits > 0) == caching and engine.pages_used == 0
    assert outs[True] == outs[False] == [greedy_reference(model, p, 5) for p in prompts]


def test_prefix_caching_off_recomputes_everything(model):
    rng = np.random.default_rng(4)
    p = rng.integers(3, 128, 30).tolist()
    engine = Engine(Runner(model, max_model_len=128, max_num_seqs=2, page_size=8), prefix_caching=False)
    reqs, _ = _run_one_by_one(engine, [p, p], 4)
    assert engine.prefix_hits == 0 and engine.pool.cached_pages == 0
    assert reqs[0].out == reqs[1].out == greedy_reference(model, p, 4)


def test_abort_mid_prefill_keeps_pages_another_request_shares(model):
    """a's 90-token prompt goes in 16-token chunks; b (a's first 80 tokens + 30 of its own) is admitted with
    the budget a's last chunk leaves, shares a's 10 cached pages, and is aborted mid-prefill: the pages a
    still reads stay, a's output is that of a alone, and once a ends no page is held."""
    engine = Engine(Runner(model, max_model_len=128, max_num_seqs=2, page_size=8, max_num_batched_tokens=16))
    long = (np.arange(90) * 7 % 120 + 3).tolist()
    a = engine.submit(Request(long, 20))
    for _ in range(3):
        engine.step()
    b = engine.submit(Request(long[:80] + list(range(40, 70)), 6))
    while b.slot < 0:
        engine.step()
    assert engine.prefix_hits == 80 and b.done == 86  # 10 pages shared, then b's own 6-token chunk
    held = lambda: np.count_nonzero(engine.pool.tables["full"][a.slot])  # noqa: E731
    shared = engine.pool.tables["full"][a.slot, :10]
    assert (engine.pool.tables["full"][b.slot, :10] == shared).all() and (engine.pool.refs["full"][shared] == 2).all()
    engine.step()
    assert 86 < b.done < 110  # mid-prefill
    engine.abort(b.id)
    engine.step()
    assert b.finish_reason == "abort" and (engine.pool.refs["full"][shared] == 1).all()
    assert engine.pages_used == held()  # b's own pages went back, a's (shared ones included) are held
    while engine.busy():
        engine.step()
    assert a.out == greedy_reference(model, long, 20) and engine.pages_used == 0


def test_eviction_under_page_pressure_is_least_recently_used(model):
    """A pool of 16 pages (2 slots x 64 tokens) and 6 different 30-token prompts (4 pages each, 3 of them
    cacheable): idle cached pages are evicted, oldest first, when fresh pages run out. The oldest prompt
    asked again finds nothing cached, the newest finds its 24 tokens; every output equals the prompt alone."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 128, 30).tolist() for _ in range(6)]
    engine = Engine(Runner(model, max_model_len=64, max_num_seqs=2, page_size=8))
    assert engine.pool.total == 16
    reqs, _ = _run_one_by_one(engine, prompts, 4)
    hits = engine.prefix_hits
    again, _ = _run_one_by_one(engine, [prompts[0]], 4)
    assert engine.prefix_hits == hits  # evicted
    again += _run_one_by_one(engine, [prompts[-1]], 4)[0]
    assert engine.prefix_hits == hits + 24  # 3 pages of the most recent prompt
    for r, p in zip(reqs + again, prompts + [prompts[0], prompts[-1]]):
        assert r.out == greedy_reference(model, p, 4)
    assert engine.pages_used == 0 and engine.pool.cached_pages <= engine.pool.total


def test_prefix_caching_with_sliding_window_layers(gemma):
    """Gemma 3 (8-token window, 8-token pages): a hit of m pages needs the full layers' pages 0..m-1 and
    only the sliding layers' page m-1 (what a query at 8m sees), which waits idle after leaving the window.
    A 35-token prompt after a 40-token one sharing 30 tokens: 24 tokens cached, output as alone."""
    rng = np.random.default_rng(6)
    base = rng.integers(3, 128, 30).tolist()
    prompts = [base + rng.integers(3, 128, 10).tolist(), base + rng.integers(3, 128, 5).tolist()]
    engine = Engine(Runner(gemma, max_model_len=128, max_num_seqs=4, page_size=8))
    reqs, _ = _run_one_by_one(engine, prompts, 5)
    assert engine.prefix_hits == 24
    for r, p in zip(reqs, prompts):
        assert r.out == greedy_reference(gemma, p, 5)
    assert engine.pages_used == 0


def test_runners_of_one_configuration_compile_each_step_once(tmp_path):
    """A second Runner of the same configuration (here: the same checkpoint loaded again) reuses the first
    one's jitted step programs: the step is traced once per token bucket in all, and both give the same
    logits. Counted with JAX's own trace events; fails if every Runner wraps a fresh jax.jit."""
    import jax

    path = tmp_path / "llama"
    torch.manual_seed(3)  # shapes of their own (hidden 96), so no earlier test's programs are reused
    T.LlamaForCausalLM(T.LlamaConfig(hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128, head_dim=24,
                                     max_position_embeddings=128)).save_pretrained(path)
    traced = []

    def listen(event, _seconds, fun_name="", **_):
        if event == "/jax/core/compile/jaxpr_trace_duration" and fun_name == "step":
            traced.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        rows = [(0, [5, 6, 7, 8, 9], 0)]
        first = Runner(load(path, dtype=jnp.float32), max_model_len=64, page_size=8).forward(rows)[0]
        once = len(traced)
        second = Runner(load(path, dtype=jnp.float32), max_model_len=64, page_size=8).forward(rows)[0]
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert once == 1, traced
    assert len(traced) == once, "the second Runner traced (and compiled) the step again"
    np.testing.assert_array_equal(first, second)


def test_data_parallel_pools_keep_each_devices_pages_and_states_apart():
    """cache.DataParallelPools (4 sequences on 2 devices, 2 state snapshots each): engine slots 0-1 are
    device 0's, 2-3 device 1's; a prefix cached by a sequence on device 0 is found for its neighbour there
    and not for a sequence on device 1 (whose pages it cannot read); state slots and snapshot slots are
    numbered within the sequence's own device's block of 2 + 1 + 2 slots; pages are counted over both."""
    from quantkit.runtime.cache import CacheLayout, DataParallelPools, page_hashes

    layout = CacheLayout(page_size=4, pages_per_seq=4, pages={"full": 9}, layers={"full": 1}, widths={"full": 8},
                         window=None, states=((1, 5, 1, 8), (1, 5, 1, 2, 2)), snapshots=2)
    pools = DataParallelPools(layout, 4, 2)
    assert [pools.device(s) for s in range(4)] == [0, 0, 1, 1]
    assert [pools.state_slot(s) for s in range(4)] == [0, 1, 5, 6]
    hashes = page_hashes(list(range(8)), 4, b"salt")
    assert pools.reserve(0, 0, 7) and pools.reserve(3, 0, 3)
    pools.register(0, hashes)
    assert pools.match(1, hashes, states=False) == 2 and pools.match(3, hashes, states=False) == 0
    assert pools.snapshot(0, hashes[1]) == 0 * 5 + 3 and pools.snapshot(2, hashes[1]) == 1 * 5 + 3
    assert pools.snapshot(3, hashes[0]) == 1 * 5 + 4 and pools.restore(1, hashes[1]) == 3
    assert pools.match(1, hashes) == 2 and pools.match(2, hashes) == 0  # device 1 has the states, not the pages
    assert pools.used == 3 and pools.total == 16 and len(pools.snaps) == 3
    pools.release(0)
    pools.release(3)
    assert pools.used == 0 and pools.cached_pages == 2


def test_host_time_and_read_back_waits_are_told_apart(model, monkeypatch):
    """The engine counts its steps, its host seconds and the seconds it waits on a step's outputs apart
    (/metrics: quantkit_engine_*): with every read-back made 20 ms slower, the waits hold those 20 ms and the
    host seconds do not, and host + waits make up the loop's wall time; with every step finished before the
    host comes for it, each read-back counts as found ready (quantkit_engine_readbacks_ready)."""
    import time

    import jax

    engine = Engine(Runner(model, max_model_len=64, max_num_seqs=2, page_size=8, max_num_batched_tokens=16))
    engine.submit(Request(_prompts(1)[0], 4))
    while engine.busy():  # compiles every program this load runs
        engine.step()
    engine.steps = engine.host_seconds = engine.wait_seconds = 0
    runs = [0]
    run = engine.runner.run

    def counted(*a, **kw):
        runs[0] += 1
        return run(*a, **kw)

    get = jax.device_get

    def slow_get(x):
        time.sleep(0.02)
        return get(x)

    monkeypatch.setattr(engine.runner, "run", counted)
    monkeypatch.setattr(jax, "device_get", slow_get)
    engine.submit(Request(_prompts(1, 1)[0], 6))
    t = time.perf_counter()
    while engine.busy():
        engine.step()
    wall = time.perf_counter() - t
    assert engine.steps == runs[0] >= 6
    assert engine.wait_seconds >= 0.02 * engine.steps  # a read-back a step
    assert 0 < engine.host_seconds < wall - 0.02 * engine.steps
    assert engine.host_seconds + engine.wait_seconds == pytest.approx(wall, rel=0.05)
    # every step finished before the host reads it back (run waits for it): each read-back found it ready
    engine.ready_readbacks = engine.steps = 0
    monkeypatch.setattr(engine.runner, "run", lambda *a, **kw: jax.block_until_ready(counted(*a, **kw)))
    engine.submit(Request(_prompts(1, 2)[0], 6))
    while engine.busy():
        engine.step()
    assert engine.ready_readbacks == engine.steps >= 6


def test_ready_after_the_smallest_bucket_and_the_rest_compiled_ahead(model):
    """`warmup(ahead=True)` runs only the smallest bucket's program and holds the step budget to it: a
    30-token prompt then runs in steps of at most 8 tokens, and its tokens equal those of an engine warmed
    whole; `compile_ahead` compiles the rest without running them, the budget grows to the largest bucket,
    and a step of that bucket, plain or split (structured outputs), then compiles nothing."""
    import jax

    prompt = list(np.random.default_rng(3).integers(3, 128, 30))
    # (3 slots: other shapes, so that its programs are not the ones the engine below must compile itself)
    whole = Engine(Runner(model, max_model_len=64, max_num_seqs=3, page_size=8, max_num_batched_tokens=32))
    whole.warmup()
    ref = whole.submit(Request(list(prompt), 6))
    while whole.busy():
        whole.step()

    engine = Engine(Runner(model, max_model_len=64, max_num_seqs=2, page_size=8, max_num_batched_tokens=32),
                    prefix_caching=False)  # (the second request's prompt runs again)
    rest = engine.warmup(ahead=True, structured=True)
    assert rest == [(16, "step"), (16, "split"), (32, "step"), (32, "split")] and engine.budget == 8
    sizes, run = [], engine.runner.run

    def recorded(batch, *a, **kw):
        sizes.append(batch["tokens"].shape[-1])
        return run(batch, *a, **kw)

    engine.runner.run = recorded
    req = engine.submit(Request(list(prompt), 6))
    while engine.busy():
        engine.step()
    assert max(sizes) == 8 and req.out == ref.out
    engine.compile_ahead(rest, quiet=0)
    assert engine.budget == 32
    compiles, sizes[:] = [], []

    def listen(name, *_, **__):
        if name.endswith("backend_compile_duration"):
            compiles.append(name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        req = engine.submit(Request(list(prompt), 6))
        while engine.busy():
            engine.step()
        batch = engine.runner.empty(32)  # a structured-output step's two programs
        jax.block_until_ready(engine.runner.run_split(batch, lambda: batch["sampling"]))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert 32 in sizes and compiles == [] and req.out == ref.out
