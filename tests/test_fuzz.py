"""Broken checkpoints get quantkit's own one-line errors, never an internal one (issue 66).

Hypothesis mutates tiny checkpoints the way a hand edit or a broken export leaves them: one config.json value
anywhere in it (the decoder's fields, text_config, quantization_config's groups and arguments) replaced by a
value of another type or out of range, or removed; a safetensors header's entry (dtype, shape, offsets) or its
length prefix; the shard index's map. `inspect`, `inspect --deep`, `convert` and the loader then either
succeed or raise a QuantkitError (exit 1 or 3, one line), each within 5 s.

The seeds: a Llama quantized W4A16 by the compressed-tensors library, a Qwen3-MoE and a Gemma 3 (layer types,
sliding window) converted by quantkit, sharded, Gemma 3 in bf16, and gpt-oss in OpenAI's MXFP4 layout. CI
runs a fixed derandomized sample (EXAMPLES, 40 a test); `QUANTKIT_FUZZ_EXAMPLES=3000` runs that many a test,
drawn at random (docs/benchmarks.md records a 6,000-checkpoint run).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ct_oracle import make_checkpoint
from helpers import family, pack_native
from quantkit.errors import QuantkitError

EXAMPLES = int(os.environ.get("QUANTKIT_FUZZ_EXAMPLES", "40"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize="QUANTKIT_FUZZ_EXAMPLES" not in os.environ,
                    database=None, suppress_health_check=list(HealthCheck))
SECONDS = 5.0

# what a wrong value is: another type, out of range, or not finite
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2**40, 2**40), st.sampled_from([0, -1, 1, 2**31, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["", "4096", "x", "int", "float8_e4m3fn"]),
    st.lists(st.integers(-3, 300), max_size=3), st.just({}), st.just({"a": 1}))


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, Path]:
    from quantkit.convert import convert

    root = tmp_path_factory.mktemp("seeds")
    out = {"llama_w4a16": make_checkpoint(root / "llama_w4a16", "W4A16")}
    for name in ("qwen3_moe", "gemma3"):
        torch.manual_seed(0)
        family(name).save_pretrained(root / f"{name}_src")
        out[name] = root / name
        convert(root / f"{name}_src", out[name], "W4A16", group_size=32, max_shard_bytes=40_000)
        assert (out[name] / "model.safetensors.index.json").exists()
    out["gemma3_bf16"] = root / "gemma3_src"
    torch.manual_seed(0)
    pack_native(family("gpt_oss"), root / "gpt_oss")
    out["gpt_oss"] = root / "gpt_oss"
    return out


def _paths(node, prefix=()) -> list[tuple]:
    """Every key path of a JSON tree (dict keys and list indices), parents before children."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out += _paths(v, (*prefix, k))
    return out


def _mutate(tree, data) -> str:
    """Replaces (or removes) the value at one drawn path of `tree`; returns what it did."""
    paths = _paths(tree)
    if not paths:
        return "nothing"
    path = data.draw(st.sampled_from(paths))
    parent = tree
    for k in path[:-1]:
        parent = parent[k]
    if isinstance(parent, dict) and data.draw(st.booleans().map(lambda b: b and len(path) > 1)):
        del parent[path[-1]]
        return f"removed {'.'.join(map(str, path))}"
    parent[path[-1]] = data.draw(VALUES)
    return f"{'.'.join(map(str, path))} = {parent[path[-1]]!r}"


def _dump(tree) -> str:
    return json.dumps(tree, allow_nan=True)


def _mutate_header(shard: Path, data) -> str:
    """One safetensors header entry replaced, or the header's length prefix or the file cut short."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, body = json.loads(raw[8:8 + n]), raw[8 + n:]
    how = data.draw(st.sampled_from(["entry", "entry", "entry", "length", "truncate"]))
    if how == "length":
        value = data.draw(st.sampled_from([0, 1, n - 1, n + 1, len(raw), 2**40]))
        shard.write_bytes(struct.pack("<Q", value) + raw[8:])
        return f"{shard.name}: header length {value}"
    if how == "truncate":
        cut = data.draw(st.integers(0, len(raw) - 1))
        shard.write_bytes(raw[:cut])
        return f"{shard.name}: cut at {cut}"
    what = _mutate(header, data)
    text = _dump(header).encode()
    shard.write_bytes(struct.pack("<Q", len(text)) + text + body)
    return f"{shard.name}: {what}"


def _copy(src: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def _actions(path: Path, out: Path):
    from quantkit.convert import convert
    from quantkit.inspect import inspect_checkpoint
    from quantkit.runtime.loader import load

    yield "inspect", lambda: inspect_checkpoint(path, "v6e")
    yield "inspect --deep", lambda: inspect_checkpoint(path, "v6e", True)
    yield "load", lambda: load(path)
    yield "convert", lambda: convert(path, out, "W4A16", group_size=32, force=True)


def _only_own_errors(path: Path, out: Path, what: str) -> None:
    for name, action in _actions(path, out):
        t0 = time.perf_counter()
        try:
            action()
        except QuantkitError as e:
            assert "\n" not in str(e), f"{name} after {what}: a message of several lines: {e}"
        except Exception as e:  # noqa: BLE001 - the failure this test looks for
            raise AssertionError(f"{name} after {what}: internal error {type(e).__name__}: {e}") from e
        took = time.perf_counter() - t0
        assert took < SECONDS, f"{name} after {what}: {took:.1f} s"


@SETTINGS
@given(data=st.data())
def test_a_mutated_config_gets_only_quantkits_errors(seeds, tmp_path_factory, data):
    """One config.json value anywhere (top level, text_config, quantization_config), of another type or out
    of range, or removed."""
    name = data.draw(st.sampled_from(sorted(seeds)))
    work = tmp_path_factory.getbasetemp() / "fuzz"
    path = _copy(seeds[name], work / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    what = f"{name}: config.json " + _mutate(cfg, data)
    (path / "config.json").write_text(_dump(cfg))
    _only_own_errors(path, work / "out", what)


@SETTINGS
@given(data=st.data())
def test_a_mutated_header_or_index_gets_only_quantkits_errors(seeds, tmp_path_factory, data):
    """A safetensors header's entry (or its length prefix, or the file cut short), or the shard index's map."""
    name = data.draw(st.sampled_from(sorted(seeds)))
    work = tmp_path_factory.getbasetemp() / "fuzz"
    path = _copy(seeds[name], work / "ckpt")
    index = path / "model.safetensors.index.json"
    if index.exists() and data.draw(st.booleans()):
        tree = json.loads(index.read_text())
        what = f"{name}: index " + _mutate(tree, data)
        index.write_text(_dump(tree))
    else:
        shard = data.draw(st.sampled_from(sorted(path.glob("*.safetensors"))))
        what = f"{name}: " + _mutate_header(shard, data)
    _only_own_errors(path, work / "out", what)


def test_a_wrong_config_field_is_named_in_one_line(seeds, tmp_path):
    """The issue's own two, `"num_hidden_layers": null` and `"hidden_size": "4096"`, through the CLI's inspect,
    convert, generate and serve: exit 1, one stderr line naming the field, what it holds and what it should."""
    import subprocess
    import sys

    from helpers import with_tokenizer

    for field_, value, expect in [("num_hidden_layers", None, "num_hidden_layers is null; expected a positive integer"),
                                  ("hidden_size", "4096", 'hidden_size is "4096"; expected a positive integer')]:
        path = _copy(seeds["qwen3_moe"], tmp_path / field_)
        with_tokenizer(path)
        cfg = json.loads((path / "config.json").read_text())
        cfg[field_] = value
        (path / "config.json").write_text(json.dumps(cfg))
        for args in (["inspect", str(path)], ["convert", str(path), str(tmp_path / "out"), "--force"],
                     ["generate", str(path), "--prompt", "hello"], ["serve", str(path), "--port", "0"]):
            done = subprocess.run([sys.executable, "-m", "quantkit.cli", *args], capture_output=True, text=True,
                                  timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 1 and len(lines) == 1 and expect in lines[0], (args, done.stderr)
            assert "internal error" not in done.stderr
