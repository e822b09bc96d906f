"""`quantkit inspect`: what is in a checkpoint, is it well-formed, and will it serve on the target.

Header-only unless `deep=True`. Never imports torch, jax or compressed-tensors (start-up time matters:
see benchmarks/inspect_speed.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from quantkit.errors import InvalidInput
from quantkit.formats.compressed_tensors import weight_qtype
from quantkit.formats.ct_tensors import check_module_data, served_qtype
from quantkit.formats.hf import Checkpoint
from quantkit.formats.safetensors_io import DTYPES, FLOAT_DTYPES
from quantkit.kernels.tiling import CHIPS, Chip, hbm_bytes
from quantkit.runtime.layout import served_shapes
from quantkit.runtime.validate import ModuleCheck, Validation, problem, validate_checkpoint, weight_path

TARGETS = tuple(CHIPS)
LAYER_KINDS = ("linear", "moe_experts")


def _device_bytes(qtype: str, params: dict, shape: tuple[int, ...] | None, chip: Chip) -> int:
    """HBM bytes for one module on `chip`, in the runtime's layout: weights [..., in, out]
    (out in lanes), scales and zero points [..., groups, out]; int4/mxfp4/nvfp4 packed, int8/fp8/mxfp8 and zero
    points 1 byte, dense weights bf16."""
    total = 0
    if shape is not None and len(shape) >= 2:
        dev_shape = (*shape[:-2], shape[-1], shape[-2])
        bits = {"int4": 4, "mxfp4": 4, "nvfp4": 4, "int8": 8, "fp8": 8, "mxfp8": 8}.get(qtype, 16)
        total += hbm_bytes(dev_shape, bits, chip)
    for param, info in params.items():
        if param in ("weight", "weight_packed") and shape is not None and len(shape) >= 2:
            continue
        if param == "weight_shape":
            continue  # metadata, not loaded
        if param == "weight_g_idx":  # loaded as the int32 row order [in]
            total += hbm_bytes(info.shape, 32, chip)
            continue
        bits = DTYPES[info.dtype][0]
        if info.dtype in FLOAT_DTYPES:
            bits = 32 if info.dtype == "F32" and param != "weight" else 16  # scales keep f32; F16/BF16 -> bf16
        s = info.shape
        dev = (*s[:-2], s[-1], s[-2]) if len(s) >= 2 else s
        if param == "weight_zero_point" and shape is not None and len(s) >= 2:
            bits, dev = 8, (*s[:-2], s[-1], shape[-2])  # unpacked to one int8 per group and column, as the scales
        total += hbm_bytes(dev, bits, chip)
    return total


def _inspect_module(ckpt: Checkpoint, m: ModuleCheck, chip: Chip, deep: bool, served: dict) -> tuple[dict, list[dict]]:
    """One module's row of the report and its problems: the validation's verdict, the --deep findings, the
    serving path on `chip` (judged on the shape the runtime serves: `served`, layout.served_shapes) and its
    HBM bytes."""
    shape, probs = m.shape, [problem("error", m.name, e) for e in m.errors]
    if deep and not m.errors:
        shape, found = check_module_data(m.name, m.scheme, m.params, ckpt.read, shape)
        probs += [problem(*f) for f in found]
    if m.reason or not m.has_weight:
        path, reason = None, m.reason or ""
    else:
        v = weight_path(m.scheme, served.get(m.name, shape), chip)
        path, reason = v.path, "; ".join(filter(None, (v.reason, m.rotation if v.path else "")))
    if path is None and reason:
        probs.append(problem("unsupported", m.name, reason))
    quantized = m.scheme is not None and m.scheme.weights is not None
    qtype = weight_qtype(m.scheme)
    layer = {
        "name": m.name,
        "kind": m.kind,
        "format": m.scheme.format if quantized else "dense",
        "scheme": m.scheme.weights.as_json() if quantized else None,
        "qtype": qtype,
        "shape": list(shape) if shape is not None else None,
        "path": path,
        "servable": not m.errors and (path is not None or not m.has_weight),
        "reason": reason or None,
        "bytes_on_disk": sum(i.nbytes for i in m.params.values()),
        "hbm_bytes": _device_bytes(served_qtype(m.scheme) if quantized else qtype, m.params, shape, chip),
    }
    return layer, probs


def _bits_per_weight(modules: list[ModuleCheck], layers: list[dict]) -> tuple[int, float | None]:
    """(linear parameters, stored bits per weight, scales included) over the quantized linear layers, or
    over all linear layers when none is quantized."""
    bits_all = [0, 0]  # [logical weights, stored bits] over all linear layers
    bits_q = [0, 0]  # the same over quantized linear layers only
    for m, layer in zip(modules, layers):
        if layer["kind"] not in LAYER_KINDS or layer["shape"] is None:
            continue
        n = 1
        for d in layer["shape"]:
            n *= d
        stored = 8 * sum(i.nbytes for p, i in m.params.items() if p.startswith("weight"))
        for acc in (bits_all, bits_q) if layer["qtype"] != "dense" else (bits_all,):
            acc[0] += n
            acc[1] += stored
    acc = bits_q if bits_q[0] else bits_all
    return bits_all[0], round(acc[1] / acc[0], 3) if acc[0] else None


def _report(path: str | Path, ckpt: Checkpoint, checked: Validation, target: str, deep: bool, layers: list[dict],
            problems: list[dict]) -> dict:
    """The report document (docs/cli.md) around the per-module rows."""
    errors = any(p["severity"] == "error" for p in problems)
    unsupported = any(p["severity"] == "unsupported" for p in problems)
    raw, qc = (ckpt.native or {}).get("quantization_config") or checked.raw, checked.qc  # gpt-oss: "mxfp4" as stored
    linear_parameters, bits_per_weight = _bits_per_weight(checked.modules, layers)
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
        "hbm_bytes_weights": sum(layer["hbm_bytes"] for layer in layers),
        "hbm_capacity": CHIPS[target].hbm_bytes or None,
        "linear_parameters": linear_parameters,
        "bits_per_weight": bits_per_weight,
        "layers": layers,
        "problems": problems,
        "exit_code": 1 if errors else 3 if unsupported else 0,
    }


def inspect_checkpoint(path: str | Path, target: str = "v6e", deep: bool = False,
                       progress: Callable[[int, int], None] | None = None) -> dict:
    """Inspects a checkpoint and returns the report (the JSON document of docs/cli.md).

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
    ckpt = Checkpoint.open(path)
    checked = validate_checkpoint(ckpt)
    problems, layers = list(checked.problems), []
    done, total = 0, sum(i.nbytes for i in ckpt.tensors.values())
    served = served_shapes(checked.cfg, checked.qc) if checked.cfg is not None else {}
    for m in checked.modules:
        layer, probs = _inspect_module(ckpt, m, CHIPS[target], deep, served)
        layers.append(layer)
        problems += probs
        done += layer["bytes_on_disk"]
        if progress is not None:
            progress(done, total)
    return _report(path, ckpt, checked, target, deep, layers, problems)
