"""`quantkit plan`: will a model fit and compile on a TPU? Answered on a CPU, without the weights.

The runtime's one ragged step (`step.step_function`) is compiled for the target with libtpu's deviceless
compilation (runtime/aot.py) on the model's abstract weights (`loader.abstract`) and cache
(`cache.cache_layout`), at two token buckets: the decode bucket of max_num_seqs sequences and the full
token budget (prompt chunks); the quantized matmuls trace to gmm_v2 and attention to the paged-attention
kernel as they would on the chip. HBM comes from the compiled programs: temporaries from their memory
analysis, weights and KV cache from the layouts XLA chose for the arguments; the decode program's own
cost analysis (bytes accessed, flops) is reported beside the roofline floor. With --tp, weights and cache are placed on the topology's mesh as runtime/sharding.py places
them, and every figure is per chip. With --data-parallel-size, every device holds the weights (but its share of
the experts under expert parallelism) and its own max_num_seqs / dp sequences, and runs its own step beside
the others' (runtime/step.py `_data_parallel`): the figures are one device's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from quantkit.errors import InvalidInput, Unsupported
from quantkit.runtime.config import MAX_NUM_BATCHED_TOKENS as BUDGET
from quantkit.runtime.config import PAGE_SIZE
# scalar memory of a TensorCore, where Pallas kernels' scalar prefetch lives (libtpu's refusals on v6e and
# v7x: "Used 1.01M of 1.00M smem"): the paged-attention kernel's block table of every sequence
SMEM_BYTES = 1 << 20
SMEM_OTHER = 12 << 10  # SMEM the step's kernels use beside the block table (gpt-oss-120b on TPU7x: 9-11 KiB)


def _config(path: Path) -> dict:
    file = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise InvalidInput(f"{file}: cannot read a model config: {e}") from None
    if not isinstance(cfg, dict):
        raise InvalidInput(f"{file}: not a JSON object")
    return cfg


def _local(leaf) -> tuple[int, ...]:
    """The shape one chip holds: the shard of a tensor-parallel array, else the whole."""
    sharding = getattr(leaf, "sharding", None)
    return tuple(sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape)


def _nbytes(leaf, layout, chip) -> int:
    """HBM bytes of one chip's part of `leaf`: in the compiled program's layout when known (XLA picks the
    tiles, e.g. 4-row tiles for 4 KV heads, or reorders dimensions), else the native-tile estimate."""
    from quantkit.kernels.tiling import hbm_bytes

    shape, bits = list(_local(leaf)), 4 if leaf.dtype.name == "int4" else 8 * leaf.dtype.itemsize
    if layout is None:
        return hbm_bytes(tuple(shape), bits, chip)
    for dim, t in zip(reversed(layout.major_to_minor), reversed(layout.tiling[0] if layout.tiling else ())):
        shape[dim] = -(-shape[dim] // t) * t  # the minor dimensions are padded to the first tile
    return -(-math.prod(shape) * bits // 8)


def plan(path: str | Path, *args, **kwargs) -> dict:
    """Compiles the serving steps for `tp` chips of `target` and reports HBM (per chip), VMEM, compile time and
    fit (docs/cli.md keys; `_plan` documents the arguments). What it reads of each compiled program is kept
    by the program's fingerprint (runtime/aot.py Facts, in ~/.cache/quantkit/jax/plan-facts or under
    $QUANTKIT_JAX_CACHE), so that a program a plan compiled before is not compiled again; `compile_timings`
    lists each program's trace, lowering and compile seconds (aot.compile_log)."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        raise Unsupported("plan compiles for TPU with libtpu, which is not installed: pip install 'quantkit[tpu]'")
    from quantkit.runtime.aot import compile_log

    with compile_log() as log:
        report = _plan(path, *args, **kwargs)
    return report | {"compile_timings": log}


def _plan(path: str | Path, target: str = "v6e", max_model_len: int = 2048, max_num_seqs: int = 16, tp: int = 1,
          scheme: str | None = None, group_size: int = 128, search: bool = True, progress=None,
          kv_cache_dtype: str = "auto", ep: bool = False, cost: bool = True, prefill_cost: bool = True,
          speculative=None, prefix_caching: bool = True, dp: int = 1, max_num_batched_tokens: int = BUDGET) -> dict:
    """The plan (see `plan`).

    Args:
        path: checkpoint directory or bare config.json (then `scheme` says how weights would be stored).
        scheme: a --scheme of ct_writer.SCHEMES (DENSE: bf16); None: the checkpoint's own
            quantization_config (or bf16 without one).
        search: also find the largest max_num_seqs that fits (compiling the steps to confirm it).
        kv_cache_dtype: as serve's (runtime/cache.py kv_fp8_dtype): an FP8 cache is compiled with its
            per-layer scales among the weights.
        ep: with tp > 1, MoE experts split whole over the chips (expert parallelism, runtime/sharding.py).
        cost: also XLA's cost analysis of the decode and prefill steps, their matmul FLOPs by MXU type and
            the decode step's collectives (three or four more compiles of shallow variants a program);
            skipped when the step does not compile. Without it `decode_step_cost`, `prefill_step_cost` and
            `decode_step_collectives` are None.
        prefill_cost: with `cost`, also the prefill program's (its own shallow compiles); else
            `prefill_step_cost` is None.
        speculative: serve's --speculative-config (runtime/speculative.SpeculativeConfig), or None: the
            verifying step's cost too; a draft head (eagle3: its checkpoint's config.json and safetensors
            headers; mtp: the model's MTP layer, which its config declares) adds its weights and its own KV
            pages to the fit and runs in the verifying step, as serve holds and runs it.
        prefix_caching: as serve's; with Gated DeltaNet layers it keeps max_num_seqs more state slots for
            the snapshots of prompt prefixes (runtime/cache.py), which the cache then holds.
        dp: data-parallel devices (with tp 1): each serves max_num_seqs / dp sequences (runtime/step.py).
        max_num_batched_tokens: serve's: the most tokens a step runs (the largest token bucket, compiled for
            the fit and costed as the prefill step).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from quantkit.runtime.validate import kv_scheme_reason
    from quantkit.kernels.tiling import CHIPS
    from quantkit.runtime.aot import chips, compile_for, target_mesh, topology_name
    from quantkit.runtime.models import from_hf
    from quantkit.runtime.cache import cache_layout, kv_fp8_dtype, with_kv_scales
    from quantkit.runtime.loader import abstract
    from quantkit.runtime.sharding import is_expert
    from quantkit.runtime.speculative import Lookup
    from quantkit.runtime.step import draft_cache, empty_batch, step_function, token_buckets

    path, chip = Path(path), CHIPS[target]
    if dp > 1 and (tp > 1 or max_num_seqs % dp):
        raise InvalidInput(f"--data-parallel-size {dp} takes --tp 1 and a --max-num-seqs that it divides")
    devices = max(tp, dp)
    raw = _config(path)
    cfg = from_hf(raw)
    qc = _quantization(raw, scheme, group_size)
    head, head_params = _draft_head(speculative, raw, cfg, path, devices)
    mtp, speculative = speculative is not None and speculative.method == "mtp", speculative.k if speculative else 0
    kv_scheme = qc.kv_cache_scheme if qc is not None else None
    fp8 = kv_fp8_dtype(kv_cache_dtype, kv_scheme is not None and kv_scheme_reason(kv_scheme) is None)
    kv_dtype = jnp.dtype(fp8 or jnp.bfloat16)
    mesh = None
    if devices > 1:  # weights and KV cache placed on the topology's mesh as the runtime places them
        from quantkit.runtime.sharding import AXIS, cache_sharding, shard_params

        mesh = target_mesh(target, devices)

    def weights_of(c):
        p = abstract(c, qc, mtp=mtp)
        if head_params is not None:
            p["draft"] = head_params
        if fp8 is not None:
            p = with_kv_scales(p, c, None, lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32))
        if mesh is None:
            return p
        return shard_params(p, c, mesh, put=lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), ep=ep,
                            dp=dp > 1)

    params = weights_of(cfg)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    param_leaves = [x for _, x in flat]
    parts = ["draft" if path[0].key == "draft" else "experts" if path[0].key == "layers" and is_expert(cfg, path[2].key)
             else "" for path, _ in flat]
    layouts = {"params": [None] * len(param_leaves), "cache": None}  # from the first compiled decode step
    budget = max_num_batched_tokens  # serve's: a step holds several sequences' chunks, whatever max_model_len

    def layout(c, n: int):
        """The Runner's cache layout for n sequences (a device's n / dp), with serve's snapshot slots under
        prefix caching (as many)."""
        n //= dp
        return cache_layout(c, max_model_len, n, PAGE_SIZE, budget, speculative, n if prefix_caching else 0)

    buckets = token_buckets(budget, verify=max_num_seqs * (1 + speculative) if speculative else 0)

    def decode_bucket(n: int) -> int:
        """The token bucket a decode step of n sequences runs in (on each of dp devices: n / dp)."""
        return next(b for b in buckets if b >= min(n // dp, budget))

    def cache(n: int, c=cfg) -> dict:
        """As the Runner's: per kind stacked pages for n sequences (and Gated DeltaNet state slots)."""
        def leaf(k, s, d):
            sh = None if mesh is None else cache_sharding(c, mesh, k, dp > 1)
            return jax.ShapeDtypeStruct((s[0], s[1] * dp, *s[2:]), d or kv_dtype, sharding=sh)

        lay = layout(c, n)
        kv = lay.cache(leaf)
        if head is not None:  # the head's own KV, or the n-gram lookup's token pages (step.Runner)
            shape, kind = draft_cache(head, lay.pages["full"], PAGE_SIZE)
            kv["draft"] = jax.ShapeDtypeStruct(shape, kind or jnp.bfloat16)
        return kv

    def weight_bytes(part: str | None = None) -> int:
        """HBM bytes of the weights, or of one part of them ("experts"; "draft": a draft head's)."""
        return sum(_nbytes(x, lay, chip) for x, lay, p in zip(param_leaves, layouts["params"], parts)
                   if part in (None, p))

    def kv_bytes(n: int, kind: str | None = None) -> int:
        """HBM bytes of the cache for n sequences: KV pages and state slots, or one kind's ("linear": the
        Gated DeltaNet states; "draft": a draft head's pages)."""
        flat = jax.tree_util.tree_flatten_with_path(cache(n))[0]
        return sum(_nbytes(x, lay, chip) for (path, x), lay in zip(flat, layouts["cache"] or [None] * len(flat))
                   if kind in (None, path[0].key))

    weight_shapes = _quantized_shapes(params)

    def compile_program(c, weights, t: int, n: int, unroll: bool = False, spec: int = 0):
        """Compiles the step of config c (weights: its abstract pytree) at t tokens for n sequences (spec:
        the verifying step of speculative decoding with up to that many drafts a row). Below the budget a
        step of n sequences is compiled as the Runner's DECODE program (one token a row; it differs from the
        plain step only in Gated DeltaNet layers, step.py `step_function`)."""
        s = min(t, n // dp)  # rows a device
        batch = empty_batch(t, s, layout(c, n), n // dp, c.vocab_size)
        parts = 2 + spec if spec and head is not None else 1  # a draft head's `last` (step.py)
        last = jax.ShapeDtypeStruct(((n + dp) * parts,), jnp.int32,
                                    sharding=NamedSharding(mesh, P(AXIS)) if dp > 1 else None)
        if dp > 1:  # each device's batch (runtime/step.py Runner.batch)
            batch = {**jax.tree_util.tree_map(lambda a: np.stack([a] * dp), batch),
                     "row_order": np.zeros(dp * s, np.int32), "token_order": np.zeros(dp * t, np.int32)}
        batch = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
        kind = "verifying" if spec else "decode" if t < budget else "budget"
        return compile_for(target, step_function(c, PAGE_SIZE, mesh=mesh, unroll=unroll, kv_fp8=fp8,
                                                 ep=ep and mesh is not None, spec=spec,
                                                 drafter=head if spec or isinstance(head, Lookup) else None,
                                                 decode=not spec and t < budget, dp=dp > 1), weights, cache(n, c),
                           last, batch, donate=(1, 2), pinned=(0,), tp=devices, facts=True,
                           label=f"{kind} step, {t} tokens, {n} sequences, {c.num_layers} layers"
                                 f"{' unrolled' if unroll else ''}")

    def compile_step(t: int, n: int, spec: int = 0):
        """Compiles the step at t tokens for n sequences (spec: the verifying step): (temporary bytes,
        seconds, compiler message, dequantized-weight buffers); temporary bytes are None when the compiler
        refuses (out of HBM)."""
        t0 = time.perf_counter()
        try:
            compiled, seconds = compile_program(cfg, params, t, n, spec=spec)
        except Exception as e:  # noqa: BLE001 - libtpu reports running out of HBM as an exception
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "HBM" in msg or "RESOURCE_EXHAUSTED" in msg or "memory" in msg.lower():
                return None, time.perf_counter() - t0, msg[:300], []
            raise
        if layouts["cache"] is None:  # the argument layouts XLA chose, in args' order
            formats = [f.layout for f in jax.tree_util.tree_leaves(compiled.input_formats)]
            w = len(param_leaves)
            layouts["params"], layouts["cache"] = formats[:w], formats[w:w + len(jax.tree_util.tree_leaves(cache(n)))]
        return compiled.memory_analysis().temp_size_in_bytes, seconds, "", _dequantized(compiled, weight_shapes)

    def fits_at(n: int, decode: bool = True) -> tuple[bool, int, float, str, list]:
        """Compiles the decode bucket (unless not `decode`) and the full budget for n sequences, and with
        speculative decoding the verifying program of the full budget too (serve runs one in every bucket;
        the largest holds the most): (fits, temporary bytes, seconds, message, dequantized buffers found)."""
        seconds, temps, found = 0.0, [], []
        sizes = [(t, 0) for t in dict.fromkeys((decode_bucket(n), budget) if decode else (budget,))]
        for t, spec in sizes + ([(budget, speculative)] if speculative else []):
            temp, s, message, more = compile_step(t, n, spec)
            seconds, found = seconds + s, found + more
            if temp is None:
                return False, 0, seconds, message, found
            temps.append(temp)
        return weight_bytes() + kv_bytes(n) + max(temps) <= chip.hbm_bytes, max(temps), seconds, "", found

    if progress:
        progress(f"compiling the step for {target} ({max_num_seqs} sequences of {max_model_len})")
    fits, temp, seconds, message, found = fits_at(max_num_seqs)
    def step_cost(t: int, spec: int = 0, later: bool = True) -> dict:
        return _step_cost(cfg, lambda c: compile_program(c, weights_of(c), t, max_num_seqs, unroll=True,
                                                         spec=spec)[0], later)

    cost = step_cost(decode_bucket(max_num_seqs)) if cost and not message else None
    verify_tokens = decode_bucket(max_num_seqs * (1 + speculative))
    verify = step_cost(verify_tokens, speculative) if speculative and cost is not None else None
    prefill = cost if cost is None or decode_bucket(max_num_seqs) == budget else \
        step_cost(budget, later=False) if prefill_cost else None
    weights, best = weight_bytes(), None
    # KV grows by `per_seq` bytes a sequence (marginal, taken at max_num_seqs: a tiny sliding-window pool is
    # clamped to the full one's size), on top of `fixed` bytes whatever n (scratch pages, the pages of one
    # step's prompt chunks); data parallel: a device's, for each of its max_num_seqs / dp sequences
    local = max_num_seqs // dp
    per_seq = kv_bytes(max_num_seqs + dp) - kv_bytes(max_num_seqs)
    fixed = kv_bytes(max_num_seqs) - local * per_seq
    if search:  # in sequences a device (data parallel: dp more at a time)
        best, s = _largest_fit(lambda m, decode=True: fits_at(m * dp, decode), local, fits, temp, message,
                               chip.hbm_bytes - weights - fixed, per_seq,
                               4 * cache_layout(cfg, max_model_len, 1, PAGE_SIZE, budget).pages_per_seq, progress)
        best, seconds = best * dp, seconds + s
    kv, state = kv_bytes(max_num_seqs), kv_bytes(max_num_seqs, "linear")
    state_per_seq = kv_bytes(max_num_seqs + dp, "linear") - state  # of per_seq and fixed: the state's part
    state_fixed = state - local * state_per_seq
    full = layout(cfg, max_num_seqs)
    snapshots = state * full.snapshots // (local + 1 + full.snapshots)  # of `state`: equal slots
    # a decode step at full context reads every weight and every cached token once, and reads and writes each
    # sequence's recurrent state, not the snapshots' (each chip its share, in parallel; the all-reduces of a
    # tensor-parallel step are left out); a draft head's weights and pages are not the decode step's
    head_bytes = weight_bytes("draft") + kv_bytes(max_num_seqs, "draft")
    step_bytes = weights + (kv - state) + 2 * (state - snapshots) - head_bytes
    collectives = {k.split(":")[1]: v for k, v in (cost or {}).items() if k.startswith("collective:")}
    return {
        "path": str(path), "target": target, "scheme": scheme or ("checkpoint" if qc else "DENSE"),
        "max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget, "tp": tp,
        "data_parallel_size": dp,
        "kv_cache_dtype": kv_dtype.name, "topology": topology_name(target, devices), "chips": chips(target, devices),
        "fits": bool(fits),
        "hbm_bytes": {"weights": weights, "kv_cache": kv - state, "recurrent_state": state,
                      "of_recurrent_state_snapshots": snapshots, "temporaries": temp,
                      "total": weights + kv + temp, "capacity": chip.hbm_bytes,
                      "of_weights_experts": weight_bytes("experts"), "of_weights_draft_head": weight_bytes("draft")},
        "expert_parallel": bool(ep and devices > 1),
        "max_num_seqs_that_fit": best,
        "kv_cache_by_dtype": _kv_by_dtype(kv - state, kv_dtype.itemsize, fp8 is not None, best, search,
                                          chip.hbm_bytes - weights - temp, (fixed - state_fixed, state_fixed),
                                          (per_seq - state_per_seq, state_per_seq), dp),
        "compile_seconds": round(seconds, 2), "compiler_message": message,
        "dequantized_weight_buffers": sorted(set(found)),
        "kernels": _kernels(params, chip, max_num_seqs),
        "decode_step_estimate": {"kind": "roofline estimate, not a measurement", "bytes": step_bytes,
                                 "seconds": step_bytes / chip.hbm_bytes_per_s,
                                 "output_tokens_per_s": max_num_seqs * chip.hbm_bytes_per_s / step_bytes},
        # XLA's own count for the compiled decode program (Pallas calls by their declared CostEstimate)
        "decode_step_cost": None if cost is None else {
            **_program_cost(cost, chip), "floor_bytes": step_bytes,
            "ratio_to_floor": round(cost.get("bytes_accessed", 0) / step_bytes, 3)},
        # the full-budget program (a prompt's chunk of `tokens`), costed the same way: compute-bound for long
        # prompts, where 8-bit MXU types pay
        "prefill_step_cost": None if prefill is None else {"tokens": budget, **_program_cost(prefill, chip)},
        # speculative decoding: the verifying step of max_num_seqs rows of 1 + k tokens each, costed as the
        # decode step is, against it (its weights are read once for every drafted position)
        "verify_step_cost": None if verify is None else {
            "drafts_a_row": speculative, "tokens": verify_tokens,
            "draft_head": head is not None and not isinstance(head, Lookup),
            **_program_cost(verify, chip),
            "ratio_to_decode_step": round(verify.get("bytes_accessed", 0) / max(cost.get("bytes_accessed", 0), 1), 3)},
        "step_programs": len(buckets) * (2 if speculative else 1) + (  # + Gated DeltaNet models' DECODE programs
            sum(b <= decode_bucket(max_num_seqs) for b in buckets) if cfg.linear_layers else 0),
        # the buffers the compiled decode step reduces or gathers across chips (bytes per chip, per op kind),
        # beside the least a tensor-parallel step with replicated activations needs: one all-reduce of the
        # [tokens, hidden] activations after each layer's attention and one after its MLP / experts, and one
        # for the vocabulary-split embedding (the vocabulary-split logits need only each chip's best
        # candidates gathered, a few bytes a row)
        "decode_step_collectives": None if devices == 1 or cost is None else {
            "bytes": collectives, "total": sum(collectives.values()),
            "floor_bytes": _collective_floor(cfg, decode_bucket(max_num_seqs), dp)},
    }


def _draft_head(spec, raw: dict, cfg, path: Path, devices: int) -> tuple:
    """The drafter `spec` (a SpeculativeConfig or None) names, as plan compiles it: (its static part, the
    step's `drafter`; its abstract weights, None where they are among the model's: Qwen3.5's MTP layer,
    loader.abstract(mtp=True), or where it has none: the n-gram lookup), or (None, None) for none or an n-gram
    lookup on several devices (the host's). As serve, draft heads on one device only."""
    if spec is None:
        return None, None
    if spec.method == "ngram":
        from quantkit.runtime.speculative import Lookup

        return (Lookup(spec.lookup_min, spec.lookup_max) if devices == 1 and "full" in cfg.layer_kinds else None), None
    if devices > 1:
        raise InvalidInput("draft heads (eagle3, mtp) run on one device; plan the target with --tp 1")
    if spec.method == "mtp":
        from quantkit.formats.safetensors_io import SafetensorsFile
        from quantkit.runtime.models.qwen3_5 import Mtp

        folder = path if path.is_dir() else path.parent  # a bare config.json: the weights may be beside it
        declared = (raw.get("text_config") or raw).get("mtp_num_hidden_layers")
        if cfg.family != "qwen3_5" or not declared and not any(
                name.startswith("mtp.") for f in folder.glob("*.safetensors") for name in SafetensorsFile(f).tensors):
            raise Unsupported("method 'mtp' needs a Qwen3.5 model with its MTP layer (mtp_num_hidden_layers in "
                              "its config, or mtp.* weights)")
        return Mtp(cfg), None
    import jax.numpy as jnp

    from quantkit.runtime.models.eagle3 import abstract

    return abstract(spec.model, cfg, jnp.bfloat16)


def _quantization(raw: dict, scheme: str | None, group_size: int):
    """The QuantizationConfig the weights would be stored with: `scheme`'s as `convert` writes it (lm_head,
    GDN projections and MTP left bf16; routers are never quantized), None for DENSE; else the checkpoint's
    own (None without one: bf16)."""
    from quantkit.formats.compressed_tensors import parse_quantization_config
    from quantkit.formats.ct_writer import writable_config
    from quantkit.formats.gpt_oss import mxfp4_config, native_mxfp4
    from quantkit.formats.hf import GROUP_IGNORE

    if scheme is not None:
        ignore = ["lm_head", *GROUP_IGNORE]
        return None if scheme == "DENSE" else parse_quantization_config(writable_config(scheme, group_size, ignore))
    if native_mxfp4(raw):  # gpt-oss as published: its compressed-tensors equivalent (formats/gpt_oss.py)
        return parse_quantization_config(mxfp4_config())
    return parse_quantization_config(raw["quantization_config"]) if "quantization_config" in raw else None


def _program_cost(cost: dict, chip) -> dict:
    """A step program's report from _step_cost's metrics: bytes accessed, FLOPs (all and by MXU operand
    type), its compute-bound roofline time (each MXU type's FLOPs at the chip's own peak rate) and the HBM
    time of its bytes (where that is larger, the step is memory-bound): estimates from the compiled program,
    never measurements."""
    by_type = {t.split(":")[1]: v for t, v in cost.items() if t.startswith("mxu:")}
    return {"bytes_accessed": cost.get("bytes_accessed", 0), "flops": cost.get("flops", 0),
            "flops_by_mxu_type": by_type,
            "roofline_seconds": sum(v / chip.peak_flops(t) for t, v in by_type.items()),
            "memory_seconds": cost.get("bytes_accessed", 0) / chip.hbm_bytes_per_s}


def _step_cost(cfg, compile_layers, later: bool = True) -> dict:
    """XLA's cost analysis of a step program (compile_layers(c): it compiled for config c, its layers
    unrolled) and its matmul FLOPs by MXU operand type (`_mxu_flops`), scaled to the model's depth
    (`_layer_costs`): the rest (embedding, logits, sampling) plus each kind's layer times its count."""
    base_kinds, base, per = _layer_costs(cfg, compile_layers, later)
    kinds = cfg.layer_kinds
    return {m: int(base.get(m, 0) + sum((kinds.count(k) - base_kinds.count(k)) * per[k].get(m, 0) for k in per))
            for m in set(base).union(*per.values())}


def _layer_costs(cfg, compile_layers, later: bool = True) -> tuple[tuple, dict, dict]:
    """(the kinds of a base program's layers, its metrics, {kind: what one more layer of it adds}). XLA
    counts a loop body once, so shallow variants are compiled, their layers unrolled: the base, then the
    base with one more layer of each kind; a kind's layer costs the difference. `later`: the base holds one
    layer of each kind, so that a kind's cost is a later layer's, not the first's, which can carry what the
    program does once (with a first layer of a second kind, XLA scheduled a copy of the logits that a
    one-layer program lacks). Else (the prefill program, whose Gated DeltaNet layers are slow to compile)
    one layer of the first kind, an attention one where there are Gated DeltaNet layers: then only one
    variant holds a GDN layer. Data-parallel expert layers run one pass of their loop, as a balanced step
    does (models/common.py `balanced_expert_passes`: XLA counts the body of a loop whose trip count the data
    decides more than once)."""
    from quantkit.runtime.models.common import balanced_expert_passes

    kinds = tuple(dict.fromkeys(cfg.layer_kinds))
    if not later:
        kinds = (next((k for k in kinds if k != "linear"), kinds[0]),)

    def measure(k: tuple[str, ...]) -> dict:
        c = dataclasses.replace(cfg, num_layers=len(k), sliding_layers=tuple(x == "sliding" for x in k),
                                linear_layers=tuple(x == "linear" for x in k) if cfg.linear_layers else ())
        with balanced_expert_passes():
            compiled = compile_layers(c)
        ca = compiled.cost_analysis()
        ca = (ca[0] if isinstance(ca, (list, tuple)) else ca) or {}
        hlo = compiled.as_text()
        return {"bytes_accessed": ca.get("bytes accessed", 0.0), "flops": ca.get("flops", 0.0),
                **{f"mxu:{t}": f for t, f in _mxu_flops(hlo).items()},
                **{f"collective:{op}": b for op, b in _collectives(hlo).items()}}

    base = measure(kinds)
    return kinds, base, {k: {m: v - base.get(m, 0) for m, v in measure((*kinds, k)).items()} for k in cfg.kinds}


def _quantized_shapes(params: dict) -> set:
    """The [k, n] a quantized weight has on one chip, unless a dense weight (which may be there) has that
    shape too: a floating-point array of such a shape in a compiled program is a dequantized weight."""
    import jax

    from quantkit.quant.qtensor import QTensor

    quantized = [x for x in jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, QTensor))
                 if isinstance(x, QTensor)]
    dense = {_local(x)[-2:] for x in jax.tree_util.tree_leaves(params)
             if x.dtype.name in ("bfloat16", "float32", "float16")}
    return {_local(x.values)[-2:] for x in quantized} - dense


def _largest_fit(fits_at, n: int, fits: bool, temp: int, message: str, room: int, per_seq: int, table: int,
                 progress) -> tuple[int, float]:
    """The largest max_num_seqs that fits, and the compile seconds spent finding it.

    n sequences fit or not (`fits`) with `temp` temporary bytes, or the compiler refused them (`message`);
    `room`: HBM bytes beside the weights and the KV cache's fixed part, of which each sequence takes
    `per_seq`, and the temporaries some more. What m sequences need of `room` is known from each compile:
    m * per_seq + its temporaries, or from a refusal, room + the excess it reports (`_refused_need`). The
    search keeps the largest m known to fit and the smallest known not to, and guesses where the line
    through their needs crosses `room` (with none known not to fit, the temporaries taken as constant),
    confirming each guess by compiling the budget program (the larger temporaries), unless a larger m
    compiled: temporaries do not shrink with m, so m fits when m * per_seq + that m's temporaries does. A
    need not known (a refusal that does not say) halves the interval instead.

    The other limit is SMEM, where the paged-attention kernel keeps its block table (`table` bytes a
    sequence) beside ~10 KiB of other scalars: the first guess is at most (SMEM_BYTES - SMEM_OTHER) / table,
    and when that cap fits, the next guess is one more; a refusal for SMEM ("Exceeded smem capacity by X")
    steps down by the sequences X holds."""
    seconds = 0.0
    need = _refused_need(message, room) if message else n * per_seq + temp
    lo, hi = ((n, need), None) if fits else ((0, temp), (n, need, None if message else temp))
    cap = (SMEM_BYTES - SMEM_OTHER) // table
    capped = fits and n + (room - need) // per_seq > cap  # the first guess, at SMEM's cap
    step = cap if capped else None
    while True:
        (a, na), (b, nb, tb) = lo, hi or (None, None, None)
        if step is not None:
            guess = step
        elif hi is None:
            guess = a + (room - na) // per_seq
        elif nb is None or nb <= na:
            guess = (a + b) // 2
        else:
            guess = a + int((room - na) * (b - a) // (nb - na))
        m = guess if hi is None else min(guess, b - 1)
        if m <= a:
            return a, seconds
        if tb is not None and m * per_seq + tb <= room:  # compiled at b, fits by the sum at m
            lo, step = (m, m * per_seq + tb), None
            continue
        if progress:
            progress(f"checking max_num_seqs = {m}")
        ok, t, s, message, _ = fits_at(m, decode=False)  # the budget program has the larger temporaries
        seconds += s
        need = _refused_need(message, room) if message else m * per_seq + t
        lo, hi = ((m, need), hi) if ok else (lo, (m, need, None if message else t))
        if ok:
            step, capped = (m + 1 if capped else None), False
        else:
            step = None if (over := _exceeded(message, "smem")) is None else \
                min(m - max(1, -(-over // table)), SMEM_BYTES // table - 1)  # (libtpu's excess far past it: ~8.7K)


def _exceeded(message: str, space: str) -> int | None:
    """The bytes of memory `space` ("hbm", "smem") a refusal says a program lacks ("Exceeded smem capacity
    by 8.7K"), or None."""
    import re

    m = re.search(rf"Exceeded {space} capacity by ([\d.]+)([KMG]?)", message)
    return None if m is None else math.ceil(float(m[1]) * {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}[m[2]])


def _refused_need(message: str, room: int) -> int | None:
    """What a configuration the compiler refused needs of `room`: room + the excess its refusal reports
    (libtpu's two messages: "required (X G) exceeds available HBM (Y G)", GiB to two decimals, and
    "Exceeded hbm capacity by Z"), None when the message does not say."""
    import re

    m = re.search(r"\(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)", message)
    over = int((float(m[1]) - float(m[2])) * 2 ** 30) if m else _exceeded(message, "hbm")
    return None if over is None else room + over


def _kernels(params: dict, chip, m: int) -> list[dict]:
    """One entry per distinct quantized weight shape (on one chip), with its gmm_v2 tiling at m rows."""
    from quantkit.kernels.dispatch import can_use_gmm_v2, mxu_type
    from quantkit.quant.qtensor import QTensor

    kernels, seen = [], set()
    for name, leaf, layers in _named(params):
        g, k, n = _local(leaf.values) if isinstance(leaf, QTensor) else (0, 0, 0)
        g //= layers  # one call multiplies by one layer's groups of the stack
        if isinstance(leaf, QTensor) and (key := (g, k, n, leaf.qtype, leaf.group, leaf.split)) not in seen:
            seen.add(key)
            group = k if leaf.group == leaf.shape[1] else leaf.group  # channel scales span the shard
            tiles, reason = can_use_gmm_v2(leaf.qtype, k, n, group, chip, m=m, g=g,
                                           scale_bytes=leaf.scales.dtype.itemsize,
                                           zero_bytes=0 if leaf.zeros is None else leaf.zeros.dtype.itemsize,
                                           act=leaf.act)
            kernels.append({"name": name, "shape": [g, k, n], "qtype": leaf.qtype, "group": group,
                            "path": "gmm_v2" if tiles else f"xla ({reason})",
                            "mxu": mxu_type(leaf.qtype, leaf.act, chip) if tiles else None,
                            "vmem_bytes": tiles.vmem_bytes if tiles else 0,
                            "tiles": {"tm": tiles.tm, "tk": tiles.tk, "tn": tiles.tn} if tiles else None})
    return kernels


def _kv_by_dtype(pages: int, itemsize: int, fp8: bool, best: int | None, search: bool, room: int,
                 fixed: tuple[int, int], per_seq: tuple[int, int], dp: int = 1) -> dict:
    """KV cache bytes and the largest max_num_seqs for bf16 and FP8: the compiled dtype's (`fp8`: the cache
    was compiled FP8; its pages' bytes, `best`), the other's scaled from its layout (1 or 2 bytes a value)
    with this compile's temporaries: an estimate. room: HBM bytes beside the weights and temporaries; fixed,
    per_seq: the compiled cache's bytes whatever the sequences, and per sequence, each as (KV pages,
    recurrent state): the float32 Gated DeltaNet state does not change with the KV dtype. Data parallel:
    one device's bytes, its sequences dp times over."""
    by_dtype = {}
    for name, size in (("bf16", 2), ("fp8", 1)):
        f = size / itemsize
        this = (size == 1) == fp8
        n = best if this else (room - fixed[0] * f - fixed[1]) // (per_seq[0] * f + per_seq[1]) * dp if search \
            else None
        by_dtype[name] = {"kv_cache": int(pages * f), "max_num_seqs_that_fit": None if n is None else int(n),
                          "compiled": this}
    return by_dtype


def _collective_floor(cfg, t: int, dp: int = 1) -> int:
    """Bytes of bf16 activations a decode step of t tokens must all-reduce at least (see plan's report); data
    parallel (t tokens on each of dp devices): what each MoE layer must gather and scatter, as
    _collectives counts it (result bytes): every device's tokens and their routing (top-k expert ids and
    weights, int32 words) all-gathered, the device's own rows' sums reduce-scattered back."""
    if dp > 1:
        moe = cfg.num_layers if cfg.num_experts else 0
        return moe * (dp * t * (cfg.hidden_size * 2 + 2 * cfg.top_k * 4) + t * cfg.hidden_size * 2)
    return (2 * cfg.num_layers + 1) * t * cfg.hidden_size * 2


def _collectives(hlo: str) -> dict:
    """Bytes of the results of each kind of cross-chip collective in a compiled program's HLO text (an
    async pair counted once, by its -start op; a tuple result by its last element, the gathered buffer)."""
    import re

    sizes = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1}
    out: dict = {}
    for result, op in re.findall(r"= (\(?[^=]*?\)?) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                                 r"collective-permute)(?:-start)?\(", hlo):
        shapes = re.findall(r"(\w+)\[([0-9,]*)\]", result)
        if shapes:
            dtype, dims = shapes[-1]
            n = math.prod(int(d) for d in dims.split(",") if d) * sizes.get(dtype, 4)
            out[op] = out.get(op, 0) + n
    return out


# HLO element types -> the MXU operand type they are multiplied as (f32 dots run as bf16 passes at XLA's
# default precision on a TPU)
MXU_OF = {"bf16": "bf16", "f32": "bf16", "f16": "bf16", "s8": "int8", "u8": "int8", "f8e4m3fn": "fp8",
          "f8e5m2": "fp8"}


def _mxu_flops(hlo: str) -> dict[str, int]:
    """Matmul FLOPs of a compiled program's HLO text by the MXU operand type ("bf16", "int8", "fp8"):
    XLA's dots and convolutions by their lhs element type (2 x output elements x the products summed into
    each, counting only the window taps that land on input, as XLA's cost analysis does), Pallas calls by
    their declared CostEstimate and the operand type in their `mxu` kernel metadata (gmm_v2's, paged
    attention's; bf16 without one). A loop body counts once (plan compiles its cost variants unrolled)."""
    import re

    out = {"bf16": 0, "int8": 0, "fp8": 0}
    types = dict(re.findall(r"%([\w.\-]+) = (\w+\[[0-9,]*\])", hlo))  # instruction -> its result type
    for line in re.split(r"\n(?=\s*(?:ROOT )?%[\w.\-]+ = )", hlo):  # one instruction each (some span lines)
        if not (m := re.search(r"%[\w.\-]+ = (\w+)\[([0-9,]*)\]\S* (dot|convolution|custom-call)\(([^)]*)\)", line)):
            continue
        _, dims, op, args = m.groups()
        if op == "custom-call":
            if "tpu_custom_call" in line and (f := re.search(r'"cost_estimate":\s*\{[^}]*"flops":\s*"?(\d+)', line)):
                t = re.search(r'"mxu":\s*"(\w+)"', line)
                out[t.group(1) if t else "bf16"] += int(f.group(1))
            continue
        operands = [_dims(types.get(x, "")) for x in re.findall(r"%([\w.\-]+)", args)[:2]]
        if len(operands) < 2 or None in operands:
            continue
        (ltype, lhs), (_, rhs) = operands
        n = math.prod(int(d) for d in dims.split(",") if d)
        if op == "dot":
            c = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
            summed = math.prod(lhs[int(i)] for i in c.group(1).split(",") if i) if c else 1
        else:
            summed = _conv_taps(line, lhs, rhs)
        out[MXU_OF.get(ltype, "bf16")] += round(2 * n * summed)
    return out


def _dims(t: str):
    """"bf16[4,64]" -> ("bf16", [4, 64]); None for anything else."""
    if "[" not in t:
        return None
    dtype, dims = t.rstrip("]").split("[")
    return dtype, [int(d) for d in dims.split(",") if d]


def _conv_taps(line: str, lhs: list[int], rhs: list[int]) -> float:
    """Products summed into one output element of an HLO convolution, averaged over the output: the
    kernel's input features times, per spatial dimension, the window taps that land on an input element
    (not padding or a hole of lhs dilation; XLA rewrites batched dots as such dilated windows)."""
    import re

    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", line)
    lhs_l, rhs_l, out_l = labels.groups()
    window = dict(re.findall(r"(\w+)=([0-9_x\-]+)", (re.search(r"window=\{([^}]*)\}", line) or [None, ""])[1]))
    out_dims = [int(d) for d in re.search(r"\[([0-9,]*)\]", line).group(1).split(",") if d]
    summed = rhs[rhs_l.index("i")]
    spatial = sorted(c for c in rhs_l if c.isdigit())
    for j, c in enumerate(spatial):
        def at(key, default):
            v = window.get(key)
            return default if v is None else v.split("x")[j]
        size, stride = int(at("size", 1)), int(at("stride", 1))
        lo = int(at("pad", "0_0").split("_")[0])
        ld, rd = int(at("lhs_dilate", 1)), int(at("rhs_dilate", 1))
        extent, outs = (lhs[lhs_l.index(c)] - 1) * ld, out_dims[out_l.index(c)]
        taps = sum(1 for o in range(outs) for w in range(size)
                   if 0 <= (x := o * stride - lo + w * rd) <= extent and x % ld == 0)
        summed *= taps / outs
    return summed


def _dequantized(compiled, shapes: set) -> list[str]:
    """Floating-point arrays in the compiled program with a quantized weight's [k, n] shape: a weight
    dequantized in HBM, which gmm_v2 exists to avoid. (A heuristic: an activation [t, d] matches only if a
    prefill chunk of t rows equals some weight's input width k.)"""
    import re

    found = []
    for dtype, dims in re.findall(r"\b(bf16|f16|f32)\[([0-9,]+)\]", compiled.as_text()):
        d = tuple(int(x) for x in dims.split(","))
        if len(d) >= 2 and all(x == 1 for x in d[:-2]) and d[-2:] in shapes:
            found.append(f"{dtype}[{dims}]")
    return found


def _named(params: dict):
    """(path like 'layers.*.q', leaf, layers stacked in it) for each weight, layer kinds folded into '*'."""
    for key, value in params.items():
        if key == "layers":
            for stack in value.values():
                for k, leaf in stack.items():
                    yield f"layers.*.{k}", leaf, stack["attn_norm"].shape[0]
        else:
            yield key, value, 1


def print_plan(r: dict, out=None, timings: bool = False) -> None:
    out = out or sys.stdout  # (the one at call time: a test's runner swaps it)
    gib = 1 << 30
    h = r["hbm_bytes"]
    unit = "TensorCore" if r["target"] == "v7x" else "chip"  # a v7x chip is two devices (runtime/aot.py)
    n, dp = max(r["tp"], r["data_parallel_size"]), r["data_parallel_size"]
    chips = f"{n} {unit}s ({r['topology']}), HBM per {unit}" if n > 1 else (
        f"{r['topology']}, one TensorCore" if unit == "TensorCore" else r["topology"])
    chips += f", data parallel ({r['max_num_seqs'] // dp} sequences each)" if dp > 1 else ""
    chips += ", experts split whole (expert parallel)" if r["expert_parallel"] else ""
    print(f"{r['path']} on {r['target']}: {r['scheme']}, {r['max_num_seqs']} sequences of {r['max_model_len']} tokens, "
          f"{r['kv_cache_dtype']} KV cache, {chips}", file=out)
    for k in ("weights", "kv_cache", "recurrent_state", "temporaries", "total", "capacity"):
        if k == "recurrent_state" and not h[k]:
            continue
        print(f"  {k if k != 'recurrent_state' else 'state':<12}{h[k] / gib:9.2f} GiB", file=out)
        if k == "weights" and h["of_weights_experts"]:
            print(f"   (experts {h['of_weights_experts'] / gib:8.2f} GiB)", file=out)
        if k == "weights" and h.get("of_weights_draft_head"):
            print(f"   (draft head {h['of_weights_draft_head'] / gib:.2f} GiB)", file=out)
        if k == "recurrent_state" and h["of_recurrent_state_snapshots"]:
            print(f"   (prefix snapshots {h['of_recurrent_state_snapshots'] / gib:.2f} GiB)", file=out)
    if (c := r["decode_step_collectives"]) is not None:
        kinds = ", ".join(f"{op} {b / (1 << 20):.2f}" for op, b in sorted(c["bytes"].items())) or "none"
        print(f"  collectives {c['total'] / (1 << 20):9.2f} MiB a decode step ({kinds} MiB; floor "
              f"{c['floor_bytes'] / (1 << 20):.2f} MiB)", file=out)
    print(f"  compile     {r['compile_seconds']:9.1f} s on this CPU (the decode and {r['max_num_batched_tokens']}-token "
          "buckets of the step, deviceless libtpu)", file=out)
    for kern in r["kernels"]:
        t = kern["tiles"]
        tiles = f"tiles {t['tm']}x{t['tk']}x{t['tn']}, VMEM {kern['vmem_bytes'] / (1 << 20):.1f} MiB" if t else ""
        mxu = f", {kern['mxu']} MXU" if kern["mxu"] else ""
        print(f"  kernel {kern['name']:<18} {kern['qtype']} g{kern['group']} {kern['shape']}: {kern['path']} {tiles}{mxu}",
              file=out)
    if (c := r["decode_step_cost"]) is not None:
        print(f"  decode step (compiled, XLA cost analysis): {c['bytes_accessed'] / 1e9:.2f} GB accessed "
              f"({c['ratio_to_floor']:.2f}x the {c['floor_bytes'] / 1e9:.2f} GB of weights + KV), "
              f"{c['flops'] / 1e9:.1f} GFLOP", file=out)
    if (c := r.get("verify_step_cost")) is not None:
        head = ", with the draft head" if c.get("draft_head") else ""
        print(f"  verifying step, {r['max_num_seqs']} rows x (1 + {c['drafts_a_row']}) tokens (speculative decoding"
              f"{head}, compiled): {c['bytes_accessed'] / 1e9:.2f} GB accessed, {c['ratio_to_decode_step']:.2f}x "
              f"the decode step's, {c['flops'] / 1e9:.1f} GFLOP", file=out)
    if (c := r["prefill_step_cost"]) is not None:
        by = ", ".join(f"{t} {f / 1e12:.2f}" for t, f in c["flops_by_mxu_type"].items() if f)
        print(f"  prefill step of {c['tokens']} tokens (compiled; roofline estimate, not measured): "
              f"compute {c['roofline_seconds'] * 1e3:.2f} ms ({by} TFLOP, each at {r['target']}'s rate for it), "
              f"memory {c['memory_seconds'] * 1e3:.2f} ms ({c['bytes_accessed'] / 1e9:.2f} GB)", file=out)
    est = r["decode_step_estimate"]
    print(f"  decode step (roofline estimate, not measured): {est['seconds'] * 1e3:.1f} ms, "
          f"~{est['output_tokens_per_s']:.0f} output tokens/s at {r['max_num_seqs']} sequences", file=out)
    if r["max_num_seqs_that_fit"] is not None:
        print(f"  largest max_num_seqs that fits at {r['max_model_len']} tokens: {r['max_num_seqs_that_fit']}",
              file=out)
    for name, d in r["kv_cache_by_dtype"].items():
        n = f", largest max_num_seqs {d['max_num_seqs_that_fit']}" if d["max_num_seqs_that_fit"] is not None else ""
        print(f"  KV cache {name:<5}{d['kv_cache'] / gib:9.2f} GiB{n}" + ("" if d["compiled"] else
              " (estimate: scaled from the compiled cache; plan with --kv-cache-dtype to compile it)"), file=out)
    if timings:
        total = sum(x["trace_s"] + x["lower_s"] + x["compile_s"] for x in r["compile_timings"])
        print(f"  compiles ({len(r['compile_timings'])}, {total:.1f} s: trace + lower + compile, s):", file=out)
        for x in r["compile_timings"]:
            print(f"    {x['trace_s']:6.1f} {x['lower_s']:6.1f} {x['compile_s']:7.1f}  {x['label']}"
                  f"{' (read back: compiled before)' if x['cached'] else ''}", file=out)
    verdict = "fits" if r["fits"] else "does NOT fit"
    print(f"verdict: {verdict}" + (f" ({r['compiler_message']})" if r["compiler_message"] else ""), file=out)
