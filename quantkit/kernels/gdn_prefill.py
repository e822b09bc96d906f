"""gdn_prefill: the Gated DeltaNet recurrence over the prompt chunks (and any other rows) of a step, by the
chunked delta rule, each row's state carried in VMEM from chunk to chunk, read once from its slot of the
stacked state cache and written back in place.

For each row, its tokens in chunks of C (runtime/models/gdn.py `delta_rule_chunk` is the reference, and its
docstring the math): with G the cumulative log decay within the chunk,
  A = (beta k k^T) o exp(G_t - G_u) for u < t;  (I + A) [u | w] = [beta v | beta k exp(G)]
  v' = u - w S;  o = (q exp(G)) S + ((q k^T) o exp(G_t - G_u), u <= t) v';  S = exp(G_C) S + (k exp(G_C - G))^T v'
the solve by the product (I - A)(I + A^2)(I + A^4)... (A is nilpotent), matmuls only, all float32.

Layout: the wrapper lists the step's chunks row after row (a row of n tokens has ceil(n / C) of them, so
there are at most T / C + rows), gathers each chunk's q, k, v [C, d], cumulative decay (as a column and as a
row) and beta into [chunks, Hv, C, ...] (padding tokens zero: they change nothing), and scatters the outputs
back to the step's tokens. Grid (Hv, chunks), sequential: a chunk's state block is its row's slot of layer
`layer` (scalar prefetch), so a row's chunks share one block, DMA'd in at its first chunk and written back
after its last (the output aliases the state cache: no other state buffer exists); the state itself passes
from chunk to chunk in a VMEM scratch. Chunks past the step's last are padding on the scratch slot.

File order (docs/architecture.md, rule 5): validation -> cost estimate -> pallas_call -> one jitted public entry.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

CHUNK = 64  # tokens a chunk, as runtime/models/gdn.py's CHUNK
HI = jax.lax.Precision.HIGHEST

# ---- validation -----------------------------------------------------------------------------------


def chunks_bound(t: int, rows: int, c: int) -> int:
    """The most chunks a step of t tokens over `rows` rows has: each row ceil(n / c), and sum(n) <= t."""
    return -(-t // c) + rows


def vmem_bytes(c: int, dk: int, dv: int) -> int:
    """VMEM of one grid step: the q, k, v, output and small blocks and the state block in and out,
    double-buffered, the carried state, and the chunk's float32 temporaries ([C, C] matrices and the [C,
    dv + dk] right-hand side a few times over)."""
    blocks = 2 * (c * (2 * dk + 2 * dv + 3 + c) + 2 * dk * dv) * 4
    return blocks + dk * dv * 4 + (6 * c * c + 4 * c * (dk + dv)) * 4


# ---- cost estimate ---------------------------------------------------------------------------------

def cost(chunks: int, rows: int, hv: int, c: int, dk: int, dv: int) -> pl.CostEstimate:
    """Each chunk's q, k, v, output (float32), cumulative decay twice and beta read or written once per
    head; each row's state read and written once per head (rows + 1 runs of chunks at most: the step's rows
    and the padding); FLOPs the matmuls execute per chunk and head (A, the solve's log2(C) pairs of
    products, v', q k^T, the output's two products, the state update) and one exp per [C, C] entry and per
    token."""
    io = chunks * hv * c * (2 * dk + 2 * dv + 3) * 4
    state = (rows + 1) * hv * 2 * dk * dv * 4
    steps = max(1, (c - 1).bit_length())
    per = (2 * c * c * dk + steps * (2 * c ** 3 + 2 * c * c * (dk + dv)) + 2 * c * dk * dv + 2 * c * c * dk
           + 2 * c * dk * dv + 2 * c * c * dv + 2 * c * dk * dv)
    return pl.CostEstimate(flops=chunks * hv * per, transcendentals=chunks * hv * (c * c + 2 * c),
                           bytes_accessed=io + state + 4 * 4 * chunks + 4)


# ---- the kernel -------------------------------------------------------------------------------------

def _kernel(layer_ref, slot_ref, start_ref, fresh_ref, valid_ref, q_ref, k_ref, v_ref, gc_ref, gr_ref, b_ref,
            s_ref, o_ref, s_out_ref, s_vmem):
    del layer_ref, slot_ref  # (the index maps use them)
    j = pl.program_id(1)
    c = q_ref.shape[0]

    @pl.when(start_ref[j] != 0)  # a row's first chunk: its state from the slot (zeros for a fresh row)
    def _():
        s_vmem[...] = jnp.where(fresh_ref[j] != 0, 0.0, s_ref[...])

    @pl.when(valid_ref[j] == 0)
    def _():
        s_out_ref[...] = s_ref[...]
        o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(valid_ref[j] != 0)
    def _():
        dot = functools.partial(jnp.dot, precision=HI, preferred_element_type=jnp.float32)
        nt = functools.partial(jax.lax.dot_general, dimension_numbers=(((1,), (1,)), ((), ())), precision=HI,
                               preferred_element_type=jnp.float32)  # x y^T
        q, k, v, beta = q_ref[...], k_ref[...], v_ref[...], b_ref[...]  # [C, dk], [C, dk], [C, dv], [C, 1]
        gc, gr = gc_ref[...], gr_ref[...]  # [C, 1], [1, C]: the cumulative log decay
        t = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
        u = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
        pair = jnp.where(t >= u, jnp.exp(jnp.where(t >= u, gc - gr, 0.0)), 0.0)  # exp(G_t - G_u), u <= t
        kb = k * beta
        p = -jnp.where(t > u, nt(kb, k) * pair, 0.0)  # -A
        x = jnp.concatenate([v * beta, kb * jnp.exp(gc)], axis=1)  # [C, dv + dk]
        for _ in range(max(1, (c - 1).bit_length())):  # x = (I - A)(I + A^2)(I + A^4)... rhs
            x, p = x + dot(p, x), dot(p, p)
        dv = v.shape[1]
        s = s_vmem[...]
        v_new = x[:, :dv] - dot(x[:, dv:], s)
        o_ref[...] = dot(q * jnp.exp(gc), s) + dot(nt(q, k) * pair, v_new)
        last = jnp.sum(jnp.where(u[:1] == c - 1, gr, 0.0), axis=1, keepdims=True)  # [1, 1]: G at the chunk's end
        kd = k * jnp.exp(last - gc)  # [C, dk]
        s = s * jnp.exp(last) + jax.lax.dot_general(kd, v_new, (((0,), (0,)), ((), ())), precision=HI,
                                                     preferred_element_type=jnp.float32)
        s_vmem[...] = s
        s_out_ref[...] = s


# ---- pallas_call -------------------------------------------------------------------------------------

def _call(q, k, v, gc, gr, beta, state, layer, slot, start, fresh, valid, rows, interpret):
    hv, nch, c, dk = q.shape
    dv = v.shape[-1]
    blk = lambda *shape: pl.BlockSpec((None, None, *shape), lambda h, j, *_: (h, j, 0, 0))  # noqa: E731
    at = lambda h, j, layer, slot, *_: (layer[0], slot[j], h, 0, 0)  # noqa: E731
    state_spec = pl.BlockSpec((None, None, None, dk, dv), at)
    limit = min(64 << 20, max(32 << 20, 2 * vmem_bytes(c, dk, dv)))
    return pl.pallas_call(
        _kernel,
        out_shape=(jax.ShapeDtypeStruct((hv, nch, c, dv), jnp.float32), jax.ShapeDtypeStruct(state.shape, state.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5, grid=(hv, nch),
            in_specs=[blk(c, dk), blk(c, dk), blk(c, dv), blk(c, 1), blk(1, c), blk(c, 1), state_spec],
            out_specs=[blk(c, dv), state_spec],
            scratch_shapes=[pltpu.VMEM((dk, dv), jnp.float32)]),
        input_output_aliases={11: 1},  # the state cache (operand 11, after the 5 scalar prefetch arrays) in place
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"),
                                             vmem_limit_bytes=limit),
        cost_estimate=cost(nch, rows, hv, c, dk, dv),
        name="gdn_prefill",
        interpret=interpret,
    )(layer, slot, start, fresh, valid, q, k, v, gc, gr, beta, state)


# ---- public entry ----------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("chunk", "interpret"), donate_argnames=("state",))
def gdn_prefill(q, k, v, g, beta, state, layer, slot, fresh, first, n, *, chunk=CHUNK, interpret=False):
    """The recurrence over every row's tokens, its state updated in place.

    Args:
        q, k: [T, Hv, dk] float32 (q already scaled, both L2-normalised); v [T, Hv, dv]; g, beta [T, Hv]: the
            step's tokens, row after row (padding tokens anywhere outside the rows).
        state: the stacked recurrent states [layers, slots, Hv, dk, dv] float32 (donated: updated in place).
        layer: int32 scalar; slot, fresh, first, n [rows]: each row's slot, whether it starts from zeros, its
            first token and its token count (0: a padding row, its slot untouched). The last slot is the
            padding rows' scratch.
        chunk: tokens a chunk (the step's T when smaller).
        interpret: Pallas interpret mode (CPU), e.g. `pltpu.InterpretParams()`.
    Returns:
        (o [T, Hv, dv] float32, zeros at padding tokens; the state cache with every row's slot updated).
    """
    t, hv, _ = q.shape
    rows, c = slot.shape[0], min(chunk, t)
    nch = chunks_bound(t, rows, c)
    sched = schedule(t, c, first, n)

    def take(a):  # [T, Hv, ...] -> [Hv, chunks, C, ...], head-major (a transpose of the step's tokens, then
        # the gather), padding tokens zero
        got = jnp.take(jnp.swapaxes(a.astype(jnp.float32), 0, 1), sched["idx"].reshape(-1), axis=1, mode="fill",
                       fill_value=0)
        return got.reshape(hv, nch, c, *a.shape[2:])

    gcum = jnp.cumsum(take(g), axis=-1)  # [Hv, chunks, C]
    row, valid = sched["row"], sched["valid"]
    as32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    o, state = _call(take(q), take(k), take(v), gcum[..., None], gcum[..., None, :], take(beta)[..., None], state,
                     as32(layer).reshape(1), as32(jnp.where(valid, slot[row], state.shape[1] - 1)),
                     as32(sched["start"]), as32(fresh[row] != 0), as32(valid), rows, interpret)
    o = jnp.take(o.reshape(hv, nch * c, -1), sched["at"], axis=1, mode="fill", fill_value=0)
    return jnp.swapaxes(o, 0, 1), state


def schedule(t: int, c: int, first: jax.Array, n: jax.Array) -> dict:
    """The chunks of a step of t tokens whose rows start at `first` with n tokens each (chunks_bound of them,
    row after row, then padding): per chunk its row, whether it is its row's first ("start") and a real
    one ("valid"), and its C token indices ("idx"; t: none); per token, its place in the chunks' [chunks *
    C] ("at"; chunks * C: none)."""
    rows = first.shape[0]
    nch = chunks_bound(t, rows, c)
    per = (n + c - 1) // c  # chunks a row
    ends = jnp.cumsum(per)
    j = jnp.arange(nch)
    row = jnp.minimum(jnp.searchsorted(ends, j, side="right"), rows - 1)
    local = j - (ends - per)[row]  # the chunk's index within its row
    valid = j < ends[-1]
    pos = local[:, None] * c + jnp.arange(c)  # [chunks, C]: the token's index within its row
    idx = jnp.where(valid[:, None] & (pos < n[row][:, None]), first[row][:, None] + pos, t)
    tok = jnp.arange(t)  # row r's token first + i is in its chunk (ends - per)[r] + i // C
    r = jnp.minimum(jnp.searchsorted(first + n, tok, side="right"), rows - 1)
    i = tok - first[r]
    at = jnp.where((i >= 0) & (i < n[r]), ((ends - per)[r] + i // c) * c + i % c, nch * c)
    return {"row": row, "start": local == 0, "valid": valid, "idx": idx, "at": at}
