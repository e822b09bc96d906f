"""Per-generation TPU facts (docs/kernels.md, "Chip facts") and how arrays are laid out in HBM.

Facts are data passed to the kernels and to `inspect`/`plan`, never queried from a device. This module
imports nothing heavy: `inspect` uses it on its header-only path.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chip:
    """One accelerator generation, per JAX device (a v7x chip is two). `hbm_bytes` is what XLA can use, `mxu`
    the MXU column count, `mxu_8bit` the 8-bit operand types its MXU multiplies at twice the bf16 rate."""

    name: str
    hbm_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float
    mxu: int
    vmem_bytes: int
    mxu_8bit: tuple[str, ...] = ()  # int8 x int8 -> int32 (v5e, v6e), fp8 x fp8 -> float32 (v7x)
    tpu: bool = True

    def peak_flops(self, mxu_type: str) -> float:
        """The MXU's peak rate for operands of `mxu_type` ("bf16", "int8", "fp8"; FLOP/s or OP/s)."""
        return self.bf16_flops * (2 if mxu_type in self.mxu_8bit else 1)


GIB = 1 << 30
CHIPS: dict[str, Chip] = {
    "v5e": Chip("v5e", 16 * GIB, 819e9, 197e12, 128, 128 << 20, ("int8",)),
    # v6e: 1,836 int8 TOP/s; its MXU takes fp8 only at the bf16 rate
    "v6e": Chip("v6e", int(31.25 * GIB), 1.64e12, 918e12, 256, 128 << 20, ("int8",)),
    # v7x: per TensorCore, which JAX sees as one device (two a chip). Google Cloud's Ironwood figures are per
    # chip (192 GiB, 7.37 TB/s, 2307 TFLOP/s bf16), split in half as jax's own TPU7x facts have them
    # (pallas tpu_info: 103 GB, 3.7 TB/s, 1155 TFLOP/s a logical device); 94.75 GiB is what libtpu lets one
    # device's programs use (its out-of-memory message, deviceless `tpu7x:1x1x1`). fp8: 4,614 TFLOP/s a chip; no int8.
    "v7x": Chip("v7x", int(94.75 * GIB), 7.37e12 / 2, 2307e12 / 2, 256, 64 << 20, ("fp8",)),
    # The XLA path on the host: no tiling, arrays stored densely.
    "cpu": Chip("cpu", 0, 0.0, 0.0, 0, 0, tpu=False),
}
LANES = 128


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def hbm_bytes(shape: tuple[int, ...], bits: int, chip: Chip) -> int:
    """Bytes an array takes in device memory.

    On TPU the two minor dimensions are stored in (sublanes, 128) tiles: the last dimension is padded
    to a multiple of 128 and the second-to-last to 8 * (32 / bits) rows (f32: 8, bf16: 16, 8-bit: 32,
    4-bit: 64), the native tile of each width, except a float32 [.., 1, n] (XLA tiles it by (1, 128): the
    GDN conv state's rows). On CPU arrays are dense. Sub-byte types are packed.
    """
    dims = list(shape) or [1]
    if chip.tpu:
        dims[-1] = round_up(dims[-1], LANES)
        if len(dims) >= 2 and (dims[-2], bits) != (1, 32):
            dims[-2] = round_up(dims[-2], 8 * 32 // bits)
    n = 1
    for d in dims:
        n *= d
    return -(-n * bits // 8)


# ---- gmm_v2 tiles -----------------------------------------------------------------------------------

MAX_TILE = 4096
STEP_SECONDS = 0.35e-6  # a grid step's fixed overhead
MIN_TILE_WEIGHT_BYTES = 512 << 10  # below this, per-step overhead outweighs the overlap gained
# a dense weight at least this big gets at least MIN_STEPS grid steps along k and n (a grouped call's next visit
# overlaps the DMA of its next expert anyway): on a v5e a 2 MiB int4 weight in one step took 7.1 us, 2.6x its HBM
# floor, its DMA and compute in series (benchmarks/tpu_gmm_variants.py)
BIG_WEIGHT_BYTES = 1 << 20
MIN_STEPS = 4


@dataclass(frozen=True)
class Tiles:
    """A gmm_v2 tiling: block sizes, whether scales apply before the dot, and the VMEM it needs."""

    tm: int
    tk: int
    tn: int
    predot: bool  # group < tk and < 128: dequantize the tile (values * scales) before the dot; else scales
    # multiply the partial sums of each group (gmm_v2)
    lhs_resident: bool  # lhs block spans all of k: read once per m tile, not once per n tile
    vmem_bytes: int  # estimated peak VMEM of one grid step, double buffers included
    vmem_limit: int  # the limit passed to Mosaic


def weight_bits(qtype: str) -> int:
    return 16 if qtype == "bf16" else 8 if qtype in ("fp8", "int8", "mxfp8") else 4


def vmem_estimate(tm: int, tk: int, tn: int, k: int, group: int, qtype: str, scale_bytes: int,
                  lhs_resident: bool = False, zero_bytes: int = 0, lhs_bytes: int = 2, weights: int = 1) -> int:
    """VMEM of one step: double-buffered lhs, weight, scales and zero points (pre-dot: the tile's tk/group
    rows; else all k/group rows of its columns) and output blocks, the f32 accumulator, and the dequantized
    tile (f32 and bf16 copies); `weights` 2: a gated pair's (gmm_v2 `up`), each with its blocks and
    accumulator."""
    lhs = 2 * tm * (k if lhs_resident else tk) * lhs_bytes
    rhs = 2 * tk * tn * weight_bits(qtype) // 8
    rows = tk // group if group < tk else max(1, k // group)
    scales = 2 * round_up(rows, 8) * tn * scale_bytes + 2 * round_up(rows, 32) * tn * zero_bytes
    out = 2 * tm * tn * 2
    acc = tm * tn * 4
    tmp = tk * tn * (4 + 4 + 2)  # decoded f32, scaled f32, bf16 operand
    return lhs + weights * (rhs + scales + acc + tmp) + out


def _visits(m: int, g: int, tm: int) -> int:
    """The most (group, m tile) visits a grouped call of m rows in g groups makes (gmm_v2.visits)."""
    tiles_m = -(-m // tm)
    return min(tiles_m + min(g, m) - 1, tiles_m * g)


def traffic(m: int, k: int, n: int, g: int, qtype: str, group: int, scale_bytes: int, tiles: Tiles,
            out_bytes: int = 2, zero_bytes: int = 0, lhs_bytes: int = 2, row_scales: int = 1,
            weights: int = 1) -> tuple[int, int]:
    """(bytes moved, FLOPs executed) by one gmm_v2 call, bounded statically.

    Each visit reads its group's packed weight tile by tile; at most min(g, m) groups hold rows, so there are
    at most tiles_m + min(g, m) - 1 visits (gmm_v2.index_maps: the bound's spare visits copy nothing). A block
    whose index does not change from one grid step to the next is not copied again: scale (and zero point)
    rows applied after the dot, and with a single k tile the weight tile too, are read once per run of
    visits to one group (at most min(g, m) runs). lhs: a resident [tm, k] block is fetched when the m tile
    changes (once per call with one m tile, else once per m tile and n tile); otherwise by k tiles, each
    visit its rows (an m tile shared by two groups twice), for each n tile. The output is written once. FLOPs
    are what the MXU executes: whole m tiles per visit, masked rows included. Quantized activations
    (lhs_bytes 1): 8-bit rows and `row_scales` float32 scales each (one, or one per group of inputs).
    `weights` 2: a gated pair (gmm_v2 `up`): two weights' blocks and products, one lhs and one output.
    (test_declared_cost_equals_the_blocks_the_grid_copies walks the grid through the kernel's index maps.)
    """
    tiles_m = -(-m // tiles.tm)
    visits = _visits(m, g, tiles.tm)
    runs = min(g, m, visits)  # runs of consecutive visits to one group
    ktiles = k // tiles.tk > 1  # blocks indexed by the k tile change at every step: a visit reads all of them
    values = (visits if ktiles else runs) * k * n * weight_bits(qtype) // 8
    scales = (visits if ktiles and group < tiles.tk else runs) * max(1, k // group) * n * (scale_bytes + zero_bytes)
    lhs_reads = 1 if (tiles.lhs_resident and tiles_m == 1) else n // tiles.tn
    lhs_rows = visits * min(tiles.tm, m) if ktiles and not tiles.lhs_resident else m  # k tiles: a visit reads its rows
    rows = m * 4 * row_scales if lhs_bytes == 1 else 0  # 8-bit rows' float32 scales, a block per m tile
    moved = weights * (values + scales) + lhs_reads * (lhs_rows * k * lhs_bytes + rows) + m * n * out_bytes
    return moved, 2 * weights * visits * min(tiles.tm, m) * k * n


def choose_tiles(m: int, k: int, n: int, g: int, qtype: str, group: int, scale_bytes: int,
                 chip: Chip, zero_bytes: int = 0, int8_lhs: bool = False, row_group: int = 0,
                 weights: int = 1) -> Tiles | None:
    """Picks gmm_v2 blocks for lhs [m, k] x weights [g, k, n] on `chip`, or None if nothing fits.

    Rules: blocks obey the (8, 128) rule (tk, tn multiples of 128 dividing k and n; tm a multiple of 8
    or all of m); lhs rows stay resident across n tiles when 2 copies of [tm, k] take at most a quarter
    of the VMEM limit;
    scale groups narrower than 128 are dequantized before the dot (tk a multiple of the group); groups of
    128 and wider and channel scales multiply the partial sums of each group (tk a multiple of the group, or
    a divisor of it); the estimated VMEM
    stays under 75% of the limit; a dense weight of 1 MiB or more gets at least 4 grid steps along k x n so
    that its DMA overlaps compute; otherwise tiles are as large as allowed (fewer, longer steps).
    int8_lhs (8-bit quantized activations, int8 or fp8): the scales apply after the dot (tk divides the group,
    and `row_group`, the inputs per row scale of per-group rows, when set). `weights` 2: a gated pair's
    tiles (gmm_v2 `up`: both weights' blocks in VMEM at once).
    """
    limit = chip.vmem_bytes * 3 // 4
    if g == 1:
        return _choose_kn(m if m <= 512 else 512, k, n, qtype, group, scale_bytes, chip, limit, zero_bytes, int8_lhs,
                          row_group, weights=weights)
    # Grouped: a tall m tile wastes MXU work on rows of other groups, a short one re-reads the weights
    # of groups that straddle tiles (unless all of k is one tile), and each grid step has a fixed overhead;
    # take the m tile with the lowest roofline time plus overhead on this chip.
    best = None
    sizes = (8, 16, 32, 64, 128, 256, 512)
    if int8_lhs:  # int8 rows come in (32, 128) tiles: blocks of a multiple of 32 rows, or all of m
        sizes = tuple(t for t in sizes if t >= 32) if m >= 32 else (m,)
    for tm in sizes:
        if tm > round_up(m, 8) and tm != 8:
            break
        tiles = _choose_kn(tm, k, n, qtype, group, scale_bytes, chip, limit, zero_bytes, int8_lhs, row_group, True,
                           weights)
        if tiles is None:
            continue
        moved, flops = traffic(m, k, n, g, qtype, group, scale_bytes, tiles, zero_bytes=zero_bytes,
                               lhs_bytes=1 if int8_lhs else 2, weights=weights)
        steps = (n // tiles.tn) * (k // tiles.tk) * _visits(m, g, tm)
        t = max(moved / chip.hbm_bytes_per_s, flops / chip.bf16_flops) + steps * STEP_SECONDS
        if best is None or t < best[0]:
            best = (t, tiles)
    return best[1] if best else None


def _choose_kn(tm: int, k: int, n: int, qtype: str, group: int, scale_bytes: int, chip: Chip, limit: int,
               zero_bytes: int, int8_lhs: bool = False, row_group: int = 0, grouped: bool = False,
               weights: int = 1) -> Tiles | None:
    """tk and tn for a given tm (see choose_tiles)."""
    bits = weight_bits(qtype)
    # tk a multiple of the group (several groups a tile: scaled before the dot when narrower than 128, else
    # each group's partial sums scaled), or a divisor of it (one scale row per k step: channel scales and
    # wide groups).
    # A pre-dot tile's scales come as their own block of tk/group rows: a multiple of 8 rows for f32 and
    # bf16, of 32 for uint8 scales and int8 zero points (their HBM tiling is (32, 128); deviceless compiles
    # refuse less), or all of k.
    sub = 32 if scale_bytes == 1 or zero_bytes else 8

    def fits_group(t: int) -> bool:
        if row_group and row_group % t:
            return False  # one row scale per k tile
        if group % t == 0:
            return True  # scales on partial sums (below the MXU width only as a fallback: smaller tiles)
        return not int8_lhs and t % group == 0 and (t == k or (t // group) % sub == 0)

    def divisors(dim: int, cap: int) -> list[int]:  # multiples of 128 that divide dim, largest first
        if dim % LANES:  # a dense weight's unaligned side (dispatch.can_use_gmm_v2): one block spans it
            return [dim]
        return [t for t in range(min(dim, cap) // LANES * LANES, 0, -LANES) if dim % t == 0]

    tks = [t for t in divisors(k, max(MAX_TILE, k if k <= 8192 else 0)) if fits_group(t)]
    tns = divisors(n, MAX_TILE)
    lhs_bytes = 1 if int8_lhs else 2
    resident = 2 * tm * k * lhs_bytes <= limit // 4  # keep [tm, k] of lhs in VMEM across n tiles
    best = None
    for tk in tks:
        for tn in tns:
            steps = (k // tk) * (n // tn)
            tile_bytes = weights * tk * tn * bits // 8
            if not grouped and weights * k * n * bits // 8 >= BIG_WEIGHT_BYTES and steps < MIN_STEPS:
                continue
            vmem = vmem_estimate(tm, tk, tn, k, group, qtype, scale_bytes, resident, zero_bytes, lhs_bytes, weights)
            if vmem * 4 > limit * 3:
                continue
            # Prefer big tiles, but not below the overhead floor; ties -> grouped: all of k in one tile
            # (consecutive visits to one group then share its weight block: `traffic`), then wider tn
            # (lane-dense output).
            key = (tile_bytes >= MIN_TILE_WEIGHT_BYTES, tile_bytes if tile_bytes <= (4 << 20) else 0,
                   grouped and tk == k, tn)
            if best is None or key > best[0]:
                best = (key, Tiles(tm, tk, tn, group < min(tk, LANES), resident, vmem, limit))
    return best[1] if best else None
