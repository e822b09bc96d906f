"""`quantkit convert` against the compressed-tensors library and transformers.

The library quantizes the same bf16 weights (ct_oracle.make_checkpoint, min-max observer): quantkit's
stored tensors must equal the library's bit for bit, the library must decompress quantkit's output to
exactly quantkit's own dequantization, and transformers must load and run it.
"""

import json
import os
import signal
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
from safetensors.torch import load_file, save_file

from ct_oracle import library_decompress_torch, make_checkpoint, read_tensors, tiny_llama
from helpers import rel_err
from quantkit.convert import convert
from quantkit.errors import InvalidInput, Unsupported
from quantkit.inspect import inspect_checkpoint

CASES = {  # our (scheme, group size) -> the oracle's scheme name
    ("W4A16", 128): "W4A16", ("W4A16", 32): "W4A16_G32", ("W4A16", -1): "W4A16_CHANNEL",
    ("W8A16", 128): "W8A16", ("FP8_DYNAMIC", 128): "FP8_DYNAMIC", ("FP8_BLOCK", 128): "FP8_BLOCK",
    ("MXFP4A16", 128): "MXFP4A16", ("W4A16_ASYM", 128): "W4A16_ASYM", ("W8A16_ASYM", 128): "W8A16_ASYM",
    ("MXFP8A16", 128): "MXFP8A16", ("NVFP4A16", 128): "NVFP4A16", ("W8A8", 128): "W8A8", ("W4A8", 128): "W4A8",
    ("W4AFP8", 128): "W4AFP8",
}
QUANTKIT = [sys.executable, "-m", "quantkit.cli"]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "tiny-llama"
    tiny_llama(0).save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    return path


@pytest.fixture(scope="module")
def big_src(tmp_path_factory):
    """Large enough that an mse convert runs for seconds: long enough to signal it mid-way."""
    path = tmp_path_factory.mktemp("big") / "big"
    tiny_llama(0, hidden=512, intermediate=2048, layers=4, vocab=4096).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory):
    root = tmp_path_factory.mktemp("out")
    return {case: convert(src, root / f"{case[0]}-{case[1]}", case[0], case[1]) and root / f"{case[0]}-{case[1]}"
            for case in CASES}


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    root = tmp_path_factory.mktemp("lib")
    return {name: make_checkpoint(root / name, name) for name in CASES.values()}


def _assert_same_bytes(ours_dir: Path, theirs_dir: Path) -> None:
    ours, theirs = read_tensors(ours_dir), read_tensors(theirs_dir)
    assert sorted(ours) == sorted(theirs)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and ours[name].shape == t.shape, name
        assert torch.equal(ours[name].contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: f"{c[0]}-g{c[1]}")
def test_tensors_equal_the_library_bit_for_bit(converted, library, case):
    _assert_same_bytes(converted[case], library[CASES[case]])


@pytest.mark.parametrize("case", [("W4A16", 128), ("FP8_BLOCK", 128), ("W4A16_ASYM", 128), ("NVFP4A16", 128)],
                         ids=lambda c: c[0])
def test_many_row_chunks_give_the_library_bytes(src, library, case, tmp_path, monkeypatch):
    """Chunks of 8-16 rows (block scales: 128, one block row) instead of whole tensors: every chunk's values
    and scales land at their own rows, in both directions (quantize, and DENSE's reads of block scales and of
    zero points packed 8 rows to a word)."""
    monkeypatch.setattr("quantkit.convert.CHUNK_BYTES", 4 * 512 * 8)  # 8 rows of float32 [*, 512]
    convert(src, tmp_path / "q", *case)
    _assert_same_bytes(tmp_path / "q", library[CASES[case]])
    convert(tmp_path / "q", tmp_path / "dense", "DENSE")
    ours = load_file(tmp_path / "dense" / "model.safetensors")
    for name, t in library_decompress_torch(library[CASES[case]]).items():
        assert torch.equal(ours[name].view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), name


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: f"{c[0]}-g{c[1]}")
def test_config_is_accepted_by_the_library_and_matches_its_schemes(converted, library, case):
    ours = json.loads((converted[case] / "config.json").read_text())["quantization_config"]
    theirs = json.loads((library[CASES[case]] / "config.json").read_text())["quantization_config"]
    ours_lib = QuantizationConfig.model_validate(ours)
    theirs_lib = QuantizationConfig.model_validate(theirs)
    assert ours["format"] == theirs["format"] and ours["ignore"] == theirs["ignore"] == ["lm_head"]
    a, b = ours_lib.config_groups["group_0"], theirs_lib.config_groups["group_0"]
    for field in ("weights", "input_activations", "output_activations"):
        fa, fb = getattr(a, field), getattr(b, field)
        assert (fa is None) == (fb is None), field
        if fa is not None:
            for k in ("num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic"):
                assert getattr(fa, k) == getattr(fb, k), (field, k)


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: f"{c[0]}-g{c[1]}")
def test_library_decompresses_ours_to_exactly_our_dense(converted, case, tmp_path):
    dense = tmp_path / "dense"
    convert(converted[case], dense, "DENSE")
    ours = load_file(dense / "model.safetensors")
    lib = library_decompress_torch(converted[case])
    assert len(lib) == 14
    for name, t in lib.items():
        assert ours[name].dtype == torch.bfloat16
        assert torch.equal(ours[name].view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), name
    assert inspect_checkpoint(dense)["format"] is None


@pytest.mark.parametrize("case,tol", [(("W4A16", 128), 0.3), (("W4A16", -1), 0.32), (("W8A16", 128), 0.022),
                                      (("FP8_DYNAMIC", 128), 0.1),
                                      (("MXFP4A16", 128), 0.32), (("MXFP8A16", 128), 0.07), (("NVFP4A16", 128), 0.24)],
                         ids=lambda c: str(c))
def test_transformers_loads_and_runs_dst(converted, library, src, case, tol):
    """Logits of transformers on our checkpoint equal its logits on the library's (same bytes), and stay
    close to the bf16 model. Tolerances: the relative logit error measured here (W4A16 g128 0.222, channel
    0.238, W8A16 g128 0.0168, FP8_DYNAMIC 0.070, MXFP4A16 0.243, MXFP8A16 0.053, NVFP4A16 0.185) plus about 30%
    headroom. They are about
    twice the per-weight relative error (4-bit 0.11, fp8 0.027) because this untrained random model has no redundancy to absorb
    weight noise, and transformers also quantizes FP8_DYNAMIC activations per token. A wrong scale or a
    misplaced nibble gives errors near 1."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # bf16 as the checkpoint: transformers' MXFP4 path decompresses to bf16 and cannot run float32
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)(ids).logits.float()
        ours = AutoModelForCausalLM.from_pretrained(converted[case], dtype=torch.bfloat16)(ids).logits.float()
        lib = AutoModelForCausalLM.from_pretrained(library[CASES[case]], dtype=torch.bfloat16)(ids).logits.float()
    assert torch.equal(ours, lib)
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert 0 < rel < tol, rel


@pytest.mark.parametrize("scheme", ["W4A16_ASYM", "MXFP6A16"])
def test_dense_of_activation_ordered_and_mxfp6_checkpoints_is_the_librarys(scheme, tmp_path):
    """--scheme DENSE of formats convert does not write: an activation-ordered GPTQ checkpoint (each column's
    scale and zero point by weight_g_idx; the reference: the library's dequantization of the permuted copy,
    columns put back) and MXFP6A16 (e2m3 codes, four in 3 bytes; the reference: the library's own), bit for
    bit in bf16."""
    from ct_oracle import library_convert_dequantize, make_actorder_checkpoint

    if scheme == "MXFP6A16":
        q = make_checkpoint(tmp_path / "q", scheme)
        ref = library_convert_dequantize(q, tmp_path / "ref")
    else:
        q, ref = make_actorder_checkpoint(tmp_path / "q", scheme)
    convert(q, tmp_path / "ours", "DENSE")
    ours, theirs = read_tensors(tmp_path / "ours"), read_tensors(ref)
    assert sorted(ours) == sorted(theirs)
    for name, t in theirs.items():
        assert torch.equal(ours[name].view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), name


@pytest.mark.parametrize("scheme", ["W4A16", "NVFP4A16"])
def test_mse_observer_lowers_error_and_stays_loadable(src, tmp_path, scheme):
    """The MSE search lowers every tensor's error below min-max's (NVFP4: over its local fp8 scales, the
    global scale kept), and the library decompresses the result to exactly our dense."""
    r = convert(src, tmp_path / "mse", scheme, 128, observer="mse")
    assert r["mean_rel_error"] < r["mean_rel_error_minmax"] * 0.97
    for t in r["tensors"]:
        if t["action"] == "quantize":
            assert t["rel_error"] <= t.get("rel_error_minmax", t["rel_error"]) + 1e-9
    dense = tmp_path / "dense"
    convert(tmp_path / "mse", dense, "DENSE")
    lib = library_decompress_torch(tmp_path / "mse")
    ours = load_file(dense / "model.safetensors")
    assert all(torch.equal(ours[n].view(torch.int16), t.view(torch.int16)) for n, t in lib.items())


def test_report_and_copied_files(converted, src):
    dst = converted[("W4A16", 128)]
    report = json.loads((dst / "quantkit_report.json").read_text())
    q = [t for t in report["tensors"] if t["action"] == "quantize"]
    assert len(q) == 14 and all(0.05 < t["rel_error"] < 0.2 and 14 < t["sqnr_db"] < 26 for t in q)
    assert (dst / "tokenizer_config.json").read_text() == (src / "tokenizer_config.json").read_text()
    assert (dst / "generation_config.json").exists()
    assert not list(dst.parent.glob(".*quantkit-tmp*"))


def test_workers_and_sharding_give_the_same_tensors(src, converted, tmp_path):
    r = convert(src, tmp_path / "sharded", "W4A16", 128, workers=2, max_shard_bytes=300_000)
    assert r["num_shards"] > 3 and r["workers"] == 2
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in (tmp_path / "sharded").glob("*.safetensors")}
    a, b = read_tensors(tmp_path / "sharded"), read_tensors(converted[("W4A16", 128)])
    assert sorted(a) == sorted(b) and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8))
                                          for n in a if a[n].dtype.itemsize == 1) and all(
        torch.equal(a[n], b[n]) for n in a if a[n].dtype.itemsize > 1)
    assert inspect_checkpoint(tmp_path / "sharded", deep=True)["exit_code"] == 0


def test_ignore_patterns_are_recorded_and_honoured_by_the_library(src, tmp_path):
    convert(src, tmp_path / "ign", "W4A16", 128, ignore=["re:.*down_proj", "model.layers.0.self_attn.q_proj"])
    qc = json.loads((tmp_path / "ign" / "config.json").read_text())["quantization_config"]
    assert "re:.*down_proj" in qc["ignore"] and "model.layers.0.self_attn.q_proj" in qc["ignore"]
    tensors = read_tensors(tmp_path / "ign")
    assert "model.layers.1.mlp.down_proj.weight" in tensors and "model.layers.0.self_attn.q_proj.weight" in tensors
    model = tiny_llama(0)
    apply_quantization_config(model, QuantizationConfig.model_validate(qc))
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            quantized = hasattr(m, "quantization_scheme")
            assert quantized == (f"{name}.weight_packed" in tensors), name


def test_moe_router_gates_stay_dense(tmp_path):
    import transformers

    cfg = transformers.Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      num_experts=4, num_experts_per_tok=2, vocab_size=256, head_dim=64)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "moe")
    convert(tmp_path / "moe", tmp_path / "moe-w4", "W4A16", 64)
    qc = json.loads((tmp_path / "moe-w4" / "config.json").read_text())["quantization_config"]
    assert sorted(qc["ignore"]) == ["lm_head", "model.layers.0.mlp.gate"]
    r = inspect_checkpoint(tmp_path / "moe-w4")
    kinds = {la["name"]: (la["kind"], la["path"]) for la in r["layers"]}
    assert kinds["model.layers.0.mlp.experts.3.down_proj"] == ("moe_experts", "gmm_v2")
    assert kinds["model.layers.0.mlp.gate"] == ("linear", "dense") and r["exit_code"] == 0
    assert len(library_decompress_torch(tmp_path / "moe-w4")) == 4 + 4 * 3


# ---- bad input: a clear error and no DST --------------------------------------------------------

def _no_dst(dst: Path) -> bool:
    return not dst.exists() and not list(dst.parent.glob(f".{dst.name}.quantkit-tmp*"))


def test_existing_dst_refused_then_forced(src, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep").write_text("x")
    with pytest.raises(InvalidInput, match="already exists; pass --force"):
        convert(src, dst, "W4A16")
    assert (dst / "keep").exists()
    convert(src, dst, "W4A16", force=True)
    assert not (dst / "keep").exists() and inspect_checkpoint(dst)["exit_code"] == 0
    with pytest.raises(InvalidInput, match="must not be SRC"):
        convert(src, src / "inside", "W4A16")


def test_group_size_that_does_not_divide(src, tmp_path):
    with pytest.raises(InvalidInput, match=r"down_proj.weight: in_features 512 is not divisible by group size 96; "
                                           r"group sizes that divide it: 16, 32, 64, 128, 256, 512, or -1"):
        convert(src, tmp_path / "g96", "W4A16", 96)
    assert _no_dst(tmp_path / "g96")


def test_nan_weights_leave_no_dst(src, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    t = load_file(bad / "model.safetensors")
    t["model.layers.1.mlp.up_proj.weight"][3, 7] = float("nan")
    save_file(t, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InvalidInput, match=r"model.layers.1.mlp.up_proj.weight: 1 NaN/Inf"):
        convert(bad, tmp_path / "out", "W4A16", workers=2)
    assert _no_dst(tmp_path / "out")


def test_quantized_source_and_fp8_static(converted, tmp_path):
    with pytest.raises(InvalidInput, match="already quantized"):
        convert(converted[("W4A16", 128)], tmp_path / "again", "MXFP4A16")
    for static in ("FP8", "NVFP4"):  # static activation scales (input_scale, input_global_scale)
        with pytest.raises(Unsupported, match="needs calibration"):
            convert(converted[("W4A16", 128)], tmp_path / static, static)
        assert _no_dst(tmp_path / static)
    assert _no_dst(tmp_path / "again")
    foreign = tmp_path / "gptq"  # another method's quantization_config: named, not parsed as compressed-tensors
    shutil.copytree(converted[("W4A16", 128)], foreign)
    cfg = json.loads((foreign / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (foreign / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Unsupported, match="quantized by 'gptq', which quantkit does not read"):
        convert(foreign, tmp_path / "dense", "DENSE")
    assert _no_dst(tmp_path / "dense")


def test_full_disk_is_a_clear_error(src, tmp_path, monkeypatch):
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(InvalidInput, match="no space left on device"):
        convert(src, tmp_path / "out", "W4A16")
    assert _no_dst(tmp_path / "out")


def test_cli_convert_errors_are_one_line(src, tmp_path):
    p = subprocess.run([*QUANTKIT, "convert", str(src), str(tmp_path / "o"), "--group-size", "96"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    p = subprocess.run([*QUANTKIT, "convert", str(src), str(tmp_path / "o"), "--scheme", "FP8"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 3 and "FP8_DYNAMIC" in p.stderr
    p = subprocess.run([*QUANTKIT, "convert", str(src), str(tmp_path / "o"), "--json"],
                       capture_output=True, text=True, timeout=120)
    report = json.loads(p.stdout)
    assert p.returncode == 0 and report["quantized_tensors"] == 14
    assert report["workers"] == min(len(os.sched_getaffinity(0)), 8)  # the default: available cores, at most 8


def test_workers_default_to_the_available_cores_at_most_8(src, tmp_path, monkeypatch):
    p = subprocess.run([*QUANTKIT, "convert", str(src), str(tmp_path / "three"), "--workers", "3"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "with 3 worker(s)" in p.stdout
    for cores, expected in ((range(64), 8), ({0, 5, 7}, 3)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: set(cores))
        assert convert(src, tmp_path / f"cores{len(cores)}", "W4A16")["workers"] == expected


def _tensors_written(shard: Path) -> tuple[int, int]:
    """(tensors holding data, tensors) of a shard convert is writing. Shards are preallocated (zeros) with
    their header written first; a tensor that still reads all zero has had nothing written (a quantized
    weight, a scale, a norm or an embedding of a random model is never all zero)."""
    import numpy as np

    with open(shard, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(n)) if n else {}
        except ValueError:  # caught between the file's creation and its header's write
            return 0, 0
    tensors = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
    written = sum(bool(np.fromfile(shard, np.uint8, b - a, offset=8 + n + a).any()) for a, b in tensors)
    return written, len(tensors)


def _shards_written(tmp: Path, known: set | None = None) -> tuple[int, int]:
    """(shards whose every tensor holds data, shards) in a convert's temporary directory; `known`: shards
    already found written, not read again (and those found now are added)."""
    known = set() if known is None else known
    files = sorted(tmp.glob("*.safetensors"))
    for f in files:
        if f not in known:
            written, tensors = _tensors_written(f)
            if written == tensors > 0:
                known.add(f)
    return len(known & set(files)), len(files)


@pytest.mark.slow
def test_killed_mid_convert_never_leaves_a_dst_and_the_next_one_completes(tmp_path):
    """SIGKILL once one shard has been written, then once half of them have, each while others are still
    being written: DST never exists; each convert to the same DST removes the temporary the killed one left,
    and the one left to finish publishes a complete checkpoint."""
    src = tmp_path / "src"
    tiny_llama(0, hidden=512, intermediate=2048, layers=4, vocab=4096).save_pretrained(src)
    dst = tmp_path / "dst"
    cmd = [*QUANTKIT, "convert", str(src), str(dst), "--observer", "mse", "--max-shard-size", "1MB"]  # 14 shards

    def temps() -> set[Path]:
        return set(tmp_path.glob(".dst.quantkit-tmp-*"))

    dead = []
    for kill_after in (1, 7):
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline, known = time.time() + 120, set()
            while True:  # the temporary appears once the source is planned; its shards right after
                tmp = [t for t in temps() if t not in dead]
                if tmp and _shards_written(tmp[0], known)[0] >= kill_after:
                    break
                assert p.poll() is None, f"convert ended before it could be killed: {p.stderr.read()}"
                assert time.time() < deadline, "no shard written within 120 s"
                time.sleep(0.01)
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=60)
        finally:
            p.kill()
            p.wait()
        assert p.returncode == -signal.SIGKILL
        assert not dst.exists()
        (tmp,) = [t for t in temps() if t not in dead]
        done, total = _shards_written(tmp)
        assert total == 14 and kill_after <= done < total, (done, total)  # killed while writing, not after
        assert not (tmp / "quantkit_report.json").exists()
        for earlier in dead:
            assert not earlier.exists()  # this convert removed it before writing its own
        dead.append(tmp)

    p = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert [t["path"] for t in r["removed_stale"]] == [str(dead[-1])]
    assert f"removed stale temporary {dead[-1]}" in p.stderr
    assert temps() == set()
    assert inspect_checkpoint(dst, deep=True)["exit_code"] == 0 and (dst / "quantkit_report.json").exists()
    shards = sorted(dst.glob("*.safetensors"))
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert r["num_shards"] == len(shards) == 14 and set(index.values()) == {f.name for f in shards}
    assert _shards_written(dst) == (14, 14)


def test_sigterm_cleans_up(tmp_path, big_src):
    dst = tmp_path / "dst"
    p = subprocess.Popen([*QUANTKIT, "convert", str(big_src), str(dst), "--observer", "mse"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not list(tmp_path.glob(".dst.quantkit-tmp*")) and time.time() < deadline:
        time.sleep(0.05)  # the handler is installed right after the temporary directory appears
    time.sleep(0.3)
    assert p.poll() is None, "conversion finished before it could be interrupted"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "interrupted" in err
    assert _no_dst(dst)


def test_next_convert_removes_what_a_killed_one_left(tmp_path, src, big_src):
    """A SIGKILLed convert's temporary directory is removed by the next convert to the same DST, which says
    so; a live (here stopped) convert's stays, as does one from another host, whose process cannot be checked."""
    dst = tmp_path / "dst"

    def temps() -> set[Path]:
        return set(tmp_path.glob(".dst.quantkit-tmp-*"))

    def start_and_wait_for_its_shard() -> tuple[subprocess.Popen, Path]:
        before = temps()
        p = subprocess.Popen([*QUANTKIT, "convert", str(big_src), str(dst), "--observer", "mse"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while not [f for t in temps() - before for f in t.glob("*.safetensors")]:
            assert p.poll() is None and time.time() < deadline, "convert ended before it could be signalled"
            time.sleep(0.02)
        (tmp,) = temps() - before
        return p, tmp

    live, live_tmp = start_and_wait_for_its_shard()
    live.send_signal(signal.SIGSTOP)
    try:
        killed, dead_tmp = start_and_wait_for_its_shard()
        killed.kill()
        killed.wait()
        host = socket.gethostname()
        reused = tmp_path / f".dst.quantkit-tmp-{os.getpid()}-1-0123abcd-{host}"  # a live PID, not the maker's start
        foreign = tmp_path / f".dst.quantkit-tmp-{killed.pid}-1-0123abcd-not-{host}"
        reused.mkdir()
        foreign.mkdir()
        p = subprocess.run([*QUANTKIT, "convert", str(src), str(dst), "--json"], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr
        removed = {r["path"]: r for r in json.loads(p.stdout)["removed_stale"]}
        assert sorted(removed) == sorted([str(dead_tmp), str(reused)])
        assert removed[str(dead_tmp)]["pid"] == killed.pid and removed[str(dead_tmp)]["bytes"] > 10**6
        assert f"removed stale temporary {dead_tmp} (" in p.stderr and "left by a killed convert" in p.stderr
        assert not dead_tmp.exists() and not reused.exists() and live_tmp.exists() and foreign.exists()
        assert inspect_checkpoint(dst)["exit_code"] == 0
    finally:
        live.kill()
        live.wait()


def _family(name):
    import transformers as T

    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=256, head_dim=64)
    if name == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**common))
    if name == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(**common))
    if name == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**common))
    if name == "gemma2":
        return T.Gemma2ForCausalLM(T.Gemma2Config(**common))
    if name == "gemma3":
        return T.Gemma3ForCausalLM(T.Gemma3TextConfig(**common))
    if name == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(**{**common, "num_local_experts": 4, "num_experts_per_tok": 2}))
    if name == "deepseek_v3":
        return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, vocab_size=256, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=32,
            qk_nope_head_dim=32, v_head_dim=32, n_group=1, topk_group=1))
    raise KeyError(name)


FAMILIES = ["qwen2", "qwen3", "mistral", "gemma2", "gemma3", "mixtral", "deepseek_v3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_families_quantize_exactly_what_the_library_targets(family, tmp_path):
    """Every Linear of the language model is quantized except lm_head and MoE routers; applying our
    config with the library to the same model marks exactly the modules we quantized; transformers runs it,
    close to the bf16 model: relative logit error within 0.33 (measured 0.14-0.25, gemma2/gemma3 the
    highest, plus about 30% headroom, as in test_transformers_loads_and_runs_dst; another model's weights
    give ~1.4)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = _family(family).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "src")
    r = convert(tmp_path / "src", tmp_path / "dst", "W4A16", 32)
    tensors = read_tensors(tmp_path / "dst")
    qc = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    fresh = _family(family)
    apply_quantization_config(fresh, QuantizationConfig.model_validate(qc))
    linears = [n for n, m in fresh.named_modules() if isinstance(m, torch.nn.Linear)]
    for name in linears:
        ours = f"{name}.weight_packed" in tensors
        assert ours == hasattr(fresh.get_submodule(name), "quantization_scheme"), name
        assert ours == (name.rsplit(".", 1)[-1] not in ("lm_head", "gate")), name
    on_disk = {n.removesuffix(".weight_packed") for n in tensors if n.endswith(".weight_packed")}
    # transformers fuses MoE experts in memory (not Linear modules); on disk they are per-expert Linears
    assert all(n in linears or ".experts." in n for n in on_disk)
    assert r["quantized_tensors"] == len(on_disk) > 0
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.bfloat16)(ids).logits
        want = model.eval()(ids).logits
    assert logits.shape == want.shape and rel_err(logits.float(), want.float()) < 0.33


def test_vision_tower_stays_dense_and_transformers_loads_multimodal(tmp_path):
    import transformers as T

    text = T.Gemma3TextConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, vocab_size=300, head_dim=64)
    vision = T.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=32, patch_size=8)
    cfg = T.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
                         boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    src = T.Gemma3ForConditionalGeneration(cfg).to(torch.bfloat16)
    src.save_pretrained(tmp_path / "src")
    r = convert(tmp_path / "src", tmp_path / "dst", "W4A16", 32)
    qc = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["re:.*vision_tower\\.", "lm_head"] and r["quantized_tensors"] == 14
    fresh = T.Gemma3ForConditionalGeneration(cfg)
    apply_quantization_config(fresh, QuantizationConfig.model_validate(qc))
    marked = [n for n, m in fresh.named_modules() if isinstance(m, torch.nn.Linear) and hasattr(m, "quantization_scheme")]
    assert len(marked) == 14 and all("language_model" in n for n in marked)
    ids = torch.randint(0, 290, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = T.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "dst", dtype=torch.bfloat16)(
            input_ids=ids).logits
        want = src.eval()(input_ids=ids).logits
    # close to the bf16 model: measured 0.23 relative (W4A16 g32 of a random model), plus ~30% headroom
    assert logits.shape == (1, 8, 300) and rel_err(logits.float(), want.float()) < 0.3


@pytest.mark.parametrize("case", [("W4A16", 128), ("W4A16", -1), ("W8A16", 128), ("FP8_DYNAMIC", 128),
                                  ("MXFP4A16", 128), ("W4A16_ASYM", 128), ("W8A16_ASYM", 128), ("MXFP8A16", 128),
                                  ("NVFP4A16", 128)],
                         ids=lambda c: f"{c[0]}-g{c[1]}")
def test_library_convert_checkpoint_dequantizes_ours_like_our_dense(converted, case, tmp_path):
    """The library's model-free path (convert_checkpoint + CompressedTensorsDequantizer) on our output. (It is
    also how zero-point checkpoints reach transformers: transformers 5.24 loads a packed asymmetric
    checkpoint, the library's own included, with its zero points re-initialised: a size mismatch it only
    warns about.)"""
    from ct_oracle import library_convert_dequantize

    library_convert_dequantize(converted[case], tmp_path / "lib")
    convert(converted[case], tmp_path / "ours", "DENSE")
    lib, ours = read_tensors(tmp_path / "lib"), read_tensors(tmp_path / "ours")
    assert sorted(lib) == sorted(ours)
    for name, t in lib.items():
        assert torch.equal(ours[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name
