"""Is a checkpoint valid, and can the runtime serve it? The checks `inspect` reports and the loader enforces.

Headers only, plus the few bytes of k/v scales. What each format stores is format knowledge
(formats/ct_tensors.py); which schemes the runtime serves, and on which path, is decided here (serving
policy, beside the kernels' feasibility in kernels/dispatch.py), with the architecture verdict of
runtime/config.py. `validate_checkpoint` opens a checkpoint once for inspect, convert and the loader.
Imports nothing heavy (no jax, torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.errors import InvalidInput, Unsupported
from quantkit.formats.compressed_tensors import (SPARSE_FORMATS, QuantArgs, QuantConfig, Scheme, activation_group,
                                                 activation_qtype, quantization_config_of, weight_qtype)
from quantkit.formats.ct_tensors import (KV_SCALES, check_global_scales, check_module_tensors, kernel_shapes, kv_head_scales,
                                        stored_transforms, transform_size)
from quantkit.formats.hf import Checkpoint, classify_module, group_modules
from quantkit.kernels.dispatch import Verdict, kernel_path
from quantkit.kernels.tiling import Chip
from quantkit.runtime.config import ModelConfig
from quantkit.runtime.layout import described_shapes
from quantkit.runtime.models import from_hf


# ---- serving policy: which schemes the runtime serves at all, and on which path ----------------------

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



def _act_reason(name: str, a: QuantArgs | None) -> str | None:
    if a is None:
        return None
    if name == "output_activations":
        return (f"output activation quantization ({a.type}{a.num_bits} {a.strategy}) is not supported by the "
                "runtime; re-quantize without output_activations")
    if a.type == "float" and a.num_bits == 8:
        return None  # fp8 activations: the runtime keeps activations in bf16 (reported as a warning)
    how = "static scales (they need calibration)" if not a.dynamic else "" if a.symmetric else "zero points"
    return (f"{a.type}{a.num_bits} {a.strategy} input activation quantization{' with ' + how if how else ''} is "
            "not implemented by the runtime (it serves dynamic symmetric int8 and fp8 per token, fp8 per group, "
            "MX fp4 / fp8 per 32 and NVFP4's fp4 per 16, and computes static fp8 ones in bf16); convert to W8A8, "
            "W4A16 or FP8_DYNAMIC with `quantkit convert`")


def _int_reason(w: QuantArgs, fmt: str) -> str | None:
    if w.actorder == "group" and w.strategy != "group":
        return (f"activation-ordered groups (actorder=group) with {w.strategy} scales: g_idx needs group scales")
    if not 2 <= w.num_bits <= 8:
        return (f"int{w.num_bits} weights are not supported: the runtime serves ints of 2 to 8 bits, fp8, mxfp4, "
                "mxfp6, mxfp8 and nvfp4; convert with `quantkit convert --scheme W4A16` or W8A16")
    if fmt not in ("pack-quantized", "int-quantized"):
        return f"int{w.num_bits} weights stored as {fmt} are not supported; only pack- and int-quantized are"
    if w.strategy not in ("group", "channel"):
        return f"int{w.num_bits} with {w.strategy} scales is not supported; only group and channel scales are"
    return None


def unsupported_reason(scheme: Scheme) -> str | None:
    """Why quantkit cannot serve weights stored under `scheme` at all (whatever the chip), or None if it can:
    int4 and int8 with or without zero points (pack- or int-quantized, group or channel scales), fp8 e4m3 (float-quantized,
    tensor, channel or block scales), mxfp4, mxfp6 (served as mxfp8), mxfp8 and nvfp4, with no activation
    quantization other than the dynamic symmetric kinds of `activation_qtype` (int8 only with int weights)
    and static fp8 (computed in bf16)."""
    w, fmt = scheme.weights, scheme.format
    if fmt in SPARSE_FORMATS:
        return (f"sparse format {fmt} is not supported (its compressor was removed in compressed-tensors 0.15); "
                "densify the checkpoint first")
    for name in ("input_activations", "output_activations"):
        if name == "input_activations" and activation_qtype(scheme):
            continue  # dynamic int8 / fp8 per token, fp8 per group, MX per 32: QTensor.act
        reason = _act_reason(name, getattr(scheme, name))
        if reason:
            return reason
    if w is None or fmt == "dense":
        return None
    qtype = weight_qtype(scheme)
    if activation_qtype(scheme) == "int8" and w.type != "int":
        return f"int8 activations with {qtype} weights are not supported; only with int weights (W8A8, W4A8)"
    if qtype == "nvfp4":
        if w.group_size != 16 or w.strategy != "tensor_group" or not w.symmetric:
            return (f"NVFP4 with {w.strategy} scales of group {w.group_size}"
                    f"{'' if w.symmetric else ', asymmetric'} is not supported; only the library's "
                    "tensor_group of 16, symmetric, is")
        return None
    if qtype in ("mxfp4", "mxfp6", "mxfp8"):
        return None
    if w.type == "int":
        return _int_reason(w, fmt)
    if w.type == "float" and w.num_bits == 8:
        if fmt != "float-quantized":
            return f"fp8 weights stored as {fmt} are not supported; only float-quantized fp8 is"
        if w.strategy not in ("tensor", "channel", "block"):
            return f"fp8 with {w.strategy} scales is not supported; only tensor, channel and block scales are"
        return None
    return f"{w.type}{w.num_bits} weights in format {fmt} are not supported"



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
    for t in qc.transforms:
        if t.location in ("weight_input", "weight_output"):
            continue  # fused into the stored weights
        what = f"transform_config group {t.group!r}: {t.type} transform at location {t.location!r}"
        if t.location != "input":
            out.append(("unsupported", f"{what} is not supported: quantkit applies online transforms at Linear "
                        "inputs only (location 'input'; weight_input / weight_output ones are in the weights)"))
        elif t.type not in ("hadamard", "random-hadamard"):
            out.append(("unsupported", f"{what} is not supported: online input transforms must be hadamard or "
                        "random-hadamard"))
        elif t.precision not in ("torch.float32", "float32"):
            out.append(("unsupported", f"{what} in precision {t.precision} is not supported: quantkit applies "
                        "it in float32"))
    if qc.kv_cache_scheme is not None and kv_scheme_reason(qc.kv_cache_scheme):
        out.append(("unsupported", kv_scheme_reason(qc.kv_cache_scheme)))
    odd = sorted({g.weights.num_bits for g in qc.groups if g.weights is not None and g.weights.type == "int"
                  and g.format in (None, "pack-quantized") and g.weights.num_bits in (3, 5, 6, 7)})
    if odd and _version(qc.version) < (0, 18):
        out.append(("unsupported", f"int{odd[0]} weights packed by compressed-tensors {qc.version}: before 0.18 a "
                    f"word held {32 // odd[0]} whole values, quantkit reads the layout of 0.18 on (values across "
                    "words); re-save the checkpoint with compressed-tensors >= 0.18"))
    if qc.status not in (None, "compressed"):
        out.append(("warning", f"quantization_status is {qc.status!r}, expected 'compressed'"))
    fp8 = [g for g in qc.groups if g.input_activations is not None and g.input_activations.type == "float"
           and g.input_activations.num_bits == 8]
    if any(not activation_qtype(g) for g in fp8):  # static fp8: not honoured
        out.append(("warning", "static fp8 activation quantization in the scheme: the runtime computes those "
                    "activations in bf16 (weights stay quantized)"))
    return out


def _version(text: str | None) -> tuple[int, ...]:
    """A version string's leading numbers ("0.17.1" -> (0, 17, 1)); None or no number: the newest."""
    import re

    nums = re.findall(r"\d+", (text or "").split("+")[0])[:3]
    return tuple(int(n) for n in nums) if nums else (1 << 30,)


def weight_path(scheme: Scheme | None, shape: tuple[int, ...] | None, chip: Chip) -> Verdict:
    """The serving path for one module's weight [..., out, in] (its served shape: layout.served_shapes)
    under `scheme` on `chip`: the scheme's verdict, then the kernel's feasibility on its kernel layout."""
    reason = unsupported_reason(scheme) if scheme is not None else None
    if reason:
        return Verdict(None, reason)
    if weight_qtype(scheme) == "dense":
        return Verdict("dense", "")
    if shape is None or len(shape) < 2:
        return Verdict(None, "weight shape unknown")
    out, inp = shape[-2:]
    act = activation_qtype(scheme)
    if inp % max(activation_group(act), 1):
        return Verdict(None, f"input activations quantized in groups of {activation_group(act)}, which do not "
                       f"divide the {inp} inputs")
    k = kernel_shapes(scheme, (out, inp))
    return kernel_path(k.qtype, inp, out, k.group, chip, scale_bytes=min(k.scale_bytes, 2), zero_bytes=int(k.zeros),
                       act=act)


def problem(severity: str, where: str, message: str) -> dict:
    """One finding, as `inspect` reports it: severity "error" | "unsupported" | "warning"."""
    return {"severity": severity, "where": where, "message": message}


@dataclass(frozen=True)
class ModuleCheck:
    """One module's header-only verdict."""

    name: str
    kind: str  # "linear" | "moe_experts" | "embedding" | "norm" | "other"
    params: dict  # parameter name (e.g. "weight_packed") -> TensorInfo
    scheme: Scheme | None
    shape: tuple[int, ...] | None  # logical [..., out, in]; None when unknown
    errors: tuple[str, ...]  # one line each: the tensors are not what the scheme requires
    reason: str | None  # why the runtime cannot serve it; None when it can or when it holds no weight
    rotation: str = ""  # its online input transform, as inspect says it ("" none)

    @property
    def has_weight(self) -> bool:
        return "weight" in self.params or "weight_packed" in self.params


@dataclass(frozen=True)
class Validation:
    """A checkpoint opened once: its headers, parsed configs and verdicts; what inspect reports, and what
    convert, eval and the loader enforce and read."""

    ckpt: Checkpoint
    raw: dict | None  # quantization_config as stored
    qc: QuantConfig | None  # parsed when compressed-tensors
    cfg: ModelConfig | None  # the runtime's model config; None when the architecture is refused or unknown
    problems: list[dict]  # checkpoint-wide findings
    modules: list[ModuleCheck]

    def raise_first(self, path) -> None:
        """Raises InvalidInput for the first error, else Unsupported for the first unsupported finding, naming
        `path` and how many more there are (what the loader and eval refuse; inspect lists them all)."""
        problems = self.all_problems()
        for severity, exc in (("error", InvalidInput), ("unsupported", Unsupported)):
            probs = [p for p in problems if p["severity"] == severity]
            if probs:
                more = f" (and {len(probs) - 1} more; see `quantkit inspect`)" if len(probs) > 1 else ""
                where, message = probs[0]["where"], probs[0]["message"]
                raise exc(f"{path}: {message if where in message else f'{where}: {message}'}{more}")

    def all_problems(self) -> list[dict]:
        """Every finding: checkpoint-wide first, then per module its errors and why it cannot be served."""
        out = list(self.problems)
        for m in self.modules:
            out += [problem("error", m.name, e) for e in m.errors]
            if m.reason:
                out.append(problem("unsupported", m.name, m.reason))
        return out


def _model_config(ckpt: Checkpoint) -> tuple[ModelConfig | None, list[dict]]:
    """The runtime's ModelConfig of the checkpoint, or None and why the runtime cannot run it."""
    if ckpt.config is None:
        return None, [problem("warning", str(ckpt.root),
                              "no config.json: architecture and quantization scheme unknown")]
    where, eos = str(ckpt.root / "config.json"), ckpt.eos_token_ids  # (a bad generation_config.json: raised)
    try:
        return from_hf(ckpt.config, eos), []
    except Unsupported as e:  # an architecture, or a variant of one, that the runtime refuses, with its reason
        return None, [problem("unsupported", where, str(e))]
    except InvalidInput as e:  # a field of the wrong type or range (config.Field), named
        return None, [problem("error", where, str(e).replace("config.json", where, 1))]


def _kv_scale_problems(ckpt: Checkpoint, cfg: ModelConfig) -> list[dict]:
    """Every layer's k_scale / v_scale must exist, be finite, positive and one per tensor or per KV head."""
    out = []
    for i, kind in enumerate(cfg.layer_kinds):
        for name in KV_SCALES if kind != "linear" else ():  # Gated DeltaNet layers keep no KV
            tensor = f"{cfg.prefix}layers.{i}.self_attn.{name}"
            if tensor not in ckpt.tensors:
                out.append(problem("error", tensor, f"kv_cache_scheme is set but {tensor} is missing"))
                continue
            try:
                kv_head_scales(ckpt.read(tensor), cfg.kv_shape(kind)[0], tensor)
            except InvalidInput as e:
                out.append(problem("error", tensor, str(e)))
    return out


def _input_transform(module: str, cls: str | None, scheme: Scheme | None, shape, qc: QuantConfig,
                     stored: dict) -> tuple[list[str], str | None, str]:
    """(errors, unsupported reason, what inspect says) of a module's online input transforms: at most one,
    on a quantized Linear, whose matrix of the size its inputs (or head_dim) need the checkpoint holds."""
    found = qc.input_transforms(module, cls)
    if not found:
        return [], None, ""
    if len(found) > 1:
        return [], f"{len(found)} online input transforms ({', '.join(t.group for t in found)}): at most one " \
            "is supported", ""
    t = found[0]
    if t.type not in ("hadamard", "random-hadamard"):
        return [], f"online input transform {t.group!r} is {t.type}: only hadamard and random-hadamard are served", ""
    if weight_qtype(scheme) == "dense":
        return [], f"online input transform {t.group!r} on a module that is not quantized is not supported", ""
    if shape is None or len(shape) < 2:
        return [], None, ""  # the weight's own problems are reported
    size = transform_size(t, shape[-1])
    if shape[-1] % size:
        return [f"{module}: transform {t.group!r} of head_dim {size} does not divide its {shape[-1]} inputs"], None, ""
    if (t.group, t.location, size) not in stored:
        return [f"{module}: no {t.group}_input transform matrix of size {size} in the checkpoint (a tensor "
                f"<module>.{t.group}_input.weight [{size}, {size}])"], None, ""
    return [], None, f"inputs rotated online by {t.type} {t.group!r} of size {size}"


def check_module(module: str, params: dict, qc: QuantConfig | None, foreign: bool,
                 stored: dict | None = None) -> ModuleCheck:
    """One module's tensors against the scheme that targets it (`foreign`: quantized by another method), and
    its online input transform against the `stored` matrices (ct_tensors.stored_transforms)."""
    kind, cls = classify_module(module, params)
    scheme = qc.scheme_for(module, cls) if qc is not None and cls is not None else None
    if foreign and any(p not in ("weight", "bias") for p in params):
        # A foreign method's tensors are not ours to judge: it is reported unsupported, not invalid.
        return ModuleCheck(module, kind, params, scheme, None, (), "quantized by a method quantkit does not read")
    shape, errors = check_module_tensors(module, scheme, params)
    reason, rotation = None, ""
    if "weight" in params or "weight_packed" in params:  # not e.g. a module holding only k_scale / v_scale
        reason = unsupported_reason(scheme) if scheme is not None else None
        if reason is None and weight_qtype(scheme) != "dense" and (shape is None or len(shape) < 2):
            reason = "weight shape unknown"
        if qc is not None and qc.transforms:
            more, why, rotation = _input_transform(module, cls, scheme, shape, qc, stored or {})
            errors, reason = [*errors, *more], reason or why
    return ModuleCheck(module, kind, params, scheme, shape, tuple(errors), reason, rotation)


def is_transform_module(qc: QuantConfig, module: str) -> bool:
    """Whether `module` holds a transform's matrix (`<module>.<group>_<location>`) or its `perm` tensor."""
    return qc.transform_module(module) is not None or qc.transform_module(module.rpartition(".")[0]) is not None


def validate_checkpoint(ckpt: Checkpoint) -> Validation:
    """Validates an opened checkpoint from its headers (and k/v scales).

    Args:
        ckpt: the checkpoint.
    Returns:
        The Validation. Raises InvalidInput when quantization_config itself does not parse.
    """
    where = str(ckpt.root / "config.json")
    raw, qc = quantization_config_of(ckpt.config, where)
    cfg, model_problems = _model_config(ckpt)
    problems = [problem("warning", where, w) for w in ckpt.warnings] + model_problems
    problems += [problem(severity, where, message) for severity, message in config_findings(raw, qc)]
    mtp = sum(name.startswith("mtp.") for name in ckpt.tensors)
    if mtp:
        problems.append(problem("warning", "mtp.*", f"{mtp} tensors of the MTP (multi-token prediction) head are "
                                "used only as a draft head, with --speculative-config '{\"method\": \"mtp\", "
                                "\"num_speculative_tokens\": 3}'"))
    kv = qc.kv_cache_scheme if qc is not None else None
    if cfg is not None and kv is not None and not kv_scheme_reason(kv):  # else reported unsupported already
        problems += _kv_scale_problems(ckpt, cfg)
    foreign = raw is not None and qc is None
    stored = stored_transforms(qc, ckpt.tensors) if qc is not None and qc.transforms else {}
    modules = [check_module(module, {p: ckpt.tensors[n] for p, n in pnames.items()}, qc, foreign, stored)
               for module, pnames in group_modules(ckpt.tensors).items()
               if not (qc is not None and is_transform_module(qc, module))]
    # nvfp4 global scales: 4 bytes a module, read always (a zero or NaN one, or fused siblings that differ,
    # would make the served weights wrong)
    globals_ = {m.name: ckpt.read(m.params["weight_global_scale"].name) for m in modules
                if not m.errors and not m.reason and weight_qtype(m.scheme) == "nvfp4"}
    problems += [problem("error", where, message) for where, message in check_global_scales(globals_)]
    if cfg is not None:
        described = described_shapes(cfg)
        problems += [problem("error", m.name, f"{m.name}: weight [out, in] = {list(m.shape[-2:])}, but config.json "
                             f"describes {list(described[m.name])}") for m in modules
                     if m.name in described and m.shape is not None and len(m.shape) >= 2
                     and tuple(m.shape[-2:]) != described[m.name]]
    return Validation(ckpt, raw, qc, cfg, problems, modules)
