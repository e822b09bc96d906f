"""gmm_v2 (Pallas, interpret mode on CPU) and the XLA path against the pure-jnp reference.

Inputs are drawn fresh on every run (the seed is in each failure message). Interpret mode fills
uninitialized memory with NaN (InterpretParams' default), so an output tile the kernel forgets to write
is poisoned and fails the comparison.

Tolerances (relative Frobenius norm against a float32 HIGHEST-precision reference):
- every path rounds its output to bf16: RMS relative error about 2^-9 / sqrt(3) = 1.1e-3;
- scales applied to partial sums use exact bf16 operands (int4, int8 and fp8 values are exact in bf16),
  so that is all: tolerance 4e-3;
- pre-dot tiles round each dequantized weight to bf16 before the MXU (another ~1.1e-3, independent),
  tolerance 6e-3; the XLA path dequantizes to bf16 as well, 6e-3.
A wrong scale row, a misplaced group boundary or an unwritten tile gives errors of order 1 or NaN.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from helpers import rel_err as _rel
from quantkit.kernels.gmm_v2 import gmm_v2, visits
from quantkit.kernels.tiling import CHIPS, Tiles, choose_tiles, hbm_bytes, traffic, weight_bits
from quantkit.kernels.xla import gmm_xla
from quantkit.quant.qtensor import make_qtensor
from quantkit.quant.reference import gmm_reference

INTERPRET = pltpu.InterpretParams()  # uninitialized memory = NaN


def _random_qtensor(rng, qtype, g, k, n, group, zeros=False):
    """Random values and scales of `qtype`; `zeros`: int zero points over the whole range as well."""
    zp = gscale = None
    if qtype in ("int4", "int8"):
        half = 8 if qtype == "int4" else 128
        values = rng.integers(-half, half, (g, k, n)).astype(np.int8)
        scales = rng.uniform(0.5, 2.0, (g, k // group, n)).astype(np.float32) / (8 * half)
        zp = rng.integers(-half, half, (g, k // group, n)).astype(np.int8) if zeros else None
    elif qtype == "fp8":
        values = (rng.standard_normal((g, k, n)) * 64).astype(jnp.float8_e4m3fn)
        scales = rng.uniform(0.5, 2.0, (g, k // group, n)).astype(np.float32) / 4096
    elif qtype == "mxfp8":  # fp8 values, E8M0 scales around 2^-12
        values = (rng.standard_normal((g, k, n)) * 64).astype(jnp.float8_e4m3fn)
        scales = rng.integers(113, 118, (g, k // group, n)).astype(np.uint8)
    elif qtype == "nvfp4":  # e2m1 codes, fp8 scales over 448, a global scale per group (448 * 6 / absmax)
        values = rng.integers(-8, 8, (g, k, n)).astype(np.int8)
        scales = rng.uniform(16, 448, (g, k // group, n)).astype(jnp.float8_e4m3fn)
        gscale = (448 * 6 / rng.uniform(0.5, 4.0, g)).astype(np.float32)
    else:  # mxfp4: e2m1 codes as signed nibbles, E8M0 scales around 2^-6
        values = rng.integers(-8, 8, (g, k, n)).astype(np.int8)
        scales = rng.integers(119, 124, (g, k // group, n)).astype(np.uint8)
    return make_qtensor(values, scales, qtype, group, zp, gscale)


def _sizes(rng, g, m):
    """g group sizes summing to at most m, some of them empty."""
    if g == 1:
        return np.array([max(0, m - rng.integers(0, 3))], np.int32)
    cap = max(1, m - int(rng.integers(0, 5)))  # leave up to 4 rows past all groups
    cuts = np.sort(rng.integers(0, cap + 1, g - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [cuts[-1] + rng.integers(0, m - cuts[-1] + 1)]]))
    sizes[rng.choice(g, 2, replace=False)] = 0  # empty experts
    return sizes.astype(np.int32)


CASES = [  # qtype, group (None = channel), tk, zero points; k = 512. Pre-dot scale blocks fill whole sublane
    # tiles (f32 8 rows, uint8 scales and int8 zero points 32) or are all of k.
    ("int4", 32, 256, False), ("int4", 64, 512, False), ("int4", 128, 512, False), ("int4", 256, 512, False),
    ("int4", 256, 256, False), ("int4", None, 128, False), ("int8", 128, 512, False), ("int8", None, 256, False),
    ("fp8", None, 256, False), ("fp8", 128, 512, False), ("mxfp4", 32, 512, False), ("mxfp8", 32, 512, False),
    ("nvfp4", 16, 512, False),
    # zero points: pre-dot (the tile's rows shifted), one of several rows per k tile, channel (one row)
    ("int4", 32, 512, True), ("int4", 256, 128, True), ("int8", None, 256, True),
    # groups of 128 and wider, several a k tile: each group's partial sums scaled (and zero points taken off)
    ("int4", 128, 512, True), ("mxfp8", 128, 512, False),
]


@pytest.mark.parametrize("qtype,group,tk,zeros", CASES)
@pytest.mark.parametrize("g,m", [(1, 1), (1, 37), (8, 61), (8, 40)])
def test_kernel_matches_reference(qtype, group, tk, zeros, g, m, seed):
    rng = np.random.default_rng(seed)
    k, n = 512, 256
    group = group or k
    rhs = _random_qtensor(rng, qtype, g, k, n, group, zeros)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    sizes = jnp.asarray(_sizes(rng, g, m))
    tiles = Tiles(tm=m if m < 16 else 16, tk=tk, tn=128, predot=group < min(tk, 128), lhs_resident=bool(m % 2),
                  vmem_bytes=0, vmem_limit=32 << 20)
    out = gmm_v2(lhs, rhs, sizes, tiles=tiles, interpret=INTERPRET)
    ref = gmm_reference(lhs, rhs, sizes)
    total = int(sizes.sum())
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert bool(jnp.isfinite(out).all()), f"unwritten (NaN) output, seed {seed}"
    assert bool((out[total:] == 0).all()), f"rows past the groups not zero, seed {seed}"
    tol = 6e-3 if tiles.predot else 4e-3
    if total:
        assert _rel(out[:total], ref[:total]) < tol, f"seed {seed}, sizes {sizes.tolist()}"


@pytest.mark.parametrize("k,n,g,m,tk", [(200, 256, 1, 37, None), (256, 200, 1, 5, None), (384, 256, 8, 61, None),
                                        (512, 200, 8, 40, 128)])
def test_dense_bf16_weight_matches_its_product(k, n, g, m, tk, seed):
    """A dense bf16 weight as the TPU step serves it (runtime/ops.py dense_as_qtensor: QTensor "bf16", unit
    channel scales) through gmm_v2: a side that is not a multiple of 128 (gpt-oss's hidden 2880 here 200) is
    one block, tiles chosen by choose_tiles (and several k tiles); grouped rows and a layer picked from a
    stack by the group offset. Against the float32 HIGHEST product of the same bf16 values; only the output's bf16 rounding
    differs (tolerance 4e-3, as for scales on partial sums)."""
    from quantkit.quant.qtensor import DENSE, QTensor

    rng = np.random.default_rng(seed)
    values = jnp.asarray(rng.standard_normal((g + 2, k, n)) / np.sqrt(k), jnp.bfloat16)  # 2 more layers in the stack
    rhs = QTensor(values, jnp.ones((g + 2, 1, n), jnp.bfloat16), DENSE, k)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    sizes = jnp.asarray(_sizes(rng, g, m))
    tiles = choose_tiles(m, k, n, g, DENSE, k, 2, CHIPS["v6e"])
    assert tiles.tk == k and (tiles.tn == n if n % 128 else n % tiles.tn == 0)  # small: one k tile
    if tk:  # several k tiles, lhs streamed by k tiles
        tiles = Tiles(tm=16, tk=tk, tn=tiles.tn, predot=False, lhs_resident=False, vmem_bytes=0, vmem_limit=32 << 20)
    out = gmm_v2(lhs, rhs, sizes, jnp.int32(2), tiles=tiles, interpret=INTERPRET)  # layers 2 .. 2 + g - 1
    groups = np.repeat(np.arange(g + 1), np.append(np.asarray(sizes), m - int(sizes.sum())))
    w = np.asarray(values[2:].astype(jnp.float32))
    ref = np.stack([lhs[i].astype(jnp.float32) @ w[e] if e < g else np.zeros(n, np.float32)
                    for i, e in enumerate(groups)])
    total = int(sizes.sum())
    assert bool(jnp.isfinite(out).all()), f"unwritten (NaN) output, seed {seed}"
    assert bool((out[total:] == 0).all()), f"rows past the groups not zero, seed {seed}"
    if total:
        assert _rel(out[:total], ref[:total]) < 4e-3, f"seed {seed}, sizes {sizes.tolist()}"


@pytest.mark.slow
def test_dense_bf16_weight_compiles_unaligned_and_is_read_once():
    """gpt-oss's attention projections as the TPU step serves them (hidden 2880, not a multiple of 128, on
    either side) compile deviceless for v6e at 16 rows, and XLA counts their weight's bytes once: doubling
    the weight (its aligned side) adds its own bytes to the program's count, within 5% (XLA's count of the
    program's small ops moves by a few hundred KB), where a dense dot whose weight XLA stages in VMEM adds
    ~3x: the kernel's tiles come straight from HBM."""
    from quantkit.quant.qtensor import DENSE, QTensor
    from quantkit.runtime.aot import compile_for

    def counted(k: int, n: int) -> float:
        rhs = QTensor(jax.ShapeDtypeStruct((1, k, n), jnp.bfloat16), jax.ShapeDtypeStruct((1, 1, n), jnp.bfloat16),
                      DENSE, k)
        call = lambda x, w: gmm_v2(x, w, jnp.full((1,), 16, jnp.int32), chip="v6e")  # noqa: E731
        compiled, _ = compile_for("v6e", call, jax.ShapeDtypeStruct((16, k), jnp.bfloat16), rhs, pinned=(1,))
        cost = compiled.cost_analysis()
        return (cost[0] if isinstance(cost, (list, tuple)) else cost)["bytes accessed"]

    for (k, n), (k2, n2) in (((2880, 4096), (2880, 8192)), ((4096, 2880), (8192, 2880))):  # q-proj, o-proj
        added = (k2 * n2 - k * n) * 2
        assert 0.95 * added <= counted(k2, n2) - counted(k, n) <= 1.05 * added, (k, n)


@pytest.mark.parametrize("qtype,group,zeros", [("int4", 32, False), ("int4", 256, False), ("int8", 64, False),
                                               ("fp8", 256, False), ("mxfp4", 32, False), ("mxfp8", 32, False),
                                               ("nvfp4", 16, False),
                                               ("int4", 32, True),
                                               ("int8", 256, True)])
def test_xla_path_matches_reference(qtype, group, zeros, seed):
    rng = np.random.default_rng(seed)
    for g, m in [(1, 5), (8, 50)]:
        rhs = _random_qtensor(rng, qtype, g, 256, 384, group, zeros)
        lhs = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
        sizes = jnp.asarray(_sizes(rng, g, m))
        out, ref = gmm_xla(lhs, rhs, sizes), gmm_reference(lhs, rhs, sizes)
        total = int(sizes.sum())
        assert bool((out[total:] == 0).all())
        assert _rel(out[:total], ref[:total]) < 6e-3, f"seed {seed}"


def test_activation_order_gathers_each_rows_group_order(seed):
    """A QTensor in activation order (stored row j of group e is input feature perm[e, j]): grouped_matmul
    gathers each row's activations into its group's order, so out[i] = x[i] @ W_e with W_e back in feature
    order; one group (a dense layer) and rows of several groups (experts, some empty)."""
    import dataclasses

    from quantkit.quant.reference import dequantize
    from quantkit.runtime.ops import grouped_matmul

    rng = np.random.default_rng(seed)
    for g, m in [(1, 7), (4, 30)]:
        qt = _random_qtensor(rng, "int4", g, 256, 128, 32)
        perm = np.stack([rng.permutation(256) for _ in range(g)]).astype(np.int32)
        stored = np.asarray(dequantize(qt))
        w = np.empty_like(stored)
        for e in range(g):
            w[e][perm[e]] = stored[e]
        x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
        sizes = _sizes(rng, g, m)
        groups = np.searchsorted(np.cumsum(sizes), np.arange(m), side="right")
        xf = np.asarray(x, np.float32)
        ref = np.stack([xf[i] @ w[e] if e < g else np.zeros(128, np.float32) for i, e in enumerate(groups)])
        out = grouped_matmul(x, dataclasses.replace(qt, perm=jnp.asarray(perm)), jnp.asarray(sizes))
        total = int(sizes.sum())
        assert _rel(out[:total], ref[:total]) < 6e-3, (g, seed)


def test_visits_cover_every_tile_once_per_group(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):  # few shapes (each compiles its ops), random group sizes
        g, m, tm = int(rng.choice([1, 3, 8])), int(rng.choice([5, 64, 199])), int(rng.choice([8, 64]))
        sizes = _sizes(rng, g, m) if g > 1 else np.array([rng.integers(0, m + 1)], np.int32)
        vg, vt, nv, bounds = (np.asarray(a) for a in visits(jnp.asarray(sizes), m, tm))
        n = int(nv[0])
        pairs = list(zip(vg[:n].tolist(), vt[:n].tolist()))
        ends = np.cumsum(sizes)
        expect = [(e, t) for e in range(g) for t in range(-(-m // tm))
                  if sizes[e] and t * tm < ends[e] and (t + 1) * tm > ends[e] - sizes[e]]
        covered = -(-int(ends[-1]) // tm)
        expect += [(g, t) for t in range(covered, -(-m // tm))]
        assert pairs == expect
        assert n <= vg.shape[0] and all(vt[n:] == vt[n - 1])  # padding repeats the last visit


# ---- tiling, on shapes alone ---------------------------------------------------------------------

LAYERS = {  # (k, n, experts) of every distinct linear
    "Llama-3-8B": [(4096, 4096, 1), (4096, 1024, 1), (4096, 14336, 1), (14336, 4096, 1)],
    "Gemma-3-27B": [(5376, 4096, 1), (5376, 2048, 1), (4096, 5376, 1), (5376, 21504, 1), (21504, 5376, 1)],
    "Qwen3-30B-A3B": [(2048, 4096, 1), (2048, 512, 1), (4096, 2048, 1), (2048, 768, 128), (768, 2048, 128)],
}
SHAPES = [s for shapes in LAYERS.values() for s in shapes]


VERSIONS = {"v5e": pltpu.ChipVersion.TPU_V5E, "v6e": pltpu.ChipVersion.TPU_V6E, "v7x": pltpu.ChipVersion.TPU_7X}


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v7x"])
@pytest.mark.parametrize("qtype,group", [("int4", 32), ("int4", 128), ("int4", None), ("int8", 128), ("fp8", None),
                                         ("mxfp4", 32), ("mxfp8", 32), ("nvfp4", 16), ("int4z", 32),
                                         ("int8z", 128)])  # z: zero points
def test_tiles_obey_the_rules(chip, qtype, group):
    c = CHIPS[chip]
    qtype, zeros = qtype.removesuffix("z"), qtype.endswith("z")
    scale_bytes = 1 if qtype in ("mxfp4", "mxfp8", "nvfp4") else 2
    for k, n, g in SHAPES:
        grp = group or k
        for m in (1, 16, 256, 2048):
            t = choose_tiles(m, k, n, g, qtype, grp, scale_bytes, c, zero_bytes=int(zeros))
            assert t is not None, (chip, k, n, grp, m)
            assert k % t.tk == 0 and n % t.tn == 0 and t.tk % 128 == 0 and t.tn % 128 == 0
            assert t.tm == m or t.tm % 8 == 0
            assert (t.tk % grp == 0) if t.predot else (t.tk % grp == 0 or grp % t.tk == 0)
            assert t.predot == (grp < min(t.tk, 128))  # groups of 128 and wider: scales on partial sums
            if grp < t.tk and (zeros or scale_bytes == 1):  # 1-byte blocks of tk/group rows: whole (32, 128) tiles
                assert (t.tk // grp) % 32 == 0 or t.tk == k, (chip, k, n, grp, t)
            # VMEM against the chip's own facts (jax's TPU info): the limit passed to Mosaic is within the
            # chip's VMEM, and the estimate covers at least what the blocks take double-buffered (lhs, the
            # packed weight tile, the output) plus the f32 accumulator, counted here from the tile sizes alone
            vmem = pltpu.get_tpu_info_for_chip(VERSIONS[chip], 1).vmem_capacity_bytes
            blocks = (2 * t.tm * (k if t.lhs_resident else t.tk) * 2 + 2 * t.tk * t.tn * weight_bits(qtype) // 8
                      + 2 * t.tm * t.tn * 2 + t.tm * t.tn * 4)
            assert blocks < t.vmem_bytes <= t.vmem_limit * 3 // 4 and t.vmem_limit <= vmem, (chip, k, n, m, t)
            weight = k * n * weight_bits(qtype) // 8
            if weight >= 8 << 20:
                assert (k // t.tk) * (n // t.tn) >= 4, (chip, k, n, t)


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v7x"])
def test_grouped_tiles_read_each_experts_weights_once_when_its_rows_straddle_tiles(chip):
    """Decode-shaped expert calls (a few rows an expert, so that m tiles straddle experts: Qwen3.5-397B's
    experts under data parallelism, 1280 rows over 64 of them, and Qwen3-30B-A3B's, 512 rows over 128)
    declare each expert's weight values and scales once (tiles whose one k tile lets an expert's visits
    share its block), besides lhs at most once an n tile and the output once; a choice of several k tiles
    re-reads a straddled expert's weights at each of its visits."""
    for m, k, n, g in ((1280, 4096, 1024, 64), (1280, 1024, 4096, 64), (512, 2048, 768, 128), (512, 768, 2048, 128)):
        t = choose_tiles(m, k, n, g, "int4", 128, 2, CHIPS[chip])
        once = g * (k * n // 2 + k // 128 * n * 2) + (n // t.tn) * m * k * 2 + m * n * 2
        assert traffic(m, k, n, g, "int4", 128, 2, t)[0] <= once, (chip, m, k, n, t)


# ---- which chip's facts a TPU gets -----------------------------------------------------------------

def test_chip_of_maps_known_device_kinds_and_sends_the_rest_to_xla():
    """Known kinds get the chip whose VMEM jax's own TPU facts give; TPU v4 (16 MiB VMEM), v5p and
    unknown kinds get None (the XLA path) with a warning, never another chip's facts. The deviceless
    topologies' devices (libtpu) carry the real device_kind strings through `tpu_chip`."""
    import warnings

    from quantkit.runtime.aot import tpu_devices
    from quantkit.runtime.ops import chip_of, tpu_chip

    v = pltpu.ChipVersion
    known = [("TPU v5 lite", "v5e", v.TPU_V5E), ("TPU v5e", "v5e", v.TPU_V5E), ("TPU v6 lite", "v6e", v.TPU_V6E),
             ("TPU v6e", "v6e", v.TPU_V6E), ("TPU7x", "v7x", v.TPU_7X), ("TPU7", "v7x", v.TPU_7),
             ("TPU v7x", "v7x", v.TPU_7X), ("TPU v7", "v7x", v.TPU_7X)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for kind, chip, version in known:
            assert chip_of(kind) == chip, kind
            info, c = pltpu.get_tpu_info_for_chip(version, 1), CHIPS[chip]
            assert c.vmem_bytes == info.vmem_capacity_bytes, kind
            # per logical device (one TensorCore of a v7x): HBM usable below jax's capacity by at most 3%
            # (v6e 31.25 of 32.04 GiB; v7x 94.75 of 95.93, libtpu's limit), bandwidth and bf16 peak within 1%
            assert 0.97 * info.hbm_capacity_bytes <= c.hbm_bytes <= info.hbm_capacity_bytes, kind
            assert abs(c.hbm_bytes_per_s / info.mem_bw_bytes_per_second - 1) < 0.01, kind
            assert abs(c.bf16_flops / info.bf16_ops_per_second - 1) < 0.01, kind
    for kind in ("TPU v4", "TPU v4 lite", "TPU v5", "TPU v5p", "TPU v3", "TPU8i", "TPU v9000"):
        with pytest.warns(UserWarning, match="XLA path"):
            assert chip_of(kind) is None, kind
    for chip in ("v5e", "v6e", "v7x"):
        with jax.default_device(tpu_devices(chip)[0]):
            assert tpu_chip() == chip


# ---- deviceless compilation for real TPUs (libtpu) -----------------------------------------------

def _abstract(qtype, g, k, n, group, m, zeros=False):
    from quantkit.quant.qtensor import STORAGE, QTensor

    sdt = {"mxfp4": jnp.uint8, "mxfp8": jnp.uint8, "nvfp4": jnp.float8_e4m3fn}.get(qtype, jnp.bfloat16)
    rhs = QTensor(jax.ShapeDtypeStruct((g, k, n), STORAGE[qtype]), jax.ShapeDtypeStruct((g, k // group, n), sdt),
                  qtype, group, zeros=jax.ShapeDtypeStruct((g, k // group, n), jnp.int8) if zeros else None,
                  gscale=jax.ShapeDtypeStruct((g,), jnp.float32) if qtype == "nvfp4" else None)
    return jax.ShapeDtypeStruct((m, k), jnp.bfloat16), rhs, jax.ShapeDtypeStruct((g,), jnp.int32)


AOT_CASES = [(chip, qtype, group) for chip in ("v5e", "v6e", "v7x") for qtype, group in [("int4", 128)]] + [
    ("v6e", "int4", 32), ("v6e", "int4", None), ("v6e", "int8", 128), ("v6e", "fp8", None), ("v6e", "mxfp4", 32),
    ("v7x", "fp8", None), ("v6e", "int4z", 128), ("v6e", "int8z", None), ("v6e", "mxfp8", 32),
    ("v6e", "nvfp4", 16)]  # z: zero points


# In CI, per chip and qtype: the widest-k dense linear (Llama-3-8B down_proj: the most k steps), a narrow
# output (its k/v projections: one n tile) and the 128-expert down projection (grouped visits); the rest of
# the matrix (every distinct linear of the three models, more row counts) runs with `scripts/test.sh
# --exhaustive`.
REPRESENTATIVE = [(14336, 4096, 1), (4096, 1024, 1), (768, 2048, 128)]


def _aot_case(chip, qtype, group, shapes, ms):
    """Mosaic compiles the kernel for `shapes` at each row count in `ms`; the weight argument has its packed
    size and no temporary is anywhere near a weight's size (nothing is dequantized in HBM)."""
    from quantkit.runtime.aot import compile_for

    qtype, zeros = qtype.removesuffix("z"), qtype.endswith("z")
    for k, n, g in shapes:
        grp = group or k
        for m in ms:
            lhs, rhs, gs = _abstract(qtype, g, k, n, grp, m, zeros)
            # the weight row-major, as the Runner places it (left free, XLA lays small-row scales and zero points
            # out transposed and copies them back for the kernel on every call)
            compiled, _ = compile_for(chip, lambda a, b, c: gmm_v2(a, b, c, chip=chip), lhs, rhs, gs, pinned=(1,))
            mem = compiled.memory_analysis()
            packed = g * k * n * weight_bits(qtype) // 8
            side = [(1 if qtype in ("mxfp4", "mxfp8", "nvfp4") else 2) * 8] + [8] * zeros  # bits of scales, zero points
            inputs = packed + sum(g * (k // grp) * n * b // 8 for b in side) + m * k * 2 + g * 4 * (1 + (qtype == "nvfp4"))
            # row-major scales and zero points of few rows (6 a group for [768, n] g128) pad to whole tiles
            padded = inputs + sum(hbm_bytes((g, k // grp, n), b, CHIPS[chip]) - g * (k // grp) * n * b // 8 for b in side)
            assert inputs <= mem.argument_size_in_bytes <= padded * 1.01 + 4096, (chip, k, n, g, m)
            # Temporaries (visit metadata, XLA's own buffers) stay far below one weight's size.
            assert mem.temp_size_in_bytes < max(1 << 20, packed // 16), (chip, k, n, g, m, mem.temp_size_in_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("chip,qtype,group", AOT_CASES)
def test_compiles_for_representative_layer_shapes(chip, qtype, group):
    """Each chip at a decode and a prefill row count (int4 g128); the other weight types at the prefill count,
    whose tall m tiles take the most VMEM (each compile is a few seconds)."""
    _aot_case(chip, qtype, group, REPRESENTATIVE, (1, 2048) if (qtype, group) == ("int4", 128) else (2048,))


@pytest.mark.slow
@pytest.mark.parametrize("chip", ["v6e", "v7x"])
def test_gated_pair_compiles_for_an_mlp(chip):
    """Mosaic compiles Llama-3-8B's gate and up projections (int4 g128, [4096, 14336] each) as one gated call
    at a decode and a prefill row count, with the pair's tiles (both weights' blocks in VMEM: v7x has half
    v6e's): both weights packed in the arguments, nothing dequantized in HBM."""
    from quantkit.runtime.aot import compile_for

    k, n = 4096, 14336
    for m in (16, 2048):
        lhs, gate, gs = _abstract("int4", 1, k, n, 128, m)
        _, up, _ = _abstract("int4", 1, k, n, 128, m)
        compiled, _ = compile_for(chip, lambda a, b, c, d: gmm_v2(a, b, c, chip=chip, up=d, gate="silu"),
                                  lhs, gate, gs, up, pinned=(1, 3))
        mem = compiled.memory_analysis()
        packed = k * n // 2
        assert 2 * packed < mem.argument_size_in_bytes < 2.1 * packed + m * k * 2, (chip, m)
        assert mem.temp_size_in_bytes < packed // 16, (chip, m, mem.temp_size_in_bytes)


@pytest.mark.exhaustive
@pytest.mark.parametrize("chip,qtype,group", AOT_CASES + [("v5e", "nvfp4", 16), ("v7x", "nvfp4", 16),
                                                         ("v5e", "mxfp8", 32), ("v5e", "fp8", None)])
def test_compiles_for_every_real_layer_shape(chip, qtype, group):
    """Every linear of Llama-3-8B, Gemma-3-27B and Qwen3-30B-A3B (experts as 128 groups) at decode and
    prefill sizes (~308 deviceless compiles, ~15 min on 2 cores)."""
    _aot_case(chip, qtype, group, SHAPES, (1, 64, 256, 2048) if (qtype, group) == ("int4", 128) else (1, 2048))


# ---- from checkpoints written by compressed-tensors to the kernel --------------------------------

@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_G32", "W4A16_CHANNEL", "W4A16_ASYM", "W8A16", "W8A16_ASYM",
                                    "W4AFP8", "FP8_DYNAMIC", "FP8_BLOCK", "MXFP4A16", "MXFP6A16", "MXFP8A16",
                                    "NVFP4A16"])
def test_library_checkpoint_through_the_kernels(scheme, tmp_path, seed):
    """Weights made by the library, converted once to the kernel layout, multiply like the library's
    own decompressed weights (x @ W.T), through gmm_v2 (interpret) and the XLA path."""
    from ct_oracle import library_decompress_torch, make_checkpoint

    from quantkit.formats.compressed_tensors import parse_quantization_config
    from quantkit.formats.ct_tensors import kernel_layout
    from quantkit.formats.hf import Checkpoint, classify_module, group_modules

    path = make_checkpoint(tmp_path / scheme, scheme)
    lib = library_decompress_torch(path)
    ck = Checkpoint.open(path)
    qc = parse_quantization_config(ck.config["quantization_config"])
    rng = np.random.default_rng(seed)
    modules = group_modules(ck.tensors)
    for module in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.k_proj"):
        pnames = modules[module]
        params = {p: ck.tensors[t] for p, t in pnames.items()}
        sch = qc.scheme_for(module, classify_module(module, params)[1])
        w = lib[module + ".weight"].float().numpy()  # [out, in]
        la = kernel_layout(sch, {p: ck.read(t) for p, t in pnames.items()}, w.shape)
        rhs = make_qtensor(la.values[None], la.scales[None], la.qtype, la.group,
                           None if la.zeros is None else la.zeros[None], None if la.gscale is None else [la.gscale])
        x = jnp.asarray(rng.standard_normal((24, w.shape[1])), jnp.bfloat16)
        ref = jnp.asarray(np.asarray(x, np.float32) @ w.T)
        sizes = jnp.array([24], jnp.int32)
        assert _rel(gmm_xla(x, rhs, sizes), ref) < 6e-3, (module, seed)
        out = gmm_v2(x, rhs, sizes, chip="v6e", interpret=INTERPRET)
        assert _rel(out, ref) < 6e-3, (module, seed)


# ---- quantized activations (QTensor.act "int8": W8A8, W4A8) ------------------------------------------

def _activations(rng, m, k, dtype=jnp.bfloat16):
    """Random rows with an outlier row (one huge element) and an all-zero row (scale 0 -> eps)."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, rng.integers(k)] = 300.0
    x[min(2, m - 1)] = 0.0
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("act", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantize_rows_is_the_librarys_dynamic_token_quantization(act, dtype, seed):
    """quantize_rows' codes times scales equal compressed-tensors' own fake quantization of the same rows
    (dynamic symmetric per-token int8 / fp8 e4m3, in the activations' dtype) bit for bit; the codes reach the
    type's largest magnitude and a zero row stays zero."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from quantkit.runtime.ops import quantize_rows

    rng = np.random.default_rng(seed)
    x = _activations(rng, 37, 256, jnp.dtype(dtype))
    args = QuantizationArgs(num_bits=8, type=act[:-1].replace("fp", "float"), strategy="token", dynamic=True,
                            symmetric=True)
    t = torch.from_numpy(np.array(x.astype(jnp.float32))).to(getattr(torch, dtype))[None]  # [1, m, k]
    scale, zp = compute_dynamic_scales_and_zp(t, args, torch.nn.Module())
    theirs = fake_quantize(t, scale, zp, args)[0].float().numpy()
    codes, scales = quantize_rows(x, act)
    assert codes.dtype == {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[act]
    assert scales.dtype == x.dtype and scales.shape == (37, 1)
    ours = np.asarray((codes.astype(x.dtype) * scales).astype(jnp.float32))
    np.testing.assert_array_equal(ours, theirs, err_msg=f"seed {seed}")
    top = np.abs(np.asarray(codes.astype(jnp.float32)))
    assert top.max() >= (127 if act == "int8" else 448) and not top[2].any()


@pytest.mark.parametrize("preset,act", [("MXFP4", "mxfp4"), ("MXFP8", "mxfp8"), ("FP8_BLOCK", "fp8_g128"),
                                        ("NVFP4", "nvfp4")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fake_quantize_groups_is_the_librarys_dynamic_group_quantization(preset, act, dtype, seed):
    """fake_quantize_groups equals compressed-tensors' own fake quantization of the same rows under the
    preset's input_activations (MX: e2m1 / e4m3 per 32 with E8M0 scales; FP8_BLOCK: e4m3 per 128, float
    scales; NVFP4: e2m1 per 16, e4m3 scales under a global scale, the library's generate_gparam of the rows'
    range as llm-compressor calibrates it), in the activations' dtype, bit for bit; besides the outlier and
    zero rows, groups of tiny values (scales far below 1) and values at e2m1's rounding ties; the activation
    args parse to that act."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp, generate_gparam

    from quantkit.formats.compressed_tensors import QuantArgs, Scheme, activation_qtype
    from quantkit.runtime.ops import fake_quantize_groups

    args = PRESET_SCHEMES[preset]["input_activations"]
    parsed = QuantArgs.parse(args.model_dump(mode="json", exclude_none=True), "args")
    assert activation_qtype(Scheme("g", ("Linear",), "dense", input_activations=parsed)) == act
    rng = np.random.default_rng(seed)
    x = np.array(_activations(rng, 37, 512, jnp.float32))
    x[5] *= 1e-30  # scales far below 1
    x[6, :32] = np.arange(32) * 0.25 * 2.0 ** -3  # multiples of half the e2m1 steps: ties at every midpoint
    x = jnp.asarray(x, dtype)
    t = torch.from_numpy(np.array(x.astype(jnp.float32))).to(getattr(torch, dtype))
    g = generate_gparam(t.amin().float(), t.amax().float()) if act == "nvfp4" else None  # float32 [1]
    scale, zp = compute_dynamic_scales_and_zp(t, args, torch.nn.Module(), global_scale=g)
    theirs = fake_quantize(t, scale, zp, args, global_scale=g).float().numpy()
    ours = fake_quantize_groups(x, act, None if g is None else jnp.asarray(g.numpy()))
    assert ours.dtype == x.dtype and ours.shape == x.shape
    np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), theirs, err_msg=f"seed {seed}")
    # tiny rows: kept by scales of their own, flushed by nvfp4's (at least 0.125 / the global scale)
    assert not np.asarray(ours[2]).any() and np.asarray(ours[5]).any() == (act != "nvfp4")


def test_each_expert_rotates_its_own_rows_as_the_librarys_transform(seed):
    """The MoE case of online input transforms: grouped_matmul over 4 experts, each with its own +-1 matrix
    (QTensor.rot [g, h, h], blocks of h = 128 over k = 256, drawn by the library's random_hadamard_matrix):
    every row is rotated by its own expert's matrix as compressed-tensors' HadamardTransform (its torch
    module) rotates it, then multiplied by that expert's weights (the reference matmul); an empty expert
    between two, rows past the groups zero. Float32 rows: only summation order differs (1e-5)."""
    import torch
    from compressed_tensors.transform import TransformArgs, TransformScheme
    from compressed_tensors.transform.factory.hadamard import HadamardTransform
    from compressed_tensors.transform.utils.hadamard import random_hadamard_matrix

    from quantkit.runtime.ops import grouped_matmul

    rng = np.random.default_rng(seed)
    g, k, n, h, m = 4, 256, 128, 128, 29
    gen = torch.Generator().manual_seed(seed)
    mats = [random_hadamard_matrix(h, torch.float32, gen=gen) for _ in range(g)]
    rhs = _random_qtensor(rng, "int8", g, k, n, 128)
    rotated_rhs = dataclasses.replace(rhs, rot=jnp.asarray(np.stack([t.numpy() for t in mats]).astype(np.int8)))
    x, sizes = _activations(rng, m, k, jnp.float32), np.array([10, 0, 12, 4], np.int32)
    ours = np.asarray(grouped_matmul(x, rotated_rhs, jnp.asarray(sizes)))
    scheme, args = TransformScheme(type="random-hadamard", head_dim=h), TransformArgs(targets=["Linear"], location="input")
    rows, at = torch.from_numpy(np.array(x)), np.concatenate([[0], np.cumsum(sizes)])
    rotated = torch.cat([HadamardTransform(torch.nn.Parameter(mats[e], requires_grad=False), None, scheme, args,
                                           torch.nn.Linear)(rows[at[e]:at[e + 1]]) for e in range(g)])
    total = int(at[-1])
    ref = np.asarray(gmm_reference(jnp.asarray(rotated.detach().numpy()), rhs, jnp.asarray(sizes)))
    assert _rel(ours[:total], ref) < 1e-5 and not ours[total:].any(), f"seed {seed}, sizes {list(sizes)}"


@pytest.mark.parametrize("chip,act,qtype,group,tk,zeros", [  # v6e: the int8 MXU; v7x: its exact bf16 emulation
    ("v6e", "int8", "int8", None, 256, False), ("v7x", "int8", "int4", 128, 128, False),
    ("v6e", "int8", "int4", 256, 128, True), ("v7x", "int8", "int8", None, 512, True),
    ("v6e", "fp8", "fp8", None, 256, False), ("v7x", "fp8", "int4", 128, 128, False),
    # FP8_BLOCK's fp8 rows with a scale per 128 inputs (fp8 MXU on v7x), also over channel-scaled int4
    ("v7x", "fp8_g128", "fp8", 128, 128, False), ("v6e", "fp8_g128", "int4", None, 128, False)])
@pytest.mark.parametrize("g,m", [(1, 37), (8, 61)])
def test_quantized_activations_match_reference(chip, act, qtype, group, tk, zeros, g, m, seed):
    """gmm_v2 on int8 / fp8 rows and their scales (per row, or per row and group of 128 inputs) against the
    reference on the same codes times their scales: products are exact on every path (integers; fp8 times
    int4 or fp8 values in bf16, float32 sums), the float32 weight and group row scales apply to partial sums,
    so only the bf16 output rounds (4e-3, as the kernel's other post-dot cases)."""
    from quantkit.runtime.ops import quantize_rows

    rng = np.random.default_rng(seed)
    k, n = 512, 256
    group = group or k
    rhs = dataclasses.replace(_random_qtensor(rng, qtype, g, k, n, group, zeros), act=act)
    codes, rows = quantize_rows(_activations(rng, m, k), act)
    sizes = jnp.asarray(_sizes(rng, g, m))
    tiles = Tiles(tm=32, tk=tk, tn=128, predot=False, lhs_resident=bool(m % 2), vmem_bytes=0, vmem_limit=32 << 20)
    assert rows.shape == (m, k // 128 if act == "fp8_g128" else 1)
    out = gmm_v2(codes, rhs, sizes, row_scales=rows, chip=chip, tiles=tiles, interpret=INTERPRET)
    rows32 = jnp.repeat(rows.astype(jnp.float32), k // rows.shape[1], axis=1)
    ref = gmm_reference(codes.astype(jnp.float32) * rows32, rhs, sizes)
    total = int(sizes.sum())
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert bool(jnp.isfinite(out).all()), f"unwritten (NaN) output, seed {seed}"
    assert bool((out[total:] == 0).all())
    assert _rel(out[:total], ref[:total]) < 4e-3, f"seed {seed}, sizes {sizes.tolist()}"


GATE_REFS = {"silu": lambda v: v * 0.5 * (1 + np.tanh(v / 2)),  # numpy's, not the kernel's jax.nn
             "gelu_tanh": lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))}


@pytest.mark.parametrize("qtype,group,tk,zeros,act,gate", [
    ("int4", 32, 256, False, "", "silu"), ("int4", None, 128, True, "", "gelu_tanh"),
    ("nvfp4", 16, 512, False, "", "silu"), ("int8", 128, 128, False, "int8", "silu"),
    ("bf16", None, 256, False, "", "gelu_tanh")])
@pytest.mark.parametrize("g,m", [(1, 37), (8, 61)])
def test_gated_pair_matches_the_gate_of_two_products(qtype, group, tk, zeros, act, gate, g, m, seed):
    """gmm_v2 with `up` (an MLP's gate and up projections in one call) against numpy's gate of the
    reference's first product times its second, each rounded to bf16 as the kernel rounds them: pre-dot and
    post-dot scales, zero points, nvfp4's two global scales (one a weight, in SMEM), int8 rows on the int8
    MXU, a dense bf16 pair; grouped rows. Tolerance 1.2e-2: each product carries the single call's error
    (4e-3 / 6e-3, above), and the gate's relative sensitivity x g'(x) / g(x) exceeds 1 for negative inputs
    (silu: 1 + x (1 - sigmoid(x))); a swapped pair, a missed gate or one weight's scales on both give errors
    of order 1."""
    from quantkit.quant.qtensor import DENSE, QTensor
    from quantkit.runtime.ops import quantize_rows

    rng = np.random.default_rng(seed)
    k, n = 512, 256
    group = group or k

    def weight():
        if qtype == "bf16":
            values = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
            return QTensor(values, jnp.ones((g, 1, n), jnp.bfloat16), DENSE, k)
        return dataclasses.replace(_random_qtensor(rng, qtype, g, k, n, group, zeros), act=act)

    a, b = weight(), weight()
    x = _activations(rng, m, k)
    lhs, rows = quantize_rows(x, act) if act else (x, None)
    ref_lhs = lhs if rows is None else lhs.astype(jnp.float32) * rows.astype(jnp.float32)
    sizes = jnp.asarray(_sizes(rng, g, m))
    tiles = Tiles(tm=32 if act else 16, tk=tk, tn=128, predot=group < min(tk, 128), lhs_resident=bool(m % 2), vmem_bytes=0,
                  vmem_limit=32 << 20)
    out = gmm_v2(lhs, a, sizes, row_scales=rows, tiles=tiles, interpret=INTERPRET, up=b, gate=gate)

    def rounded(w):
        return np.asarray(gmm_reference(ref_lhs, w, sizes).astype(jnp.bfloat16).astype(jnp.float32))

    ref = GATE_REFS[gate](rounded(a)) * rounded(b)
    total = int(sizes.sum())
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert bool(jnp.isfinite(out).all()), f"unwritten (NaN) output, seed {seed}"
    assert bool((out[total:] == 0).all()), f"rows past the groups not zero, seed {seed}"
    if total:
        assert _rel(out[:total], ref[:total]) < 1.2e-2, f"seed {seed}, sizes {sizes.tolist()}"
    with pytest.raises(ValueError, match="differ in more than their arrays"):
        gmm_v2(lhs, a, sizes, row_scales=rows, tiles=tiles, interpret=INTERPRET, gate=gate,
               up=dataclasses.replace(b, group=group // 2) if qtype != "bf16" else dataclasses.replace(b, act="int8"))


def _dots(jaxpr) -> list[tuple]:
    """(lhs dtype, rhs dtype, preferred type) of every dot_general in a jaxpr and the jaxprs inside it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append((str(eqn.invars[0].aval.dtype), str(eqn.invars[1].aval.dtype),
                          str(eqn.params.get("preferred_element_type"))))
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _dots(inner)
    return found


@pytest.mark.parametrize("act,qtype,group,resident,sizes,tk", [
    ("int8", "int8", 512, True, [40, 30, 26], 128), ("int8", "int4", 128, False, [96], 128),
    ("", "int8", 128, False, [40, 30, 26], 128), ("fp8", "fp8", 512, True, [96], 128),
    ("", "int4", 32, True, [40, 30, 26], 128), ("fp8_g128", "fp8", 128, False, [96], 128),
    ("", "int4", 32, True, [40, 30, 26], 512), ("", "int8", 512, False, [10, 20, 6, 50], 512)])
def test_declared_cost_equals_the_blocks_the_grid_copies(act, qtype, group, resident, sizes, tk):
    """gmm_v2's CostEstimate (tiling.traffic) against the bytes its pipeline copies for one call, counted by
    walking the grid with the call's own visit metadata (`visits`) through the kernel's own index maps
    (`index_maps`): an input block is copied when its index differs from the previous step's, the output
    written when its index changes. Groups of 40 / 30 / 26 rows over 32-row tiles straddle tiles (5 visits,
    the static bound tiles_m + g - 1, attained); 8-bit rows move 1
    byte an element and a float32 scale a row; with all of k in one tile (tk 512) a group's visits share
    its weight block; a gated pair copies its second weight's blocks as the first's."""
    from quantkit.kernels.gmm_v2 import cost

    m, k, n, tm, tn = 96, 512, 384, 32, 128
    _, rhs, _ = _abstract(qtype, len(sizes), k, n, group, m)
    rhs = dataclasses.replace(rhs, act=act)
    tiles = Tiles(tm=tm, tk=tk, tn=tn, predot=group < tk, lhs_resident=resident, vmem_bytes=0, vmem_limit=0)
    copied, written = _grid_walk(sizes, m, k, n, tiles, qtype, group, act)
    assert cost(m, k, n, len(sizes), rhs, tiles).bytes_accessed == sum(copied) + written, (copied, written)
    # a gated pair (`up`): the second weight's values and scales by the same index maps, one lhs, one output
    assert cost(m, k, n, len(sizes), rhs, tiles, weights=2).bytes_accessed == \
        sum(copied) + copied[2] + copied[3] + written


def _grid_walk(sizes, m, k, n, tiles, qtype, group, act=""):
    """Bytes gmm_v2's pipeline copies for one call: (per input — lhs, row scales, weight values, scales —
    the bytes of its blocks, output bytes written), walking the grid with the call's own visit metadata
    (`visits`) through the kernel's own index maps (`index_maps`): an input block is copied when its index
    differs from the previous step's, the output written when its index changes."""
    from quantkit.kernels.gmm_v2 import index_maps, visits

    g, nk, tm, tk, tn = len(sizes), k // tiles.tk, tiles.tm, tiles.tk, tiles.tn
    meta = visits(jnp.asarray(sizes, jnp.int32), m, tm) + (jnp.zeros(1, jnp.int32),)  # + the group offset
    lhs_map, rows_map, q_map, s_map, out_map = index_maps(tiles, g, nk, group)
    vbits = 8 if qtype in ("int8", "fp8") else 4
    row_scales = k // 128 if act == "fp8_g128" else 1  # float32 scales a row
    blocks = [(lhs_map, tm * (k if tiles.lhs_resident else tk) * (1 if act else 2)),
              (rows_map, tm * 4 * row_scales if act else 0), (q_map, tk * tn * vbits // 8),
              (s_map, (tk // group if group < tk else k // group) * tn * 2)]
    copied, last, out_last, written = [0] * len(blocks), {}, None, 0
    for ni in range(n // tn):
        for v in range(int(meta[2][0])):  # the grid's visit dimension: the real visits
            for ki in range(nk):
                for j, (index, size) in enumerate(blocks):
                    if last.get(j) != (i := tuple(int(x) for x in index(ni, v, ki, *meta))):
                        copied[j], last[j] = copied[j] + size, i
                if (o := tuple(int(x) for x in out_map(ni, v, ki, *meta))) != out_last:
                    written, out_last = written + tm * tn * 2, o
    return copied, written


@pytest.mark.parametrize("resident,tk,sizes", [(False, 128, [20, 10]), (True, 128, [20, 10]),
                                               (False, 512, [20, 10]), (False, 128, [0, 0])])
def test_visits_past_every_group_copy_no_input_blocks(resident, tk, sizes):
    """Rows past every group (the sentinel group's m tiles, which the kernel only zeroes: under expert
    parallelism, the rows of other devices' experts) cost their output and nothing else. Walking the grid
    (`_grid_walk`): 96 rows of which the groups hold 30 (or none) copy exactly the input blocks that 32 rows
    holding the same groups copy, with several k tiles too (a sentinel visit stays on the k tile and m
    tile the last grouped visit ended on), and write two more output tiles an n tile."""
    k, n, tm, tn = 512, 384, 32, 128
    tiles = Tiles(tm=tm, tk=tk, tn=tn, predot=False, lhs_resident=resident, vmem_bytes=0, vmem_limit=0)
    wide, wide_out = _grid_walk(sizes, 96, k, n, tiles, "int4", 128)
    narrow, narrow_out = _grid_walk(sizes, 32, k, n, tiles, "int4", 128)
    assert wide == narrow and wide_out == narrow_out + 2 * (n // tn) * tm * tn * 2, (wide, narrow)


@pytest.mark.slow
@pytest.mark.parametrize("chip", ["v5e", "v6e", "v7x"])
def test_8bit_activations_compile_to_the_chips_mxu_type(chip):
    """Deviceless compiles of W8A8 (int8 channel, Llama-3-8B down_proj [14336, 4096]), W4A8 experts (int4
    g128, Qwen3-30B-A3B down [768, 2048] x 128), FP8_DYNAMIC (fp8 channel, the down_proj) and FP8_BLOCK (fp8
    128 x 128 blocks, rows with a scale per 128 inputs) at 2048 rows:
    the kernel's dot is int8 x int8 -> int32 on v5e and v6e and bf16 x bf16 -> float32 on v7x (no int8 MXU); fp8 x
    fp8 -> float32 on v7x and bf16 on v6e (fp8 at the bf16 rate); Mosaic accepts it, the compiled program
    declares the call's FLOPs under that MXU type (what `plan` counts), and nothing weight-sized is a
    temporary."""
    from quantkit.plan import _mxu_flops
    from quantkit.runtime.aot import compile_for

    for act, qtype, k, n, g, group in [("int8", "int8", 14336, 4096, 1, 14336), ("int8", "int4", 768, 2048, 128, 128),
                                       ("fp8", "fp8", 14336, 4096, 1, 14336), ("fp8_g128", "fp8", 14336, 4096, 1, 128)]:
        _, rhs, gs = _abstract(qtype, g, k, n, group, 2048)
        rhs = dataclasses.replace(rhs, act=act)
        codes = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[act.split("_g")[0]]
        lhs = jax.ShapeDtypeStruct((2048, k), codes)
        rows = jax.ShapeDtypeStruct((2048, k // 128 if act == "fp8_g128" else 1), jnp.bfloat16)
        call = lambda a, b, c, r: gmm_v2(a, b, c, row_scales=r, chip=chip)  # noqa: E731
        mxu = {("v5e", "int8"): "int8", ("v6e", "int8"): "int8", ("v7x", "fp8"): "fp8"}.get(
            (chip, act.split("_g")[0]), "bf16")
        expected = {"int8": ("int8", "int8", "int32"), "fp8": ("float8_e4m3fn", "float8_e4m3fn", "float32"),
                    "bf16": ("bfloat16", "bfloat16", "float32")}[mxu]
        assert set(_dots(jax.make_jaxpr(call)(lhs, rhs, gs, rows).jaxpr)) == {expected}, (chip, qtype)
        compiled, _ = compile_for(chip, call, lhs, rhs, gs, rows, pinned=(1,))
        flops = _mxu_flops(compiled.as_text())
        assert flops[mxu] >= 2 * 2048 * k * n and sum(flops.values()) == flops[mxu], (chip, act, flops)
        assert compiled.memory_analysis().temp_size_in_bytes < max(1 << 20, g * k * n // 16)
