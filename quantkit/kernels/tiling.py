"""Per-generation TPU facts (TPU.md) and how arrays are laid out in HBM.

Facts are data passed to the kernels and to `inspect`/`plan`, never queried from a device. This module
imports nothing heavy: `inspect` uses it on its header-only path.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chip:
    """One accelerator generation. `hbm_bytes` is what XLA can use, `mxu` the MXU column count."""

    name: str
    hbm_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float
    mxu: int
    vmem_bytes: int
    fp8_mxu: bool
    tpu: bool = True


GIB = 1 << 30
CHIPS: dict[str, Chip] = {
    "v5e": Chip("v5e", 16 * GIB, 819e9, 197e12, 128, 128 << 20, fp8_mxu=False),
    "v6e": Chip("v6e", int(31.25 * GIB), 1.64e12, 918e12, 256, 128 << 20, fp8_mxu=True),
    # v7x bandwidth: Google Cloud Ironwood announcement (7.37 TB/s per chip).
    "v7x": Chip("v7x", 192 * 10**9, 7.37e12, 2307e12, 256, 64 << 20, fp8_mxu=True),
    # The XLA path on the host: no tiling, arrays stored densely.
    "cpu": Chip("cpu", 0, 0.0, 0.0, 0, 0, fp8_mxu=False, tpu=False),
}
LANES = 128


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def hbm_bytes(shape: tuple[int, ...], bits: int, chip: Chip) -> int:
    """Bytes an array takes in device memory.

    On TPU the two minor dimensions are stored in (sublanes, 128) tiles: the last dimension is padded
    to a multiple of 128 and the second-to-last to 8 * (32 / bits) rows (f32: 8, bf16: 16, 8-bit: 32,
    4-bit: 64), the native tile of each width. On CPU arrays are dense. Sub-byte types are packed.
    """
    dims = list(shape) or [1]
    if chip.tpu:
        dims[-1] = _round_up(dims[-1], LANES)
        if len(dims) >= 2:
            dims[-2] = _round_up(dims[-2], 8 * 32 // bits)
    n = 1
    for d in dims:
        n *= d
    return -(-n * bits // 8)
