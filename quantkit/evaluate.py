"""`quantkit eval`: what quantization cost, measured on text, with paired-bootstrap intervals.

Both checkpoints run through the JAX runtime (float32 activations, so what is measured is the weights)
on the same non-overlapping token windows, one after the other, so that memory never holds both. Per
predicted token: the KL divergence of the candidate's next-token distribution from the reference's, each
model's negative log-likelihood of the actual next token, and whether both put the same token first.
Intervals come from one paired bootstrap: blocks of consecutive tokens are resampled (tokens within a
block are correlated), the same draw for every statistic, so the reference and candidate perplexities
vary together as they should.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from quantkit.errors import InvalidInput

BLOCK = 32  # tokens per bootstrap block: covers correlation of a few tokens (see test_eval)
RESAMPLES = 1000


def default_text() -> str:
    """The source of the standard library's argparse module: present on every Python, plain English and code."""
    import argparse

    return Path(argparse.__file__).read_text(encoding="utf-8")


def bootstrap_ci(columns: dict[str, np.ndarray], stats: dict, block: int = BLOCK, resamples: int = RESAMPLES,
                 seed: int = 0) -> dict[str, tuple[float, float]]:
    """95% percentile intervals of each `stats[name](columns)` under a paired moving-block bootstrap.

    Args:
        columns: per-token arrays of equal length n.
        stats: name -> function of a dict of (resampled) columns, returning a float.
        block: consecutive tokens drawn together.
    """
    n = len(next(iter(columns.values())))
    block = max(1, min(block, n))
    starts = np.arange(n - block + 1)
    rng = np.random.default_rng(seed)
    picks = rng.choice(starts, size=(resamples, -(-n // block)))  # [resamples, blocks]
    idx = (picks[:, :, None] + np.arange(block)).reshape(resamples, -1)[:, :n]  # [resamples, n]
    out = {}
    for name, fn in stats.items():
        values = np.array([fn({k: v[i] for k, v in columns.items()}) for i in idx])
        out[name] = (float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5)))
    return out


def _token_stats(ref_logits: np.ndarray, cand_logits: np.ndarray, targets: np.ndarray) -> dict[str, np.ndarray]:
    """Per position: KL(ref || cand), both NLLs of the target, same argmax. Logits [t, vocab], float64 math."""
    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lr, lc = log_softmax(ref_logits), log_softmax(cand_logits)
    rows = np.arange(len(targets))
    return {"kl": np.maximum((np.exp(lr) * (lr - lc)).sum(axis=-1), 0.0),
            "nll_ref": -lr[rows, targets], "nll_cand": -lc[rows, targets],
            "agree": (lr.argmax(-1) == lc.argmax(-1)).astype(np.float64)}


def _model_config(path: Path):
    """The ModelConfig of a checkpoint from its headers and config.json alone (no weights read), after
    the validation `runtime.loader.load` does: so that a candidate that cannot be served, or that does not
    match the reference, fails before the reference has run."""
    from quantkit.formats.hf import Checkpoint
    from quantkit.runtime.validate import validate_checkpoint

    checked = validate_checkpoint(Checkpoint.open(path))
    checked.raise_first(path)
    if checked.cfg is None:
        raise InvalidInput(f"{path}: no config.json")
    return checked.cfg


def _release(*trees) -> None:
    """Frees the device buffers of every array in `trees` now (a model's weights, its KV cache), rather
    than whenever the last Python reference goes: eval loads the candidate only once the reference is gone."""
    import gc

    import jax

    for leaf in jax.tree_util.tree_leaves(trees):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()
    gc.collect()
    try:  # glibc keeps freed heap pages for reuse; the candidate's buffers have other sizes: give them back
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def evaluate(reference: Path, candidate: Path, text: str | None = None, max_tokens: int = 4096,
             window: int = 512, progress=None, kv_cache_dtype: str = "auto", tp: int = 1, ep: bool = False) -> dict:
    """Runs both checkpoints on the same windows of `text` (tokenized with the reference's tokenizer);
    the candidate with a `kv_cache_dtype` cache (runtime/cache.py), the reference with its own default;
    both over `tp` devices (`ep`: experts split whole; runtime/sharding.py).

    One model at a time, so that memory holds one model's float32 weights, never two (an 8B model is
    32 GB in float32): the reference runs over every window first and only its float32 logits of the
    predicted tokens are kept (KL needs its whole next-token distribution), then it is freed and the
    candidate runs. Those logits are tokens x vocab x 4 bytes: --max-tokens 4096 of a 128,256-token
    vocabulary (Llama 3) is 2.1 GB, of a 262,144-token one (Gemma 3) 4.3 GB, against 32 GB and 108 GB
    of float32 weights for Llama-3.1-8B and Gemma-3-27B. They are the very arrays the per-token
    statistics were computed from when both models ran side by side, so every figure is unchanged.

    Returns the report (docs/cli.md keys): tokens, ppl_reference, ppl_candidate, kl {mean, median, p99, max,
    ci95}, top1_agreement {value, ci95}, plus the intervals of both perplexities.
    """
    import jax
    import jax.numpy as jnp

    from quantkit.runtime.engine import Runner
    from quantkit.runtime.loader import load
    from quantkit.runtime.sharding import start
    from quantkit.runtime.tokenizer import TextCodec

    ids = TextCodec(reference).encode(default_text() if text is None else text)[:max_tokens]
    cfgs = [_model_config(p) for p in (reference, candidate)]  # headers only: fail before any weight is read
    if cfgs[0].vocab_size != cfgs[1].vocab_size:
        raise InvalidInput(f"vocabularies differ: {cfgs[0].vocab_size} vs {cfgs[1].vocab_size} "
                           "tokens; compare checkpoints of the same model")
    window = min(window, min(c.max_position_embeddings for c in cfgs))
    spans = [ids[i:i + window] for i in range(0, len(ids), window)]
    spans = [s for s in spans if len(s) >= 2]
    if not spans:
        raise InvalidInput(f"the text has {len(ids)} tokens; eval needs at least 2")
    mesh = start(tp)

    def run(path: Path, kv: str, each):
        """Loads `path`, runs every span through it (each(i, float32 logits of the span's predicted
        tokens)), and returns (devices holding its weights, whether experts were split whole), having freed
        the model."""
        model = load(path, dtype=jnp.float32, mesh=mesh, ep=ep, check=False)  # validated by _model_config
        runner = Runner(model, max_model_len=window, max_num_batched_tokens=window, kv_cache_dtype=kv)
        for i, span in enumerate(spans):
            each(i, runner.forward([(0, span, 0)])[0][:-1])
            done[0] += 1
            if progress is not None:  # windows run, over both models
                progress(done[0], 2 * len(spans))
        devices = max(len(x.sharding.device_set) for x in jax.tree_util.tree_leaves(model.params))
        placed = (devices, runner.ep)
        _release(runner.params, runner.kv, runner.last, model.params)
        del runner, model
        return placed

    done = [0]
    ref_logits: list[np.ndarray] = [None] * len(spans)

    def keep(i, logits):  # a copy: the step's output also holds the bucket's padding rows
        ref_logits[i] = np.array(logits, dtype=np.float32)

    cols: dict[str, list] = {}

    def compare(i, logits):
        for k, v in _token_stats(ref_logits[i], logits, np.array(spans[i][1:])).items():
            cols.setdefault(k, []).append(v)
        ref_logits[i] = None  # done with it

    run(reference, "auto", keep)
    devices, expert_parallel = run(candidate, kv_cache_dtype, compare)
    c = {k: np.concatenate(v) for k, v in cols.items()}
    ci = bootstrap_ci(c, {"kl": lambda d: d["kl"].mean(), "agree": lambda d: d["agree"].mean(),
                          "ppl_ref": lambda d: math.exp(d["nll_ref"].mean()),
                          "ppl_cand": lambda d: math.exp(d["nll_cand"].mean()),
                          "ratio": lambda d: math.exp(d["nll_cand"].mean() - d["nll_ref"].mean())})
    kl = c["kl"]
    return {
        "reference": str(reference), "candidate": str(candidate), "tokens": int(len(kl)),
        "windows": len(spans), "window": window,
        "ppl_reference": math.exp(c["nll_ref"].mean()), "ppl_reference_ci95": ci["ppl_ref"],
        "ppl_candidate": math.exp(c["nll_cand"].mean()), "ppl_candidate_ci95": ci["ppl_cand"],
        "ppl_ratio": {"value": math.exp(c["nll_cand"].mean() - c["nll_ref"].mean()), "ci95": ci["ratio"]},
        "kl": {"mean": float(kl.mean()), "median": float(np.median(kl)), "p99": float(np.percentile(kl, 99)),
               "max": float(kl.max()), "ci95": ci["kl"]},
        "top1_agreement": {"value": float(c["agree"].mean()), "ci95": ci["agree"]},
        # where the weights ran: devices holding them (--tp), experts split whole (--enable-expert-parallel)
        "devices": devices,
        "expert_parallel": expert_parallel,
    }


def print_report(r: dict, out=sys.stdout) -> None:
    def ci(pair, fmt):
        return f"[{fmt.format(pair[0])}, {fmt.format(pair[1])}]"

    kl, top = r["kl"], r["top1_agreement"]
    rows = [
        ("tokens", f"{r['tokens']} ({r['windows']} windows of up to {r['window']})", ""),
        ("PPL(reference)", f"{r['ppl_reference']:.4f}", ci(r["ppl_reference_ci95"], "{:.4f}")),
        ("PPL(candidate)", f"{r['ppl_candidate']:.4f}", ci(r["ppl_candidate_ci95"], "{:.4f}")),
        ("PPL ratio", f"{r['ppl_ratio']['value']:.6f}", ci(r["ppl_ratio"]["ci95"], "{:.6f}")),
        ("Mean KLD", f"{kl['mean']:.6f}", ci(kl["ci95"], "{:.6f}")),
        ("Median KLD", f"{kl['median']:.6f}", ""),
        ("99.0% KLD", f"{kl['p99']:.6f}", ""),
        ("Maximum KLD", f"{kl['max']:.6f}", ""),
        ("Same top p", f"{100 * top['value']:.3f} %", ci([100 * x for x in top["ci95"]], "{:.3f} %")),
    ]
    print(f"reference: {r['reference']}\ncandidate: {r['candidate']}", file=out)
    for name, value, interval in rows:
        print(f"{name:<16}{value:>26}  {interval}", file=out)
    print("intervals: 95% paired block bootstrap", file=out)
