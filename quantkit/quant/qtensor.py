"""QTensor: the one quantized-weight type of the runtime (docs/architecture.md, rule 2).

Invariants:
- `values` [g, k, n]: weights already transposed to (input, output) so that output features lie on the
  128 lanes; g = 1 for a dense layer, the number of experts for MoE. Storage dtype by logical type:
  int4 -> jnp.int4 (q in [-8, 7]); int8 -> jnp.int8 (q in [-128, 127]); fp8 -> jnp.float8_e4m3fn;
  mxfp4 -> jnp.int4 holding the e2m1 code bits (code = sign << 3 | magnitude index, read as a
  two's-complement nibble), since Mosaic has no float4 vectors; nvfp4 -> the same e2m1 codes; mxfp8 ->
  jnp.float8_e4m3fn. Always 4 or 8 bits per weight in HBM; never dequantized there.
- `scales` [g, k // group, n]: one scale per `group` consecutive input features and output column.
  group == k means channel scales. int4/int8/fp8: float32 or bfloat16; mxfp4/mxfp8: uint8 E8M0 exponents;
  nvfp4: float8_e4m3fn, group 16.
  fp8 block [128, 128] scales are stored as group 128 with each column's block scale repeated.
- `zeros` (asymmetric ints only, else None) [g, k // group, n] int8: the integer zero point of each scale
  group, z in the qtype's range; the logical value is then (q - z) * scale. Kept as stored, never folded
  into the scales (1 byte per group and column in HBM).
- `gscale` (nvfp4 only, else None) [g] float32: each group's (expert's) global scale; the effective scale is
  float32(scale) / gscale, computed per element in float32 as compressed-tensors does (never pre-divided: a
  stored quotient would need 4 bytes per scale, and rounding it would change the weights).
- `perm` (activation-ordered groups only, else None) [g, k] int32: the weight's rows are stored sorted by scale
  group (row i holds input feature perm[e, i]), so groups are contiguous as above; the matmul's callers gather
  the activations' columns by it (runtime/ops.py), the kernels never see it.
- `act` (static): how the matmul's callers quantize the activations before multiplying ("" none: bf16 or
  float32 as the model runs; "int8" / "fp8": dynamic symmetric per token, each row's absmax / 127.5 / 448,
  as compressed-tensors defines W8A8 and W4A8 / FP8_DYNAMIC and W4AFP8; runtime/ops.py). The kernels then
  take 8-bit rows and their scales. Per-group kinds (formats/compressed_tensors.activation_qtype) are
  quantize-dequantized before the weights' own path.
- `act_gscale` (nvfp4 activations only, else None) [g] float32: each group's (expert's) static
  `input_global_scale`, which the activations' fp8 local scales are taken relative to.
- `rot` (online input transforms only, else None) [g, h, h] int8, entries +-1: each row of the activations is
  multiplied, in blocks of h, by its group's matrix and divided by sqrt(h) (compressed-tensors' online
  Hadamard transform, QuIP / SpinQuant), before `perm` and `act`; the weights hold its inverse already.
- `qtype` and `group` are static (pytree metadata), so jit specializes on them.
- Tensor parallelism (runtime/sharding.py): `mesh` is the Mesh the arrays are placed on and `split` which
  dimension is divided over its "model" axis ("n" output columns, "k" input rows, "" replicated); both
  static. None / "" on one device.
The logical value of element [e, i, j] is (decode(values[e, i, j]) - zero[e, i // group, j]) * (scale[e, i // group, j]
/ gscale[e]) (zero = 0 without `zeros`, gscale = 1 without `gscale`).
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

QTYPES = ("int4", "int8", "fp8", "mxfp4", "mxfp8", "nvfp4")
STORAGE = {"int4": jnp.int4, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "mxfp4": jnp.int4, "mxfp8": jnp.float8_e4m3fn,
           "nvfp4": jnp.int4}
BITS = {"int4": 4, "int8": 8, "fp8": 8, "mxfp4": 4, "mxfp8": 8, "nvfp4": 4, "bf16": 16}  # bits per stored weight
# A dense bf16 weight the TPU step serves through the quantized matmul (runtime/ops.py `dense_as_qtensor`):
# values as they are, unit channel scales. Never stored or loaded as such, so not one of QTYPES.
DENSE = "bf16"
FP4 = ("mxfp4", "nvfp4")  # e2m1 codes


@partial(jax.tree_util.register_dataclass, data_fields=["values", "scales", "zeros", "gscale", "perm",
                                                      "act_gscale", "rot"],
         meta_fields=["qtype", "group", "mesh", "split", "act"])
@dataclass(frozen=True)
class QTensor:
    values: jax.Array  # [g, k, n]
    scales: jax.Array  # [g, k // group, n]
    qtype: str  # static: one of QTYPES
    group: int  # static: input features per scale (k for channel scales)
    mesh: Any = None  # static: jax.sharding.Mesh of a tensor-parallel weight
    split: str = ""  # static: "n" | "k" | "" (see above)
    zeros: jax.Array | None = None  # [g, k // group, n] int8 zero points of an asymmetric int weight
    gscale: jax.Array | None = None  # [g] float32 global scales (nvfp4)
    perm: jax.Array | None = None  # [g, k] int32 input feature of each stored row (activation order)
    act: str = ""  # static: "" | "int8" | "fp8" | a per-group kind (see above)
    act_gscale: jax.Array | None = None  # [g] float32 input global scales (nvfp4 activations)
    rot: jax.Array | None = None  # [g, h, h] int8 +-1 online input transform (see above)

    @property
    def arrays(self) -> dict:
        """The data arrays present, by field name ("values", "scales", then "zeros", "gscale", "perm",
        "act_gscale", "rot" when set); `with_arrays` takes such a mapping back. Every array's first axis is
        the group axis."""
        return {f: a for f in ("values", "scales", "zeros", "gscale", "perm", "act_gscale", "rot")
                if (a := getattr(self, f)) is not None}

    def per_array(self, values, scales, groups) -> dict:
        """For each array of `arrays`, the one of three things (a sharding, a BlockSpec...) for its kind: the
        values, a per-scale array (scales and zero points share a shape, and so a slicing or a placement),
        or a per-group one (gscale, perm, act_gscale, rot: split only with the groups)."""
        kind = {"values": values, "scales": scales, "zeros": scales, "gscale": groups, "perm": groups,
                "act_gscale": groups, "rot": groups}
        return {f: kind[f] for f in self.arrays}

    def with_arrays(self, arrays: dict, **meta) -> "QTensor":
        """This QTensor's static fields (or those in `meta`) over other data arrays (a mapping as `arrays`)."""
        return dataclasses.replace(self, **{"zeros": None, "gscale": None, "perm": None, "act_gscale": None,
                                            "rot": None, **arrays}, **meta)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> jax.Array:
        """The logical values, float32 [g, k, n] in stored row order (see `perm`): decode(values) * scale of
        each row's group, with the one FP4/E8M0 decoding (formats/packing.py; quant/reference.py keeps an
        independent one as the oracle).
        nvfp4's are rounded to bf16: its product with a quotient scale is not exact in bf16, and the library
        defines the weights as that bf16 rounding whatever the model's dtype (what gmm_v2 feeds the MXU too)."""
        values, scales = decode_values(self.values, self.qtype), decode_scales(self.scales, self.qtype)
        if self.gscale is not None:
            scales = scales / self.gscale[:, None, None]
        if self.zeros is not None:
            values = values - jnp.repeat(self.zeros.astype(jnp.float32), self.group, axis=1)
        w = values * jnp.repeat(scales, self.group, axis=1)
        return w if self.gscale is None else w.astype(jnp.bfloat16).astype(jnp.float32)

    def nbytes(self) -> int:
        """HBM bytes of values (packed), scales, zero points, global scales and row orders."""
        side = [a for f, a in self.arrays.items() if f != "values"]
        return self.values.size * BITS[self.qtype] // 8 + sum(a.size * a.dtype.itemsize for a in side)


def decode_values(values: jax.Array, qtype: str) -> jax.Array:
    """Stored values (a whole weight or a kernel's tile) -> float32 before scaling: ints and fp8 as they are,
    e2m1 codes to their values (formats/packing.py, the one FP4 decoding)."""
    return fp4_decode(values, jnp) if qtype in FP4 else values.astype(jnp.float32)


def decode_scales(scales: jax.Array, qtype: str) -> jax.Array:
    """Stored scales -> float32: E8M0 exponent bytes of the MX types to powers of two, others (fp8 of nvfp4,
    before its global scale) as they are."""
    return e8m0_decode(scales, jnp) if qtype.startswith("mxfp") else scales.astype(jnp.float32)


def check_qtensor(values: tuple, scales: tuple, qtype: str, group: int, zeros: tuple | None = None,
                  gscale: tuple | None = None, perm: tuple | None = None) -> None:
    """Raises ValueError unless shapes values [g, k, n], scales (and zeros) [g, k // group, n], gscale [g] and
    qtype are a QTensor's (zero points on int types only, global scales on nvfp4 alone and always)."""
    if qtype not in QTYPES:
        raise ValueError(f"unknown qtype {qtype!r}")
    g, k, n = values
    if k % group or tuple(scales) != (g, k // group, n):
        raise ValueError(f"scales {tuple(scales)} do not match values {(g, k, n)} with group {group}")
    if zeros is not None and (tuple(zeros) != tuple(scales) or not qtype.startswith("int")):
        raise ValueError(f"zero points {tuple(zeros)} do not match {qtype} scales {tuple(scales)}")
    if (gscale is not None) != (qtype == "nvfp4") or (gscale is not None and tuple(gscale) != (g,)):
        raise ValueError(f"global scales {gscale and tuple(gscale)} do not match {qtype} values {(g, k, n)}")
    if perm is not None and tuple(perm) != (g, k):
        raise ValueError(f"row order {tuple(perm)} does not match values {(g, k, n)}")


def make_qtensor(values, scales, qtype: str, group: int, zeros=None, gscale=None, perm=None) -> QTensor:
    """Builds a QTensor from [g, k, n] values (int8 codes/ints or fp8), [g, k // group, n] scales, optional
    zero points of the same shape and nvfp4's [g] global scales, checking the invariants above."""
    values = np.asarray(values) if not isinstance(values, jax.Array) else values
    check_qtensor(values.shape, scales.shape, qtype, group, None if zeros is None else zeros.shape,
                  None if gscale is None else np.shape(gscale), None if perm is None else np.shape(perm))
    return QTensor(jnp.asarray(values).astype(STORAGE[qtype]), jnp.asarray(scales), qtype, group,
                   zeros=None if zeros is None else jnp.asarray(zeros).astype(jnp.int8),
                   gscale=None if gscale is None else jnp.asarray(gscale, jnp.float32),
                   perm=None if perm is None else jnp.asarray(perm, jnp.int32))
