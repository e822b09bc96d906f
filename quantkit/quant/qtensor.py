"""QTensor: the one quantized-weight type of the runtime (docs/architecture.md, rule 2).

Invariants:
- `values` [g, k, n]: weights already transposed to (input, output) so that output features lie on the
  128 lanes; g = 1 for a dense layer, the number of experts for MoE. Storage dtype by logical type:
  int4 -> jnp.int4 (q in [-8, 7]); int8 -> jnp.int8 (q in [-128, 127]); fp8 -> jnp.float8_e4m3fn;
  mxfp4 -> jnp.int4 holding the e2m1 code bits (code = sign << 3 | magnitude index, read as a
  two's-complement nibble), since Mosaic has no float4 vectors; mxfp8 -> jnp.float8_e4m3fn. Always 4 or 8 bits per weight in HBM; never dequantized there.
- `scales` [g, k // group, n]: one scale per `group` consecutive input features and output column.
  group == k means channel scales. int4/int8/fp8: float32 or bfloat16; mxfp4/mxfp8: uint8 E8M0 exponents.
  fp8 block [128, 128] scales are stored as group 128 with each column's block scale repeated.
- `zeros` (asymmetric ints only, else None) [g, k // group, n] int8: the integer zero point of each scale
  group, z in the qtype's range; the logical value is then (q - z) * scale. Kept as stored, never folded
  into the scales (1 byte per group and column in HBM).
- `qtype` and `group` are static (pytree metadata), so jit specializes on them.
- Tensor parallelism (runtime/sharding.py): `mesh` is the Mesh the arrays are placed on and `split` which
  dimension is divided over its "model" axis ("n" output columns, "k" input rows, "" replicated); both
  static. None / "" on one device.
The logical value of element [e, i, j] is (decode(values[e, i, j]) - zero[e, i // group, j]) * scale[e, i // group, j]
(zero = 0 without `zeros`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from quantkit.formats.packing import e8m0_decode, fp4_decode

QTYPES = ("int4", "int8", "fp8", "mxfp4", "mxfp8")
STORAGE = {"int4": jnp.int4, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "mxfp4": jnp.int4, "mxfp8": jnp.float8_e4m3fn}
BITS = {"int4": 4, "int8": 8, "fp8": 8, "mxfp4": 4, "mxfp8": 8}  # bits per stored weight


@partial(jax.tree_util.register_dataclass, data_fields=["values", "scales", "zeros"],
         meta_fields=["qtype", "group", "mesh", "split"])
@dataclass(frozen=True)
class QTensor:
    values: jax.Array  # [g, k, n]
    scales: jax.Array  # [g, k // group, n]
    qtype: str  # static: "int4" | "int8" | "fp8" | "mxfp4" | "mxfp8"
    group: int  # static: input features per scale (k for channel scales)
    mesh: Any = None  # static: jax.sharding.Mesh of a tensor-parallel weight
    split: str = ""  # static: "n" | "k" | "" (see above)
    zeros: jax.Array | None = None  # [g, k // group, n] int8 zero points of an asymmetric int weight

    @property
    def arrays(self) -> tuple:
        """The data arrays: (values, scales) or (values, scales, zeros); `with_arrays` takes them back.
        Scales and zeros share a shape, and so a slicing or a placement."""
        return (self.values, self.scales) if self.zeros is None else (self.values, self.scales, self.zeros)

    def with_arrays(self, values, scales, zeros=None, **meta) -> "QTensor":
        """This QTensor's static fields (or those in `meta`) over other data arrays."""
        return dataclasses.replace(self, values=values, scales=scales, zeros=zeros, **meta)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> jax.Array:
        """The logical values, float32 [g, k, n]: decode(values) * scale of each row's group, with the one
        FP4/E8M0 decoding (formats/packing.py; quant/reference.py keeps an independent one as the oracle)."""
        values, scales = decode_values(self.values, self.qtype), decode_scales(self.scales, self.qtype)
        if self.zeros is not None:
            values = values - jnp.repeat(self.zeros.astype(jnp.float32), self.group, axis=1)
        return values * jnp.repeat(scales, self.group, axis=1)

    def nbytes(self) -> int:
        """HBM bytes of values (packed), scales and zero points."""
        return self.values.size * BITS[self.qtype] // 8 + sum(a.size * a.dtype.itemsize for a in self.arrays[1:])


def decode_values(values: jax.Array, qtype: str) -> jax.Array:
    """Stored values (a whole weight or a kernel's tile) -> float32 before scaling: ints and fp8 as they are,
    e2m1 codes to their values (formats/packing.py, the one FP4 decoding)."""
    return fp4_decode(values, jnp) if qtype == "mxfp4" else values.astype(jnp.float32)


def decode_scales(scales: jax.Array, qtype: str) -> jax.Array:
    """Stored scales -> float32: E8M0 exponent bytes of the MX types to powers of two, others as they are."""
    return e8m0_decode(scales, jnp) if qtype.startswith("mxfp") else scales.astype(jnp.float32)


def check_qtensor(values: tuple, scales: tuple, qtype: str, group: int, zeros: tuple | None = None) -> None:
    """Raises ValueError unless shapes values [g, k, n], scales (and zeros) [g, k // group, n] and qtype are a
    QTensor's (zero points on int types only)."""
    if qtype not in QTYPES:
        raise ValueError(f"unknown qtype {qtype!r}")
    g, k, n = values
    if k % group or tuple(scales) != (g, k // group, n):
        raise ValueError(f"scales {tuple(scales)} do not match values {(g, k, n)} with group {group}")
    if zeros is not None and (tuple(zeros) != tuple(scales) or not qtype.startswith("int")):
        raise ValueError(f"zero points {tuple(zeros)} do not match {qtype} scales {tuple(scales)}")


def make_qtensor(values, scales, qtype: str, group: int, zeros=None) -> QTensor:
    """Builds a QTensor from [g, k, n] values (int8 codes/ints or fp8), [g, k // group, n] scales and
    optional zero points of the same shape, checking the invariants above."""
    values = np.asarray(values) if not isinstance(values, jax.Array) else values
    check_qtensor(values.shape, scales.shape, qtype, group, None if zeros is None else zeros.shape)
    return QTensor(jnp.asarray(values).astype(STORAGE[qtype]), jnp.asarray(scales), qtype, group,
                   zeros=None if zeros is None else jnp.asarray(zeros).astype(jnp.int8))
