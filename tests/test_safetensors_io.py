"""The safetensors reader against the `safetensors` library's own files, and against hostile files."""

import json
import struct
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from quantkit.errors import InvalidInput, QuantkitError
from quantkit.formats.hf import Checkpoint
from quantkit.formats.safetensors_io import SafetensorsFile

TORCH_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}


def _raw(header: dict, data: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_reads_every_dtype_written_by_the_safetensors_library(tmp_path, name):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # hash() varies per process
    x = torch.randn(3, 5, generator=g, dtype=torch.float32) * 4
    if name == "F8_E8M0":
        t = torch.randint(0, 255, (3, 5), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    elif name == "BOOL":
        t = x > 0
    else:
        t = x.to(TORCH_DTYPES[name])
    save_file({"a": t, "b": torch.arange(7, dtype=torch.int32)}, tmp_path / "m.safetensors")
    f = SafetensorsFile(tmp_path / "m.safetensors")
    assert f.tensors["a"].dtype == name and f.tensors["a"].shape == (3, 5)
    assert f.read("a").tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes()
    np.testing.assert_array_equal(f.read("b"), np.arange(7, dtype=np.int32))


def test_bf16_and_fp8_values_decode(tmp_path):
    t = torch.tensor([[1.5, -2.0, 448.0]], dtype=torch.float32)
    save_file({"w": t.to(torch.bfloat16), "q": t.to(torch.float8_e4m3fn)}, tmp_path / "m.safetensors")
    f = SafetensorsFile(tmp_path / "m.safetensors")
    assert f.read("w").dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(f.read("w").astype(np.float32), t.numpy())
    np.testing.assert_array_equal(f.read("q").astype(np.float32), t.numpy())


def test_f4_is_packed_bytes(tmp_path):
    (tmp_path / "m.safetensors").write_bytes(_raw({"x": {"dtype": "F4", "shape": [2, 4], "data_offsets": [0, 4]}},
                                                  bytes([0x10, 0x32, 0x54, 0x76])))
    f = SafetensorsFile(tmp_path / "m.safetensors")
    assert f.read("x").tolist() == [0x10, 0x32, 0x54, 0x76]


BAD = {
    "truncated": (b"\x05\x00\x00", "truncated"),
    "header past end": (struct.pack("<Q", 500) + b"{}", "runs past the end"),
    "huge header": (struct.pack("<Q", 2**63) + b"{}", "exceeds"),
    "not json": (struct.pack("<Q", 4) + b"{{{{", "not valid JSON"),
    "not object": (_raw([1, 2]), "not a JSON object"),
    "unknown dtype": (_raw({"x": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}, b"\0"), "unknown dtype"),
    "overlap": (_raw({"x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                      "y": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"\0" * 3), "overlaps"),
    "gap": (_raw({"x": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}, b"\0" * 2), "gap"),
    "out of bounds": (_raw({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8), "beyond"),
    "size mismatch": (_raw({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8), "needs 12"),
    "negative dim": (_raw({"x": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}), "shape"),
    "bool dim": (_raw({"x": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"\0"), "shape"),
    "reversed offsets": (_raw({"x": {"dtype": "U8", "shape": [0], "data_offsets": [2, 1]}}), "data_offsets"),
    "extra key": (_raw({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "z": 1}}, b"\0"), "exactly"),
    "bad metadata": (_raw({"__metadata__": {"a": 1}}), "__metadata__"),
    "duplicate key": (struct.pack("<Q", 105) + b'{"x":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},'
                      b'"x":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}', "duplicate key"),
    "half byte": (_raw({"x": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, b"\0\0"), "whole bytes"),
    "deep json": (struct.pack("<Q", 200000) + b"[" * 100000 + b"]" * 100000, "not valid JSON"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_corrupt_files_raise_one_line_invalid_input(tmp_path, case):
    raw, expect = BAD[case]
    p = tmp_path / "bad.safetensors"
    p.write_bytes(raw)
    with pytest.raises(InvalidInput) as e:
        SafetensorsFile(p)
    msg = str(e.value)
    assert expect in msg and str(p) in msg and "\n" not in msg


def _index(tmp_path, weight_map):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_sharded_checkpoint_via_index(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "s1.safetensors")
    save_file({"b": torch.ones(3)}, tmp_path / "s2.safetensors")
    _index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"})
    ck = Checkpoint.open(tmp_path)
    assert sorted(ck.tensors) == ["a", "b"] and len(ck.files) == 2
    np.testing.assert_array_equal(ck.read("b"), np.ones(3, np.float32))


@pytest.mark.parametrize("shard,expect", [
    ("../outside.safetensors", "outside the checkpoint"),
    ("/etc/passwd", "outside the checkpoint"),
    ("missing.safetensors", "does not exist"),
    ("sub/../../outside.safetensors", "outside the checkpoint"),
])
def test_index_pointing_outside_or_missing_is_refused(tmp_path, shard, expect):
    ck_dir = tmp_path / "ck"
    ck_dir.mkdir()
    save_file({"a": torch.zeros(2)}, tmp_path / "outside.safetensors")
    _index(ck_dir, {"a": shard})
    with pytest.raises(InvalidInput, match=expect):
        Checkpoint.open(ck_dir)


def test_symlinked_shard_escaping_directory_is_refused(tmp_path):
    ck_dir = tmp_path / "ck"
    ck_dir.mkdir()
    save_file({"a": torch.zeros(2)}, tmp_path / "outside.safetensors")
    (ck_dir / "s.safetensors").symlink_to(tmp_path / "outside.safetensors")
    _index(ck_dir, {"a": "s.safetensors"})
    with pytest.raises(InvalidInput, match="outside the checkpoint"):
        Checkpoint.open(ck_dir)


def test_index_naming_wrong_shard_and_duplicates(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "s1.safetensors")
    save_file({"a": torch.zeros(2)}, tmp_path / "s2.safetensors")
    _index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"})
    with pytest.raises(InvalidInput, match="also appears"):
        Checkpoint.open(tmp_path)
    (tmp_path / "s2.safetensors").unlink()
    save_file({"c": torch.zeros(2)}, tmp_path / "s2.safetensors")
    with pytest.raises(InvalidInput, match="does not hold it"):
        Checkpoint.open(tmp_path)


def test_non_json_config_and_index(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InvalidInput, match="config.json: not valid JSON"):
        Checkpoint.open(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(InvalidInput, match="expected a JSON object"):
        Checkpoint.open(tmp_path)


# ---- property: any mutation of a valid header either parses or raises our own error ----------------

def _valid_file() -> bytes:
    header = {
        "__metadata__": {"format": "pt"},
        "w": {"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 64]},
        "s": {"dtype": "F32", "shape": [4, 1], "data_offsets": [64, 80]},
        "p": {"dtype": "I32", "shape": [4, 2], "data_offsets": [80, 112]},
    }
    return _raw(header, bytes(range(112)))


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_headers_parse_or_raise_quantkit_error(tmp_path_factory, data):
    raw = bytearray(_valid_file())
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete", "length"]))
        if op == "length":
            raw[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
            continue
        if not raw:
            break
        i = data.draw(st.integers(0, len(raw) - 1))
        if op == "flip":
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set":
            raw[i] = data.draw(st.sampled_from(b'{}[]",:0123456789-eE.tfn \\\xff'))
        elif op == "truncate":
            del raw[i:]
        elif op == "insert":
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del raw[i]
    path = tmp_path_factory.mktemp("fuzz") / "m.safetensors"
    path.write_bytes(bytes(raw))
    try:
        f = SafetensorsFile(path)
        for name in f.tensors:
            f.read(name)
    except QuantkitError as e:  # anything else propagates and fails the test
        assert "\n" not in str(e) and str(path) in str(e)


def test_writer_output_loads_in_the_safetensors_library(tmp_path):
    from safetensors.torch import load_file

    from quantkit.formats.safetensors_io import write_safetensors

    rng = np.random.default_rng(0)
    arrays = {
        "bf16": rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16),
        "fp8": rng.standard_normal((5,)).astype(ml_dtypes.float8_e4m3fn),
        "i32": rng.integers(-2**31, 2**31 - 1, (2, 3), dtype=np.int32),
        "u8": rng.integers(0, 255, (7,), dtype=np.uint8),
        "f32": rng.standard_normal((1,)).astype(np.float32),
    }
    write_safetensors(tmp_path / "m.safetensors", arrays, {"format": "pt"})
    loaded = load_file(tmp_path / "m.safetensors")
    assert loaded["bf16"].dtype == torch.bfloat16 and loaded["fp8"].dtype == torch.float8_e4m3fn
    for name, arr in arrays.items():
        assert loaded[name].contiguous().view(torch.uint8).numpy().tobytes() == arr.tobytes(), name
