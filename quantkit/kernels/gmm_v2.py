"""gmm_v2: grouped matmul whose weights stay int4 / int8 / fp8 / mxfp4 / mxfp8 / nvfp4 in HBM and are dequantized per
tile in VMEM (and dense bf16 layer weights, multiplied as they are: runtime/ops.py dense_as_qtensor).

out[i, :] = lhs[i, :] @ dequantize(rhs[group of row i])    rows sorted by group; rows past the groups -> 0
out[i, :] = gate(lhs[i, :] @ dequantize(rhs[..])) * (lhs[i, :] @ dequantize(up[..]))    a gated pair (`up`)

One kernel serves dense layers (one group) and MoE experts (many groups), and an MLP's gate and up
projections as one gated pair: both weights' tiles meet each lhs tile (read once), two accumulators, and the
output tile is the gate of the first times the second, so neither [m, n] product goes to HBM nor does the
elementwise pass that would multiply them (Llama-3-8B on a v6e: 9.8 MB less a layer at 80 tokens).
Per grid step (n tile, visit, k tile), the weight tile [tk, tn] is DMA'd from HBM to VMEM in its packed type (double-buffered by the
Pallas pipeline), converted to float on the vector unit and multiplied by its scales, then fed to the
MXU in bf16 with float32 accumulation. Scales (and zero points z of asymmetric ints: (q - z) * s):
- group < 128, narrower than the MXU ("pre-dot"): each group of rows of the tile is shifted and scaled before
  the dot;
- group >= 128 (group 128 and wider, channel scales): scales apply to partial sums. Each group of the tile's
  rows (or the whole tile, when a group spans it) is dotted unscaled (exact small integers or fp8 values in
  bf16) and its [tm, tn] float32 product multiplied by the group's scale row; a zero point row z is taken off
  first as z * (the sum of those lhs columns), since x (q - z) = xq - (sum x) z. Per element of the weight
  this leaves one conversion to bf16: on a TPU v5e, W4A16 g128 at decode took 40-45% less time than
  scaling every element before the dot (benchmarks/tpu_gmm_variants.py), which left the vector unit, not HBM, the
  bound.
nvfp4's global scale (one float32 per group) comes in SMEM with the group metadata; the tile's scales are
divided by it in float32 before use, as compressed-tensors divides them (so the bf16 weights are the library's).
Quantized activations (QTensor.act "int8": W8A8, W4A8; "fp8": FP8_DYNAMIC, W4AFP8): lhs holds 8-bit codes
and `row_scales` one float32 scale a row. int8: the integer weight tile (int4 widened) meets them on the MXU
as int8 x int8 -> int32 on v5e/v6e, and as the same small integers in bf16 with float32 sums on v7x (no int8
MXU there; exact: |products| < 2^14, partial sums < 2^24). fp8: codes × int4 or fp8 weight values as fp8 x fp8
-> float32 on v7x's fp8 MXU (int4 values are exact in e4m3), else (v5e/v6e: fp8 at the bf16 rate; int8 weights)
both as bf16 with float32 sums, every product exact. `dispatch.mxu_type` picks the MXU type. Scales apply after the dot (tiles never span a
scale group), zero points by the row-sum identity, the row scales once at the end; fp8 rows with a scale per
group of N inputs ("fp8_g<N>", FP8_BLOCK; N a multiple of tk) take their k tile's scale column per partial sum.
A "visit" is one (group, m tile) pair: an m tile that straddles a group boundary is visited once per
group, and each visit writes only its group's rows (megablox's scheme, reimplemented here).

File order (docs/architecture.md, rule 5): configs -> validation -> tiling -> cost estimate -> pallas_call ->
one jitted public entry.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from quantkit.kernels.dispatch import can_use_gmm_v2, mxu_type, row_codes, row_group
from quantkit.kernels.tiling import CHIPS, Chip, Tiles, traffic
from quantkit.quant.qtensor import QTensor, decode_scales, decode_values

# ---- configs --------------------------------------------------------------------------------------

# The gates of a gated pair (gmm_v2 `up`): out = GATES[gate](lhs @ rhs) * (lhs @ up)
GATES = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- validation -----------------------------------------------------------------------------------

def check_gmm_v2(lhs_shape: tuple[int, int], rhs: QTensor, chip: Chip, groups: int | None = None,
                 pair: bool = False) -> tuple[Tiles | None, str]:
    """Tiles for this call (over `groups` of rhs's groups, default all; `pair`: with a gated pair's second
    weight like rhs), or None and why gmm_v2 cannot serve it (callers fall back to XLA)."""
    m, k = lhs_shape
    g, k2, n = rhs.shape
    g = groups or g
    if k != k2:
        return None, f"lhs has {k} features but the weight {k2}"
    return can_use_gmm_v2(rhs.qtype, k, n, rhs.group, chip, m=m, g=g, scale_bytes=rhs.scales.dtype.itemsize,
                          zero_bytes=_zero_bytes(rhs), act=rhs.act, weights=2 if pair else 1)


def _zero_bytes(rhs: QTensor) -> int:
    return 0 if rhs.zeros is None else rhs.zeros.dtype.itemsize


# ---- group metadata --------------------------------------------------------------------------------

def visits(group_sizes: jax.Array, m: int, tm: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Which (group, m tile) pairs to visit, in order.

    Returns int32 arrays: group id per visit [V], m tile per visit [V], the number of real visits [1],
    and group row bounds [g + 1, 2] (the extra group g, empty, stands for rows past all groups). V is the
    static bound tiles_m + min(g, m) - 1: at most min(g, m) groups hold rows, and the real visits number at most
    tiles_m + (groups holding rows) - 1 (at least one: with every group empty, the sentinel's tiles_m). The
    tables' entries past the real visits repeat the last one; the grid's visit dimension is the number of real
    visits (a dynamic bound), so they never run: a step costs ~0.2-0.35 us on a v5e even when it moves nothing,
    and the static bound gave Qwen3-30B-A3B's experts at 8 tokens 64 steps for ~53 visits (at one token, the
    former bound tiles_m + g: 129 for 8, 45.9 us for the gate/up pair, 6.6x its floor).
    """
    g = group_sizes.shape[0]
    tiles_m = _cdiv(m, tm)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    total = ends[-1]
    first = starts // tm
    count = jnp.where(sizes > 0, (ends - 1) // tm - first + 1, 0)
    covered = (total + tm - 1) // tm  # m tiles that hold any grouped row
    # Tiles past the last group are visited once each by the empty sentinel group g, which zeroes them.
    first = jnp.concatenate([first, covered[None]])
    count = jnp.concatenate([count, (tiles_m - covered)[None]])
    cum = jnp.cumsum(count)
    n_visits = cum[-1]
    bound = tiles_m + min(g, m) - 1
    v = jnp.arange(bound, dtype=jnp.int32)
    # one compare of every visit with every group's end (a fusion), not searchsorted's loop of gathers: on a
    # v5e that loop's gathers took 9.3 us a Qwen3-30B-A3B layer at one token (8 of ~1.2 us, two calls)
    method = "compare_all" if bound * (g + 1) <= 1 << 20 else "scan"
    vg = jnp.searchsorted(cum, jnp.minimum(v, n_visits - 1), side="right", method=method).astype(jnp.int32)
    vt = (first[vg] + jnp.minimum(v, n_visits - 1) - (cum[vg] - count[vg])).astype(jnp.int32)
    bounds = jnp.stack([jnp.concatenate([starts, jnp.zeros(1, jnp.int32)]),
                        jnp.concatenate([ends, jnp.zeros(1, jnp.int32)])], axis=1)
    return vg, vt, n_visits.reshape(1).astype(jnp.int32), bounds


# ---- the kernel ------------------------------------------------------------------------------------

def _kernel(vg_ref, vt_ref, nv_ref, bounds_ref, off_ref, *refs, qtype: str, group: int, tiles: Tiles,
            num_groups: int, nk: int, zeros: bool, gscale: bool, int8_lhs: bool, mxu: str, row_group: int,
            gate: str):
    gs_ref, refs = (refs[0], refs[1:]) if gscale else (None, refs)  # nvfp4 global scales: [groups] a weight, pair: both
    lhs_ref, *refs = refs
    # row scales of 8-bit codes: [tm, 1], or [tm, k / row_group] per group of inputs
    rs_ref, refs = (refs[0], refs[1:]) if int8_lhs else (None, refs)
    per = 3 if zeros else 2  # a weight's refs: values, scales (and zero points: asymmetric ints)
    pair = 2 if gate else 1  # a gated pair: rhs's and up's refs, then the output, then an accumulator each
    weights = [refs[j * per:(j + 1) * per] + [None] * (3 - per) for j in range(pair)]
    out_ref, accs = refs[pair * per], refs[pair * per + 1:]
    v, ki = pl.program_id(1), pl.program_id(2)
    tm, tk, tn = tiles.tm, tiles.tk, tiles.tn
    g = vg_ref[v]
    real = g < num_groups

    def scales(s_ref, j, rows=slice(None)):  # scale rows as float32, over the group's global scale (weight j's)
        s = decode_scales(s_ref[rows, :], qtype)
        return s if gs_ref is None else s / gs_ref[j * num_groups + jnp.minimum(g, num_groups - 1)]

    def part(x, q_ref, s_ref, z_ref, j):  # this k tile's float32 contribution to weight j's [tm, tn] sums
        if int8_lhs:  # 8-bit codes on both sides; scales after the dot (tk divides the group)
            if mxu == "int8":
                y = jnp.dot(x, q_ref[...].astype(jnp.int8), preferred_element_type=jnp.int32)
            elif mxu == "fp8":  # int4 or fp8 weight values, exact in e4m3
                y = jnp.dot(x, decode_values(q_ref[...], qtype).astype(x.dtype), preferred_element_type=jnp.float32)
            else:
                y = jnp.dot(x.astype(jnp.bfloat16), decode_values(q_ref[...], qtype).astype(jnp.bfloat16),
                            preferred_element_type=jnp.float32)
            y = y.astype(jnp.float32)
            if z_ref is not None:
                y -= jnp.sum(x.astype(jnp.float32), axis=1, keepdims=True) * _tile_row(
                    z_ref[...].astype(jnp.float32), ki, tk, group)
            y *= _tile_row(scales(s_ref, j), ki, tk, group)
            if row_group:  # the k tile's own column of row scales (a tile never spans two), by a mask
                rs = rs_ref[...]
                hit = jax.lax.broadcasted_iota(jnp.int32, rs.shape, 1) == (ki * tk) // row_group
                y *= jnp.sum(jnp.where(hit, rs, 0.0), axis=1, keepdims=True)
            return y
        if qtype == "bf16":  # a dense weight: its unit scales change nothing
            return jnp.dot(x, q_ref[...], preferred_element_type=jnp.float32)
        if tiles.predot:
            rows = tk // group
            s = scales(s_ref, j)  # [tk/group, tn]: this k tile's scale rows
            q = decode_values(q_ref[...], qtype).reshape(rows, group, tn)  # f32
            if z_ref is not None:
                q = q - z_ref[...].astype(jnp.float32)[:, None, :]  # exact: small integers
            w = (q * s[:, None, :]).reshape(tk, tn).astype(jnp.bfloat16)
            return jnp.dot(x, w, preferred_element_type=jnp.float32)
        # scales on partial sums: the tile's groups of rows one by one (the block holds their tk/group scale
        # rows), or the one group the tile lies in (the block holds all k/group rows: the tile's picked out)
        if group >= tk:
            s = [_tile_row(scales(s_ref, j), ki, tk, group)]
            z = None if z_ref is None else [_tile_row(z_ref[...].astype(jnp.float32), ki, tk, group)]
        else:
            s = [scales(s_ref, j, slice(r, r + 1)) for r in range(tk // group)]
            z = None if z_ref is None else [z_ref[r:r + 1, :].astype(jnp.float32) for r in range(tk // group)]
        width = min(group, tk)
        y = None
        for r in range(tk // width):
            xr = x[:, r * width:(r + 1) * width]
            p = jnp.dot(xr, _bf16_values(q_ref[r * width:(r + 1) * width, :], qtype),
                        preferred_element_type=jnp.float32)
            if z is not None:
                p -= jnp.sum(xr.astype(jnp.float32), axis=1, keepdims=True) * z[r]
            y = p * s[r] if y is None else y + p * s[r]
        return y

    @pl.when(ki == 0)
    def _():
        for acc_ref in accs:
            acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(real)
    def _():
        x = lhs_ref[:, pl.ds(pl.multiple_of(ki * tk, 128), tk)] if tiles.lhs_resident else lhs_ref[...]  # [tm, tk]
        for j, (refs_j, acc_ref) in enumerate(zip(weights, accs)):
            acc_ref[...] += part(x, *refs_j, j)

    @pl.when(ki == nk - 1)
    def _():
        t = vt_ref[v]
        first = (v == 0) | (vt_ref[jnp.maximum(v - 1, 0)] != t)
        rows = t * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        mine = (rows >= bounds_ref[g, 0]) & (rows < bounds_ref[g, 1])
        prev = jnp.where(first, 0.0, out_ref[...].astype(jnp.float32))
        sums = [a[...] if rs_ref is None or row_group else a[...] * rs_ref[...] for a in accs]
        if gate:  # each product rounded to the output's type, as two calls give them; the rest in float32
            g_, u = (y.astype(out_ref.dtype).astype(jnp.float32) for y in sums)
            sums = [GATES[gate](g_) * u]
        out_ref[...] = jnp.where(mine, sums[0], prev).astype(out_ref.dtype)


def _bf16_values(values: jax.Array, qtype: str) -> jax.Array:
    """A tile's stored values as the MXU's bf16 operand (exact: small integers, fp8 and e2m1 values): ints
    converted straight to bf16 (one conversion an element, not two through float32)."""
    return values.astype(jnp.bfloat16) if qtype in ("int4", "int8") else \
        decode_values(values, qtype).astype(jnp.bfloat16)


def _tile_row(all_rows: jax.Array, ki, tk: int, group: int) -> jax.Array:
    """[k/group, tn] f32 -> [1, tn], the scale (zero point) row of k tile ki when one row serves the tile.
    Selected with a mask rather than a dynamic one-row slice, which Mosaic cannot prove aligned for packed
    (bf16, uint8) scales."""
    if all_rows.shape[0] == 1:
        return all_rows
    hit = jax.lax.broadcasted_iota(jnp.int32, all_rows.shape, 0) == (ki * tk) // group
    return jnp.sum(jnp.where(hit, all_rows, 0.0), axis=0, keepdims=True)


# ---- cost estimate ---------------------------------------------------------------------------------

def cost(m: int, k: int, n: int, g: int, rhs: QTensor, tiles: Tiles, out_bytes: int = 2,
         weights: int = 1) -> pl.CostEstimate:
    """The static bound of tiling.traffic: bytes the call moves and FLOPs the MXU executes (`weights` 2: a
    gated pair's)."""
    moved, flops = traffic(m, k, n, g, rhs.qtype, rhs.group, rhs.scales.dtype.itemsize, tiles, out_bytes,
                           _zero_bytes(rhs), lhs_bytes=1 if row_codes(rhs.act, rhs.qtype) else 2,
                           row_scales=k // row_group(rhs.act) if row_group(rhs.act) else 1, weights=weights)
    moved += 0 if rhs.gscale is None else 4 * g * weights  # the call's global scales, into SMEM once
    return pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=moved)


# ---- pallas_call -----------------------------------------------------------------------------------

def index_maps(tiles: Tiles, g: int, nk: int, group: int) -> tuple:
    """The block index of each operand at grid step (n tile, visit, k tile) — (lhs, row scales, weight values,
    scales and zero points, output) — from the scalar prefetch refs (visit groups and m tiles, the number of
    real visits, group bounds, the group offset; nvfp4's global scales after them, unused). A visit that
    reads no weights — one of the sentinel group's (m tiles past every group's rows: under expert
    parallelism, rows of other devices' experts), which the kernel only zeroes — repeats the blocks the last
    grouped visit ended on (its last k tile, its m tile): an unchanged index copies nothing, so those visits
    move no bytes but their output's (the CostEstimate counts every visit up to the static bound as a
    grouped one)."""

    def idle(v, vg):
        return vg[v] >= g

    def at(v, ki, vg):  # the k tile a visit reads: the last one throughout an idle visit
        return jnp.where(idle(v, vg), nk - 1, ki)

    def lhs_map(ni, v, ki, vg, vt, nv, bounds, off, *_):  # resident: one block per m tile, kept across n tiles
        last = jnp.maximum(bounds[g - 1, 1] - 1, 0) // tiles.tm  # the last grouped row's m tile
        return jnp.where(idle(v, vg), last, vt[v]), 0 if tiles.lhs_resident else at(v, ki, vg)

    def rows_map(ni, v, ki, vg, vt, *_):  # 8-bit rows' scales: a block per m tile, like the output's
        return vt[v], 0

    def q_map(ni, v, ki, vg, vt, nv, bounds, off, *_):
        return off[0] + jnp.minimum(vg[v], g - 1), at(v, ki, vg), ni

    def s_map(ni, v, ki, vg, vt, nv, bounds, off, *_):  # group < tk: the k tile's rows; else all rows (few)
        return off[0] + jnp.minimum(vg[v], g - 1), at(v, ki, vg) if group < tiles.tk else 0, ni

    def out_map(ni, v, ki, vg, vt, nv, bounds, off, *_):
        return vt[v], ni

    return lhs_map, rows_map, q_map, s_map, out_map


def _call(lhs: jax.Array, rhs: QTensor, group_sizes: jax.Array, group_offset: jax.Array, tiles: Tiles,
          interpret, row_scales: jax.Array | None, out_dtype, mxu: str, up: QTensor | None, gate: str) -> jax.Array:
    m, k = lhs.shape
    _, _, n = rhs.shape
    g = group_sizes.shape[0]
    tm, tk, tn = tiles.tm, tiles.tk, tiles.tn
    nk = k // tk
    vg, vt, nv, bounds = visits(group_sizes, m, tm)
    srows = rhs.scales.shape[1]
    grid = (n // tn, nv[0], nk)  # the real visits only: a dynamic bound
    kernel = functools.partial(_kernel, qtype=rhs.qtype, group=rhs.group, tiles=tiles, num_groups=g, nk=nk,
                               zeros=rhs.zeros is not None, gscale=rhs.gscale is not None,
                               int8_lhs=row_scales is not None, mxu=mxu,
                               row_group=row_group(rhs.act) if row_scales is not None else 0, gate=gate)
    lhs_map, rows_map, q_map, s_map, out_map = index_maps(tiles, g, nk, rhs.group)
    s_spec = pl.BlockSpec((None, tk // rhs.group if rhs.group < tk else srows, tn), s_map)  # zero points too

    offset = group_offset.reshape(1).astype(jnp.int32)
    prefetch = [vg, vt, nv, bounds, offset]
    pair = (rhs,) if up is None else (rhs, up)
    if rhs.gscale is not None:  # this call's groups' global scales: [g] float32 a weight, in SMEM
        prefetch.append(jnp.concatenate([jax.lax.dynamic_slice_in_dim(w.gscale.astype(jnp.float32), offset[0], g)
                                         for w in pair]))
    # weights stay in HBM: else XLA may stage a small one whole into VMEM before the call (a second copy
    # of its bytes, seen for Gemma-3-27B's o-proj and scales), where the kernel streams tiles anyway
    blocks = [[pltpu.with_memory_space_constraint(a, pltpu.HBM) for f, a in w.arrays.items() if f != "gscale"]
              for w in pair]
    lhs_specs = [pl.BlockSpec((tm, k if tiles.lhs_resident else tk), lhs_map)]
    lhs_args = [lhs]
    if row_scales is not None:  # [m, 1] or [m, k / N] float32, a block per m tile like the output's
        lhs_specs.append(pl.BlockSpec((tm, row_scales.shape[1]), rows_map))
        lhs_args.append(row_scales.astype(jnp.float32))

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=grid,
            in_specs=[*lhs_specs, *[spec for b in blocks for spec in [pl.BlockSpec((None, tk, tn), q_map),
                                                                     *[s_spec] * (len(b) - 1)]]],
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)] * len(pair),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=tiles.vmem_limit),
        cost_estimate=cost(m, k, n, g, rhs, tiles, jnp.dtype(out_dtype).itemsize, len(pair)),
        name="gmm_v2", metadata={"mxu": mxu},  # the MXU's operand type, which `plan` counts FLOPs by
        interpret=interpret,
    )(*prefetch, *lhs_args, *[a for b in blocks for a in b])


# ---- public entry ----------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("chip", "tiles", "interpret", "gate"))
def gmm_v2(lhs: jax.Array, rhs: QTensor, group_sizes: jax.Array, group_offset: jax.Array | None = None, *,
           row_scales: jax.Array | None = None, chip: str = "v6e", tiles: Tiles | None = None,
           interpret=False, up: QTensor | None = None, gate: str = "") -> jax.Array:
    """Grouped matmul with quantized weights; with `up`, a gated pair: GATES[gate](lhs @ rhs) * (lhs @ up).

    Args:
        lhs: [m, k] bf16, rows sorted by group; int8 / fp8 codes when rhs.act is "int8" / "fp8"
            (runtime/ops.quantize_rows).
        rhs: QTensor [g, k, n] (int4, int8 with or without zero points, fp8, mxfp4, mxfp8 or nvfp4; group or
            channel scales).
        group_sizes: int32 [g], rows per group, sum <= m; rows past the sum come out zero.
        row_scales: [m, 1] the quantized rows' scales (with rhs.act only; [m, k / N] per group of N inputs,
            "fp8_g<N>"), in the output's dtype.
        group_offset: int32 scalar: the groups are rhs's groups offset .. offset + g - 1 (default 0). A
            layer of a stacked weight [layers, k, n] (scanned layers) is offset = layer, g = 1: the kernel
            DMAs that layer's tiles straight from the stack, never a sliced copy.
        chip: target generation ("v5e", "v6e", "v7x"); its facts pick the tiles.
        tiles: explicit tiles (tests); default: `choose_tiles` for the chip.
        interpret: run in Pallas interpret mode (CPU), e.g. `pltpu.InterpretParams()`.
        up, gate: a second weight stored as rhs is (its arrays alone differ) and a GATES key: each k tile of
            lhs, read once, meets both weights' tiles, and the output tile is the gate of rhs's sums, each
            rounded to the output's type, times up's (an MLP's gate and up projections: their two [m, n]
            products and the pass that multiplies them never reach HBM).
    Returns:
        [m, n] in lhs.dtype (row_scales.dtype with int8 rows).
    """
    if (up is None) != (not gate) or (gate and gate not in GATES):
        raise ValueError(f"a gated pair needs up and one of {sorted(GATES)} (got gate {gate!r})")
    if up is not None and not pairs(rhs, up):
        raise ValueError("a gated pair's weights differ in more than their arrays")
    codes = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}.get(row_codes(rhs.act, rhs.qtype))
    if (codes is None) != (row_scales is None) or (codes is not None and lhs.dtype != codes):
        raise ValueError(f"act {rhs.act!r}: {rhs.act} lhs rows and row_scales go together (got {lhs.dtype} rows)")
    if row_scales is not None and tiles is not None and tiles.predot:
        raise ValueError("quantized rows take their weight scales after the dot: tk must divide the group")
    if tiles is None:
        tiles, why = check_gmm_v2(lhs.shape, rhs, CHIPS[chip], group_sizes.shape[0], up is not None)
        if tiles is None:
            raise ValueError(f"gmm_v2 cannot serve this call: {why}")
    offset = jnp.zeros((), jnp.int32) if group_offset is None else jnp.asarray(group_offset, jnp.int32)
    out_dtype = lhs.dtype if row_scales is None else row_scales.dtype
    mxu = mxu_type(rhs.qtype, rhs.act, CHIPS[chip]) if rhs.act else "bf16"
    return _call(lhs, rhs, group_sizes, offset, tiles, interpret, row_scales, out_dtype, mxu, up, gate)


def pairs(a: QTensor, b: QTensor) -> bool:
    """Whether gmm_v2 takes b as a's gated pair (`up`): the same shape, storage and placement, scale and zero
    point arrays alike, and no per-weight transform of the activations (activation order, rotation, nvfp4
    input scales), which would give each weight its own lhs."""
    alike = all(getattr(a, f) == getattr(b, f) for f in ("shape", "qtype", "group", "act", "mesh", "split"))
    present = all((getattr(a, f) is None) == (getattr(b, f) is None) for f in ("zeros", "gscale"))
    return alike and present and a.scales.dtype == b.scales.dtype and \
        all(getattr(w, f) is None for w in (a, b) for f in ("perm", "rot", "act_gscale"))
