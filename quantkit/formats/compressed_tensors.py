"""compressed-tensors `quantization_config`: parsed into frozen Schemes, matched to modules.

Mirrors the library's rules (compressed-tensors 0.20.1, see FORMATS.md) without importing it:
- a config group is a scheme dict or, in shorthand, a preset name mapped to its targets;
- a target is an exact module name, a `re:` regex (re.match on the module name) or a class name;
- when several targets match a module, exact names win over regexes over class names (alphabetical
  within a kind), and a target listed by two groups belongs to the later one;
- `ignore` entries use the same matching and always win;
- every field is typed as the library types it; a wrong type is one InvalidInput line naming the field.
Also here: which schemes quantkit serves and why not (`unsupported_reason`, `config_findings`), and what tensors
each format stores (`check_module_tensors`, `check_module_data`).
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


_REQUIRED = object()


def _describe(v: object) -> str:
    """A JSON value as error messages name it: null, true, string 'x', list [1], object {...}."""
    if v is None or isinstance(v, bool):
        return {None: "null", True: "true", False: "false"}[v]
    kind = {str: "string", int: "integer", float: "number", list: "list", dict: "object"}.get(type(v), type(v).__name__)
    text = repr(v) if not isinstance(v, int) or abs(v) < 10**40 else f"of {v.bit_length()} bits"
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"


def _field(d: dict, key: str, where: str, types, what: str, default=_REQUIRED, nullable: bool = False):
    """d[key] if it is one of `types` (a bool only where bool is listed, null only when `nullable`), `default`
    when absent; otherwise InvalidInput naming the field, what it expects and what it got."""
    if key not in d:
        if default is _REQUIRED:
            raise InvalidInput(f"{where}.{key}: missing (expected {what})")
        return default
    v = d[key]
    types = types if isinstance(types, tuple) else (types,)
    if (v is None and nullable) or (isinstance(v, types) and (bool in types or not isinstance(v, bool))):
        return v
    raise InvalidInput(f"{where}.{key}: expected {what}, got {_describe(v)}")


def _block_structure(d: dict, where: str) -> tuple[int, int] | None:
    """block_structure: [rows, cols] (or the older "RxC" string), both positive."""
    block = _field(d, "block_structure", where, (list, str), "[rows, cols] or null", None, nullable=True)
    if block is None:
        return None
    rc = block
    if isinstance(block, str):  # the older "128x128"
        rc = [int(p) if p.isdecimal() and len(p) < 10 else 0 for p in block.split("x")]
    if not (len(rc) == 2 and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in rc)):
        raise InvalidInput(f"{where}.block_structure: expected [rows, cols] of positive integers, "
                           f"got {_describe(block)}")
    return rc[0], rc[1]


def _actorder(d: dict, where: str) -> str | None:
    """actorder as "weight", "group" or None (legacy spellings: True = group, static / dynamic)."""
    v = _field(d, "actorder", where, (bool, str), "'weight', 'group' or null", None, nullable=True)
    if v is None or isinstance(v, bool):
        return "group" if v else None
    order = {"static": "weight", "dynamic": "group"}.get(v.lower(), v.lower())
    if order not in ("weight", "group"):
        raise InvalidInput(f"{where}.actorder: expected 'weight', 'group' or null, got {_describe(v)}")
    return order


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
        """QuantizationArgs from config.json; InvalidInput naming the field on a wrong type or value."""
        if not isinstance(d, dict):
            raise InvalidInput(f"{where}: expected an object, got {_describe(d)}")
        unknown = set(d) - _ARG_KEYS
        if unknown:
            raise InvalidInput(f"{where}: unknown key(s) {sorted(unknown)}")
        num_bits = _field(d, "num_bits", where, int, "an integer", 8)
        if not 1 <= num_bits <= 32:
            raise InvalidInput(f"{where}.num_bits: expected a bit width from 1 to 32, got {_describe(num_bits)}")
        qtype = _field(d, "type", where, str, "'int' or 'float'", "int").lower()
        if qtype not in ("int", "float"):
            raise InvalidInput(f"{where}.type: expected 'int' or 'float', got {_describe(qtype)}")
        group_size = _field(d, "group_size", where, int, "an integer or null", None, nullable=True)
        if group_size is not None and group_size < -1:
            raise InvalidInput(f"{where}.group_size: expected > 0, or -1 for channel, got {_describe(group_size)}")
        strategy = _field(d, "strategy", where, str, "a strategy name or null", None, nullable=True)
        if strategy is None:
            if group_size == 0:
                raise InvalidInput(f"{where}.group_size: expected > 0, or -1 for channel, got integer 0")
            strategy = "tensor" if group_size is None else "group" if group_size > 0 else "channel"
        strategy = strategy.lower()
        if strategy not in STRATEGIES:
            raise InvalidInput(f"{where}.strategy: expected one of {', '.join(STRATEGIES)}, got {_describe(strategy)}")
        if strategy in ("group", "tensor_group") and not (group_size and group_size > 0):
            raise InvalidInput(f"{where}: strategy {strategy} needs a positive group_size")
        block = _block_structure(d, where)
        if (strategy == "block") != (block is not None):
            raise InvalidInput(f"{where}: strategy 'block' and block_structure go together")
        dynamic = _field(d, "dynamic", where, (bool, str), "true, false or 'local'", False)
        if isinstance(dynamic, str):
            if dynamic.lower() != "local":
                raise InvalidInput(f"{where}.dynamic: expected true, false or 'local', got {_describe(dynamic)}")
            dynamic = "local"
        for key in ("zp_dtype", "observer"):  # not used by quantkit, but typed like the library
            _field(d, key, where, str, "a string or null", None, nullable=True)
        _field(d, "observer_kwargs", where, dict, "an object", {})
        return cls(
            num_bits=num_bits, type=qtype, symmetric=_field(d, "symmetric", where, bool, "true or false", True),
            group_size=group_size, strategy=strategy, block_structure=block, dynamic=dynamic,
            actorder=_actorder(d, where),
            scale_dtype=_field(d, "scale_dtype", where, str, "a dtype name or null", None, nullable=True),
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
        raise InvalidInput(f"{where}: expected a list of strings, got {_describe(value)}")
    for v in value:
        if v.startswith("re:"):
            try:
                _regex(v[3:])
            except re.error as e:
                raise InvalidInput(f"{where}: invalid regex {v!r}: {e}") from None
    return tuple(value)


_GROUP_KEYS = frozenset({"targets", "weights", "input_activations", "output_activations", "format"})


def _parse_group(name: str, g: object, fmt: str, where: str) -> Scheme:
    """One config group: a scheme object, or in shorthand a preset name mapped to its targets."""
    if isinstance(g, list):  # shorthand: "W4A16": ["Linear"]
        preset = PRESETS.get(name.upper())
        if preset is None:
            raise InvalidInput(f"{where}: {name!r} is not a preset scheme name (known: {', '.join(PRESETS)})")
        targets, body, gfmt = _strings(g, where), preset, None
    elif isinstance(g, dict):
        unknown = set(g) - _GROUP_KEYS
        if unknown:
            raise InvalidInput(f"{where}: unknown key(s) {sorted(unknown)}")
        targets = _strings(_field(g, "targets", where, list, "a list of strings"), f"{where}.targets")
        body, gfmt = g, _field(g, "format", where, str, "a format name or null", None, nullable=True)
    else:
        raise InvalidInput(f"{where}: expected a scheme object or a list of targets, got {_describe(g)}")
    if gfmt is None:
        if fmt == "mixed-precision":
            raise InvalidInput(f"{where}: format is mixed-precision, so every group needs its own 'format'")
        gfmt = fmt
    args = {k: QuantArgs.parse(body[k], f"{where}.{k}") if body.get(k) is not None else None
            for k in ("weights", "input_activations", "output_activations")}
    return Scheme(name=name, targets=targets, format=gfmt, **args)


def parse_quantization_config(qc: object, where: str = "quantization_config") -> QuantConfig:
    """Parses a compressed-tensors `quantization_config` object, checking each field's type as the library does.

    Args:
        qc: the object from config.json.
        where: prefix for error messages (e.g. "config.json: quantization_config").
    Returns:
        The QuantConfig. Raises InvalidInput with one line naming the bad field (its path from `where`).
    """
    if not isinstance(qc, dict):
        raise InvalidInput(f"{where}: expected an object, got {_describe(qc)}")
    fmt = _field(qc, "format", where, str, "a format name", "dense")
    groups = _field(qc, "config_groups", where, dict, "an object mapping group names to schemes")
    ignore = _field(qc, "ignore", where, list, "a list of strings", [], nullable=True)
    kv = qc.get("kv_cache_scheme")
    version = _field(qc, "version", where, (str, int, float), "a version string", None, nullable=True)
    sparsity, transform = (_field(qc, key, where, dict, "an object or null", None, nullable=True)
                           for key in ("sparsity_config", "transform_config"))
    return QuantConfig(
        format=fmt,
        version=None if version is None else str(version),
        status=_field(qc, "quantization_status", where, str, "a string", None, nullable=True),
        groups=tuple(_parse_group(str(n), g, fmt, f"{where}.config_groups.{n}") for n, g in groups.items()),
        ignore=_strings(ignore or [], f"{where}.ignore"),
        kv_cache_scheme=QuantArgs.parse(kv, f"{where}.kv_cache_scheme") if kv is not None else None,
        sparsity=bool(sparsity),
        transform=bool(transform),
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


# ---- what quantkit serves: the format-level verdict per scheme and per config ------------------------

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


def _int_reason(w: QuantArgs, fmt: str) -> str | None:
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


def unsupported_reason(scheme: Scheme) -> str | None:
    """Why quantkit cannot serve weights stored under `scheme` at all (whatever the chip), or None if it can:
    symmetric int4 (pack-quantized, group or channel scales), fp8 e4m3 (float-quantized, tensor, channel or
    block scales) and mxfp4, with no activation quantization other than fp8."""
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
        return _int_reason(w, fmt)
    if w.type == "float" and w.num_bits == 8:
        if fmt != "float-quantized":
            return f"fp8 weights stored as {fmt} are not supported; only float-quantized fp8 is"
        if w.strategy not in ("tensor", "channel", "block"):
            return f"fp8 with {w.strategy} scales is not supported; only tensor, channel and block scales are"
        return None
    if qtype == "mxfp4":
        return None
    return f"{w.type}{w.num_bits} weights in format {fmt} are not supported"


def quantization_config_of(config: dict | None, where: str) -> tuple[dict | None, QuantConfig | None]:
    """config.json's `quantization_config` as stored, and parsed when its quant_method is compressed-tensors.

    Args:
        config: the parsed config.json, or None.
        where: the config.json path, for messages.
    Returns:
        (raw dict or None, QuantConfig or None). Raises InvalidInput when it is not an object or does not parse.
    """
    raw = (config or {}).get("quantization_config")
    if raw is None:
        return None, None
    if not isinstance(raw, dict):
        raise InvalidInput(f"{where}: quantization_config is not an object")
    if raw.get("quant_method", "compressed-tensors") != "compressed-tensors":
        return raw, None
    return raw, parse_quantization_config(raw, f"{where}: quantization_config")


def config_findings(raw: dict | None, qc: QuantConfig | None) -> list[tuple[str, str]]:
    """Checkpoint-wide (severity, message) pairs about a quantization_config: "unsupported" for what the
    runtime cannot serve, "warning" for what it serves differently than stored."""
    if raw is not None and qc is None:
        return [("unsupported", f"quant_method {raw.get('quant_method')!r} is not compressed-tensors; quantkit "
                 "reads compressed-tensors checkpoints only (re-quantize the original with `quantkit convert`)")]
    out = []
    if qc is None:
        return out
    if qc.sparsity:
        out.append(("unsupported", "sparsity_config is set: sparse compressed-tensors checkpoints are not supported"))
    if qc.transform:
        out.append(("unsupported", "transform_config is set: online rotations (SpinQuant/QuIP transforms) are not "
                    "supported by the runtime"))
    if qc.kv_cache_scheme is not None and kv_scheme_reason(qc.kv_cache_scheme):
        out.append(("unsupported", kv_scheme_reason(qc.kv_cache_scheme)))
    if qc.status not in (None, "compressed"):
        out.append(("warning", f"quantization_status is {qc.status!r}, expected 'compressed'"))
    if any(g.input_activations is not None for g in qc.groups):
        out.append(("warning", "fp8 activation quantization in the scheme: the runtime computes activations in "
                    "bf16 (weights stay quantized)"))
    return out


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
        if scale.shape[:-1] != (*lead, out) or not _ceil(lo, w.group_size) <= n_groups <= _ceil(inp, w.group_size):
            t.errors.append(f"{t.module}.weight_scale: shape {list(scale.shape)}, expected "
                            f"{list(expected_scale_shape(w, lead, out, inp))} for group size {w.group_size}")
    if not w.symmetric and w.strategy in ("group", "channel"):
        t.need("weight_zero_point", {"I32"})
    if w.actorder == "group":
        t.need("weight_g_idx", {"I32", "I64"})
    return (*lead, out, inp)


def _check_float(t: _Tensors, scheme: Scheme) -> tuple[int, ...] | None:
    """float-quantized (fp8 e4m3 `weight`) and naive-quantized floats: weight, scale, static input_scale."""
    w = scheme.weights
    weight = t.need("weight", {"F8_E4M3"} if w.num_bits == 8 and w.type == "float" else None)
    if weight is None or len(weight.shape) < 2:
        return weight.shape if weight is not None else None
    *lead, out, inp = weight.shape
    t.scale(w, tuple(lead), out, inp)
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
    t.need("weight_scale", {"U8", "F8_E8M0"} if mx else {"F8_E4M3"}, (*lead, out, _ceil(2 * half, 32 if mx else 16)))
    if not mx:
        t.need("weight_global_scale", {"F32"})
    return (*lead, out, 2 * half)


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
    elif fmt == "float-quantized" or (fmt == "naive-quantized" and w.type == "float"):
        shape = _check_float(t, scheme)
    elif fmt in ("mxfp4-pack-quantized", "nvfp4-pack-quantized"):
        shape = _check_fp4(t)
    else:  # other formats are reported unsupported; only the presence of a weight tensor is checked
        shape = None
        if not (params.get(stored_weight_name(scheme)) or params.get("weight") or params.get("weight_packed")):
            t.errors.append(f"{module}: no weight tensor found for format {fmt}")
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
        if param.endswith("scale") or param == "weight_global_scale":
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
        g = read(params["weight_g_idx"].name)
        if g.shape[-1:] != shape[-1:] or g.min(initial=0) < 0 or g.max(initial=0) >= _ceil(shape[-1], w.group_size):
            found.append(("error", f"{module}.weight_g_idx", f"{module}.weight_g_idx is out of range"))
    return shape, found


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


# ---- convert: how each writable scheme is quantized, stored row by row, and named in config.json ------

def writable_spec(scheme: str, group_size: int):
    """The quant.quantize.QuantSpec that produces the weights writable_group(scheme, group_size) declares."""
    from quantkit.quant.quantize import QuantSpec

    w = writable_group(scheme, group_size)["weights"]
    kind = "int" if w["type"] == "int" else "fp8" if w["num_bits"] == 8 else "mxfp4"
    block = w.get("block_structure")
    return QuantSpec(kind, w["num_bits"], w.get("group_size") or -1, tuple(block) if block else None)


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
        return r0 // w.block_structure[0], _ceil(r1, w.block_structure[0])
    return r0, r1


def output_config(config: dict, scheme: str, group_size: int, ignore: list[str]) -> dict:
    """SRC's config.json rewritten for the converted checkpoint: with the `quantization_config` of a
    writable scheme, or for DENSE without one and with bfloat16 as the dtype."""
    if scheme != "DENSE":
        return {**config, "quantization_config": writable_config(scheme, group_size, ignore)}
    dense = {k: v for k, v in config.items() if k != "quantization_config"}
    return dense | {k: "bfloat16" for k in ("torch_dtype", "dtype") if k in dense}
