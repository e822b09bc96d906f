"""`quantkit inspect`: what is in a checkpoint, is it well-formed, and will it serve on the target.

Header-only unless `deep=True`. Never imports torch, jax or compressed-tensors (start-up time matters:
see benchmarks/inspect_speed.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from quantkit.errors import InvalidInput, QuantkitError, Unsupported
from quantkit.formats import packing
from quantkit.formats.compressed_tensors import (
    KV_SCALES, QuantConfig, Scheme, check_module_tensors, kv_head_scales, kv_scheme_reason, parse_quantization_config,
    weight_qtype,
)
from quantkit.formats.hf import Checkpoint, classify_module, group_modules
from quantkit.formats.safetensors_io import DTYPES, FLOAT_DTYPES
from quantkit.kernels.dispatch import weight_path
from quantkit.kernels.tiling import CHIPS, LANES, Chip, hbm_bytes, round_up

TARGETS = tuple(CHIPS)
LAYER_KINDS = ("linear", "moe_experts")


def _problem(severity: str, where: str, message: str) -> dict:
    return {"severity": severity, "where": where, "message": message}


def _config_problems(ckpt: Checkpoint, qc: QuantConfig | None, raw: dict | None) -> list[dict]:
    """Checkpoint-wide findings that do not belong to one layer."""
    where = str(ckpt.root / "config.json")
    out = [_problem("warning", where, w) for w in ckpt.warnings]
    if ckpt.config is None:
        out.append(_problem("warning", str(ckpt.root), "no config.json: architecture and quantization scheme unknown"))
    else:
        from quantkit.runtime.config import ARCHITECTURES

        archs = ckpt.config.get("architectures")
        arch = archs[0] if isinstance(archs, list) and archs else None
        if arch not in ARCHITECTURES:
            out.append(_problem("unsupported", where, f"architecture {arch!r} is not supported by the runtime; "
                                f"supported: {', '.join(ARCHITECTURES)}"))
        else:
            from quantkit.runtime.config import from_hf

            try:
                from_hf(ckpt.config)
            except Unsupported as e:  # a variant of a known architecture the runtime refuses, with its reason
                out.append(_problem("unsupported", where, str(e)))
            except (KeyError, TypeError, ValueError) as e:
                out.append(_problem("error", where, f"config.json does not describe a {arch}: {type(e).__name__} {e}"))
    if raw is not None and qc is None:
        method = raw.get("quant_method")
        out.append(_problem("unsupported", where, f"quant_method {method!r} is not compressed-tensors; quantkit reads "
                            "compressed-tensors checkpoints only (re-quantize the original with `quantkit convert`)"))
    if qc is None:
        return out
    if qc.sparsity:
        out.append(_problem("unsupported", where, "sparsity_config is set: sparse compressed-tensors checkpoints are "
                            "not supported"))
    if qc.transform:
        out.append(_problem("unsupported", where, "transform_config is set: online rotations (SpinQuant/QuIP "
                            "transforms) are not supported by the runtime"))
    if qc.kv_cache_scheme is not None:
        reason = kv_scheme_reason(qc.kv_cache_scheme)
        if reason:
            out.append(_problem("unsupported", where, reason))
        else:
            out += _kv_scale_problems(ckpt)
    if qc.status not in (None, "compressed"):
        out.append(_problem("warning", where, f"quantization_status is {qc.status!r}, expected 'compressed'"))
    if any(g.input_activations is not None for g in qc.groups):
        out.append(_problem("warning", where, "fp8 activation quantization in the scheme: the runtime computes "
                            "activations in bf16 (weights stay quantized)"))
    return out


def _kv_scale_problems(ckpt: Checkpoint) -> list[dict]:
    """Every layer's k_scale / v_scale (read always: a few bytes each) must exist, be finite, positive and
    one per tensor or per KV head."""
    from quantkit.runtime.config import from_hf

    try:
        cfg = from_hf(ckpt.config)
    except (QuantkitError, KeyError, TypeError, ValueError):
        return []  # the architecture problem is reported on its own
    out = []
    for i, kind in enumerate(cfg.layer_kinds):
        for name in KV_SCALES:
            tensor = f"{cfg.prefix}layers.{i}.self_attn.{name}"
            if tensor not in ckpt.tensors:
                out.append(_problem("error", tensor, f"kv_cache_scheme is set but {tensor} is missing"))
                continue
            try:
                kv_head_scales(ckpt.read(tensor), cfg.kv_shape(kind)[0], tensor)
            except InvalidInput as e:
                out.append(_problem("error", tensor, str(e)))
    return out


def _served_shape(module: str, shape: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The [..., out, in] the runtime serves: an MLP's or expert's intermediate width (gate/up out, down in)
    rounded up to 128 lanes, as the loader pads it (runtime/loader.py lane_widths)."""
    last = module.rsplit(".", 1)[-1]
    if shape is None or len(shape) < 2 or last not in ("gate_proj", "up_proj", "down_proj"):
        return shape
    axis = -1 if last == "down_proj" else -2
    padded = list(shape)
    padded[axis] = round_up(shape[axis], LANES)
    return tuple(padded)


def _device_bytes(qtype: str, params: dict, shape: tuple[int, ...] | None, chip: Chip) -> int:
    """HBM bytes for one module on `chip`, in the runtime's layout: weights [..., in, out]
    (out in lanes), scales [..., groups, out]; int4/mxfp4 packed, fp8 1 byte, dense weights bf16."""
    total = 0
    if shape is not None and len(shape) >= 2:
        dev_shape = (*shape[:-2], shape[-1], shape[-2])
        bits = {"int4": 4, "mxfp4": 4, "fp8": 8}.get(qtype, 16)
        total += hbm_bytes(dev_shape, bits, chip)
    for param, info in params.items():
        if param in ("weight", "weight_packed") and shape is not None and len(shape) >= 2:
            continue
        if param in ("weight_shape", "weight_g_idx"):
            continue  # metadata, not loaded
        bits = DTYPES[info.dtype][0]
        if info.dtype in FLOAT_DTYPES:
            bits = 32 if info.dtype == "F32" and param != "weight" else 16  # scales keep f32; F16/BF16 -> bf16
        s = info.shape
        dev = (*s[:-2], s[-1], s[-2]) if len(s) >= 2 else s
        total += hbm_bytes(dev, bits, chip)
    return total


def _deep_check(ckpt: Checkpoint, module: str, scheme: Scheme | None, params: dict,
                shape: tuple[int, ...] | None) -> tuple[tuple[int, ...] | None, list[dict]]:
    """Reads a module's data: NaN/Inf/zero scales, weight_shape, packed padding, g_idx range."""
    probs: list[dict] = []
    w = scheme.weights if scheme is not None and scheme.format != "dense" else None

    def read(param):
        return ckpt.read(params[param].name) if param in params else None

    for param, info in params.items():
        arr = read(param)
        if param.endswith("scale") or param == "weight_global_scale":
            values = packing.e8m0_to_float(arr) if info.dtype in ("U8", "F8_E8M0") else arr.astype(np.float32)
            if not np.isfinite(values).all():
                probs.append(_problem("error", f"{module}.{param}", f"{module}.{param} contains NaN or Inf"))
            elif info.dtype not in ("U8", "F8_E8M0") and (values == 0).any():
                n = int((values == 0).sum())
                probs.append(_problem("error", f"{module}.{param}", f"{module}.{param} has {n} zero scale(s)"))
        elif info.dtype in FLOAT_DTYPES or info.dtype.startswith("F8_E"):
            if not np.isfinite(arr.astype(np.float32)).all():
                probs.append(_problem("error", f"{module}.{param}", f"{module}.{param} contains NaN or Inf values"))
    if w is not None and scheme.format == "pack-quantized" and "weight_shape" in params and shape is not None:
        ws = tuple(int(x) for x in read("weight_shape"))
        cols = params["weight_packed"].shape[-1]
        if ws[:-1] != shape[:-1] or not ws or -(-ws[-1] * w.num_bits // 32) != cols:
            probs.append(_problem("error", f"{module}.weight_shape",
                                  f"{module}.weight_shape is {list(ws)} but weight_packed {list(params['weight_packed'].shape)} "
                                  f"holds a weight of {list(shape[:-1])} x ~{shape[-1]}"))
        else:
            shape = ws
            spare = cols * 32 - ws[-1] * w.num_bits
            if spare:
                words = read("weight_packed")[..., -1].astype(np.int64) & 0xFFFFFFFF
                if (words >> (32 - spare)).any():
                    probs.append(_problem("warning", f"{module}.weight_packed",
                                          f"{module}.weight_packed has non-zero padding bits beyond {ws[-1]} columns"))
    if w is not None and "weight_g_idx" in params and shape is not None and w.group_size:
        g = read("weight_g_idx")
        if g.shape[-1:] != shape[-1:] or g.min(initial=0) < 0 or g.max(initial=0) >= -(-shape[-1] // w.group_size):
            probs.append(_problem("error", f"{module}.weight_g_idx", f"{module}.weight_g_idx is out of range"))
    return shape, probs


def inspect_checkpoint(path: str | Path, target: str = "v6e", deep: bool = False,
                       progress: Callable[[int, int], None] | None = None) -> dict:
    """Inspects a checkpoint and returns the report (the JSON document of CLI.md).

    Args:
        path: checkpoint directory or .safetensors file.
        target: "v5e" | "v6e" | "v7x" | "cpu".
        deep: also read tensor data (NaN/Inf/zero scales, weight_shape, padding bits).
        progress: called with (bytes checked, total bytes) after each module.
    Returns:
        The report dict. Raises InvalidInput when the files themselves cannot be read.
    """
    if target not in CHIPS:
        raise InvalidInput(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    chip = CHIPS[target]
    ckpt = Checkpoint.open(path)
    raw = (ckpt.config or {}).get("quantization_config")
    qc = None
    if raw is not None:
        if not isinstance(raw, dict):
            raise InvalidInput(f"{ckpt.root / 'config.json'}: quantization_config is not an object")
        if raw.get("quant_method", "compressed-tensors") == "compressed-tensors":
            qc = parse_quantization_config(raw, f"{ckpt.root / 'config.json'}: quantization_config")
    problems = _config_problems(ckpt, qc, raw)
    foreign = raw is not None and qc is None

    layers = []
    done, total = 0, sum(i.nbytes for i in ckpt.tensors.values())
    hbm_total = 0
    bits_all = [0, 0]  # [logical weights, stored bits] over all linear layers
    bits_q = [0, 0]  # the same over quantized linear layers only
    for module, pnames in group_modules(ckpt.tensors).items():
        params = {p: ckpt.tensors[n] for p, n in pnames.items()}
        kind, cls = classify_module(module, params)
        scheme = qc.scheme_for(module, cls) if qc is not None and cls is not None else None
        quantized_foreign = foreign and any(p not in ("weight", "bias") for p in params)
        # A foreign method's tensors are not ours to judge: it is reported unsupported, not invalid.
        shape, errors = (None, []) if quantized_foreign else check_module_tensors(module, scheme, params)
        layer_probs = [_problem("error", module, e) for e in errors]
        if deep and not errors:
            shape, deep_probs = _deep_check(ckpt, module, scheme, params, shape)
            layer_probs += deep_probs
        done += sum(i.nbytes for i in params.values())
        if progress is not None:
            progress(done, total)
        qtype = weight_qtype(scheme)
        if quantized_foreign:
            verdict_path, reason = None, "quantized by a method quantkit does not read"
        elif "weight" not in params and "weight_packed" not in params:
            verdict_path, reason = None, ""  # e.g. a module holding only k_scale/v_scale
        else:
            v = weight_path(scheme, _served_shape(module, shape), chip)
            verdict_path, reason = v.path, v.reason
        servable = not errors and (verdict_path is not None or ("weight" not in params and "weight_packed" not in params))
        if verdict_path is None and reason:
            layer_probs.append(_problem("unsupported", module, reason))
        problems += layer_probs
        hbm = _device_bytes(qtype, params, shape, chip)
        hbm_total += hbm
        if kind in LAYER_KINDS and shape is not None:
            n = 1
            for d in shape:
                n *= d
            stored = 8 * sum(i.nbytes for p, i in params.items() if p.startswith("weight"))
            for acc in (bits_all, bits_q) if qtype != "dense" else (bits_all,):
                acc[0] += n
                acc[1] += stored
        layers.append({
            "name": module,
            "kind": kind,
            "format": scheme.format if scheme is not None and scheme.weights is not None else "dense",
            "scheme": scheme.weights.as_json() if scheme is not None and scheme.weights is not None else None,
            "qtype": qtype,
            "shape": list(shape) if shape is not None else None,
            "path": verdict_path,
            "servable": servable,
            "reason": reason or None,
            "bytes_on_disk": sum(i.nbytes for i in params.values()),
            "hbm_bytes": hbm,
        })

    errors = any(p["severity"] == "error" for p in problems)
    unsupported = any(p["severity"] == "unsupported" for p in problems)
    return {
        "path": str(path),
        "architecture": ckpt.architecture,
        "quant_method": raw.get("quant_method") if isinstance(raw, dict) else None,
        "format": qc.format if qc is not None else None,
        "kv_cache_scheme": qc.kv_cache_scheme.as_json() if qc is not None and qc.kv_cache_scheme else None,
        "version": qc.version if qc is not None else None,
        "num_tensors": len(ckpt.tensors),
        "num_files": len(ckpt.files),
        "bytes_on_disk": ckpt.bytes_on_disk,
        "servable": not errors and not unsupported,
        "target": target,
        "deep": deep,
        "hbm_bytes_weights": hbm_total,
        "hbm_capacity": chip.hbm_bytes or None,
        "linear_parameters": bits_all[0],
        # Over the quantized linear layers (scales included), or over all linear layers when none is quantized.
        "bits_per_weight": round(bits_q[1] / bits_q[0], 3) if bits_q[0] else
                           round(bits_all[1] / bits_all[0], 3) if bits_all[0] else None,
        "layers": layers,
        "problems": problems,
        "exit_code": 1 if errors else 3 if unsupported else 0,
    }
