"""`quantkit serve`: OpenAI-compatible HTTP routes (Starlette + uvicorn) over one continuous-batching Engine.

Threads: uvicorn's event loop answers HTTP; one engine thread runs `Engine.run`, calling each request's
`on_update`, which queues the update for the loop (one `call_soon_threadsafe` per engine iteration). A
streaming response merges every update waiting in its queue into one SSE chunk per choice, so a slow client
costs one chunk per wake-up, not one per token. The model loads and compiles in a background thread while
/health already answers; /ready and the /v1 routes wait for it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import socket
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from quantkit.errors import InvalidInput
from quantkit.runtime.config import MAX_NUM_BATCHED_TOKENS
from quantkit.runtime.engine import TOP_LOGPROBS, Engine, QueueFull, Request, Runner, Sampling, Update
from quantkit.runtime.structured import COMPACT, KINDS, Constraints
from quantkit.runtime.tools import call, held, parse, required_schema

log = logging.getLogger("quantkit.serve")
MAX_BODY = 8 << 20  # bytes of JSON a request may send
MAX_N = 128  # choices per prompt (OpenAI's limit)
MIN_LOGPROB = -9999.0  # a token a structured-output mask excludes has -inf; JSON has no infinity (vLLM's floor)


class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


# ---- metrics ---------------------------------------------------------------------------------------------

LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Twin:
    """One metric under quantkit's name and under vLLM's (labelled model_name, as vLLM labels it)."""

    def __init__(self, kind, name: str, help_: str, registry: CollectorRegistry, model: str, **kw):
        self.both = (kind(f"quantkit_{name}", help_, registry=registry, **kw),
                     kind(f"vllm:{name}", help_, ["model_name"], registry=registry, **kw).labels(model))

    def inc(self, v: float) -> None:
        for m in self.both:
            m.inc(v)

    def observe(self, v: float) -> None:
        for m in self.both:
            m.observe(v)


class Metrics:
    """The server's Prometheus metrics, in a registry of its own: quantkit's names, and vLLM's where vLLM
    has one, so that vLLM's dashboards work unchanged. Sequences count one by one (a request with n
    choices or several prompts is several sequences, as in vLLM); HTTP requests count by route and status."""

    def __init__(self, server: "Server"):
        self.server, model = server, server.name
        self.registry = r = CollectorRegistry()
        self.requests = Counter("quantkit_requests", "Finished HTTP requests by route and status.",
                                ["route", "status"], registry=r)
        self.prompt_tokens = _Twin(Counter, "prompt_tokens", "Prompt tokens processed.", r, model)
        self.generation_tokens = _Twin(Counter, "generation_tokens", "Tokens generated.", r, model)
        self.ttft = _Twin(Histogram, "time_to_first_token_seconds", "Arrival to first token.", r, model,
                          buckets=LATENCY)
        self.tpot = _Twin(Histogram, "time_per_output_token_seconds", "Mean time between output tokens.", r, model,
                          buckets=LATENCY)
        self.e2e = _Twin(Histogram, "e2e_request_latency_seconds", "Arrival to last token.", r, model,
                         buckets=LATENCY)
        self.success = Counter("vllm:request_success", "Finished sequences by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        r.register(self)  # `collect`: the engine's state, read at each scrape

    def finished(self, req: Request, end: float) -> None:
        n = len(req.out)
        self.prompt_tokens.inc(len(req.prompt))
        self.generation_tokens.inc(n)
        if req.first_token_at is not None:
            self.ttft.observe(req.first_token_at - req.arrived)
            if n > 1:
                self.tpot.observe((end - req.first_token_at) / (n - 1))
        self.e2e.observe(end - req.arrived)
        self.success.labels(self.server.name, req.finish_reason or "abort").inc()

    def collect(self):
        e, model = self.server.engine, self.server.name
        used, total = (e.pages_used, e.pool.total) if e else (0, 0)
        for kind, name, v, help_, vllm in (
                (GaugeMetricFamily, "num_requests_running", len(e.running) if e else 0, "Sequences holding a slot.",
                 ["num_requests_running"]),
                (GaugeMetricFamily, "num_requests_waiting", len(e.waiting) if e else 0,
                 "Sequences queued for a slot.", ["num_requests_waiting"]),
                (GaugeMetricFamily, "programs_compiled", self.server.programs[0],
                 "Step programs compiled (a ready server compiles its larger token buckets while it serves).", []),
                (GaugeMetricFamily, "programs", self.server.programs[1], "Step programs the server runs.", []),
                (GaugeMetricFamily, "kv_pages_used", used, "KV cache pages in use.", []),
                (GaugeMetricFamily, "kv_pages_total", total, "KV cache pages.", []),
                (GaugeMetricFamily, "kv_pages_cached", e.pool.cached_pages if e else 0,
                 "KV cache pages holding a cached prefix (in use or idle).", []),
                (GaugeMetricFamily, "kv_cache_usage", used / total if total else 0.0,
                 "Fraction of KV cache pages in use (1 = 100%).", ["kv_cache_usage_perc", "gpu_cache_usage_perc"]),
                (GaugeMetricFamily, "prefix_state_snapshots", len(e.pool.snaps) if e else 0,
                 "Gated DeltaNet state snapshots kept for prefix caching.", []),
                (GaugeMetricFamily, "prefix_state_snapshot_slots", e.pool.layout.snapshots if e else 0,
                 "Gated DeltaNet state snapshot slots (the most snapshots kept).", []),
                (GaugeMetricFamily, "prefix_state_snapshot_bytes", e.snapshot_bytes if e else 0,
                 "Device bytes of the Gated DeltaNet state snapshot slots (all layers, all of them).", []),
                (CounterMetricFamily, "prefix_cache_queries", e.prefix_queries if e else 0,
                 "Prompt tokens looked up in the prefix cache.", ["prefix_cache_queries"]),
                (CounterMetricFamily, "prefix_cache_hits", e.prefix_hits if e else 0,
                 "Prompt tokens found in the prefix cache (not recomputed).", ["prefix_cache_hits"]),
                (CounterMetricFamily, "structured_requests", e.constrained if e else 0,
                 "Sequences under a structured-output constraint (response_format, structured_outputs).", []),
                (CounterMetricFamily, "structured_masks", e.masks if e else 0,
                 "Structured-output token masks computed (one per constrained sequence a step).", []),
                (CounterMetricFamily, "structured_mask_steps", e.mask_steps if e else 0,
                 "Engine steps that computed at least one structured-output mask.", []),
                (CounterMetricFamily, "structured_mask_seconds", e.mask_seconds if e else 0.0,
                 "Host seconds spent computing structured-output masks (per step: divide by structured_mask_steps).",
                 []),
                (CounterMetricFamily, "engine_steps", e.steps if e else 0, "Steps the engine dispatched.", []),
                (CounterMetricFamily, "engine_host_seconds", e.host_seconds if e else 0.0,
                 "Host seconds the engine spent scheduling, dispatching and delivering, read-back waits left out "
                 "(per step: divide by engine_steps).", []),
                (CounterMetricFamily, "engine_readback_wait_seconds", e.wait_seconds if e else 0.0,
                 "Seconds the engine waited for a step's outputs: the device still running it (where ~0, the "
                 "device waited for the host).", []),
                (CounterMetricFamily, "engine_readbacks_ready", e.ready_readbacks if e else 0,
                 "Read-backs that found their step already finished: only before the next of those steps can the "
                 "device have idled (the engine dispatches a step before reading the previous one back).", []),
                (CounterMetricFamily, "spec_decode_num_drafts", e.drafts if e else 0,
                 "Speculative decoding: sequence rows verified with drafts.", ["spec_decode_num_drafts"]),
                (CounterMetricFamily, "spec_decode_num_draft_tokens", e.draft_tokens if e else 0,
                 "Speculative decoding: draft tokens verified.", ["spec_decode_num_draft_tokens"]),
                (CounterMetricFamily, "spec_decode_num_accepted_tokens", e.accepted if e else 0,
                 "Speculative decoding: draft tokens accepted.", ["spec_decode_num_accepted_tokens"])):
            yield kind(f"quantkit_{name}", help_, value=v)
            for alias in vllm:
                family = kind(f"vllm:{alias}", help_, labels=["model_name"])
                family.add_metric([model], v)
                yield family
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative decoding: draft tokens accepted, by position in the draft.",
                                      labels=["model_name", "position"])
        for j, v in enumerate(e.accepted_at if e else []):
            per_pos.add_metric([model, str(j)], v)
        yield per_pos


# ---- request parsing -------------------------------------------------------------------------------------

def _field(body: dict, name: str, kinds: tuple, default=None, ok=None, rule: str = ""):
    """body[name] checked for type (bool is never a number) and range; ApiError 400 naming the field."""
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ApiError(400, f"'{name}' must be {names}, got {type(v).__name__}", param=name)
    if ok is not None and not ok(v):
        raise ApiError(400, f"'{name}' {rule}, got {v!r}", param=name)
    return v


@dataclass
class Params:
    prompts: list[tuple[list[int], str]]  # (token ids, text) of each prompt
    n: int  # choices per prompt; choice i of each draws with seed + i
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    logprobs: int | None
    stream: bool
    include_usage: bool
    echo: bool
    min_tokens: int
    ignore_eos: bool
    grammar: str | None = None  # the structured-output constraint, as llguidance's grammar (structured.py)
    tools: list | None = None  # chat: the request's tools, and tool_choice's mode (runtime/tools.py):
    tool_mode: str | None = None  # "auto", "required" or a function's name; None: no tool calls parsed


# ---- the server ------------------------------------------------------------------------------------------

class Server:
    def __init__(self, path: Path, served_model_name: str | None = None, max_model_len: int | None = None,
                 max_num_seqs: int = 16, api_key: str | None = None,
                 max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
                 max_waiting: int = 256, enable_prefix_caching: bool = True, kv_cache_dtype: str = "auto",
                 mesh=None, ep: bool = False, speculative=None, dp: bool = False, load_format: str = "auto"):
        self.prefix_caching, self.kv_cache_dtype = enable_prefix_caching, kv_cache_dtype
        self.load_format = load_format  # "auto": the checkpoint's weights; "dummy": random ones (loader.dummy)
        self.speculative = speculative  # runtime/speculative.SpeculativeConfig, or None
        self.mesh, self.ep, self.dp = mesh, ep, dp  # runtime/sharding.py (dp: the mesh is data parallel)
        self.path, self.name = Path(path), served_model_name or Path(path).name
        self.max_model_len, self.max_num_seqs, self.api_key = max_model_len, max_num_seqs, api_key
        self.max_num_batched_tokens, self.max_waiting = max_num_batched_tokens, max_waiting
        self.engine: Engine | None = None
        self.engine_thread: threading.Thread | None = None
        self.programs = [0, 0]  # step programs compiled, of all the server runs
        self.compile_thread: threading.Thread | None = None  # compiling the rest while serving (`_compile_ahead`)
        self.started = int(time.time())  # /v1/models' `created`
        self.codec = None
        self.status = "starting"
        self.failed: str | None = None
        self.metrics = Metrics(self)
        self.stop = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lock, self._pending, self._scheduled = threading.Lock(), [], False  # updates for the loop
        self.on_failure = None  # called (on the loader thread) when loading fails
        self.app = Starlette(routes=[
            Route("/health", self.health), Route("/ready", self.ready), Route("/metrics", self.prometheus),
            Route("/v1/models", self.models), Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"])], lifespan=self._lifespan)

    # -- start-up: load, compile every shape, then start the engine thread --
    def runner(self):
        """(model, Runner) as the flags say; every process of a multi-process run builds the same."""
        from quantkit.runtime.engine import enable_compilation_cache
        from quantkit.runtime.loader import dummy, load
        from quantkit.runtime.speculative import drafter_for

        enable_compilation_cache()
        model = dummy(self.path) if self.load_format == "dummy" else \
            load(self.path, mesh=self.mesh, ep=self.ep, dp=self.dp,
                 mtp=self.speculative is not None and self.speculative.method == "mtp")
        limit = min(self.max_model_len or 2048, model.cfg.max_position_embeddings)
        return model, Runner(model, max_model_len=limit, max_num_seqs=self.max_num_seqs,
                             max_num_batched_tokens=self.max_num_batched_tokens, kv_cache_dtype=self.kv_cache_dtype,
                             speculative=self.speculative.k if self.speculative else 0,
                             drafter=drafter_for(self.speculative, model),
                             # Gated DeltaNet models: a state snapshot slot a sequence for prefix caching
                             prefix_states=self.max_num_seqs if self.prefix_caching and model.cfg.linear_layers
                             else 0)

    def load(self) -> None:
        import jax

        from quantkit.runtime.tokenizer import TextCodec

        try:
            t0 = time.monotonic()
            self.status = "loading weights"
            self.codec = TextCodec(self.path)
            model, runner = self.runner()
            limit = runner.max_model_len
            engine = Engine(runner, decode=self.codec.decode, max_waiting=self.max_waiting,
                            prefix_caching=self.prefix_caching, speculative=self.speculative)
            self.stop_ids = frozenset(i for i in (*model.cfg.eos_token_ids, self.codec.token_id("eos_token"))
                                      if i is not None)
            self.vocab = model.cfg.vocab_size
            self.constraints = Constraints(self.path / "tokenizer.json", self.vocab, self.stop_ids)

            def progress(done: int, total: int) -> None:
                self.status = f"compiling {done}/{total} shapes"

            # one process: ready after the smallest bucket's programs, the rest compiled while serving (several
            # processes run every step together and compile each program on first use, all of them at once)
            one = jax.process_count() == 1
            structured = one and not self.dp
            rest = engine.warmup(progress, structured=structured, ahead=one)
            total = len(engine.programs(structured))
            self.programs = [total - len(rest), total]
            self.engine_thread = threading.Thread(target=engine.run, args=(self.stop,), name="engine", daemon=True)
            self.engine_thread.start()
            self.engine, self.status = engine, "ready"
            if rest:
                self.compile_thread = threading.Thread(target=self._compile_ahead, args=(engine, rest, t0),
                                                       name="compile", daemon=True)
                self.compile_thread.start()
            r = engine.runner
            each = r.max_num_seqs // r.dp
            devices = "1 device" if r.mesh is None else f"{r.dp} devices, data parallel ({each} sequence" \
                f"{'s' if each > 1 else ''} each)" if r.dp > 1 else f"{r.tp} devices"
            devices += " (experts split whole)" if r.ep and r.mesh is not None else ""
            log.warning("ready in %.1f s: %s on %s, max_model_len %d, max_num_seqs %d, KV cache %s, prefix caching "
                        "%s, %d token buckets (%s)",
                        time.monotonic() - t0, self.name, devices, limit,
                        self.max_num_seqs, r.kv_dtype, ("on" if not r.layout.snapshots else
                        f"on (Gated DeltaNet states: {r.layout.snapshots} snapshots at page-aligned prompt chunk "
                        "ends)") if engine.prefix_caching else
                        "off (Gated DeltaNet states: one process only)" if self.prefix_caching else "off",
                        len(engine.shapes()), "for structured outputs each also as two halves" if not self.speculative
                        else f"each verifying up to {self.speculative.k} {self.speculative.method} drafts a sequence")
            if rest:
                log.warning("%d of %d programs compiled (steps of up to %d tokens until more are); the rest compile "
                            "while serving (/ready, /metrics: quantkit_programs_compiled)", *self.programs,
                            engine.budget)
        except Exception as e:  # noqa: BLE001 - reported as one line, the process then exits 1
            self.failed = f"{type(e).__name__}: {e}" if not isinstance(e, InvalidInput) else str(e)
            self.status = "failed"
            log.error("error: cannot serve %s: %s", self.path, self.failed)
            if self.on_failure is not None:
                self.on_failure()

    def _compile_ahead(self, engine: Engine, rest: list, t0: float) -> None:
        """The programs the ready server did not compile yet (engine.compile_ahead), on this thread."""
        done = self.programs[0]
        try:
            engine.compile_ahead(rest, lambda i, n: self.programs.__setitem__(0, done + i), stop=self.stop)
            if not self.stop.is_set():
                log.warning("all %d programs compiled, %.1f s after start", self.programs[1], time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - the budget stays where it is; serving goes on
            log.error("compiling ahead stopped: %s: %s (steps stay within %d tokens)", type(e).__name__, e,
                      engine.budget)

    @asynccontextmanager
    async def _lifespan(self, app):
        self.loop = asyncio.get_running_loop()
        threading.Thread(target=self.load, name="loader", daemon=True).start()
        yield
        self.stop.set()  # uvicorn's grace period is over: the engine thread stops

    # -- plain routes --
    async def health(self, request: HttpRequest):
        return JSONResponse({"status": "ok"})

    async def ready(self, request: HttpRequest):
        ok = self.engine is not None
        compiled, total = self.programs
        return JSONResponse({"status": self.status, "programs_compiled": compiled, "programs": total},
                            status_code=200 if ok else 503)

    async def prometheus(self, request: HttpRequest):
        return Response(generate_latest(self.metrics.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: HttpRequest):
        return await self._guarded(request, "/v1/models", self._models)

    async def _models(self, request: HttpRequest):
        limit = self.engine.runner.max_model_len
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model", "created": self.started,
                                                        "owned_by": "quantkit", "max_model_len": limit}]})

    async def completions(self, request: HttpRequest):
        return await self._guarded(request, "/v1/completions", lambda r: self._generate(r, chat=False))

    async def chat(self, request: HttpRequest):
        return await self._guarded(request, "/v1/chat/completions", lambda r: self._generate(r, chat=True))

    async def _guarded(self, request: HttpRequest, route: str, handler):
        """Auth, readiness and error bodies for every /v1 route; counts the status."""
        try:
            if self.api_key is not None:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                    raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                                   code="invalid_api_key")
            if self.engine is None:
                raise ApiError(503, f"not ready yet ({self.status}); poll GET /ready", kind="service_unavailable")
            response = await handler(request)
        except ApiError as e:
            response = e.response()
        except Exception as e:  # noqa: BLE001 - never a traceback to the client
            log.error("internal error on %s: %s: %s", route, type(e).__name__, e)
            response = ApiError(500, f"internal error: {type(e).__name__}", kind="internal_error").response()
        self.metrics.requests.labels(route, response.status_code).inc()
        return response

    # -- generation --
    async def _body(self, request: HttpRequest) -> dict:
        if int(request.headers.get("content-length") or 0) > MAX_BODY:
            raise ApiError(413, f"request body over {MAX_BODY >> 20} MiB")
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise ApiError(413, f"request body over {MAX_BODY >> 20} MiB")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    def _params(self, body: dict, chat: bool) -> Params:
        model = _field(body, "model", (str,))
        if model is None:
            raise ApiError(400, "'model' is required", param="model")
        if model != self.name:
            raise ApiError(404, f"model '{model}' does not exist; this server serves '{self.name}'",
                           param="model", code="model_not_found")
        n = _field(body, "n", (int,), 1, lambda v: 1 <= v <= MAX_N, f"must be in [1, {MAX_N}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if _field(body, name, (int, float), 0) != 0:
                raise ApiError(400, f"'{name}' is not supported", param=name)
        tools, tool_mode = self._tools(body) if chat else (None, None)
        if chat:
            effort = _field(body, "reasoning_effort", (str,), None, lambda v: v in ("low", "medium", "high"),
                            "must be low, medium or high")
            text = self._render_chat(body.get("messages"), **({"reasoning_effort": effort} if effort else {}),
                                     **({"tools": tools} if tools else {}))
            prompts = [(self.codec.encode(text, special=False), text)]
        else:
            prompts = self._prompts(body.get("prompt"))
        longest = max(len(ids) for ids, _ in prompts)
        limit = self.engine.runner.max_model_len
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        name = next((k for k in names if body.get(k) is not None), "max_tokens")
        max_tokens = _field(body, name, (int,), max(limit - longest, 1) if chat else 16, lambda v: v >= 1,
                            "must be at least 1")
        if longest + max_tokens > limit:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens, but {longest} "
                                f"prompt tokens + {max_tokens} {name} = {longest + max_tokens}; shorten the "
                                f"prompt or lower {name}", param=name)
        min_tokens = _field(body, "min_tokens", (int,), 0, lambda v: 0 <= v <= max_tokens,
                            f"must be in [0, {name}={max_tokens}]")
        temperature = _field(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "must be in [0, 2]")
        top_p = _field(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "must be in (0, 1]")
        top_k = _field(body, "top_k", (int,), 0, lambda v: v >= -1, "must be -1, 0 (off) or positive")
        seed = _field(body, "seed", (int,), None)
        stop = _field(body, "stop", (str, list), [])
        stop = [stop] if isinstance(stop, str) else stop
        if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(400, "'stop' must be a non-empty string or a list of at most 4 of them", param="stop")
        if chat:
            want = _field(body, "logprobs", (bool,), False)
            top = _field(body, "top_logprobs", (int,), 0, lambda v: 0 <= v <= TOP_LOGPROBS,
                         f"must be in [0, {TOP_LOGPROBS}]")
            logprobs = top if want else None
            echo = False
        else:
            logprobs = _field(body, "logprobs", (int,), None, lambda v: 0 <= v <= TOP_LOGPROBS,
                              f"must be in [0, {TOP_LOGPROBS}]")
            echo = _field(body, "echo", (bool,), False)
        options = _field(body, "stream_options", (dict,), {})
        grammar = self._constraint(body)
        if tool_mode not in (None, "auto"):  # required / a named function: the grammar writes the call
            if grammar is not None:
                raise ApiError(400, f"tool_choice {tool_mode!r} writes the answer as tool calls; drop "
                                    "'response_format' / 'structured_outputs'", param="tool_choice")
            schema = required_schema(tools) if tool_mode == "required" else next(
                t["function"].get("parameters") or {"type": "object"} for t in tools
                if t["function"]["name"] == tool_mode)
            grammar = self._compiled("json", schema, "tools")
        return Params(prompts, n, max_tokens,
                      Sampling(float(temperature), max(top_k, 0), float(top_p),
                               seed if seed is not None else uuid.uuid4().int & 0xFFFFFFFF),
                      tuple(stop), logprobs, _field(body, "stream", (bool,), False),
                      bool(options.get("include_usage")), echo, min_tokens, _field(body, "ignore_eos", (bool,), False),
                      grammar, tools, tool_mode)

    def _tools(self, body: dict) -> tuple[list | None, str | None]:
        """The chat request's `tools` (OpenAI's function tools, checked) and the mode its `tool_choice` asks
        for: "auto" (the default with tools), "required", a function's name, or None ("none", or no tools)."""
        tools = _field(body, "tools", (list,), None)
        choice = body.get("tool_choice")
        if not tools:
            if choice not in (None, "none"):
                raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
            return None, None
        for t in tools:
            f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"] or not isinstance(
                    f.get("parameters", {}), (dict, type(None))):
                raise ApiError(400, "each tool must be {\"type\": \"function\", \"function\": {\"name\", "
                                    "\"description\", \"parameters\": a JSON schema}}", param="tools")
        names = [t["function"]["name"] for t in tools]
        if choice is None or choice in ("auto", "required"):
            return tools, choice or "auto"
        if choice == "none":
            return tools, None
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or name not in names:
            raise ApiError(400, f"'tool_choice' must be none, auto, required or {{\"type\": \"function\", "
                                f"\"function\": {{\"name\": one of {names}}}}}", param="tool_choice")
        return tools, name

    def _constraint(self, body: dict) -> str | None:
        """The request's structured-output constraint as llguidance's grammar (compiled once here, so that a
        bad one is a 400 naming its field), from OpenAI's `response_format` or vLLM's `structured_outputs`;
        None without one."""
        fmt = _field(body, "response_format", (dict,), None)
        so = _field(body, "structured_outputs", (dict,), None)
        if fmt is not None and so is not None:
            raise ApiError(400, "give 'response_format' or 'structured_outputs', not both", param="structured_outputs")
        whitespace = COMPACT
        if fmt is not None:
            field, kind = "response_format", fmt.get("type")
            if kind == "text":
                return None
            if kind == "json_object":
                spec = None
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                    raise ApiError(400, "'response_format.json_schema' must be an object with a 'name' and a 'schema' "
                                        "object", param=field)
                kind, spec = "json", spec.get("schema", {})
            else:
                raise ApiError(400, f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                               param=field)
        elif so is not None:
            options = {"disable_any_whitespace", "whitespace_pattern", "disable_fallback",
                       "disable_additional_properties"}
            unknown = sorted(set(so) - set(KINDS) - options)
            if unknown:
                raise ApiError(400, f"'structured_outputs' has unknown keys {unknown}; it takes one of "
                                    f"{', '.join(KINDS)} and options {', '.join(sorted(options))}",
                               param="structured_outputs")
            given = [k for k in KINDS if so.get(k) not in (None, False)]
            if len(given) != 1:
                raise ApiError(400, f"'structured_outputs' needs exactly one constraint of {', '.join(KINDS)}, "
                                    f"got {given or 'none'}", param="structured_outputs")
            kind = given[0]
            field, spec = f"structured_outputs.{kind}", so[kind]
            pattern = so.get("whitespace_pattern")
            if pattern is not None and not isinstance(pattern, str):
                raise ApiError(400, "'structured_outputs.whitespace_pattern' must be a string", param="structured_outputs")
            if pattern is not None:
                whitespace = {"whitespace_flexible": True, "whitespace_pattern": pattern}
            elif so.get("disable_any_whitespace") is False:  # vLLM's default, asked for: any whitespace
                whitespace = {"whitespace_flexible": True}
        else:
            return None
        return self._compiled(kind, spec, field, whitespace)

    def _compiled(self, kind: str, spec, field: str, whitespace: dict | None = None) -> str:
        """llguidance's grammar for a constraint, compiled and cached here (structured.Constraints), so that
        a bad one fails this request alone: a 400 naming `field`."""
        try:
            grammar = self.constraints.grammar(kind, spec, whitespace)
            self.constraints.matcher(grammar)
        except InvalidInput as e:
            raise ApiError(400, f"'{field}' cannot be enforced: {e}", param=field) from None
        return grammar

    def _prompts(self, prompt) -> list[tuple[list[int], str]]:
        """(token ids, text) of each prompt: `prompt` is one (a string or token ids) or a list of them."""
        many = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
        return [self._prompt(p) for p in (prompt if many else [prompt])]

    def _prompt(self, prompt) -> tuple[list[int], str]:
        if isinstance(prompt, str) and prompt:
            return self.codec.encode(prompt), prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            if not all(0 <= t < self.vocab for t in prompt):
                raise ApiError(400, f"prompt token ids must be in [0, {self.vocab})", param="prompt")
            return prompt, self.codec.decode(prompt)
        raise ApiError(400, "'prompt' must be a non-empty string, a non-empty list of token ids, or a list of "
                            "those", param="prompt")

    def _render_chat(self, messages, **options) -> str:
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
        clean = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, "each message needs a 'role' and 'content'", param="messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise ApiError(400, "only text content parts are supported", param="messages")
                content = "".join(p["text"] for p in content)
            calls = m.get("tool_calls") if m["role"] == "assistant" else None
            if content is None and calls:
                content = ""
            if not isinstance(content, str):
                raise ApiError(400, "message 'content' must be a string or text parts", param="messages")
            one = {"role": m["role"], "content": content}
            if calls:  # the template sees each call's arguments as an object (as vLLM passes them)
                one["tool_calls"] = [_template_call(c) for c in calls]
            for key in ("tool_call_id", "name"):  # a tool result's
                if isinstance(m.get(key), str):
                    one[key] = m[key]
            clean.append(one)
        try:
            return self.codec.chat(clean, **options)
        except InvalidInput as e:
            raise ApiError(400, str(e), param="messages") from None

    async def _generate(self, request: HttpRequest, chat: bool):
        p = self._params(await self._body(request), chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        queue: asyncio.Queue = asyncio.Queue()  # (choice index, update)
        reqs = []
        for ids, _ in p.prompts:  # one sequence per choice: choice j answers prompt j // n
            for i in range(p.n):
                j = len(reqs)
                reqs.append(Request(ids, p.max_tokens, replace(p.sampling, seed=p.sampling.seed + i), self.stop_ids,
                                    p.stop, p.logprobs, lambda update, j=j: self._post(queue, (j, update)),
                                    id=f"{rid}-{j}", min_tokens=p.min_tokens, ignore_eos=p.ignore_eos,
                                    grammar=self.constraints.matcher(p.grammar) if p.grammar else None))
        self._submit(reqs)
        shape = _Shape(self, rid, chat, p)
        if p.stream:
            return StreamingResponse(self._stream(reqs, queue, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            updates, live = [[] for _ in reqs], len(reqs)
            while live:
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    self._close(reqs, "client closed")
                    return PlainTextResponse("", status_code=499)
                j, update = get.result()
                updates[j].append(update)
                live -= update.finish_reason is not None
        finally:
            gone.cancel()
        self._close(reqs, "ok")
        return JSONResponse(shape.whole([_merge(us) for us in updates], reqs))

    def _submit(self, reqs: list[Request]) -> None:
        """Queues every sequence of a request, or none (those queued before a refusal are aborted)."""
        for k, req in enumerate(reqs):
            try:
                self.engine.submit(req)
            except (QueueFull, InvalidInput) as e:
                for queued in reqs[:k]:
                    self.engine.abort(queued.id)
                if isinstance(e, QueueFull):
                    raise ApiError(429, str(e), kind="rate_limit_exceeded") from None
                raise ApiError(400, str(e)) from None

    def _post(self, queue: asyncio.Queue, item) -> None:
        """Engine thread: hands an update to the event loop. One loop wake-up carries every update of an
        engine iteration (a wake-up per request was 9% of the engine thread's time at 16 streams)."""
        with self._lock:
            self._pending.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: shutting down
            pass

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for queue, item in pending:
            queue.put_nowait(item)

    async def _stream(self, reqs: list[Request], queue: asyncio.Queue, shape: "_Shape"):
        """SSE chunks, each of one choice: what its waiting updates carry, merged."""
        done = False
        try:
            if shape.chat:
                for j in range(len(reqs)):
                    yield shape.sse(shape.chunk(j, Update("", [], []), role=True))
            live = len(reqs)
            while live:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                by_choice: dict[int, list[Update]] = {}
                for j, update in items:
                    by_choice.setdefault(j, []).append(update)
                for j, updates in sorted(by_choice.items()):
                    u = _merge(updates)
                    c = shape.chunk(j, u)  # every update: gpt-oss's markers carry no text but move its channels
                    choice = c["choices"][0]
                    if (choice["delta"] if shape.chat else choice["text"]) or choice["logprobs"] or u.finish_reason:
                        yield shape.sse(c)
                    live -= u.finish_reason is not None
            done = True
            if shape.p.include_usage:
                yield shape.sse({**shape.head("chunk"), "choices": [], "usage": shape.usage(reqs)})
            yield "data: [DONE]\n\n"
        finally:
            self._close(reqs, "ok" if done else "client closed")

    def _close(self, reqs: list[Request], how: str) -> None:
        """Counts and logs every sequence of a request; aborts those still running (the client went away)."""
        for req in reqs:
            if req.finish_reason is None:
                self.engine.abort(req.id)
            end = req.finished_at or time.monotonic()
            self.metrics.finished(req, end)
            ttft = f"{(req.first_token_at - req.arrived) * 1e3:.0f}" if req.first_token_at else "-"
            log.warning("%s %s prompt=%d completion=%d finish=%s ttft_ms=%s latency_ms=%.0f", req.id, how,
                        len(req.prompt), len(req.out), req.finish_reason, ttft, (end - req.arrived) * 1e3)


def _template_call(c) -> dict:
    """An assistant message's earlier tool call, for the chat template: OpenAI's shape with its arguments
    parsed from their JSON string; 400 when malformed."""
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise ApiError(400, "each tool call needs a 'function' with a 'name' and 'arguments'", param="messages")
    args = f.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise ApiError(400, f"tool call {f['name']!r}: 'arguments' is not JSON", param="messages") from None
    return {"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args},
            "name": f["name"], "arguments": args}


async def _disconnected(request: HttpRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _merge(updates: list[Update]) -> Update:
    return Update("".join(u.text for u in updates), [t for u in updates for t in u.tokens],
                  [x for u in updates for x in u.logprobs], updates[-1].finish_reason)


class _Shape:
    """OpenAI response bodies for one request (completion or chat; whole or chunk). Choice j answers prompt
    j // n (OpenAI's order)."""

    def __init__(self, server: Server, rid: str, chat: bool, p: Params):
        from quantkit.runtime.tokenizer import Channels

        self.server, self.rid, self.chat, self.p = server, rid, chat, p
        # gpt-oss (harmony): each choice's analysis channel is its reasoning_content, the rest its content
        channels = [Channels.of(server.codec) for _ in range(len(p.prompts) * p.n)] if chat else [None]
        self.channels = channels if channels[0] is not None else None
        self.created = int(time.time())
        self.offsets = [len(text) if p.echo else 0 for _, text in p.prompts for _ in range(p.n)]  # text_offset
        # with tools: each choice's tokens so far, how much of their text went out as content, whether it called
        choices = len(p.prompts) * p.n
        self.tokens, self.sent, self.called = [[] for _ in range(choices)], [0] * choices, [False] * choices

    def head(self, kind: str) -> dict:
        obj = {"whole": "chat.completion", "chunk": "chat.completion.chunk"}[kind] if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.server.name}

    @staticmethod
    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    def usage(self, reqs: list[Request]) -> dict:
        """Each prompt counts once, every choice's tokens count (as OpenAI counts them)."""
        prompt, completion = sum(len(ids) for ids, _ in self.p.prompts), sum(len(r.out) for r in reqs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _token(self, t: int) -> str:
        return _token_text(self.server.codec, t)

    def logprobs(self, j: int, entries: list) -> dict | None:
        if self.p.logprobs is None:
            return None
        if self.chat:
            def one(t, lp):
                s = self._token(t)
                return {"token": s, "logprob": max(lp, MIN_LOGPROB), "bytes": list(s.encode())}

            return {"content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]}
                                for t, lp, top in entries]}
        tokens, offsets = [], []
        for t, _, _ in entries:
            tokens.append(self._token(t))
            offsets.append(self.offsets[j])
            self.offsets[j] += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [max(lp, MIN_LOGPROB) for _, lp, _ in entries],
                "top_logprobs": [{self._token(i): max(v, MIN_LOGPROB) for i, v in top} for _, _, top in entries],
                "text_offset": offsets}

    def _choice(self, j: int, u: Update, **content) -> dict:
        finish = "tool_calls" if self.called[j] and u.finish_reason == "stop" else u.finish_reason
        return {"index": j, **content, "logprobs": self.logprobs(j, u.logprobs), "finish_reason": finish}

    def _message(self, j: int, u: Update, stream: bool = True) -> dict:
        """A chat message's (or delta's) fields: content; reasoning_content for gpt-oss; with tools, the
        calls parsed from the finished text (runtime/tools.py; gpt-oss's from its harmony messages,
        tokenizer.Channels), content held back while it may be one."""
        if self.p.tool_mode is not None and (self.channels is None or self.p.tool_mode != "auto"):
            self.tokens[j] += u.tokens  # read with their special tokens (Gemma 4's call marks are some)
            text, sent = self.server.codec.decode(self.tokens[j], special=True), self.sent[j]
            if u.finish_reason is None:  # (a partial character waits)
                self.sent[j] = max(sent, min(held(text, self.p.tool_mode), len(text.rstrip("\ufffd"))))
                return {"content": text[sent:self.sent[j]]} if self.sent[j] > sent else {}
            content, calls = parse(text, self.p.tool_mode, self.p.tools)
            self.called[j] = bool(calls)
            msg = {"content": content[sent:]} if content[sent:] else {}
            if calls:
                msg["tool_calls"] = [{"index": k, **c} if stream else c for k, c in enumerate(calls)]
            return msg
        if self.channels is None:
            return {"content": u.text} if u.text else {}
        channels = self.channels[j]
        reasoning, content = channels.feed(u.tokens, done=u.finish_reason is not None)
        msg = {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": content} if content else {})}
        if u.finish_reason is not None and self.p.tool_mode == "auto":  # gpt-oss's own calls (tokenizer.Channels)
            names = {t["function"]["name"] for t in self.p.tools}
            calls = [call(name, args) for name, args in channels.calls if name in names]
            if calls:
                self.called[j] = True
                msg["tool_calls"] = [{"index": k, **c} if stream else c for k, c in enumerate(calls)]
        return msg

    def chunk(self, j: int, u: Update, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else self._message(j, u)
            choice = self._choice(j, u, delta=delta)
        else:
            choice = self._choice(j, u, text=u.text)
        return {**self.head("chunk"), "choices": [choice]}

    def whole(self, updates: list[Update], reqs: list[Request]) -> dict:
        if self.chat:
            messages = [{"role": "assistant", "content": "", **self._message(j, u, stream=False)} for j, u in
                        enumerate(updates)]
            for m in messages:
                if m.get("tool_calls") and not m["content"]:
                    m["content"] = None
            choices = [self._choice(j, u, message=m) for j, (u, m) in enumerate(zip(updates, messages))]
        else:
            echo = [text if self.p.echo else "" for _, text in self.p.prompts]
            choices = [self._choice(j, u, text=echo[j // self.p.n] + u.text) for j, u in enumerate(updates)]
        return {**self.head("whole"), "choices": choices, "usage": self.usage(reqs)}


@lru_cache(maxsize=65536)
def _token_text(codec, t: int) -> str:
    return codec.decode([t])


def unix_socket(path: str) -> socket.socket:
    """A listening Unix socket at `path`, mode 0600 from its creation. A socket file already there is refused
    while a server answers on it, and replaced when stale (its server gone without removing it); any other
    file is refused. InvalidInput says what to do."""
    import os
    import stat

    def refused(why, do: str = "pick another --uds path") -> InvalidInput:
        return InvalidInput(f"cannot listen on {path}: {getattr(why, 'strerror', None) or why}; {do}")

    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise refused(e) from None
    if mode is not None:
        if not stat.S_ISSOCK(mode):
            raise refused("a file that is not a socket is there")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise refused("another server is listening there", "stop it or pick another --uds path")
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # stale: nothing accepts on it
        except OSError as e:
            raise refused(e) from None
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o177)  # the socket is born 0600: no moment at which others may connect
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise refused(e) from None
    finally:
        os.umask(umask)
    sock.listen(2048)
    return sock


def serve(path: Path, host: str = "127.0.0.1", port: int = 8000, uds: str | None = None, **options) -> int:
    """Runs the server until SIGTERM/SIGINT; returns the exit code (0 after a clean shutdown, 1 when the
    model could not be loaded). `uds`: listen on this Unix socket path instead of host:port (removed at exit).
    `options` go to Server; `grace` (seconds) bounds the drain on shutdown."""
    import uvicorn

    import jax

    from quantkit.formats.hf import Checkpoint
    from quantkit.runtime.sharding import start
    from quantkit.runtime.validate import validate_checkpoint

    grace = options.pop("grace", 30)
    path = Path(path)
    if not (path / "config.json").is_file():
        raise InvalidInput(f"{path}: not a model directory (no config.json)")
    dp = options.pop("dp", 1)
    if options.get("load_format") == "dummy":
        if dp > 1 or options.get("tp", 1) > 1 or options.get("distributed", (None,))[0] or options.get("speculative"):
            raise InvalidInput("--load-format dummy serves on one device without a draft model: drop --tp, "
                               "--data-parallel-size, the multi-host flags and --speculative-config")
    else:  # what the loader would refuse, refused from the headers before the address is announced: one line
        validate_checkpoint(Checkpoint.open(path)).raise_first(path)
    mesh = start(options.pop("tp", 1), *options.pop("distributed", (None, None, None)), dp=dp)
    server = Server(path, mesh=mesh, dp=dp > 1, **options)
    if jax.process_index() > 0:  # process 0 serves HTTP and schedules; this one runs each step it broadcasts
        from quantkit.runtime.tokenizer import TextCodec

        TextCodec(path)  # process 0's checks in its order: a checkpoint it refuses stops every process alike
        server.runner()[1].follow()
        return 0
    if uds is not None:
        sock = unix_socket(uds)
        address = f"unix:{uds}"
    else:
        try:
            sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        except OSError as e:
            raise InvalidInput(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port") from None
        # accepted connections inherit TCP_NODELAY: a stream's small chunks must not wait for the client's
        # delayed ACK (measured: first token 43 ms late without it)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        address = f"http://{host}:{sock.getsockname()[1]}"
    logging.basicConfig(format="%(message)s", stream=sys.stderr)
    print(f"quantkit serve: {address} (model '{server.name}'; GET /ready turns 200 once it is loaded and "
          f"its first programs compiled)", file=sys.stderr, flush=True)
    config = uvicorn.Config(server.app, log_level="warning", access_log=False, timeout_graceful_shutdown=grace,
                            lifespan="on")
    http = uvicorn.Server(config)
    server.on_failure = lambda: setattr(http, "should_exit", True)
    # uvicorn re-raises the signal that stopped it once it is done; a no-op handler makes that a clean exit
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        http.run(sockets=[sock])
    finally:
        if uds is not None:
            Path(uds).unlink(missing_ok=True)
    if server.engine is not None:  # the engine thread has seen `stop`; then the other processes may end
        server.engine_thread.join()
        if server.compile_thread is not None:  # it returns after the program it compiles (exiting mid-compile
            server.compile_thread.join()       # can abort the process)
        server.engine.runner.stop()
    return 1 if server.failed else 0
