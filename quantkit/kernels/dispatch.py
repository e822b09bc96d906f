"""Which runtime path serves a weight, or why none can (ARCHITECTURE.md rule 7).

Every predicate returns a verdict with a reason; callers fall back (gmm_v2 -> xla) or refuse, and the
reason surfaces in `quantkit inspect`. Only kernel feasibility lives here (tiles, chip); whether a scheme is
one quantkit serves at all is the format's verdict (formats/compressed_tensors.py `unsupported_reason`).
Imports nothing heavy: `inspect` uses it on its header-only path.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.formats.compressed_tensors import Scheme, unsupported_reason, weight_qtype
from quantkit.kernels.tiling import LANES, Chip, Tiles, choose_tiles

# Weight types the runtime keeps quantized on device (int4 symmetric, fp8 e4m3, mxfp4).
SERVED_QTYPES = ("int4", "fp8", "mxfp4")


@dataclass(frozen=True)
class Verdict:
    path: str | None  # "gmm_v2" | "xla" | "dense" | None
    reason: str  # why not servable, or why the fallback; "" when nothing to say

    @property
    def servable(self) -> bool:
        return self.path is not None


def can_use_gmm_v2(qtype: str, k: int, n: int, group_size: int | None, chip: Chip, m: int = 256, g: int = 1,
                   scale_bytes: int = 2) -> tuple[Tiles | None, str]:
    """Tiles with which the Pallas gmm_v2 kernel serves a [k, n] weight of `qtype` on `chip`, or None
    and why not (the caller falls back to the XLA path).

    Args:
        qtype: "int4" | "fp8" | "mxfp4".
        k, n: input and output features.
        group_size: scale group along k (None, -1 or k for channel scales).
        chip: target facts.
        m, g: rows per call and number of groups (experts); m = 256 stands for a decode batch.
        scale_bytes: bytes per stored scale.
    """
    if not chip.tpu:
        return None, f"{chip.name}: Pallas TPU kernels need a TPU target"
    if qtype not in SERVED_QTYPES:
        return None, f"{qtype} is not a gmm_v2 weight type"
    if k % LANES or n % LANES:
        return None, f"[{k}, {n}] is not a multiple of {LANES} in both dimensions (TPU block rule)"
    group = k if not group_size or group_size < 0 else group_size
    if k % group:
        return None, f"group size {group} does not divide in_features {k}"
    tiles = choose_tiles(m, k, n, g, qtype, group, scale_bytes, chip)
    if tiles is None:
        return None, f"no tiling of [{k}, {n}] with group {group} fits {chip.name} VMEM"
    return tiles, ""


def weight_path(scheme: Scheme | None, shape: tuple[int, ...] | None, chip: Chip) -> Verdict:
    """The serving path for one module's weight [..., out, in] under `scheme` on `chip`."""
    reason = unsupported_reason(scheme) if scheme is not None else None  # the format's verdict
    if reason:
        return Verdict(None, reason)
    qtype = weight_qtype(scheme)
    if qtype == "dense":
        return Verdict("dense", "")
    if shape is None or len(shape) < 2:
        return Verdict(None, "weight shape unknown")
    out, inp = shape[-2:]
    w = scheme.weights
    # The kernel's k-group (quant/qtensor.py): fp8 blocks become groups of the block width.
    group = w.block_structure[1] if w.strategy == "block" else w.group_size if w.strategy == "group" else inp
    tiles, why = can_use_gmm_v2(qtype, inp, out, group, chip, scale_bytes=1 if qtype == "mxfp4" else 2)
    return Verdict("gmm_v2", "") if tiles else Verdict("xla", f"XLA fallback: {why}")
