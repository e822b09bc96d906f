"""Continuous batching over the one ragged step (runtime/step.py): a vLLM-v1-style scheduler with a token
budget per step, page accounting (runtime/cache.py), detokenization and stops; behind both
`quantkit generate` and `quantkit serve`.

Each iteration schedules one step: running decodes first (one token each), then chunks of prompts fill
the rest of the `max_num_batched_tokens` budget, newcomers admitted into free slots, all in the same
step. The step is dispatched before the previous step's tokens are read back: the host prepares and
launches step N + 1 while the device runs step N (a decode row's input token never leaves the device),
and the tokens of step N are delivered one iteration late. A request that stops is therefore computed
one step further, and that token is dropped.

With prefix caching (on by default, as in vLLM) a newcomer starts from the longest chain of cached full
pages of its prompt (runtime/cache.py) and prefills only the rest; at least its last prompt token is
computed, for its first sample. Pages are named as soon as they are full and their tokens known: prompt
pages when their chunk is scheduled (the device runs steps in order, so a later reader sees them written),
generated ones when their tokens are read back.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

import jax
import numpy as np

from quantkit.errors import InvalidInput
from quantkit.runtime.cache import page_hashes
from quantkit.runtime.speculative import Lookup, PromptLookup, SpeculativeConfig
from quantkit.runtime.structured import spread
from quantkit.runtime.step import BANNED, NO_TOKEN, TOP_LOGPROBS, Row, Runner, Sampling  # noqa: F401 - re-exported


def enable_compilation_cache(directory: str | None = None) -> str:
    """Turns on JAX's persistent compilation cache (default ~/.cache/quantkit/jax, or $QUANTKIT_JAX_CACHE) for
    programs that take at least half a second to compile (the steps; not the many small eager-op programs,
    whose writing costs more than their reading saves: 13% of op-by-op time, measured on gmm_v2.visits)."""
    directory = directory or os.environ.get("QUANTKIT_JAX_CACHE") or os.path.expanduser("~/.cache/quantkit/jax")
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return directory


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


SPEC_FLOOR, SPEC_PROBE = 0.15, 32  # drafts stop for a sequence whose recent acceptance is below the floor,
# and are looked for again after this many of its decode steps; for a sampled one each look that leaves it
# below doubles that, up to SPEC_PROBE_MAX, and one that lifts it above resets it
SPEC_PROBE_MAX = 8 * SPEC_PROBE
# a greedy sequence's floor: about where a drafted step stops paying (its read-back, ~16% of a step on XLA:CPU,
# or a TPU's verifying step 1.08-1.41x a decode step, against k drafts a few percent of which save a step each);
# a sampled sequence's is the no-loss bound measured at temperature 1 (docs/benchmarks.md)
SPEC_FLOOR_GREEDY = 0.05


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
    min_tokens: int = 0  # stop ids are never sampled, nor stop strings matched, before this many tokens
    ignore_eos: bool = False  # a stop id ends nothing: it is kept, and generation goes on
    grammar: object = None  # structured.Grammar: the constraint its tokens must follow, if any
    # engine state
    slot: int = -1
    done: int = 0  # tokens (prompt, then fed-back outputs) scheduled into the cache
    pending: int = 0  # sampled tokens of dispatched steps not yet delivered
    ahead: int = 0  # drafts of dispatched steps not yet read back (as many more tokens may come)
    out: list = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of text already delivered
    checked: int = 0  # characters of text already searched for stop strings
    offsets: tuple[int, int] = (0, 0)  # incremental detokenization window
    hashes: list = field(default_factory=list)  # chained hashes of its full pages (prefix caching)
    named: int = 0  # pages registered in the prefix cache
    align_at: int = 0  # Gated DeltaNet models: where its cached KV pages end (a prompt chunk ends there)
    proposed: int = 0  # drafts a draft head left on the device for its slot (speculative decoding: eagle3, mtp)
    matched: bool = True  # whether the device's n-gram lookup found it drafts in the last step read back
    acceptance: float = 0.5  # its drafts' recent acceptance (moving average; `Engine._observe`)
    undrafted: int = 0  # its decode steps since it last looked for drafts
    probe: int = SPEC_PROBE  # how many it waits for the next look while below the floor (`Engine._observe`)
    lookup: PromptLookup | None = None  # its n-gram index (speculative decoding: ngram)
    finish_reason: str | None = None
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None


class Engine:
    """Continuous batching over one Runner: requests join and leave between steps.

    KV pages come from the runner's pools as sequences grow and go back the moment a request finishes, is
    aborted or its client disconnects (sliding-window layers also return pages that left the window); a
    page other requests share stays until the last of them lets go.
    """

    def __init__(self, runner: Runner, decode: Callable[[list[int]], str] | None = None, max_waiting: int = 256,
                 prefix_caching: bool = True, speculative: SpeculativeConfig | None = None):
        """max_waiting: requests queued beyond the `runner.max_num_seqs` running ones before `submit` refuses.
        prefix_caching: reuse cached pages of earlier prompts (and outputs) that a prompt starts with; for
        models with Gated DeltaNet layers, whose per-sequence state no page holds, only with the runner's
        state snapshots (`Runner.prefix_states`, runtime/cache.py), and only up to the prompt chunks'
        page-aligned ends (`_chunk`, `_snapshot`).
        speculative: draft tokens for decoding rows (runtime/speculative.py; the runner's `speculative` is its
        k). A drafter on the device (a draft head, or the n-gram lookup on a one-device runner) leaves its
        drafts there, and so the positions they leave: a step is scheduled while the previous verifying step
        runs, its rows counting every draft of it as accepted and the device moving them back by those it
        rejected (`_follows`; step.py), as long as every step runs the verifying program (the drafter runs)
        and no request is constrained. Host n-gram lookups (a runner on several devices) follow the tokens
        so far: a step that drafts reads the previous one back before it is scheduled, and the step after a
        drafted one too (its positions follow the accepted count); other steps overlap as without
        speculation. A row under a structured-output constraint or before its
        min_tokens gets none, nor one the device's lookup found nothing for in the last step read back. How
        many a step takes (`_room`): on XLA:CPU, where a step's time grows with
        its tokens, only the padding of the token bucket a step of decodes alone runs anyway, and only where
        that padding is at least the step's tokens, so that the drafts can pay for reading the previous step
        back first (measured on the default model, 16 concurrent streams: drafts up to k a row 0.42x as
        fast as without, drafts in any padding 0.75x; 0.79-1.18x since the CPU attention takes a verifying
        row's queries together, docs/benchmarks.md); on a TPU, whose decode step is bound by reading the
        weights, up to the token budget."""
        if (speculative.k if speculative else 0) != runner.speculative:
            raise ValueError(f"the runner verifies {runner.speculative} drafts a row, the config says {speculative}")
        if speculative is not None and speculative.method != "ngram" and runner.drafter is None:
            raise ValueError(f"method {speculative.method!r} needs the runner's draft head")
        self.runner, self.detokenize, self.max_waiting = runner, decode, max_waiting
        self.speculative = speculative
        # n-gram lookups on the host: a runner on several devices (else on the device, as a head's drafts)
        self.host_lookup = speculative is not None and runner.drafter is None
        # speculative decoding (vLLM's spec_decode metrics): rows that carried drafts, drafts, accepted ones,
        # accepted ones by position
        self.drafts = self.draft_tokens = self.accepted = 0
        self.accepted_at = [0] * runner.speculative
        self.prior = {True: 0.5, False: 0.5}  # greedy / sampled sequences' recent acceptance (`_observe`)
        self.fill_only = jax.default_backend() == "cpu"  # drafts only in a decode step's padding (`_room`)
        # the n-gram lookup in the verifying step (its drafts are read back: whether it found any for a row)
        self.device_lookup = runner.drafter is not None and isinstance(runner.drafter.spec, Lookup)
        self.pool = runner.pool
        # Gated DeltaNet models: with the runner's state snapshots (cache.py), on one process (the copies are
        # not broadcast to the others)
        self.prefix_caching = prefix_caching and (not runner.layout.states or runner.layout.snapshots > 0
                                                  and jax.process_count() == 1)
        self.salt = f"quantkit kv {runner.kv_dtype}".encode()  # what else changes a page's keys and values
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up / found cached
        # structured outputs: constrained sequences, masks computed, steps that computed one, their seconds
        self.constrained, self.masks, self.mask_steps, self.mask_seconds = 0, 0, 0, 0.0
        # steps dispatched; host seconds in `step` outside read-backs; seconds waiting on a read-back (the
        # device still running the step read): where that wait is ~0, the device waited for the host instead
        self.steps, self.host_seconds, self.wait_seconds = 0, 0.0, 0.0
        # read-backs whose step had finished before the host came for it: only after those can the device have
        # waited for the next step (the engine dispatches a step before it reads the previous one back)
        self.ready_readbacks = 0
        self.budget = runner.max_num_batched_tokens
        self.free_slots = list(range(runner.max_num_seqs))[::-1]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.inflight = None  # (device outputs, [(request, samples?)]) of the last dispatched step
        self.since = (False, time.monotonic())  # `run`: (busy?, since when) of the current run of steps or idling
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
        if req.min_tokens and len(req.stop_ids) > BANNED:
            raise InvalidInput(f"min_tokens needs at most {BANNED} stop ids, got {len(req.stop_ids)}")
        if req.grammar is not None and (jax.process_count() > 1 or self.runner.dp > 1):
            raise InvalidInput("structured outputs and tool_choice required / named are served by one process "
                               "without data parallelism only, not across hosts or data-parallel devices yet")
        with self._lock:
            if len(self.waiting) + len(self.running) >= self.runner.max_num_seqs + self.max_waiting:
                raise QueueFull(f"all {self.runner.max_num_seqs} slots are busy and {len(self.waiting)} requests "
                                f"are waiting; retry later")
            req.id = req.id or f"req-{next(self._ids)}"
            self.waiting.append(req)
            self.constrained += req.grammar is not None
        self.wakeup.set()
        return req

    def abort(self, request_id: str) -> None:
        """Stops a request at the next iteration and frees its pages (any thread)."""
        with self._lock:
            self._aborts.add(request_id)
        self.wakeup.set()

    @property
    def pages_used(self) -> int:
        return self.pool.used

    def busy(self) -> bool:
        return bool(self.running or self.waiting or self.inflight)

    # -- the loop (one thread) --
    def run(self, stop: threading.Event) -> None:
        """Steps until `stop` is set; sleeps while idle (`since`: (busy?, since when), of the current run of
        steps or of idling)."""
        self.since = (False, time.monotonic())
        while not stop.is_set():
            busy = self.step()
            if busy != self.since[0]:
                self.since = (busy, time.monotonic())
            if not busy:
                self.wakeup.wait(0.1)
                self.wakeup.clear()

    def step(self) -> bool:
        """One iteration: schedule and dispatch a step, then deliver the previous one's tokens. False when
        there was nothing to do. A sequence under a structured-output constraint needs its last token before
        its next mask: a step with one runs as two programs (Runner.run_split), the previous step read back
        and the masks computed while the device runs the new step's forward."""
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            for r in [r for r in self.waiting if r.id in aborts]:
                self.waiting.remove(r)
                self._finish(r, "abort")
        for r in [r for r in self.running if r.id in aborts]:
            self._finish(r, "abort")
        t0, waited = time.perf_counter(), self.wait_seconds
        masks, collected = self.masks, False
        follows = self._follows()
        if self.inflight is not None and not follows and any(d for *_, d in self.inflight[1]):
            self._collect(*self.inflight)  # positions follow acceptance
            self.inflight, collected = None, True
        rows = self._schedule(follows)
        room = self._room(rows)
        if room and self.inflight is not None and self.host_lookup and \
                any(self._may_draft(r, row) for r, row, _ in rows):
            self._collect(*self.inflight)  # drafts follow the tokens so far
            self.inflight, collected = None, True
            rows = [x for x in rows if x[0].finish_reason is None]
        if room:
            self._draft(rows, room)
        for r, row, _ in rows:
            row.follow = r.ahead > 0  # (only while `follows`: else the step that drafted was read back)
        # after the newcomers and the drafts (a probe's own step does not run the head); rows that follow
        # need the verifying program
        head = self._head() or any(row.follow for _, row, _ in rows)
        previous, self.inflight = self.inflight, None
        if rows:
            batch = self.runner.batch([row for _, row, _ in rows])
            constrained = [(k, r) for k, (r, _, samples) in enumerate(rows) if samples and r.grammar is not None]

            def sampling() -> dict:  # while the forward runs: the previous step's tokens, then the masks
                nonlocal previous
                if previous is not None:
                    self._collect(*previous)
                    previous = None
                s = {**batch["sampling"], "allow": batch["sampling"]["allow"].copy()}
                for k, r in constrained:
                    s["allow"][k] = spread(r.grammar.mask, s["allow"].shape[1]) if r.finish_reason is None else -1
                return s

            if constrained and batch["drafts"].any():  # read back for the drafts: the masks go in the batch
                batch["sampling"], constrained = sampling(), []
            out = self.runner.run_split(batch, sampling) if constrained else self.runner.run(batch, head)
            drafted = self.runner.drafter is not None and not constrained and (head or batch["drafts"].any())
            for r, row, samples in rows:
                r.ahead += len(row.drafts) + row.proposed
                r.proposed = self.speculative.k if drafted and samples else 0
            self.inflight = (out, [(r, samples, len(row.drafts) + row.proposed) for r, row, samples in rows])
            self._snapshot(rows)
            if self.host_lookup:
                for r, row, _ in rows:  # while the device runs: prompt chunks into their n-gram indexes
                    if row.tokens is not None:
                        self._lookup(r, r.prompt[:r.done])
        if previous is not None:
            self._collect(*previous)
        self.mask_steps += self.masks > masks
        self.steps += bool(rows)
        self.host_seconds += time.perf_counter() - t0 - (self.wait_seconds - waited)
        return bool(rows) or previous is not None or collected

    def _schedule(self, follows: bool = False) -> list[tuple[Request, Row, bool]]:
        """Decodes first, then prompt chunks (running requests, then newcomers) within the token budget.
        Returns (request, row, whether the row's last token is the request's newest, i.e. samples). A
        data-parallel runner's devices each have the budget (`_place` puts a newcomer on one). `follows`
        (`_follows`): a constrained newcomer waits for the next step."""
        budget, rows, dev = [self.budget] * self.pool.devices, [], self.pool.device

        def add(r: Request, n: int, prompt: bool) -> bool:
            # (a row that follows a step not read back may start r.ahead earlier: its drafts rejected)
            if not self.pool.reserve(r.slot, r.done - r.ahead, r.done + n - 1):
                return False  # out of pages: the request waits for a later step
            toks = r.prompt[r.done:r.done + n] if prompt else None
            samples = not prompt or r.done + n == len(r.prompt)
            banned = tuple(r.stop_ids) if samples and len(r.out) + r.pending < r.min_tokens else ()
            rows.append((r, Row(r.slot, r.done, n, toks, r.sampling, r.logprobs is not None, banned), samples))
            r.done += n
            r.pending += samples
            if samples and self.runner.drafter is not None:  # the drafter writes up to max(k - 1, 1) further
                self.pool.reserve(r.slot, r.done - n - r.ahead, min(r.done + max(self.runner.speculative - 2, 0),
                                                          self.runner.max_model_len - 1))
            self._name(r)
            return True

        for r in self.running:  # decodes: a fed-back token, if more tokens are wanted
            if r.done >= len(r.prompt) and budget[d := dev(r.slot)] and len(r.out) + r.pending + r.ahead < r.max_tokens:
                budget[d] -= add(r, 1, False)
        for r in self.running:
            if r.done < len(r.prompt) and budget[d := dev(r.slot)]:
                n = self._chunk(r, min(len(r.prompt) - r.done, budget[d]))
                budget[d] -= n if add(r, n, True) else 0
        with self._lock:
            while self.waiting and (slot := self._place(budget)) is not None and not (
                    follows and self.waiting[0].grammar is not None):
                r = self.waiting.popleft()
                if r.grammar is not None and not self._fill([r])[0]:  # its first mask: no token allowed
                    self._finish(r, "stop")
                    continue
                self.free_slots.remove(slot)
                r.slot, d = slot, dev(slot)
                r.acceptance = self.prior[r.sampling.temperature == 0]
                self.running.append(r)
                if self.prefix_caching:
                    self._reuse(r)
                n = self._chunk(r, min(len(r.prompt) - r.done, budget[d]))
                budget[d] -= n if add(r, n, True) else 0
        return rows

    def _place(self, budget: list[int]) -> int | None:
        """The free slot a newcomer takes, None when none can: one device's next free slot; on a
        data-parallel runner the device with the fewest sequences among those with budget left this step
        (ties: the lowest), as vLLM's data-parallel coordinator balances by load."""
        dev = self.pool.device
        per = Counter(dev(s) for s in self.free_slots)  # free slots a device
        # the most recently freed slot first (a stack, as on one device)
        return max((s for s in reversed(self.free_slots) if budget[dev(s)]), key=lambda s: (per[dev(s)], -dev(s)),
                   default=None)

    def _room(self, rows: list) -> int:
        """Draft tokens the scheduled step may take (see __init__): 0 without speculation or decode rows."""
        if self.speculative is None or not any(row.tokens is None for _, row, _ in rows):
            return 0
        n = sum(row.n for _, row, _ in rows)
        if not self.fill_only:
            return self.budget - n
        pad = self.runner.bucket(n) - n
        return 0 if any(row.tokens is not None for _, row, _ in rows) or pad < n else pad

    def _wants_drafts(self, r: Request) -> bool:
        """Whether r's recent drafts paid: a moving average of their acceptance at least SPEC_FLOOR (a sampled
        or unpredictable stream whose drafts are rejected stops drafting, and with it reading each step back
        and running a draft head; a greedy stream at SPEC_FLOOR_GREEDY: with a prompt_lookup_min of 1, the
        code-editing benchmark's greedy streams stopped at 0.15 with 42% of their drafts accepted overall,
        for 30% more steps), or r.probe decode steps since it last looked for drafts (try again)."""
        floor = SPEC_FLOOR_GREEDY if r.sampling.temperature == 0 else SPEC_FLOOR
        return r.acceptance >= floor or r.undrafted >= r.probe

    def _observe(self, r: Request, rate: float, weight: float = 0.25) -> None:
        """What r's last look for drafts gave: the fraction of its drafts accepted, or 0 with a smaller weight
        for a sampled sequence's n-gram lookup that found nothing (the step was read back for nothing: a
        smaller loss than rejected drafts; a greedy stream's lookups go on, as what falls into a loop or
        starts copying stays there). r's moving average follows it, and so does the one that greedy or
        sampled sequences start from, more slowly (a server whose sampled streams reject their drafts starts
        the next ones without drafts: they look again after r.probe steps). A sampled sequence's look made
        below the floor (a probe) that leaves it there doubles r.probe (its rejections come from its
        temperature, which stays; each probe costs drafted steps: on this CPU a step with the head's 3 drafts
        costs 1.6 plain ones), one that lifts it above resets it; a greedy one's stays (what it writes may
        turn predictable: it starts copying)."""
        greedy = r.sampling.temperature == 0
        probing = not greedy and r.acceptance < SPEC_FLOOR
        r.acceptance += weight * (rate - r.acceptance)
        self.prior[greedy] += 0.4 * weight * (rate - self.prior[greedy])
        r.undrafted = 0
        if probing:
            r.probe = SPEC_PROBE if r.acceptance >= SPEC_FLOOR else min(2 * r.probe, SPEC_PROBE_MAX)

    def _head(self) -> bool:
        """Whether the step runs the draft head (eagle3, mtp; or the device's n-gram lookup): some sequence
        wants drafts and, on XLA:CPU, few enough run that the next step can take them (`_room`: at most half
        the smallest bucket)."""
        return self.runner.drafter is not None and any(self._wants_drafts(r) for r in self.running) and (
            not self.fill_only or 2 * len(self.running) <= self.runner.buckets[0])

    def _follows(self) -> bool:
        """Whether the next step may be scheduled before the one in flight is read back although that one
        verified drafts: a draft head's runner whose next step will run the verifying program (the head
        runs: `_head`), which moves each row to where the previous step's acceptance left it (step.py),
        with no constrained request running (a constrained step's masks need its last token)."""
        return self._head() and jax.process_count() == 1 and \
            not any(r.grammar is not None for r in self.running)

    def _may_draft(self, r: Request, row: Row) -> bool:
        """Whether r's row may carry drafts: a decode row without a constraint or banned ids (min_tokens),
        of a request that wants more than this row's token, whose n-gram lookup can find something once
        its token in flight is known: every match ending in that token needs an earlier occurrence of the
        prompt_lookup_min - 1 known tokens before it (so a step is not read back for nothing)."""
        if row.tokens is not None or r.grammar is not None or row.banned or \
                len(r.out) + r.pending + r.ahead >= r.max_tokens or not self._wants_drafts(r):
            return False
        if not self.host_lookup:  # what the head (or the device's lookup, where it last found some) left there
            return r.proposed > 0 and r.matched
        n = self.speculative.lookup_min - 1
        return r.pending < 2 or n == 0 or bool(self._lookup(r).draft(1, n, n))

    def _lookup(self, r: Request, prompt: list[int] | None = None) -> PromptLookup:
        """r's n-gram index, up to date with its known tokens, or with `prompt` (its prompt so far); made at
        its first prompt chunk."""
        if r.lookup is None:
            r.lookup = PromptLookup(range(max(self.speculative.lookup_min - 1, 1), self.speculative.lookup_max + 1))
        return r.lookup.extend(r.prompt, r.out) if prompt is None else r.lookup.extend(prompt, [])

    def _draft(self, rows: list, room: int) -> None:
        """Extends decode rows with drafts, in order, within `room` tokens and the pages the pool can give:
        n-gram lookups (read back: r.out is current), or the count of a draft head's drafts on the device."""
        spec = self.speculative
        for r, row, _ in rows:
            if room <= 0:
                return
            if not self._may_draft(r, row):
                continue
            k = min(spec.k, r.max_tokens - len(r.out) - r.pending - r.ahead, room)
            if not self.host_lookup:
                n = max(min(k, r.proposed), 0)
            else:
                drafts = self._lookup(r).draft(k, spec.lookup_min, spec.lookup_max) if k > 0 else []
                if k > 0 and not drafts and r.sampling.temperature > 0:
                    self._observe(r, 0.0, 0.1)
                n = len(drafts)
            # from the row's first position: a sliding window's pages are kept for its first query
            if n and self.pool.reserve(r.slot, row.start - r.ahead, row.start + row.n + n - 1):
                if not self.host_lookup:
                    row.proposed = n
                else:
                    row.drafts = tuple(drafts)
                row.n, r.done, r.undrafted = row.n + n, r.done + n, 0  # below the floor: no head until these pay
                room -= n

    @property
    def snapshot_bytes(self) -> int:
        """Device bytes of the state snapshot slots (Gated DeltaNet models with prefix caching)."""
        lay = self.pool.layout
        return sum(math.prod(s[2:]) * 4 * s[0] for s in lay.states[:2]) * lay.snapshots

    def _chunk(self, r: Request, n: int) -> int:
        """How many of the n prompt tokens r may take this step: all, except for Gated DeltaNet models with
        prefix caching, whose chunks end on page boundaries where they can (vLLM's "align" mode), so that
        the states after them can be kept (`_snapshot`): a prompt's last chunk first stops at the last
        boundary before its last token (what a later prompt that starts with it can hit), an earlier chunk
        at the last boundary it reaches, and a chunk also stops where the prompt's cached KV pages end past
        its last snapshot (a prefix other prompts share, as a system prompt: the next one then hits all of
        it)."""
        if not (self.prefix_caching and self.runner.layout.states):
            return n
        ps, end = self.pool.layout.page_size, r.done + n
        last = (len(r.prompt) - 1) // ps * ps
        end = last if end == len(r.prompt) and r.done < last else end if end == len(r.prompt) else end // ps * ps
        if r.done < r.align_at < end:  # where its cached pages end: a prefix other prompts share
            end = r.align_at
        return end - r.done if end > r.done else n

    def _snapshot(self, rows: list) -> None:
        """Keeps the Gated DeltaNet states of each prompt row that ends on a page boundary, named by that
        page's hash, unless kept already (copied on device after the dispatched step: cache.py)."""
        if not (self.prefix_caching and self.runner.layout.states):
            return
        ps, pairs = self.pool.layout.page_size, []
        for r, row, _ in rows:
            end = row.start + row.n
            if row.tokens is not None and end % ps == 0 and \
                    (dst := self.pool.snapshot(r.slot, r.hashes[end // ps - 1])) is not None:
                pairs.append((self.pool.state_slot(r.slot), dst))
        self.runner.copy_states(pairs)

    def _reuse(self, r: Request) -> None:
        """Starts a newcomer from the cached pages its prompt begins with (all but its last token), and for
        Gated DeltaNet models from the states after them."""
        ps = self.pool.layout.page_size
        r.hashes = page_hashes(r.prompt, ps, self.salt)
        m = self.pool.match(r.slot, r.hashes[:(len(r.prompt) - 1) // ps])
        self.pool.share(r.slot, r.hashes[:m])
        if m and self.runner.layout.states:
            self.runner.copy_states([(self.pool.restore(r.slot, r.hashes[m - 1]), self.pool.state_slot(r.slot))])
        if self.runner.layout.states:  # its KV pages may be cached past the last snapshot: a chunk ends there
            r.align_at = self.pool.match(r.slot, r.hashes[:(len(r.prompt) - 1) // ps], states=False) * ps
        r.done, r.named = m * ps, m
        self.prefix_queries += len(r.prompt)
        self.prefix_hits += m * ps

    def _name(self, r: Request) -> None:
        """Registers r's pages that are full, scheduled and of known tokens (sampled ones are known when
        read back) in the prefix cache."""
        if not self.prefix_caching or r.slot < 0:
            return
        ps = self.pool.layout.page_size
        full = min(r.done, len(r.prompt) + len(r.out)) // ps
        if full > len(r.hashes):
            seq = (r.prompt + r.out)[:full * ps]
            r.hashes += page_hashes(seq, ps, r.hashes[-1] if r.hashes else self.salt, len(r.hashes))
        if full > r.named:
            self.pool.register(r.slot, r.hashes[r.named:full], r.named)
            r.named = full

    def _collect(self, out, rows: list) -> None:
        """Delivers the tokens of a finished step to the rows that sampled (with speculation, each row's
        accepted drafts and the token after them; the cache then ends after the last accepted draft: what the
        rejected ones wrote is overwritten later); then the next masks of the constrained rows, all at once
        (a sequence whose constraint allows nothing more ends there)."""
        # a draft head's proposals stay on the device; the n-gram lookup's come back, to tell which it found
        t, out = time.perf_counter(), out[:7 if self.device_lookup else 6]
        self.ready_readbacks += all(x.is_ready() for x in out)  # computed already: the device may have idled
        out = jax.device_get(out)
        self.wait_seconds += time.perf_counter() - t
        if len(out) >= 6:  # step.verify_rows: [S, k + 1] a row, `count` of them real
            toks, counts, lps, top_ids, top_lps, offered = out[:6]
        else:
            (toks, lps, top_ids, top_lps), counts = (x[:, None] for x in out), np.ones(len(out[0]), np.int32)
        for i, (r, samples, drafts) in enumerate(rows):
            if samples:
                r.pending -= 1
                c = int(counts[i])
                r.undrafted += 1
                if len(out) == 7:  # the device's lookup: a row it found nothing for takes no draft tokens
                    r.matched = bool((out[6][i] != NO_TOKEN).any())  # (until a later look finds some)
                if drafts:
                    r.ahead -= drafts
                    r.done -= drafts + 1 - c
                    if offered[i]:
                        self._observe(r, (c - 1) / offered[i])
                        self.drafts, self.draft_tokens, self.accepted = (
                            self.drafts + 1, self.draft_tokens + int(offered[i]), self.accepted + c - 1)
                        for j in range(c - 1):
                            self.accepted_at[j] += 1
                    elif r.sampling.temperature > 0:  # the device's lookup found nothing
                        self._observe(r, 0.0, 0.1)
                if r.finish_reason is None:
                    self._accept(r, toks[i, :c], lps[i, :c], top_ids[i, :c], top_lps[i, :c])
                    self._name(r)
        need = [r for r, samples, _ in rows if samples and r.grammar is not None and r.finish_reason is None]
        for r, live in zip(need, self._fill(need)):
            if not live:  # complete, or a dead end: nothing may follow
                r.finish_reason = "stop"
                self._flush(r)
                self._deliver(r, [], [])

    def _accept(self, r: Request, toks, lps, top_ids, top_lps) -> None:
        """Appends sampled tokens (until a stop), detokenizes, delivers an update, finishes if done."""
        if r.first_token_at is None:
            r.first_token_at = time.monotonic()
        new, info = [], []
        for j, tok in enumerate(int(t) for t in toks):
            if tok in r.stop_ids and not r.ignore_eos:
                r.finish_reason = "stop"
                break
            if r.grammar is not None and not r.grammar.accept(tok):  # (the mask allowed only what it accepts)
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
        if r.finish_reason is not None:
            self._flush(r)
        self._deliver(r, new, info)

    def _flush(self, r: Request) -> None:
        """A finished request's trailing partial character, as the tokenizer renders it."""
        if self.detokenize is not None and r.offsets[1] < len(r.out):
            lo, mid = r.offsets
            r.text += self.detokenize(r.out[lo:])[len(self.detokenize(r.out[lo:mid])):]

    def _fill(self, reqs: list[Request]) -> list[bool]:
        """Constrained sequences' next masks (structured.Grammar.fill, one after another: llguidance's
        thread pool took 3x as long for 16 rows on this 2-core CPU), timed for /metrics; False for one where no
        token may follow (its constraint complete or at a dead end; before min_tokens, stop ids do not count)."""
        if not reqs:
            return []
        t = time.perf_counter()
        out = [r.grammar.fill() for r in reqs]
        for k, r in enumerate(reqs):
            if out[k] and len(r.out) < r.min_tokens and not r.ignore_eos:
                bits = r.grammar.mask.view(np.uint32)
                for i in (i for i in r.stop_ids if i < 32 * len(bits)):
                    bits[i // 32] &= ~np.uint32(1 << (i % 32))
                out[k] = bool(bits.any())
        self.masks, self.mask_seconds = self.masks + len(reqs), self.mask_seconds + time.perf_counter() - t
        return out

    def _extend_text(self, r: Request) -> bool:
        """Incremental detokenization (a window of tokens, so a tokenizer's word-initial spaces come out
        right); True when a stop string appeared (text cut before it, its tokens dropped)."""
        lo, mid = r.offsets
        before = self.detokenize(r.out[lo:mid])
        now = self.detokenize(r.out[lo:])
        if len(now) > len(before) and not now.endswith("\ufffd"):  # wait for a whole character
            r.text += now[len(before):]
            r.offsets = (mid, len(r.out))
        start, r.checked = r.checked, len(r.text)
        if len(r.out) <= r.min_tokens:  # a stop string completed by the first min_tokens tokens does not count
            return False
        hits = [i for i in (r.text.find(s, max(0, start - len(s) + 1)) for s in r.stop_strings) if i >= 0]
        if not hits:
            return False
        cut = min(hits)
        r.text, r.finish_reason = r.text[:cut], "stop"
        while r.out and any(self.detokenize(r.out).find(s, cut) >= 0 for s in r.stop_strings):
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
        """Returns the request's slot and pages. A step already dispatched may still write them; the device
        runs steps in order, so whoever gets them next writes after it."""
        r.finished_at, r.lookup = time.monotonic(), None
        if r.slot >= 0:
            self._name(r)
            self.pool.release(r.slot)
            self.free_slots.append(r.slot)
            r.slot = -1
            self.running.remove(r)

    # -- compile everything up front --
    def shapes(self) -> tuple[int, ...]:
        """The token buckets: one compiled step program each."""
        return self.runner.buckets

    def programs(self, structured: bool = False) -> list[tuple[int, str]]:
        """(bucket, kind) of every program a step can run, by bucket: "step"; with `structured`, "split" (the two
        programs of a step with structured-output masks); with speculation "verify"; for Gated DeltaNet models
        "decode" in each bucket a decode step can take."""
        decode = self.runner.has_decode_program
        return [(t, kind) for t in self.shapes() for kind in ("step", "split", "verify", "decode")
                if kind == "step" or kind == "split" and structured or kind == "verify" and self.speculative is not None
                or kind == "decode" and decode and t <= self.runner.bucket(self.runner.max_num_seqs)]

    def warmup(self, progress: Callable[[int, int], None] | None = None, structured: bool = False,
               ahead: bool = False) -> list[tuple[int, str]]:
        """Runs the programs of `programs(structured)` once each on padding (writes only the scratch page), so
        that no step compiles later. `ahead`: only the smallest bucket's, the step budget held to that bucket;
        returns the rest, for `compile_ahead` (a server is ready after the first bucket)."""
        runs = self.programs(structured)
        now = [x for x in runs if x[0] == runs[0][0]] if ahead else runs
        for i, (t, kind) in enumerate(now):
            batch = self.runner.empty(t)
            if kind == "verify":
                batch["drafts"][0] = 1  # the verifying program (on padding: the scratch page)
            jax.block_until_ready(self.runner.run_split(batch, lambda: batch["sampling"]) if kind == "split" else
                                  self.runner.run(batch, head=kind == "verify", decode=kind == "decode"))
            if progress is not None:
                progress(i + 1, len(now))
        if ahead:
            self.budget = min(self.budget, runs[0][0])
        return runs[len(now):]

    def compile_ahead(self, rest: list[tuple[int, str]], progress: Callable[[int, int], None] | None = None,
                      quiet: float = 0.5, patience: float = 2.0, stop: threading.Event | None = None) -> None:
        """Compiles the programs `rest` (`warmup(ahead=True)`'s) bucket by bucket, smallest first, without running
        them (on another thread than `run`'s); after each bucket's last one the step budget grows to that bucket,
        so a step never takes a bucket not yet compiled (a longer prompt meanwhile runs in chunks). Each
        program waits until the engine has been idle for `quiet` seconds or busy for `patience`: tracing a
        program holds the interpreter, and a compile the cores, which made a first request's 16 tokens 6x
        slower (0.44 against 0.07 s on this 2-core CPU); a load that lasts gets the larger buckets anyway.
        `stop` set: returns before the next program (a server shutting down)."""
        stop = stop or threading.Event()
        for i, (t, kind) in enumerate(rest):
            while time.monotonic() - self.since[1] < (patience if self.since[0] else quiet) and not stop.is_set():
                time.sleep(0.01)
            if stop.is_set():
                return
            self.runner.compile(t, kind)
            if i + 1 == len(rest) or rest[i + 1][0] != t:
                self.budget = min(self.runner.max_num_batched_tokens, t)
            if progress is not None:
                progress(i + 1, len(rest))

def generate(runner: Runner, prompt: list[int], max_tokens: int, sampling: Sampling = Sampling(),
             stop_ids: tuple[int, ...] = (), stop_strings: tuple[str, ...] = (), decode=None,
             on_update: Callable[[Update], None] | None = None, engine: Engine | None = None) -> list[int]:
    """Generates up to max_tokens after `prompt` (one sequence, through the same engine as the server).

    Stops at a stop id (not included), or once the text (`decode(ids)`; needed for stop strings) contains a
    stop string: the text is cut before it and the tokens that complete it are dropped. `on_update` sees the
    text as it grows. `engine`: the Engine to run it on (speculative decoding, its counts); default a plain
    one.
    """
    engine = engine or Engine(runner, decode=decode)
    req = engine.submit(Request(list(prompt), max_tokens, sampling, frozenset(stop_ids), tuple(stop_strings),
                                on_update=on_update))
    while engine.busy():
        engine.step()
    return req.out
