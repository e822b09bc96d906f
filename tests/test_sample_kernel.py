"""kernels/sample.py, the TPU sampler, run in Pallas interpret mode against numpy: the masked, banned,
tempered, top-k / top-p filtered Gumbel-max draw whose noise is jax.random.gumbel's (the row's key), the
log-probabilities and the 20 alternatives; and compiled for a v6e, the logits read once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from quantkit.kernels import sample as kernel
from quantkit.runtime.structured import device_words, spread, words

INTERPRET = pltpu.InterpretParams()  # tests/test_tpu.py runs these tests with it off, on a TPU
# log-probabilities: float32 log-sum-exp in another order over <= 2,048 terms, a few ulp of values ~1-10; on a
# TPU (tests/test_tpu.py) its exp and log are approximations good to ~1e-6 relative (4e-5 seen on a v5e): 1e-4
LOGPROB_TOL = 2e-6

BANNED = 3


def _rows(rng, b: int, vocab: int, shared: bool) -> dict:
    """b rows of every kind: greedy, sampled, top-k, top-p, both; banned ids (one a row's best); masks (and
    rows without); logprobs on every other row. Logits drawn with ties (rounded), so that the order of equal
    values is exercised. shared: every row the same logits, sampled at temperature 2 with its own key, top-k
    3 or top-p 0.5 by turns, so that draws cover the kept tokens (a cut-off one off shows in some row)."""
    logits = np.round(rng.standard_normal((b, vocab)) * 3, 1).astype(np.float32)
    kind = np.arange(b) % 5
    raw = rng.integers(-2**31, 2**31, (b, words(vocab)), dtype=np.int64).astype(np.int32)
    raw[np.arange(b) % 3 == 0] = -1
    banned = np.full((b, BANNED), 2**31 - 1, np.int32)
    banned[1::2, 0] = logits[1::2].argmax(1)
    banned[1::2, 1] = rng.integers(0, vocab, b // 2)
    if shared:
        logits[:], raw[:], kind = logits[0], -1, np.where(np.arange(b) % 2 == 0, 2, 3)
    return {"logits": logits, "raw": raw, "banned": banned,
            "temperature": np.where(kind == 0, 0, 2 if shared else rng.uniform(0.5, 1.5, b)).astype(np.float32),
            "top_k": np.where(np.isin(kind, (2, 4)), 3 if shared else rng.integers(1, 40, b), 0).astype(np.int32),
            "top_p": np.where(np.isin(kind, (3, 4)), 0.5 if shared else rng.uniform(0.3, 0.95, b), 1).astype("f4"),
            "logprobs": np.arange(b) % 2 == 0,
            "keys": np.asarray(jax.vmap(lambda s: jax.random.fold_in(jax.random.PRNGKey(s), 7))(
                rng.integers(0, 2**31, b).astype(np.uint32)))}


def _reference(r: dict) -> tuple:
    """numpy: the row's allowed logits L, B with banned ids out, lse of L; the token is argmax B (greedy) or
    argmax of B / T filtered (top-k: values below the k-th largest out; top-p: then the fewest most likely
    tokens whose probability reaches p, ties at the cut kept) plus jax.random.gumbel(key); the 20 largest L
    by value, then lower id."""
    b, vocab = r["logits"].shape
    bits = (r["raw"].view(np.uint32)[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
    big = np.where(bits.reshape(b, -1)[:, :vocab] == 1, r["logits"], -np.inf)
    tok, lp, ids, lps = np.zeros(b, np.int64), np.zeros(b), np.zeros((b, 20), np.int64), np.zeros((b, 20))
    for i in range(b):
        L = big[i].astype(np.float64)
        B = L.copy()
        B[[t for t in r["banned"][i] if t < vocab]] = -np.inf
        lse = np.log(np.sum(np.exp(L - L.max()))) + L.max()
        if r["temperature"][i] <= 0:
            tok[i] = np.argmax(B)
        else:
            x = B / r["temperature"][i]
            if r["top_k"][i] > 0:
                x = np.where(x < np.sort(x)[::-1][r["top_k"][i] - 1], -np.inf, x)
            if r["top_p"][i] < 1:
                p = np.exp(x - x.max()) / np.sum(np.exp(x - x.max()))
                q = np.sort(p)[::-1]
                floor = q[np.searchsorted(np.cumsum(q), r["top_p"][i])]
                x = np.where(p < floor, -np.inf, x)
            noise = np.asarray(jax.random.gumbel(jnp.asarray(r["keys"][i]), (vocab,), jnp.float32))
            tok[i] = np.argmax(x + noise)
        lp[i] = L[tok[i]] - lse
        order = np.lexsort((np.arange(vocab), -L))[:20]
        ids[i], lps[i] = order, L[order] - lse
    return tok, lp, ids, lps


@pytest.mark.parametrize("vocab,b,shared,greedy,drop", [
    (384, 11, False, False, ""), (1024, 8, False, False, ""), (2048, 3, False, False, ""),
    (256, 64, True, False, ""), (384, 11, False, True, ""), (384, 11, False, True, "masks bans"),
    (1024, 8, False, False, "masks"), (384, 11, False, True, "bans")])
def test_kernel_draws_what_numpy_draws_with_jax_noise(vocab, b, shared, greedy, drop):
    """Every row kind, three chunkings (3 x 128, 1 x 1,024, 2 x 1,024 lanes), a partial row block, and 64
    draws from one distribution's top 3 and top half (`_rows`); greedy: every row at temperature 0 (the
    kernel then skips the scores and the noise); drop: no row with a mask (the kernel given none) or banned
    ids (each block then skips that work: the four kinds of first pass). Tokens
    and alternative ids exactly (the noise is jax.random's, bit for bit; logits with ties; the top-p cut by
    search lands between distinct probabilities); log-probabilities to 2e-6 (float32 log-sum-exp in another
    order over <= 2,048 terms: a few ulp of values ~1-10)."""
    rng = np.random.default_rng()
    r = _rows(rng, b, vocab, shared)
    if greedy:
        r["temperature"][:] = 0
    if "masks" in drop:
        r["raw"][:] = -1
    if "bans" in drop:
        r["banned"][:] = 2**31 - 1
    allow = None if "masks" in drop else jnp.asarray(np.stack([spread(m, device_words(vocab)) for m in r["raw"]]))
    out = kernel.sample(jnp.asarray(r["logits"]), allow, jnp.asarray(r["keys"]), r["temperature"],
                        r["top_k"], r["top_p"], r["banned"], r["logprobs"], interpret=INTERPRET)
    tok, lp, ids, lps = (np.asarray(x) for x in out)
    rtok, rlp, rids, rlps = _reference(r)
    assert np.array_equal(tok, rtok)
    assert np.abs(lp - rlp).max() < LOGPROB_TOL
    want = r["logprobs"]
    assert np.array_equal(ids[want], rids[want]) and np.abs(lps[want] - rlps[want]).max() < LOGPROB_TOL
    assert not ids[~want].any() and not lps[~want].any()  # rows without logprobs: zeros
    sampled = r["temperature"] > 0
    assert greedy or (tok[sampled] != r["logits"][sampled].argmax(1)).any()  # (the noise does move draws)


def test_compiles_for_a_v6e_reading_the_logits_once():
    """The sampler of Llama-3's 128,256-token vocabulary for 80 rows (16 sequences x (1 + 4) verified
    positions) and Gemma's 262,144 for 16, compiled deviceless for a v6e: the program's bytes are the
    logits and masks read once (its declared cost; XLA's sampler counted 898 MB for the 80 rows)."""
    from quantkit.runtime.aot import compile_for

    for vocab, b in ((128256, 80), (262144, 16)):
        f = jax.ShapeDtypeStruct
        args = (f((b, vocab), jnp.float32), f((b, device_words(vocab)), jnp.int32), f((b, 2), jnp.uint32),
                f((b,), jnp.float32), f((b,), jnp.int32), f((b,), jnp.float32), f((b, BANNED), jnp.int32),
                f((b,), bool))
        compiled, _ = compile_for("v6e", lambda *a: kernel.sample(*a), *args)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        logits = b * vocab * 4
        assert logits < cost["bytes accessed"] < 1.1 * logits + 4 * b * device_words(vocab) * 4 + (1 << 20)
