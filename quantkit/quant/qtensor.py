"""QTensor: the one quantized-weight type of the runtime (docs/architecture.md, rule 2).

Invariants:
- `values` [g, k, n]: weights already transposed to (input, output) so that output features lie on the
  128 lanes; g = 1 for a dense layer, the number of experts for MoE. Storage dtype by logical type:
  int4 -> jnp.int4 (q in [-8, 7]); int8 -> jnp.int8 (q in [-128, 127]); fp8 -> jnp.float8_e4m3fn;
  mxfp4 -> jnp.int4 holding the e2m1 code bits (code = sign << 3 | magnitude index, read as a
  two's-complement nibble), since Mosaic has no float4 vectors. Always 4 or 8 bits per weight in HBM; never dequantized there.
- `scales` [g, k // group, n]: one scale per `group` consecutive input features and output column.
  group == k means channel scales. int4/int8/fp8: float32 or bfloat16; mxfp4: uint8 E8M0 exponents.
  fp8 block [128, 128] scales are stored as group 128 with each column's block scale repeated.
- `qtype` and `group` are static (pytree metadata), so jit specializes on them.
- Tensor parallelism (runtime/sharding.py): `mesh` is the Mesh the arrays are placed on and `split` which
  dimension is divided over its "model" axis ("n" output columns, "k" input rows, "" replicated); both
  static. None / "" on one device.
The logical value of element [e, i, j] is decode(values[e, i, j]) * scale[e, i // group, j].
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from quantkit.formats.packing import e8m0_decode, fp4_decode

QTYPES = ("int4", "int8", "fp8", "mxfp4")
STORAGE = {"int4": jnp.int4, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "mxfp4": jnp.int4}
BITS = {"int4": 4, "int8": 8, "fp8": 8, "mxfp4": 4}  # bits per stored weight


@partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"],
         meta_fields=["qtype", "group", "mesh", "split"])
@dataclass(frozen=True)
class QTensor:
    values: jax.Array  # [g, k, n]
    scales: jax.Array  # [g, k // group, n]
    qtype: str  # static: "int4" | "int8" | "fp8" | "mxfp4"
    group: int  # static: input features per scale (k for channel scales)
    mesh: Any = None  # static: jax.sharding.Mesh of a tensor-parallel weight
    split: str = ""  # static: "n" | "k" | "" (see above)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> jax.Array:
        """The logical values, float32 [g, k, n]: decode(values) * scale of each row's group, with the one
        FP4/E8M0 decoding (formats/packing.py; quant/reference.py keeps an independent one as the oracle)."""
        mx = self.qtype == "mxfp4"
        values = fp4_decode(self.values, jnp) if mx else self.values.astype(jnp.float32)  # [g, k, n]
        scales = e8m0_decode(self.scales, jnp) if mx else self.scales.astype(jnp.float32)  # [g, k // group, n]
        return values * jnp.repeat(scales, self.group, axis=1)

    def nbytes(self) -> int:
        """HBM bytes of values (packed) and scales."""
        return self.values.size * BITS[self.qtype] // 8 + self.scales.size * self.scales.dtype.itemsize


def check_qtensor(values: tuple, scales: tuple, qtype: str, group: int) -> None:
    """Raises ValueError unless shapes values [g, k, n], scales [g, k // group, n] and qtype are a QTensor's."""
    if qtype not in QTYPES:
        raise ValueError(f"unknown qtype {qtype!r}")
    g, k, n = values
    if k % group or tuple(scales) != (g, k // group, n):
        raise ValueError(f"scales {tuple(scales)} do not match values {(g, k, n)} with group {group}")


def make_qtensor(values, scales, qtype: str, group: int) -> QTensor:
    """Builds a QTensor from [g, k, n] values (int8 codes/ints or fp8) and [g, k // group, n] scales,
    checking the invariants above."""
    values = np.asarray(values) if not isinstance(values, jax.Array) else values
    check_qtensor(values.shape, scales.shape, qtype, group)
    return QTensor(jnp.asarray(values).astype(STORAGE[qtype]), jnp.asarray(scales), qtype, group)
