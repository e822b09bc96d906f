"""Running a loaded model: paged KV cache, jitted prefill/decode steps over bucketed shapes, sampling,
and a simple generate loop (continuous batching lives in the server's engine, issue 6)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from quantkit.errors import InvalidInput
from quantkit.runtime.loader import LoadedModel
from quantkit.runtime.models import forward_for

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def enable_compilation_cache(directory: str | None = None) -> str:
    """Turns on JAX's persistent compilation cache (default ~/.cache/quantkit/jax, or $QUANTKIT_JAX_CACHE)."""
    directory = directory or os.environ.get("QUANTKIT_JAX_CACHE") or os.path.expanduser("~/.cache/quantkit/jax")
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return directory


def new_cache(model: LoadedModel, num_pages: int, page_size: int) -> list:
    """Per layer (key pages, value pages) [num_pages, page_size, kv_heads, head_dim]; page 0 is scratch."""
    c = model.cfg
    shape = (num_pages, page_size, c.num_kv_heads, c.head_dim)
    return [(jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype)) for _ in range(c.num_layers)]


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_k 0 and top_p 1 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def sample(logits: jax.Array, key: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """One token per row of logits [b, vocab]; traced parameters, so one compilation serves all settings."""
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.sort(scaled, axis=-1)[:, ::-1]
    kth = jnp.where(top_k > 0, order[:, jnp.maximum(top_k - 1, 0)][:, None], -jnp.inf)
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    probs_sorted = jax.nn.softmax(jnp.sort(scaled, axis=-1)[:, ::-1], axis=-1)
    cum = jnp.cumsum(probs_sorted, axis=-1)
    cutoff_idx = jnp.sum(cum < top_p, axis=-1)  # keep the smallest prefix whose mass reaches top_p
    cutoff = jnp.take_along_axis(jnp.sort(scaled, axis=-1)[:, ::-1], cutoff_idx[:, None], axis=-1)
    scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    drawn = jax.random.categorical(key, scaled, axis=-1)
    return jnp.where(temperature <= 0, greedy, drawn)


@dataclass
class Runner:
    """Jitted model steps with a paged cache for up to `max_batch` sequences of `max_model_len` tokens."""

    model: LoadedModel
    max_model_len: int = 2048
    max_batch: int = 1
    page_size: int = 16
    tp: int = 1
    compilations: set = field(default_factory=set)

    def __post_init__(self):
        self.pages_per_seq = -(-self.max_model_len // self.page_size)
        self.cache = new_cache(self.model, 1 + self.max_batch * self.pages_per_seq, self.page_size)
        self.params = self.model.params
        if self.tp > 1:
            from quantkit.runtime.sharding import cache_sharding, make_mesh, shard_params

            mesh = make_mesh(self.tp)
            self.params = shard_params(self.params, self.model.cfg, mesh)
            spec = cache_sharding(self.model.cfg, mesh)
            self.cache = [(jax.device_put(k, spec), jax.device_put(v, spec)) for k, v in self.cache]
        self.block_tables = jnp.asarray(
            1 + np.arange(self.max_batch * self.pages_per_seq).reshape(self.max_batch, self.pages_per_seq), jnp.int32)
        fwd = forward_for(self.model.cfg.family)
        cfg = self.model.cfg

        def step(params, cache, tokens, positions, block_tables):
            logits, cache = fwd(params, cfg, tokens, positions, cache, block_tables)
            return logits, cache

        self._step = jax.jit(step, donate_argnums=(1,))

    def forward(self, tokens: np.ndarray, positions: np.ndarray) -> jax.Array:
        """Logits [b, t, vocab] for tokens/positions [b, t] (positions -1 = padding); updates the cache."""
        b, t = tokens.shape
        self.compilations.add((b, t))
        logits, self.cache = self._step(self.params, self.cache, jnp.asarray(tokens, jnp.int32),
                                        jnp.asarray(positions, jnp.int32), self.block_tables[:b])
        return logits


def _bucket(n: int) -> int:
    for b in PREFILL_BUCKETS:
        if n <= b:
            return b
    return n


def generate(runner: Runner, prompt: list[int], max_tokens: int, sampling: Sampling = Sampling(),
             stop_ids: tuple[int, ...] = (), on_token=None, stop_strings: tuple[str, ...] = (),
             decode=None) -> list[int]:
    """Generates up to max_tokens after `prompt` (one sequence).

    Stops at a stop id (not included), or once the decoded text (`decode(ids)`) contains a stop string;
    the tokens that complete the stop string are dropped.
    """
    n = len(prompt)
    if not prompt:
        raise InvalidInput("empty prompt")
    if n + max_tokens > runner.max_model_len:
        raise InvalidInput(f"prompt of {n} tokens + max_tokens {max_tokens} exceeds the model length "
                           f"{runner.max_model_len}; shorten the prompt or lower --max-tokens")
    t = _bucket(n)
    tokens = np.zeros((1, t), np.int32)
    positions = np.full((1, t), -1, np.int32)
    tokens[0, :n], positions[0, :n] = prompt, np.arange(n)
    logits = runner.forward(tokens, positions)[:, n - 1]
    key = jax.random.PRNGKey(sampling.seed)
    out: list[int] = []
    samp = jax.jit(sample)
    for i in range(max_tokens):
        key, sub = jax.random.split(key)
        tok = int(samp(logits, sub, sampling.temperature, sampling.top_k, sampling.top_p)[0])
        if tok in stop_ids:
            break
        out.append(tok)
        if stop_strings and decode is not None:
            text = decode(out)
            if any(st in text for st in stop_strings):
                while out and any(st in decode(out) for st in stop_strings):
                    out.pop()
                break
        if on_token is not None:
            on_token(tok)
        if i == max_tokens - 1:
            break
        logits = runner.forward(np.array([[tok]], np.int32), np.array([[n + i]], np.int32))[:, 0]
    return out
