"""gdn_decode: one token of the Gated DeltaNet recurrence for every row of a decode step, each row's state
read once from its slot of the stacked state cache and written back in place.

For row r (one token; runtime/models/gdn.py has the layer and its pure-JAX recurrence, the reference):
  S = 0 if fresh[r] else state[layer, slot[r]]          [Hv, dk, dv] float32
  S = exp(g) S;  d = beta (v - S^T k);  S = S + k d^T;  o = S^T q
rows with valid[r] = 0 (padding) leave their slot as it was and output zeros.

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


# ---- cost estimate ---------------------------------------------------------------------------------

def cost(rows: int, hv: int, dk: int, dv: int) -> pl.CostEstimate:
    """Every row's state read and written once (padding rows too: a static bound), its q, k [Hv, dk], v
    and o [Hv, dv], g and beta [Hv] (float32) once; per state element a decay, two products into the
    sums S^T k and S^T q, and the rank-one update (6 FLOPs); one exp a head."""
    state = hv * dk * dv * 4
    io = (2 * hv * dk + 2 * hv * dv + 2 * hv) * 4
    return pl.CostEstimate(flops=6 * rows * hv * dk * dv, transcendentals=rows * hv,
                           bytes_accessed=rows * (2 * state + io) + 4 * (3 * rows + 1))


# ---- the kernel -------------------------------------------------------------------------------------

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


# ---- public entry ----------------------------------------------------------------------------------

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
