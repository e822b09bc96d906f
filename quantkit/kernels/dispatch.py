"""Which runtime path serves a weight, or why none can (ARCHITECTURE.md rule 7).

Every predicate returns a verdict with a reason; callers fall back (gmm_v2 -> xla) or refuse, and the
reason surfaces in `quantkit inspect`. Imports nothing heavy: `inspect` uses it on its header-only path.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.formats.compressed_tensors import SPARSE_FORMATS, QuantArgs, Scheme, weight_qtype
from quantkit.kernels.tiling import LANES, Chip, Tiles, choose_tiles

# Weight types the runtime keeps quantized on device (int4 symmetric, fp8 e4m3, mxfp4).
SERVED_QTYPES = ("int4", "fp8", "mxfp4")


@dataclass(frozen=True)
class Verdict:
    path: str | None  # "gmm_v2" | "xla" | "dense" | None
    reason: str  # why not servable, or why the fallback; "" when nothing to say

    @property
    def servable(self) -> bool:
        return self.path is not None


def _act_reason(name: str, a: QuantArgs | None) -> str | None:
    if a is None:
        return None
    if name == "output_activations":
        return (f"output activation quantization ({a.type}{a.num_bits} {a.strategy}) is not supported by the "
                "runtime; re-quantize without output_activations")
    if a.type == "float" and a.num_bits == 8:
        return None  # fp8 activations: the runtime keeps activations in bf16 (reported as a warning)
    return (f"{a.type}{a.num_bits} {a.strategy} input activation quantization is not implemented by the runtime "
            "(it runs bf16 activations and honours only fp8 activation schemes); "
            "convert to W4A16 or FP8_DYNAMIC with `quantkit convert`")


def unsupported_reason(scheme: Scheme) -> str | None:
    """Why the runtime cannot serve weights stored under `scheme` at all, or None if it can."""
    w, fmt = scheme.weights, scheme.format
    if fmt in SPARSE_FORMATS:
        return (f"sparse format {fmt} is not supported (its compressor was removed in compressed-tensors 0.15); "
                "densify the checkpoint first")
    for name in ("input_activations", "output_activations"):
        reason = _act_reason(name, getattr(scheme, name))
        if reason:
            return reason
    if w is None or fmt == "dense":
        return None
    qtype = weight_qtype(scheme)
    if qtype == "nvfp4":
        return ("NVFP4 (fp4 with fp8 block-16 scales and a global scale) is not supported yet; "
                "convert to MXFP4A16 or W4A16 with `quantkit convert`")
    if qtype.startswith("mxfp") and qtype != "mxfp4":
        return f"{qtype.upper()} ({fmt}) is not supported yet; convert to MXFP4A16 or FP8_DYNAMIC"
    if w.type == "int":
        if not w.symmetric:
            return (f"asymmetric int{w.num_bits} weights with zero points (W{w.num_bits}A16_ASYM) are not supported: "
                    "the runtime serves symmetric int4; re-quantize with `quantkit convert --scheme W4A16`")
        if w.actorder == "group":
            return ("activation-ordered groups (actorder=group, weight_g_idx) permute input columns and are not "
                    "supported; re-quantize with actorder=weight or without actorder")
        if w.num_bits != 4:
            return (f"int{w.num_bits} weights (W{w.num_bits}A16) are not supported: the runtime serves int4 "
                    "(W4A16), fp8 and mxfp4; convert with `quantkit convert --scheme W4A16` or FP8_DYNAMIC")
        if fmt != "pack-quantized":
            return f"int4 weights stored as {fmt} are not supported; only pack-quantized int4 is"
        if w.strategy not in ("group", "channel"):
            return f"int4 with {w.strategy} scales is not supported; only group and channel scales are"
        return None
    if w.type == "float" and w.num_bits == 8:
        if fmt != "float-quantized":
            return f"fp8 weights stored as {fmt} are not supported; only float-quantized fp8 is"
        if w.strategy not in ("tensor", "channel", "block"):
            return f"fp8 with {w.strategy} scales is not supported; only tensor, channel and block scales are"
        return None
    if qtype == "mxfp4":
        return None
    return f"{w.type}{w.num_bits} weights in format {fmt} are not supported"


def can_use_gmm_v2(qtype: str, k: int, n: int, group_size: int | None, chip: Chip, m: int = 256, g: int = 1,
                   scale_bytes: int = 2) -> tuple[Tiles | None, str]:
    """Tiles with which the Pallas gmm_v2 kernel serves a [k, n] weight of `qtype` on `chip`, or None
    and why not (the caller falls back to the XLA path).

    Args:
        qtype: "int4" | "fp8" | "mxfp4".
        k, n: input and output features.
        group_size: scale group along k (None, -1 or k for channel scales).
        chip: target facts.
        m, g: rows per call and number of groups (experts); m = 256 stands for a decode batch.
        scale_bytes: bytes per stored scale.
    """
    if not chip.tpu:
        return None, f"{chip.name}: Pallas TPU kernels need a TPU target"
    if qtype not in SERVED_QTYPES:
        return None, f"{qtype} is not a gmm_v2 weight type"
    if k % LANES or n % LANES:
        return None, f"[{k}, {n}] is not a multiple of {LANES} in both dimensions (TPU block rule)"
    group = k if not group_size or group_size < 0 else group_size
    if k % group:
        return None, f"group size {group} does not divide in_features {k}"
    tiles = choose_tiles(m, k, n, g, qtype, group, scale_bytes, chip)
    if tiles is None:
        return None, f"no tiling of [{k}, {n}] with group {group} fits {chip.name} VMEM"
    return tiles, ""


def weight_path(scheme: Scheme | None, shape: tuple[int, ...] | None, chip: Chip) -> Verdict:
    """The serving path for one module's weight [..., out, in] under `scheme` on `chip`."""
    if scheme is None or scheme.weights is None or scheme.format == "dense":
        reason = unsupported_reason(scheme) if scheme is not None else None
        return Verdict(None, reason) if reason else Verdict("dense", "")
    reason = unsupported_reason(scheme)
    if reason:
        return Verdict(None, reason)
    if shape is None or len(shape) < 2:
        return Verdict(None, "weight shape unknown")
    out, inp = shape[-2:]
    w = scheme.weights
    qtype = weight_qtype(scheme)
    # The kernel's k-group (quant/qtensor.py): fp8 blocks become groups of the block width.
    group = w.block_structure[1] if w.strategy == "block" else w.group_size if w.strategy == "group" else inp
    tiles, why = can_use_gmm_v2(qtype, inp, out, group, chip, scale_bytes=1 if qtype == "mxfp4" else 2)
    return Verdict("gmm_v2", "") if tiles else Verdict("xla", f"XLA fallback: {why}")
