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
# Activation quantizations (QTensor.act) whose 8-bit codes gmm_v2 multiplies per token; fp8 per group of a
# multiple of 128 inputs ("fp8_g<N>") too, with weights exact in fp8 (row_codes); the others (mxfp4, mxfp8,
# nvfp4) are quantize-dequantized before the call and take the bf16 path.
ROW_CODES = ("int8", "fp8")
# the weight types each 8-bit row type multiplies in gmm_v2 (int8 rows: integer weights only)
ROW_WEIGHTS = {"int8": ("int4", "int8"), "fp8": ("int4", "int8", "fp8")}


def row_codes(act: str, qtype: str) -> str:
    """The 8-bit type whose codes (with a scale per row, or per row and group of inputs) gmm_v2 takes for `act`
    rows and `qtype` weights, or "" when the rows reach it dequantized: per token always ("int8", "fp8"; the
    weight type is then checked by can_use_gmm_v2); per group ("fp8_g<N>") when N is a multiple of 128 (a k
    tile never spans two row scales) and the weights are of ROW_WEIGHTS["fp8"]."""
    if act in ROW_CODES:
        return act
    if act.startswith("fp8_g") and int(act.split("_g")[1]) % LANES == 0 and qtype in ROW_WEIGHTS["fp8"]:
        return "fp8"
    return ""


def row_group(act: str) -> int:
    """Inputs per row scale of per-group 8-bit rows ("fp8_g<N>": N), 0 for one scale a row."""
    return int(act.split("_g")[1]) if "_g" in act else 0


@dataclass(frozen=True)
class Verdict:
    path: str | None  # "gmm_v2" | "xla" | "dense" | None
    reason: str  # why not servable, or why the fallback; "" when nothing to say

    @property
    def servable(self) -> bool:
        return self.path is not None


def can_use_gmm_v2(qtype: str, k: int, n: int, group_size: int | None, chip: Chip, m: int = 256, g: int = 1,
                   scale_bytes: int = 2, zero_bytes: int = 0, act: str = "", weights: int = 1
                   ) -> tuple[Tiles | None, str]:
    """Tiles with which the Pallas gmm_v2 kernel serves a [k, n] weight of `qtype` on `chip`, or None
    and why not (the caller falls back to the XLA path).

    Args:
        qtype: one of SERVED_QTYPES, or "bf16" (a dense weight, unit channel scales).
        k, n: input and output features.
        group_size: scale group along k (None, -1 or k for channel scales).
        chip: target facts.
        m, g: rows per call and number of groups (experts); m = 256 stands for a decode batch.
        scale_bytes: bytes per stored scale.
        zero_bytes: bytes per stored zero point (0: none, symmetric).
        act: the activations' quantization (QTensor.act): "int8" multiplies int8 rows by integer weights,
            "fp8" fp8 rows by integer or fp8 weights, "fp8_g<N>" fp8 rows with a scale per group of N inputs
            (8-bit rows, their scales after the dot: row_codes); any other reaches the kernel already
            dequantized (bf16 rows).
        weights: 2 for a gated pair of such weights in one call (gmm_v2 `up`).
    """
    rows = row_codes(act, qtype)
    if not chip.tpu:
        return None, f"{chip.name}: Pallas TPU kernels need a TPU target"
    if qtype not in SERVED_QTYPES + ("bf16",):
        return None, f"{qtype} is not a gmm_v2 weight type"
    # a dense bf16 weight (QTensor "bf16": runtime/ops.py dense_as_qtensor) may have a side that is not a
    # multiple of 128 (gpt-oss's hidden 2880): its blocks span that side whole, which the (8, 128) rule allows
    if qtype != "bf16" and (k % LANES or n % LANES):
        return None, f"[{k}, {n}] is not a multiple of {LANES} in both dimensions (TPU block rule)"
    group = k if not group_size or group_size < 0 else group_size
    if k % group:
        return None, f"group size {group} does not divide in_features {k}"
    if rows and qtype not in ROW_WEIGHTS[rows]:
        return None, f"{act} activations with {qtype} weights"
    tiles = choose_tiles(m, k, n, g, qtype, group, scale_bytes, chip, zero_bytes, int8_lhs=bool(rows),
                         row_group=row_group(act) if rows else 0, weights=weights)
    if tiles is None and rows and group < LANES:
        return None, f"{act} activations need scale groups of at least {LANES} inputs, not {group}"
    if tiles is None:
        return None, f"no tiling of [{k}, {n}] with group {group} fits {chip.name} VMEM"
    return tiles, ""


# the weight types whose values an 8-bit MXU operand type holds exactly (int4 also in fp8 e4m3: |q| <= 16)
EXACT_IN = {"int8": ("int4", "int8"), "fp8": ("int4", "fp8")}


def mxu_type(qtype: str, act: str, chip: Chip) -> str:
    """The operand type gmm_v2 feeds the MXU for `qtype` weights and `act` rows (QTensor.act): the rows'
    8-bit type (row_codes) where the chip multiplies it at twice the bf16 rate and the weight values are
    exact in it, else bf16 (the same products, exact in float32 accumulation)."""
    rows = row_codes(act, qtype)
    return rows if rows and rows in chip.mxu_8bit and qtype in EXACT_IN[rows] else "bf16"


def kernel_path(qtype: str, k: int, n: int, group: int, chip: Chip, scale_bytes: int = 2,
                zero_bytes: int = 0, act: str = "") -> Verdict:
    """gmm_v2 for a served [k, n] weight of `qtype` with `group` inputs per scale, else the XLA path and why;
    with quantized activations, the MXU type that multiplies them (or how they are computed exactly in bf16)."""
    tiles, why = can_use_gmm_v2(qtype, k, n, group, chip, scale_bytes=scale_bytes, zero_bytes=zero_bytes, act=act)
    if not tiles:
        return Verdict("xla", f"XLA fallback: {why}")
    rows = row_codes(act, qtype)
    if act and not rows:
        return Verdict("gmm_v2", f"{act} activations quantize-dequantized exactly per group, then multiplied in "
                       "bf16 (per-group activation scales are not fed to the MXU)")
    per = f" (a scale per {row_group(act)} inputs)" if row_group(act) else ""
    if act and (t := mxu_type(qtype, act, chip)) != "bf16":
        return Verdict("gmm_v2", f"{t} x {t} on the MXU{per}")
    if act == "int8":
        return Verdict("gmm_v2", f"int8 activations emulated exactly in bf16 ({chip.name} has no int8 MXU)")
    if rows == "fp8":
        why = f"{chip.name} multiplies fp8 at the bf16 rate" if "fp8" not in chip.mxu_8bit else \
            f"{qtype} weights are not exact in fp8"
        return Verdict("gmm_v2", f"fp8 activations{per} multiplied exactly in bf16 ({why})")
    return Verdict("gmm_v2", "")
