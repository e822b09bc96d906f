"""What `quantkit convert` writes, per scheme it writes (W4A16 group or channel, FP8_DYNAMIC, FP8_BLOCK,
MXFP4A16): the config group as the library serializes it, the stored tensors of each Linear and their rows,
and the rewritten config.json.
"""

from __future__ import annotations

from quantkit.formats.compressed_tensors import QuantArgs
from quantkit.formats.ct_tensors import ceil_div

SCHEMES = ("W4A16", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "MXFP4A16", "DENSE")  # --scheme (DENSE: bf16, no config)

def writable_group(scheme: str, group_size: int) -> dict:
    """The config group (library serialization) for a scheme quantkit writes: W4A16 (group or
    channel), FP8_DYNAMIC, FP8_BLOCK, MXFP4A16. Targets are "Linear"; `ignore` lists the rest."""
    fp8_token = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    if scheme == "W4A16":
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False,
                   "strategy": "channel" if group_size == -1 else "group", "group_size": group_size}
        return {"targets": ["Linear"], "weights": weights, "input_activations": None,
                "output_activations": None, "format": "pack-quantized"}
    if scheme == "FP8_DYNAMIC":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel"}
        return {"targets": ["Linear"], "weights": weights, "input_activations": fp8_token,
                "output_activations": None, "format": "float-quantized"}
    if scheme == "FP8_BLOCK":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "block",
                   "block_structure": [128, 128]}
        acts = {**fp8_token, "strategy": "group", "group_size": 128}
        return {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                "output_activations": None, "format": "float-quantized"}
    if scheme == "MXFP4A16":
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False, "strategy": "group",
                   "group_size": 32, "scale_dtype": "torch.uint8"}
        return {"targets": ["Linear"], "weights": weights, "input_activations": None,
                "output_activations": None, "format": "mxfp4-pack-quantized"}
    raise ValueError(f"quantkit does not write scheme {scheme!r}")


def writable_config(scheme: str, group_size: int, ignore: list[str], version: str = "0.20.1") -> dict:
    """A complete `quantization_config` for one writable scheme (see writable_group)."""
    group = writable_group(scheme, group_size)
    return {
        "quant_method": "compressed-tensors", "format": group["format"], "quantization_status": "compressed",
        "version": version, "config_groups": {"group_0": group}, "ignore": ignore, "kv_cache_scheme": None,
        "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None,
    }


def stored_layout(scheme: str, group_size: int, shape: tuple[int, int], dtype: str) -> dict[str, tuple[str, tuple]]:
    """Tensors a Linear weight [out, in] of float `dtype` becomes: {param: (dtype name, shape)}."""
    out, inp = shape
    if scheme == "W4A16":
        groups = 1 if group_size == -1 else ceil_div(inp, group_size)
        return {"weight_packed": ("I32", (out, ceil_div(inp * 4, 32))), "weight_scale": (dtype, (out, groups)),
                "weight_shape": ("I64", (2,))}
    if scheme == "FP8_DYNAMIC":
        return {"weight": ("F8_E4M3", (out, inp)), "weight_scale": (dtype, (out, 1))}
    if scheme == "FP8_BLOCK":
        return {"weight": ("F8_E4M3", (out, inp)), "weight_scale": (dtype, (ceil_div(out, 128), ceil_div(inp, 128)))}
    if scheme == "MXFP4A16":
        return {"weight_packed": ("U8", (out, inp // 2)), "weight_scale": ("U8", (out, inp // 32))}
    raise ValueError(f"quantkit does not write scheme {scheme!r}")



def stored_rows(spec, values, scale, r0: int, shape: tuple[int, int], scale_dtype) -> dict[str, tuple]:
    """The stored tensors of rows r0.. of a weight [out, in] quantized with `spec` (a writable_spec).

    Args:
        values, scale: the rows' quantized values and scales as quantize_rows returns them.
        r0: the chunk's first weight row (a multiple of the block height for block scales).
        shape: the whole weight's [out, in]; pack-quantized also stores it, with the first chunk.
        scale_dtype: the stored scale dtype (the weight's), except MXFP4's E8M0 bytes.
    Returns:
        {param: (array, its first row in the stored tensor)}.
    """
    import numpy as np

    from quantkit.formats import packing

    if spec.kind == "mxfp4":
        return {"weight_packed": (packing.pack_fp4(values), r0), "weight_scale": (scale, r0)}
    scales = (scale.astype(scale_dtype), r0 // spec.block[0] if spec.block else r0)
    if spec.kind == "fp8":
        return {"weight": (values, r0), "weight_scale": scales}
    out = {"weight_packed": (packing.pack_int(values, spec.num_bits), r0), "weight_scale": scales}
    return out | ({"weight_shape": (np.array(shape, np.int64), 0)} if r0 == 0 else {})


def stored_row_range(w: QuantArgs, param: str, r0: int, r1: int) -> tuple[int, int]:
    """The rows of stored tensor `param` (the weight or its scales) that hold weight rows r0..r1."""
    if param == "weight_scale" and w.strategy == "tensor":
        return 0, 1
    if param == "weight_scale" and w.strategy == "block":
        return r0 // w.block_structure[0], ceil_div(r1, w.block_structure[0])
    return r0, r1


def output_config(config: dict, scheme: str, group_size: int, ignore: list[str]) -> dict:
    """SRC's config.json rewritten for the converted checkpoint: with the `quantization_config` of a
    writable scheme, or for DENSE without one and with bfloat16 as the dtype."""
    if scheme != "DENSE":
        return {**config, "quantization_config": writable_config(scheme, group_size, ignore)}
    dense = {k: v for k, v in config.items() if k != "quantization_config"}
    return dense | {k: "bfloat16" for k in ("torch_dtype", "dtype") if k in dense}
