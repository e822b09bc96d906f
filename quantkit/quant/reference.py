"""Pure-jnp oracles for the kernels (docs/architecture.md, rule 5): same signatures, float32, no tiling.

The mxfp4 decodings come from ml_dtypes' float4_e2m1fn and float8_e8m0fnu (byte 255 is NaN, as the OCP MX
spec), on purpose not from formats/packing.py, which the production paths share: an oracle that shared it
would agree with any mistake in it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from quantkit.quant.qtensor import QTensor

# numpy, not jnp: a module-level jax array created while a trace is running would leak the trace.
FP4_VALUES = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)  # [code]
E8M0_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)  # [byte]


def decode_values(qt: QTensor) -> jax.Array:
    """Stored values as float32 [g, k, n], before scaling."""
    if qt.qtype in ("mxfp4", "nvfp4"):
        return jnp.asarray(FP4_VALUES)[qt.values.astype(jnp.int32) & 15]
    return qt.values.astype(jnp.float32)


def decode_scales(qt: QTensor) -> jax.Array:
    """Scales as float32 [g, k // group, n] (E8M0 bytes -> 2**(e - 127), 255 -> NaN; nvfp4: fp8 over its
    group's global scale)."""
    if qt.qtype in ("mxfp4", "mxfp8"):
        return jnp.asarray(E8M0_VALUES)[qt.scales.astype(jnp.int32)]
    s = qt.scales.astype(jnp.float32)
    return s if qt.gscale is None else s / qt.gscale.reshape(-1, 1, 1)


def dequantize(qt: QTensor) -> jax.Array:
    """float32 [g, k, n]: (value - zero point) * scale, per element (groups expanded by indexing)."""
    rows = jnp.arange(qt.shape[1]) // qt.group
    zero = 0.0 if qt.zeros is None else qt.zeros.astype(jnp.float32)[:, rows]
    return (decode_values(qt) - zero) * decode_scales(qt)[:, rows]


def row_groups(group_sizes: jax.Array, m: int) -> jax.Array:
    """Group index of each of the m rows (rows past sum(group_sizes) get len(group_sizes))."""
    return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")


def gmm_reference(lhs: jax.Array, rhs: QTensor, group_sizes: jax.Array, out_dtype=jnp.float32) -> jax.Array:
    """out[i] = lhs[i] @ dequantize(rhs)[group of row i]; rows past sum(group_sizes) are zero.

    Args:
        lhs: [m, k], rows sorted by group.
        rhs: QTensor [g, k, n].
        group_sizes: int32 [g], sum <= m.
    Returns:
        [m, n] in out_dtype, computed in float32 at highest precision.
    """
    w = dequantize(rhs)
    every = jnp.einsum("mk,gkn->gmn", lhs.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    g = row_groups(group_sizes, lhs.shape[0])
    picked = jnp.take_along_axis(every, jnp.minimum(g, w.shape[0] - 1)[None, :, None], axis=0)[0]
    return jnp.where((g < w.shape[0])[:, None], picked, 0.0).astype(out_dtype)
