"""The quantized matmuls of the runtime: gmm_v2 on TPU when it can serve the shape, the XLA path otherwise."""

from __future__ import annotations

import contextlib
import contextvars
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from quantkit.formats.compressed_tensors import activation_group
from quantkit.kernels.dispatch import row_codes
from quantkit.kernels.tiling import CHIPS
from quantkit.kernels.xla import gmm_xla
from quantkit.quant.qtensor import QTensor

FP8_MAX = 448.0  # e4m3's largest value


# Set only inside `interpreted_tpu_kernels` (tests): trace the TPU path, kernels in Pallas interpret mode.
_INTERPRETED = contextvars.ContextVar("quantkit_interpreted_tpu_kernels", default=None)


@contextlib.contextmanager
def interpreted_tpu_kernels(chip: str = "v6e"):
    """Within this context, steps traced on any backend take the TPU code path (gmm_v2, the paged-attention
    kernel) with the kernels run in Pallas interpret mode: the TPU program run, not only compiled, on a CPU."""
    token = _INTERPRETED.set(chip)
    try:
        yield
    finally:
        _INTERPRETED.reset(token)


def interpreted_chip() -> str | None:
    """The chip of the enclosing `interpreted_tpu_kernels`, or None."""
    return _INTERPRETED.get()


def interpret():
    """The `interpret` argument for Pallas calls: InterpretParams inside `interpreted_tpu_kernels`, else False."""
    if _INTERPRETED.get() is None:
        return False
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams()


# device_kind of each TPU generation kernels/tiling.py has facts for (spelled as jax's pallas tpu_info does;
# lower case). TPU7 and TPU7x share their facts there.
DEVICE_KINDS = {"tpu v5 lite": "v5e", "tpu v5e": "v5e", "tpu v6 lite": "v6e", "tpu v6e": "v6e",
                "tpu7x": "v7x", "tpu7": "v7x", "tpu v7x": "v7x", "tpu v7": "v7x"}


def chip_of(device_kind: str) -> str | None:
    """The CHIPS key of a TPU's device_kind, or None, with a warning, for a generation without facts here
    (TPU v4, v5p, unknown ones): their VMEM differs from every known chip's (v4 has 16 MiB, less than any),
    so no known chip's tiles are safe there; None sends the runtime to the XLA path, correct on any TPU."""
    chip = DEVICE_KINDS.get(" ".join(device_kind.lower().split()))
    if chip is None:
        warnings.warn(f"no kernel facts for {device_kind!r} (known: v5e, v6e, v7x): using the XLA path, "
                      "not the Pallas kernels", stacklevel=2)
    return chip


def tpu_chip() -> str | None:
    """The TPU generation being traced for: the default device's (set by `with jax.default_device(...)`
    for deviceless compilation in `plan`), else the backend's; None off TPU (unless interpreted) and on a
    TPU generation without facts here (`chip_of`)."""
    if _INTERPRETED.get() is not None:
        return _INTERPRETED.get()
    dev = jax.config.jax_default_device
    dev = dev if isinstance(dev, jax.Device) else (jax.devices()[0] if jax.default_backend() == "tpu" else None)
    if dev is None or dev.platform != "tpu":
        return None
    return chip_of(dev.device_kind)


def _in_stored_order(x: jax.Array, w: QTensor, group_sizes: jax.Array, group_offset) -> jax.Array:
    """x's columns gathered into w's stored row order (activation-ordered groups: QTensor.perm): one gather of
    the [m, k] activations per call, by the one order of a dense layer or by each row's group's (experts); no
    weight-sized temporary. Under tensor parallelism it runs on the global x, before the per-shard matmul
    (a row-parallel layer's order crosses shards)."""
    perm = _per_row(w.perm, group_sizes, group_offset, x.shape[0])
    return jnp.take(x, perm[0], axis=1) if perm.shape[0] == 1 else jnp.take_along_axis(x, perm, axis=1)


def _per_row(a: jax.Array, group_sizes: jax.Array, group_offset, m: int) -> jax.Array:
    """A per-group array a [G, ...] of a QTensor, as this call's groups give it to its m rows sorted by group:
    [1, ...] when the call has one group, else [m, ...] (row i: its group's)."""
    g = group_sizes.shape[0]
    off = jnp.zeros((), jnp.int32) if group_offset is None else jnp.asarray(group_offset, jnp.int32)
    a = jax.lax.dynamic_slice_in_dim(a, off, g)  # this call's groups
    if g == 1:
        return a
    row_group = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")
    return a[jnp.minimum(row_group, g - 1)]


def rotate(x: jax.Array, rot: jax.Array) -> jax.Array:
    """x [m, k] times the block-diagonal matrix of rot [1 or m, h, h] (+-1; one per row: its group's) over
    its k // h blocks, divided by sqrt(h): compressed-tensors' online Hadamard transform, in float32 as it
    computes it, rounded back to x's dtype."""
    m, k = x.shape
    h = rot.shape[-1]
    xb, r = x.astype(jnp.float32).reshape(m, k // h, h), rot.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    y = jnp.einsum("mbh,hj->mbj", xb, r[0], precision=hi) if r.shape[0] == 1 else \
        jnp.einsum("mbh,mhj->mbj", xb, r, precision=hi)
    return _divide(y, jnp.asarray(float(np.sqrt(h)), jnp.float32)).reshape(m, k).astype(x.dtype)


def quantize_rows(x: jax.Array, act: str = "int8") -> tuple[jax.Array, jax.Array]:
    """Dynamic symmetric per-token (or per group of N inputs: "fp8_g<N>") quantization (QTensor.act), in x's
    dtype as compressed-tensors computes it: scale = the row's (group's) absmax / half the type's range (int8:
    127.5, fp8 e4m3: 448; 0 -> the dtype's eps), codes = x / scale clipped to the type's range, then rounded
    to it (int8: half to even; fp8: the cast). Returns (codes [m, k] int8 or float8_e4m3fn, scales [m, k / N]
    in x.dtype, [m, 1] per token); codes times their scale is the library's fake-quantized x."""
    m, k = x.shape
    half, lo, hi = (127.5, -128, 127) if act == "int8" else (FP8_MAX, -FP8_MAX, FP8_MAX)
    # per token on [m, k] itself: a [m, 1, k] view had XLA on a TPU materialize the scales broadcast over it
    # (2048 x 14336 of the down projection's input: 173 us a layer of a W8A8 prefill on a v5e)
    g = x.reshape(m, -1, activation_group(act)) if activation_group(act) else x
    scale = _divide(jnp.max(jnp.abs(g), axis=-1, keepdims=True), jnp.asarray(half, x.dtype))
    scale = jnp.where(scale == 0, jnp.asarray(jnp.finfo(x.dtype).eps, x.dtype), scale)
    y = jnp.clip(_divide(g, scale), lo, hi).reshape(m, k)
    return (jnp.round(y).astype(jnp.int8) if act == "int8" else y.astype(jnp.float8_e4m3fn)), scale.reshape(m, -1)


def fake_quantize_groups(x: jax.Array, act: str, gscale: jax.Array | None = None) -> jax.Array:
    """Dynamic symmetric per-group quantize-dequantize of x [m, k] along its rows (QTensor.act "mxfp4",
    "mxfp8": groups of 32 with an E8M0 scale; "fp8_g<N>": groups of N with a float scale; "nvfp4": groups of
    16 with an fp8 scale relative to `gscale`, the input global scale of each row's module [1 or m]), in
    x's dtype as compressed-tensors computes it: the group's absmax -> scale (MX: the absmax rounded to a power
    of two, up only from mantissa 1.75, over the element type's largest power, 2 for e2m1 and 256 for e4m3;
    fp8: absmax / 448, 0 -> the dtype's eps; nvfp4: float32(absmax / 6) * gscale rounded to e4m3, 0 -> 0.125,
    then / gscale, all in float32), x / scale clipped to the type's range and rounded to it (e4m3: the cast;
    e2m1: nearest, ties to even), times the scale (nvfp4: in float32, rounded to x's dtype at the end). No
    MXU multiplies these types: the result is multiplied in the activations' dtype by the weights' own path."""
    m, k = x.shape
    group = activation_group(act)
    g = x.reshape(m, k // group, group)
    absmax = jnp.max(jnp.abs(g), axis=2, keepdims=True)
    fp4 = act in ("mxfp4", "nvfp4")
    if act == "nvfp4":
        gscale = gscale.astype(jnp.float32)[:, None, None]  # [1 or m, 1, 1]
        scale = _divide(absmax, jnp.asarray(6.0, x.dtype)).astype(jnp.float32) * gscale
        scale = jnp.clip(scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
        scale = _divide(jnp.where(scale == 0, 0.125, scale), gscale)
        y = _round_e2m1(jnp.clip(_divide(g.astype(jnp.float32), scale), -6.0, 6.0))
        return (y * scale).astype(x.dtype).reshape(m, k)
    if act.startswith("mx"):  # the library's generate_mx_scales, on the bits of x's dtype
        bits = jnp.dtype(x.dtype).itemsize * 8
        mant = jnp.finfo(x.dtype).nmant
        uint = {16: jnp.uint16, 32: jnp.uint32}[bits]
        u = jax.lax.bitcast_convert_type(absmax, uint)
        mask = jnp.asarray(((1 << (bits - mant)) - 1) << mant, uint)  # sign and exponent: the mantissa rounded away
        p2 = jax.lax.bitcast_convert_type((u + jnp.asarray(1 << (mant - 2), uint)) & mask, x.dtype)
        p2 = p2.astype(jnp.float32)
        e = jnp.clip(jnp.floor(jnp.log2(p2)) - (2 if fp4 else 8), -127, 127).astype(jnp.int32)
        # 2**e exactly, from its float32 bits (2**-127 is the subnormal 2**-23 * 2**-104)
        scale = jax.lax.bitcast_convert_type(jnp.where(e > -127, (e + 127) << 23, 1 << 22), jnp.float32)
        # an all-zero group: 2**-127, which a chip that flushes subnormals (XLA:CPU, TPU) reads as 0, so 1
        # here (the group stays zero either way)
        scale = jnp.where(absmax == 0, 1.0, scale).astype(x.dtype)
    else:  # fp8 per group: quantize_rows's codes times their scales
        codes, scale = quantize_rows(x, act)
        return (codes.astype(x.dtype).reshape(m, k // group, group) * scale[..., None]).reshape(m, k)
    top = 6.0 if fp4 else FP8_MAX
    y = jnp.clip(_divide(g, scale), -top, top)
    y = _round_e2m1(y) if fp4 else y.astype(jnp.float8_e4m3fn).astype(x.dtype)
    return (y * scale).reshape(m, k)


def _round_e2m1(y: jax.Array) -> jax.Array:
    """Values in [-6, 6] rounded to the nearest e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6), ties to the even
    code, sign kept: the steps between neighbours, each taken past its midpoint (at an odd code's midpoint
    only beyond it)."""
    a = jnp.abs(y)
    steps = ((a > 0.25) * 0.5 + (a >= 0.75) * 0.5 + (a > 1.25) * 0.5 + (a >= 1.75) * 0.5 + (a > 2.5) * 1.0
             + (a >= 3.5) * 1.0 + (a > 5.0) * 2.0)
    return jnp.copysign(steps.astype(y.dtype), y)


def _divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """a / b rounded once, as torch divides: XLA turns a division by a broadcast value into a product with its
    reciprocal (a last-bit difference that moves codes across rounding ties); a divisor materialized at a's
    shape behind an optimization barrier is divided element by element."""
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(b, a.shape))


def grouped_matmul(x: jax.Array, w: QTensor, group_sizes: jax.Array, group_offset=None,
                   up: QTensor | None = None, gate: str = "") -> jax.Array:
    """x [m, k] rows sorted by group, w [G, k, n], groups group_offset .. + len(group_sizes) - 1 -> [m, n].
    Activations are put in w's stored row order (QTensor.perm) and quantized (QTensor.act) here, on the whole
    rows: before a tensor-parallel split, whose shards see only some columns.
    With `up` (a weight like w) and `gate` (a gmm_v2.GATES key): GATES[gate](x @ w) * (x @ up), an MLP's
    gate and up projections, in one gmm_v2 call where the two pair (gmm_v2.pairs) and it serves them."""
    from quantkit.kernels.gmm_v2 import GATES, pairs

    if up is not None and (not pairs(w, up) or w.split == "k"):  # the gate needs whole sums: not k-split ones
        return GATES[gate](grouped_matmul(x, w, group_sizes, group_offset)) * grouped_matmul(
            x, up, group_sizes, group_offset)
    if w.rot is not None:
        x = rotate(x, _per_row(w.rot, group_sizes, group_offset, x.shape[0]))
    if w.perm is not None:
        x = _in_stored_order(x, w, group_sizes, group_offset)
    gscale = None if w.act_gscale is None else _per_row(w.act_gscale, group_sizes, group_offset, x.shape[0])
    w = w.with_arrays({f: a for f, a in w.arrays.items() if f not in ("rot", "perm", "act_gscale")})
    if row_codes(w.act, w.qtype):  # codes and their row (group) scales for the MXU
        x = quantize_rows(x, w.act)
    elif w.act:  # group-quantized activations: exact values, then the weights' own path
        x, w = fake_quantize_groups(x, w.act, gscale), w.with_arrays(w.arrays, act="")
        up = up if up is None else up.with_arrays(up.arrays, act="")
    if w.mesh is not None:
        return _per_shard(x, w, group_sizes, group_offset, up, gate)
    return _local(x, w, group_sizes, group_offset, up, gate)


def _local(x, w: QTensor, group_sizes: jax.Array, group_offset, up: QTensor | None = None, gate: str = ""
           ) -> jax.Array:
    """One device's matmul (or gated pair: grouped_matmul): gmm_v2 where it serves the call, else the XLA
    path; x is an array, or the pair (8-bit codes, row scales in the activations' dtype) of quantize_rows (the
    XLA path multiplies them back: the library's fake-quantized activations, then the weights' own path)."""
    codes, rows = x if isinstance(x, tuple) else (x, None)
    chip = tpu_chip()
    if chip is not None:
        from quantkit.kernels.gmm_v2 import check_gmm_v2, gmm_v2

        tiles, _ = check_gmm_v2(codes.shape, w, CHIPS[chip], group_sizes.shape[0], up is not None)
        if tiles is not None:
            return gmm_v2(codes, w, group_sizes, group_offset, row_scales=rows, chip=chip, tiles=tiles,
                          interpret=interpret(), up=up, gate=gate)
    if up is not None:  # two calls: on the XLA path, or where gmm_v2 cannot tile the pair
        from quantkit.kernels.gmm_v2 import GATES

        return GATES[gate](_local(x, w, group_sizes, group_offset)) * _local(x, up, group_sizes, group_offset)
    if rows is not None:  # the library's fake-quantized rows
        codes = codes.astype(rows.dtype) * jnp.repeat(rows, codes.shape[1] // rows.shape[1], axis=1)
    return gmm_xla(codes, w, group_sizes, group_offset)


def _per_shard(x, w: QTensor, group_sizes: jax.Array, group_offset, up: QTensor | None = None, gate: str = ""
               ) -> jax.Array:
    """A tensor-parallel weight (runtime/sharding.py): each device multiplies by its own shard under
    shard_map, since XLA cannot partition a Mosaic kernel by itself. Split "n": each device computes its
    output columns; split "k": each its input rows' partial product, summed across devices."""
    from jax.sharding import PartitionSpec as P

    ax, k_split = "model", w.split == "k"
    spec = {"n": P(None, None, ax), "k": P(None, ax, None), "": P()}[w.split]
    channel = w.group == w.shape[1]  # one scale row: replicated when the rows are split, and spans a shard
    offset = jnp.zeros((), jnp.int32) if group_offset is None else jnp.asarray(group_offset, jnp.int32)

    pair = (w,) if up is None else (w, up)

    def body(x, arrays, sizes, off):
        mine = [a.with_arrays(b, group=b["values"].shape[1] if channel else w.group, mesh=None, split="")
                for a, b in zip(pair, arrays)] + [None]
        y = _local(x, mine[0], sizes, off, mine[1], gate)
        return jax.lax.psum(y, ax) if k_split else y

    rows = P() if channel and k_split else spec  # scales and zero points
    xspec = P(None, ax) if k_split else P()
    # per-group row scales [m, k / N] are split with the columns they scale
    xspecs = (xspec, xspec if x[1].shape[1] > 1 else P()) if isinstance(x, tuple) else xspec
    return jax.shard_map(body, mesh=w.mesh, in_specs=(xspecs, [a.per_array(spec, rows, P()) for a in pair], P(), P()),
                         out_specs=P(None, ax) if w.split == "n" else P(), check_vma=False)(
        x, [a.arrays for a in pair], group_sizes, offset)


def dense_as_qtensor(params: dict, cfg, mesh=None, ep: bool = False) -> dict:
    """`params` with each layer stack's dense bf16 linear weights [layers, in, out] (q, k, v, o, the dense MLP,
    Gated DeltaNet's projections: runtime/layout.py Slots of kind "linear") as QTensors of the DENSE type, unit
    channel scales, on `mesh` as runtime/sharding.py places them: the TPU step then reads them through gmm_v2,
    each layer's tiles straight from the stack, as it reads quantized ones. Left to XLA, a dense weight that
    fits VMEM is staged there whole before its dot (a copy every step, which XLA's count sees three times)."""
    from quantkit.quant.qtensor import DENSE
    from quantkit.runtime.layout import skeleton
    from quantkit.runtime.sharding import AXIS, split_of

    tp = 1 if mesh is None else mesh.shape[AXIS]

    def wrap(kind: str, key: str, w):
        if not isinstance(w, jax.Array) or w.ndim != 3 or w.dtype != jnp.bfloat16:  # (QTensors, unrolled tuples)
            return w
        split = split_of(key, cfg, tp, kind, ep) if mesh is not None else ""
        return QTensor(w, jnp.ones((w.shape[0], 1, w.shape[2]), jnp.bfloat16), DENSE, w.shape[1],
                       mesh=mesh, split=split)

    slots = skeleton(cfg)["layers"]
    linear = {kind: {key for key, s in slots[kind].items() if s.module[0].kind == "linear"} for kind in slots}
    return {**params, "layers": {kind: {key: wrap(kind, key, w) if key in linear.get(kind, ()) else w
                                        for key, w in stack.items()} for kind, stack in params["layers"].items()}}


def qmatmul(x: jax.Array, w: QTensor, layer=None) -> jax.Array:
    """x [m, k] @ one group of w [G, k, n] (group `layer` of a stacked weight, default 0) -> [m, n]."""
    return grouped_matmul(x, w, jnp.full((1,), x.shape[0], jnp.int32), layer)
