"""`quantkit generate`: the library function against transformers' greedy generate; the command prints what it
returns, and where libtpu is installed but no TPU attached it picks the CPU quietly, saying so in one line."""

import os
import re
import subprocess
import sys

import jax.numpy as jnp
import pytest
import torch
import transformers as T

from helpers import with_tokenizer
from quantkit.generate import generate
from quantkit.runtime.backend import choose_backend, tpu_chips, tpu_device_files
from quantkit.runtime.tokenizer import TextCodec

PROMPT = "hello world, the quick"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("generate") / "llama"
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                             head_dim=16, max_position_embeddings=256))
    model.save_pretrained(path)
    with_tokenizer(path)
    return path, model.eval()


def test_greedy_tokens_equal_transformers(checkpoint):
    """float32 greedy tokens equal transformers' (up to its end-of-sequence token, which ours leaves out); a
    stop string taken from that text cuts it there."""
    path, ref = checkpoint
    codec = TextCodec(path)
    ids = codec.encode(PROMPT)
    with torch.no_grad():
        hf = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(ids):]
    hf = hf.tolist()
    eos = ref.generation_config.eos_token_id
    expected = hf[:hf.index(eos)] if eos in hf else hf
    r = generate(path, PROMPT, 12, dtype=jnp.float32)
    assert r.tokens == expected and len(expected) > 4
    assert r.text == codec.decode(expected) and r.prompt_tokens == len(ids)
    assert r.finish_reason == ("stop" if eos in hf else "length")
    assert 0 < r.first_token_seconds <= r.seconds and r.load_seconds > 0
    word = r.text[len(r.text) // 2:][:2]
    cut = generate(path, PROMPT, 12, stop=[word], dtype=jnp.float32)
    assert cut.text == r.text[:r.text.index(word)] and cut.finish_reason == "stop"


# The claim under test is "no TPU: CPU chosen quietly"; on a TPU host the CPU is rightly not chosen, so the
# case does not exist there (CI and this machine have no TPU; test_choose_backend covers the TPU branches).
@pytest.mark.skipif(bool(tpu_chips() or tpu_device_files()), reason="for a machine without a TPU")
def test_cli_prints_what_generate_returns_and_picks_the_cpu_quietly(checkpoint):
    """Run without JAX_PLATFORMS, as a user would: stdout is the library's completion; stderr is the backend
    line, the load line and the stats of the returned Generation, and nothing from libtpu's search for a TPU
    (worker hostnames, accelerator type, 'Unable to initialize backend')."""
    path, _ = checkpoint
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    p = subprocess.run([sys.executable, "-m", "quantkit.cli", "generate", str(path), "--prompt", PROMPT,
                        "--max-tokens", "12"], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr
    r = generate(path, PROMPT, 12)  # bf16, as the command runs
    assert p.stdout == r.text + "\n" and r.text
    lines = p.stderr.splitlines()
    assert len(lines) == 3 and lines[0] == "backend: cpu (no TPU found)", p.stderr
    assert lines[1].startswith("loaded llama (2 layers): weights take ")
    assert re.fullmatch(rf"{r.prompt_tokens} prompt tokens; {len(r.tokens)} generated in [0-9.]+ s, the first "
                        rf"after [0-9.]+ s, then [0-9.]+ tokens/s \({r.finish_reason}\)", lines[2]), lines[2]


def test_tpu_chips_and_device_files(tmp_path):
    """TPU chips by Google's vendor id and a TPU device id; Google's gVNIC, other vendors' devices and
    unreadable entries are not chips. Device files: accel nodes and VFIO groups, not VFIO's control node."""
    pci, dev = tmp_path / "pci", tmp_path / "dev"
    for name, vendor, device in (("0000:00:04.0", "0x1ae0", "0x006f"), ("0000:00:05.0", "0x1ae0", "0x006f"),
                                 ("0000:00:06.0", "0x1ae0", "0x0042"), ("0000:00:07.0", "0x10de", "0x0063")):
        (pci / name).mkdir(parents=True)
        (pci / name / "vendor").write_text(vendor + "\n")
        (pci / name / "device").write_text(device + "\n")
    (pci / "0000:00:08.0").mkdir()
    assert tpu_chips(pci) == ["v6e", "v6e"]
    (dev / "vfio").mkdir(parents=True)
    for f in ("accel0", "vfio/vfio", "vfio/3", "null"):
        (dev / f).touch()
    assert tpu_device_files(dev) == [str(dev / "accel0"), str(dev / "vfio" / "3")]


def test_choose_backend(monkeypatch):
    """A backend the user chose (conftest sets JAX_PLATFORMS=cpu) is kept, without a line. Unset: a TPU on the
    PCI bus, or a TPU's device files, leave JAX to start it; with neither, the CPU is set."""
    import jax

    from quantkit.runtime import backend

    assert choose_backend() is None and jax.config.jax_platforms == "cpu"
    cases = ((["v6e"] * 4, [], "backend: tpu (4 x TPU v6e)", None),
             ([], ["/dev/vfio/0"], "backend: JAX's choice (/dev/vfio/0 may be a TPU's)", None),
             ([], [], "backend: cpu (no TPU found)", "cpu"))
    try:
        for chips, files, line, platforms in cases:
            jax.config.update("jax_platforms", None)
            monkeypatch.setattr(backend, "tpu_chips", lambda chips=chips: chips)
            monkeypatch.setattr(backend, "tpu_device_files", lambda files=files: files)
            assert (choose_backend(), jax.config.jax_platforms) == (line, platforms)
    finally:
        jax.config.update("jax_platforms", "cpu")
