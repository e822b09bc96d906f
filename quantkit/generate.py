"""`quantkit generate`: one completion of a prompt, through the engine that serves (runtime/engine.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from quantkit.runtime.loader import LoadedModel


@dataclass
class Generation:
    """What `generate` produced, with its timings (seconds)."""

    text: str  # the completion, cut before a stop string
    tokens: list[int]  # its token ids (a stop id, or the tokens completing a stop string, not included)
    prompt_tokens: int
    finish_reason: str  # "stop" or "length"
    load_seconds: float  # tokenizer, weights and KV cache
    first_token_seconds: float  # from the prompt's submission to its first token (prefill, and compiling)
    seconds: float  # from the prompt's submission to the end
    speculative: dict | None = None  # speculative decoding's counts (`speculative_counts`)

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: the tokens after the first over the time after it."""
        later = self.seconds - self.first_token_seconds
        return (len(self.tokens) - 1) / later if len(self.tokens) > 1 and later > 0 else 0.0

    def report(self) -> dict:
        """`generate --json`'s document."""
        return {"text": self.text, "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
                "finish_reason": self.finish_reason, "load_seconds": round(self.load_seconds, 3),
                "first_token_seconds": round(self.first_token_seconds, 3), "seconds": round(self.seconds, 3),
                "tokens_per_second": round(self.tokens_per_second, 2), "speculative": self.speculative}


def speculative_counts(engine) -> dict | None:
    """An engine's speculative decoding so far: method, k, rows verified with drafts, drafts, accepted ones
    (rate, by position) and tokens a drafted step yields on average (accepted + 1)."""
    spec = engine.speculative
    if spec is None:
        return None
    return {"method": spec.method, "num_speculative_tokens": spec.k, "drafts": engine.drafts,
            "draft_tokens": engine.draft_tokens, "accepted_tokens": engine.accepted,
            "acceptance_rate": engine.accepted / engine.draft_tokens if engine.draft_tokens else 0.0,
            "accepted_per_position": list(engine.accepted_at),
            "mean_tokens_per_step": 1 + engine.accepted / engine.drafts if engine.drafts else 1.0}


def devices(mesh) -> str:
    """Where the weights are: "cpu", or e.g. "4 tpu devices in 2 processes"."""
    if mesh is None:
        return jax.default_backend()
    procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    return f"{mesh.devices.size} {jax.default_backend()} devices{procs}"


def generate(path: str | Path, prompt: str, max_tokens: int = 128, *, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int = 0, chat: bool = False, stop: Sequence[str] = (), max_model_len: int = 2048,
             kv_cache_dtype: str = "auto", tp: int = 1, ep: bool = False, dp: int = 1, distributed=(None, None, None),
             dtype=jnp.bfloat16, on_text: Callable[[str], None] | None = None,
             on_loaded: Callable[[LoadedModel, str], None] | None = None, speculative=None) -> Generation | None:
    """Loads the checkpoint at `path` with the JAX runtime and completes `prompt`.

    Args:
        path: checkpoint directory (dense or compressed-tensors) with its tokenizer.
        max_tokens: tokens to generate at most; it also stops at the model's end-of-sequence tokens.
        temperature, top_p, top_k, seed: sampling (greedy at temperature 0).
        chat: wrap the prompt as a user message in the checkpoint's chat template.
        stop: strings that end the completion (cut before them).
        max_model_len: KV cache length (prompt + output), at most the model's.
        kv_cache_dtype: as serve's (runtime/cache.py).
        tp, ep: devices to split the model over; MoE experts split whole (runtime/sharding.py).
        dp: data-parallel devices instead (each with the weights but its experts, and its own sequences).
        distributed: (coordinator address, number of processes, process id) of a multi-process run.
        dtype: activation and dense-weight dtype (float32 for parity tests).
        on_text: receives the completion's text as it grows.
        on_loaded: receives (the LoadedModel, `devices(mesh)`) once the weights are placed.
        speculative: a runtime/speculative.SpeculativeConfig (speculative decoding), or None.
    Returns:
        the Generation; None on a process other than the first of a multi-process run, which runs the steps
        the first one schedules.
    """
    from quantkit.runtime.engine import Engine, Runner, Sampling, enable_compilation_cache, generate as run
    from quantkit.runtime.loader import load
    from quantkit.runtime.speculative import drafter_for
    from quantkit.runtime.sharding import start
    from quantkit.runtime.tokenizer import TextCodec

    t0 = time.monotonic()
    codec = TextCodec(path)
    enable_compilation_cache()
    mesh = start(tp, *distributed, dp=dp)
    model = load(path, dtype=dtype, mesh=mesh, ep=ep, dp=dp > 1, mtp=speculative is not None and speculative.method == "mtp")
    leader = jax.process_index() == 0
    if leader and on_loaded is not None:
        on_loaded(model, devices(mesh))
    text = codec.chat([{"role": "user", "content": prompt}]) if chat else prompt
    ids = codec.encode(text, special=not chat)  # a chat template writes its own special tokens
    stop_ids = tuple(i for i in (*model.cfg.eos_token_ids, codec.token_id("eos_token")) if i is not None)
    runner = Runner(model, max_model_len=min(max_model_len, model.cfg.max_position_embeddings), max_num_seqs=dp,
                    kv_cache_dtype=kv_cache_dtype, speculative=speculative.k if speculative else 0,
                    drafter=drafter_for(speculative, model))
    if not leader:
        runner.follow()
        return None
    updates = []  # (seconds since submission, Update)

    def update(u) -> None:
        updates.append((time.monotonic() - t1, u))
        if on_text is not None and u.text:
            on_text(u.text)

    engine = Engine(runner, decode=codec.decode, speculative=speculative)
    t1 = time.monotonic()
    try:
        tokens = run(runner, ids, max_tokens, Sampling(temperature, top_k, top_p, seed), stop_ids=stop_ids,
                     stop_strings=tuple(stop), on_update=update, engine=engine)
    finally:
        runner.stop()
    seconds = time.monotonic() - t1
    return Generation(text="".join(u.text for _, u in updates), tokens=tokens, prompt_tokens=len(ids),
                      finish_reason=updates[-1][1].finish_reason, load_seconds=t1 - t0,
                      first_token_seconds=next((s for s, u in updates if u.tokens), seconds), seconds=seconds,
                      speculative=speculative_counts(engine))
