"""Whether the Pallas gmm_v2 kernel serves a weight of a given kernel layout, or why not (docs/architecture.md,
rule 7): the kernels' feasibility, on qtype, shape, group and chip alone. Every predicate returns a verdict
with a reason; callers fall back (gmm_v2 -> xla) and the reason surfaces in `quantkit inspect`. Which
schemes the runtime serves at all, and how a scheme becomes a kernel layout, is decided above this layer
(runtime/validate.py, formats/ct_tensors.py). Imports nothing heavy: `inspect` uses it on its header-only path.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.kernels.tiling import LANES, Chip, Tiles, choose_tiles

# Weight types the runtime keeps quantized on device (int4 and int8 with or without zero points, fp8 e4m3, mxfp4,
# mxfp8, nvfp4).
SERVED_QTYPES = ("int4", "int8", "fp8", "mxfp4", "mxfp8", "nvfp4")
# Activation quantizations (QTensor.act) whose 8-bit codes gmm_v2 multiplies; the others (mxfp4, mxfp8,
# fp8_g<N>: per group) are quantize-dequantized before the call and take the bf16 path.
ROW_CODES = ("int8", "fp8")


@dataclass(frozen=True)
class Verdict:
    path: str | None  # "gmm_v2" | "xla" | "dense" | None
    reason: str  # why not servable, or why the fallback; "" when nothing to say

    @property
    def servable(self) -> bool:
        return self.path is not None


def can_use_gmm_v2(qtype: str, k: int, n: int, group_size: int | None, chip: Chip, m: int = 256, g: int = 1,
                   scale_bytes: int = 2, zero_bytes: int = 0, act: str = "") -> tuple[Tiles | None, str]:
    """Tiles with which the Pallas gmm_v2 kernel serves a [k, n] weight of `qtype` on `chip`, or None
    and why not (the caller falls back to the XLA path).

    Args:
        qtype: one of SERVED_QTYPES.
        k, n: input and output features.
        group_size: scale group along k (None, -1 or k for channel scales).
        chip: target facts.
        m, g: rows per call and number of groups (experts); m = 256 stands for a decode batch.
        scale_bytes: bytes per stored scale.
        zero_bytes: bytes per stored zero point (0: none, symmetric).
        act: the activations' quantization (QTensor.act): "int8" multiplies int8 rows by integer weights,
            "fp8" fp8 rows by integer or fp8 weights (8-bit rows, their scales after the dot); any other
            reaches the kernel already dequantized (bf16 rows).
    """
    act = act if act in ROW_CODES else ""
    if not chip.tpu:
        return None, f"{chip.name}: Pallas TPU kernels need a TPU target"
    if qtype not in SERVED_QTYPES:
        return None, f"{qtype} is not a gmm_v2 weight type"
    if k % LANES or n % LANES:
        return None, f"[{k}, {n}] is not a multiple of {LANES} in both dimensions (TPU block rule)"
    group = k if not group_size or group_size < 0 else group_size
    if k % group:
        return None, f"group size {group} does not divide in_features {k}"
    if act and qtype not in (("int4", "int8") if act == "int8" else ("int4", "int8", "fp8")):
        return None, f"{act} activations with {qtype} weights"
    tiles = choose_tiles(m, k, n, g, qtype, group, scale_bytes, chip, zero_bytes, int8_lhs=bool(act))
    if tiles is None and act and group < LANES:
        return None, f"{act} activations need scale groups of at least {LANES} inputs, not {group}"
    if tiles is None:
        return None, f"no tiling of [{k}, {n}] with group {group} fits {chip.name} VMEM"
    return tiles, ""


# the weight types whose values an 8-bit MXU operand type holds exactly (int4 also in fp8 e4m3: |q| <= 16)
EXACT_IN = {"int8": ("int4", "int8"), "fp8": ("int4", "fp8")}


def mxu_type(qtype: str, act: str, chip: Chip) -> str:
    """The operand type gmm_v2 feeds the MXU for `qtype` weights and `act` rows (QTensor.act): the rows'
    8-bit type where the chip multiplies it at twice the bf16 rate and the weight values are exact in it,
    else bf16 (the same products, exact in float32 accumulation)."""
    return act if act in chip.mxu_8bit and qtype in EXACT_IN.get(act, ()) else "bf16"


def kernel_path(qtype: str, k: int, n: int, group: int, chip: Chip, scale_bytes: int = 2,
                zero_bytes: int = 0, act: str = "") -> Verdict:
    """gmm_v2 for a served [k, n] weight of `qtype` with `group` inputs per scale, else the XLA path and why;
    with quantized activations, the MXU type that multiplies them (or how they are computed exactly in bf16)."""
    tiles, why = can_use_gmm_v2(qtype, k, n, group, chip, scale_bytes=scale_bytes, zero_bytes=zero_bytes, act=act)
    if not tiles:
        return Verdict("xla", f"XLA fallback: {why}")
    if act and act not in ROW_CODES:
        return Verdict("gmm_v2", f"{act} activations quantize-dequantized exactly per group, then multiplied in "
                       "bf16 (per-group activation scales are not fed to the MXU)")
    if act and (t := mxu_type(qtype, act, chip)) != "bf16":
        return Verdict("gmm_v2", f"{t} x {t} on the MXU")
    if act == "int8":
        return Verdict("gmm_v2", f"int8 activations emulated exactly in bf16 ({chip.name} has no int8 MXU)")
    if act == "fp8":
        why = f"{chip.name} multiplies fp8 at the bf16 rate" if "fp8" not in chip.mxu_8bit else \
            f"{qtype} weights are not exact in fp8"
        return Verdict("gmm_v2", f"fp8 activations multiplied exactly in bf16 ({why})")
    return Verdict("gmm_v2", "")
