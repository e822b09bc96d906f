"""sample: a token for every row of float32 logits [b, V], its log-probability and the top alternatives, in
one read of the logits from HBM (the sampler of a TPU step; runtime/step.py `pick` is its XLA path and says
what each row's parameters mean).

For row r (x its logits, col the token ids):
  L = x where the row's structured-output mask allows, else -inf                  (log-probabilities' logits)
  B = L, the row's banned ids at -inf                                              (the sample's)
  lse = log sum exp L;  token = argmax B when the temperature is 0, else argmax (F + g), where F is B over the
  temperature with what top-k and top-p drop at -inf (step._filtered's search, to its precision) and g
  jax.random.gumbel(key) [V] (the row's key: Threefry-2x32, bit for bit, so a seeded draw is the XLA path's);
  logprob = L[token] - lse;  with logprobs: the 20 largest L (value, then lower id first) less lse, else 0.

Grid (row blocks of 8,): a step DMAs its rows' logits [8, V] (4 MiB at a 128k vocabulary) and masks into
VMEM once; every pass below (the maximum, the log-sum-exp, the cut-off searches, the draw, the
alternatives) runs over the VMEM copy in chunks of lanes, so that no [b, V] array reaches HBM. The mask
comes in the device layout runtime/structured.py `spread` writes: token t is bit t // W of word t % W (W a
multiple of 1,024), so a chunk's bits are one aligned slice of words shifted by one amount. Whether a block filters
(top-k / top-p), reports alternatives, samples at all, has a mask or banned ids is scalar-prefetched, so that a
block without them skips their work (an all-greedy block: the scores and the noise, its draw the first pass's
argmax).

File order (docs/architecture.md, rule 5): validation -> cost estimate -> pallas_call -> one jitted public entry.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

ROWS = 8  # rows a grid step (a float32 tile's sublanes)
LANES = 128
TOP = 20  # alternatives (step.TOP_LOGPROBS)
WAYS, ROUNDS = 8, 14  # the cut-off search (step._cut)
TINY = float(np.finfo(np.float32).tiny)

# ---- validation -----------------------------------------------------------------------------------


def servable(vocab: int) -> bool:
    """Whether the kernel takes a vocabulary (whole 128-lane chunks; every published vocabulary quantkit
    serves is: 128,256, 151,936, 201,088, 262,144)."""
    return vocab % LANES == 0


def chunk(vocab: int) -> int:
    """Lanes a pass handles at a time: the largest of 1,024 / 512 / 256 / 128 dividing the vocabulary."""
    return next(c for c in (1024, 512, 256, 128) if vocab % c == 0)


def vmem_bytes(vocab: int, width: int) -> int:
    """VMEM of a grid step: logits and mask blocks double-buffered, the masked logits and the scores
    (float32 scratch), and the small blocks."""
    return 2 * ROWS * (vocab + width) * 4 + 2 * ROWS * vocab * 4 + (1 << 20)


# ---- cost estimate ---------------------------------------------------------------------------------

def cost(b: int, vocab: int, width: int, params: int) -> pl.CostEstimate:
    """The logits, masks (`width` words a row) and parameters (`params` integers and 2 floats a row) read
    once, the outputs written once; per element a mask, a ban, the Threefry noise (~120 integer operations,
    two logs) and the passes' comparisons (an estimate: the searches run only where a row filters)."""
    n = b * vocab
    io = b * (vocab + width + params + 2) * 4 + b * (2 + 2 * TOP) * 4
    return pl.CostEstimate(flops=200 * n, transcendentals=3 * n, bytes_accessed=io)


# ---- kernel ----------------------------------------------------------------------------------------

def _rotl(x, r: int):
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _threefry(k0, k1, x1):
    """Threefry-2x32 (20 rounds, Random123's rotations) of the counter (0, x1) under key (k0, k1): the two
    output words xored, jax.random's partitionable bits for flat index x1."""
    ks = (k0, k1, k0 ^ k1 ^ np.uint32(0x1BD11BDA))
    x0, x1 = k0 + jnp.zeros_like(x1), x1 + k1
    for i in range(5):
        for r in ((13, 15, 26, 6), (17, 29, 16, 24))[i % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, r) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0 ^ x1


def _gumbel(k0, k1, col):
    """jax.random.gumbel(key, [V], float32)[col] ("low" mode): -log(-log(u)), u uniform in [tiny, 1)."""
    bits = _threefry(k0, k1, col.astype(jnp.uint32))
    u = jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | np.uint32(0x3F800000), jnp.float32) - 1.0
    u = jnp.maximum(TINY, u * (np.float32(1.0) - np.float32(TINY)) + TINY)
    return -jnp.log(-jnp.log(u))


def _kernel(flags_ref, x_ref, allow_ref, ints_ref, floats_ref, tok_ref, lp_ref, ids_ref, lps_ref, l_ref, s_ref, *,
            vocab: int, width: int):
    c, rows = chunk(vocab), x_ref.shape[0]
    n = vocab // c
    i = pl.program_id(0)
    ints, floats = ints_ref[...], floats_ref[...]
    k0, k1 = (jax.lax.bitcast_convert_type(ints[:, j:j + 1], jnp.uint32) for j in (0, 1))
    top_k, want, banned = ints[:, 2:3], ints[:, 3:4] != 0, [ints[:, 4 + j:5 + j] for j in range(ints.shape[1] - 4)]
    temp, top_p = floats[:, 0:1], floats[:, 1:2]
    greedy = temp <= 0
    lane = jax.lax.broadcasted_iota(jnp.int32, (rows, c), 1)
    ninf, zeros = jnp.full((rows, c), -jnp.inf, jnp.float32), jnp.zeros((rows, c), jnp.float32)

    def sweep(body, init):  # body(col [rows, c], start, lanes, carry) over the vocabulary's chunks
        def step(j, carry):
            start = pl.multiple_of(j * c, c)
            return body(lane + start, start, pl.ds(start, c), carry)
        return jax.lax.fori_loop(0, n, step, init)

    def lanes_max(a):
        return jnp.max(a, axis=-1, keepdims=True)

    def lanes_sum(a):
        return jnp.sum(a, axis=-1, keepdims=True)

    def unbanned(col, v):
        hit = col == banned[0]
        for b in banned[1:]:
            hit = hit | (col == b)
        return jnp.where(hit, -jnp.inf, v)

    # the first pass: the masked logits L into scratch, their maximum, and the argmax of the unbanned ones (a
    # greedy row's draw), the mask and the bans applied only in blocks that have them
    def first(masked: bool, bans: bool):
        def body(col, start, at, carry):
            m, best, where_ = carry
            v = x_ref[:, at]
            if masked:
                word = allow_ref[:, pl.ds(pl.multiple_of(start % width, c), c)]
                v = jnp.where(((word >> (start // width)) & 1) != 0, v, -jnp.inf)
            l_ref[:, at] = v
            u = unbanned(col, v) if bans else v
            up = u > best
            return jnp.maximum(m, v), jnp.where(up, u, best), jnp.where(up, col, where_)
        return lambda: sweep(body, (ninf, ninf, lane))

    masked, bans = flags_ref[i, 3] != 0, flags_ref[i, 4] != 0
    m, best, where_ = jax.lax.cond(masked, lambda: jax.lax.cond(bans, first(True, True), first(True, False)),
                                   lambda: jax.lax.cond(bans, first(False, True), first(False, False)))
    top = lanes_max(m)
    lse = top + jnp.log(lanes_sum(sweep(lambda col, start, at, s: s + jnp.exp(l_ref[:, at] - top), zeros)))

    def scores(col, start, at, carry):  # what a sampled row draws from: the unbanned logits over the temperature
        s_ref[:, at] = unbanned(col, l_ref[:, at]) / jnp.maximum(temp, 1e-6)
        return carry

    sampled = flags_ref[i, 2] != 0  # a row of the block samples: else its scores and noise are skipped

    @pl.when(sampled)
    def _():
        sweep(scores, 0)

    def cut(value, part, enough):
        """step._cut over the chunks: per row the largest threshold t (to the search's precision) with
        enough(sum of part(value, t))."""
        lo = -lanes_max(sweep(lambda col, start, at, m: jnp.maximum(
            m, jnp.where(jnp.isfinite(v := value(at)), -v, -jnp.inf)), ninf))
        hi = lanes_max(sweep(lambda col, start, at, m: jnp.maximum(m, value(at)), ninf))

        def round_(_, bounds):
            lo, hi = bounds
            edges = [lo, *(lo + (hi - lo) * np.float32(w / WAYS) for w in range(1, WAYS)), hi]
            sums = sweep(lambda col, start, at, acc: tuple(a + part(value(at), t) for a, t in zip(acc, edges[1:-1])),
                         (zeros,) * (WAYS - 1))
            k = sum(enough(lanes_sum(a)).astype(jnp.int32) for a in sums)  # thresholds that keep enough
            new_lo, new_hi = lo, edges[1]
            for w in range(1, WAYS):
                new_lo, new_hi = jnp.where(k == w, edges[w], new_lo), jnp.where(k == w, edges[w + 1], new_hi)
            return new_lo, new_hi

        return jax.lax.fori_loop(0, ROUNDS, round_, (lo, hi))[0]

    @pl.when(flags_ref[i, 0] != 0)
    def _():
        kth = cut(lambda at: s_ref[:, at], lambda v, t: (v >= t).astype(jnp.float32),
                  lambda count: count >= top_k.astype(jnp.float32))

        def topk(col, start, at, m):
            v = s_ref[:, at]
            v = jnp.where((top_k > 0) & (v < kth), -jnp.inf, v)
            s_ref[:, at] = v
            return jnp.maximum(m, v)

        mx = lanes_max(sweep(topk, ninf))
        z = lanes_sum(sweep(lambda col, start, at, s: s + jnp.exp(s_ref[:, at] - mx), zeros))
        prob = lambda at: jnp.exp(s_ref[:, at] - mx) / z  # noqa: E731
        floor = cut(prob, lambda p, t: jnp.where(p >= t, p, 0.0), lambda mass: mass >= top_p)

        def topp(col, start, at, carry):
            s_ref[:, at] = jnp.where((top_p < 1) & (prob(at) < floor), -jnp.inf, s_ref[:, at])
            return carry

        sweep(topp, 0)

    # a sampled block's draw: one argmax over each row (a greedy row's unbanned logits, a sampled row's scores +
    # noise), carried per lane (the first of equal values), with the masked logit at the best place; an
    # all-greedy block's is the first pass's (its logit the best value), without the noise's ~120 integer
    # operations an element (on a v5e a greedy block of 8 rows of a 128k vocabulary took 196 us with it)
    def draw():
        def body(col, start, at, carry):
            best, where_, logit = carry
            l = l_ref[:, at]
            v = jnp.where(greedy, unbanned(col, l), s_ref[:, at] + _gumbel(k0, k1, col))
            up = v > best
            return jnp.where(up, v, best), jnp.where(up, col, where_), jnp.where(up, l, logit)
        return sweep(body, (ninf, lane, ninf))

    best, where_, logit = jax.lax.cond(sampled, draw, lambda: (best, where_, best))
    mx = lanes_max(best)
    tok = jnp.min(jnp.where(best == mx, where_, vocab), axis=-1, keepdims=True)
    tok_ref[...] = tok
    lp_ref[...] = lanes_max(jnp.where(where_ == tok, logit, -jnp.inf)) - lse

    ids_ref[...] = jnp.zeros(ids_ref.shape, jnp.int32)
    lps_ref[...] = jnp.zeros(lps_ref.shape, jnp.float32)

    @pl.when(flags_ref[i, 1] != 0)
    def _():
        # the TOP largest masked logits, value first, then the lower id: each pass takes the best of those
        # after the last taken in that order
        last_v, last_id = jnp.full((rows, 1), jnp.inf, jnp.float32), jnp.full((rows, 1), -1, jnp.int32)
        for t in range(TOP):
            def alt(col, start, at, carry, last_v=last_v, last_id=last_id):
                best, where_ = carry
                v = l_ref[:, at]
                after = (v < last_v) | ((v == last_v) & (col > last_id))
                up = after & ((v > best) | ((v == best) & (col < where_)))
                return jnp.where(up, v, best), jnp.where(up, col, where_)

            best, where_ = sweep(alt, (ninf, jnp.full((rows, c), vocab, jnp.int32)))
            last_v = lanes_max(best)
            last_id = jnp.min(jnp.where(best == last_v, where_, vocab), axis=-1, keepdims=True)
            ids_ref[:, t:t + 1] = jnp.where(want, last_id, 0)
            lps_ref[:, t:t + 1] = jnp.where(want, last_v - lse, 0.0)


# ---- pallas_call -------------------------------------------------------------------------------------

def _call(flags, logits, allow, ints, floats, rows: int, interpret):
    b, vocab = logits.shape
    row = lambda r, *_: (r, 0)  # noqa: E731
    blk = lambda w: pl.BlockSpec((rows, w), row)  # noqa: E731
    limit = min(100 << 20, max(32 << 20, vmem_bytes(vocab, allow.shape[1]) + (8 << 20)))
    return pl.pallas_call(
        functools.partial(_kernel, vocab=vocab, width=allow.shape[1]),
        out_shape=(jax.ShapeDtypeStruct((b, 1), jnp.int32), jax.ShapeDtypeStruct((b, 1), jnp.float32),
                   jax.ShapeDtypeStruct((b, TOP), jnp.int32), jax.ShapeDtypeStruct((b, TOP), jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(pl.cdiv(b, rows),),
            in_specs=[blk(vocab), blk(allow.shape[1]), blk(ints.shape[1]), blk(floats.shape[1])],
            out_specs=[blk(1), blk(1), blk(TOP), blk(TOP)],
            scratch_shapes=[pltpu.VMEM((rows, vocab), jnp.float32), pltpu.VMEM((rows, vocab), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=limit),
        cost_estimate=cost(b, vocab, allow.shape[1], ints.shape[1]),
        name="sample",
        interpret=interpret,
    )(flags, logits, allow, ints, floats)


# ---- public entry ----------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("interpret",))
def sample(logits, allow, keys, temperature, top_k, top_p, banned, logprobs, *, interpret=False):
    """Token, log-probability and alternatives of every row (module docstring).

    Args:
        logits: [b, V] float32, V a multiple of 128 (`servable`).
        allow: [b, W] int32, each row's mask in the device layout (runtime/structured.py `spread`: token t is
            bit t // W of word t % W, W a multiple of 1,024; -1: all tokens), or None: no masks (a block
            whose words are all -1 skips the masking; a step's masks are read twice, once for that).
        keys: [b, 2] uint32, each row's jax.random key data; temperature, top_p [b] float32; top_k [b] int32;
            banned [b, n] int32 ids never drawn (out of range: none); logprobs [b] bool.
    Returns:
        (token [b] int32, logprob [b] float32, top ids [b, 20] int32, top logprobs [b, 20] float32; zeros
        for rows without logprobs).
    """
    b = logits.shape[0]
    if allow is None:  # no masks: a block of all-allowing words the kernel never reads (the flag below)
        allow = jnp.full((b, 1024), -1, jnp.int32)
    rows = min(b, ROWS)
    blocks = pl.cdiv(b, rows)
    pad = blocks * rows - b
    per_block = lambda f: jnp.any(jnp.pad(f, (0, pad)).reshape(blocks, rows), axis=1)  # noqa: E731
    vocab = logits.shape[1]
    flags = jnp.stack([per_block(((top_k > 0) | (top_p < 1)) & (temperature > 0)),
                       per_block(logprobs), per_block(temperature > 0), per_block(jnp.any(allow != -1, axis=1)),
                       per_block(jnp.any((banned >= 0) & (banned < vocab), axis=1))], axis=1).astype(jnp.int32)
    ints = jnp.concatenate([jax.lax.bitcast_convert_type(keys, jnp.int32), top_k[:, None].astype(jnp.int32),
                            logprobs[:, None].astype(jnp.int32), banned.astype(jnp.int32)], axis=1)
    floats = jnp.stack([temperature, top_p], axis=1).astype(jnp.float32)
    tok, lp, ids, lps = _call(flags, logits.astype(jnp.float32), allow.astype(jnp.int32), ints, floats, rows,
                              interpret)
    return tok[:, 0], lp[:, 0], ids, lps
