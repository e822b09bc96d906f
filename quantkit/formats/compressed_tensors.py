"""compressed-tensors `quantization_config`: parsed into frozen Schemes, matched to modules.

Mirrors the library's rules (compressed-tensors 0.20.1, see FORMATS.md) without importing it:
- a config group is a scheme dict or, in shorthand, a preset name mapped to its targets;
- a target is an exact module name, a `re:` regex (re.match on the module name) or a class name;
- when several targets match a module, exact names win over regexes over class names (alphabetical
  within a kind), and a target listed by two groups belongs to the later one;
- `ignore` entries use the same matching and always win.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantkit.errors import InvalidInput

FORMATS = frozenset({
    "dense", "naive-quantized", "int-quantized", "float-quantized", "pack-quantized",
    "nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp6-pack-quantized", "mxfp8-quantized",
    "mixed-precision", "sparse-bitmask", "sparse-24-bitmask", "marlin-24",
})
SPARSE_FORMATS = frozenset({"sparse-bitmask", "sparse-24-bitmask", "marlin-24"})
STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")
_ARG_KEYS = frozenset({
    "num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
    "actorder", "scale_dtype", "zp_dtype", "observer", "observer_kwargs",
})


@dataclass(frozen=True)
class QuantArgs:
    """How one tensor (weights or activations) is quantized; fields as in the library."""

    num_bits: int = 8
    type: str = "int"  # "int" | "float"
    symmetric: bool = True
    group_size: int | None = None  # > 0 for group / tensor_group, -1 = channel
    strategy: str = "tensor"
    block_structure: tuple[int, int] | None = None
    dynamic: bool | str = False  # False | True | "local"
    actorder: str | None = None  # None | "weight" | "group"
    scale_dtype: str | None = None

    @classmethod
    def parse(cls, d: object, where: str) -> "QuantArgs":
        if not isinstance(d, dict):
            raise InvalidInput(f"{where}: expected an object, found {type(d).__name__}")
        unknown = set(d) - _ARG_KEYS
        if unknown:
            raise InvalidInput(f"{where}: unknown key(s) {sorted(unknown)}")

        def get(key, types, default):
            v = d.get(key, default)
            if v is not None and (not isinstance(v, types) or (isinstance(v, bool) and bool not in types)):
                raise InvalidInput(f"{where}.{key}: invalid value {v!r}")
            return v

        num_bits = get("num_bits", (int,), 8)
        if not 1 <= num_bits <= 32:
            raise InvalidInput(f"{where}.num_bits: {num_bits} is not a bit width")
        qtype = str(get("type", (str,), "int")).lower()
        if qtype not in ("int", "float"):
            raise InvalidInput(f"{where}.type: {qtype!r} is neither 'int' nor 'float'")
        group_size = get("group_size", (int,), None)
        if group_size is not None and group_size < -1:
            raise InvalidInput(f"{where}.group_size: {group_size} (use > 0, or -1 for channel)")
        strategy = get("strategy", (str,), None)
        if strategy is None:
            strategy = "tensor" if group_size is None else "group" if group_size > 0 else "channel"
            if group_size == 0:
                raise InvalidInput(f"{where}.group_size: 0 (use > 0, or -1 for channel)")
        strategy = strategy.lower()
        if strategy not in STRATEGIES:
            raise InvalidInput(f"{where}.strategy: unknown strategy {strategy!r}")
        if strategy in ("group", "tensor_group") and not (group_size and group_size > 0):
            raise InvalidInput(f"{where}: strategy {strategy} needs a positive group_size")
        block = d.get("block_structure")
        if isinstance(block, str):
            try:
                block = [int(x) for x in block.split("x")]
            except ValueError:
                raise InvalidInput(f"{where}.block_structure: invalid value {block!r}") from None
        if block is not None:
            if not (isinstance(block, list) and len(block) == 2 and all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block
            )):
                raise InvalidInput(f"{where}.block_structure: expected [rows, cols], found {block!r}")
            block = (block[0], block[1])
        if (strategy == "block") != (block is not None):
            raise InvalidInput(f"{where}: strategy 'block' and block_structure go together")
        dynamic = d.get("dynamic", False)
        if isinstance(dynamic, str) and dynamic.lower() == "local":
            dynamic = "local"
        elif not isinstance(dynamic, bool):
            raise InvalidInput(f"{where}.dynamic: invalid value {dynamic!r}")
        actorder = d.get("actorder")
        if actorder is True:  # legacy: True meant "group"
            actorder = "group"
        elif actorder is False:
            actorder = None
        elif isinstance(actorder, str):
            actorder = {"static": "weight", "dynamic": "group"}.get(actorder.lower(), actorder.lower())
            if actorder not in ("weight", "group"):
                raise InvalidInput(f"{where}.actorder: unknown value {actorder!r}")
        elif actorder is not None:
            raise InvalidInput(f"{where}.actorder: invalid value {actorder!r}")
        symmetric = get("symmetric", (bool,), True)
        scale_dtype = d.get("scale_dtype")
        return cls(
            num_bits=num_bits, type=qtype, symmetric=True if symmetric is None else symmetric,
            group_size=group_size, strategy=strategy, block_structure=block, dynamic=dynamic,
            actorder=actorder, scale_dtype=None if scale_dtype is None else str(scale_dtype),
        )

    def as_json(self) -> dict:
        """The `scheme` object of inspect's JSON (CLI.md)."""
        return {
            "type": self.type, "num_bits": self.num_bits, "strategy": self.strategy,
            "group_size": self.group_size, "symmetric": self.symmetric,
            "dynamic": self.dynamic, "actorder": self.actorder,
            **({"block_structure": list(self.block_structure)} if self.block_structure else {}),
        }


@dataclass(frozen=True)
class Scheme:
    """One config group: what a matched module's weights and activations are, and the storage format."""

    name: str
    targets: tuple[str, ...]
    format: str
    weights: QuantArgs | None = None
    input_activations: QuantArgs | None = None
    output_activations: QuantArgs | None = None


@dataclass(frozen=True)
class QuantConfig:
    """A parsed `quantization_config` (compressed-tensors)."""

    format: str
    version: str | None
    status: str | None
    groups: tuple[Scheme, ...]
    ignore: tuple[str, ...]
    kv_cache_scheme: QuantArgs | None
    sparsity: bool  # a non-empty sparsity_config
    transform: bool  # a non-empty transform_config

    def scheme_for(self, name: str, class_name: str | None) -> Scheme | None:
        """The scheme that applies to module `name` of class `class_name` (e.g. "Linear"), or None."""
        if any(_matches(name, class_name, t) for t in self.ignore):
            return None
        target_to_scheme: dict[str, Scheme] = {}
        for g in self.groups:
            for t in g.targets:
                target_to_scheme[t] = g  # a later group takes over a repeated target
        ordered = sorted(target_to_scheme, key=lambda t: ("re:" in t, t))
        for t in ordered:
            if match_name(name, t):
                return target_to_scheme[t]
        for t in ordered:
            if class_name is not None and t == class_name:
                return target_to_scheme[t]
        return None


def match_name(name: str, target: str) -> bool:
    """A module name against one target: exact, or `re:` + regex anchored at the start (re.match)."""
    if target.startswith("re:"):
        return _regex(target[3:]).match(name) is not None
    return target == name


def _matches(name: str, class_name: str | None, target: str) -> bool:
    return match_name(name, target) or (class_name is not None and target == class_name)


_REGEX_CACHE: dict[str, re.Pattern] = {}


def _regex(pattern: str) -> re.Pattern:
    if pattern not in _REGEX_CACHE:
        _REGEX_CACHE[pattern] = re.compile(pattern)
    return _REGEX_CACHE[pattern]


# ---- presets (the library's PRESET_SCHEMES, as data) -----------------------------------------------

def _int_w(bits: int, **kw) -> dict:
    return {"num_bits": bits, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True, **kw}


_INT_TOKEN = lambda bits: {"num_bits": bits, "type": "int", "strategy": "token", "dynamic": True}  # noqa: E731
_FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
_MX = lambda bits: {"num_bits": bits, "type": "float", "strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"}  # noqa: E731
_NV = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "scale_dtype": "torch.float8_e4m3fn"}

PRESETS: dict[str, dict] = {
    "UNQUANTIZED": {},
    "W4A16_ASYM": {"weights": _int_w(4, symmetric=False)},
    "W8A8": {"weights": {"num_bits": 8, "strategy": "channel"}, "input_activations": _INT_TOKEN(8)},
    "INT8": {"weights": {"num_bits": 8, "strategy": "channel"}, "input_activations": _INT_TOKEN(8)},
    "W4AFP8": {"weights": _int_w(4), "input_activations": _FP8_TOKEN},
    "FP8": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
    "FP8_DYNAMIC": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                    "input_activations": _FP8_TOKEN},
    "FP8_BLOCK": {"weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                                        "dynamic": True}},
    "NVFP4A16": {"weights": _NV},
    "NVFP4": {"weights": _NV, "input_activations": {**_NV, "dynamic": "local"}},
    "MXFP4A16": {"weights": _MX(4)},
    "MXFP4": {"weights": _MX(4), "input_activations": {**_MX(4), "dynamic": True}},
    "MXFP4XFP8": {"weights": _MX(4), "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                                           "group_size": 128, "dynamic": True}},
    "MXFP6A16": {"weights": _MX(6)},
    "MXFP6A8": {"weights": _MX(6), "input_activations": {**_MX(8), "dynamic": True}},
    "MXFP8A16": {"weights": _MX(8)},
    "MXFP8": {"weights": _MX(8), "input_activations": {**_MX(8), "dynamic": True}},
}
for _w, _a in [(w, a) for w in range(2, 9) for a in (4, 8, 16) if w <= a]:
    PRESETS.setdefault(f"W{_w}A{_a}", {"weights": _int_w(_w), **({"input_activations": _INT_TOKEN(_a)} if _a < 16 else {})})


def _strings(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidInput(f"{where}: expected a list of strings")
    for v in value:
        if v.startswith("re:"):
            try:
                _regex(v[3:])
            except re.error as e:
                raise InvalidInput(f"{where}: invalid regex {v!r}: {e}") from None
    return tuple(value)


def parse_quantization_config(qc: object, where: str = "quantization_config") -> QuantConfig:
    """Parses a compressed-tensors `quantization_config` object.

    Args:
        qc: the object from config.json.
        where: prefix for error messages (e.g. "config.json: quantization_config").
    Returns:
        The QuantConfig. Raises InvalidInput with one line naming the bad field.
    """
    if not isinstance(qc, dict):
        raise InvalidInput(f"{where}: expected an object")
    fmt = qc.get("format", "dense")
    if not isinstance(fmt, str):
        raise InvalidInput(f"{where}.format: expected a string, found {fmt!r}")
    groups_in = qc.get("config_groups")
    if not isinstance(groups_in, dict):
        raise InvalidInput(f"{where}.config_groups: expected an object mapping group names to schemes")
    groups = []
    for gname, g in groups_in.items():
        gw = f"{where}.config_groups.{gname}"
        if isinstance(g, list):  # shorthand: "W4A16": ["Linear"]
            preset = PRESETS.get(gname.upper())
            if preset is None:
                raise InvalidInput(f"{gw}: {gname!r} is not a preset scheme name (known: {', '.join(PRESETS)})")
            targets, body, gfmt = _strings(g, gw), preset, None
        elif isinstance(g, dict):
            unknown = set(g) - {"targets", "weights", "input_activations", "output_activations", "format"}
            if unknown:
                raise InvalidInput(f"{gw}: unknown key(s) {sorted(unknown)}")
            targets, body, gfmt = _strings(g.get("targets"), f"{gw}.targets"), g, g.get("format")
        else:
            raise InvalidInput(f"{gw}: expected a scheme object or a list of targets")
        if gfmt is None:
            if fmt == "mixed-precision":
                raise InvalidInput(f"{gw}: format is mixed-precision, so every group needs its own 'format'")
            gfmt = fmt
        if not isinstance(gfmt, str):
            raise InvalidInput(f"{gw}.format: expected a string")
        args = {
            k: QuantArgs.parse(body[k], f"{gw}.{k}") if body.get(k) is not None else None
            for k in ("weights", "input_activations", "output_activations")
        }
        groups.append(Scheme(name=str(gname), targets=targets, format=gfmt, **args))
    ignore = _strings(qc.get("ignore") or [], f"{where}.ignore")
    kv = qc.get("kv_cache_scheme")
    version = qc.get("version")
    status = qc.get("quantization_status")
    return QuantConfig(
        format=fmt,
        version=str(version) if version is not None else None,
        status=str(status) if status is not None else None,
        groups=tuple(groups),
        ignore=ignore,
        kv_cache_scheme=QuantArgs.parse(kv, f"{where}.kv_cache_scheme") if kv is not None else None,
        sparsity=bool(qc.get("sparsity_config")),
        transform=bool(qc.get("transform_config")),
    )


# ---- tensors on disk per format (FORMATS.md, "Tensors") ---------------------------------------------

# ---- KV cache scales (kv_cache_scheme) ------------------------------------------------------------------

KV_SCALES = ("k_scale", "v_scale")  # tensors of each attention module (`...self_attn.k_scale`), float32


def kv_scheme_reason(args: QuantArgs) -> str | None:
    """Why a kv_cache_scheme cannot be served, or None: FP8 (E4M3, stored = fp8(x / scale)) with static
    symmetric scales per tensor ([1]) or per KV head ([kv_heads, 1, 1], strategy attn_head)."""
    if args.type != "float" or args.num_bits != 8:
        return f"kv_cache_scheme is {args.type} {args.num_bits}-bit: only an FP8 (float, 8-bit) KV cache is supported"
    if args.dynamic:
        return "kv_cache_scheme is dynamic: only static (calibrated) k/v scales are supported"
    if not args.symmetric:
        return "kv_cache_scheme is asymmetric: only symmetric FP8 KV scales are supported"
    if args.strategy not in ("tensor", "attn_head"):
        return f"kv_cache_scheme strategy {args.strategy!r}: only 'tensor' and 'attn_head' are supported"
    return None


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


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def stored_weight_name(scheme: Scheme | None) -> str:
    """Name of the tensor that holds a module's (packed) weight values under `scheme`."""
    if scheme is None or scheme.weights is None or scheme.format in ("dense", "float-quantized", "naive-quantized",
                                                                     "int-quantized", "mxfp8-quantized"):
        return "weight"
    return "weight_packed"


def weight_qtype(scheme: Scheme | None) -> str:
    """Short name of how the weight values are stored: bf16-like 'dense', 'int4', 'int8', 'fp8', 'mxfp4', ..."""
    if scheme is None or scheme.weights is None or scheme.format == "dense":
        return "dense"
    w = scheme.weights
    if scheme.format == "mxfp4-pack-quantized":
        return "mxfp4"
    if scheme.format == "nvfp4-pack-quantized":
        return "nvfp4"
    if scheme.format.startswith("mxfp"):
        return scheme.format.split("-")[0]
    return f"{'int' if w.type == 'int' else 'fp'}{w.num_bits}"


def expected_scale_shape(args: QuantArgs, lead: tuple[int, ...], out: int, inp: int) -> tuple[int, ...] | None:
    """Shape of `weight_scale` for a weight [*lead, out, inp] quantized with `args` (None: not checked)."""
    if args.strategy == "tensor":
        return None  # [1] or [] both occur; checked separately
    if args.strategy == "channel":
        return (*lead, out, 1)
    if args.strategy in ("group", "tensor_group"):
        return (*lead, out, _ceil(inp, args.group_size))
    if args.strategy == "block":
        r, c = args.block_structure
        return (*lead, _ceil(out, r), _ceil(inp, c))
    return None


def check_module_tensors(module: str, scheme: Scheme | None, params: dict) -> tuple[tuple[int, ...] | None, list[str]]:
    """Checks that a module's tensors are what `scheme` says they must be (names, dtypes, shapes).

    Args:
        module: module name, for messages.
        scheme: the scheme that targets it, or None when unquantized.
        params: parameter name (e.g. "weight_packed") -> TensorInfo.
    Returns:
        (logical weight shape [..., out, in] or None if unknown, list of one-line error messages).
    """
    errors: list[str] = []

    def need(param: str, dtypes: set[str] | None = None, shape: tuple | None = None):
        info = params.get(param)
        if info is None:
            errors.append(f"{module}: missing tensor {module}.{param} required by format {fmt}")
            return None
        if dtypes is not None and info.dtype not in dtypes:
            errors.append(f"{module}.{param}: dtype {info.dtype}, expected {' or '.join(sorted(dtypes))}")
        if shape is not None and info.shape != tuple(shape):
            errors.append(f"{module}.{param}: shape {list(info.shape)}, expected {list(shape)}")
        return info

    def check_scale(scale, lead: tuple, out: int, inp: int) -> None:
        """weight_scale against its strategy's shape ([1] or [] per tensor)."""
        if w.strategy == "tensor":
            if scale.shape not in ((), (1,)):
                errors.append(f"{module}.weight_scale: shape {list(scale.shape)}, expected [1] (per tensor)")
            return
        exp = expected_scale_shape(w, lead, out, inp)
        if exp is not None and scale.shape != exp:
            errors.append(f"{module}.weight_scale: shape {list(scale.shape)}, expected {list(exp)} "
                          f"({w.strategy} strategy)")

    floats = {"F16", "BF16", "F32"}
    fmt = scheme.format if scheme is not None else "dense"
    w = scheme.weights if scheme is not None else None
    if w is None or fmt == "dense":
        info = params.get("weight")
        if info is None:
            if any(p.startswith("weight_") for p in params):
                errors.append(f"{module}: holds quantized tensors ({', '.join(sorted(params))}) but no config "
                              "group of quantization_config targets it")
            return None, errors
        return info.shape, errors

    if fmt == "pack-quantized" and w.type == "int":
        packed = need("weight_packed", {"I32"})
        if packed is None or len(packed.shape) < 2:
            if packed is not None:
                errors.append(f"{module}.weight_packed: expected at least 2 dimensions, found {list(packed.shape)}")
            return None, errors
        *lead, out, cols = packed.shape
        lead = tuple(lead)
        per_word = 32 / w.num_bits
        inp = int(cols * per_word)  # exact whenever in_features fills whole words; --deep reads weight_shape
        need("weight_shape", {"I64", "I32"}, (len(packed.shape),))
        scale = need("weight_scale", floats)
        if scale is not None:
            if w.strategy == "group":
                lo = int((cols - 1) * per_word) + 1
                n_groups = scale.shape[-1] if scale.shape else -1
                if scale.shape[:-1] != (*lead, out) or not _ceil(lo, w.group_size) <= n_groups <= _ceil(inp, w.group_size):
                    errors.append(f"{module}.weight_scale: shape {list(scale.shape)}, expected "
                                  f"{list(expected_scale_shape(w, lead, out, inp))} for group size {w.group_size}")
            else:
                check_scale(scale, lead, out, inp)
        if not w.symmetric and w.strategy in ("group", "channel"):
            need("weight_zero_point", {"I32"})
        if w.actorder == "group":
            need("weight_g_idx", {"I32", "I64"})
        return (*lead, out, inp), errors

    if fmt == "float-quantized" or (fmt == "naive-quantized" and w.type == "float"):
        weight = need("weight", {"F8_E4M3"} if w.num_bits == 8 and w.type == "float" else None)
        if weight is None or len(weight.shape) < 2:
            return (weight.shape if weight is not None else None), errors
        *lead, out, inp = weight.shape
        scale = need("weight_scale", floats)
        if scale is not None:
            check_scale(scale, tuple(lead), out, inp)
        a = scheme.input_activations
        if a is not None and not a.dynamic:
            need("input_scale", floats)
        return weight.shape, errors

    if fmt in ("mxfp4-pack-quantized", "nvfp4-pack-quantized"):
        packed = need("weight_packed", {"U8"})
        if packed is None or len(packed.shape) < 2:
            return None, errors
        *lead, out, half = packed.shape
        inp = 2 * half
        group = 32 if fmt.startswith("mx") else 16
        need("weight_scale", {"U8", "F8_E8M0"} if fmt.startswith("mx") else {"F8_E4M3"},
             (*lead, out, _ceil(inp, group)))
        if fmt.startswith("nv"):
            need("weight_global_scale", {"F32"})
        return (*lead, out, inp), errors

    # Other formats are reported unsupported; only the presence of a weight tensor is checked.
    info = params.get(stored_weight_name(scheme)) or params.get("weight") or params.get("weight_packed")
    if info is None:
        errors.append(f"{module}: no weight tensor found for format {fmt}")
    return None, errors


def logical_shape(shapes: dict[str, tuple], weight_shape=None) -> tuple[int, ...]:
    """Logical weight shape [..., out, in] of a quantized module: the values of its `weight_shape` tensor when
    stored (pack-quantized), else its fp8 `weight`'s shape, else twice the fp4 bytes per row."""
    if weight_shape is not None:
        return tuple(int(x) for x in weight_shape)
    if "weight" in shapes:
        return tuple(shapes["weight"])
    packed = shapes["weight_packed"]
    return (*packed[:-1], packed[-1] * 2)


def can_dequantize(scheme: Scheme) -> bool:
    """Whether `dequantize` handles this scheme's weights."""
    w, fmt = scheme.weights, scheme.format
    if fmt == "pack-quantized":
        return w.type == "int" and w.symmetric and w.actorder != "group" and w.strategy in ("group", "channel")
    if fmt == "float-quantized":
        return w.type == "float" and w.num_bits == 8 and w.strategy in ("tensor", "channel", "block", "group")
    return fmt == "mxfp4-pack-quantized"


def dequantize(scheme: Scheme, arrays: dict, shape: tuple[int, ...]):
    """Dequantizes one module's stored weight to float32, as the library does (q * scale per group).

    The product of a 4/8-bit value and a bf16/f16/f32 scale is exact in float32, so casting the result
    to the scale's dtype rounds once, exactly like the library's multiply in that dtype.

    Args:
        scheme: the module's scheme (a served weight type: int pack-quantized, fp8, mxfp4).
        arrays: parameter name -> numpy array (weight_packed / weight, weight_scale).
        shape: logical weight shape [..., out, in].
    Returns:
        float32 [..., out, in].
    """
    import numpy as np

    from quantkit.formats import packing

    w, fmt = scheme.weights, scheme.format
    inp = shape[-1]
    if fmt == "mxfp4-pack-quantized":
        values = packing.unpack_fp4(np.asarray(arrays["weight_packed"]))
        scale = packing.e8m0_to_float(np.asarray(arrays["weight_scale"]))
        return values * packing.expand_groups(scale, 32, inp)
    if fmt == "pack-quantized":
        q = packing.unpack_int(np.asarray(arrays["weight_packed"]), w.num_bits, inp).astype(np.float32)
        if not w.symmetric:
            raise ValueError("asymmetric weights are not dequantized by quantkit")
    else:  # float-quantized
        q = np.asarray(arrays["weight"]).astype(np.float32)
    scale = np.asarray(arrays["weight_scale"]).astype(np.float32)
    if w.strategy == "tensor":
        return q * scale.reshape(())
    if w.strategy == "block":
        return q * packing.expand_blocks(scale, w.block_structure, shape)
    if w.strategy == "group":
        return q * packing.expand_groups(scale, w.group_size, inp)
    return q * scale  # channel: [..., out, 1]


# ---- writing: what quantkit convert produces per scheme ---------------------------------------------

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
        groups = 1 if group_size == -1 else _ceil(inp, group_size)
        return {"weight_packed": ("I32", (out, _ceil(inp * 4, 32))), "weight_scale": (dtype, (out, groups)),
                "weight_shape": ("I64", (2,))}
    if scheme == "FP8_DYNAMIC":
        return {"weight": ("F8_E4M3", (out, inp)), "weight_scale": (dtype, (out, 1))}
    if scheme == "FP8_BLOCK":
        return {"weight": ("F8_E4M3", (out, inp)), "weight_scale": (dtype, (_ceil(out, 128), _ceil(inp, 128)))}
    if scheme == "MXFP4A16":
        return {"weight_packed": ("U8", (out, inp // 2)), "weight_scale": ("U8", (out, inp // 32))}
    raise ValueError(f"quantkit does not write scheme {scheme!r}")


def kernel_shapes(scheme: Scheme, shape: tuple[int, int], scale_dtype: str = "bfloat16"):
    """What `kernel_layout` returns for a logical [out, in] weight, without data (for `plan`):
    (scales shape [in // group, out], scales dtype, qtype, group)."""
    out, inp = shape
    w, fmt = scheme.weights, scheme.format
    if fmt == "mxfp4-pack-quantized":
        return (inp // 32, out), "uint8", "mxfp4", 32
    qtype = "int4" if fmt == "pack-quantized" else "fp8"
    group = {"group": w.group_size, "block": (w.block_structure or (0, 128))[1]}.get(w.strategy, inp)
    return (inp // group, out), scale_dtype, qtype, group


def kernel_layout(scheme: Scheme, arrays: dict, shape: tuple[int, int]):
    """A served weight in the runtime's layout (see quant/qtensor.py), in numpy.

    Args:
        scheme: the module's scheme (int4 pack-quantized, fp8 float-quantized, mxfp4).
        arrays: parameter name -> numpy array as stored.
        shape: logical [out, in].
    Returns:
        (values [in, out] int8 (int4 values or e2m1 codes as signed nibbles) or float8_e4m3fn,
         scales [in // group, out] (float32/bfloat16 as stored, uint8 E8M0 for mxfp4), qtype, group).
    """
    import numpy as np

    from quantkit.formats import packing

    out, inp = shape
    w, fmt = scheme.weights, scheme.format
    scale = np.asarray(arrays["weight_scale"])
    if fmt == "mxfp4-pack-quantized":
        packed = np.asarray(arrays["weight_packed"])
        codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(out, inp).astype(np.int8)
        return np.where(codes >= 8, codes - 16, codes).astype(np.int8).T, scale.view(np.uint8).T, "mxfp4", 32
    if fmt == "pack-quantized":
        values, qtype = packing.unpack_int(np.asarray(arrays["weight_packed"]), w.num_bits, inp).T, "int4"
    else:
        values, qtype = np.asarray(arrays["weight"]).T, "fp8"
    if w.strategy == "group":
        return values, scale.T, qtype, w.group_size
    if w.strategy == "block":  # [ceil(out/br), ceil(in/bc)] -> one scale per bc inputs and per column
        br, bc = w.block_structure
        return values, np.repeat(scale.T, br, axis=1)[:, :out], qtype, bc
    if w.strategy == "tensor":
        return values, np.broadcast_to(scale.reshape(1, 1), (1, out)).copy(), qtype, inp
    return values, scale.T, qtype, inp  # channel: [out, 1] -> [1, out]
