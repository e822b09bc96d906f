"""Bit layouts of compressed-tensors (docs/formats.md, "On disk"), in vectorised numpy.

- pack-quantized: element i of a row occupies bits [i*b, i*b+b) of a little-endian stream of int32
  words; the stored value is q + 2**(b-1).
- fp4 (mxfp4/nvfp4): byte k holds code(2k) in its low nibble and code(2k+1) in its high nibble;
  code = sign << 3 | index into FP4_MAGNITUDES.
- E8M0 scale byte e means 2**(e - 127); 255 is NaN (OCP MX spec, as ml_dtypes.float8_e8m0fnu; compressed-tensors'
  own decoding gives inf there).

`fp4_decode` (and FP4_VALUES, its table) and `e8m0_decode` are the one definition of both decodings, shared by the
format code, the XLA path and the gmm_v2 kernel (docs/architecture.md, rule 9; quant/reference.py, the test oracle,
decodes independently). The decoders take the array module (numpy or jax.numpy) and use only selects and bit
operations, which Mosaic lowers inside a Pallas TPU kernel (no gather).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E8M0_NAN = 255


def fp4_decode(codes, xp=np):
    """e2m1 codes (integers whose low 4 bits are the code: bytes or int4 nibbles) -> float32 values, code 8
    -> -0.0. Builds the float32 bits: magnitude index i >= 2 is (1 + (i & 1) / 2) * 2**((i >> 1) - 1), whose
    exponent and top mantissa bit are (i + 252) << 22; i = 1 is 0.5 (exponent 126); the sign is code bit 3.
    xp: numpy or jax.numpy (int ops, selects and a bitcast, about 10 vector ops: no gather, which Mosaic lacks)."""
    c = codes.astype(xp.int32)
    i = c & 7
    mag = xp.where(i >= 2, (i + 252) << 22, xp.where(i == 1, 126 << 23, 0)).astype(xp.int32)
    return (mag | (c & 8) << 28).view(xp.float32)


FP4_VALUES = fp4_decode(np.arange(16))  # [code]: 0, 0.5, 1, 1.5, 2, 3, 4, 6, then their negatives
FP4_MAGNITUDES = FP4_VALUES[:8]


def e8m0_decode(e, xp=np):
    """E8M0 bytes (integers 0..255) -> float32 2**(e - 127), bit-exact: byte 0 -> 2**-127 (a subnormal),
    255 -> NaN. xp: numpy or jax.numpy (builds the float32 bit pattern: int ops, selects, a bitcast)."""
    e = e.astype(xp.int32)
    bits = xp.where(e == 0, 1 << 22, xp.where(e == E8M0_NAN, 0x7FC00000, e << 23))
    return bits.astype(xp.int32).view(xp.float32)


def unpack_int(packed: np.ndarray, num_bits: int, in_features: int) -> np.ndarray:
    """Unpacks pack-quantized int32 words to signed integers.

    Args:
        packed: int32 [..., ceil(in_features * num_bits / 32)].
        num_bits: 1..8.
        in_features: logical row length.
    Returns:
        int8 [..., in_features] with values in [-2**(b-1), 2**(b-1)).
    """
    words = np.ascontiguousarray(packed).astype("<i4", copy=False)
    raw = words.view(np.uint8).reshape(*packed.shape[:-1], -1)  # [..., 4 * words], little-endian
    if num_bits == 4:
        out = np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(*raw.shape[:-1], -1)
    elif num_bits == 8:
        out = raw
    else:
        bits = np.unpackbits(raw, axis=-1, bitorder="little")[..., : in_features * num_bits]
        bits = bits.reshape(*raw.shape[:-1], in_features, num_bits)
        out = (bits.astype(np.int16) << np.arange(num_bits, dtype=np.int16)).sum(-1)
    out = out[..., :in_features].astype(np.int16) - (1 << (num_bits - 1))
    return out.astype(np.int8)


def pack_int(q: np.ndarray, num_bits: int) -> np.ndarray:
    """Packs signed integers [..., n] (|q| < 2**(b-1)) into pack-quantized int32 words [..., ceil(n*b/32)].

    Bits past the last element are zero, as the library writes them.
    """
    n = q.shape[-1]
    words = -(-n * num_bits // 32)
    stored = (q.astype(np.int16) + (1 << (num_bits - 1))).astype(np.uint8)  # offset binary
    if num_bits == 4:
        stored = np.concatenate([stored, np.zeros((*q.shape[:-1], words * 8 - n), np.uint8)], axis=-1)
        raw = stored[..., 0::2] | (stored[..., 1::2] << 4)
    elif num_bits == 8:
        raw = np.concatenate([stored, np.zeros((*q.shape[:-1], words * 4 - n), np.uint8)], axis=-1)
    else:
        bits = np.unpackbits(stored[..., None], axis=-1, bitorder="little")[..., :num_bits]
        bits = bits.reshape(*q.shape[:-1], n * num_bits)
        bits = np.concatenate([bits, np.zeros((*q.shape[:-1], words * 32 - n * num_bits), np.uint8)], axis=-1)
        raw = np.packbits(bits, axis=-1, bitorder="little")
    return np.ascontiguousarray(raw).view("<i4").astype(np.int32, copy=False)


def fp4_codes(x: np.ndarray) -> np.ndarray:
    """Rounds float32 values (already clamped to [-6, 6]) to the nearest e2m1 code, ties to even.
    A negative value that rounds to zero becomes -0 (code 8), as the library stores it."""
    mag = np.abs(x)
    # Midpoints between neighbouring magnitudes; at a tie the even code (0, 1.0, 2.0, 4.0) wins,
    # hence <= at the midpoints below an even code and < below an odd one.
    idx = ((mag > 0.25).astype(np.uint8) + (mag >= 0.75) + (mag > 1.25) + (mag >= 1.75) + (mag > 2.5)
           + (mag >= 3.5) + (mag > 5.0))
    return idx | (x < 0).astype(np.uint8) << 3  # negative values that round to zero keep their sign


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """e2m1 codes [..., n] (n even) -> bytes [..., n/2], even column in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """fp4 e2m1 bytes [..., n/2] -> float32 values [..., n]."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return FP4_VALUES[codes]  # fp4_decode's table: a gather is faster in numpy


# e2m3 (MXFP6) magnitudes by 5-bit index: subnormals i/8, then (1 + m/8) * 2**e for e = 0, 1, 2
FP6_MAGNITUDES = np.array([i / 8 for i in range(8)] + [(1 + m / 8) * 2 ** e for e in range(3) for m in range(8)],
                          np.float32)


def unpack_fp6(packed: np.ndarray) -> np.ndarray:
    """mxfp6 bytes [..., 3n/4] -> float32 e2m3 values [..., n]: four 6-bit codes (sign in bit 5, magnitude
    index below) little-endian in each 3 bytes."""
    b = packed.reshape(*packed.shape[:-1], -1, 3).astype(np.int32)
    word = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16
    codes = np.stack([word >> shift & 0x3F for shift in (0, 6, 12, 18)], axis=-1).reshape(*packed.shape[:-1], -1)
    return np.where(codes & 0x20, -FP6_MAGNITUDES[codes & 0x1F], FP6_MAGNITUDES[codes & 0x1F])


def e8m0_to_float(scale: np.ndarray) -> np.ndarray:
    """E8M0 scale bytes (uint8 or float8_e8m0fnu) -> float32 2**(e-127); byte 255 -> NaN."""
    return e8m0_decode(np.asarray(scale).view(np.uint8))


def float_to_e8m0(scale: np.ndarray) -> np.ndarray:
    """Power-of-two float32 scales -> E8M0 bytes (exact)."""
    return (np.log2(scale).astype(np.int32) + 127).astype(np.uint8)


def expand_groups(scale: np.ndarray, group: int, in_features: int) -> np.ndarray:
    """Repeats per-group scales [..., G] along the last axis to [..., in_features]."""
    return np.repeat(scale, group, axis=-1)[..., :in_features]


def expand_blocks(scale: np.ndarray, block: tuple[int, int], shape: tuple[int, ...]) -> np.ndarray:
    """Repeats block scales [..., R, C] to the weight's [..., out, in]."""
    out, inp = shape[-2:]
    s = np.repeat(scale, block[0], axis=-2)[..., :out, :]
    return np.repeat(s, block[1], axis=-1)[..., :inp]


def to_dtype(x: np.ndarray, name: str) -> np.ndarray:
    """Casts float32 to a safetensors float dtype name (F32, F16, BF16)."""
    return x.astype({"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}[name])
