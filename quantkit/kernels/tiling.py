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


# ---- gmm_v2 tiles -----------------------------------------------------------------------------------

TILE_CANDIDATES = (2048, 1024, 512, 256, 128)
MIN_TILE_WEIGHT_BYTES = 512 << 10  # below this, per-step overhead (~0.35 us) outweighs the overlap gained
BIG_WEIGHT_BYTES = 8 << 20  # weights at least this big get at least MIN_STEPS grid steps along k and n
MIN_STEPS = 4


@dataclass(frozen=True)
class Tiles:
    """A gmm_v2 tiling: block sizes, whether scales apply before the dot, and the VMEM it needs."""

    tm: int
    tk: int
    tn: int
    predot: bool  # group < tk: dequantize the tile (values * scales) before the dot
    vmem_bytes: int  # estimated peak VMEM of one grid step, double buffers included
    vmem_limit: int  # the limit passed to Mosaic


def weight_bits(qtype: str) -> int:
    return 8 if qtype == "fp8" else 4


def vmem_estimate(tm: int, tk: int, tn: int, k: int, group: int, qtype: str, scale_bytes: int) -> int:
    """VMEM of one step: double-buffered lhs, weight, scales (pre-dot: the tile's tk/group rows; else
    all k/group rows of its columns) and output blocks, the f32 accumulator, and the dequantized tile
    (f32 and bf16 copies)."""
    lhs = 2 * tm * tk * 2
    rhs = 2 * tk * tn * weight_bits(qtype) // 8
    rows = tk // group if group < tk else max(1, k // group)
    scales = 2 * _round_up(rows, 8) * tn * scale_bytes
    out = 2 * tm * tn * 2
    acc = tm * tn * 4
    tmp = tk * tn * (4 + 4 + 2)  # decoded f32, scaled f32, bf16 operand
    return lhs + rhs + scales + out + acc + tmp


def choose_tiles(m: int, k: int, n: int, g: int, qtype: str, group: int, scale_bytes: int,
                 chip: Chip) -> Tiles | None:
    """Picks gmm_v2 blocks for lhs [m, k] x weights [g, k, n] on `chip`, or None if nothing fits.

    Rules: blocks obey the (8, 128) rule (tk, tn multiples of 128; tm a multiple of 8 or all of m);
    scale groups narrower than the MXU are dequantized before the dot (tk a multiple of the group),
    wider groups and channel scales multiply partial sums (tk divides the group); the estimated VMEM
    stays under 75% of the limit; a weight of 8 MiB or more gets at least 4 grid steps along k x n so
    that its DMA overlaps compute; otherwise tiles are as large as allowed (fewer, longer steps).
    """
    limit = chip.vmem_bytes * 3 // 4
    tm = m if (g == 1 and m <= 512) else min(_round_up(m, 8), 128 if g > 1 else 512)
    bits = weight_bits(qtype)
    # tk a multiple of the group (scales before the dot), or, for groups at least as wide as the MXU
    # (channel scales included), a divisor of it (scales on partial sums, one scale row per k step).
    # A pre-dot tile's scales come as their own block of tk/group rows: (8, 128) rule, unless all of k.
    def fits_group(t: int) -> bool:
        if group >= chip.mxu and group % t == 0:
            return True  # scales on partial sums
        return t % group == 0 and (t == k or (t // group) % 8 == 0)

    cands = sorted({*TILE_CANDIDATES, *([k] if k <= 8192 and k % 128 == 0 else [])}, reverse=True)
    tks = [t for t in cands if k % t == 0 and fits_group(t)]
    tns = [t for t in TILE_CANDIDATES if n % t == 0]
    best = None
    for tk in tks:
        for tn in tns:
            steps = (k // tk) * (n // tn)
            tile_bytes = tk * tn * bits // 8
            if k * n * bits // 8 >= BIG_WEIGHT_BYTES and steps < MIN_STEPS:
                continue
            vmem = vmem_estimate(tm, tk, tn, k, group, qtype, scale_bytes)
            if vmem * 4 > limit * 3:
                continue
            # Prefer big tiles, but not below the overhead floor; ties -> wider tn (lane-dense output).
            key = (tile_bytes >= MIN_TILE_WEIGHT_BYTES, tile_bytes if tile_bytes <= (4 << 20) else 0, tn)
            if best is None or key > best[0]:
                best = (key, Tiles(tm, tk, tn, group < tk, vmem, limit))
    return best[1] if best else None
