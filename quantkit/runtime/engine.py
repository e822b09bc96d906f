"""Running a loaded model: a paged KV cache, jitted prefill/decode steps over bucketed shapes (sampling and
logprobs on device, one host transfer per step), and the continuous-batching `Engine` behind both
`quantkit generate` and `quantkit serve`.

Shapes are bucketed so that a server compiles a known, finite set of programs up front (`Engine.warmup`):
prefill chunks of 16, 32, 48, 64, 96, ... `prefill_chunk` tokens, decode batches of 2, 4, ... `max_batch` rows, and the
attended context in 1, 2, 4, ... pages, so attention reads only the pages a batch can see.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from quantkit.errors import InvalidInput
from quantkit.runtime.loader import LoadedModel
from quantkit.runtime.models import forward_for
from quantkit.runtime.models.common import ring_pages

TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's limit)


def enable_compilation_cache(directory: str | None = None) -> str:
    """Turns on JAX's persistent compilation cache (default ~/.cache/quantkit/jax, or $QUANTKIT_JAX_CACHE)."""
    directory = directory or os.environ.get("QUANTKIT_JAX_CACHE") or os.path.expanduser("~/.cache/quantkit/jax")
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory


def new_cache(model: LoadedModel, max_batch: int, pages_per_seq: int, page_size: int,
              ring: int | None = None) -> list:
    """Per layer (key pages, value pages) [num_pages, page_size, kv_heads, head_dim]: 1 + max_batch *
    pages_per_seq pages, or 1 + max_batch * ring for sliding-window layers with a ring; page 0 is scratch.

    In the model's dtype, except float32 on CPU: XLA:CPU upcasts a bf16 scatter and so copies the whole cache
    on every write (measured 0.69 ms vs 0.006 ms per decode write into a 2048-page cache).
    """
    c = model.cfg
    dtype = jnp.float32 if jax.default_backend() == "cpu" else model.dtype
    out = []
    for i in range(c.num_layers):
        pages = 1 + max_batch * (ring if ring and c.is_sliding(i) else pages_per_seq)
        out.append(tuple(jnp.zeros((pages, page_size, c.num_kv_heads, c.head_dim), dtype) for _ in "kv"))
    return out


def _pow2_upto(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2 lo, 4 lo, ... below hi, then hi."""
    out = [lo]
    while out[-1] < hi:
        out.append(min(out[-1] * 2, hi))
    return tuple(out)


def _prefill_buckets(hi: int) -> tuple[int, ...]:
    """16, 32, 48, 64, 96, 128, 192, ... below hi, then hi: at most a third of a chunk is padding."""
    out = [16, 32]
    while out[-1] < hi:
        out.append(out[-1] // 2 * 3 if out[-1] & (out[-1] - 1) == 0 else out[-1] // 3 * 4)
    return tuple(b for b in out if b < hi) + (hi,)


def _fit(n: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if b >= n), buckets[-1])


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_k 0 and top_p 1 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def sample(logits: jax.Array, keys: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """One token per row of logits [b, vocab] with per-row keys [b, 2] and parameters [b].

    The top-k / top-p filter sorts the vocabulary, which XLA:CPU does slowly, so it runs only when a row
    asks for it.
    """
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]

    def filtered():
        desc = jnp.sort(scaled, axis=-1)[:, ::-1]
        kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, desc.shape[-1] - 1)[:, None], axis=-1)
        kth = jnp.where(top_k[:, None] > 0, kth, -jnp.inf)
        desc = jnp.where(desc < kth, -jnp.inf, desc)
        cum = jnp.cumsum(jax.nn.softmax(desc, axis=-1), axis=-1)
        cut = jnp.minimum(jnp.sum(cum < top_p[:, None], axis=-1), desc.shape[-1] - 1)  # smallest prefix >= top_p
        floor = jnp.maximum(kth, jnp.take_along_axis(desc, cut[:, None], axis=-1))
        return jnp.where(scaled < floor, -jnp.inf, scaled)

    scaled = jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1)), filtered, lambda: scaled)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled)
    return jnp.where(temperature <= 0, jnp.argmax(logits, axis=-1), drawn)


def _pick(logits: jax.Array, s: dict, next_pos: jax.Array):
    """Token, its log-probability and the top alternatives for logits [b, vocab] (float32).

    The key of a draw depends only on the request's seed and the position of the drawn token, so a seeded
    request gives the same text whatever else shares its batch.
    """
    keys = jax.vmap(lambda seed, p: jax.random.fold_in(jax.random.PRNGKey(seed), p))(s["seed"], next_pos)
    tok = jax.lax.cond(jnp.all(s["temperature"] <= 0), lambda: jnp.argmax(logits, axis=-1),
                       lambda: sample(logits, keys, s["temperature"], s["top_k"], s["top_p"]))
    logp = jax.nn.log_softmax(logits, axis=-1)
    b = logits.shape[0]
    top = jax.lax.cond(jnp.any(s["logprobs"]), lambda: tuple(jax.lax.top_k(logp, TOP_LOGPROBS)),
                       lambda: (jnp.zeros((b, TOP_LOGPROBS), logp.dtype), jnp.zeros((b, TOP_LOGPROBS), jnp.int32)))
    return tok.astype(jnp.int32), jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0], top[1], top[0]


def step_functions(cfg):
    """The pure step functions of a model (what Runner jits and `plan` compiles for a TPU):

    step(params, cache, tokens [b, t], positions [b, t], block_tables) -> (logits [b, t, vocab], cache)
        (block_tables: the (full, ring) pair of models/common.py);
    prefill(params, cache, tokens, positions, block_tables, last [b], sampling) -> ((token, logprob, top ids,
        top logprobs), cache): samples after position `last` of each row;
    decode(params, cache, tokens [b], positions [b], limits [b], block_tables, sampling, steps) -> (outputs
        [steps, b, ...], cache): `steps` decode steps; rows past `limits` write to the scratch page.
    """
    fwd = forward_for(cfg.family)

    def step(params, cache, tokens, positions, block_tables):
        return fwd(params, cfg, tokens, positions, cache, block_tables)

    def prefill(params, cache, tokens, positions, block_tables, last, s):
        logits, cache = fwd(params, cfg, tokens, positions, cache, block_tables, last)  # [b, 1, vocab]
        return _pick(logits[:, 0], s, positions[jnp.arange(tokens.shape[0]), last] + 1), cache

    def decode(params, cache, tokens, positions, limits, block_tables, s, steps):
        def one(carry, _):
            cache, tok, pos = carry
            live = jnp.where(pos <= limits, pos, -1)  # rows past their last position write to scratch
            logits, cache = fwd(params, cfg, tok[:, None], live[:, None], cache, block_tables)
            out = _pick(logits[:, 0], s, pos + 1)
            return (cache, out[0], pos + 1), out

        (cache, _, _), outs = jax.lax.scan(one, (cache, tokens, positions), None, length=steps)
        return outs, cache  # each [steps, b, ...]

    return step, prefill, decode


def sampling_arrays(b: int) -> dict:
    """Greedy sampling parameters for b rows (the per-row arrays prefill/decode take)."""
    return {"temperature": np.zeros(b, np.float32), "top_k": np.zeros(b, np.int32),
            "top_p": np.ones(b, np.float32), "seed": np.zeros(b, np.uint32), "logprobs": np.zeros(b, bool)}


@dataclass
class Runner:
    """Jitted model steps with a paged cache of `max_batch * ceil(max_model_len / page_size)` pages (+ scratch),
    and for sliding-window layers a ring of `ring_pages` pages per sequence (models/common.py)."""

    model: LoadedModel
    max_model_len: int = 2048
    max_batch: int = 1
    page_size: int = 16
    tp: int = 1
    compilations: set = field(default_factory=set)

    def __post_init__(self):
        self.pages_per_seq = -(-self.max_model_len // self.page_size)
        self.num_pages = 1 + self.max_batch * self.pages_per_seq
        self.ring_pages = ring_pages(self.model.cfg, self.page_size, self.max_model_len)
        self.cache = new_cache(self.model, self.max_batch, self.pages_per_seq, self.page_size, self.ring_pages)
        # the fixed layout (slot i owns pages 1 + i * pages_per_seq ...; Engine hands out pages instead), and
        # a slot's ring, which is fixed: slot i owns ring pages 1 + i * ring_pages ... (it never grows)
        self.block_tables = 1 + np.arange(self.max_batch * self.pages_per_seq, dtype=np.int32).reshape(
            self.max_batch, self.pages_per_seq)
        self.ring_tables = None if self.ring_pages is None else (
            1 + np.arange(self.max_batch * self.ring_pages, dtype=np.int32).reshape(self.max_batch, -1))
        self.params = self.model.params
        if self.tp > 1:
            from quantkit.runtime.sharding import cache_sharding, make_mesh, shard_params

            mesh = make_mesh(self.tp)
            self.params = shard_params(self.params, self.model.cfg, mesh)
            spec = cache_sharding(self.model.cfg, mesh)
            self.cache = [(jax.device_put(k, spec), jax.device_put(v, spec)) for k, v in self.cache]
        step, prefill, decode = step_functions(self.model.cfg)
        self._step = jax.jit(step, donate_argnums=(1,))
        self._prefill = jax.jit(prefill, donate_argnums=(1,))
        self._decode = jax.jit(decode, donate_argnums=(1,), static_argnums=(7,))

    def forward(self, tokens: np.ndarray, positions: np.ndarray) -> jax.Array:
        """Logits [b, t, vocab] for tokens/positions [b, t] (positions -1 = padding), row i in the pages of
        sequence i; updates the cache."""
        b, t = tokens.shape
        self.compilations.add((b, t))
        logits, self.cache = self._step(self.params, self.cache, jnp.asarray(tokens, jnp.int32),
                                        jnp.asarray(positions, jnp.int32), self.tables(np.arange(b), None))
        return logits

    def tables(self, slots: np.ndarray, pages: int | None, full: np.ndarray | None = None) -> tuple:
        """The (full, ring) block tables of `slots` (-1: a padding row, all scratch), attending to `pages`
        pages (None: all); `full`: the engine's page tables, default the fixed layout."""
        full = self.block_tables if full is None else full
        pages = pages or full.shape[1]
        live = (slots >= 0)[:, None]
        f = np.where(live, full[slots, :pages], 0).astype(np.int32)
        if self.ring_tables is None:
            return f, None
        return f, np.where(live, self.ring_tables[slots, :min(pages, self.ring_pages)], 0).astype(np.int32)

    def prefill(self, tokens, positions, tables, last, s: dict):
        """Samples the token after position `last` of each row; returns host arrays (tok, logprob, top ids,
        top logprobs), each with a leading batch axis."""
        out, self.cache = self._prefill(self.params, self.cache, tokens, positions, tables, last, s)
        return jax.device_get(out)

    def decode(self, tokens, positions, limits, tables, s: dict, steps: int):
        """`steps` decode steps for rows whose last token is `tokens` at `positions`; host arrays with a
        leading [steps, b] shape."""
        out, self.cache = self._decode(self.params, self.cache, tokens, positions, limits, tables, s, steps)
        return jax.device_get(out)


# ---- continuous batching -------------------------------------------------------------------------------

class QueueFull(Exception):
    """The engine's waiting queue is at its limit (a server answers 429)."""


@dataclass
class Update:
    """What one engine iteration produced for one request."""

    text: str  # new text (held back while it could still turn into a stop string)
    tokens: list[int]
    logprobs: list[tuple[int, float, list[tuple[int, float]]]]  # per token: (id, logprob, top alternatives)
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last update


@dataclass(eq=False)
class Request:
    """A request as the engine sees it. `on_update` is called on the engine's thread."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    stop_ids: frozenset = frozenset()
    stop_strings: tuple[str, ...] = ()
    logprobs: int | None = None  # alternatives per token (0: just the chosen token's); None: off
    on_update: Callable[[Update], None] | None = None
    id: str = ""
    # engine state
    slot: int = -1
    pages: list = field(default_factory=list)
    done: int = 0  # prompt tokens already in the cache
    out: list = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of text already delivered
    offsets: tuple[int, int] = (0, 0)  # incremental detokenization window
    finish_reason: str | None = None
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None


class Engine:
    """Continuous batching over one Runner: requests join and leave between steps.

    Each iteration admits waiting requests into free slots, runs prefill chunks (at most `prefill_chunk`
    tokens of prompt per iteration, so running requests keep decoding while long prompts arrive), then
    `decode_steps` decode steps for every request whose prompt is in the cache. KV pages are taken from a
    free list as sequences grow and returned the moment a request finishes or is aborted.
    """

    def __init__(self, runner: Runner, decode: Callable[[list[int]], str] | None = None, decode_steps: int = 1,
                 prefill_chunk: int = 512, max_waiting: int = 256):
        """max_waiting: requests queued beyond the `runner.max_batch` running ones before `submit` refuses."""
        self.runner, self.detokenize, self.decode_steps = runner, decode, decode_steps
        self.max_waiting = max_waiting
        self.page_size = runner.page_size
        self.prefill_buckets = _prefill_buckets(max(16, min(prefill_chunk, runner.max_model_len)))
        # at least 2 rows: with one row XLA:CPU turns the cache scatter into a copy of the whole cache
        # (measured 4.0 ms vs 0.6 ms per step for 2 rows, 512-page cache)
        self.batch_buckets = _pow2_upto(2, max(2, runner.max_batch))
        self.page_buckets = _pow2_upto(1, runner.pages_per_seq)
        self.tables = np.zeros((runner.max_batch, runner.pages_per_seq), np.int32)  # 0 = scratch page
        self.free_slots = list(range(runner.max_batch))[::-1]
        self.free_pages = list(range(runner.num_pages - 1, 0, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self.wakeup = threading.Event()
        self._ids = itertools.count()

    # -- thread-safe entry points --
    def submit(self, req: Request) -> Request:
        """Queues a request (any thread). Raises InvalidInput for a bad length, QueueFull when full."""
        n, limit = len(req.prompt), self.runner.max_model_len
        if n == 0:
            raise InvalidInput("empty prompt")
        if req.max_tokens < 1:
            raise InvalidInput(f"max_tokens must be at least 1, got {req.max_tokens}")
        if n + req.max_tokens > limit:
            raise InvalidInput(f"prompt of {n} tokens + max_tokens {req.max_tokens} exceeds the model length "
                               f"{limit}; shorten the prompt or lower max_tokens")
        with self._lock:
            if len(self.waiting) + len(self.running) >= self.runner.max_batch + self.max_waiting:
                raise QueueFull(f"all {self.runner.max_batch} slots are busy and {len(self.waiting)} requests "
                                f"are waiting; retry later")
            req.id = req.id or f"req-{next(self._ids)}"
            self.waiting.append(req)
        self.wakeup.set()
        return req

    def abort(self, request_id: str) -> None:
        """Stops a request at the next iteration and frees its pages (any thread)."""
        with self._lock:
            self._aborts.add(request_id)
        self.wakeup.set()

    @property
    def pages_used(self) -> int:
        return self.runner.num_pages - 1 - len(self.free_pages)

    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    # -- the loop (one thread) --
    def run(self, stop: threading.Event) -> None:
        """Steps until `stop` is set; sleeps while idle."""
        while not stop.is_set():
            if not self.step():
                self.wakeup.wait(0.1)
                self.wakeup.clear()

    def step(self) -> bool:
        """One iteration; False when there was nothing to do."""
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            for r in [r for r in self.waiting if r.id in aborts]:
                self.waiting.remove(r)
                self._finish(r, "abort")
            while self.waiting and self.free_slots:
                r = self.waiting.popleft()
                r.slot = self.free_slots.pop()
                self.running.append(r)
        for r in [r for r in self.running if r.id in aborts]:
            self._finish(r, "abort")
        if not self.running:
            return False
        budget = self.prefill_buckets[-1]
        for r in [r for r in self.running if r.done < len(r.prompt)]:
            if budget <= 0:
                break
            budget -= self._prefill(r)
        ready = [r for r in self.running if r.done == len(r.prompt) and r.out]
        if ready:
            self._decode(ready)
        return True

    @staticmethod
    def _samp(rows: list[Request], b: int) -> dict:
        s = sampling_arrays(b)
        for i, r in enumerate(rows):
            p = r.sampling
            s["temperature"][i], s["top_k"][i], s["top_p"][i] = p.temperature, p.top_k, p.top_p
            s["seed"][i], s["logprobs"][i] = p.seed & 0xFFFFFFFF, r.logprobs is not None
        return s

    def _reserve(self, r: Request, last_position: int) -> None:
        while len(r.pages) <= last_position // self.page_size:
            page = self.free_pages.pop()
            self.tables[r.slot, len(r.pages)] = page
            r.pages.append(page)

    def _prefill(self, r: Request) -> int:
        start, c = r.done, self.prefill_buckets[-1]
        n = min(len(r.prompt) - start, c)
        t = c if start else _fit(n, self.prefill_buckets)
        self._reserve(r, start + n - 1)
        pages = _fit(-(-(start + t) // self.page_size), self.page_buckets)
        tokens = np.zeros((1, t), np.int32)
        positions = np.full((1, t), -1, np.int32)
        tokens[0, :n], positions[0, :n] = r.prompt[start:start + n], np.arange(start, start + n)
        self.runner.compilations.add(("prefill", t, pages))
        tok, lp, top_ids, top_lp = self.runner.prefill(tokens, positions,
                                                       self.runner.tables(np.array([r.slot]), pages, self.tables),
                                                       np.array([n - 1], np.int32), self._samp([r], 1))
        r.done += n
        if r.done == len(r.prompt):
            self._accept(r, tok, lp, top_ids, top_lp)
        return n

    def _decode(self, rows: list[Request]) -> None:
        k, b = self.decode_steps, _fit(len(rows), self.batch_buckets)
        tokens, positions = np.zeros(b, np.int32), np.full(b, -1, np.int32)
        limits = np.full(b, -2, np.int32)
        reach = 0
        for i, r in enumerate(rows):
            tokens[i], positions[i] = r.out[-1], len(r.prompt) + len(r.out) - 1
            limits[i] = len(r.prompt) + r.max_tokens - 2  # the last token is never fed back
            last = min(positions[i] + k - 1, limits[i])
            self._reserve(r, last)
            reach = max(reach, last + 1)
        pages = _fit(-(-reach // self.page_size), self.page_buckets)
        slots = np.array([r.slot for r in rows] + [-1] * (b - len(rows)))
        tables = self.runner.tables(slots, pages, self.tables)
        self.runner.compilations.add(("decode", b, pages))
        toks, lps, top_ids, top_lps = self.runner.decode(tokens, positions, limits, tables, self._samp(rows, b), k)
        for i, r in enumerate(rows):
            self._accept(r, toks[:, i], lps[:, i], top_ids[:, i], top_lps[:, i])

    def _accept(self, r: Request, toks, lps, top_ids, top_lps) -> None:
        """Appends sampled tokens (until a stop), detokenizes, delivers an update, finishes if done."""
        if r.first_token_at is None:
            r.first_token_at = time.monotonic()
        new, info = [], []
        for j, tok in enumerate(int(t) for t in toks):
            if tok in r.stop_ids:
                r.finish_reason = "stop"
                break
            r.out.append(tok)
            new.append(tok)
            if r.logprobs is not None:
                info.append((tok, float(lps[j]), [(int(i), float(v)) for i, v in
                                                  zip(top_ids[j][:r.logprobs], top_lps[j][:r.logprobs])]))
            if self.detokenize is not None and self._extend_text(r):
                break
            if len(r.out) >= r.max_tokens:
                r.finish_reason = "length"
                break
        if r.finish_reason is not None and self.detokenize is not None and r.offsets[1] < len(r.out):
            lo, mid = r.offsets  # flush a trailing partial character as the tokenizer renders it
            r.text += self.detokenize(r.out[lo:])[len(self.detokenize(r.out[lo:mid])):]
        self._deliver(r, new, info)

    def _extend_text(self, r: Request) -> bool:
        """Incremental detokenization (a window of tokens, so a tokenizer's word-initial spaces come out
        right); True when a stop string appeared (text cut before it, its tokens dropped)."""
        lo, mid = r.offsets
        before = self.detokenize(r.out[lo:mid])
        now = self.detokenize(r.out[lo:])
        if len(now) > len(before) and not now.endswith("\ufffd"):  # wait for a whole character
            r.text += now[len(before):]
            r.offsets = (mid, len(r.out))
        hits = [i for i in (r.text.find(s, max(0, r.sent - len(s))) for s in r.stop_strings) if i >= 0]
        if not hits:
            return False
        r.text, r.finish_reason = r.text[:min(hits)], "stop"
        while r.out and any(s in self.detokenize(r.out) for s in r.stop_strings):
            r.out.pop()
        return True

    def _deliver(self, r: Request, new: list[int], info: list) -> None:
        if r.finish_reason is None:
            hold = max((len(s) - 1 for s in r.stop_strings), default=0)
            end = max(r.sent, len(r.text) - hold)
        else:
            end = len(r.text)
        text, r.sent = r.text[r.sent:end], end
        if r.finish_reason is not None:
            self._release(r)
        if r.on_update is not None and (text or new or r.finish_reason):
            r.on_update(Update(text, new, info, r.finish_reason))

    def _finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        self._release(r)
        if r.on_update is not None:
            r.on_update(Update("", [], [], reason))

    def _release(self, r: Request) -> None:
        r.finished_at = time.monotonic()
        if r.slot >= 0:
            self.free_pages.extend(reversed(r.pages))
            self.tables[r.slot] = 0
            self.free_slots.append(r.slot)
            r.pages, r.slot = [], -1
            self.running.remove(r)

    # -- compile everything up front --
    def shapes(self) -> list[tuple]:
        """Every step shape this engine can run: ("prefill", tokens, pages) and ("decode", rows, pages)."""
        ps, c = self.page_size, self.prefill_buckets[-1]
        first = {("prefill", t, _fit(-(-t // ps), self.page_buckets)) for t in self.prefill_buckets}
        more = {("prefill", c, p) for p in self.page_buckets  # continuation chunks of long prompts
                if p > _fit(-(-c // ps), self.page_buckets)} if self.runner.max_model_len > c else set()
        decode = {("decode", b, p) for b in self.batch_buckets for p in self.page_buckets}
        return sorted(first | more) + sorted(decode)

    def warmup(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Runs every shape once on padding (writes only the scratch page), so nothing compiles later."""
        shapes = self.shapes()
        for i, (kind, b, pages) in enumerate(shapes):
            if kind == "prefill":
                self.runner.prefill(np.zeros((1, b), np.int32), np.full((1, b), -1, np.int32),
                                    self.runner.tables(np.array([-1]), pages), np.zeros(1, np.int32), self._samp([], 1))
            else:
                self.runner.decode(np.zeros(b, np.int32), np.full(b, -1, np.int32), np.full(b, -2, np.int32),
                                   self.runner.tables(np.full(b, -1), pages), self._samp([], b), self.decode_steps)
            self.runner.compilations.add((kind, b, pages))
            if progress is not None:
                progress(i + 1, len(shapes))


def generate(runner: Runner, prompt: list[int], max_tokens: int, sampling: Sampling = Sampling(),
             stop_ids: tuple[int, ...] = (), stop_strings: tuple[str, ...] = (), decode=None,
             on_update: Callable[[Update], None] | None = None) -> list[int]:
    """Generates up to max_tokens after `prompt` (one sequence, through the same engine as the server).

    Stops at a stop id (not included), or once the text (`decode(ids)`; needed for stop strings) contains a
    stop string: the text is cut before it and the tokens that complete it are dropped. `on_update` sees the
    text as it grows.
    """
    engine = Engine(runner, decode=decode)
    req = engine.submit(Request(list(prompt), max_tokens, sampling, frozenset(stop_ids), tuple(stop_strings),
                                on_update=on_update))
    while req.finish_reason is None:
        engine.step()
    return req.out
