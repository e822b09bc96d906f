"""Speculative decoding: vLLM's `--speculative-config`, and the drafters that propose tokens.

A decoding row then carries its last token and up to `k` drafts; the one ragged step verifies them all
(step.verify_rows: each position's token is drawn as a step without drafts draws it, with the same key,
and a draft stands where it is that token: the standard rejection rule for a certain drafter) and returns
the accepted drafts plus the target's next token, so the output is the one the target alone gives, token
for token when greedy or seeded. Drafters:

- `ngram` (prompt lookup): the tokens that followed the latest earlier occurrence of the sequence's last n
  tokens (prompt and output so far), for the longest n in [prompt_lookup_min, prompt_lookup_max] that
  occurs. On one device, on the device inside each step (`Lookup`: the step keeps every sequence's tokens in
  pages beside its KV), so that the next step's drafts follow the accepted tokens without the host reading
  the step back first, as a draft head's do; on several devices host-side, from an index of the sequence's
  n-grams kept up to date as tokens arrive (`PromptLookup`): a few dict reads a row a step.
- `eagle3`: an EAGLE-3 draft head (`"model": PATH`, models/eagle3.py) run on device inside each step, after
  the target's forward, drafting the next step's tokens from the target's hidden states.
- `mtp`: Qwen3.5's own multi-token-prediction layer (the checkpoint's `mtp.*`, models/qwen3_5.Mtp), the same
  way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from quantkit.errors import Unsupported

KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")
BUILT = ("ngram", "eagle3", "mtp")
MAX_TOKENS = 16  # drafts a row at most: each bucket's program verifies k + 1 positions a row


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    k: int  # num_speculative_tokens: drafts a row at most
    lookup_min: int = 5  # ngram: the shortest suffix looked up (vLLM's defaults: 5 and 5)
    lookup_max: int = 5
    model: str | None = None  # eagle3: the draft checkpoint


def parse(text: str | dict | None) -> SpeculativeConfig | None:
    """The JSON of `--speculative-config` (vLLM's keys) as a SpeculativeConfig; None for None / "" / {}.
    Raises ValueError naming what is wrong (a usage error)."""
    if text is None or text == "":
        return None
    try:
        spec = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"must be a JSON object, got {type(spec).__name__}")
    if not spec:
        return None
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(KEYS)}")
    method = spec.get("method")
    if method == "[ngram]":
        method = "ngram"
    if method not in BUILT:
        raise ValueError(f"unknown method {method!r}; quantkit serves {', '.join(BUILT)}")
    model = spec.get("model")
    if method != "eagle3" and model is not None:
        raise ValueError(f"'model' names a draft checkpoint, which method {method!r} does not use")
    if method == "eagle3" and (not isinstance(model, str) or not model):
        raise ValueError("method 'eagle3' needs 'model': the path of an EAGLE-3 draft checkpoint")

    def count(key: str, default):
        v = spec.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key!r} must be a positive integer, got {v!r}")
        return v

    k = count("num_speculative_tokens", None)
    if k is None:
        raise ValueError("'num_speculative_tokens' is required (drafts a step verifies per sequence)")
    if k > MAX_TOKENS:
        raise ValueError(f"'num_speculative_tokens' {k} is above {MAX_TOKENS}")
    lo, hi = count("prompt_lookup_min", None), count("prompt_lookup_max", None)
    lo, hi = lo or hi or 5, hi or lo or 5
    if lo > hi:
        raise ValueError(f"'prompt_lookup_min' {lo} is above 'prompt_lookup_max' {hi}")
    return SpeculativeConfig(method, k, lo, hi, model)


@dataclass
class Drafter:
    """A draft head for the Runner: `spec` its static part (models/eagle3.Eagle3, models/qwen3_5.Mtp: a key
    of the jitted step), `params` its weights (None: the loader put them in the model's, "draft")."""

    spec: object
    params: dict | None = None


def drafter_for(spec: SpeculativeConfig | None, model):
    """The drafter `spec` names for the target `model` (a loader.LoadedModel; for `mtp` loaded with
    `mtp=True`): a draft head, or the device's n-gram lookup (which a Runner on several devices leaves to the
    host); None for no speculation."""
    if spec is None:
        return None
    if spec.method == "ngram":
        return Drafter(Lookup(spec.lookup_min, spec.lookup_max))
    if spec.method == "mtp":
        from quantkit.runtime.models.qwen3_5 import Mtp

        if "draft" not in model.params:
            raise Unsupported(f"{model.path}: method 'mtp' needs a Qwen3.5 checkpoint with its MTP layer (mtp.*)")
        return Drafter(Mtp(model.cfg))
    import jax
    import jax.numpy as jnp

    from quantkit.runtime.models.eagle3 import load

    # float32 on CPU, where XLA's bf16 dots take about twice as long (the head is small: 1.4 M parameters for
    # the default model's; its passes are most of what it adds to a step there)
    return Drafter(*load(spec.model, model.cfg, jnp.float32 if jax.default_backend() == "cpu" else model.dtype))


@dataclass(frozen=True)
class Lookup:
    """The n-gram drafter on the device (a Runner's `drafter` spec, like a draft head's): the step writes each
    token it runs, and the token it chooses after a row's kept ones, into token pages laid out as the
    full-attention KV pages (so a prefix-cache hit brings its tokens too), then drafts from each row's
    sequence read back through its block table (`draft`)."""

    lo: int  # prompt_lookup_min
    hi: int  # prompt_lookup_max
    aux = ()  # (no target hidden states)

    def draft(self, seq, length, k: int, none: int):
        """k drafts a row [S, k] from its tokens seq [S, M] (positions >= length [S] unused): what followed
        the latest earlier occurrence of its last n tokens, for the largest n in [lo, hi] that occurs (as
        `PromptLookup.draft`), continued periodically past the sequence's end (the match a period p back
        predicts what follows it as repeating those p tokens); `none` for every draft of a row with no
        match."""
        import jax.numpy as jnp

        m = seq.shape[1]
        end = jnp.arange(m)[None]  # where an earlier occurrence ends, followed by at least one known token
        last = length[:, None] - 1
        run, n = jnp.ones(seq.shape, bool), jnp.zeros(seq.shape, jnp.int32)
        for i in range(self.hi):  # n[r, j]: how many tokens ending at j equal the sequence's last ones
            back = jnp.pad(seq, ((0, 0), (i, 0)), constant_values=-1)[:, :m]  # seq[j - i]
            want = jnp.take_along_axis(seq, jnp.maximum(last - i, 0), axis=1)
            run = run & (back == want) & (last - i >= 0)
            n = n + run
        n = jnp.where(end < last, n, 0)
        best = jnp.max(n, axis=1, keepdims=True)
        at = jnp.max(jnp.where((n >= best) & (end < last), end, -1), axis=1, keepdims=True)  # its latest end
        idx = at + 1 + jnp.arange(k)[None] % jnp.maximum(last - at, 1)
        drafts = jnp.take_along_axis(seq, jnp.clip(idx, 0, m - 1), axis=1)
        return jnp.where(best >= self.lo, drafts, none)


class PromptLookup:
    """The n-gram drafter's index of one sequence (prompt and output so far): for each n in `sizes`, the
    latest start of every n-gram that ends before the sequence's last token, a dict updated as tokens
    arrive (len(sizes) entries a token), so that a lookup reads a few entries whatever the sequence's
    length. A scan of the whole sequence at every step (numpy, each n) cost 1.9 ms a step for 16 sequences
    of 2,000 tokens and 26 ms at 32,000, on the host while the device waits for the drafts; this, 0.11 and
    0.20 ms (benchmarks/ngram_lookup.py)."""

    def __init__(self, sizes: range):
        self.sizes, self.tokens, self.latest = sizes, [], {}
        self.indexed = 0  # n-grams ending at positions < indexed are in `latest`

    def extend(self, prompt: list[int], out: list[int]) -> "PromptLookup":
        """Catches up with the sequence `prompt + out`, which extends the one seen so far."""
        have, p = len(self.tokens), len(prompt)
        if have > p + len(out):  # shorter (a stop string's tokens taken back): start over
            self.__init__(self.sizes)
            have = 0
        self.tokens += prompt[have:]
        self.tokens += out[max(have - p, 0):]
        t = self.tokens
        for end in range(self.indexed, len(t) - 1):  # an n-gram ending at the last token is the suffix itself
            for n in self.sizes:
                if n <= end + 1:
                    self.latest[tuple(t[end + 1 - n:end + 1])] = end + 1 - n
        self.indexed = max(self.indexed, len(t) - 1)
        return self

    def draft(self, k: int, lo: int, hi: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the last n tokens, for the largest n
        in [lo, hi] (within `sizes`) that occurs; [] when none does."""
        t = self.tokens
        for n in range(min(hi, len(t) - 1), lo - 1, -1):
            start = self.latest.get(tuple(t[len(t) - n:]))
            if start is not None:
                return t[start + n:start + n + k]
        return []
