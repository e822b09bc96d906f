"""safetensors files: header parsing with full validation, and lazy (mmap) tensor reads.

The header is parsed here, not by the `safetensors` package, so that every malformed or hostile file
ends in one `InvalidInput` naming the file and the problem, and so that reading a header never touches
tensor data. Layout: u64 little-endian header length N, N bytes of JSON, then the data buffer, which
the tensors must cover exactly (contiguous, in bounds, no overlap, no hole), as the format requires.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from quantkit.errors import InvalidInput

# The safetensors reference implementation refuses headers above 100 MB; so do we.
MAX_HEADER_BYTES = 100_000_000
MAX_RANK = 8

# dtype name -> (bits per element, numpy dtype used to view the data). Sub-byte types (F4, F6) are
# returned as their raw packed bytes (uint8), since numpy has no packed sub-byte arrays.
DTYPES: dict[str, tuple[int, np.dtype]] = {
    "BOOL": (8, np.dtype(np.bool_)),
    "U8": (8, np.dtype(np.uint8)),
    "I8": (8, np.dtype(np.int8)),
    "U16": (16, np.dtype("<u2")),
    "I16": (16, np.dtype("<i2")),
    "U32": (32, np.dtype("<u4")),
    "I32": (32, np.dtype("<i4")),
    "U64": (64, np.dtype("<u8")),
    "I64": (64, np.dtype("<i8")),
    "F16": (16, np.dtype("<f2")),
    "BF16": (16, np.dtype(ml_dtypes.bfloat16)),
    "F32": (32, np.dtype("<f4")),
    "F64": (64, np.dtype("<f8")),
    "C64": (64, np.dtype("<c8")),
    "F8_E4M3": (8, np.dtype(ml_dtypes.float8_e4m3fn)),
    "F8_E5M2": (8, np.dtype(ml_dtypes.float8_e5m2)),
    "F8_E8M0": (8, np.dtype(ml_dtypes.float8_e8m0fnu)),
    "F6_E2M3": (6, np.dtype(np.uint8)),
    "F6_E3M2": (6, np.dtype(np.uint8)),
    "F4": (4, np.dtype(np.uint8)),
}
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its dtype name, shape and absolute byte range in `file`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_entry(name: str, entry: object, where: str) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(entry, dict):
        raise InvalidInput(f"{where}: tensor {name!r}: header entry is not an object")
    extra = set(entry) - {"dtype", "shape", "data_offsets"}
    if extra or len(entry) != 3:
        raise InvalidInput(
            f"{where}: tensor {name!r}: header entry must have exactly dtype, shape, data_offsets "
            f"(found {sorted(entry)})"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise InvalidInput(
            f"{where}: tensor {name!r}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})"
        )
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(
        _is_int(d) and d >= 0 for d in shape
    ):
        raise InvalidInput(
            f"{where}: tensor {name!r}: shape must be a list of at most {MAX_RANK} "
            f"non-negative integers, found {shape!r}"[:300]
        )
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
    ) or not 0 <= offsets[0] <= offsets[1]:
        raise InvalidInput(
            f"{where}: tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end, "
            f"found {offsets!r}"[:300]
        )
    numel = 1
    for d in shape:
        numel *= d
    bits = DTYPES[dtype][0]
    if (numel * bits) % 8:
        raise InvalidInput(
            f"{where}: tensor {name!r}: {numel} elements of {dtype} do not fill whole bytes"
        )
    if offsets[1] - offsets[0] != numel * bits // 8:
        raise InvalidInput(
            f"{where}: tensor {name!r}: shape {tuple(shape)} of {dtype} needs {numel * bits // 8} "
            f"bytes but data_offsets span {offsets[1] - offsets[0]}"
        )
    return dtype, tuple(shape), offsets[0], offsets[1]


class SafetensorsFile:
    """One .safetensors file: validated header on open, tensor data read lazily through mmap.

    Args:
        path: the file.
    Attributes:
        tensors: name -> TensorInfo, in file order.
        metadata: the `__metadata__` string map (empty if absent).
        size: file size in bytes.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._mmap: mmap.mmap | None = None
        self._fd: int | None = None
        where = str(self.path)
        try:
            with open(self.path, "rb") as f:
                self.size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                if len(head) < 8:
                    raise InvalidInput(
                        f"{where}: truncated: {self.size} bytes, too short for a safetensors header"
                    )
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER_BYTES:
                    raise InvalidInput(
                        f"{where}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit "
                        "(not a safetensors file, or corrupt)"
                    )
                if 8 + n > self.size:
                    raise InvalidInput(
                        f"{where}: header length {n} runs past the end of the file ({self.size} bytes): "
                        "the file is truncated or not safetensors"
                    )
                raw = f.read(n)
        except OSError as e:
            raise InvalidInput(f"{where}: cannot read: {e.strerror or e}") from None
        self.data_start = 8 + n
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise InvalidInput(f"{where}: header is not valid JSON: {str(e)[:200]}") from None
        if not isinstance(header, dict):
            raise InvalidInput(f"{where}: header is not a JSON object")
        meta = header.pop("__metadata__", {})
        if not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
        ):
            raise InvalidInput(f"{where}: __metadata__ must map strings to strings")
        self.metadata: dict[str, str] = meta

        entries = [(name, *_parse_entry(name, e, where)) for name, e in header.items()]
        # The data buffer must be covered exactly: sorted by offset, each tensor starts where the
        # previous ended, and the last ends at the end of the file.
        pos = 0
        for name, _, _, begin, end in sorted(entries, key=lambda e: (e[3], e[4])):
            if begin != pos:
                kind = "overlaps the previous tensor" if begin < pos else "leaves a gap before it"
                raise InvalidInput(
                    f"{where}: tensor {name!r}: data_offsets [{begin}, {end}] {kind} "
                    f"(expected to start at {pos})"
                )
            pos = end
        data_len = self.size - self.data_start
        if pos != data_len:
            what = "beyond the end of the file (truncated?)" if pos > data_len else "short of the end"
            raise InvalidInput(
                f"{where}: tensors end at data offset {pos} but the data buffer holds {data_len} "
                f"bytes: offsets point {what}"
            )
        self.tensors: dict[str, TensorInfo] = {
            name: TensorInfo(name, dt, shape, self.path, self.data_start + b, self.data_start + e)
            for name, dt, shape, b, e in entries
        }

    def read(self, name: str) -> np.ndarray:
        """Returns tensor `name` as a read-only numpy view of the mapped file (no copy).

        Sub-byte dtypes (F4, F6_*) come back as their packed bytes, a flat uint8 array.
        """
        info = self.tensors[name]
        if self._mmap is None:
            try:
                with open(self.path, "rb") as f:
                    if os.fstat(f.fileno()).st_size != self.size:
                        raise InvalidInput(f"{self.path}: file changed size since it was opened")
                    self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError as e:
                raise InvalidInput(f"{self.path}: cannot map: {e.strerror or e}") from None
        bits, np_dtype = DTYPES[info.dtype]
        if bits < 8 or bits % 8:
            return np.frombuffer(self._mmap, np.uint8, info.nbytes, info.start)
        arr = np.frombuffer(self._mmap, np_dtype, info.numel, info.start)
        return arr.reshape(info.shape)

    def read_rows(self, name: str, start: int, stop: int, flat: bool = False) -> np.ndarray:
        """Copies rows [start, stop) of tensor `name` (elements for 1-D) with pread: unlike read(),
        it leaves no mapped pages behind, so streaming a whole model keeps resident memory flat.
        flat: rows of the tensor seen as 2-D [all leading dims, last dim] (one expert's part of a 3-D
        expert tensor is a run of such rows)."""
        info = self.tensors[name]
        bits, np_dtype = DTYPES[info.dtype]
        shape = (math.prod(info.shape[:-1]), info.shape[-1]) if flat and len(info.shape) > 2 else info.shape
        rows = shape[0] if shape else 1
        row_bytes = info.nbytes // rows if rows else 0
        stop = min(stop, rows)
        n = (stop - start) * row_bytes
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except OSError as e:
                raise InvalidInput(f"{self.path}: cannot open: {e.strerror or e}") from None
        buf = bytearray(n)
        view, done = memoryview(buf), 0
        while done < n:
            got = os.preadv(self._fd, [view[done:]], info.start + start * row_bytes + done)
            if got == 0:
                raise InvalidInput(f"{self.path}: tensor {name!r} ends early: the file was truncated")
            done += got
        if bits % 8:
            return np.frombuffer(buf, np.uint8)
        return np.frombuffer(buf, np_dtype).reshape(stop - start, *shape[1:]) if shape else \
            np.frombuffer(buf, np_dtype).reshape(())

    def close(self) -> None:
        # Views handed out by read() keep the map alive until they are dropped.
        self._mmap = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_NAME_OF = {v[1]: k for k, v in DTYPES.items() if v[0] % 8 == 0 and k not in ("U8",)} | {np.dtype(np.uint8): "U8"}


def dtype_name(dtype: np.dtype) -> str:
    """safetensors dtype name of a numpy dtype (uint8 for packed sub-byte data)."""
    try:
        return _NAME_OF[np.dtype(dtype)]
    except KeyError:
        raise InvalidInput(f"dtype {dtype} has no safetensors name") from None


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Writes `tensors` to one .safetensors file (header padded to 8 bytes, data in insertion order)."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    pos = 0
    for name, arr in tensors.items():
        header[name] = {"dtype": dtype_name(arr.dtype), "shape": list(arr.shape), "data_offsets": [pos, pos + arr.nbytes]}
        pos += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())
