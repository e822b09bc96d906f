"""compressed-tensors tensors on disk per format (docs/formats.md, "On disk"): the header checks of each module's
tensors (`check_module_tensors`) and of their data (`check_module_data`), the library's dequantization, and
the runtime's kernel layout of a served weight (`kernel_shapes` without data, `kernel_layout` with it).
"""

from __future__ import annotations

from typing import NamedTuple

from quantkit.errors import InvalidInput
from quantkit.formats.compressed_tensors import QuantArgs, QuantConfig, Scheme, Transform, activation_qtype, weight_qtype

# ---- KV cache scales (kv_cache_scheme) ------------------------------------------------------------------

KV_SCALES = ("k_scale", "v_scale")  # tensors of each attention module (`...self_attn.k_scale`), float32



def kv_head_scales(values, kv_heads: int, where: str):
    """A k_scale / v_scale tensor as one float32 per KV head ([kv_heads]): one value ([], [1]) is broadcast,
    [kv_heads] / [kv_heads, 1, 1] (attn_head) kept. InvalidInput for another shape, NaN/Inf or a scale <= 0."""
    import numpy as np

    a = np.asarray(values, np.float32)
    if a.size not in (1, kv_heads) or a.ndim > 3 or any(d != 1 for d in a.shape[1:]):
        raise InvalidInput(f"{where} has shape {list(a.shape)}; expected [1] (per tensor) or [{kv_heads}, 1, 1] "
                           f"(per KV head)")
    if not np.isfinite(a).all():
        raise InvalidInput(f"{where} contains NaN or Inf")
    if (a <= 0).any():
        raise InvalidInput(f"{where} has a scale <= 0 ({float(a.min())})")
    return np.broadcast_to(a.reshape(-1), (kv_heads,)).copy()


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def stored_weight_name(scheme: Scheme | None) -> str:
    """Name of the tensor that holds a module's (packed) weight values under `scheme`."""
    if scheme is None or scheme.weights is None or scheme.format in ("dense", "float-quantized", "naive-quantized",
                                                                     "int-quantized", "mxfp8-quantized"):
        return "weight"
    return "weight_packed"



def expected_scale_shape(args: QuantArgs, lead: tuple[int, ...], out: int, inp: int) -> tuple[int, ...] | None:
    """Shape of `weight_scale` for a weight [*lead, out, inp] quantized with `args` (None: not checked)."""
    if args.strategy == "tensor":
        return None  # [1] or [] both occur; checked separately
    if args.strategy == "channel":
        return (*lead, out, 1)
    if args.strategy in ("group", "tensor_group"):
        return (*lead, out, ceil_div(inp, args.group_size))
    if args.strategy == "block":
        r, c = args.block_structure
        return (*lead, ceil_div(out, r), ceil_div(inp, c))
    return None


_FLOATS = frozenset({"F16", "BF16", "F32"})


class _Tensors:
    """One module's stored tensors under one format, and the one-line errors found in them."""

    def __init__(self, module: str, fmt: str, params: dict):
        self.module, self.fmt, self.params, self.errors = module, fmt, params, []

    def need(self, param: str, dtypes: set[str] | None = None, shape: tuple | None = None):
        """The TensorInfo of a required `param` (None when missing), its dtype and shape checked."""
        info = self.params.get(param)
        where = f"{self.module}.{param}"
        if info is None:
            self.errors.append(f"{self.module}: missing tensor {where} required by format {self.fmt}")
        elif dtypes is not None and info.dtype not in dtypes:
            self.errors.append(f"{where}: dtype {info.dtype}, expected {' or '.join(sorted(dtypes))}")
        if info is not None and shape is not None and info.shape != tuple(shape):
            self.errors.append(f"{where}: shape {list(info.shape)}, expected {list(shape)}")
        return info

    def scale(self, w: QuantArgs, lead: tuple, out: int, inp: int) -> None:
        """weight_scale against its strategy's shape ([1] or [] per tensor)."""
        scale = self.need("weight_scale", _FLOATS)
        if scale is None:
            return
        if w.strategy == "tensor":
            if scale.shape not in ((), (1,)):
                self.errors.append(f"{self.module}.weight_scale: shape {list(scale.shape)}, expected [1] (per tensor)")
            return
        exp = expected_scale_shape(w, lead, out, inp)
        if exp is not None and scale.shape != exp:
            self.errors.append(f"{self.module}.weight_scale: shape {list(scale.shape)}, expected {list(exp)} "
                               f"({w.strategy} strategy)")


def _check_dense(t: _Tensors) -> tuple[int, ...] | None:
    info = t.params.get("weight")
    if info is None and any(p.startswith("weight_") for p in t.params):
        t.errors.append(f"{t.module}: holds quantized tensors ({', '.join(sorted(t.params))}) but no config "
                        "group of quantization_config targets it")
    return info.shape if info is not None else None


def _check_int_packed(t: _Tensors, w: QuantArgs) -> tuple[int, ...] | None:
    """pack-quantized int: int32 words along the input dimension, weight_shape, scales, zero points, g_idx."""
    packed = t.need("weight_packed", {"I32"})
    if packed is None or len(packed.shape) < 2:
        if packed is not None:
            t.errors.append(f"{t.module}.weight_packed: expected at least 2 dimensions, found {list(packed.shape)}")
        return None
    *lead, out, cols = packed.shape
    lead = tuple(lead)
    per_word = 32 / w.num_bits
    inp = int(cols * per_word)  # exact whenever in_features fills whole words; --deep reads weight_shape
    t.need("weight_shape", {"I64", "I32"}, (len(packed.shape),))
    if w.strategy != "group":
        t.scale(w, lead, out, inp)
    elif (scale := t.need("weight_scale", _FLOATS)) is not None:
        # in_features is known only to a word: any group count between the shortest and longest row fits
        lo = int((cols - 1) * per_word) + 1
        n_groups = scale.shape[-1] if scale.shape else -1
        if scale.shape[:-1] != (*lead, out) or not ceil_div(lo, w.group_size) <= n_groups <= ceil_div(inp, w.group_size):
            t.errors.append(f"{t.module}.weight_scale: shape {list(scale.shape)}, expected "
                            f"{list(expected_scale_shape(w, lead, out, inp))} for group size {w.group_size}")
    if not w.symmetric and (scale := t.params.get("weight_scale")) is not None and len(scale.shape) >= 2:
        # zero points packed along the OUTPUT dimension: [ceil(out * b / 32), groups] (FORMATS.md)
        t.need("weight_zero_point", {"I32"}, (*lead, ceil_div(out * w.num_bits, 32), scale.shape[-1]))
    if w.actorder == "group":
        t.need("weight_g_idx", {"I32", "I64"}, (*lead, inp))
    return (*lead, out, inp)


def _check_unpacked(t: _Tensors, scheme: Scheme) -> tuple[int, ...] | None:
    """One stored value per weight (`weight`): fp8 e4m3 (float-quantized), int8 (int-quantized) and
    naive-quantized values; its scales and a static input_scale."""
    w = scheme.weights
    dtypes = {"F8_E4M3"} if w.num_bits == 8 and w.type == "float" else {"I8"} if w.type == "int" else None
    weight = t.need("weight", dtypes)
    if weight is None or len(weight.shape) < 2:
        return weight.shape if weight is not None else None
    *lead, out, inp = weight.shape
    t.scale(w, tuple(lead), out, inp)
    if not w.symmetric and w.type == "int" and (scale := t.params.get("weight_scale")) is not None:
        t.need("weight_zero_point", {"I8"}, scale.shape)  # one int8 per scale, unpacked
    a = scheme.input_activations
    if a is not None and not a.dynamic:
        t.need("input_scale", _FLOATS)
    return weight.shape


def _check_fp4(t: _Tensors) -> tuple[int, ...] | None:
    """mxfp4 / nvfp4: two e2m1 codes per byte, scales per 32 (E8M0) or 16 (fp8, plus a global scale)."""
    packed = t.need("weight_packed", {"U8"})
    if packed is None or len(packed.shape) < 2:
        return None
    *lead, out, half = packed.shape
    mx = t.fmt.startswith("mx")
    t.need("weight_scale", {"U8", "F8_E8M0"} if mx else {"F8_E4M3"}, (*lead, out, ceil_div(2 * half, 32 if mx else 16)))
    if not mx:
        t.need("weight_global_scale", {"F32"}, (*lead, 1))
    return (*lead, out, 2 * half)


def _check_mxfp6(t: _Tensors) -> tuple[int, ...] | None:
    """mxfp6: four e2m3 codes in each 3 bytes, E8M0 scales per 32 inputs."""
    packed = t.need("weight_packed", {"U8"})
    if packed is None or len(packed.shape) < 2:
        return None
    *lead, out, cols = packed.shape
    if cols % 3:
        t.errors.append(f"{t.module}.weight_packed: {cols} bytes a row do not hold whole groups of four 6-bit codes")
        return None
    inp = cols // 3 * 4
    t.need("weight_scale", {"U8", "F8_E8M0"}, (*lead, out, ceil_div(inp, 32)))
    return (*lead, out, inp)


def _check_mxfp8(t: _Tensors) -> tuple[int, ...] | None:
    """mxfp8: one fp8 e4m3 value per weight, E8M0 scales per 32 inputs."""
    weight = t.need("weight", {"F8_E4M3"})
    if weight is None or len(weight.shape) < 2:
        return None
    *lead, out, inp = weight.shape
    t.need("weight_scale", {"U8", "F8_E8M0"}, (*lead, out, ceil_div(inp, 32)))
    return weight.shape


def check_module_tensors(module: str, scheme: Scheme | None, params: dict) -> tuple[tuple[int, ...] | None, list[str]]:
    """Checks that a module's tensors are what `scheme` says they must be (names, dtypes, shapes).

    Args:
        module: module name, for messages.
        scheme: the scheme that targets it, or None when unquantized.
        params: parameter name (e.g. "weight_packed") -> TensorInfo.
    Returns:
        (logical weight shape [..., out, in] or None if unknown, list of one-line error messages).
    """
    w = scheme.weights if scheme is not None else None
    fmt = scheme.format if scheme is not None else "dense"
    t = _Tensors(module, fmt, params)
    if w is None or fmt == "dense":
        shape = _check_dense(t)
    elif fmt == "pack-quantized" and w.type == "int":
        shape = _check_int_packed(t, w)
    elif fmt in ("float-quantized", "int-quantized") or (fmt == "naive-quantized" and w.type == "float"):
        shape = _check_unpacked(t, scheme)
    elif fmt in ("mxfp4-pack-quantized", "nvfp4-pack-quantized"):
        shape = _check_fp4(t)
    elif fmt == "mxfp8-quantized":
        shape = _check_mxfp8(t)
    elif fmt == "mxfp6-pack-quantized":
        shape = _check_mxfp6(t)
    else:  # other formats are reported unsupported; only the presence of a weight tensor is checked
        shape = None
        if not (params.get(stored_weight_name(scheme)) or params.get("weight") or params.get("weight_packed")):
            t.errors.append(f"{module}: no weight tensor found for format {fmt}")
    if activation_qtype(scheme) == "nvfp4" and shape is not None:  # the activations' static global scale
        t.need("input_global_scale", {"F32"}, (*shape[:-2], 1))
    if w is not None:  # tensors the scheme says nothing of would be ignored: the served weight would be wrong
        if w.symmetric and "weight_zero_point" in params:
            t.errors.append(f"{module}.weight_zero_point: present, but the scheme is symmetric; set symmetric: "
                            "false in quantization_config or remove the tensor")
        if w.actorder != "group" and "weight_g_idx" in params:
            t.errors.append(f"{module}.weight_g_idx: present, but the scheme's actorder is {w.actorder!r}, not "
                            "'group'; fix quantization_config or remove the tensor")
    return shape, t.errors


def check_module_data(module: str, scheme: Scheme | None, params: dict, read, shape: tuple[int, ...] | None):
    """Reads a module's data (`inspect --deep`): NaN/Inf values, zero scales, weight_shape against the packed
    words, non-zero padding bits, g_idx range.

    Args:
        module: module name, for messages.
        scheme: the scheme that targets it, or None.
        params: parameter name -> TensorInfo, already found well-formed by check_module_tensors.
        read: tensor name -> numpy array.
        shape: the logical shape check_module_tensors found.
    Returns:
        (the logical shape, exact from weight_shape when stored; list of (severity, where, message)).
    """
    import numpy as np

    from quantkit.formats import packing
    from quantkit.formats.safetensors_io import FLOAT_DTYPES

    found = []
    w = scheme.weights if scheme is not None and scheme.format != "dense" else None
    for param, info in params.items():
        arr, where = read(info.name), f"{module}.{param}"
        if param == "weight_global_scale":
            continue  # read by every validation (check_global_scales)
        if param.endswith("scale"):
            e8m0 = info.dtype in ("U8", "F8_E8M0")
            values = packing.e8m0_to_float(arr) if e8m0 else arr.astype(np.float32)
            if not np.isfinite(values).all():
                found.append(("error", where, f"{where} contains NaN or Inf"))
            elif not e8m0 and (values == 0).any():
                found.append(("error", where, f"{where} has {int((values == 0).sum())} zero scale(s)"))
        elif info.dtype in FLOAT_DTYPES or info.dtype.startswith("F8_E"):
            if not np.isfinite(arr.astype(np.float32)).all():
                found.append(("error", where, f"{where} contains NaN or Inf values"))
    if w is not None and scheme.format == "pack-quantized" and "weight_shape" in params and shape is not None:
        ws = tuple(int(x) for x in read(params["weight_shape"].name))
        packed = params["weight_packed"]
        cols = packed.shape[-1]
        if ws[:-1] != shape[:-1] or not ws or -(-ws[-1] * w.num_bits // 32) != cols:
            found.append(("error", f"{module}.weight_shape", f"{module}.weight_shape is {list(ws)} but weight_packed "
                          f"{list(packed.shape)} holds a weight of {list(shape[:-1])} x ~{shape[-1]}"))
        else:
            shape = ws
            spare = cols * 32 - ws[-1] * w.num_bits  # unused high bits of each row's last word
            if spare:
                words = read(packed.name)[..., -1].astype(np.int64) & 0xFFFFFFFF
                if (words >> (32 - spare)).any():
                    found.append(("warning", f"{module}.weight_packed",
                                  f"{module}.weight_packed has non-zero padding bits beyond {ws[-1]} columns"))
    if w is not None and "weight_g_idx" in params and shape is not None and w.group_size:
        try:
            activation_order(read(params["weight_g_idx"].name), w.group_size, shape[-1], f"{module}.weight_g_idx")
        except InvalidInput as e:
            found.append(("error", f"{module}.weight_g_idx", str(e)))
    return shape, found


def activation_order(g_idx, group: int, inp: int, where: str):
    """The row order that makes an activation-ordered weight's groups contiguous: int32 [inp], the input
    features sorted by their group (stable). InvalidInput naming `where` unless g_idx holds inp group numbers
    in range, each group exactly `group` times (what GPTQ's act-order writes; anything else has no contiguous
    layout, and the library rejects it)."""
    import numpy as np

    g = np.asarray(g_idx).reshape(-1).astype(np.int64)
    groups = ceil_div(inp, group)
    if g.shape != (inp,) or g.min(initial=0) < 0 or g.max(initial=0) >= groups:
        raise InvalidInput(f"{where} is out of range: expected {inp} group numbers in [0, {groups})")
    counts = np.bincount(g, minlength=groups)
    if (counts != group).any():
        bad = int(np.flatnonzero(counts != group)[0])
        raise InvalidInput(f"{where} is not a permutation of whole groups: group {bad} has {counts[bad]} input "
                           f"features, not {group}")
    return np.argsort(g, kind="stable").astype(np.int32)


def logical_shape(shapes: dict[str, tuple], weight_shape=None, fmt: str = "") -> tuple[int, ...]:
    """Logical weight shape [..., out, in] of a quantized module of format `fmt`: the values of its
    `weight_shape` tensor when stored (pack-quantized), else its fp8 `weight`'s shape, else the codes in its
    packed bytes per row (mxfp6: 4 per 3 bytes, fp4: 2 per byte)."""
    if weight_shape is not None:
        return tuple(int(x) for x in weight_shape)
    if "weight" in shapes:
        return tuple(shapes["weight"])
    packed = shapes["weight_packed"]
    return (*packed[:-1], packed[-1] * 4 // 3 if fmt == "mxfp6-pack-quantized" else packed[-1] * 2)


def can_dequantize(scheme: Scheme) -> bool:
    """Whether `dequantize` handles this scheme's weights."""
    w, fmt = scheme.weights, scheme.format
    if fmt in ("pack-quantized", "int-quantized"):
        return w.type == "int" and w.strategy in ("group", "channel")
    if fmt == "float-quantized":
        return w.type == "float" and w.num_bits == 8 and w.strategy in ("tensor", "channel", "block", "group")
    return fmt in ("mxfp4-pack-quantized", "mxfp6-pack-quantized", "mxfp8-quantized", "nvfp4-pack-quantized")


def dequantize(scheme: Scheme, arrays: dict, shape: tuple[int, ...]):
    """Dequantizes one module's stored weight to float32, as the library does ((q - zero point) * scale per
    group).

    The product of a (shifted) 4/8-bit value and a bf16/f16/f32 scale is exact in float32, so casting the
    result to the scale's dtype rounds once, exactly like the library's multiply in that dtype.

    Args:
        scheme: the module's scheme (a served weight type: int pack- or int-quantized, fp8, mxfp4).
        arrays: parameter name -> numpy array (weight_packed / weight, weight_scale).
        shape: logical weight shape [..., out, in].
    Returns:
        float32 [..., out, in].
    """
    import numpy as np

    from quantkit.formats import packing

    w, fmt = scheme.weights, scheme.format
    inp = shape[-1]
    if fmt in ("mxfp4-pack-quantized", "mxfp6-pack-quantized", "mxfp8-quantized"):
        values = mx_values(fmt, arrays)
        scale = packing.e8m0_to_float(np.asarray(arrays["weight_scale"]))
        return values * packing.expand_groups(scale, 32, inp)
    if fmt == "nvfp4-pack-quantized":  # fp8 scales over the global scale, in float32 (the library's order)
        scale = np.asarray(arrays["weight_scale"]).astype(np.float32) / stored_global_scale(arrays)[..., None]
        return packing.unpack_fp4(np.asarray(arrays["weight_packed"])) * packing.expand_groups(scale, 16, inp)
    if fmt == "pack-quantized":
        q = packing.unpack_int(np.asarray(arrays["weight_packed"]), w.num_bits, inp).astype(np.float32)
    else:  # float-quantized, int-quantized: one stored value per weight
        q = np.asarray(arrays["weight"]).astype(np.float32)
    scale = np.asarray(arrays["weight_scale"]).astype(np.float32)
    if w.actorder == "group":  # each input feature's own group, by weight_g_idx
        g_idx = np.asarray(arrays["weight_g_idx"]).astype(np.int64)
        expand = lambda a: a[..., g_idx]  # noqa: E731
    else:
        expand = lambda a: packing.expand_groups(a, w.group_size if w.strategy == "group" else inp, inp)  # noqa: E731
    if w.type == "int" and not w.symmetric:  # [..., out, groups] like the scales
        q = q - expand(zero_points(scheme, arrays, shape[-2]).astype(np.float32))
    if w.strategy == "tensor":
        return q * scale.reshape(())
    if w.strategy == "block":
        return q * packing.expand_blocks(scale, w.block_structure, shape)
    if w.strategy == "group":
        return q * expand(scale)
    return q * scale  # channel: [..., out, 1]



def mx_values(fmt: str, arrays: dict):
    """An MX weight's element values as float32 [..., out, in]: e2m1 (mxfp4), e2m3 (mxfp6) or fp8 e4m3 (mxfp8)."""
    import numpy as np

    from quantkit.formats import packing

    if fmt == "mxfp8-quantized":
        return np.asarray(arrays["weight"]).astype(np.float32)
    unpack = packing.unpack_fp4 if fmt == "mxfp4-pack-quantized" else packing.unpack_fp6
    return unpack(np.asarray(arrays["weight_packed"]))


def kernel_group(w: QuantArgs, inp: int) -> int:
    """Input features per scale in the kernel layout (quant/qtensor.py) of a weight with `inp` inputs: the
    group size, an fp8 block's width (each column's block scale repeated per block row), or all of `inp`
    (channel and tensor scales). The one place a scheme becomes the kernel's group."""
    return {"group": w.group_size, "block": w.block_structure[1] if w.block_structure else inp}.get(w.strategy, inp)


def stored_transforms(qc: QuantConfig, tensors: dict) -> dict[tuple[str, str, int], tuple[str, str | None]]:
    """The online transform matrices a checkpoint holds: (group, location, size) -> the name of the `weight`
    tensor of a `<module>.<group>_<location>` and of its `perm` (randomize) or None. The library stores the
    matrix shared by a group's modules of one size once, under the first such module (tied weights)."""
    out = {}
    for name, info in tensors.items():
        module, _, param = name.rpartition(".")
        t = qc.transform_module(module) if param == "weight" else None
        if t is not None and len(info.shape) == 2 and info.shape[0] == info.shape[1]:
            perm = f"{module}.perm"
            out.setdefault((t.group, t.location, info.shape[0]), (name, perm if perm in tensors else None))
    return out


def transform_size(t: Transform, inputs: int) -> int:
    """The side of transform t's matrix on a Linear of `inputs` input features: its head_dim blocks, else all."""
    return t.head_dim or inputs


def input_rotation(t: Transform, matrix, perm, where: str):
    """The int8 matrix an online input transform multiplies each row by, before dividing by sqrt(its size)
    (compressed-tensors' HadamardTransform): the stored Hadamard matrix (entries +-1), rows and columns
    permuted by `perm` when stored (randomize), transposed when `inverse`. InvalidInput when it is not +-1."""
    import numpy as np

    m = np.asarray(matrix, np.float32)
    if not np.isin(m, (-1.0, 1.0)).all():
        raise InvalidInput(f"{where}: a {t.type} transform matrix must hold only +1 and -1")
    if perm is not None:
        p = np.asarray(perm).astype(np.int64)
        if sorted(p.tolist()) != list(range(len(m))):
            raise InvalidInput(f"{where}: the transform's perm is not a permutation of 0..{len(m) - 1}")
        m = m[p][:, p]
    return (m.T if t.inverse else m).astype(np.int8)


def stored_global_scale(arrays: dict):
    """An nvfp4 weight's `weight_global_scale` as float32 [..., 1] ([1] stored per weight, [experts, 1] for
    stacked experts)."""
    import numpy as np

    return np.asarray(arrays["weight_global_scale"], np.float32)


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # siblings servers fuse into one matmul


def check_global_scales(scales: dict) -> list[tuple[str, str]]:
    """(tensor, message) for each nvfp4 `weight_global_scale` the library would reject: not one finite value
    > 0, or one that differs from a fused sibling's (q/k/v, gate/up of one parent module share one global
    scale: llm-compressor writes them so, and vLLM fuses the siblings into one weight).

    Args:
        scales: module name -> its weight_global_scale as stored (numpy).
    """
    import numpy as np

    found, good = [], {}
    for module, value in scales.items():
        where, v = f"{module}.weight_global_scale", np.asarray(value, np.float32).reshape(-1)
        if not (np.isfinite(v).all() and (v > 0).all()):
            found.append((where, f"{where} is {v.tolist()}: a global scale must be finite and > 0"))
        else:
            good[module] = v
    for module, v in good.items():
        parent, _, leaf = module.rpartition(".")
        for names in FUSED:
            if leaf in names[1:] and (first := f"{parent}.{names[0]}") in good and not np.array_equal(good[first], v):
                found.append((f"{module}.weight_global_scale",
                              f"{module}.weight_global_scale is {v.tolist()} but {first}'s is {good[first].tolist()}: "
                              f"fused layers ({'/'.join(names)}) must share one global scale; re-quantize them "
                              "together (llm-compressor does)"))
    return found


def zero_points(scheme: Scheme, arrays: dict, out: int):
    """An asymmetric int weight's zero points as stored, unpacked: int8 [..., out, groups] (pack-quantized packs
    them along the output dimension, int-quantized stores them as they are)."""
    import numpy as np

    from quantkit.formats import packing

    z = np.asarray(arrays["weight_zero_point"])
    if scheme.format != "pack-quantized":
        return z.astype(np.int8)
    return np.swapaxes(packing.unpack_int(np.swapaxes(z, -1, -2), scheme.weights.num_bits, out), -1, -2)


class KernelShapes(NamedTuple):
    """A served weight's kernel layout without data (quant/qtensor.py): scales (and zero points) [in // group, out]."""
    scales: tuple[int, int]
    scale_dtype: str
    qtype: str
    group: int
    zeros: bool  # int8 zero points beside the scales (asymmetric ints)
    perm: bool = False  # rows in activation order, with their int32 order (actorder group)

    @property
    def scale_bytes(self) -> int:
        return {"uint8": 1, "float8_e4m3fn": 1, "float32": 4}.get(self.scale_dtype, 2)


class KernelLayout(NamedTuple):
    """A served weight in the kernel layout, in numpy (quant/qtensor.py)."""
    values: object  # [in, out] int8 (int4 / int8 values, e2m1 codes as signed nibbles) or float8_e4m3fn
    scales: object  # [in // group, out] float32 / bfloat16 as stored, uint8 E8M0 for mxfp4
    qtype: str
    group: int
    zeros: object = None  # [in // group, out] int8 zero points, or None (symmetric)
    gscale: float | None = None  # nvfp4's global scale
    perm: object = None  # [in] int32 input feature of each row (activation-ordered groups), or None
    act: str = ""  # the activations' quantization (compressed_tensors.activation_qtype)
    act_gscale: float | None = None  # nvfp4 activations: the module's input_global_scale
    rot: object = None  # [size, size] int8 ±1: the online Hadamard transform of the inputs (input_rotation), or None


def _has_zeros(w: QuantArgs) -> bool:
    return w.type == "int" and not w.symmetric


def served_qtype(scheme: Scheme) -> str:
    """The kernel qtype (quant/qtensor.py) a weight of `scheme` is held in on device: ints of 2-4 bits in int4,
    of 5-8 bits in int8, mxfp6's e2m3 values as fp8 e4m3 (mxfp8; all 64 are exact there: the values as they
    are, in the container the kernels unpack), others as stored."""
    qtype = weight_qtype(scheme)
    if qtype == "mxfp6":
        return "mxfp8"
    if scheme.weights is not None and scheme.weights.type == "int" and qtype != "dense":
        return "int4" if scheme.weights.num_bits <= 4 else "int8"
    return qtype


def kernel_shapes(scheme: Scheme, shape: tuple[int, int], scale_dtype: str = "bfloat16") -> KernelShapes:
    """What `kernel_layout` returns for a logical [out, in] weight, without data (for `plan`)."""
    out, inp = shape
    w, fmt = scheme.weights, scheme.format
    if fmt in ("mxfp4-pack-quantized", "mxfp6-pack-quantized", "mxfp8-quantized"):
        return KernelShapes((inp // 32, out), "uint8", served_qtype(scheme), 32, False)
    if fmt == "nvfp4-pack-quantized":
        return KernelShapes((inp // 16, out), "float8_e4m3fn", "nvfp4", 16, False)
    group = kernel_group(w, inp)
    return KernelShapes((inp // group, out), scale_dtype, served_qtype(scheme), group, _has_zeros(w),
                        w.actorder == "group")


def kernel_layout(scheme: Scheme, arrays: dict, shape: tuple[int, int], where: str = "weight") -> KernelLayout:
    """A served weight in the runtime's layout (see quant/qtensor.py), in numpy, with how its activations are
    quantized (and nvfp4 activations' input_global_scale).

    Args:
        scheme: the module's scheme (int4 / int8 pack- or int-quantized, fp8 float-quantized, mxfp4).
        arrays: parameter name -> numpy array as stored.
        shape: logical [out, in].
        where: the module, for messages.
    """
    import numpy as np

    act = activation_qtype(scheme)
    gscale = float(np.asarray(arrays["input_global_scale"], np.float32).reshape(())) if act == "nvfp4" else None
    return _weight_layout(scheme, arrays, shape, where)._replace(act=act, act_gscale=gscale)


def _weight_layout(scheme: Scheme, arrays: dict, shape: tuple[int, int], where: str) -> KernelLayout:
    import ml_dtypes
    import numpy as np

    from quantkit.formats import packing

    out, inp = shape
    w, fmt = scheme.weights, scheme.format
    scale = np.asarray(arrays["weight_scale"])
    if fmt in ("mxfp4-pack-quantized", "nvfp4-pack-quantized"):  # e2m1 codes as signed nibbles
        packed = np.asarray(arrays["weight_packed"])
        codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(out, inp).astype(np.int8)
        codes = np.where(codes >= 8, codes - 16, codes).astype(np.int8).T
        if fmt.startswith("nvfp4"):
            return KernelLayout(codes, scale.T, "nvfp4", 16, gscale=float(stored_global_scale(arrays).reshape(())))
        return KernelLayout(codes, scale.view(np.uint8).T, "mxfp4", 32)
    if fmt in ("mxfp6-pack-quantized", "mxfp8-quantized"):  # e2m3 values are all exact in fp8 e4m3
        values = mx_values(fmt, arrays).astype(ml_dtypes.float8_e4m3fn)
        return KernelLayout(values.T, scale.view(np.uint8).T, "mxfp8", 32)
    if fmt == "pack-quantized":
        values = packing.unpack_int(np.asarray(arrays["weight_packed"]), w.num_bits, inp).T
    else:
        values = np.asarray(arrays["weight"]).T
    qtype, group = served_qtype(scheme), kernel_group(w, inp)
    if w.strategy == "block":  # [ceil(out/br), ceil(in/bc)] -> one scale per bc inputs and per column
        return KernelLayout(values, np.repeat(scale.T, w.block_structure[0], axis=1)[:, :out], qtype, group)
    if w.strategy == "tensor":
        return KernelLayout(values, np.broadcast_to(scale.reshape(1, 1), (1, out)).copy(), qtype, group)
    # group [out, in // group] or channel [out, 1] -> transposed, and the zero points with them
    zeros = zero_points(scheme, arrays, out).T if _has_zeros(w) else None
    if w.actorder == "group":  # rows sorted by group: each group's rows contiguous, as the kernels need
        perm = activation_order(arrays["weight_g_idx"], w.group_size, inp, f"{where}.weight_g_idx")
        return KernelLayout(values[perm], scale.T, qtype, group, zeros, perm=perm)
    return KernelLayout(values, scale.T, qtype, group, zeros)
