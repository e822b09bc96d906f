"""`quantkit convert`: stream a checkpoint tensor by tensor into compressed-tensors (or back to bf16).

Design:
1. Plan from headers only: validate SRC as inspect does (quantkit.runtime.validate), decide per tensor what to do
   (quantize / copy / dequantize), and compute every output tensor's dtype and shape, hence every
   shard's header and every tensor's byte offset, before any data is read.
2. Write into a temporary sibling directory: shard files are preallocated (a full disk fails at once),
   workers quantize row chunks and `pwrite` them at their offsets, so memory is bounded by the chunk
   size, not by the model, and workers need no coordination.
3. config.json, small files and quantkit_report.json, then one rename makes DST appear. Any error,
   Ctrl-C or SIGTERM removes the temporary directory; a SIGKILL leaves it behind but never a DST, and
   the next convert to the same DST removes it: its name carries the PID, start time and host of its
   maker, so only those whose maker is gone are removed.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quantkit.errors import InvalidInput, QuantkitError, Unsupported
from quantkit.formats import packing
from quantkit.formats.compressed_tensors import Scheme, match_name
from quantkit.formats.ct_tensors import FUSED, can_dequantize, dequantize, logical_shape
from quantkit.formats.ct_writer import (GROUPED, SCHEMES, divisor_hint, output_config, row_alignment, stored_layout, stored_row_range, stored_rows,
                                       writable_scheme)
from quantkit.formats.hf import (
    INDEX_NAME, PACKED_EXPERTS, Checkpoint, classify_module, default_exclusion,
    exclusion_pattern, group_modules, packed_experts,
)
from quantkit.formats.safetensors_io import DTYPES, FLOAT_DTYPES
from quantkit.quant.quantize import global_scale, quantize_rows
from quantkit.runtime.models import ARCHITECTURES
from quantkit.runtime.validate import Validation, unsupported_reason, validate_checkpoint

CHUNK_BYTES = 4 << 20  # float32 bytes of input per row chunk: small enough to stay in cache
REPORT_NAME = "quantkit_report.json"
# Each worker holds one row chunk and its temporaries: at most ~50 MB (measured: the mse observer on a
# 14336-wide bf16 chunk). 8 keep the peak under ~0.4 GB on any machine; more threads rarely help,
# since reading and writing share one disk.
MAX_DEFAULT_WORKERS = 8


def default_workers() -> int:
    """Worker threads when --workers is not given: one per core this process may use, at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_WORKERS))


@dataclass
class Job:
    """One unit of output: a quantized module, a copied tensor, or a dequantized module."""

    action: str  # "quantize" | "copy" | "dequantize"
    name: str  # output module (quantize/dequantize) or tensor (copy) name
    src: dict[str, str]  # param -> source tensor name
    shape: tuple[int, ...]  # logical shape of the weight / tensor
    dtype: str  # source float dtype (quantize), output dtype (dequantize) or stored dtype (copy)
    outputs: dict[str, tuple[str, tuple]] = field(default_factory=dict)  # out tensor -> (dtype, shape)
    scheme: Scheme | None = None  # dequantize: the source scheme
    bytes_in: int = 0
    row0: int = 0  # quantize: the weight's first row in its source tensor seen as 2-D (packed experts)
    gscale: float | None = None  # quantize to NVFP4: the weight's global scale (fused siblings share one)

    def nbytes_out(self) -> int:
        return sum(_nbytes(d, s) for d, s in self.outputs.values())


def _nbytes(dtype: str, shape: tuple) -> int:
    return math.prod(shape) * DTYPES[dtype][0] // 8


def _matches(name: str, patterns: list[str]) -> bool:
    return any(match_name(name, p) for p in patterns)


def plan(checked: Validation, scheme: str, group_size: int, ignore: list[str],
         quantize_lm_head: bool = False) -> tuple[list[Job], list[str]]:
    """Decides every output tensor from headers alone. Returns (jobs, config `ignore` list)."""
    ckpt, src_qc = checked.ckpt, checked.qc
    native = ckpt.native or {}
    if native.get("mxfp4") and not native["dequantized"]:  # MXFP4A16 (_open_source): the published bytes as
        # they are, under the compressed-tensors config they are equivalent to (formats/gpt_oss.py)
        return [Job("copy", n, {"tensor": n}, i.shape, i.dtype, {n: (i.dtype, i.shape)}, bytes_in=i.nbytes)
                for n, i in ckpt.tensors.items()], []
    if checked.raw is not None and src_qc is None:
        raise Unsupported(f"{ckpt.root}: quantized by {checked.raw.get('quant_method')!r}, which quantkit does "
                          "not read; convert the original weights")
    if src_qc is not None and scheme != "DENSE":
        fmt = src_qc.format
        raise InvalidInput(f"{ckpt.root}: already quantized ({fmt}); quantizing it again would compound the "
                           f"error. Convert the original weights, or use --scheme DENSE to get bf16 back")
    if src_qc is None and scheme == "DENSE" and not native.get("mxfp4"):
        raise InvalidInput(f"{ckpt.root}: not a compressed-tensors checkpoint; --scheme DENSE dequantizes one")
    jobs: list[Job] = []
    ignored: list[str] = [p for p in ignore if p.startswith("re:")]
    family = ARCHITECTURES.get(ckpt.architecture)
    packs_experts = family is not None and family.packed_experts  # its 3-D expert tensors: split per expert
    for module, pnames in group_modules(ckpt.tensors).items():
        params = {p: ckpt.tensors[n] for p, n in pnames.items()}
        kind, cls = classify_module(module, params)
        if scheme == "DENSE":
            sch = src_qc.scheme_for(module, cls) if cls is not None and src_qc is not None else None
            if sch is not None and sch.weights is not None and sch.format != "dense":
                jobs.append(_dequantize_job(ckpt, module, sch, pnames, params))
                continue
            jobs += [Job("copy", n, {"tensor": n}, ckpt.tensors[n].shape, ckpt.tensors[n].dtype)
                     for p, n in pnames.items() if p not in ("input_scale", "k_scale", "v_scale", "q_scale")]
            continue
        packed = params.get("tensor")
        if (packed is not None and packs_experts and len(packed.shape) == 3
                and module.rpartition(".")[2] in PACKED_EXPERTS and packed.dtype in FLOAT_DTYPES
                and not _matches(module, ignore)):  # split into per-expert Linears, as llm-compressor does
            jobs += [_quantize_job(name, pnames["tensor"], shape, packed.dtype, scheme, group_size, row0)
                     for name, row0, shape in packed_experts(module, packed.shape)]
            continue
        w = params.get("weight")
        quantize = cls == "Linear" and w is not None and len(w.shape) == 2 and w.dtype in FLOAT_DTYPES
        if quantize:
            reason = default_exclusion(module)
            if reason == "lm_head" and quantize_lm_head:
                reason = None
            if reason is None and _matches(module, ignore):
                reason = "--ignore"
            if reason is not None:
                quantize = False
                pattern = exclusion_pattern(module)
                if pattern is not None:  # one pattern per tower or part
                    ignored.append(pattern)
                elif not _matches(module, [p for p in ignore if p.startswith("re:")]):
                    ignored.append(module)
        for p, n in pnames.items():
            info = ckpt.tensors[n]
            if p == "weight" and quantize:
                jobs.append(_quantize_job(module, n, info.shape, info.dtype, scheme, group_size))
            else:
                jobs.append(Job("copy", n, {"tensor": n}, info.shape, info.dtype))
    for j in jobs:
        if j.action == "copy":
            j.outputs = {j.name: (j.dtype, j.shape)}
        j.bytes_in = _nbytes(j.dtype, j.shape) if j.action == "quantize" else \
            sum(ckpt.tensors[n].nbytes for n in j.src.values())
    if scheme != "DENSE" and not any(j.action == "quantize" for j in jobs):
        raise InvalidInput(f"{ckpt.root}: no Linear weight to quantize (all excluded or ignored)")
    if not quantize_lm_head and "lm_head" not in ignored:
        ignored.append("lm_head")  # tied embeddings: no tensor, but loaders still build an lm_head Linear
    return jobs, list(dict.fromkeys(ignored))


def _quantize_job(module: str, src: str, shape: tuple, dtype: str, scheme: str, group_size: int, row0: int = 0) -> Job:
    """Quantizes weight [out, in] of Linear `module`, rows row0.. of tensor `src` (seen as 2-D)."""
    out, inp = shape
    s = writable_scheme(scheme, group_size)
    g = s.weights.group_size if s.weights.strategy in ("group", "tensor_group") else 0
    if g and inp % g:
        raise InvalidInput(f"{src}: in_features {inp} is not divisible by group size {g}; "
                           + (f"{scheme} needs a multiple of {g}" if scheme not in GROUPED else divisor_hint(inp)))
    layout = stored_layout(s, (out, inp), dtype)
    return Job("quantize", module, {"weight": src}, (out, inp), dtype, {f"{module}.{q}": v for q, v in layout.items()},
               row0=row0)


def _dequantize_job(ckpt: Checkpoint, module: str, sch: Scheme, pnames: dict, params: dict) -> Job:
    if not can_dequantize(sch):
        reason = unsupported_reason(sch) or f"format {sch.format} with {sch.weights.strategy} scales"
        raise Unsupported(f"{module}: cannot dequantize: {reason}")
    shape = logical_shape({p: i.shape for p, i in params.items()},
                          ckpt.read(pnames["weight_shape"]) if "weight_shape" in pnames else None, sch.format)
    out_dtype = "BF16"
    read = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_global_scale", "weight_g_idx")
    src = {p: n for p, n in pnames.items() if p in read}
    outputs = {f"{module}.weight": (out_dtype, shape)}
    if "bias" in pnames:
        src_bias = pnames["bias"]
        outputs[src_bias] = (ckpt.tensors[src_bias].dtype, ckpt.tensors[src_bias].shape)
        src["bias"] = src_bias
    return Job("dequantize", module, src, shape, out_dtype, outputs, scheme=sch)


# ---- output shards ---------------------------------------------------------------------------------

@dataclass
class Shard:
    path: Path
    tensors: dict[str, tuple[str, tuple, int]]  # name -> (dtype, shape, absolute offset)
    size: int
    header: bytes = b""


def layout_shards(jobs: list[Job], out_dir: Path, max_shard_bytes: int) -> list[Shard]:
    """Assigns output tensors to shards in job order and fixes every header and offset."""
    groups: list[list[tuple[str, str, tuple]]] = [[]]
    used = 0
    for j in jobs:
        for name, (dtype, shape) in j.outputs.items():
            n = _nbytes(dtype, shape)
            if groups[-1] and used + n > max_shard_bytes:
                groups.append([])
                used = 0
            groups[-1].append((name, dtype, shape))
            used += n
    shards = []
    total = len(groups)
    for i, members in enumerate(groups):
        fname = "model.safetensors" if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        header, pos = {"__metadata__": {"format": "pt"}}, 0
        for name, dtype, shape in members:
            n = _nbytes(dtype, shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
            pos += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        start = 8 + len(raw)
        shard = Shard(out_dir / fname, {}, start + pos, len(raw).to_bytes(8, "little") + raw)
        for name, info in header.items():
            if name != "__metadata__":
                shard.tensors[name] = (info["dtype"], tuple(info["shape"]), start + info["data_offsets"][0])
        shards.append(shard)
    return shards


# ---- the work --------------------------------------------------------------------------------------

class _Writer:
    """pwrite-based writer over preallocated shard files; thread-safe."""

    def __init__(self, shards: list[Shard]):
        self.fds: dict[str, int] = {}
        self.where: dict[str, tuple[int, str, tuple, int]] = {}
        for s in shards:
            fd = os.open(s.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self.fds[str(s.path)] = fd
            try:
                os.posix_fallocate(fd, 0, s.size)
            except OSError as e:
                raise _disk_error(e, s.path, s.size) from None
            self._write(fd, s.header, 0, s.path)
            for name, (dtype, shape, off) in s.tensors.items():
                self.where[name] = (fd, dtype, shape, off)

    @staticmethod
    def _write(fd: int, data, offset: int, path) -> None:
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        view = memoryview(data).cast("B")
        while view:
            try:
                n = os.pwrite(fd, view, offset)
            except OSError as e:
                raise _disk_error(e, path, len(view)) from None
            view, offset = view[n:], offset + n

    def write(self, name: str, arr: np.ndarray, first_row: int = 0) -> None:
        """Writes rows of tensor `name` starting at row `first_row` (or raw bytes at byte offset)."""
        fd, dtype, shape, off = self.where[name]
        row_bytes = _nbytes(dtype, shape[1:]) if len(shape) > 1 else DTYPES[dtype][0] // 8
        self._write(fd, np.ascontiguousarray(arr), off + first_row * row_bytes, name)

    def close(self) -> None:
        for fd in self.fds.values():
            os.fsync(fd)
            os.close(fd)
        self.fds.clear()


def _disk_error(e: OSError, path, need: int) -> QuantkitError:
    import errno

    if e.errno == errno.ENOSPC:
        return InvalidInput(f"{path}: no space left on device (needed {need / 1e9:.2f} GB more); free space or "
                            "choose another DST")
    return InvalidInput(f"{path}: cannot write: {e.strerror or e}")


def _finite(name: str, x: np.ndarray) -> None:
    if not np.isfinite(x).all():  # numpy's isfinite reads bf16/f16/f32 without a copy
        bad = int((~np.isfinite(x)).sum())
        raise InvalidInput(f"{name}: {bad} NaN/Inf value(s) in the source weights; fix or drop this tensor first")


@dataclass
class Stats:
    ref2: float = 0.0  # sum of squared weights
    err2: float = 0.0  # sum of squared quantization error
    minmax_err2: float = 0.0

    def row(self, job: Job, scheme: str, bytes_out: int) -> dict:
        rel = math.sqrt(self.err2 / self.ref2) if self.ref2 else 0.0
        out = {"name": job.name, "action": job.action, "scheme": scheme if job.action == "quantize" else None,
               "shape": list(job.shape), "bytes_in": job.bytes_in, "bytes_out": bytes_out,
               "rel_error": rel, "sqnr_db": (10 * math.log10(self.ref2 / self.err2) if self.err2 else None)}
        if self.minmax_err2 and self.minmax_err2 != self.err2:
            out["rel_error_minmax"] = math.sqrt(self.minmax_err2 / self.ref2)
        return out


def _rows_per_chunk(row_elems: int, align: int) -> int:
    rows = max(1, CHUNK_BYTES // (4 * max(1, row_elems)))
    return max(align, rows // align * align)


def run_job(job: Job, ckpt: Checkpoint, writer: _Writer, scheme: str, group_size: int, observer: str,
            progress: Callable[[int], None]) -> dict:
    """Does one job in row chunks; returns its report row."""
    stats = Stats()
    if job.action == "copy":
        info = ckpt.tensors[job.src["tensor"]]
        rows = info.shape[0] if info.shape else 1
        whole = len(info.shape) <= 1 or DTYPES[info.dtype][0] % 8 or not info.nbytes  # small or sub-byte: at once
        step = rows if whole else max(1, CHUNK_BYTES // (info.nbytes // rows))
        for r0 in range(0, rows, step):
            part = ckpt.read_rows(job.src["tensor"], r0, r0 + step)
            if job.dtype in FLOAT_DTYPES:
                _finite(job.name, part)
            writer.write(job.name, part, r0)
            progress(part.nbytes)
        return stats.row(job, scheme, job.nbytes_out())

    if job.action == "quantize":
        s = writable_scheme(scheme, group_size)
        out, inp = job.shape
        step = _rows_per_chunk(inp, row_alignment(s))
        for r0 in range(0, out, step):
            rows = ckpt.read_rows(job.src["weight"], job.row0 + r0, job.row0 + min(out, r0 + step), flat=True)
            with np.errstate(invalid="ignore"):  # NaN weights are reported just below
                r = quantize_rows(rows, s.weights, observer, job.gscale)
            if not math.isfinite(r.ref2):
                _finite(job.src["weight"], rows.astype(np.float32))
            stats.ref2 += r.ref2
            stats.err2 += r.err2
            stats.minmax_err2 += r.minmax_err2
            for param, (arr, first) in stored_rows(s, r.values, r.scale, r0, job.shape,
                                                   DTYPES[job.dtype][1], r.zero, job.gscale).items():
                writer.write(f"{job.name}.{param}", arr, first)
            progress(rows.nbytes)
        return stats.row(job, scheme, job.nbytes_out())

    # dequantize: row chunks of the packed weight and its per-row (or per-block-row) scales
    sch, w = job.scheme, job.scheme.weights
    out = job.shape[0]
    step = _rows_per_chunk(job.shape[-1], row_alignment(sch))
    for r0 in range(0, out, step):
        r1 = min(out, r0 + step)
        part = {p: ckpt.read(n) if p == "weight_g_idx" else ckpt.read_rows(n, *stored_row_range(sch, p, r0, r1))
                for p, n in job.src.items() if p != "bias"}  # g_idx: one group number per input column
        deq = dequantize(sch, part, (r1 - r0, job.shape[-1]))
        _finite(job.name, deq)
        writer.write(f"{job.name}.weight", packing.to_dtype(deq, job.dtype), r0)
        progress(sum(a.nbytes for a in part.values()))
    if "bias" in job.src:
        writer.write(job.src["bias"], ckpt.read(job.src["bias"]))
    return stats.row(job, scheme, job.nbytes_out())


# ---- entry point -----------------------------------------------------------------------------------

SMALL_FILE_SKIP = {"config.json", INDEX_NAME, REPORT_NAME}


def _copy_small_files(src_root: Path, dst: Path) -> list[str]:
    """Copies tokenizer, generation config and other regular files that stay inside SRC."""
    copied = []
    root = src_root.resolve()
    for f in sorted(src_root.iterdir()):
        if f.name in SMALL_FILE_SKIP or f.suffix == ".safetensors" or not f.is_file():
            continue
        if not f.resolve().is_relative_to(root):
            continue  # a symlink leading outside SRC is not copied
        shutil.copyfile(f, dst / f.name)
        copied.append(f.name)
    return copied


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000000' -> bytes."""
    t = text.strip().upper()
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for u, m in units.items():
        if t.endswith(u):
            try:
                return int(float(t[: -len(u)]) * m)
            except ValueError:
                break
    try:
        return int(t)
    except ValueError:
        raise InvalidInput(f"cannot read size {text!r}; use e.g. 5GB or 500MB") from None


def convert(src: str | Path, dst: str | Path, scheme: str = "W4A16", group_size: int = 128,
            ignore: list[str] | None = None, observer: str = "minmax", workers: int | None = None,
            force: bool = False, quantize_lm_head: bool = False, max_shard_bytes: int = 5 * 10**9,
            progress: Callable[[int, int], None] | None = None) -> dict:
    """Converts SRC into a compressed-tensors checkpoint at DST (or back to bf16 with scheme DENSE).

    Args:
        src, dst: checkpoint directories.
        scheme: one of SCHEMES.
        group_size: W4A16 / W8A16 group size (> 0) or -1 for channel scales.
        ignore: module names or `re:` patterns to leave unquantized (recorded in `ignore`).
        observer: "minmax" or "mse".
        workers: threads quantizing tensors in parallel; None: default_workers().
        force: replace an existing DST.
        quantize_lm_head: also quantize lm_head.
        max_shard_bytes: output shard size limit.
        progress: called with (bytes done, total bytes).
    Returns:
        The report (also written to DST/quantkit_report.json).
    """
    workers = default_workers() if workers is None else workers
    _check_options(scheme, group_size, observer, workers)
    src, dst = Path(src), Path(dst)
    _check_paths(src, dst, force)
    checked = _open_source(src, scheme)
    ckpt = checked.ckpt
    jobs, ignored = plan(checked, scheme, group_size, list(ignore or []), quantize_lm_head)
    lossless = (ckpt.native or {}).get("mxfp4") and scheme == "MXFP4A16"

    dst.parent.mkdir(parents=True, exist_ok=True)
    stale = remove_stale_temporaries(dst)
    tmp = dst.parent / f".{dst.name}.quantkit-tmp-{_owner_tag()}"
    with _sigterm_as_interrupt():  # before anything is written
        try:
            tmp.mkdir()
            shards = layout_shards(jobs, tmp, max_shard_bytes)
            rows = _run_jobs(jobs, ckpt, shards, scheme, group_size, observer, workers, progress)
            _write_index(tmp, shards)
            config = ckpt.config if lossless else output_config(ckpt.config or {}, scheme, group_size, ignored)
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            copied = _copy_small_files(src, tmp)
            report = _report(src, dst, scheme, group_size, observer, workers, rows, ignored, copied, shards, stale)
            (tmp / REPORT_NAME).write_text(json.dumps(report, indent=1) + "\n")
            _publish(tmp, dst, force)
            return report
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _check_options(scheme: str, group_size: int, observer: str, workers: int) -> None:
    if scheme not in SCHEMES:
        raise InvalidInput(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if scheme == "FP8":
        raise Unsupported("FP8 (per-tensor weights with a static per-tensor input scale) needs calibration data "
                          "to set input_scale, which quantkit convert does not do; use FP8_DYNAMIC "
                          "(per-channel weights, dynamic per-token activations)")
    if scheme == "NVFP4":
        raise Unsupported("NVFP4 (fp4 activations relative to a static input_global_scale per layer) needs "
                          "calibration data to set input_global_scale, which quantkit convert does not do; use "
                          "NVFP4A16 (the same weights, bf16 activations) or quantize with llm-compressor")
    if scheme in GROUPED and not (group_size == -1 or group_size > 0):
        raise InvalidInput(f"--group-size {group_size}: use a positive group size or -1 for channel scales")
    if observer not in ("minmax", "mse"):
        raise InvalidInput(f"unknown observer {observer!r}; choose minmax or mse")
    if workers < 1:
        raise InvalidInput("--workers must be at least 1")


def _check_paths(src: Path, dst: Path, force: bool) -> None:
    if not src.is_dir():
        raise InvalidInput(f"{src}: not a checkpoint directory")
    rs, rd = src.resolve(), dst.resolve()
    if rs == rd or rd.is_relative_to(rs) or rs.is_relative_to(rd):
        raise InvalidInput(f"{dst}: DST must not be SRC or lie inside it (or contain it)")
    if dst.exists() and not force:
        raise InvalidInput(f"{dst}: already exists; pass --force to replace it")


def _open_source(src: Path, scheme: str) -> Validation:
    """SRC, once the checkpoint validation (the one inspect runs) finds no structural error in it. A gpt-oss
    MXFP4 checkpoint is read as its compressed-tensors equivalent for MXFP4A16 (copied as it is), else with
    its experts dequantized to bf16 (formats/gpt_oss.py)."""
    ckpt = Checkpoint.open(src)
    if (ckpt.native or {}).get("mxfp4") and scheme != "MXFP4A16":
        ckpt = Checkpoint.open(src, dequantize_native=True)
    checked = validate_checkpoint(ckpt)
    errors = [p for p in checked.all_problems() if p["severity"] == "error"]
    if errors:
        raise InvalidInput(f"{src}: {errors[0]['message']}" + (f" (and {len(errors) - 1} more problems; "
                           "see `quantkit inspect`)" if len(errors) > 1 else ""))
    return checked


def _absmax(rows: np.ndarray) -> float:
    """The largest |value| of float rows, exactly, from their bits (sign cleared: integer order is float order
    for finite values; NaN, above every finite one, makes it NaN)."""
    u = {2: np.uint16, 4: np.uint32}[rows.dtype.itemsize]
    bits = (np.ascontiguousarray(rows).view(u) & u(np.iinfo(u).max >> 1)).max(initial=0)
    return float(np.array(bits, u).view(rows.dtype).astype(np.float32))


def _global_scales(jobs: list[Job], ckpt: Checkpoint, pool: ThreadPoolExecutor, tick: Callable[[int], None]) -> None:
    """NVFP4: sets each quantize job's global scale from its weight's absmax (one pass over its rows), fused
    siblings (q/k/v, gate/up of one module) given the smallest of theirs, as llm-compressor writes them (vLLM
    fuses the siblings into one weight, which needs one global scale)."""
    quant = [j for j in jobs if j.action == "quantize"]

    def absmax(j: Job) -> float:
        out, inp = j.shape
        step, m = _rows_per_chunk(inp, 1), 0.0
        for r0 in range(0, out, step):
            rows = ckpt.read_rows(j.src["weight"], j.row0 + r0, j.row0 + min(out, r0 + step), flat=True)
            m = max(m, _absmax(rows))
            tick(rows.nbytes)
        return m

    for j, m in zip(quant, pool.map(absmax, quant)):
        j.gscale = float(global_scale(m, DTYPES[j.dtype][1]))
    family: dict[tuple, list[Job]] = {}
    for j in quant:
        parent, _, leaf = j.name.rpartition(".")
        names = next((names for names in FUSED if leaf in names), None)
        if names is not None:
            family.setdefault((parent, names), []).append(j)
    for siblings in family.values():
        shared = min(j.gscale for j in siblings)
        for j in siblings:
            j.gscale = shared


def _run_jobs(jobs: list[Job], ckpt: Checkpoint, shards: list[Shard], scheme: str, group_size: int, observer: str,
              workers: int, progress: Callable[[int, int], None] | None) -> list[dict]:
    """Runs every job on `workers` threads into the preallocated shards; returns the report rows in job order.
    NVFP4 first reads every weight once for its global scale (counted in the progress)."""
    nv = writable_scheme(scheme, group_size).format == "nvfp4-pack-quantized" if scheme != "DENSE" else False
    total = sum(j.bytes_in for j in jobs) + (sum(j.bytes_in for j in jobs if j.action == "quantize") if nv else 0)
    done = [0]
    lock = threading.Lock()

    def tick(n: int) -> None:
        with lock:
            done[0] += n
            if progress is not None:
                progress(done[0], total)

    writer = _Writer(shards)
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            if nv:
                _global_scales(jobs, ckpt, pool, tick)
            futures = [pool.submit(run_job, j, ckpt, writer, scheme, group_size, observer, tick) for j in jobs]
            try:
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    finally:
        writer.close()


# ---- temporaries: named after their maker, so that a killed convert's can be told apart and removed ----

_OWNED = re.compile(r"(?:tmp|old)-(?P<pid>\d+)-(?P<start>\d+)-[0-9a-f]{8}-(?P<host>.+)")


def _process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot, which tells a reused PID from the process
    that had it; "0" where /proc cannot say."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return "0"


def _owner_tag() -> str:
    """PID-START-RANDOM-HOST: what _OWNED reads back from a temporary's name."""
    return f"{os.getpid()}-{_process_start(os.getpid())}-{uuid.uuid4().hex[:8]}-{socket.gethostname()}"


def _alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    return start == "0" or _process_start(pid) in (start, "0")


def remove_stale_temporaries(dst: Path) -> list[dict]:
    """Removes what converts to DST killed on this host left beside it: temporary directories, and a
    replaced DST that --force had moved aside. Those of live processes (and other hosts) stay.

    Returns:
        [{path, pid, bytes}] for each one removed (bytes: disk space freed).
    """
    removed = []
    prefix = f".{dst.name}.quantkit-"
    for p in sorted(dst.parent.iterdir()):
        m = _OWNED.fullmatch(p.name[len(prefix):]) if p.name.startswith(prefix) else None
        if m is None or m["host"] != socket.gethostname() or _alive(int(m["pid"]), m["start"]):
            continue
        try:
            tree = p.rglob("*") if p.is_dir() and not p.is_symlink() else ()
            size = sum(f.lstat().st_blocks for f in [p, *tree]) * 512
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        except OSError:
            continue  # another convert removed it first, or it is not ours to remove
        removed.append({"path": str(p), "pid": int(m["pid"]), "bytes": size})
    return removed


@contextmanager
def _sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt, so that it cleans up as Ctrl-C does (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _write_index(tmp: Path, shards: list[Shard]) -> None:
    if len(shards) == 1:
        return
    weight_map = {name: s.path.name for s in shards for name in s.tensors}
    total = sum(s.size - len(s.header) for s in shards)
    (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2) + "\n")


def _publish(tmp: Path, dst: Path, force: bool) -> None:
    """Makes DST appear in one rename; with --force the old DST is moved aside first, then removed."""
    if dst.exists() or dst.is_symlink():
        if not force:
            raise InvalidInput(f"{dst}: appeared while converting; pass --force to replace it")
        old = dst.parent / f".{dst.name}.quantkit-old-{_owner_tag()}"
        os.rename(dst, old)
        os.rename(tmp, dst)
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
    else:
        os.rename(tmp, dst)


def _report(src, dst, scheme, group_size, observer, workers, rows, ignored, copied, shards, stale) -> dict:
    q = [r for r in rows if r["action"] == "quantize"]
    out = {
        "src": str(src), "dst": str(dst), "scheme": scheme,
        "group_size": group_size if scheme in GROUPED else None, "observer": observer, "workers": workers,
        "bytes_in": sum(r["bytes_in"] for r in rows), "bytes_out": sum(s.size for s in shards),
        "num_shards": len(shards), "quantized_tensors": len(q), "ignore": ignored, "copied_files": copied,
        "removed_stale": stale, "tensors": rows,
    }
    if q:
        ref = [r for r in q if r["rel_error"] is not None]
        out["mean_rel_error"] = sum(r["rel_error"] for r in ref) / len(ref)
        if observer == "mse":
            mm = [r.get("rel_error_minmax", r["rel_error"]) for r in ref]
            out["mean_rel_error_minmax"] = sum(mm) / len(mm)
    return out
