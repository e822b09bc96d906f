"""The one ragged step: the flattened tokens of all scheduled sequences (decode tokens and prompt chunks
together) -> the next token of each sequence, sampled on device, and the updated cache. What `plan`
compiles, what the engine runs.

A step's batch (host arrays, built by `Batch`): tokens [T] (prompt tokens; a decode row's token comes from
the device: `prev_slot` >= 0 takes the last token sampled for that slot, so the host never waits for a
step's output before preparing the next), positions [T], cu_q_lens [S + 1], kv_lens [S] (tokens in the
cache after the step), num_seqs [1], per kind block tables [S, pages_per_seq], slot [S] (the engine slot of
each row; padding rows: max_num_seqs, dropped) and sampling arrays [S]. Shapes are bucketed by T only
(S = min(T, max_num_seqs)), so a server compiles one program per token bucket.

With a drafter on the device (speculative decoding: the eagle3 or mtp head, or the n-gram lookup) the
device's `last` holds three parts of max_num_seqs + 1 entries, by slot: the last token, the shift (the
verifying step's accepted tokens less the tokens it ran: 0 or minus its rejected drafts) and the k drafts
the drafter proposed (`head_entry`); a row's drafts are its `prev_slot` entries there, and a row with
`follow` set starts where its slot's shift says: the host schedules it before reading the previous step
back, as if every draft had been accepted (`_followed`), so that it need not wait for the device between
verifying steps.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from quantkit.errors import InvalidInput
from quantkit.kernels import sample as sample_kernel
from quantkit.quant.qtensor import QTensor
from quantkit.runtime.cache import (CacheLayout, DataParallelPools, PagePool, cache_layout, kv_fp8_dtype,
                                    with_kv_scales)
from quantkit.runtime.config import MAX_NUM_BATCHED_TOKENS, PAGE_SIZE
from quantkit.runtime.models import forward_for
from quantkit.runtime.models.common import argmax as _argmax
from quantkit.runtime.models.common import logits as project
from quantkit.runtime.models.common import live_tokens
from quantkit.runtime.models.gdn import keep_checkpoints
from quantkit.runtime.sharding import (AXIS, cache_sharding, local_view, make_mesh, place_row_major, row_major,
                                       shard_params)
from quantkit.runtime.speculative import Lookup
from quantkit.runtime.structured import device_words
from quantkit.runtime.ops import dense_as_qtensor, interpret, interpreted_chip, interpreted_tpu_kernels, tpu_chip

TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's limit)
STOP, STEP, LOGITS, VERIFY, DECODE = 0, 1, 2, 3, 4  # what the first process of a multi-process run broadcasts (Runner._call)
BANNED = 8  # the most token ids a row may forbid its sample (Row.banned); padding: NO_TOKEN, out of range
NO_TOKEN = np.iinfo(np.int32).max


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_k 0 and top_p 1 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def _cut(x: jax.Array, enough, ways: int = 8, rounds: int = 14) -> jax.Array:
    """Per row of x [b, n], the largest threshold t (to the search's precision) with enough(x >= t) true:
    a cut-off found by searching the row's value range, without sorting the vocabulary (a sort of a 262k
    vocabulary took 32 s of a 40 s TPU compile). enough(keep [b, m, n]) -> [b, m] tests m thresholds at
    once: each round splits the bracket [lo, hi) into `ways` parts in one pass over x, where bisection
    takes a pass per halving (8 ways x 14 rounds narrow it as 42 bisection steps: 14 passes, not 42, each
    with 7 comparisons an element; docs/runtime.md)."""
    lo = jnp.min(jnp.where(jnp.isfinite(x), x, jnp.inf), axis=-1)
    hi = jnp.max(x, axis=-1)
    frac = jnp.arange(1, ways, dtype=x.dtype) / ways

    def body(_, bounds):
        lo, hi = bounds
        t = lo[:, None] + (hi - lo)[:, None] * frac  # [b, ways - 1], increasing
        ok = enough(x[:, None, :] >= t[:, :, None])  # true up to some threshold (keeping less is not enough)
        j = jnp.sum(ok, axis=-1)  # thresholds that keep enough: lo moves to the last, hi to the next
        edges = jnp.concatenate([lo[:, None], t, hi[:, None]], axis=-1)
        return (jnp.take_along_axis(edges, j[:, None], -1)[:, 0], jnp.take_along_axis(edges, j[:, None] + 1, -1)[:, 0])

    return jax.lax.fori_loop(0, rounds, body, (lo, hi))[0]


def _filtered(scaled: jax.Array, top_k, top_p) -> jax.Array:
    """Logits over temperature [b, vocab] with what top-k and then top-p drop at -inf.

    top-k keeps the tokens at least as likely as the k-th, top-p then the most likely tokens whose
    probability reaches top_p (the smallest such set; tokens tied at a cut-off are all kept). The cut-offs
    are found by search (`_cut`).
    """
    kth = _cut(scaled, lambda keep: jnp.sum(keep, -1) >= top_k[:, None])
    x = jnp.where((top_k[:, None] > 0) & (scaled < kth[:, None]), -jnp.inf, scaled)
    p = jax.nn.softmax(x, axis=-1)
    floor = _cut(p, lambda keep: jnp.sum(jnp.where(keep, p[:, None, :], 0.0), -1) >= top_p[:, None])
    return jnp.where((top_p[:, None] < 1) & (p < floor[:, None]), -jnp.inf, x)


def _unbanned(logits: jax.Array, banned: jax.Array | None) -> jax.Array:
    """logits [b, vocab] with each row's banned ids [b, BANNED] at -inf, elementwise (no scatter into a
    copy), so that XLA computes it inside each reduction that reads it."""
    if banned is None:
        return logits
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    return jnp.where(functools.reduce(jnp.logical_or, [ids == banned[:, j, None] for j in range(banned.shape[1])]),
                     -jnp.inf, logits)


def sample(logits: jax.Array, keys: jax.Array, temperature, top_k, top_p, banned=None) -> jax.Array:
    """One token per row of logits [b, vocab] with per-row keys [b, 2], parameters [b] and banned ids
    (`_unbanned`): the argmax where the temperature is 0, else jax.random.categorical's Gumbel-max draw from
    the logits over temperature, filtered by top-k and top-p (`_filtered`) only when some row asks for it.
    One argmax over all rows (a greedy row's logits enter it as they are), written so that XLA fuses the
    ban, the scaling and the noise into that reduction instead of storing [b, vocab] arrays on the way."""
    greedy = (temperature <= 0)[:, None]

    def draw(filter_rows):
        x = _unbanned(logits, banned)
        scaled = x / jnp.maximum(temperature, 1e-6)[:, None]
        if filter_rows:
            scaled = _filtered(scaled, top_k, top_p)
        noise = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[-1:], logits.dtype))(keys)
        return _argmax(jnp.where(greedy, x, scaled + noise))

    return jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1)), lambda: draw(True), lambda: draw(False))


def allowed_logits(logits: jax.Array, allow: jax.Array) -> jax.Array:
    """logits [b, vocab] with the tokens a row's bitmask allow [b, W] (int32 words in the device layout,
    structured.spread: token t is bit t // W of word t % W) does not set at -inf. The bits are expanded to a
    boolean [b, vocab] only when some row has a mask (a cond); the selection itself is elementwise, so that
    XLA computes it inside the reductions that read it instead of storing a masked copy of the logits."""
    def keep():
        bits = (allow[:, None, :] >> jnp.arange(32, dtype=jnp.int32)[:, None]) & 1
        return bits.reshape(allow.shape[0], -1)[:, :logits.shape[-1]] != 0

    return jnp.where(jax.lax.cond(jnp.any(allow != -1), keep, lambda: jnp.ones(logits.shape, bool)), logits, -jnp.inf)


def pick(logits: jax.Array, s: dict, next_pos: jax.Array, draft: jax.Array | None = None, split: bool = False):
    """Token, its log-probability and the top alternatives for logits [b, vocab] (float32).

    The key of a draw depends only on the request's seed and the position of the drawn token, so a seeded
    request gives the same text whatever else shares its batch. A row's structured-output mask (`allow`)
    applies first, to the sample and to the log-probabilities (the masked distribution, as vLLM reports
    it); its banned ids [BANNED] are never drawn, its log-probabilities those of the unbanned logits
    (vLLM's raw logprobs). With draft [b] (speculative decoding; NO_TOKEN: none), whether the token drawn
    is the draft is a fifth output: so the draft is accepted with probability p(draft), and where it is
    not, the token drawn is distributed as p without it: speculative sampling's rule for a drafter that is
    certain (max(p - q, 0) renormalized for a one-hot q), drawn with the very key a step without drafts
    uses, so that a seeded request's tokens do not depend on its drafts.

    On a TPU one kernel (kernels/sample.py) reads the logits once and computes all of it, unless `split`
    (a tensor-parallel mesh, whose devices may each hold a slice of the vocabulary): XLA's reductions below
    then combine the slices.
    """
    keys = jax.vmap(lambda seed, p: jax.random.fold_in(jax.random.PRNGKey(seed), p))(s["seed"], next_pos)
    banned = s["banned"]
    if tpu_chip() is not None and not split and sample_kernel.servable(logits.shape[-1]):
        out = sample_kernel.sample(logits, s.get("allow"), keys, s["temperature"], s["top_k"], s["top_p"], banned,
                                   s["logprobs"], interpret=interpret())
        return out if draft is None else (*out, out[0] == draft)
    if "allow" in s:
        logits = allowed_logits(logits, s["allow"])
    tok = jax.lax.cond(jnp.all(s["temperature"] <= 0), lambda: _argmax(_unbanned(logits, banned)),
                       lambda: sample(logits, keys, s["temperature"], s["top_k"], s["top_p"], banned))
    # log-probabilities without a [b, vocab] log-softmax: the chosen token's and the top ones' logits less
    # the row's log-sum-exp
    top = jnp.max(logits, axis=-1, keepdims=True)
    lse = top + jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True))
    b = logits.shape[0]

    def alternatives():
        values, ids = jax.lax.top_k(logits, TOP_LOGPROBS)
        return ids, values - lse

    alt = jax.lax.cond(jnp.any(s["logprobs"]), alternatives,
                       lambda: (jnp.zeros((b, TOP_LOGPROBS), jnp.int32), jnp.zeros((b, TOP_LOGPROBS), logits.dtype)))
    out = tok.astype(jnp.int32), (jnp.take_along_axis(logits, tok[:, None], axis=-1) - lse)[:, 0], *alt
    return out if draft is None else (*out, tok == draft)


def head_entry(slots: int, k: int, slot, j=None):
    """The index in a draft head's `last` (module docstring) of slot's shift, or with j of its j-th proposed
    draft (of k); `slots`: max_num_seqs + 1. (Its last token's is the slot itself.)"""
    return slots + slot if j is None else 2 * slots + slot * k + j


def _token_rows(batch: dict):
    """Each token's row [T] and whether it is a sequence's (not padding)."""
    cu = batch["cu_q_lens"]
    tok = jnp.arange(batch["positions"].shape[0])
    return jnp.minimum(jnp.searchsorted(cu[1:], tok, side="right"), cu.shape[0] - 2), live_tokens(batch, tok.shape[0])


def _followed(batch: dict, last: jax.Array, k: int) -> dict:
    """batch with the rows that follow a verifying step not yet read back (batch["follow"]) moved to where it
    left their sequences: positions and lengths shifted by their slot's shift (minus the drafts it
    rejected; the host counted them all as accepted)."""
    shift = jnp.where(batch["follow"] != 0, last[head_entry(last.shape[0] // (2 + k), k, batch["slot"])], 0)
    row, live = _token_rows(batch)
    return {**batch, "positions": batch["positions"] + jnp.where(live, shift[row], 0),
            "kv_lens": batch["kv_lens"] + shift}


def _slots(batch: dict, ps: int) -> dict:
    """Per kind, the flat cache slot (page * ps + offset) each token writes; padding tokens: 0 (scratch)."""
    pos = batch["positions"]
    seq, live = _token_rows(batch)
    return {k: jnp.where(live, tab[seq, pos // ps] * ps + pos % ps, 0) for k, tab in batch["tables"].items()}


def sample_rows(logits: jax.Array, last: jax.Array, batch: dict, masks: bool = True, split: bool = False):
    """(token, logprob, top ids, top logprobs) of each sequence row from its logits [S, vocab] (`pick`), and
    `last` with each row's slot set to its token. batch: the step's "sampling", "kv_lens" and "slot".
    masks: whether structured-output masks apply; the one-program step has none (a constrained step runs
    split, or verifies drafts), and a masking branch in it, never taken, perturbs XLA's buffer assignment
    of the whole program: gpt-oss-20b's v6e decode step counted 1.38 GB more, 1.27x its floor for 1.18x.
    split: as `pick`'s."""
    s = batch["sampling"] if masks else {k: v for k, v in batch["sampling"].items() if k != "allow"}
    out = pick(logits, s, batch["kv_lens"], split=split)
    return out, last.at[batch["slot"]].set(out[0], mode="drop")


def verify_rows(logits: jax.Array, row: jax.Array, draft: jax.Array, next_pos: jax.Array, grid: jax.Array,
                last: jax.Array, batch: dict, split: bool = False):
    """Speculative decoding's verification, from the target's logits [R, vocab] at R positions: per position
    its sequence row [R], the draft that follows it [R] (NO_TOKEN: none) and the position of the token it
    draws [R]; grid [S, k + 1]: each row's positions in R, its last token before the drafts, each draft,
    then repeats of its last one (drafts: batch["drafts"] a row).

    Each position's token is drawn by `pick` under the row's sampling and the key of the position it fills,
    as a step without drafts draws it, and its draft accepted where they agree (`pick`: speculative
    sampling's rule). A row keeps its drafts up to the first one rejected, then the token drawn there:
    `count` = accepted + 1 tokens, the very tokens of drawing them one step at a time (greedy, or sampled
    with the request's seed). Returns ((tokens [S, k + 1], count [S],
    logprobs [S, k + 1], top ids, top logprobs [S, k + 1, TOP_LOGPROBS], drafts offered [S]: those not
    NO_TOKEN, which the device's n-gram lookup leaves where it found nothing), `last` with each row's slot set
    to its last token)."""
    sampling = jax.tree_util.tree_map(lambda x: x[row], batch["sampling"])
    tok, lp, top_ids, top_lps, accepted = (x[grid] for x in pick(logits, sampling, next_pos, draft, split))
    count = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1) + 1
    last = last.at[batch["slot"]].set(jnp.take_along_axis(tok, count[:, None] - 1, axis=1)[:, 0], mode="drop")
    return (tok, count, lp, top_ids, top_lps, jnp.sum(draft[grid] != NO_TOKEN, axis=1)), last


def verify_positions(batch: dict, tokens: jax.Array, k: int):
    """The positions a step with up to k drafts a row verifies: (the token index of each, then
    `verify_rows`' row, draft, next_pos and grid). Every token when the step has no more tokens than its
    rows have positions (one logits row per token: a decode step), else each row's k + 1 (prompt chunks)."""
    t, cu, drafts = tokens.shape[0], batch["cu_q_lens"], batch["drafts"]
    ends = cu[1:] - 1  # each sequence's last token
    at = jnp.maximum(jnp.minimum(ends[:, None] - drafts[:, None] + jnp.arange(k + 1), ends[:, None]), 0)
    src, grid = (jnp.arange(t), at) if t <= at.size else (at.reshape(-1), jnp.arange(at.size).reshape(at.shape))
    row = jnp.minimum(jnp.searchsorted(cu[1:], src, side="right"), drafts.shape[0] - 1)
    j = src - (ends - drafts)[row]  # 0: the row's last token before its drafts
    draft = jnp.where((j >= 0) & (j < drafts[row]), tokens[jnp.minimum(src + 1, t - 1)], NO_TOKEN)
    return src, row, draft, batch["positions"][src] + 1, grid


def _kept(out: tuple, meta: dict) -> tuple[jax.Array, jax.Array]:
    """From `verify_rows`' out: each row's last kept token (its index in the step: its last accepted draft,
    or its last token) and the token the target chose after it."""
    tok, count = out[0], out[1]
    kept = jnp.maximum(meta["cu_q_lens"][1:] - 1 - meta["drafts"] + count - 1, 0)
    return kept, jnp.take_along_axis(tok, count[:, None] - 1, axis=1)[:, 0]


def draft_rows(params: dict, head, tokens: jax.Array, h: jax.Array, aux: jax.Array | None, out: tuple, kv: jax.Array,
               meta: dict, page_size: int, k: int):
    """A draft head's tokens for the next step: k token ids a row [S, k], and the head's cache.

    head: models/eagle3.Eagle3 or models/qwen3_5.Mtp (its `hidden`, `embed`, `run` and `tokens`); h the
    target's final hidden states [T, H], aux its fused auxiliary ones (EAGLE-3). The head runs over the
    step's tokens, position i taking the target's hidden state at i and the token at i + 1, where a row's
    last kept position (its last accepted draft, or its last token) takes the token the target just chose
    (`verify_rows`' out); positions past it are computed too and overwritten later, as rejected drafts' KV
    is. Its output there gives the first draft; each further draft runs the head on the previous one and
    the head's own output, one position further (one query a row)."""
    from quantkit.runtime.models.common import attention_block

    embed = head.embed(params)
    t, s = tokens.shape[0], out[1].shape[0]
    n = meta["num_seqs"]
    live = jnp.arange(s) < n[0]
    last, chosen = _kept(out, meta)
    nxt = jnp.concatenate([tokens[1:], tokens[:1]]).at[jnp.where(live, last, t)].set(chosen, mode="drop")

    def run(emb, hidden, kv, m):
        def attend(p, x):
            nonlocal kv
            a, kv = attention_block(p, x, kv, 0, m, head.cfg, "full")
            return a
        return head.run(params, emb, hidden, attend), kv

    g, kv = run(embed[nxt], head.hidden(params, h, aux), kv, {**meta, "kv_fp8": None})
    g = g[last]
    drafts = [head.tokens(params, g)]
    pos = meta["positions"][last]
    pad = ((0, -s % 8), (0, 0))  # the TPU attention kernel takes a multiple of 8 tokens: padding, in no row
    for j in range(1, k):  # one query a row: row i is token i
        m = {**meta, "kv_fp8": None, "verify": 0, "positions": jnp.pad(pos + j, pad[0]), "kv_lens": pos + j + 1,
             "cu_q_lens": jnp.minimum(jnp.arange(s + 1, dtype=jnp.int32), n[0]),
             "tables": {"full": meta["tables"]["full"]}}
        g, kv = run(jnp.pad(embed[drafts[-1]], pad), jnp.pad(g, pad), kv, {**m, "slots": _slots(m, page_size)})
        g = g[:s]
        drafts.append(head.tokens(params, g))
    return jnp.stack(drafts, axis=1), kv


def draft_cache(draft, pages: int, page_size: int) -> tuple[tuple, object]:
    """A drafter's cache on the device (kv["draft"]) over the target's `pages` full-attention pages: the
    n-gram lookup's token pages, or a draft head's KV (one layer); (shape, dtype; None: the model's)."""
    if isinstance(draft, Lookup):
        return (pages * page_size,), jnp.int32
    return (1, pages, page_size, 2 * math.prod(draft.cfg.kv_shape("full"))), None


def lookup_rows(lookup, out: tuple, pages: jax.Array, meta: dict, page_size: int, k: int):
    """The device's n-gram drafts for the next step (speculative.Lookup): k a row [S, k], NO_TOKEN where its
    lookup finds nothing, and the token pages [full-attention pages x page_size], which hold the step's
    tokens (`step_function`), with each row's chosen one (after its last kept) written where its KV will go;
    positions past it hold rejected drafts, overwritten later as their KV is."""
    s, table = out[1].shape[0], meta["tables"]["full"]
    kept, chosen = _kept(out, meta)
    pos = meta["positions"][kept] + 1  # where the chosen token goes
    at = table[jnp.arange(s), jnp.minimum(pos // page_size, table.shape[1] - 1)] * page_size + pos % page_size
    at = jnp.where((jnp.arange(s) < meta["num_seqs"][0]) & (pos < table.shape[1] * page_size), at, 0)  # 0: scratch
    pages = pages.at[at].set(chosen)
    seq = pages.reshape(-1, page_size)[table].reshape(s, -1)
    return lookup.draft(seq, pos + 1, k, NO_TOKEN), pages


def step_function(cfg, page_size: int, all_logits: bool = False, mesh=None, unroll: bool = False, kv_fp8=None,
                  ep: bool = False, sample: bool = True, spec: int = 0, drafter=None, decode: bool = False,
                  dp: bool = False):
    """step(params, kv, last, batch) -> (outputs, kv, last).

    kv: per kind stacked pages; last [max_num_seqs + 1]: the last token sampled per slot (with a drafter,
    three parts: module docstring). outputs: (token,
    logprob, top ids, top logprobs) per sequence row [S, ...], or with all_logits the float32 logits of
    every token [T, vocab] (eval and tests), or without `sample` each row's logits [S, vocab] and `last`
    unchanged: the step's first half, whose second is `sample_rows` (the engine splits a step so that
    structured-output masks are computed while the device runs the first). mesh: the tensor-parallel mesh, if any; unroll: layers as a
    Python loop (CPU serving, plan's cost analysis) instead of the scan. kv_fp8: the float8 dtype of an
    FP8 cache (params then carry each layer's `kv_scale`, cache.with_kv_scales). ep: MoE experts split
    whole over the mesh (expert parallelism, runtime/sharding.py). spec: speculative decoding with up to
    `spec` drafts a row: a row's last batch["drafts"] tokens are drafts following its real last token, and
    the outputs are `verify_rows`'s; drafter (a draft head, eagle3.Eagle3 or qwen3_5.Mtp: its weights
    params["draft"], its cache kv["draft"]): the outputs gain the next step's drafts [S, spec] (`draft_rows`).
    decode: every row of every step has one token (the Runner's DECODE program for models with Gated DeltaNet
    layers, which then compile only their one-token recurrence, not the chunked prompt path beside it).
    dp: `mesh` is data parallel: each device runs its own sequences (`_data_parallel`).
    """
    fwd = forward_for(cfg.family)
    tp_mesh = None if dp else mesh  # what the model's own ops split over

    def step(params, kv, last, batch):
        if tpu_chip() is not None:  # dense layer weights through gmm_v2 too
            params = dense_as_qtensor(params, cfg, tp_mesh, ep and not dp)
        tokens = jnp.where(batch["prev_slot"] >= 0, last[jnp.maximum(batch["prev_slot"], 0)], batch["tokens"])
        drafted = tokens  # the device's n-gram lookup leaves NO_TOKEN for drafts it did not find
        if drafter is not None and spec:
            batch = _followed(batch, last, spec)
        meta = {**batch, "slots": _slots(batch, page_size), "mesh": tp_mesh, "unroll": unroll, "kv_fp8": kv_fp8,
                "ep_mesh": (AXIS if dp else mesh) if ep else None, "verify": spec, "decode": decode}
        if isinstance(drafter, Lookup):  # every step writes its tokens where the lookup reads them
            tokens = jnp.where(tokens == NO_TOKEN, 0, tokens)
            kv = {**kv, "draft": kv["draft"].at[meta["slots"]["full"]].set(tokens)}
        if drafter is not None and not all_logits and drafter.aux:
            meta["aux_layers"] = drafter.aux
        h, kv, *aux = fwd(params, cfg, tokens, kv, meta)
        if all_logits:
            return project(params, h, cfg), kv, last
        if spec:
            src, *verified = verify_positions(batch, drafted, spec)
            out, last = verify_rows(project(params, h[src], cfg), *verified, last, batch, tp_mesh is not None)
            if len(kv.get("linear", ())) == 4:  # GDN states: each row's after the tokens it kept
                kv = {**kv, "linear": keep_checkpoints(kv["linear"], batch, out[1])}
            if isinstance(drafter, Lookup):
                drafts, cache = lookup_rows(drafter, out, kv["draft"], meta, page_size, spec)
            elif drafter is not None:
                drafts, cache = draft_rows(params, drafter, tokens, h, aux[0] if aux else None, out, kv["draft"], meta,
                                           page_size, spec)
            if drafter is not None:
                out, kv = (*out, drafts), {**kv, "draft": cache}
                slots, slot = last.shape[0] // (2 + spec), batch["slot"]
                last = last.at[head_entry(slots, spec, slot)].set(out[1] - 1 - batch["drafts"], mode="drop")
                last = last.at[head_entry(slots, spec, slot[:, None], jnp.arange(spec))].set(drafts, mode="drop")
            return out, kv, last
        ends = batch["cu_q_lens"][1:] - 1  # each sequence's last token
        logits = project(params, h[jnp.maximum(ends, 0)], cfg)
        if not sample:
            return logits, kv, last
        out, last = sample_rows(logits, last, batch, masks=False, split=tp_mesh is not None)
        return out, kv, last

    return _data_parallel(step, mesh, ep, all_logits) if dp else step


def _data_parallel(step: Callable, mesh, ep: bool, all_logits: bool) -> Callable:
    """`step` run by every device of the data-parallel `mesh` on its own sequences (one shard_map): the
    weights as sharding.local_view gives them, each kind's pages and state slots split along their second
    axis, `last` along its one, every batch array with a leading device axis (`Runner.batch`), each
    device's rows and tokens laid out as one device's. The model's MoE layers exchange tokens between the
    devices (models/common.py `_data_parallel_experts`); nothing else does. The outputs, gathered, are put
    back in the order of the step's rows (batch["row_order"]; the logits of every token: "token_order")."""
    def run(params, kv, last, batch):
        params, specs = local_view(params, ep)
        order = batch["token_order" if all_logits else "row_order"]
        batch = {k: v for k, v in batch.items() if k not in ("row_order", "token_order")}
        cache = jax.tree_util.tree_map(lambda _: P(None, AXIS), kv)

        def body(params, kv, last, batch):
            out, kv, last = step(params, kv, last, jax.tree_util.tree_map(lambda x: x[0], batch))
            return jax.tree_util.tree_map(lambda x: x[None], out), kv, last

        out, kv, last = jax.shard_map(body, mesh=mesh, in_specs=(specs, cache, P(AXIS), P(AXIS)),
                                      out_specs=(P(AXIS), cache, P(AXIS)), check_vma=False)(params, kv, last, batch)
        return jax.tree_util.tree_map(lambda x: x.reshape(-1, *x.shape[2:])[order], out), kv, last

    return run


def _frozen(tree) -> tuple:
    """A pytree of hashable leaves (shardings, formats) as a hashable (treedef, leaves) key."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple(leaves)


@functools.lru_cache(maxsize=16)
def jitted_step(cfg, page_size: int, mesh, unroll: bool, kv_fp8, ep: bool, dp: bool, formats: tuple, out_shardings,
                interpreted: str | None, all_logits: bool, sample: bool = True, spec: int = 0, drafter=None,
                decode: bool = False):
    """The jitted step of one static configuration, shared by every Runner that has it: a second Runner of
    the same model (a test, a server restarting its engine, eval's second checkpoint of the same shapes)
    reuses the compiled programs instead of compiling each token bucket again. `formats`: the weights'
    row-major placements, `out_shardings` (None on one device): both as `_frozen` keys. `interpreted`: the
    chip of `ops.interpreted_tpu_kernels` the Runner was made in (tests), which the program is traced under:
    a key of its own, else a Runner of the TPU path would reuse a CPU Runner's traced program."""
    pinned = dict(in_shardings=(jax.tree_util.tree_unflatten(*formats), None, None, None), donate_argnums=(1, 2))
    if out_shardings is not None:
        pinned["out_shardings"] = jax.tree_util.tree_unflatten(*out_shardings)
    fn = step_function(cfg, page_size, all_logits, mesh=mesh, unroll=unroll, kv_fp8=kv_fp8, ep=ep, sample=sample,
                       spec=spec, drafter=drafter, decode=decode, dp=dp)
    if interpreted is not None:
        step = fn

        def fn(*args):
            with interpreted_tpu_kernels(interpreted):
                return step(*args)
    return jax.jit(fn, **pinned)


def _copy(states: tuple, src, dst) -> tuple:
    """The conv and recurrent states (not the speculative checkpoints) of slots `src` copied to `dst`."""
    return tuple(a.at[:, dst].set(a[:, src]) if i < 2 else a for i, a in enumerate(states))


_copy_slots = jax.jit(_copy, donate_argnums=(0,))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def _copy_slots_on(mesh, states: tuple, src, dst) -> tuple:
    """`_copy` on each device of a data-parallel mesh, of its own slots (src, dst [devices, n]: local)."""
    return jax.shard_map(lambda st, s, d: _copy(st, s[0], d[0]), mesh=mesh, in_specs=(P(None, AXIS), P(AXIS), P(AXIS)),
                         out_specs=P(None, AXIS))(states, src, dst)


@functools.lru_cache(maxsize=4)
def jitted_sampler(rep):
    """sample_rows jitted (`last` donated; rep: the replicated sharding of a mesh, or None)."""
    run = functools.partial(sample_rows, split=rep is not None)
    return jax.jit(run, donate_argnums=(1,), **({} if rep is None else {"out_shardings": (rep, rep)}))


def token_buckets(max_num_batched_tokens: int, lo: int = 8, verify: int = 0) -> tuple[int, ...]:
    """8, 16, 32, ... below the budget, then the budget: the step's token counts; `verify` (speculative
    decoding: max_num_seqs x (1 + k)) adds the bucket of every sequence with all its drafts, rounded up to
    16, so that such a step does not pad to the next power of two (16 x 5 = 80 tokens, not 128)."""
    out = [lo]
    while out[-1] < max_num_batched_tokens:
        out.append(min(out[-1] * 2, max_num_batched_tokens))
    extra = -(-verify // 16) * 16
    return tuple(sorted({*out, extra})) if 0 < extra < max_num_batched_tokens else tuple(out)


def sampling_arrays(b: int, vocab: int) -> dict:
    """Greedy sampling parameters for b rows, every token allowed."""
    return {"temperature": np.zeros(b, np.float32), "top_k": np.zeros(b, np.int32),
            "top_p": np.ones(b, np.float32), "seed": np.zeros(b, np.uint32), "logprobs": np.zeros(b, bool),
            "banned": np.full((b, BANNED), NO_TOKEN, np.int32),
            "allow": np.full((b, device_words(vocab)), -1, np.int32)}


def empty_batch(t: int, s: int, layout: CacheLayout, max_num_seqs: int, vocab: int) -> dict:
    """A step of t padding tokens and no sequence (s rows): the host arrays `Batch.build` fills."""
    return {"tokens": np.zeros(t, np.int32), "prev_slot": np.full(t, -1, np.int32),
            "positions": np.zeros(t, np.int32), "cu_q_lens": np.zeros(s + 1, np.int32),
            "kv_lens": np.zeros(s, np.int32), "num_seqs": np.zeros(1, np.int32), "drafts": np.zeros(s, np.int32),
            "follow": np.zeros(s, np.int32),
            "tables": {k: np.zeros((s, layout.pages_per_seq), np.int32) for k in layout.layers},
            "slot": np.full(s, max_num_seqs, np.int32), "sampling": sampling_arrays(s, vocab)}


@dataclass
class Row:
    """One sequence's part of a step: `n` tokens from position `start`; `tokens` given (prompt), or None
    for one decode token that the device takes from the slot's last sampled token. `banned`: token ids
    its sample must not be (at most BANNED). `drafts`: token ids following a decode row's device-side token
    (its last len(drafts) of n), which the step verifies (speculative decoding; a Runner with
    `speculative`); `proposed`: instead, that many of the drafts a Runner's draft head left on the device for
    the slot; `follow`: the row's start counts every draft of its slot's last verifying step as accepted,
    which the device corrects (module docstring)."""

    slot: int
    start: int
    n: int
    tokens: list | None = None
    sampling: Sampling = Sampling()
    logprobs: bool = False
    banned: tuple = ()
    drafts: tuple = ()
    proposed: int = 0
    follow: bool = False


@dataclass
class Runner:
    """A loaded model on device with its paged cache (runtime/cache.py) and the jitted step.

    max_num_batched_tokens: the most tokens one step runs (the largest token bucket).
    weights: "packed" keeps quantized weights int4/fp8/mxfp4 (gmm_v2 on a TPU, the XLA path elsewhere);
    "dense" dequantizes them once to the model dtype (4x the memory of int4, but off TPU the XLA path
    would dequantize every weight on every step: measured 0.44x the bf16 decode speed on this CPU);
    "auto": packed on a TPU, dense elsewhere.
    scan: run the layers as `lax.scan` (the TPU program: compile time independent of depth); None: scan
    except on CPU, where XLA:CPU spends ~0.5 ms per loop iteration (measured: a 2-layer hidden-256 step
    2.2 ms scanned, 1.2 ms unrolled) and compile time is not the constraint.
    kv_cache_dtype: auto | bf16 | fp8 | fp8_e4m3 | fp8_e5m2 (cache.kv_fp8_dtype); `kv_dtype` is the result.
    tp, ep: tensor-parallel devices and expert parallelism (runtime/sharding.py); a model the loader placed
    on a mesh brings its own (its weights stay where they are).
    dp: data-parallel devices (vLLM's --data-parallel-size): each holds every weight (but its experts under
    `ep`) and serves max_num_seqs / dp sequences with its own pages and state slots (cache.DataParallelPools);
    a step gives each device its own rows (`batch`), and runs as one program over all (`_data_parallel`).
    speculative: the most drafts a row verifies (speculative decoding, runtime/speculative.py); a step with
    drafts then runs the verifying program (`verify_rows`, outputs of speculative + 1 tokens a row; one
    program per token bucket, whatever its drafts), a step without the plain one; with a `drafter` every
    step runs the verifying program, which also drafts the next step's tokens."""

    model: object  # loader.LoadedModel
    max_model_len: int = 2048
    max_num_seqs: int = 1
    page_size: int = PAGE_SIZE
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    tp: int = 1
    ep: bool = False
    dp: int = 1
    weights: str = "auto"
    scan: bool | None = None
    kv_cache_dtype: str = "auto"
    speculative: int = 0
    drafter: object = None  # speculative.Drafter: drafts come from it (a head, the n-gram lookup), on device, every step
    prefix_states: int = 0  # Gated DeltaNet models: state slots for prefix-caching snapshots (cache.py)
    compiled: set = field(default_factory=set)

    def __post_init__(self):
        cfg = self.model.cfg
        self.mesh, self.ep = self.model.mesh, self.ep or self.model.ep
        if self.model.dp:
            self.dp = self.mesh.shape[AXIS]
        elif self.mesh is not None:  # placed tensor parallel
            if self.dp > 1 or self.tp > 1 and self.mesh.shape[AXIS] != self.tp:
                raise InvalidInput(f"the model was placed on {self.mesh.shape[AXIS]} devices tensor parallel, not "
                                   f"as asked (--tp {self.tp}, --data-parallel-size {self.dp})")
            self.tp = self.mesh.shape[AXIS]
        if self.dp > 1:
            if self.tp > 1:
                raise InvalidInput("--data-parallel-size with --tp is not supported yet: one of them at a time")
            if self.max_num_seqs % self.dp:
                raise InvalidInput(f"--max-num-seqs {self.max_num_seqs} does not split over {self.dp} data-parallel "
                                   f"devices; make it a multiple of {self.dp}")
            if self.speculative or self.drafter is not None or jax.process_count() > 1:
                raise InvalidInput("--data-parallel-size serves from one process without speculative decoding yet")
        local = self.max_num_seqs // self.dp  # sequences a device serves
        self.buckets = token_buckets(self.max_num_batched_tokens,
                                     verify=self.max_num_seqs * (1 + self.speculative) if self.speculative else 0)
        self.layout = cache_layout(cfg, self.max_model_len, local, self.page_size,
                                   self.max_num_batched_tokens, self.speculative, self.prefix_states)
        self.pool = DataParallelPools(self.layout, self.max_num_seqs, self.dp) if self.dp > 1 else \
            PagePool(self.layout, self.max_num_seqs)
        fp8 = kv_fp8_dtype(self.kv_cache_dtype, self.model.kv_scales is not None)
        self.kv_dtype = jnp.dtype(fp8 or self.model.dtype).name
        if self.mesh is None and max(self.tp, self.dp) > 1:
            self.mesh = make_mesh(max(self.tp, self.dp))
        mesh, rep, dp = self.mesh, None if self.mesh is None else NamedSharding(self.mesh, P()), self.dp > 1
        # KV pages with their heads split when they divide the mesh; Gated DeltaNet states replicated; data
        # parallel: each device's pages and state slots its own, as its `last` tokens
        shard = lambda k: None if mesh is None else cache_sharding(cfg, mesh, k, dp)  # noqa: E731
        kv_sharding = self.layout.cache(lambda k, s, d: shard(k))
        last_sharding = NamedSharding(mesh, P(AXIS)) if dp else rep
        if self.drafter is not None and isinstance(self.drafter.spec, Lookup) and (mesh is not None or
                                                                                   "full" not in self.layout.pages):
            self.drafter = None  # n-gram lookups on the host (the engine's `PromptLookup`)
        draft = self.drafter.spec if self.drafter is not None else None
        if draft is not None and mesh is not None:
            raise InvalidInput("draft heads (eagle3, mtp) run on one device; serve the target with --tp 1")
        # float32 on CPU: XLA:CPU upcasts a bf16 (or fp8) scatter and so copies the whole cache on every write
        dtype = jnp.float32 if jax.default_backend() == "cpu" else fp8 or self.model.dtype
        # committed to a device from the start: the step's outputs are, and an uncommitted first argument
        # would make the first two calls of every program two compilations
        here = jax.local_devices()[0]
        self.kv = self.layout.cache(lambda k, s, d: jnp.zeros((s[0], s[1] * self.dp, *s[2:]), d or dtype,
                                                               device=shard(k) or here))
        if draft is not None:
            shape, kind = draft_cache(draft, self.layout.pages["full"], self.page_size)
            self.kv["draft"] = jnp.zeros(shape, kind or (jnp.float32 if dtype == jnp.float32 else self.model.dtype),
                                         device=here)
        self.last = jnp.zeros(self.dp * (local + 1) * (1 if draft is None else 2 + self.speculative), jnp.int32,
                              device=last_sharding or here)
        self.params = self.model.params
        if fp8 is not None:
            self.params = with_kv_scales(self.params, cfg, self.model.kv_scales, np.asarray if mesh else jnp.asarray)
        if self.weights == "dense" or self.weights == "auto" and jax.default_backend() != "tpu":
            from quantkit.runtime.loader import densify

            self.params = densify(self.params, self.model.dtype)
        if mesh is not None:  # what the loader placed stays; what densify made (or a model loaded whole) moves
            self.params = shard_params(self.params, cfg, mesh, ep=self.ep, dp=dp)
        unroll = not self.scan if self.scan is not None else jax.default_backend() == "cpu"
        if unroll:  # per-layer arrays: a slice of a stacked weight would be copied before every dot on CPU
            def unstack(w):  # each layer placed as the stack's other dims are
                per_layer = None if mesh is None else NamedSharding(mesh, P(*w.sharding.spec[1:]))
                return jax.jit(tuple, out_shardings=per_layer)(w)

            self.params = {**self.params, "layers": {
                kind: {k: w if isinstance(w, QTensor) else unstack(w) for k, w in stack.items()}
                for kind, stack in self.params["layers"].items()}}
        if draft is not None and self.drafter.params is not None:  # (an MTP layer came with the model's)
            self.params = {**self.params, "draft": jax.device_put(self.drafter.params, here)}
        self.params = place_row_major(self.params)  # the loader placed them so; a sharded copy may not be
        formats = jax.tree_util.tree_map(lambda x: row_major(x.sharding, x.ndim), self.params)
        # the outputs replicated: every process reads them
        outs = None if mesh is None else _frozen((rep, kv_sharding, last_sharding))
        key = (cfg, self.page_size, mesh, unroll, fp8, self.ep, dp, _frozen(formats), outs, interpreted_chip())
        lookup = draft if isinstance(draft, Lookup) else None  # (whose token pages every step writes)
        self._step, self._logits = jitted_step(*key, False, drafter=lookup), jitted_step(*key, True)
        self._forward, self._sample = jitted_step(*key, False, False, drafter=lookup), jitted_sampler(rep)
        self._programs = {STEP: self._step, LOGITS: self._logits}
        if self.speculative:
            self._programs[VERIFY] = jitted_step(*key, False, True, self.speculative, draft)
        if cfg.linear_layers:  # steps of one token a row without the chunked delta rule (gdn.py `_recurrence`)
            self._programs[DECODE] = jitted_step(*key, False, True, 0, lookup, True)

    @property
    def has_decode_program(self) -> bool:
        return DECODE in self._programs

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Gated DeltaNet state slots copied (src, dst) on device, after the steps dispatched so far: a
        prefix-caching snapshot taken or restored (cache.py; data parallel: slots of one device, numbered as
        cache.DataParallelPools does). Padded to max_num_seqs / dp pairs a device (the scratch slot onto
        itself) so that one program serves any number."""
        local = self.max_num_seqs // self.dp
        per = local + 1 + self.layout.snapshots  # a device's state slots
        by = [[(a % per, b % per) for a, b in pairs if a // per == d] for d in range(self.dp)]
        for i in range(0, max(map(len, by)), local):
            src, dst = np.asarray([(x[i:i + local] + [(local, local)] * local)[:local] for x in by], np.int32).T
            states = self.kv["linear"]
            states = _copy_slots(states, src.T[0], dst.T[0]) if self.dp == 1 else \
                _copy_slots_on(self.mesh, states, src.T, dst.T)
            self.kv = {**self.kv, "linear": states}

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n) if n <= self.buckets[-1] else -(-n // 8) * 8

    def batch(self, rows: list[Row], tokens: int = 0) -> dict:
        """The host arrays of a step running `rows` (pages must be reserved), in a bucket of at least
        `tokens`. Data parallel: each device's rows as one device's batch (its local slots, its tables), all
        stacked along a leading device axis, with the order that puts the outputs back in `rows`' order
        ("row_order": each row's index in the flattened [devices * rows] outputs; "token_order": each
        token's in [devices * tokens])."""
        local, dev = self.max_num_seqs // self.dp, self.pool.device
        by = [[i for i, r in enumerate(rows) if dev(r.slot) == d] for d in range(self.dp)]
        n = max(sum(rows[i].n for i in mine) for mine in by)
        t = self.bucket(max(n, tokens))
        s = min(t, local) if n <= self.buckets[-1] else max(map(len, by))
        if self.dp == 1:
            return self._batch(rows, self.pool, t, s)
        parts = [self._batch([dataclasses.replace(rows[i], slot=rows[i].slot % local) for i in mine], pool, t, s)
                 for mine, pool in zip(by, self.pool.pools)]
        b = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *parts)
        b["row_order"], b["token_order"], start = np.zeros(self.dp * s, np.int32), np.zeros(self.dp * t, np.int32), {}
        for d, mine in enumerate(by):
            at = d * t
            for j, i in enumerate(mine):
                b["row_order"][i], start[i] = d * s + j, at
                at += rows[i].n
        flat = [start[i] + k for i, r in enumerate(rows) for k in range(r.n)]
        b["token_order"][:len(flat)] = flat
        return b

    def _batch(self, rows: list[Row], pool: PagePool, t: int, s: int) -> dict:
        """One device's batch of t tokens and s rows running `rows`, their tables from `pool`."""
        b = empty_batch(t, s, self.layout, self.max_num_seqs // self.dp, self.model.cfg.vocab_size)
        at = 0
        for i, r in enumerate(rows):
            if r.tokens is None:
                b["prev_slot"][at] = r.slot
                b["tokens"][at + 1:at + 1 + len(r.drafts)] = r.drafts
                b["prev_slot"][at + 1:at + 1 + r.proposed] = head_entry(self.max_num_seqs + 1, self.speculative,
                                                                        r.slot, np.arange(r.proposed))
            else:
                b["tokens"][at:at + r.n] = r.tokens
            b["positions"][at:at + r.n] = np.arange(r.start, r.start + r.n)
            at += r.n
            b["cu_q_lens"][i + 1] = at
            b["kv_lens"][i], b["slot"][i], b["drafts"][i] = r.start + r.n, r.slot, len(r.drafts) + r.proposed
            b["follow"][i] = r.follow
            for k, tab in pool.tables.items():
                b["tables"][k][i] = tab[r.slot]
            sp, p = b["sampling"], r.sampling
            sp["temperature"][i], sp["top_k"][i], sp["top_p"][i] = p.temperature, p.top_k, p.top_p
            sp["seed"][i], sp["logprobs"][i] = p.seed & 0xFFFFFFFF, r.logprobs
            sp["banned"][i, :len(r.banned)] = r.banned
        b["cu_q_lens"][len(rows) + 1:] = at
        b["num_seqs"][0] = len(rows)
        return b

    def empty(self, t: int) -> dict:
        """A step of t padding tokens (warm-up)."""
        return self.batch([], t)

    def run(self, batch: dict, head: bool = True, decode: bool | None = None):
        """Dispatches one step (asynchronously); returns the device outputs (token, logprob, top ids, top
        logprobs), each [S, ...]; for a step with drafts `verify_rows`'s; with a draft head (and `head`, or
        drafts) those and the next step's drafts. `decode`: whether it runs as the DECODE program (models
        with Gated DeltaNet layers; default: when every row has one token)."""
        self.compiled.add(batch["tokens"].shape[-1])
        drafting = batch["drafts"].any() or self.drafter is not None and head
        if not batch["drafts"].any() and (batch["sampling"]["allow"] != -1).any():
            raise ValueError("a step with structured-output masks and no drafts runs through run_split")
        if decode is None:
            decode = np.diff(batch["cu_q_lens"]).max() <= 1
        return self._call(VERIFY if drafting else DECODE if decode and DECODE in self._programs else STEP, batch)

    def compile(self, t: int, kind: str) -> None:
        """Compiles bucket t's program of `kind` ("step", "split": the forward and sampling of a split step,
        "verify", "decode"; Engine.warmup's kinds) without running it, from the cache's and last tokens'
        shapes, so that any thread can (a server compiles its larger buckets while it serves): the program's
        first call then finds it compiled (its jit's cache, and the persistent one)."""
        batch = self.empty(t)
        kv, last = (jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), x)
                    for x in (self.kv, self.last))
        if kind != "split":
            self._programs[{"step": STEP, "verify": VERIFY, "decode": DECODE}[kind]].lower(
                self.params, kv, last, batch).compile()
            return
        forward = self._forward.lower(self.params, kv, last, batch).compile()
        self._sample.lower(forward.out_info[0], last, {"sampling": batch["sampling"], "kv_lens": batch["kv_lens"],
                                                       "slot": batch["slot"]}).compile()

    def run_split(self, batch: dict, sampling: Callable[[], dict]):
        """One step as two programs: the forward (dispatched at once), then the sampling with the arrays
        `sampling()` returns, called while the device runs the forward (a structured-output step computes its
        masks there). Outputs as `run`'s. One process only (`_call` broadcasts the one-program step)."""
        self.compiled.add(batch["tokens"].shape[-1])
        logits, self.kv, self.last = self._forward(self.params, self.kv, self.last, batch)
        s = sampling()
        out, self.last = self._sample(logits, self.last, {"sampling": s, "kv_lens": batch["kv_lens"],
                                                          "slot": batch["slot"]})
        return out

    def forward(self, rows: list[tuple[int, list, int]]) -> list[np.ndarray]:
        """Float32 logits of every token for (slot, tokens, start position) rows run as one ragged step
        (tests, eval); reserves the pages the rows need."""
        for slot, toks, start in rows:
            if not self.pool.reserve(slot, start, start + len(toks) - 1):
                raise RuntimeError("KV cache pool exhausted")
        batch = self.batch([Row(slot, start, len(toks), list(toks)) for slot, toks, start in rows])
        out, at = np.asarray(self._call(LOGITS, batch)), 0
        res = []
        for _, toks, _ in rows:
            res.append(out[at:at + len(toks)])
            at += len(toks)
        return res

    # ---- several processes (jax.distributed): the first schedules, every process runs each step ----

    def _call(self, op: int, batch: dict):
        """Runs step `op` on `batch`; in a multi-process run, first broadcasts it from this (the first)
        process to the others' `follow` loops, so that every process runs the same program on the same
        inputs. Returns the outputs as this process's local arrays."""
        if jax.process_count() > 1:
            op, batch = self._broadcast(op, batch)
        out, self.kv, self.last = self._programs[op](self.params, self.kv, self.last, batch)
        return out if jax.process_count() == 1 else jax.tree_util.tree_map(lambda x: x.addressable_data(0), out)

    def _broadcast(self, op: int, batch: dict | None) -> tuple[int, dict | None]:
        """The first process's (op, batch), received on every process, the batch as global arrays (None
        with STOP)."""
        from jax.experimental import multihost_utils as mh

        head = np.zeros(3, np.int32) if batch is None else np.array(
            [op, batch["tokens"].shape[0], batch["kv_lens"].shape[0]], np.int32)
        op, t, s = (int(x) for x in mh.broadcast_one_to_all(head))
        if op == STOP:
            return op, None
        batch = mh.broadcast_one_to_all(batch if batch is not None else empty_batch(
            t, s, self.layout, self.max_num_seqs, self.model.cfg.vocab_size))
        return op, mh.host_local_array_to_global_array(batch, self.mesh, P())

    def follow(self) -> None:
        """A process other than the first in a multi-process run: runs every step the first process
        dispatches, until it calls `stop`."""
        while True:
            op, batch = self._broadcast(STOP, None)
            if batch is None:
                return
            _, self.kv, self.last = self._programs[op](self.params, self.kv, self.last, batch)

    def stop(self) -> None:
        """The first process: ends the other processes' `follow` loops (a no-op in a single process)."""
        if jax.process_count() > 1 and jax.process_index() == 0:
            from jax.experimental import multihost_utils as mh

            mh.broadcast_one_to_all(np.array([STOP, 0, 0], np.int32))
