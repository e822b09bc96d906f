"""The e2m1 and E8M0 decodings (formats/packing.py, shared by the production paths; quant/reference.py, the
kernels' oracle) against the format oracles, for every code and byte: ml_dtypes' float4_e2m1fn and
float8_e8m0fnu (the OCP MX spec: E8M0 byte 255 is NaN) and compressed-tensors' own decoders. Bit-exact,
the sign of zero included."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from compressed_tensors.compressors.mx_utils import decompress_mx_scale
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

from quantkit.formats import packing
from quantkit.quant.qtensor import make_qtensor
from quantkit.quant.reference import decode_scales, decode_values


def _same(got, want):
    got, want = np.asarray(got, np.float32).ravel(), np.asarray(want, np.float32).ravel()
    np.testing.assert_array_equal(got, want)  # NaN matches NaN
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # -0.0 is not 0.0


def test_fp4_decodings_agree_with_the_format():
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    library = unpack_fp4_from_uint8(torch.from_numpy(packing.pack_fp4(codes)[None]), 1, 16, torch.float32)
    _same(library.numpy(), want)
    _same(packing.FP4_VALUES, want)
    _same(packing.fp4_decode(codes), want)
    _same(packing.fp4_decode(jnp.asarray(codes), jnp), want)
    _same(packing.unpack_fp4(packing.pack_fp4(codes)), want)
    # the QTensor storage: codes as two's-complement int4 nibbles
    nibbles = np.where(codes >= 8, codes.astype(np.int8) - 16, codes).reshape(1, 16, 1)
    qt = make_qtensor(nibbles, np.full((1, 1, 1), 127, np.uint8), "mxfp4", 16)
    _same(packing.fp4_decode(qt.values, jnp), want)
    _same(decode_values(qt), want)


def test_e8m0_decodings_agree_with_the_format():
    e = np.arange(256, dtype=np.uint8)
    want = e.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    assert np.isnan(want[255]) and want[0] == 2.0 ** -127 and want[127] == 1.0
    # compressed-tensors decodes 255 as 2**128 = inf; the spec (and ml_dtypes) says NaN, which we follow
    _same(decompress_mx_scale(torch.from_numpy(e[:255])).float().numpy(), want[:255])
    _same(packing.e8m0_to_float(e), want)
    _same(packing.e8m0_to_float(e.view(ml_dtypes.float8_e8m0fnu)), want)
    _same(packing.e8m0_decode(jnp.asarray(e), jnp), want)
    _same(decode_scales(make_qtensor(np.zeros((1, 256, 1), np.int8), e.reshape(1, 256, 1), "mxfp4", 1)), want)
