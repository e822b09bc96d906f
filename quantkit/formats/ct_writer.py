"""What `quantkit convert` writes: for each --scheme the library's preset as one Scheme (the weights' and
activations' QuantArgs and the storage format), its config group as the library serializes it, the stored
tensors of each Linear and their rows, and the rewritten config.json.
"""

from __future__ import annotations

from quantkit.formats.compressed_tensors import PRESETS, QuantArgs, Scheme
from quantkit.formats.ct_tensors import ceil_div, expected_scale_shape

# --scheme (DENSE: bf16); W8A16_ASYM is the one the library has no preset of: W8A16 with zero points. W8A8 and
# W4A8: dynamic per-token int8 activations (config only: nothing to calibrate)
SCHEMES = ("W4A16", "W4A16_ASYM", "W8A16", "W8A16_ASYM", "W8A8", "W4A8", "W4AFP8", "FP8", "FP8_DYNAMIC", "FP8_BLOCK",
           "MXFP4A16", "MXFP8A16", "NVFP4A16", "NVFP4", "DENSE")  # FP8 and NVFP4: planned, not written (calibration)
GROUPED = ("W4A16", "W4A16_ASYM", "W8A16", "W8A16_ASYM", "W4A8", "W4AFP8")  # the schemes --group-size sets (-1: channel)


def divisor_hint(n: int) -> str:
    """What to do when a group size does not divide `n` input features: the group sizes that do."""
    good = [g for g in (16, 32, 64, 128, 256, 512, 1024) if n % g == 0]
    return (f"group sizes that divide it: {', '.join(map(str, good))}, or -1 (channel)" if good
            else "use --group-size -1 (one scale per output channel)")


def writable_scheme(scheme: str, group_size: int) -> Scheme:
    """The Scheme `convert --scheme` writes and `plan --scheme` plans: the library's preset of that name,
    targeting "Linear"; GROUPED ones with `group_size` (-1: one scale per output channel). ValueError for DENSE
    (no quantization_config) and names not in SCHEMES."""
    if scheme not in SCHEMES or scheme == "DENSE":
        raise ValueError(f"quantkit does not write scheme {scheme!r}")
    preset = PRESETS.get(scheme) or PRESETS[scheme.removesuffix("_ASYM")]
    weights = preset["weights"]
    if scheme.endswith("_ASYM"):
        weights = {**weights, "symmetric": False}
    if scheme in GROUPED:
        weights = {**weights, "strategy": "channel" if group_size == -1 else "group", "group_size": group_size}
    w = QuantArgs.parse(weights, scheme)
    acts = preset.get("input_activations")
    mx = w.scale_dtype == "torch.uint8"
    # int weights with quantized activations: the library stores them unpacked, one int8 each
    fmt = ("int-quantized" if acts else "pack-quantized") if w.type == "int" else "nvfp4-pack-quantized" \
        if w.strategy == "tensor_group" else "mxfp4-pack-quantized" if w.num_bits == 4 else "mxfp8-quantized" if mx \
        else "float-quantized"
    return Scheme(scheme, ("Linear",), fmt, w, QuantArgs.parse(acts, scheme) if acts else None)


def writable_config(scheme: str, group_size: int, ignore: list[str], version: str = "0.20.1") -> dict:
    """A complete `quantization_config` for one writable scheme (see writable_scheme)."""
    s = writable_scheme(scheme, group_size)
    acts = s.input_activations.as_json() if s.input_activations else None
    group = {"targets": list(s.targets), "weights": s.weights.as_json(), "input_activations": acts,
             "output_activations": None, "format": s.format}
    return {
        "quant_method": "compressed-tensors", "format": s.format, "quantization_status": "compressed",
        "version": version, "config_groups": {"group_0": group}, "ignore": ignore, "kv_cache_scheme": None,
        "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None,
    }


def stored_layout(s: Scheme, shape: tuple[int, int], dtype: str) -> dict[str, tuple[str, tuple]]:
    """Tensors a Linear weight [out, in] of float `dtype` becomes under writable Scheme `s`:
    {param: (dtype name, shape)}; scales in the weight's dtype except the MX types' E8M0 bytes and NVFP4's fp8
    (with its float32 global scale)."""
    out, inp = shape
    scale = expected_scale_shape(s.weights, (), out, inp) or (1,)  # (1,): per tensor
    if s.format == "pack-quantized":
        bits = s.weights.num_bits
        zero = {} if s.weights.symmetric else {"weight_zero_point": ("I32", (ceil_div(out * bits, 32), scale[-1]))}
        return {"weight_packed": ("I32", (out, ceil_div(inp * bits, 32))),
                "weight_scale": (dtype, scale), **zero, "weight_shape": ("I64", (2,))}
    if s.format == "int-quantized":
        return {"weight": ("I8", (out, inp)), "weight_scale": (dtype, scale)}
    if s.format == "mxfp4-pack-quantized":
        return {"weight_packed": ("U8", (out, inp // 2)), "weight_scale": ("U8", scale)}
    if s.format == "nvfp4-pack-quantized":
        return {"weight_packed": ("U8", (out, inp // 2)), "weight_scale": ("F8_E4M3", scale),
                "weight_global_scale": ("F32", (1,))}
    if s.format == "mxfp8-quantized":
        return {"weight": ("F8_E4M3", (out, inp)), "weight_scale": ("U8", scale)}
    return {"weight": ("F8_E4M3", (out, inp)), "weight_scale": (dtype, scale)}


def stored_rows(s: Scheme, values, scale, r0: int, shape: tuple[int, int], scale_dtype, zero=None,
                gscale=None) -> dict[str, tuple]:
    """The stored tensors of rows r0.. of a weight [out, in] quantized under writable Scheme `s`.

    Args:
        values, scale, zero: the rows' quantized values, scales and zero points (asymmetric ints) as
            quantize_rows returns them.
        r0: the chunk's first weight row (a multiple of the block height for block scales, of the rows
            packed in one int32 word of zero points for those: `row_alignment`).
        shape: the whole weight's [out, in]; pack-quantized also stores it, with the first chunk.
        scale_dtype: the stored scale dtype (the weight's), except the MX types' E8M0 bytes and NVFP4's fp8.
        gscale: NVFP4's global scale (stored with the first chunk).
    Returns:
        {param: (array, its first row in the stored tensor)}.
    """
    import ml_dtypes
    import numpy as np

    from quantkit.formats import packing

    if s.format == "mxfp4-pack-quantized":
        return {"weight_packed": (packing.pack_fp4(values), r0), "weight_scale": (scale, r0)}
    if s.format == "nvfp4-pack-quantized":
        out = {"weight_packed": (packing.pack_fp4(values), r0),
               "weight_scale": (scale.astype(ml_dtypes.float8_e4m3fn), r0)}
        return out | ({"weight_global_scale": (np.array([gscale], np.float32), 0)} if r0 == 0 else {})
    if s.format == "mxfp8-quantized":
        return {"weight": (values, r0), "weight_scale": (scale, r0)}
    scales = (scale.astype(scale_dtype), stored_row_range(s, "weight_scale", r0, r0 + 1)[0])
    if s.format == "float-quantized":
        return {"weight": (values, r0), "weight_scale": scales}
    if s.format == "int-quantized":
        return {"weight": (values.astype(np.int8), r0), "weight_scale": scales}
    bits = s.weights.num_bits
    out = {"weight_packed": (packing.pack_int(values, bits), r0), "weight_scale": scales}
    if zero is not None:  # packed along the output rows: [ceil(rows * b / 32), groups]
        out["weight_zero_point"] = (packing.pack_int(zero.T, bits).T, r0 * bits // 32)
    return out | ({"weight_shape": (np.array(shape, np.int64), 0)} if r0 == 0 else {})


def row_alignment(s: Scheme) -> int:
    """Weight rows a chunk of a quantized weight starts at a multiple of: a block's height, or the rows whose
    packed zero points share an int32 word (32 / bits)."""
    w = s.weights
    if w.strategy == "block":
        return w.block_structure[0]
    return 32 // w.num_bits if _packed_zeros(s) else 1


def _packed_zeros(s: Scheme) -> bool:
    return s.format == "pack-quantized" and not s.weights.symmetric


def stored_row_range(s: Scheme, param: str, r0: int, r1: int) -> tuple[int, int]:
    """The rows of stored tensor `param` (the weight, its scales or zero points) that hold weight rows r0..r1."""
    w = s.weights
    if (param == "weight_scale" and w.strategy == "tensor") or param == "weight_global_scale":
        return 0, 1
    if param == "weight_scale" and w.strategy == "block":
        return r0 // w.block_structure[0], ceil_div(r1, w.block_structure[0])
    if param == "weight_zero_point" and _packed_zeros(s):  # packed along the rows, r0 aligned (row_alignment)
        return r0 * w.num_bits // 32, ceil_div(r1 * w.num_bits, 32)
    return r0, r1


def output_config(config: dict, scheme: str, group_size: int, ignore: list[str]) -> dict:
    """SRC's config.json rewritten for the converted checkpoint: with the `quantization_config` of a
    writable scheme, or for DENSE without one and with bfloat16 as the dtype."""
    if scheme != "DENSE":
        return {**config, "quantization_config": writable_config(scheme, group_size, ignore)}
    dense = {k: v for k, v in config.items() if k != "quantization_config"}
    return dense | {k: "bfloat16" for k in ("torch_dtype", "dtype") if k in dense}
