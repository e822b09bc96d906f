"""OpenAI's own gpt-oss checkpoint layout, seen as per-expert Linears.

gpt-oss keeps each MoE layer's experts in 3-D tensors, gate and up interleaved along the intermediate axis
(gate = even columns, up = odd: transformers' GptOssExperts):
- bf16: `mlp.experts.gate_up_proj` [E, hidden, 2I] and `down_proj` [E, I, hidden] ([in, out] per expert),
  with `gate_up_proj_bias` [E, 2I] and `down_proj_bias` [E, hidden];
- as published (`quantization_config: {"quant_method": "mxfp4", "modules_to_not_convert": [...]}`): the
  weights as `<name>_blocks` uint8 [E, out, in / 32, 16] (two e2m1 codes a byte, the even column in the low
  nibble) and `<name>_scales` uint8 [E, out, in / 32] (E8M0: 2^(s - 127)), rows in [out, in] order; the
  biases as in bf16 (transformers' integrations/mxfp4.py `convert_moe_packed_tensors`).

`split_experts` turns such a checkpoint into the layout llm-compressor and `quantkit convert` write, one Linear
per expert and part (`mlp.experts.{e}.gate_proj` ...: weight [out, in], bias [out]), by name only: each
per-expert tensor is read from the 3-D one when asked for. MXFP4 blocks and scales become compressed-tensors
MXFP4 `weight_packed` [out, in / 2] and `weight_scale` [out, in / 32] byte for byte (the same codes, nibble
order and E8M0 scales), under a `quantization_config` that says so; so inspect, the loader and convert read a
published gpt-oss checkpoint as the compressed-tensors MXFP4A16 checkpoint it is equivalent to, and nothing
is re-quantized. With `dequantize`, the MXFP4 experts read as bf16 `weight`s instead (exact: an e2m1 value
times a power of two), for converting to another scheme.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np

from quantkit.errors import InvalidInput
from quantkit.formats import packing
from quantkit.formats.safetensors_io import DTYPES, TensorInfo

_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)(_blocks|_scales|_bias|)$")
PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
EXPERT_TARGET = r"re:.*\.experts\.\d+\.(gate|up|down)_proj$"


def is_native(config: dict | None, names) -> bool:
    """Whether a checkpoint keeps gpt-oss's 3-D expert tensors (bf16 or MXFP4)."""
    return bool(config) and config.get("model_type") == "gpt_oss" and any(_EXPERTS.match(n) for n in names)


def native_mxfp4(config: dict) -> bool:
    """Whether config.json says the experts are gpt-oss MXFP4 (quant_method mxfp4)."""
    raw = config.get("quantization_config")
    return isinstance(raw, dict) and raw.get("quant_method") == "mxfp4"


def mxfp4_config() -> dict:
    """The compressed-tensors quantization_config equivalent to gpt-oss's: MXFP4 weights (group 32, E8M0
    scales) on every expert Linear, everything else bf16 (modules_to_not_convert)."""
    from quantkit.formats.ct_writer import writable_config

    cfg = writable_config("MXFP4A16", 32, [])
    cfg["config_groups"]["group_0"]["targets"] = [EXPERT_TARGET]
    return cfg


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., G * 32] of MXFP4 blocks [..., G, 16] and E8M0 scales [..., G]: the compressed-tensors
    decoding (formats/packing.py), whose byte layout this is."""
    values = packing.unpack_fp4(blocks.reshape(*blocks.shape[:-2], -1))
    return values * packing.expand_groups(packing.e8m0_to_float(scales), 32, values.shape[-1])


def split_experts(ckpt, dequantize: bool = False):
    """`ckpt` (formats/hf.py Checkpoint) with gpt-oss's 3-D expert tensors replaced by per-expert ones (see the
    module docstring); its config's quantization_config becomes the compressed-tensors one (or none with
    `dequantize`), and `ckpt.native` records what it was."""
    groups: dict[tuple[str, str], dict[str, TensorInfo]] = {}
    for name, info in ckpt.tensors.items():
        m = _EXPERTS.match(name)
        if m:
            groups.setdefault((m.group(1), m.group(2)), {})[m.group(3)] = info
    mxfp4 = native_mxfp4(ckpt.config)
    virtual: dict[str, tuple] = {}
    for (root, part), found in groups.items():
        virtual |= _split(root, part, found, mxfp4 and not dequantize)
    for infos in groups.values():
        for info in infos.values():
            ckpt.hidden[info.name] = ckpt.tensors.pop(info.name)
    ckpt.tensors |= {name: v[0] for name, v in virtual.items()}
    ckpt.virtual = {name: v[1] for name, v in virtual.items()}
    raw = ckpt.config.get("quantization_config")
    ckpt.native = {"layout": "gpt-oss", "mxfp4": mxfp4, "dequantized": mxfp4 and dequantize,
                   "quantization_config": raw}
    config = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
    if mxfp4 and not dequantize:
        config["quantization_config"] = mxfp4_config()
    elif raw is not None and not mxfp4:
        config["quantization_config"] = raw
    ckpt.config = config
    return ckpt


def _info(name: str, dtype: str, shape: tuple, src: TensorInfo) -> TensorInfo:
    return TensorInfo(name, dtype, shape, src.file, 0, int(np.prod(shape)) * DTYPES[dtype][0] // 8)


def _split(root: str, part: str, found: dict[str, TensorInfo], packed: bool) -> dict[str, tuple]:
    """{per-expert tensor name: (TensorInfo, read(checkpoint) -> array)} of one 3-D expert tensor group."""
    parts = PARTS[part]
    out: dict[str, tuple] = {}
    blocks, scales, dense, bias = (found.get(k) for k in ("_blocks", "_scales", "", "_bias"))
    if (blocks is None) != (scales is None):
        raise InvalidInput(f"{root}.{part}: _blocks and _scales come together (one is missing)")
    if blocks is not None and dense is not None:
        raise InvalidInput(f"{root}.{part}: both bf16 and MXFP4 tensors")
    if blocks is None and dense is None:
        raise InvalidInput(f"{root}.{part}_bias without its weights")
    n = len(parts)
    if blocks is not None:
        if (blocks.dtype, scales.dtype) != ("U8", "U8") or len(blocks.shape) != 4 or blocks.shape[-1] != 16 \
                or tuple(blocks.shape[:-1]) != tuple(scales.shape):
            raise InvalidInput(f"{root}.{part}_blocks {list(blocks.shape)} ({blocks.dtype}) and _scales "
                               f"{list(scales.shape)} ({scales.dtype}): expected uint8 [E, out, in/32, 16] and "
                               "uint8 [E, out, in/32]")
        e, rows, g, _ = blocks.shape
        if rows % n:
            raise InvalidInput(f"{root}.{part}_blocks: {rows} rows do not hold gate and up interleaved")
        out_dim, in_dim = rows // n, g * 32
        for x in range(e):
            for j, p in enumerate(parts):
                pre = f"{root}.{x}.{p}"
                pick = (x, slice(j, None, n))
                if packed:
                    out[f"{pre}.weight_packed"] = (
                        _info(f"{pre}.weight_packed", "U8", (out_dim, in_dim // 2), blocks),
                        lambda ck, b=blocks.name, pick=pick: ck.read(b)[pick].reshape(out_dim, -1))
                    out[f"{pre}.weight_scale"] = (
                        _info(f"{pre}.weight_scale", "U8", (out_dim, g), scales),
                        lambda ck, s=scales.name, pick=pick: np.ascontiguousarray(ck.read(s)[pick]))
                else:
                    out[f"{pre}.weight"] = (
                        _info(f"{pre}.weight", "BF16", (out_dim, in_dim), blocks),
                        lambda ck, b=blocks.name, s=scales.name, pick=pick: dequantize_mxfp4(
                            ck.read(b)[pick], ck.read(s)[pick]).astype(ml_dtypes.bfloat16))
    else:
        if len(dense.shape) != 3 or dense.shape[2] % n:
            raise InvalidInput(f"{root}.{part} {list(dense.shape)}: expected [E, in, {n} x out]")
        e, in_dim, cols = dense.shape
        out_dim = cols // n
        for x in range(e):
            for j, p in enumerate(parts):
                pre = f"{root}.{x}.{p}"
                out[f"{pre}.weight"] = (
                    _info(f"{pre}.weight", dense.dtype, (out_dim, in_dim), dense),
                    lambda ck, t=dense.name, x=x, j=j: np.ascontiguousarray(ck.read(t)[x, :, j::n].T))
    if bias is not None:
        if len(bias.shape) != 2 or bias.shape[0] != e or bias.shape[1] != n * out_dim:
            raise InvalidInput(f"{root}.{part}_bias {list(bias.shape)}: expected [{e}, {n * out_dim}]")
        for x in range(e):
            for j, p in enumerate(parts):
                name = f"{root}.{x}.{p}.bias"
                out[name] = (_info(name, bias.dtype, (out_dim,), bias),
                             lambda ck, t=bias.name, x=x, j=j: np.ascontiguousarray(ck.read(t)[x, j::n]))
    return out
