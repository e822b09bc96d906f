"""Weight quantization in vectorised numpy: min-max (RTN) and MSE-searched scales. No torch.

The arithmetic follows compressed-tensors step by step (docs/formats.md, "On disk"), including the
rounding to the weight's dtype after each operation, so that for the same bf16 weight and the min-max
observer the stored tensors equal the library's bit for bit. Each function works on a block of whole
rows, so callers can stream a tensor in row chunks with bounded memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from quantkit.formats import packing
from quantkit.formats.compressed_tensors import QuantArgs

FP8_MAX = 448.0
FP4_MAX = 6.0
MX_GROUP = 32
NV_GROUP = 16
FP8_EPS = np.float32(0.125)  # the library's stand-in for a zero fp8 scale (its _get_dtype_eps)


def kind_of(w: QuantArgs) -> str:
    """What quantize_rows does for weight args `w`: "int" (ints, group or channel scales, with zero points when
    asymmetric), "fp8" (e4m3, channel or block scales), "mxfp4" (e2m1) or "mxfp8" (e4m3) with E8M0 scales per
    32, "nvfp4" (e2m1, fp8 scales per 16 under a global scale). ValueError for anything else."""
    if w.type == "int" and w.strategy in ("group", "channel") and w.actorder is None:
        return "int"
    if w.type == "float" and w.num_bits == 8 and w.strategy in ("channel", "block"):
        return "fp8"
    if w.type == "float" and w.num_bits in (4, 8) and w.strategy == "group" and w.group_size == MX_GROUP \
            and w.scale_dtype == "torch.uint8":
        return f"mxfp{w.num_bits}"
    if w.type == "float" and w.num_bits == 4 and w.strategy == "tensor_group" and w.group_size == NV_GROUP:
        return "nvfp4"
    raise ValueError(f"quantkit does not quantize weights as {w.as_json()}")


def _qmax(kind: str, num_bits: int) -> float:
    return {"int": (2 ** num_bits - 1) / 2, "fp8": FP8_MAX, "mxfp4": FP4_MAX, "mxfp8": FP8_MAX, "nvfp4": FP4_MAX}[kind]


def round_to(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Rounds float32 values to `dtype` (as the library's op in that dtype does) and back to float32."""
    if dtype == np.float32:
        return x
    if dtype == ml_dtypes.bfloat16:
        # Round to nearest even on the bits: 2.4x faster than a cast through ml_dtypes; finite inputs only
        # (NaN weights are rejected before anything is written).
        u = x.view(np.uint32)
        r = (u >> 16) & 1
        r += 0x7FFF
        r += u
        r &= 0xFFFF0000
        return r.view(np.float32)
    return x.astype(dtype).astype(np.float32)


def _eps(dtype: np.dtype) -> np.float32:
    return np.float32(ml_dtypes.finfo(dtype).eps)


def _groups(w: np.ndarray, args: QuantArgs) -> np.ndarray:
    """float32 [rows, in] -> [rows, G, g] (groups or one channel group), or [R, C, br*bc] for blocks."""
    rows, cols = w.shape
    if args.strategy == "block":
        br, bc = args.block_structure
        pr, pc = -rows % br, -cols % bc
        if pr or pc:  # ragged edge blocks: zero padding never changes an absmax
            w = np.pad(w, ((0, pr), (0, pc)))
        r, c = w.shape
        return w.reshape(r // br, br, c // bc, bc).transpose(0, 2, 1, 3).reshape(r // br, c // bc, br * bc)
    g = cols if args.strategy == "channel" else args.group_size  # group, tensor_group
    return w.reshape(rows, cols // g, g)


def _ungroup(x: np.ndarray, args: QuantArgs, shape: tuple[int, int]) -> np.ndarray:
    rows, cols = shape
    if args.strategy == "block":
        br, bc = args.block_structure
        r, c = x.shape[0] * br, x.shape[1] * bc
        return x.reshape(x.shape[0], x.shape[1], br, bc).transpose(0, 2, 1, 3).reshape(r, c)[:rows, :cols]
    return x.reshape(rows, cols)


def _mx_exponent(absmax: np.ndarray, dtype: np.dtype, emax: int) -> np.ndarray:
    """E8M0 byte of an MX group: absmax rounded to a power of two (up only from mantissa 1.75, for every element
    type, as the library does), minus the element type's largest exponent `emax` (fp4 2, fp8 e4m3 8), biased
    by 127; done on the bits of `dtype` as the library does."""
    if dtype == np.float32:
        bits, mant, ebits, view = absmax.view(np.uint32).astype(np.int64), 23, 8, np.uint32
    else:
        bits, mant = absmax.astype(dtype).view(np.uint16).astype(np.int64), ml_dtypes.finfo(dtype).nmant
        ebits, view = 15 - mant, np.uint16
    mask = ((1 << (ebits + 1)) - 1) << mant
    p2 = ((bits + (1 << (mant - 2))) & mask).astype(view).view(np.float32 if view == np.uint32 else dtype)
    with np.errstate(divide="ignore"):
        e = 127 + np.floor(np.log2(p2.astype(np.float32))) - emax
    return np.clip(e, 0, 255).astype(np.uint8)


def global_scale(absmax: float, dtype: np.dtype) -> np.float32:
    """NVFP4's global scale of a tensor whose largest |value| is `absmax` (exact in the weight's `dtype`), as the
    library's generate_gparam computes it: 448 * 6 / absmax in the weight's dtype, 1 where that is not finite.
    torch divides a number by a tensor as reciprocal then product, each rounded to the dtype: so here too."""
    a = np.maximum(np.float32(absmax), np.float32(np.finfo(np.float32).tiny))
    with np.errstate(divide="ignore", over="ignore"):
        g = round_to(round_to(np.float32(1) / np.atleast_1d(a), dtype) * np.float32(FP8_MAX * FP4_MAX), dtype)[0]
    return g if np.isfinite(g) else np.float32(1.0)


def _scale(absmax: np.ndarray, kind: str, qmax: float, dtype: np.dtype, gscale=None) -> np.ndarray:
    """Scales (float32 values exactly representable in the stored type) from group absmax; nvfp4: the fp8
    local scale of the library, round_fp8(gscale * (absmax / 6 in the weight dtype)) in float32."""
    if kind.startswith("mxfp"):
        return packing.e8m0_to_float(_mx_exponent(absmax, dtype, 2 if kind == "mxfp4" else 8))
    s = round_to(absmax / np.float32(qmax), dtype)
    if kind == "nvfp4":
        s = np.clip(np.float32(gscale) * s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        return np.where(s == 0, FP8_EPS, s)
    return np.where(s == 0, _eps(dtype), s)


def _asymmetric(lo: np.ndarray, hi: np.ndarray, qmax: float, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Scale and integer zero point (float32) of groups with minimum `lo` and maximum `hi` (widened to hold 0),
    each operation rounded to the weight's dtype as the library computes them: scale = (hi - lo) / (2^b - 1),
    zero point = round(qmin - lo / scale) clamped to the range; an all-zero group gets zero point 0 (the
    library's NaN cast to int8) and the dtype's eps as its scale."""
    qmin = -float(np.ceil(qmax))  # a Python float: float32 arrays stay float32
    lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
    scale = round_to(round_to(hi - lo, dtype) / np.float32(2 * qmax), dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = round_to(np.float32(qmin) - round_to(lo / scale, dtype), dtype)
    z = np.rint(np.nan_to_num(np.clip(z, qmin, float(np.floor(qmax))), nan=0.0))
    return np.where(scale == 0, _eps(dtype), scale), z


def _qdq(x: np.ndarray, scale: np.ndarray, kind: str, qmax: float, dtype: np.dtype,
         zero: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Quantizes grouped x [.., g] with per-group scale (and integer zero point) [.., 1]: (stored values, error
    (q - zero) * scale - x in float32). x / scale is rounded to `dtype` (float32 where the library divides by a
    float32 scale: nvfp4)."""
    y = round_to(x / scale, dtype)
    if kind == "int":  # clamp to the integer range before rounding, as the library does
        if zero is not None:
            y = round_to(y + zero, dtype)
        np.clip(y, -np.ceil(qmax), np.floor(qmax), out=y)  # -8..7 for int4
        np.rint(y, out=y)  # round half to even, like torch.round
        q = y.astype(np.int8)
        if zero is not None:
            y -= zero
    else:
        np.clip(y, -qmax, qmax, out=y)
        if kind in ("fp8", "mxfp8"):
            q = y.astype(ml_dtypes.float8_e4m3fn)
            y = q.astype(np.float32)
        else:  # e2m1 (mxfp4, nvfp4)
            q = packing.fp4_codes(y)
            y = packing.FP4_VALUES[q]
    y *= scale
    y -= x
    return q, y


# llm-compressor's MSE observer defaults: shrink the range by up to 20% in 1% steps, |error|^2.4.
MSE_STEPS = np.arange(0, 20) / 100
MSE_NORM = 2.4


@dataclass
class Quantized:
    """Result of quantize_rows: stored values and scales, and error sums for the report."""

    values: np.ndarray  # [rows, in]: int8 / float8_e4m3fn / fp4 codes (uint8)
    scale: np.ndarray  # [rows, G] or [R, C]: float32 scales (nvfp4: fp8 values), or E8M0 bytes for mxfp4 / mxfp8
    ref2: float  # sum of squared weights (NaN/Inf when the weights hold any)
    err2: float  # sum of squared errors q*scale - w of the chosen scales (float32, before a loader's rounding)
    minmax_err2: float  # the same for the min-max scales, to report what the MSE search gained
    zero: np.ndarray | None = None  # [rows, G] int8 zero points of asymmetric ints


def _sumsq(x: np.ndarray) -> float:
    flat = x.reshape(-1)
    return float(np.dot(flat, flat))  # float32 BLAS dot: ~1e-5 relative, plenty for a report


def quantize_rows(w: np.ndarray, args: QuantArgs, observer: str = "minmax", gscale=None) -> Quantized:
    """Quantizes a block of whole rows of a weight.

    Args:
        w: [rows, in] in the weight's dtype (bfloat16, float16 or float32); for block scales `rows` is
           a multiple of the block height except at the end of the tensor.
        args: the weights' QuantizationArgs (a kind `kind_of` accepts).
        observer: "minmax", or "mse" (per group, the clipping ratio that minimises |error|^2.4; asymmetric:
            the minimum and the maximum shrunk alike).
        gscale: nvfp4's global scale of the whole weight (`global_scale`, shared by fused siblings).
    Returns:
        Quantized (values, scales and zero points in the shapes above, error sums).
    """
    dtype = np.dtype(w.dtype)
    kind = kind_of(args)
    qmax = _qmax(kind, args.num_bits)
    x = _groups(w.astype(np.float32), args)
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)  # exact in the weight dtype

    def params(shrink: float):  # (scale, zero point or None) of the range shrunk by `shrink`
        f = np.float32(1 - shrink)
        if not args.symmetric:
            return _asymmetric(round_to(lo * f, dtype), round_to(hi * f, dtype), qmax, dtype)
        return _scale(round_to(np.maximum(hi, -lo) * f, dtype), kind, qmax, dtype, gscale), None

    # nvfp4 divides by its local scale over the global one, in float32 (the library's order)
    nv = kind == "nvfp4"
    qdq = (lambda s, z: _qdq(x, s / np.float32(gscale), kind, qmax, np.float32)) if nv else \
        (lambda s, z: _qdq(x, s, kind, qmax, dtype, z))
    scale, zero = params(0.0)
    q, err = qdq(scale, zero)
    minmax_err2 = _sumsq(err)
    if observer == "mse":
        best = (np.abs(err) ** MSE_NORM).sum(-1, keepdims=True)
        for shrink in MSE_STEPS[1:]:
            s, z = params(shrink)
            q2, e2 = qdq(s, z)
            cost = (np.abs(e2) ** MSE_NORM).sum(-1, keepdims=True)
            better = cost < best
            best = np.where(better, cost, best)
            scale, zero = np.where(better, s, scale), None if z is None else np.where(better, z, zero)
            q, err = np.where(better, q2, q), np.where(better, e2, err)
    elif observer != "minmax":
        raise ValueError(f"unknown observer {observer!r}")
    stored_scale = packing.float_to_e8m0(scale[..., 0]) if kind.startswith("mxfp") else scale[..., 0]
    err2 = minmax_err2 if observer == "minmax" else _sumsq(err)
    return Quantized(_ungroup(q, args, w.shape), stored_scale, _sumsq(x), err2, minmax_err2,
                     None if zero is None else zero[..., 0].astype(np.int8))
