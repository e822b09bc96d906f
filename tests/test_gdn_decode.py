"""The Gated DeltaNet kernels (kernels/gdn_decode.py, kernels/gdn_prefill.py; Pallas, interpret mode on CPU)
against the layer's pure-JAX recurrence, chunked rule and causal conv (runtime/models/gdn.py `_recurrence`,
`_conv`), and compiled deviceless.

Inputs are drawn fresh on every run (the seed is in each failure message). Tolerance 1e-5 relative
(Frobenius): both compute the same float32 products and sums, the reference with HIGHEST-precision einsums,
the kernel elementwise on the vector unit, in another order (~1e-7 measured). A row reading the wrong slot,
a missed decay or a state not written back gives errors of order 1; slots the step does not touch must come
back bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from helpers import rel_err
from quantkit.kernels import gdn_prefill as prefill
from quantkit.kernels.gdn_decode import conv_cost, conv_decode, cost, gdn_decode
from quantkit.runtime.models.gdn import _conv, _l2norm, _recurrence

INTERPRET = pltpu.InterpretParams()  # tests/test_tpu.py runs these tests with it off, on a TPU


def _inputs(rng, rows, hv, dk, dv, layers, slots):
    q = _l2norm(jnp.asarray(rng.standard_normal((rows, hv, dk)), jnp.float32)) * dk ** -0.5
    k = _l2norm(jnp.asarray(rng.standard_normal((rows, hv, dk)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((rows, hv, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 2.0, (rows, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (rows, hv)), jnp.float32)
    state = jnp.asarray(rng.standard_normal((layers, slots, hv, dk, dv)), jnp.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("hv,dk,dv", [(4, 32, 64), (2, 128, 128)])
def test_decode_kernel_matches_the_recurrence(hv, dk, dv, seed):
    """Eight rows: valid ones in distinct slots (one of them fresh: from zeros), padding rows (valid 0) on
    the scratch slot, of layer 1 of a 3-layer stack: each valid row's output and new state equal the
    recurrence's; every other slot and layer is unchanged, bit for bit, and padding rows output zeros."""
    rng = np.random.default_rng(seed)
    rows, layers, slots, layer = 8, 3, 7, 1
    q, k, v, g, beta, state = _inputs(rng, rows, hv, dk, dv, layers, slots)
    slot = np.array([3, 0, 5, 2, 1, 6, 6, 6], np.int32)  # 6: the scratch slot of the padding rows
    valid = np.array([1, 1, 1, 1, 1, 0, 0, 0], np.int32)
    fresh = np.array([0, 1, 0, 0, 0, 0, 0, 0], np.int32)
    s0 = jnp.where(fresh[:, None, None, None] != 0, 0.0, state[layer, slot])
    o_ref, s1 = _recurrence(q, k, v, g, beta, s0, jnp.arange(rows), jnp.asarray(valid), decode=True)
    want = np.asarray(state).copy()
    want[layer, slot[:5]] = np.asarray(s1)[:5]
    o, got = gdn_decode(q, k, v, g, beta, state, layer, slot, fresh, valid, interpret=INTERPRET)
    o, got = np.asarray(o), np.asarray(got)
    assert np.isfinite(o).all() and np.isfinite(got).all(), f"unwritten (NaN) output, seed {seed}"
    assert rel_err(o[:5], np.asarray(o_ref)[:5]) < 1e-5, f"seed {seed}"
    assert (o[5:] == 0).all(), f"padding rows' output, seed {seed}"
    assert rel_err(got[layer, slot[:5]], want[layer, slot[:5]]) < 1e-5, f"seed {seed}"
    untouched = np.ones(got.shape[:2], bool)
    untouched[layer, slot[:5]] = False
    assert (got[untouched] == want[untouched]).all(), f"a slot the step does not own changed, seed {seed}"


@pytest.mark.slow
@pytest.mark.parametrize("chip,hv", [("v6e", 32), ("v7x", 64)])
def test_decode_kernel_compiles_in_place_with_its_declared_bytes(chip, hv):
    """Qwen3.5-35B-A3B's (32 value heads) and -397B-A17B's (64) GDN state [Hv, 128, 128] float32, 16 rows over
    a 30-layer stack of 17 slots, compiled deviceless: no temporaries (the state cache is updated in place,
    never copied: a copy would be the whole stack, 1 GiB and more), and XLA's count of the program within 10%
    of the kernel's declared bytes (every row's state read and written once; the rest, 1% on v6e and 5% on
    v7x, is the program's own handling of the small inputs)."""
    from quantkit.runtime.aot import compile_for

    rows, dk, dv = 16, 128, 128
    f32, i32 = jnp.float32, jnp.int32
    s = jax.ShapeDtypeStruct
    args = [s((rows, hv, dk), f32), s((rows, hv, dk), f32), s((rows, hv, dv), f32), s((rows, hv), f32),
            s((rows, hv), f32), s((30, 17, hv, dk, dv), f32), s((), i32), s((rows,), i32), s((rows,), i32),
            s((rows,), i32)]
    compiled, _ = compile_for(chip, lambda *a: gdn_decode(*a), *args, donate=(5,))
    counted = compiled.cost_analysis()
    counted = (counted[0] if isinstance(counted, (list, tuple)) else counted)["bytes accessed"]
    declared = cost(rows, hv, dk, dv).bytes_accessed
    assert compiled.memory_analysis().temp_size_in_bytes == 0
    assert declared <= counted <= 1.1 * declared, counted / declared
    assert declared >= 2 * rows * hv * dk * dv * 4  # at least each row's state in and out


def test_conv_kernel_matches_the_conv(seed):
    """The causal conv (K = 4, 256 channels) for eight rows as the decode test's (valid rows in distinct
    slots, one fresh, padding rows on the scratch slot, layer 1 of 3): each valid row's output equals the
    reference's to 1e-6 (the same float32 products and sums; the output rounds to x's bfloat16) and its new
    conv state (the last three inputs, flattened, oldest first) equals the reference's; padding rows output
    zeros and every other slot and layer is unchanged, bit for bit."""
    rng = np.random.default_rng(seed)
    rows, layers, slots, layer, kk, c = 8, 3, 7, 1, 4, 256
    x = jnp.asarray(rng.standard_normal((rows, c)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((kk, c)), jnp.float32)
    conv = jnp.asarray(rng.standard_normal((layers, slots, 1, (kk - 1) * c)), jnp.float32)
    slot = np.array([3, 0, 5, 2, 1, 6, 6, 6], np.int32)
    valid = np.array([1, 1, 1, 1, 1, 0, 0, 0], np.int32)
    fresh = np.array([0, 1, 0, 0, 0, 0, 0, 0], np.int32)
    c0 = jnp.where(fresh[:, None, None] != 0, 0.0, conv[layer, slot].reshape(rows, kk - 1, c))
    ones = jnp.ones(rows, jnp.int32)
    y_ref, c1 = _conv(x, w, c0, jnp.arange(rows), jnp.zeros(rows, jnp.int32), jnp.arange(rows), ones)
    want = np.asarray(conv).copy()
    want[layer, slot[:5]] = np.asarray(c1).reshape(rows, 1, -1)[:5]
    y, got = conv_decode(x, w, conv, layer, slot, fresh, valid, interpret=INTERPRET)
    y, got = np.asarray(y, np.float32), np.asarray(got)
    assert rel_err(y[:5], np.asarray(y_ref, np.float32)[:5]) < 1e-6, f"seed {seed}"
    assert (y[5:] == 0).all(), f"padding rows' output, seed {seed}"
    assert (got[layer, slot[:5]] == want[layer, slot[:5]]).all(), f"seed {seed}"
    untouched = np.ones(got.shape[:2], bool)
    untouched[layer, slot[:5]] = False
    assert (got[untouched] == want[untouched]).all(), f"a slot the step does not own changed, seed {seed}"


@pytest.mark.parametrize("chip,c", [("v6e", 8192), ("v7x", 12288)])
def test_conv_kernel_compiles_in_place_with_its_declared_bytes(chip, c):
    """Qwen3.5-35B-A3B's (8,192 conv channels) and -397B-A17B's (12,288) conv state, 16 rows over a 30-layer
    stack of 17 slots, compiled deviceless: no temporaries (the stack, stored as [.., 1, 3 * C] rows, is
    updated in place: as [.., 3, C] XLA:TPU laid it out in another order and copied all of it in and out),
    and XLA's count the declared bytes plus at most a copy in and out of the small operands (x, the weights
    and y; v7x stages them in VMEM before the call: 2.4 MB of 8.5; the stack is 75 MB)."""
    from quantkit.runtime.aot import compile_for

    rows, kk = 16, 4
    s, i32 = jax.ShapeDtypeStruct, jnp.int32
    args = [s((rows, c), jnp.bfloat16), s((kk, c), jnp.float32), s((30, 17, 1, (kk - 1) * c), jnp.float32),
            s((), i32), s((rows,), i32), s((rows,), i32), s((rows,), i32)]
    compiled, _ = compile_for(chip, lambda *a: conv_decode(*a), *args, donate=(2,))
    counted = compiled.cost_analysis()
    counted = (counted[0] if isinstance(counted, (list, tuple)) else counted)["bytes accessed"]
    declared = conv_cost(rows, kk, c, 2).bytes_accessed
    small = rows * c * 2 + kk * c * 4 + rows * c * 4
    assert compiled.memory_analysis().temp_size_in_bytes == 0
    assert declared <= counted <= declared + 2 * small, (counted, declared)
    assert declared >= 2 * rows * (kk - 1) * c * 4  # at least each row's state in and out


def _prefill_inputs(rng, t, hv, dk, dv, layers, slots):
    q, k, v, g, beta, state = _inputs(rng, t, hv, dk, dv, layers, slots)
    return q, k, v, g * 0.25, beta, state  # decays of prompt length: exp(sum g) stays above float32's floor


def test_prefill_kernel_matches_the_chunked_rule(seed):
    """A step of 160 tokens over five rows (101 tokens: several chunks and a partial one, 1, none, 32: exactly
    two chunks of the kernel's 16, 20 from zeros) and 6 padding tokens, of layer 1 of a 2-layer stack:
    each row's tokens' outputs and its new state equal the chunked rule's (the reference's chunks are 64
    tokens, the kernel's 16: the same recurrence cut differently; 1e-5, ~4e-7 measured), padding tokens
    output zeros, and the row without tokens, the scratch slot and the other layer are unchanged, bit for
    bit."""
    rng = np.random.default_rng(seed)
    t, hv, dk, dv, layers, slots, layer = 160, 2, 128, 128, 2, 7, 1
    q, k, v, g, beta, state = _prefill_inputs(rng, t, hv, dk, dv, layers, slots)
    n = np.array([101, 1, 0, 32, 20], np.int32)
    first = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int32)
    slot = np.array([2, 0, 5, 3, 1], np.int32)
    fresh = np.array([0, 0, 0, 0, 1], np.int32)
    s0 = jnp.where(fresh[:, None, None, None] != 0, 0.0, state[layer, slot])
    o_ref, s1 = _recurrence(q, k, v, g, beta, s0, jnp.asarray(first), jnp.asarray(n))
    want = np.asarray(state).copy()
    o, got = prefill.gdn_prefill(q, k, v, g, beta, state, layer, slot, fresh, first, n, chunk=16,
                                 interpret=INTERPRET)
    o, got = np.asarray(o), np.asarray(got)
    live = np.arange(t) < n.sum()
    assert rel_err(o[live], np.asarray(o_ref)[live]) < 1e-5, f"seed {seed}"
    assert (o[~live] == 0).all(), f"padding tokens' output, seed {seed}"
    for r in (0, 1, 3, 4):
        assert rel_err(got[layer, slot[r]], np.asarray(s1)[r]) < 1e-5, f"row {r}, seed {seed}"
    assert (got[layer, [5, 6]] == want[layer, [5, 6]]).all() and (got[0] == want[0]).all(), f"seed {seed}"


def test_prefill_kernel_declares_the_blocks_its_grid_copies():
    """The declared bytes against a walk of the grid through the block index maps, for a step whose every
    row has tokens and whose chunks end in padding (the static bound's case): every step copies its chunk's
    q, k, v, decays, beta and output blocks, and a state block is read when the block index changes and
    written when it changes again — once per run of a row's chunks, and once for the padding run."""
    t, c, hv, dk, dv = 256, 64, 4, 128, 128
    n = jnp.asarray([100, 1, 64, 40], jnp.int32)
    first = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(n)[:-1]])
    sched = prefill.schedule(t, c, first, n)
    slot_of = np.where(np.asarray(sched["valid"]), np.asarray([5, 6, 7, 8])[np.asarray(sched["row"])], 9)
    assert not np.asarray(sched["valid"]).all()  # padding chunks at the end
    moved = 0
    prev = None
    for h in range(hv):
        for j in range(len(slot_of)):
            moved += c * (2 * dk + 2 * dv + 3) * 4
            if (slot_of[j], h) != prev:
                moved += 2 * dk * dv * 4
                prev = (slot_of[j], h)
    declared = prefill.cost(len(slot_of), len(n), hv, c, dk, dv).bytes_accessed
    assert moved <= declared <= moved + 4 * 4 * len(slot_of) + 4  # and the scalar prefetch arrays


@pytest.mark.parametrize("chip,hv", [("v6e", 32), ("v7x", 64)])
def test_prefill_kernel_compiles_deviceless(chip, hv):
    """A 512-token step of 16 rows at Qwen3.5-35B-A3B's (32 value heads) and -397B-A17B's (64) shapes, over a
    30-layer stack of 17 slots, compiles for the chip (Mosaic takes the kernel), in place: its temporaries
    (the chunk-ordered q, k, v and outputs) stay far below one copy of the state stack, and XLA's count
    holds the kernel's declared bytes."""
    from quantkit.runtime.aot import compile_for

    t, rows, dk, dv = 512, 16, 128, 128
    s, f32, i32 = jax.ShapeDtypeStruct, jnp.float32, jnp.int32
    args = [s((t, hv, dk), f32), s((t, hv, dk), f32), s((t, hv, dv), f32), s((t, hv), f32), s((t, hv), f32),
            s((30, 17, hv, dk, dv), f32), s((), i32)] + [s((rows,), i32)] * 4
    compiled, _ = compile_for(chip, lambda *a: prefill.gdn_prefill(*a), *args, donate=(5,))
    counted = compiled.cost_analysis()
    counted = (counted[0] if isinstance(counted, (list, tuple)) else counted)["bytes accessed"]
    declared = prefill.cost(prefill.chunks_bound(t, rows, 64), rows, hv, 64, dk, dv).bytes_accessed
    stack = 30 * 17 * hv * dk * dv * 4
    assert compiled.memory_analysis().temp_size_in_bytes < stack / 4
    assert counted >= declared
