"""Is a checkpoint valid, and can the runtime serve it? The checks `inspect` reports and the loader enforces.

Headers only, plus the few bytes of k/v scales. What each format requires and which schemes quantkit serves is
format knowledge (formats/compressed_tensors.py); this module walks a checkpoint and collects those verdicts,
with the architecture verdict of runtime/config.py. Imports nothing heavy (no jax, torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.errors import InvalidInput, Unsupported
from quantkit.formats.compressed_tensors import (
    KV_SCALES, QuantConfig, Scheme, check_module_tensors, config_findings, kv_head_scales, kv_scheme_reason,
    quantization_config_of, unsupported_reason, weight_qtype,
)
from quantkit.formats.hf import Checkpoint, classify_module, group_modules
from quantkit.runtime.config import ModelConfig, from_hf


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

    @property
    def has_weight(self) -> bool:
        return "weight" in self.params or "weight_packed" in self.params


@dataclass(frozen=True)
class Validation:
    raw: dict | None  # quantization_config as stored
    qc: QuantConfig | None  # parsed when compressed-tensors
    problems: list[dict]  # checkpoint-wide findings
    modules: list[ModuleCheck]

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
    where = str(ckpt.root / "config.json")
    try:
        return from_hf(ckpt.config), []
    except Unsupported as e:  # an architecture, or a variant of one, that the runtime refuses, with its reason
        return None, [problem("unsupported", where, str(e))]
    except (KeyError, TypeError, ValueError) as e:
        return None, [problem("error", where, f"config.json does not describe a {ckpt.architecture}: "
                              f"{type(e).__name__} {e}")]


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


def check_module(module: str, params: dict, qc: QuantConfig | None, foreign: bool) -> ModuleCheck:
    """One module's tensors against the scheme that targets it (`foreign`: quantized by another method)."""
    kind, cls = classify_module(module, params)
    scheme = qc.scheme_for(module, cls) if qc is not None and cls is not None else None
    if foreign and any(p not in ("weight", "bias") for p in params):
        # A foreign method's tensors are not ours to judge: it is reported unsupported, not invalid.
        return ModuleCheck(module, kind, params, scheme, None, (), "quantized by a method quantkit does not read")
    shape, errors = check_module_tensors(module, scheme, params)
    reason = None
    if "weight" in params or "weight_packed" in params:  # not e.g. a module holding only k_scale / v_scale
        reason = unsupported_reason(scheme) if scheme is not None else None
        if reason is None and weight_qtype(scheme) != "dense" and (shape is None or len(shape) < 2):
            reason = "weight shape unknown"
    return ModuleCheck(module, kind, params, scheme, shape, tuple(errors), reason)


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
                                "not used: quantkit serves the model without speculative decoding"))
    kv = qc.kv_cache_scheme if qc is not None else None
    if cfg is not None and kv is not None and not kv_scheme_reason(kv):  # else reported unsupported already
        problems += _kv_scale_problems(ckpt, cfg)
    foreign = raw is not None and qc is None
    modules = [check_module(module, {p: ckpt.tensors[n] for p, n in pnames.items()}, qc, foreign)
               for module, pnames in group_modules(ckpt.tensors).items()]
    return Validation(raw, qc, problems, modules)
