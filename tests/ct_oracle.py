"""Test oracle: build and decompress real compressed-tensors checkpoints with the
compressed-tensors library itself (no llm-compressor, no hub access).

The library (compressed-tensors 0.20.1) is the reference.  This module only does
the small amount of glue that llm-compressor would otherwise do:

* ``tiny_llama`` builds a small random ``LlamaForCausalLM`` from a ``LlamaConfig``.
* ``make_checkpoint`` applies a quantization config with
  ``apply_quantization_config``, calibrates the WEIGHT qparams with min-max
  statistics fed to the library's own ``calculate_qparams`` (and, for NVFP4, the
  library's ``generate_gparam`` for the global scale), sets static activation scales
  to a fixed value, compresses with ``ModelCompressor.compress_model``, saves with
  ``save_pretrained`` and writes ``quantization_config`` with
  ``ModelCompressor.update_config``.
* ``library_decompress`` reads the safetensors back and runs the library's
  per-format ``BaseCompressor.decompress`` on every quantized module.

Decompressed output: ``library_decompress(path)`` returns float32 numpy arrays
(converted losslessly from the library's own output dtype); the library's output
dtype per tensor is returned by ``library_decompress_dtype(path)`` and the raw
torch tensors by ``library_decompress_torch(path)``.
"""

from __future__ import annotations

import json
import pathlib
from typing import Iterable

import numpy as np
import torch
import transformers

from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.compressors.model_compressors import (
    ModelCompressor,
)
from compressed_tensors.config import CompressionFormat
from compressed_tensors.offload import update_offload_parameter
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStrategy,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from compressed_tensors.quantization.utils import (
    calculate_qparams,
    generate_gparam,
    is_module_quantized,
)
from compressed_tensors.utils.match import match_quantizable_tensors


__all__ = [
    "SCHEMES",
    "EXPECTED_FORMAT",
    "MIXED_GROUPS",
    "EXPECTED_DOWN_PROJ",
    "EXPECTED_DECOMPRESSED_DTYPE",
    "MLP_TARGET",
    "ATTN_TARGET",
    "STATIC_INPUT_SCALE",
    "tiny_llama",
    "original_weights",
    "linear_names",
    "make_checkpoint",
    "read_quantization_config",
    "read_tensors",
    "library_decompress",
    "library_decompress_torch",
    "library_decompress_dtype",
    "library_convert_dequantize",
    "make_actorder_checkpoint",
    "to_activation_order",
]


SCHEMES = [
    "W4A16",
    "W4A16_G32",
    "W4A16_CHANNEL",
    "W4A16_ASYM",
    "W8A16",
    "W8A16_INT",
    "W8A16_ASYM",
    "W3A16",
    "W6A16",
    "W4AFP8",
    "FP8",
    "FP8_DYNAMIC",
    "FP8_BLOCK",
    "MXFP4A16",
    "MXFP6A16",
    "MXFP8A16",
    "NVFP4A16",
    "MIXED",
]

# top-level ``quantization_config.format`` the library chooses for each scheme
EXPECTED_FORMAT = {
    "W4A16": "pack-quantized",
    "W4A16_G32": "pack-quantized",
    "W4A16_CHANNEL": "pack-quantized",
    "W4A16_ASYM": "pack-quantized",
    "W8A16": "pack-quantized",
    "W8A16_INT": "int-quantized",
    "W8A16_ASYM": "pack-quantized",
    "W3A16": "pack-quantized",
    "W6A16": "pack-quantized",
    "W4AFP8": "int-quantized",
    "FP8": "float-quantized",
    "FP8_DYNAMIC": "float-quantized",
    "FP8_BLOCK": "float-quantized",
    "MXFP4A16": "mxfp4-pack-quantized",
    "MXFP6A16": "mxfp6-pack-quantized",
    "MXFP8A16": "mxfp8-quantized",
    "NVFP4A16": "nvfp4-pack-quantized",
    "NVFP4": "nvfp4-pack-quantized",
    "MIXED": "mixed-precision",
    "W8A8": "int-quantized",
    "W4A8": "int-quantized",
}

# MIXED: W4A16 (group 128) on the mlp projections, FP8_DYNAMIC on attention.
# {target: (preset, per-group format)}.  NOTE: the library renumbers config groups
# in module order when it rebuilds the config from the model
# (QuantizationConfig.from_pretrained), so in config.json "group_0" is the
# attention (FP8_DYNAMIC, float-quantized) group and "group_1" the mlp group.
MLP_TARGET = r"re:.*mlp\.(gate|up|down)_proj$"
ATTN_TARGET = r"re:.*self_attn\.(q|k|v|o)_proj$"
MIXED_GROUPS = {
    MLP_TARGET: ("W4A16", "pack-quantized"),
    ATTN_TARGET: ("FP8_DYNAMIC", "float-quantized"),
}

# Tensors stored for model.layers.0.mlp.down_proj (out=256, in=512, bf16 model)
# with the default tiny_llama dims: {scheme: {suffix: (dtype, shape)}}
EXPECTED_DOWN_PROJ = {
    "W4A16": {
        "weight_packed": ("int32", (256, 64)),
        "weight_scale": ("bfloat16", (256, 4)),
        "weight_shape": ("int64", (2,)),
    },
    "W4A16_G32": {
        "weight_packed": ("int32", (256, 64)),
        "weight_scale": ("bfloat16", (256, 16)),
        "weight_shape": ("int64", (2,)),
    },
    "W4A16_CHANNEL": {
        "weight_packed": ("int32", (256, 64)),
        "weight_scale": ("bfloat16", (256, 1)),
        "weight_shape": ("int64", (2,)),
    },
    "W4A16_ASYM": {
        "weight_packed": ("int32", (256, 64)),
        "weight_scale": ("bfloat16", (256, 4)),
        "weight_zero_point": ("int32", (32, 4)),  # packed along dim 0
        "weight_shape": ("int64", (2,)),
    },
    "W8A16": {
        "weight_packed": ("int32", (256, 128)),
        "weight_scale": ("bfloat16", (256, 4)),
        "weight_shape": ("int64", (2,)),
    },
    "W8A16_INT": {
        "weight": ("int8", (256, 512)),
        "weight_scale": ("bfloat16", (256, 4)),
    },
    "W8A16_ASYM": {
        "weight_packed": ("int32", (256, 128)),
        "weight_scale": ("bfloat16", (256, 4)),
        "weight_zero_point": ("int32", (64, 4)),  # packed along dim 0
        "weight_shape": ("int64", (2,)),
    },
    "W3A16": {  # 3-bit values run across int32 words (compressed-tensors >= 0.18)
        "weight_packed": ("int32", (256, 48)),
        "weight_scale": ("bfloat16", (256, 4)),
        "weight_shape": ("int64", (2,)),
    },
    "W6A16": {
        "weight_packed": ("int32", (256, 96)),
        "weight_scale": ("bfloat16", (256, 4)),
        "weight_shape": ("int64", (2,)),
    },
    "W4AFP8": {  # int4 values one per int8 (int-quantized), fp8 dynamic activations
        "weight": ("int8", (256, 512)),
        "weight_scale": ("bfloat16", (256, 4)),
    },
    "FP8": {
        "weight": ("float8_e4m3fn", (256, 512)),
        "weight_scale": ("bfloat16", (1,)),
        "input_scale": ("bfloat16", (1,)),
    },
    "FP8_DYNAMIC": {
        "weight": ("float8_e4m3fn", (256, 512)),
        "weight_scale": ("bfloat16", (256, 1)),
    },
    "FP8_BLOCK": {
        "weight": ("float8_e4m3fn", (256, 512)),
        "weight_scale": ("bfloat16", (2, 4)),
    },
    "MXFP4A16": {
        "weight_packed": ("uint8", (256, 256)),
        "weight_scale": ("uint8", (256, 16)),
    },
    "MXFP6A16": {  # four e2m3 codes in each 3 bytes
        "weight_packed": ("uint8", (256, 384)),
        "weight_scale": ("uint8", (256, 16)),
    },
    "MXFP8A16": {
        "weight": ("float8_e4m3fn", (256, 512)),
        "weight_scale": ("uint8", (256, 16)),
    },
    "NVFP4A16": {
        "weight_packed": ("uint8", (256, 256)),
        "weight_scale": ("float8_e4m3fn", (256, 32)),
        "weight_global_scale": ("float32", (1,)),
    },
    "MIXED": {  # mlp -> W4A16
        "weight_packed": ("int32", (256, 64)),
        "weight_scale": ("bfloat16", (256, 4)),
        "weight_shape": ("int64", (2,)),
    },
}

# dtype of the library's decompressed weights (bf16 model)
EXPECTED_DECOMPRESSED_DTYPE = {s: "bfloat16" for s in SCHEMES}

# value written into every static activation scale (FP8's input_scale)
STATIC_INPUT_SCALE = 0.015625  # 2**-6, exact in every float dtype

# fused groups whose NVFP4 global scales llm-compressor makes equal (vLLM fuses them)
_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


# --------------------------------------------------------------------------- model


def tiny_llama(
    seed: int = 0,
    *,
    hidden: int = 256,
    intermediate: int = 512,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    dtype: torch.dtype = torch.bfloat16,
) -> transformers.LlamaForCausalLM:
    """A tiny random Llama built from ``LlamaConfig`` (no hub access)."""
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model = model.to(dtype)
    model.config.dtype = dtype
    model.eval()
    return model


def linear_names(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def original_weights(seed: int = 0, **model_kwargs) -> dict[str, np.ndarray]:
    """Float32 copies (lossless) of every Linear weight of ``tiny_llama(seed, ...)``."""
    model = tiny_llama(seed, **model_kwargs)
    return {
        f"{n}.weight": m.weight.detach().float().numpy()
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }


# ------------------------------------------------------------------ quant configs


def _scheme(name: str, targets: list[str]) -> QuantizationScheme:
    if name in ("W4A16_G32", "W4A16_CHANNEL"):
        # the W4A16 preset with another group size (-1 = per output channel)
        group_size, strategy = (32, "group") if name == "W4A16_G32" else (-1, "channel")
        return QuantizationScheme(
            targets=targets,
            weights=QuantizationArgs(
                num_bits=4,
                type="int",
                symmetric=True,
                dynamic=False,
                strategy=strategy,
                group_size=group_size,
            ),
        )
    if name == "W8A16_INT":  # the W8A16 preset stored one int8 per weight (int-quantized), not packed
        return preset_name_to_scheme("W8A16", targets).model_copy(update={"format": "int-quantized"})
    if name == "W8A16_ASYM":  # the W8A16 preset with zero points (no preset of the library has them)
        scheme = preset_name_to_scheme("W8A16", targets)
        return scheme.model_copy(update={"weights": scheme.weights.model_copy(update={"symmetric": False})})
    return preset_name_to_scheme(name, targets)


def _quant_config(scheme: str | None, ignore: Iterable[str], kv_strategy: str | None = None) -> QuantizationConfig:
    ignore = list(ignore)
    kv = None if kv_strategy is None else QuantizationArgs(num_bits=8, type="float", strategy=kv_strategy,
                                                           dynamic=False, symmetric=True)
    if scheme is None:  # KV cache scales only
        return QuantizationConfig(config_groups={}, ignore=ignore, kv_cache_scheme=kv)
    if scheme == "MIXED":
        groups = {
            f"group_{i}": _scheme(preset, [target])
            for i, (target, (preset, _)) in enumerate(MIXED_GROUPS.items())
        }
    elif scheme in SCHEMES or scheme in PRESET_SCHEMES:  # another preset: e.g. an unsupported example
        groups = {"group_0": _scheme(scheme, ["Linear"])}
    else:
        raise KeyError(f"unknown scheme {scheme!r}; known: {SCHEMES}")
    return QuantizationConfig(config_groups=groups, ignore=ignore, kv_cache_scheme=kv)


def _detect_cached_attention_in_transformers_5() -> None:
    """compressed-tensors 0.20.1 finds the attention modules that own a KV cache by a `past_key_value(s)`
    argument of their forward; transformers 5 calls it `cache`, and the library then adds no k/v scales
    (silently). Teach its detector the new name (the module attribute and apply.py's imported copy)."""
    import inspect

    from compressed_tensors.quantization.lifecycle import apply, initialize

    original = initialize.is_cached_attention_module
    if getattr(original, "patched", False):
        return

    def detect(module) -> bool:
        return original(module) or (initialize._is_attention_module(module) and hasattr(module, "k_proj")
                                    and "cache" in inspect.signature(module.forward).parameters)

    detect.patched = True
    initialize.is_cached_attention_module = apply.is_cached_attention_module = detect


# -------------------------------------------------------------------- calibration


def _observed_min_max(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max of the weight reduced the way llm-compressor's weight observers do
    (``flatten_for_calibration`` then amin/amax), in the weight's dtype.

    Returns tensors shaped like the library's initialized scale:
    tensor -> [1]; channel -> [out, 1]; group/tensor_group -> [out, in/g];
    block -> [ceil(out/br), ceil(in/bc)].
    """
    w = weight.detach()
    strategy = args.strategy
    if strategy == QuantizationStrategy.TENSOR:
        flat = w.reshape(1, 1, -1)
    elif strategy == QuantizationStrategy.CHANNEL:
        flat = w.unsqueeze(-2).unsqueeze(0)  # (1, rows, 1, cols)
    elif strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP):
        gs = args.group_size
        if w.shape[-1] % gs:
            raise ValueError(f"in_features {w.shape[-1]} not divisible by {gs}")
        flat = w.unflatten(-1, (-1, gs)).unsqueeze(0)  # (1, rows, groups, gs)
    elif strategy == QuantizationStrategy.BLOCK:
        br, bc = args.block_structure
        rows, cols = w.shape[-2:]
        if rows % br or cols % bc:
            raise ValueError(f"weight {tuple(w.shape)} not divisible by block {br}x{bc}")
        flat = (
            w.unflatten(0, (rows // br, br))
            .unflatten(-1, (cols // bc, bc))
            .transpose(1, 2)
            .flatten(-2, -1)
            .unsqueeze(0)
        )  # (1, row_blocks, col_blocks, br*bc)
    else:
        raise ValueError(f"weight strategy {strategy} not supported here")
    return torch.amin(flat, dim=(0, -1)), torch.amax(flat, dim=(0, -1))


def _calibrate_weights(model: torch.nn.Module, fuse_global_scales: bool) -> None:
    quantized = [
        (name, m)
        for name, m in model.named_modules()
        if is_module_quantized(m) and m.quantization_scheme.weights is not None
    ]

    # 1. NVFP4 global scales (library's generate_gparam over the whole tensor)
    for _, m in quantized:
        args = m.quantization_scheme.weights
        if args.strategy == QuantizationStrategy.TENSOR_GROUP:
            w = m.weight.detach()
            gscale = generate_gparam(w.amin(), w.amax())  # float32 [1]
            update_offload_parameter(m, "weight_global_scale", gscale)
    if fuse_global_scales:
        _fuse_global_scales(model)

    # 2. scales / zero points from min-max, via the library's calculate_qparams
    for _, m in quantized:
        args = m.quantization_scheme.weights
        if args.dynamic:
            continue
        gscale = getattr(m, "weight_global_scale", None)
        mn, mx = _observed_min_max(m.weight, args)
        scale, zp = calculate_qparams(mn, mx, args, global_scale=gscale)
        update_offload_parameter(m, "weight_scale", scale)
        if hasattr(m, "weight_zero_point"):
            update_offload_parameter(m, "weight_zero_point", zp)

    # 3. static activation scales: any fixed positive value; NVFP4's input global scale as llm-compressor
    # calibrates it (generate_gparam of the input's range) for a made-up range per input (_input_absmax)
    for name, m in model.named_modules():
        if not is_module_quantized(m):
            continue
        for base in ("input", "output"):
            if hasattr(m, f"{base}_scale"):
                p = getattr(m, f"{base}_scale")
                update_offload_parameter(m, f"{base}_scale", torch.full_like(p, STATIC_INPUT_SCALE))
            if hasattr(m, f"{base}_zero_point"):
                p = getattr(m, f"{base}_zero_point")
                update_offload_parameter(m, f"{base}_zero_point", torch.zeros_like(p))
            if hasattr(m, f"{base}_global_scale"):
                a = torch.tensor(_input_absmax(name))
                update_offload_parameter(m, f"{base}_global_scale", generate_gparam(-a, a).reshape(1))


def _input_absmax(name: str) -> float:
    """A made-up absmax in [1, 5) of the input of module `name`: the same for modules that read one input
    (q/k/v, gate/up), different between layers, experts and inputs."""
    import zlib

    parent, leaf = name.rsplit(".", 1)
    site = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(leaf, leaf)
    return 1 + zlib.crc32(f"{parent}.{site}".encode()) % 1000 / 250


def _fuse_global_scales(model: torch.nn.Module) -> None:
    """What llm-compressor does for NVFP4: q/k/v (and gate/up) share the minimum
    of their global scales, so vLLM can fuse them."""
    for parent in model.modules():
        for group in _FUSED_GROUPS:
            mods = [getattr(parent, n, None) for n in group]
            if any(m is None or not hasattr(m, "weight_global_scale") for m in mods):
                continue
            fused = torch.min(torch.cat([m.weight_global_scale.data for m in mods]))
            for m in mods:
                update_offload_parameter(m, "weight_global_scale", fused.reshape(1))


# ------------------------------------------------------------------- checkpoints


def make_checkpoint(
    path,
    scheme: str | None,
    *,
    seed: int = 0,
    ignore=("lm_head",),
    fuse_global_scales: bool = True,
    kv_scales=None,
    kv_strategy: str = "tensor",
    model: torch.nn.Module | None = None,
    **model_kwargs,
) -> pathlib.Path:
    """Build ``tiny_llama(seed, **model_kwargs)``, quantize every Linear except
    ``ignore`` with ``scheme`` using the library, compress, save (safetensors) and
    write ``quantization_config`` into config.json.  Returns ``path``.

    Dimensions must suit the scheme: in_features divisible by the group size
    (128 for W4A16/W8A16/W4A16_ASYM, 32 MXFP4, 16 NVFP4) and both dims by 128 for
    FP8_BLOCK; keep out_features > 8 (the library cannot unpack a 4-bit zero point
    when out_features <= 8).

    ``fuse_global_scales`` (NVFP4 only): like llm-compressor, give q/k/v and
    gate/up one shared global scale (the minimum of theirs).  With False each
    tensor keeps ``448*6/absmax(tensor)``.

    ``kv_scales``: per layer (k_scale, v_scale), each a float (``kv_strategy``
    "tensor") or one per KV head ("attn_head"): a ``kv_cache_scheme`` (FP8) with
    these scales, set where llm-compressor's calibration would put them.
    ``scheme`` None: KV cache scales only, dense weights.
    ``model``: quantize this (bf16, eval) model instead of ``tiny_llama``.
    """
    path = pathlib.Path(path)
    model = model if model is not None else tiny_llama(seed, **model_kwargs)
    if kv_scales is not None:
        _detect_cached_attention_in_transformers_5()
    config = _quant_config(scheme, ignore, kv_strategy if kv_scales is not None else None)
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        _calibrate_weights(model, fuse_global_scales)
        for layer, (k, v) in zip(model.model.layers, kv_scales or ()):
            attn = layer.self_attn
            attn.k_scale.copy_(torch.as_tensor(k, dtype=attn.k_scale.dtype).reshape(attn.k_scale.shape))
            attn.v_scale.copy_(torch.as_tensor(v, dtype=attn.v_scale.dtype).reshape(attn.v_scale.shape))

    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    compressor.update_config(path)
    return path


# ----------------------------------------------------------------------- reading


def read_quantization_config(path) -> dict:
    with open(pathlib.Path(path) / "config.json") as f:
        return json.load(f)["quantization_config"]


def read_tensors(path) -> dict[str, torch.Tensor]:
    """All tensors of every *.safetensors file under ``path`` (torch, as stored)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(pathlib.Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def _group_format(scheme: QuantizationScheme, top_format: str | None) -> str:
    if scheme.format is not None:
        return CompressionFormat(scheme.format).value
    if top_format and top_format != CompressionFormat.mixed_precision.value:
        return top_format
    return infer_module_format(torch.nn.Linear, scheme).value


def library_decompress_torch(path) -> dict[str, torch.Tensor]:
    """{module + ".weight": the library's dequantized weight, in the library's own
    output dtype} for every quantized module of the checkpoint at ``path``.

    Per config group: ``BaseCompressor.get_value_from_registry(format)``, gather
    ``compression_param_names(scheme)`` of each matching module (the same matching
    as ``CompressedTensorsDequantizer.process``), then ``decompress(state_dict,
    scheme)``.  Unlike the dequantizer, the result is not cast to a fixed dtype.
    """
    qcfg = QuantizationConfig.model_validate(read_quantization_config(path))
    tensors = read_tensors(path)
    out: dict[str, torch.Tensor] = {}
    for scheme in qcfg.config_groups.values():
        fmt = _group_format(scheme, qcfg.format)
        compressor = BaseCompressor.get_value_from_registry(fmt)
        names = compressor.compression_param_names(scheme)
        matched = list(
            match_quantizable_tensors(
                tensors,
                ignore=qcfg.ignore or [],
                targets=scheme.targets,
                param_targets=[names[0]],
            )
        )
        for module_name, _ in matched:
            missing = [n for n in names if f"{module_name}.{n}" not in tensors]
            if missing:
                if names[0] == "weight":
                    # an unquantized module whose tensor is just called "weight"
                    # (e.g. model.embed_tokens under a "Linear" target): skip it
                    continue
                raise KeyError(f"{module_name}: missing {missing} for format {fmt}")
            state = {n: tensors.pop(f"{module_name}.{n}") for n in names}
            result = compressor.decompress(state, scheme)
            out[f"{module_name}.weight"] = result["weight"].detach()
    return dict(sorted(out.items()))


def library_decompress(path) -> dict[str, np.ndarray]:
    """{module + ".weight": float32 numpy array} of the library's dequantized
    weights (exactly the library's values, converted losslessly to float32 from the
    dtype reported by ``library_decompress_dtype``)."""
    result = {}
    for name, t in library_decompress_torch(path).items():
        f32 = t.to(torch.float32)
        if t.dtype.itemsize > 4 or not t.dtype.is_floating_point:  # pragma: no cover
            raise TypeError(f"{name}: {t.dtype} does not convert losslessly to float32")
        result[name] = f32.numpy()
    return result


def library_decompress_dtype(path) -> dict[str, str]:
    """{module + ".weight": library output dtype as a string, e.g. "bfloat16"}."""
    return {
        name: str(t.dtype).removeprefix("torch.")
        for name, t in library_decompress_torch(path).items()
    }


def library_convert_dequantize(
    src, dst, dtype: torch.dtype = torch.bfloat16, ignore: Iterable[str] | None = None
) -> pathlib.Path:
    """Dequantize a whole checkpoint directory with the library's model-free
    ``convert_checkpoint(src, dst, CompressedTensorsDequantizer(src, ignore, dtype))``
    (weights are cast to ``dtype``; quantization_config is dropped from config.json).

    Library quirk (0.20.1): for formats whose root tensor is plain ``weight``
    (float-quantized, naive/int-quantized) a ``"Linear"`` target matches EVERY
    ``*.weight`` name, so ``model.embed_tokens`` is taken for a quantized module and
    conversion fails with "Dependency weight model.embed_tokens.weight_scale not
    found in weight map".  With ``ignore=None`` the modules that have a ``weight``
    but no ``weight_scale`` / ``weight_packed`` are passed as extra ``ignore``.

    Second quirk (0.20.1), not worked around: a checkpoint with static activation
    scales (scheme "FP8": ``input_scale``) is rejected by the dequantizer's
    validation with ``ValueError: Found N residual quantization param(s) after
    dequantization ... input_scale``; use ``library_decompress`` for those.
    """
    from compressed_tensors.entrypoints.convert import (
        CompressedTensorsDequantizer,
        convert_checkpoint,
    )

    if ignore is None:
        names = set(read_tensors(src))
        ignore = sorted(
            n[: -len(".weight")]
            for n in names
            if n.endswith(".weight")
            and n[: -len(".weight")] + ".weight_scale" not in names
            and n[: -len(".weight")] + ".weight_packed" not in names
        )
    converter = CompressedTensorsDequantizer(str(src), ignore=list(ignore), dtype=dtype)
    convert_checkpoint(str(src), str(dst), converter, device="cpu")
    return pathlib.Path(dst)


def make_actorder_checkpoint(path, scheme: str = "W4A16_G32", *, seed: int = 0) -> tuple[pathlib.Path, pathlib.Path]:
    """An activation-ordered GPTQ-style tiny Llama (``actorder: group``, ``weight_g_idx``), as older
    compressed-tensors versions stored them, and its reference weights; compressed-tensors 0.20.1 neither
    writes nor reads g_idx, so the library quantizes a column-permuted copy and the columns go back
    (``to_activation_order``).

    Each quantized Linear [out, in] gets a random permutation ``sigma`` of its input columns; the library
    quantizes the model with ``W[:, sigma]`` (groups contiguous) under ``scheme``. Returns ``(path, dense)`` as
    ``to_activation_order``.
    """
    model = tiny_llama(seed)
    rng = np.random.default_rng(seed + 100)
    sigmas = {}
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head":
                sigmas[name] = torch.as_tensor(rng.permutation(m.in_features))
                m.weight.copy_(m.weight[:, sigmas[name]])
    path = pathlib.Path(path)
    contiguous = make_checkpoint(path.parent / (path.name + "-contiguous"), scheme, model=model)
    return to_activation_order(contiguous, path, sigmas, _scheme(scheme, ["Linear"]).weights.group_size)


def to_activation_order(contiguous, path, sigmas: dict, group: int) -> tuple[pathlib.Path, pathlib.Path]:
    """A pack-quantized checkpoint whose modules were quantized from column-permuted weights (module name ->
    ``sigma``: column j of the quantized weight is input column ``sigma[j]``), turned into the activation-ordered
    layout of the original weights: each module's stored values put back in the original column order
    (unpacked and packed with the library's own helpers), ``weight_g_idx = argsort(sigma) // group`` beside
    them (every group ``group`` columns, scattered), ``actorder: "group"`` in the config.

    Returns ``(path, dense)``: the checkpoint, and ``path.parent / (path.name + "-dense")``, the library's bf16
    dequantization of ``contiguous`` (``library_convert_dequantize``) with every column back in place: the
    weights a correct reader of ``path`` must serve.
    """
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from safetensors.torch import save_file

    path, contiguous = pathlib.Path(path), pathlib.Path(contiguous)
    dense = library_convert_dequantize(contiguous, path.parent / (path.name + "-dense"))

    def back(w, sigma):  # column j of the permuted weight is input column sigma[j]
        out = torch.empty_like(w)
        out[:, sigma] = w
        return out

    for f in sorted(dense.glob("*.safetensors")):
        t = {k: v.contiguous() for k, v in read_tensors_file(f).items()}
        for name, sigma in sigmas.items():
            if f"{name}.weight" in t:
                t[f"{name}.weight"] = back(t[f"{name}.weight"], sigma)
        save_file(t, str(f), metadata={"format": "pt"})
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((contiguous / "config.json").read_text())
    bits = next(iter(config["quantization_config"]["config_groups"].values()))["weights"]["num_bits"]
    for f in sorted(contiguous.glob("*")):
        if f.suffix != ".safetensors":
            if f.is_file():
                (path / f.name).write_bytes(f.read_bytes())
            continue
        t = read_tensors_file(f)
        for name, sigma in sigmas.items():
            key = f"{name}.weight_packed"
            if key in t:
                out, inp = (int(x) for x in t[f"{name}.weight_shape"])
                q = unpack_from_int32(t[key], bits, torch.Size([out, inp]))
                t[key] = pack_to_int32(back(q, sigma), bits)
                t[f"{name}.weight_g_idx"] = (torch.argsort(sigma) // group).to(torch.int32)
        save_file(t, str(path / f.name), metadata={"format": "pt"})
    for g in config["quantization_config"]["config_groups"].values():
        g["weights"]["actorder"] = "group"
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path, dense


def read_tensors_file(f) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(f))


def library_quantize_checkpoint(src, dst, scheme: str, ignore=("lm_head", r"re:.*mlp\.gate$")) -> pathlib.Path:
    """The library's quantization of a saved bf16 checkpoint without its model class: every 2-D
    ``*_proj.weight`` becomes an ``nn.Linear`` of that name in a bare module tree (a MoE's per-expert
    ``mlp.experts.E.gate_proj`` included; routers, embeddings, norms and lm_head left as they are), which
    ``make_checkpoint``'s own steps quantize (apply_quantization_config, min-max calibration with fused
    NVFP4 global scales, compress_model); the other tensors and files are copied and the library writes
    quantization_config into config.json (``ignore`` recorded there: by default lm_head and MoE routers, which
    stay dense). For schemes ``quantkit convert`` does not write (MXFP6A16, W3A16...) on models whose experts
    transformers keeps as fused parameters."""
    from safetensors.torch import save_file

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    tensors = read_tensors(src)
    root = torch.nn.Module()
    for name, t in tensors.items():
        if name.endswith("_proj.weight") and t.ndim == 2:
            parent = root
            *path, leaf = name.removesuffix(".weight").split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            lin = torch.nn.Linear(t.shape[1], t.shape[0], bias=False, dtype=t.dtype)
            lin.weight.data.copy_(t)
            parent.add_module(leaf, lin)
    apply_quantization_config(root, _quant_config(scheme, ignore), show_progress=False)
    with torch.no_grad():
        _calibrate_weights(root, True)
    compressor = ModelCompressor.from_pretrained_model(root)
    compressor.compress_model(root)
    quantized = {k: v.contiguous() for k, v in root.state_dict().items()}
    out = {k: v for k, v in tensors.items() if k not in {n for n in tensors if n.endswith("_proj.weight")}}
    dst.mkdir(parents=True, exist_ok=True)
    save_file({**out, **quantized}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            (dst / f.name).write_bytes(f.read_bytes())
    compressor.update_config(dst)
    config = json.loads((dst / "config.json").read_text())  # the library lists only ignored modules it saw
    config["quantization_config"]["ignore"] = list(ignore)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def fake_quantize_inputs(model: torch.nn.Module, scheme: str, skip: Iterable[str] = ("lm_head",),
                         global_scales: dict | None = None) -> torch.nn.Module:
    """Hooks the library's dynamic activation quantization onto the input of every ``nn.Linear`` of ``model``
    but those named in ``skip`` (what its ``forward_quantize`` does to a quantized module's input:
    ``compute_dynamic_scales_and_zp`` then ``fake_quantize`` with the preset's ``input_activations``), and of
    every ``F.linear`` of a fused-experts module (transformers 5 keeps MoE experts as 3-D parameters): the
    reference forward of a W8A8 / W4A8 checkpoint run by transformers on its dequantized weights. Rows go to
    the library as [batch, tokens, k]: given 2-D rows, its token strategy would take one scale for all.
    NVFP4: ``global_scales`` (``input_global_scales`` of the checkpoint) gives each module's
    ``input_global_scale`` (a fused expert's F.linear: its expert's, found by its weight)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = PRESET_SCHEMES[scheme]["input_activations"]

    def fq(x, module, name):  # rows as [batch, tokens, k]: the library's token strategy reduces the last dim alone
        x3 = x if x.ndim == 3 else x[None]
        g = None if global_scales is None else global_scales[name]
        scale, zp = compute_dynamic_scales_and_zp(x3, args, module, global_scale=g)
        return fake_quantize(x3, scale, zp, args, global_scale=g).reshape(x.shape)

    names = {m: n for n, m in model.named_modules()}

    def hook(module, inputs):
        return (fq(inputs[0], module, names[module]), *inputs[1:])

    linear = torch.nn.functional.linear

    def expert_of(module, w):  # the per-expert module name of one expert's weight
        for param, leaf in (("gate_up_proj", "gate_proj"), ("down_proj", "down_proj")):
            for e, we in enumerate(getattr(module, param)):
                if we.data_ptr() == w.data_ptr():
                    return f"{names[module]}.{e}.{leaf}"
        raise AssertionError("not an expert weight")

    def experts_forward(module, forward):  # fused 3-D expert weights (transformers 5): each F.linear's input
        def run(*a, **kw):
            torch.nn.functional.linear = lambda x, w, b=None: linear(fq(x, module, expert_of(module, w)), w, b)
            try:
                return forward(*a, **kw)
            finally:
                torch.nn.functional.linear = linear
        return run

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] not in skip:
            module.register_forward_pre_hook(hook)
        elif isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
            # transformers' default grouped_mm experts never call F.linear: the hook would see nothing
            assert getattr(model.config, "_experts_implementation", "eager") == "eager", \
                "load the reference with experts_implementation='eager'"
            module.forward = experts_forward(module, module.forward)
    return model


def online_input_transforms(model: torch.nn.Module, path) -> torch.nn.Module:
    """Hooks, first, onto the input of every Linear of ``model`` that checkpoint ``path``'s transform_config
    gives an online input transform, the library's own ``HadamardTransform`` over the matrix (and perm) the
    checkpoint stores for that group and size (the library stores a matrix shared by modules once): the
    reference forward of a QuIP / SpinQuant-style checkpoint on its dequantized weights."""
    from compressed_tensors.transform import TransformConfig
    from compressed_tensors.transform.factory.hadamard import HadamardTransform
    from compressed_tensors.utils import match_named_modules

    config = TransformConfig.model_validate(read_quantization_config(path)["transform_config"])
    tensors = read_tensors(path)
    for group, scheme in config.config_groups.items():
        for args in scheme.apply:
            if args.location != "input":
                continue
            for name, module in match_named_modules(model, args.targets, args.ignore):
                size = scheme.head_dim or module.in_features
                key = next(k for k, v in tensors.items() if k.endswith(f".{group}_input.weight") and v.shape[0] == size)
                perm = tensors.get(key.removesuffix("weight") + "perm")
                transform = HadamardTransform(torch.nn.Parameter(tensors[key], requires_grad=False),
                                              None if perm is None else torch.nn.Parameter(perm, requires_grad=False),
                                              scheme, args, torch.nn.Linear)
                module.register_forward_pre_hook(lambda m, a, t=transform: (t(a[0]), *a[1:]), prepend=True)
    return model


def without_transform_matrices(src, dst) -> pathlib.Path:
    """A copy of checkpoint ``src`` without its online transforms' matrices (``*_input.weight`` / ``.perm``),
    which the library's dequantizer refuses as orphan parameters."""
    tensors = {k: v for k, v in read_tensors(src).items() if not k.endswith(("_input.weight", "_input.perm"))}
    return _copy_checkpoint(src, dst, tensors)


def input_global_scales(path) -> dict:
    """Module name -> its ``input_global_scale`` in checkpoint ``path`` (NVFP4 activations)."""
    suffix = ".input_global_scale"
    return {k.removesuffix(suffix): v for k, v in read_tensors(path).items() if k.endswith(suffix)}


def with_float32_scales(src, dst) -> pathlib.Path:
    """A copy of checkpoint ``src`` with its ``*_scale`` tensors upcast (losslessly) to float32: the library then
    dequantizes in float32 (it computes in the scales' dtype), each weight the exact product of its code and
    scale, as the runtime does in a float32 parity test."""
    return _copy_checkpoint(src, dst, {k: v.float() if k.endswith("_scale") else v for k, v in read_tensors(src).items()})


def without_input_global_scales(src, dst) -> pathlib.Path:
    """A copy of NVFP4 checkpoint ``src`` without its ``input_global_scale`` tensors, which the library's
    dequantizer (convert_checkpoint) refuses as orphan parameters: what it dequantizes are the weights."""
    tensors = {k: v for k, v in read_tensors(src).items() if not k.endswith(".input_global_scale")}
    return _copy_checkpoint(src, dst, tensors)


def _copy_checkpoint(src, dst, tensors: dict) -> pathlib.Path:
    """Checkpoint ``src``'s files but its safetensors into ``dst``, with ``tensors`` as its one safetensors file."""
    from safetensors.torch import save_file

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst
