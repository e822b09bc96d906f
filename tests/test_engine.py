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


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "llama"
    torch.manual_seed(0)
    T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128, head_dim=16,
                                     max_position_embeddings=256)).save_pretrained(path)
    return load(path, dtype=jnp.float32)


def _reference(model, prompt, n):
    """Greedy tokens one at a time through the plain forward step (no engine, no sampling code)."""
    r = Runner(model, max_model_len=128, page_size=8)
    logits = r.forward([(0, prompt, 0)])[0][-1]
    out = []
    for i in range(n):
        out.append(int(np.argmax(logits)))
        logits = r.forward([(0, [out[-1]], len(prompt) + i)])[0][-1]
    return out


def _prompts(k, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 128, int(rng.integers(3, 40))).tolist() for _ in range(k)]


@pytest.mark.parametrize("budget", [512, 16])
def test_staggered_requests_match_each_alone(model, budget):
    _staggered(model, budget)


def test_sliding_window_pages_with_chunked_prompts(tmp_path):
    """Gemma 3 with an 8-token window: its local layers hold only the pages a query can still see (pages
    that leave the window go back to their pool), so their pool is sized by the window, not the model
    length; prompts up to 40 tokens in chunks of a 16-token budget."""
    torch.manual_seed(0)
    T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, head_dim=16, max_position_embeddings=256, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])).save_pretrained(tmp_path)
    gemma = load(tmp_path, dtype=jnp.float32)
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
        assert r.out == _reference(model, p, n) and r.finish_reason == "length"
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
    assert a.out == _reference(model, short, 30) and b.out == _reference(model, long, 5)


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
    greedy = _reference(model, [5, 6, 7], 8)
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
    assert alone == crowded and alone != _reference(model, [9, 8, 7], 16)


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
