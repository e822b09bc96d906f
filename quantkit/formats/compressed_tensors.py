"""compressed-tensors `quantization_config`: parsed into frozen Schemes, matched to modules.

Mirrors the library's rules (compressed-tensors 0.20.1, see docs/formats.md, "On disk") without importing it:
- a config group is a scheme dict or, in shorthand, a preset name mapped to its targets;
- a target is an exact module name, a `re:` regex (re.match on the module name) or a class name;
- when several targets match a module, exact names win over regexes over class names (alphabetical
  within a kind), and a target listed by two groups belongs to the later one;
- `ignore` entries use the same matching and always win;
- every field is typed as the library types it; a wrong type is one InvalidInput line naming the field.
What each format stores on disk is formats/ct_tensors.py, what `convert` writes formats/ct_writer.py, and
which schemes the runtime serves runtime/validate.py.
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
        """The `scheme` object of inspect's JSON (docs/cli.md), also what `convert` writes as QuantizationArgs."""
        return {
            "type": self.type, "num_bits": self.num_bits, "strategy": self.strategy,
            "group_size": self.group_size, "symmetric": self.symmetric,
            "dynamic": self.dynamic, "actorder": self.actorder,
            **({"block_structure": list(self.block_structure)} if self.block_structure else {}),
            **({"scale_dtype": self.scale_dtype} if self.scale_dtype else {}),
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


TRANSFORM_LOCATIONS = ("input", "weight_input", "weight_output", "output", "k_cache", "q_attn")


@dataclass(frozen=True)
class Transform:
    """One `apply` entry of a transform_config group `group`: a matrix of `type` applied at `location` of the
    modules `targets` match and `ignore` does not (names, regexes or class names, as quantization targets),
    transposed when `inverse`, block-diagonal in blocks of `head_dim` when set. The library names the module
    holding an online one's matrix `<module>.<group>_<location>` (its tensor `weight`, and `perm` when
    `randomize`); modules of one group and size share one matrix, stored once."""

    group: str
    type: str
    location: str
    inverse: bool
    targets: tuple[str, ...]
    ignore: tuple[str, ...]
    head_dim: int | None
    randomize: bool
    precision: str

    def applies_to(self, name: str, class_name: str | None) -> bool:
        return (any(_matches(name, class_name, t) for t in self.targets)
                and not any(_matches(name, class_name, t) for t in self.ignore))


def _parse_transforms(tc: dict | None, where: str) -> tuple[Transform, ...]:
    """transform_config's `config_groups`, one Transform per `apply` entry (fields checked as the library's
    TransformScheme / TransformArgs: unknown keys refused)."""
    if not tc:
        return ()
    groups = _field(tc, "config_groups", where, dict, "an object mapping names to transform schemes", {})
    out = []
    for name, g in groups.items():
        w = f"{where}.config_groups.{name}"
        if not isinstance(g, dict):
            raise InvalidInput(f"{w}: expected a transform scheme object, got {_describe(g)}")
        unknown = set(g) - {"type", "apply", "randomize", "requires_grad", "head_dim", "precision"}
        if unknown:
            raise InvalidInput(f"{w}: unknown key(s) {sorted(unknown)}")
        head_dim = _field(g, "head_dim", w, int, "a positive integer or null", None, nullable=True)
        if head_dim is not None and head_dim <= 0:
            raise InvalidInput(f"{w}.head_dim: expected a positive integer or null, got {head_dim}")
        common = dict(group=str(name), type=_field(g, "type", w, str, "a transform type"), head_dim=head_dim,
                      randomize=_field(g, "randomize", w, bool, "true or false", False),
                      precision=_field(g, "precision", w, str, "a dtype name", "torch.float32"))
        for i, a in enumerate(_field(g, "apply", w, list, "a list of transform args", [])):
            wa = f"{w}.apply[{i}]"
            if not isinstance(a, dict):
                raise InvalidInput(f"{wa}: expected an object, got {_describe(a)}")
            if set(a) - {"targets", "location", "inverse", "ignore"}:
                raise InvalidInput(f"{wa}: unknown key(s) {sorted(set(a) - {'targets', 'location', 'inverse', 'ignore'})}")
            location = _field(a, "location", wa, str, "a location")
            if location not in TRANSFORM_LOCATIONS:
                raise InvalidInput(f"{wa}.location: {location!r} is not one of {', '.join(TRANSFORM_LOCATIONS)}")
            targets, ignore = (a.get(k, []) for k in ("targets", "ignore"))
            out.append(Transform(location=location, inverse=_field(a, "inverse", wa, bool, "true or false", False),
                                 targets=_strings([targets] if isinstance(targets, str) else targets, f"{wa}.targets"),
                                 ignore=_strings([ignore] if isinstance(ignore, str) else ignore, f"{wa}.ignore"),
                                 **common))
    return tuple(out)


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
    transforms: tuple[Transform, ...] = ()  # transform_config's, one per apply entry

    def input_transforms(self, name: str, class_name: str | None) -> list[Transform]:
        """The online transforms of module `name`'s input (location "input")."""
        return [t for t in self.transforms if t.location == "input" and t.applies_to(name, class_name)]

    def transform_module(self, module: str) -> Transform | None:
        """The transform whose matrix module `module` (`<module>.<group>_<location>`) holds, or None."""
        last = module.rpartition(".")[2]
        return next((t for t in self.transforms if last == f"{t.group}_{t.location}"), None)

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
        transforms=_parse_transforms(transform, f"{where}.transform_config"),
    )


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


def activation_qtype(scheme: Scheme | None) -> str:
    """How the runtime quantizes a Linear's input activations under `scheme` (QTensor.act), "" for none (A16,
    and what is not honoured: static fp8 activations, computed in bf16 with a warning). Dynamic and symmetric:
    - "int8" / "fp8": per token, int8 (W8A8, W4A8: each row's absmax / 127.5) or fp8 e4m3 (FP8_DYNAMIC,
      W4AFP8: absmax / 448), as compressed-tensors computes them; the codes go to the MXU (runtime/ops.quantize_rows);
    - "mxfp4" / "mxfp8": e2m1 / e4m3 per group of 32 inputs with an E8M0 scale (MXFP4, MXFP8, MXFP6A8),
      "fp8_g<N>": e4m3 per group of N with a float scale (FP8_BLOCK, MXFP4XFP8), and "nvfp4": e2m1 per group
      of 16 with an fp8 scale relative to the module's static `input_global_scale` (NVFP4, `dynamic: local`):
      quantize-dequantized exactly as the library does (runtime/ops.fake_quantize_groups), then the weights'
      bf16 path."""
    a = None if scheme is None else scheme.input_activations
    if a is None or not a.symmetric:
        return ""
    if a.dynamic == "local" and a.type == "float" and a.num_bits == 4 and a.strategy == "tensor_group" \
            and a.group_size == 16:
        return "nvfp4"
    if a.dynamic is not True:
        return ""
    if a.num_bits == 8 and a.strategy == "token":
        return {"int": "int8", "float": "fp8"}.get(a.type, "")
    if a.type == "float" and a.strategy == "group" and a.group_size and a.group_size > 0:
        if a.scale_dtype == "torch.uint8" and a.group_size == 32 and a.num_bits in (4, 8):
            return f"mxfp{a.num_bits}"
        if a.scale_dtype is None and a.num_bits == 8:
            return f"fp8_g{a.group_size}"
    return ""


def activation_group(act: str) -> int:
    """The inputs per activation scale of an `activation_qtype` code: 32 for MX, 16 for nvfp4, N for
    "fp8_g<N>", 0 for the per-token row codes and ""."""
    return 32 if act.startswith("mx") else 16 if act == "nvfp4" else int(act.split("_g")[1]) if "_g" in act else 0


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
