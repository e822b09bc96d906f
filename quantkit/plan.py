"""`quantkit plan`: will a model fit and compile on a TPU? Answered on a CPU, without the weights.

The runtime's own prefill and decode steps (`engine.step_functions`) are compiled for the target with
libtpu's deviceless compilation (runtime/aot.py) on the model's abstract weights (`loader.abstract`): the
quantized matmuls trace to the gmm_v2 Pallas kernel as they would on the chip. HBM comes from the compiled
programs (temporaries) and from the TPU layout of the arguments (weights, KV cache: `tiling.hbm_bytes`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from quantkit.errors import InvalidInput, Unsupported

PAGE_SIZE, PREFILL_CHUNK = 16, 512


def _config(path: Path) -> dict:
    file = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise InvalidInput(f"{file}: cannot read a model config: {e}") from None
    if not isinstance(cfg, dict):
        raise InvalidInput(f"{file}: not a JSON object")
    return cfg


def _nbytes(leaf, chip) -> int:
    from quantkit.kernels.tiling import hbm_bytes

    return hbm_bytes(tuple(leaf.shape), 4 if leaf.dtype.name == "int4" else 8 * leaf.dtype.itemsize, chip)


def plan(path: str | Path, target: str = "v6e", max_model_len: int = 2048, max_num_seqs: int = 16, tp: int = 1,
         scheme: str | None = None, group_size: int = 128, search: bool = True, progress=None) -> dict:
    """Compiles the serving steps for `target` and reports HBM, VMEM, compile time and fit (CLI.md keys).

    Args:
        path: checkpoint directory or bare config.json (then `scheme` says how weights would be stored).
        scheme: W4A16 / FP8_DYNAMIC / FP8_BLOCK / MXFP4A16 / DENSE; None: the checkpoint's own
            quantization_config (or bf16 without one).
        search: also find the largest max_num_seqs that fits (compiling the decode step to confirm it).
    """
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        raise Unsupported("plan compiles for TPU with libtpu, which is not installed: pip install 'quantkit[tpu]'")
    if tp != 1:
        raise Unsupported("plan --tp > 1 is not implemented yet (single-chip plans only)")
    import jax
    import jax.numpy as jnp

    from quantkit.formats.compressed_tensors import parse_quantization_config, writable_config
    from quantkit.kernels.dispatch import can_use_gmm_v2
    from quantkit.kernels.tiling import CHIPS
    from quantkit.quant.qtensor import QTensor
    from quantkit.runtime.aot import compile_for
    from quantkit.runtime.config import from_hf
    from quantkit.runtime.engine import sampling_arrays, step_functions
    from quantkit.runtime.loader import abstract

    path, chip = Path(path), CHIPS[target]
    raw = _config(path)
    cfg = from_hf(raw)
    if scheme is not None:
        qc = None if scheme == "DENSE" else parse_quantization_config(writable_config(scheme, group_size, ["lm_head"]))
    else:
        qc = parse_quantization_config(raw["quantization_config"]) if "quantization_config" in raw else None
    params = abstract(cfg, qc)
    leaves = jax.tree_util.tree_leaves(params)
    weights = sum(_nbytes(x, chip) for x in leaves)
    pages = -(-max_model_len // PAGE_SIZE)
    _, prefill, decode = step_functions(cfg)

    def cache(n: int):
        page = jax.ShapeDtypeStruct((1 + n * pages, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
        return [(page, page) for _ in range(cfg.num_layers)]

    def kv_bytes(n: int) -> int:
        return sum(_nbytes(a, chip) for layer in cache(n) for a in layer)

    weight_shapes = {tuple(x.shape[-2:]) for x in
                     jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, QTensor))
                     if isinstance(x, QTensor)}

    def compile_step(kind: str, n: int):
        """(temporary bytes, seconds, compiler message, dequantized-weight buffers); temporary bytes are
        None when the compiler refuses (out of HBM)."""
        i32 = jnp.int32
        if kind == "decode":
            fn = lambda p, c, t, pos, lim, bt, s: decode(p, c, t, pos, lim, bt, s, 1)  # noqa: E731
            args = (params, cache(n), *(jax.ShapeDtypeStruct((n,), i32) for _ in range(3)),
                    jax.ShapeDtypeStruct((n, pages), i32), sampling_arrays(n))
        else:
            t = min(PREFILL_CHUNK, max_model_len)
            fn = prefill
            args = (params, cache(n), jax.ShapeDtypeStruct((1, t), i32), jax.ShapeDtypeStruct((1, t), i32),
                    jax.ShapeDtypeStruct((1, pages), i32), jax.ShapeDtypeStruct((1,), i32), sampling_arrays(1))
        t0 = time.perf_counter()
        try:
            compiled, seconds = compile_for(target, fn, *args, donate=(1,))
        except Exception as e:  # noqa: BLE001 - libtpu reports running out of HBM as an exception
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "HBM" in msg or "RESOURCE_EXHAUSTED" in msg or "memory" in msg.lower():
                return None, time.perf_counter() - t0, msg[:300], []
            raise
        return compiled.memory_analysis().temp_size_in_bytes, seconds, "", _dequantized(compiled, weight_shapes)

    def fits_at(n: int) -> tuple[bool, int, float, str, list]:
        """Compiles prefill and decode for n sequences: (fits, temporary bytes, seconds, message, found)."""
        seconds, temps, found = 0.0, [], []
        for kind in ("prefill", "decode"):
            temp, s, message, more = compile_step(kind, n)
            seconds, found = seconds + s, found + more
            if temp is None:
                return False, 0, seconds, message, found
            temps.append(temp)
        return weights + kv_bytes(n) + max(temps) <= chip.hbm_bytes, max(temps), seconds, "", found

    if progress:
        progress(f"compiling prefill and decode for {target} ({max_num_seqs} sequences of {max_model_len})")
    fits, temp, seconds, message, found = fits_at(max_num_seqs)
    best = None
    if search:
        # KV grows by kv_bytes(1) per sequence: start at the analytic bound and confirm it by compiling
        n, best = max(0, (chip.hbm_bytes - weights - temp) // (kv_bytes(1) - kv_bytes(0))), 0
        while n >= 1:
            if n == max_num_seqs:
                ok = fits
            else:
                if progress:
                    progress(f"checking max_num_seqs = {n}")
                ok, _, s, _, _ = fits_at(n)
                seconds += s
            if ok:
                best = n
                break
            n -= 1
    # the kernels: one entry per distinct quantized weight shape, with its gmm_v2 tiling
    kernels, seen = [], set()
    for name, leaf in _named(params):
        if isinstance(leaf, QTensor) and (key := (leaf.shape, leaf.qtype, leaf.group)) not in seen:
            seen.add(key)
            g, k, n = leaf.shape
            tiles, reason = can_use_gmm_v2(leaf.qtype, k, n, leaf.group, chip, m=max_num_seqs, g=g,
                                           scale_bytes=leaf.scales.dtype.itemsize)
            kernels.append({"name": name, "shape": [g, k, n], "qtype": leaf.qtype, "group": leaf.group,
                            "path": "gmm_v2" if tiles else f"xla ({reason})",
                            "vmem_bytes": tiles.vmem_bytes if tiles else 0,
                            "tiles": {"tm": tiles.tm, "tk": tiles.tk, "tn": tiles.tn} if tiles else None})
    kv = kv_bytes(max_num_seqs)
    step_bytes = weights + kv  # a decode step at full context reads every weight and every cached token once
    return {
        "path": str(path), "target": target, "scheme": scheme or ("checkpoint" if qc else "DENSE"),
        "max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "tp": tp, "fits": bool(fits),
        "hbm_bytes": {"weights": weights, "kv_cache": kv, "temporaries": temp,
                      "total": weights + kv + temp, "capacity": chip.hbm_bytes},
        "max_num_seqs_that_fit": best, "compile_seconds": round(seconds, 2), "compiler_message": message,
        "dequantized_weight_buffers": sorted(set(found)),
        "kernels": kernels,
        "decode_step_estimate": {"kind": "roofline estimate, not a measurement", "bytes": step_bytes,
                                 "seconds": step_bytes / chip.hbm_bytes_per_s,
                                 "output_tokens_per_s": max_num_seqs * chip.hbm_bytes_per_s / step_bytes},
    }


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
    """(path like 'layers.*.q', leaf) for each weight, layers folded into '*'."""
    for key, value in params.items():
        if key == "layers":
            for layer in value:
                for k, leaf in layer.items():
                    yield f"layers.*.{k}", leaf
        else:
            yield key, value


def print_plan(r: dict, out=sys.stdout) -> None:
    gib = 1 << 30
    h = r["hbm_bytes"]
    print(f"{r['path']} on {r['target']}: {r['scheme']}, {r['max_num_seqs']} sequences of {r['max_model_len']} tokens",
          file=out)
    for k in ("weights", "kv_cache", "temporaries", "total", "capacity"):
        print(f"  {k:<12}{h[k] / gib:9.2f} GiB", file=out)
    print(f"  compile     {r['compile_seconds']:9.1f} s on this CPU (prefill + decode, deviceless libtpu)", file=out)
    for kern in r["kernels"]:
        t = kern["tiles"]
        tiles = f"tiles {t['tm']}x{t['tk']}x{t['tn']}, VMEM {kern['vmem_bytes'] / (1 << 20):.1f} MiB" if t else ""
        print(f"  kernel {kern['name']:<18} {kern['qtype']} g{kern['group']} {kern['shape']}: {kern['path']} {tiles}",
              file=out)
    est = r["decode_step_estimate"]
    print(f"  decode step (roofline estimate, not measured): {est['seconds'] * 1e3:.1f} ms, "
          f"~{est['output_tokens_per_s']:.0f} output tokens/s at {r['max_num_seqs']} sequences", file=out)
    if r["max_num_seqs_that_fit"] is not None:
        print(f"  largest max_num_seqs that fits at {r['max_model_len']} tokens: {r['max_num_seqs_that_fit']}",
              file=out)
    verdict = "fits" if r["fits"] else "does NOT fit"
    print(f"verdict: {verdict}" + (f" ({r['compiler_message']})" if r["compiler_message"] else ""), file=out)
