"""gdn_decode and conv_decode: one token of a Gated DeltaNet layer's recurrence and of its causal conv for
every row of a decode step, each row's state read once from its slot of the stacked state cache and
written back in place.

For row r (one token; runtime/models/gdn.py has the layer and its pure-JAX recurrence, the reference):
  S = 0 if fresh[r] else state[layer, slot[r]]          [Hv, dk, dv] float32
  S = exp(g) S;  d = beta (v - S^T k);  S = S + k d^T;  o = S^T q
rows with valid[r] = 0 (padding) leave their slot as it was and output zeros.

conv_decode, for row r (x its token's conv input [C], w the layer's conv weights [K, C]):
  c = 0 if fresh[r] else conv[layer, slot[r]]           [1, (K - 1) * C] float32: the previous K - 1 inputs
  y = silu(sum_j (c ++ x)[j] w[j]);  conv[layer, slot[r]] = the last K - 1 of (c ++ x)

Grid (rows,): a step DMAs row r's whole state [Hv, dk, dv] (2 MiB for Qwen3.5-35B-A3B, 4 MiB for the 397B)
into VMEM by its slot (scalar prefetch), updates it on the vector unit in float32 (elementwise products and
sums: the same operations the reference's HIGHEST-precision einsums compute, in another order) and writes
it back to the same place: the output aliases the state cache (`input_output_aliases`), so no other state
buffer exists. Sequential ("arbitrary"): padding rows share the scratch slot.

File order (docs/architecture.md, rule 5): validation -> cost estimate -> pallas_call -> one jitted public entry.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# ---- validation -----------------------------------------------------------------------------------


def vmem_bytes(hv: int, dk: int, dv: int) -> int:
    """VMEM of one grid step: the state block in and out, double-buffered, and two float32 temporaries of
    its size (the decayed and the updated state), plus the row's small blocks."""
    state = hv * dk * dv * 4
    return 6 * state + 8 * hv * (2 * dk + 2 * dv + 2) * 4


def conv_vmem_bytes(kk: int, c: int, rows: int, x_bytes: int) -> int:
    """VMEM of one conv_decode step: the state block in and out, the weights and the block of `rows` rows of
    input and (float32) output, double-buffered, the input's float32 copy, and the float32 window."""
    return 2 * ((2 * (kk - 1) + kk) * c * 4 + rows * c * (x_bytes + 4)) + rows * c * 4 + kk * c * 4


# ---- cost estimate ---------------------------------------------------------------------------------

def cost(rows: int, hv: int, dk: int, dv: int) -> pl.CostEstimate:
    """Every row's state read and written once (padding rows too: a static bound), its q, k [Hv, dk], v
    and o [Hv, dv], g and beta [Hv] (float32) once; per state element a decay, two products into the
    sums S^T k and S^T q, and the rank-one update (6 FLOPs); one exp a head."""
    state = hv * dk * dv * 4
    io = (2 * hv * dk + 2 * hv * dv + 2 * hv) * 4
    return pl.CostEstimate(flops=6 * rows * hv * dk * dv, transcendentals=rows * hv,
                           bytes_accessed=rows * (2 * state + io) + 4 * (3 * rows + 1))


def conv_cost(rows: int, kk: int, c: int, x_bytes: int) -> pl.CostEstimate:
    """Every row's conv state [K - 1, C] (float32) read and written once (padding rows too), its input [C]
    and float32 output once, the weights [K, C] once; per channel K products and sums and a SiLU (one exp)."""
    return pl.CostEstimate(flops=(2 * kk + 2) * rows * c, transcendentals=rows * c,
                           bytes_accessed=rows * (2 * (kk - 1) * c * 4 + c * (x_bytes + 4)) + kk * c * 4
                           + 4 * (3 * rows + 1))


# ---- the kernels ------------------------------------------------------------------------------------

def _kernel(layer_ref, slot_ref, fresh_ref, valid_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref,
            o_ref, s_out_ref):
    del layer_ref, slot_ref  # (the index maps use them)
    r = pl.program_id(0)
    q, k, v = q_ref[0], k_ref[0], v_ref[0]  # [Hv, dk], [Hv, dk], [Hv, dv]
    g, beta = g_ref[0], beta_ref[0]  # [Hv, 1]

    @pl.when(valid_ref[r] == 0)
    def _():
        s_out_ref[...] = s_ref[...]
        o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(valid_ref[r] != 0)
    def _():
        s = jnp.where(fresh_ref[r] != 0, 0.0, s_ref[...]) * jnp.exp(g)[:, :, None]  # [Hv, dk, dv]
        d = beta * (v - jnp.sum(k[:, :, None] * s, axis=1))  # [Hv, dv]
        s = s + k[:, :, None] * d[:, None, :]
        s_out_ref[...] = s
        o_ref[0] = jnp.sum(q[:, :, None] * s, axis=1)


def _conv_kernel(layer_ref, slot_ref, fresh_ref, valid_ref, x_ref, w_ref, c_ref, y_ref, c_out_ref, xs_ref):
    del layer_ref, slot_ref  # (the index maps use them)
    r = pl.program_id(0)
    kk, c = w_ref.shape
    i = r % x_ref.shape[0]  # row r's place in its block of x and y

    @pl.when(i == 0)
    def _():  # the block's rows in float32, whose single rows can be read at a dynamic index
        xs_ref[...] = x_ref[...].astype(jnp.float32)

    @pl.when(valid_ref[r] == 0)
    def _():
        c_out_ref[...] = c_ref[...]
        y_ref[pl.ds(i, 1), :] = jnp.zeros((1, c), y_ref.dtype)

    @pl.when(valid_ref[r] != 0)
    def _():
        x = xs_ref[pl.ds(i, 1), :]  # [1, C]
        prev = jnp.where(fresh_ref[r] != 0, 0.0, c_ref[...])  # [1, (K - 1) * C], oldest input first
        w = w_ref[...].astype(jnp.float32)  # [K, C]
        acc = x * w[kk - 1:]  # the newest input first, then one further back at a time
        for m in range(1, kk):
            acc = acc + prev[:, (kk - 1 - m) * c:(kk - m) * c] * w[kk - 1 - m:kk - m]
        y_ref[pl.ds(i, 1), :] = jax.nn.silu(acc).astype(x_ref.dtype).astype(jnp.float32)
        if kk > 2:
            c_out_ref[:, :(kk - 2) * c] = prev[:, c:]
        c_out_ref[:, (kk - 2) * c:] = x


# ---- pallas_call -------------------------------------------------------------------------------------

def _call(q, k, v, g, beta, state, layer, slot, fresh, valid, interpret):
    t, hv, dk = q.shape
    dv = v.shape[-1]
    row = lambda r, *_: (r, 0, 0)  # noqa: E731
    at = lambda r, layer, slot, *_: (layer[0], slot[r], 0, 0, 0)  # noqa: E731
    state_spec = pl.BlockSpec((None, None, hv, dk, dv), at)
    limit = min(64 << 20, max(32 << 20, 2 * vmem_bytes(hv, dk, dv)))
    return pl.pallas_call(
        _kernel,
        out_shape=(jax.ShapeDtypeStruct((t, hv, dv), jnp.float32), jax.ShapeDtypeStruct(state.shape, state.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(t,),
            in_specs=[pl.BlockSpec((1, hv, dk), row), pl.BlockSpec((1, hv, dk), row), pl.BlockSpec((1, hv, dv), row),
                      pl.BlockSpec((1, hv, 1), row), pl.BlockSpec((1, hv, 1), row), state_spec],
            out_specs=[pl.BlockSpec((1, hv, dv), row), state_spec]),
        input_output_aliases={9: 1},  # the state cache (operand 9, after the 4 scalar prefetch arrays) in place
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=limit),
        cost_estimate=cost(t, hv, dk, dv),
        name="gdn_decode",
        interpret=interpret,
    )(layer, slot, fresh, valid, q, k, v, g[..., None], beta[..., None], state)


def _conv_call(x, w, conv, layer, slot, fresh, valid, interpret):
    t, c = x.shape
    kk = w.shape[0]
    # x and y in blocks of a native tile of rows, step r reading and writing row r % rows (y float32, and x
    # read through a float32 copy: Mosaic loads and stores no single bfloat16 row at a dynamic index)
    rows = min(t, 8 * 4 // x.dtype.itemsize)
    row = lambda r, *_: (r // rows, 0)  # noqa: E731
    at = lambda r, layer, slot, *_: (layer[0], slot[r], 0, 0)  # noqa: E731
    state_spec = pl.BlockSpec((None, None, 1, (kk - 1) * c), at)
    limit = min(64 << 20, max(32 << 20, 2 * conv_vmem_bytes(kk, c, rows, x.dtype.itemsize)))
    y, conv = pl.pallas_call(
        _conv_kernel,
        out_shape=(jax.ShapeDtypeStruct((t, c), jnp.float32), jax.ShapeDtypeStruct(conv.shape, conv.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(t,),
            in_specs=[pl.BlockSpec((rows, c), row), pl.BlockSpec((kk, c), lambda *_: (0, 0)), state_spec],
            out_specs=[pl.BlockSpec((rows, c), row), state_spec],
            scratch_shapes=[pltpu.VMEM((rows, c), jnp.float32)]),
        input_output_aliases={6: 1},  # the conv state cache (operand 6, after the 4 scalar prefetch arrays)
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=limit),
        cost_estimate=conv_cost(t, kk, c, x.dtype.itemsize),
        name="conv_decode",
        interpret=interpret,
    )(layer, slot, fresh, valid, x, w, conv)
    return y, conv


# ---- public entries --------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("state",))
def gdn_decode(q, k, v, g, beta, state, layer, slot, fresh, valid, *, interpret=False):
    """One recurrence step per row, in place.

    Args:
        q, k: [T, Hv, dk] float32 (q already scaled, both L2-normalised); v [T, Hv, dv]; g, beta [T, Hv].
        state: the stacked recurrent states [layers, slots, Hv, dk, dv] float32 (donated: updated in place).
        layer: int32 scalar, the layer; slot [T] int32, each row's slot; fresh [T] (nonzero: start from
            zeros), valid [T] (zero: a padding row, its slot untouched).
        interpret: Pallas interpret mode (CPU), e.g. `pltpu.InterpretParams()`.
    Returns:
        (o [T, Hv, dv] float32, the state cache with every valid row's slot updated).
    """
    as32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    return _call(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), g.astype(jnp.float32),
                 beta.astype(jnp.float32), state, as32(layer).reshape(1), as32(slot), as32(fresh), as32(valid),
                 interpret)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("conv",))
def conv_decode(x, w, conv, layer, slot, fresh, valid, *, interpret=False):
    """One step of the depthwise causal conv + SiLU per row, its conv state updated in place.

    Args:
        x: [T, C], each row's token's conv input (the qkv projection); w: the layer's weights [K, C].
        conv: the stacked conv states [layers, slots, 1, (K - 1) * C] float32, oldest input first (donated:
            updated in place); layer, slot, fresh, valid: as gdn_decode's.
    Returns:
        (y [T, C] float32, rounded to x's dtype as the layer's XLA path rounds it, zeros for padding rows;
        the conv cache with every valid row's slot updated).
    """
    as32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    return _conv_call(x, w.astype(jnp.float32), conv, as32(layer).reshape(1), as32(slot), as32(fresh),
                      as32(valid), interpret)
