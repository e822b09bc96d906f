"""The Gated DeltaNet decode kernels (kernels/gdn_decode.py; Pallas, interpret mode on CPU) against the layer's
pure-JAX recurrence and causal conv (runtime/models/gdn.py `_recurrence`, `_conv`; one token a row), and
compiled deviceless.

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
from quantkit.kernels.gdn_decode import conv_cost, conv_decode, cost, gdn_decode
from quantkit.runtime.models.gdn import _conv, _l2norm, _recurrence


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
    o, got = gdn_decode(q, k, v, g, beta, state, layer, slot, fresh, valid, interpret=pltpu.InterpretParams())
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
    y, got = conv_decode(x, w, conv, layer, slot, fresh, valid, interpret=pltpu.InterpretParams())
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
