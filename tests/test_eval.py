"""`quantkit eval` against transformers + torch (the numerics oracle) and a bootstrap with known truth.

Tolerances: the runtime's float32 logits equal transformers' within ~1e-6 relative (test_runtime), so
perplexities agree to 1e-4 relative. The KL of nearly equal distributions is about half the variance,
under p, of the logit difference; float32 logit errors (max 1.4e-6 absolute here, random across the
4096-token vocabulary) mostly cancel in that sum: measured 1.4e-7 relative on the mean KL, 8e-7 on the
max, 4e-8 on the perplexity ratio. Tolerances are ~7x those; doing the KL math in float32 instead of
float64 moves the mean by 1.4e-5 and the max by 8e-5 (measured), which they catch.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as T

from quantkit.convert import convert
from quantkit.evaluate import bootstrap_ci, evaluate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import make_tiny_model  # noqa: E402
from ct_oracle import tiny_llama  # noqa: E402

TEXT = ("The value of this list is the type of the file. Return the model of the data, or none if the test "
        "fails. This class is for the token and the error of the value. ") * 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    dense = make_tiny_model.build(tmp / "dense", num_hidden_layers=2)
    convert(dense, tmp / "w4", "W4A16", 32)
    return dense, tmp / "w4"


def test_identical_checkpoints_give_zero_kl_and_full_agreement(models):
    dense, _ = models
    p = subprocess.run([sys.executable, "-m", "quantkit.cli", "eval", str(dense), str(dense), "--max-tokens", "200",
                        "--window", "64", "--json"], capture_output=True, text=True, timeout=600,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["tokens"] == 200 - 4  # 4 windows of 50/64: one token per window has no successor
    assert r["kl"]["mean"] == r["kl"]["max"] == 0.0 and r["kl"]["ci95"] == [0.0, 0.0]
    assert r["top1_agreement"] == {"value": 1.0, "ci95": [1.0, 1.0]}
    assert r["ppl_reference"] == r["ppl_candidate"] > 1


def test_w4a16_against_transformers(models):
    dense, w4 = models
    r = evaluate(dense, w4, TEXT, max_tokens=256, window=64)
    from quantkit.runtime.tokenizer import TextCodec

    ids = TextCodec(dense).encode(TEXT)[:256]
    ref = T.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    cand = T.AutoModelForCausalLM.from_pretrained(w4, dtype=torch.float32).eval()
    kl, nll_r, nll_c, agree = [], [], [], []
    with torch.no_grad():
        for i in range(0, len(ids), 64):
            x = torch.tensor([ids[i:i + 64]])
            lr = torch.log_softmax(ref(x).logits[0, :-1].double(), -1)
            lc = torch.log_softmax(cand(x).logits[0, :-1].double(), -1)
            kl.append(torch.nn.functional.kl_div(lc, lr, log_target=True, reduction="none").sum(-1))
            tgt = x[0, 1:]
            nll_r.append(-lr[torch.arange(len(tgt)), tgt])
            nll_c.append(-lc[torch.arange(len(tgt)), tgt])
            agree.append((lr.argmax(-1) == lc.argmax(-1)).double())
    kl, agree = torch.cat(kl), torch.cat(agree)
    assert r["tokens"] == len(kl)
    assert r["kl"]["mean"] > 0 and r["kl"]["mean"] == pytest.approx(kl.mean().item(), rel=1e-6)
    assert r["kl"]["max"] == pytest.approx(kl.max().item(), rel=5e-6)
    assert abs(r["top1_agreement"]["value"] - agree.mean().item()) <= 1 / len(kl)  # at most one near-tie flips
    assert r["ppl_reference"] == pytest.approx(torch.cat(nll_r).mean().exp().item(), rel=1e-4)
    assert r["ppl_candidate"] == pytest.approx(torch.cat(nll_c).mean().exp().item(), rel=1e-4)
    ratio = (torch.cat(nll_c).mean() - torch.cat(nll_r).mean()).exp().item()  # transformers' PPL ratio
    assert ratio > 1 and r["ppl_ratio"]["value"] == pytest.approx(ratio, rel=3e-7)
    assert r["ppl_ratio"]["ci95"][0] <= ratio <= r["ppl_ratio"]["ci95"][1]
    lo, hi = r["kl"]["ci95"]
    assert lo < r["kl"]["mean"] < hi and r["kl"]["median"] <= r["kl"]["p99"] <= r["kl"]["max"]


def test_bootstrap_interval_covers_the_truth():
    """Known answer: per-token values i.i.d. exponential with mean 0.3, and a correlated series (AR(1),
    phi 0.8) with mean 0; the 95% interval of the mean must cover the truth about 95% of the time.
    Measured with 32-token blocks: 0.905 and 0.895 (a percentile bootstrap on 640 skewed or correlated
    values covers a little under nominal); 16-token blocks gave 0.85 on the correlated series."""
    rng = np.random.default_rng(0)
    for make, truth in ((lambda: rng.exponential(0.3, 640), 0.3),
                        (lambda: _ar1(rng, 640, 0.8), 0.0)):
        hits = 0
        for trial in range(200):
            lo, hi = bootstrap_ci({"x": make()}, {"m": lambda d: d["x"].mean()}, resamples=300, seed=trial)["m"]
            hits += lo <= truth <= hi
        assert 0.88 <= hits / 200 <= 0.995, hits


def _ar1(rng, n, phi):
    x = np.zeros(n)
    e = rng.standard_normal(n)
    for i in range(1, n):
        x[i] = phi * x[i - 1] + e[i]
    return x


def test_bad_inputs(models, tmp_path):
    dense, w4 = models
    cmd = [sys.executable, "-m", "quantkit.cli", "eval", str(dense), str(w4)]
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    p = subprocess.run(cmd + ["--text", str(tmp_path / "missing.txt")], capture_output=True, text=True, env=env)
    assert p.returncode == 1 and "cannot read the text" in p.stderr and "Traceback" not in p.stderr
    other = make_tiny_model.build(tmp_path / "other", num_hidden_layers=1, vocab_size=512)
    p = subprocess.run([sys.executable, "-m", "quantkit.cli", "eval", str(dense), str(other)], capture_output=True,
                       text=True, env=env)
    assert p.returncode == 1 and "vocabularies differ: 4096 vs 512" in p.stderr


ONE_MODEL = """
import sys

import jax.numpy as jnp

from quantkit.evaluate import default_text
from quantkit.runtime.engine import Runner
from quantkit.runtime.loader import load
from quantkit.runtime.tokenizer import TextCodec

path, max_tokens, window = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ids = TextCodec(path).encode(default_text())[:max_tokens]
runner = Runner(load(path, dtype=jnp.float32), max_model_len=window, max_num_batched_tokens=window)
for i in range(0, len(ids), window):
    runner.forward([(0, ids[i:i + window], 0)])
"""


def test_eval_holds_one_float32_model_at_a_time(tmp_path):
    """The peak memory of `quantkit eval` is that of one model run alone, not two: a 4-layer model of 268 MB
    in float32 (134 MB bf16 on disk, 94% of it in the layers, which the CPU Runner holds twice: the loader's
    stacks and its per-layer copies). Peak RSS measured on this 2-core CPU: one model alone 938 MB, eval
    962 MB; eval holding both models at once (as it did before) 1487 MB, over the bound of one model +
    1.5 x 268 MB = 1349 MB."""
    ref, cand = tmp_path / "ref", tmp_path / "cand"
    kw = {"hidden": 1024, "intermediate": 4096, "layers": 4, "heads": 16, "kv_heads": 8, "vocab": 2048}
    tiny_llama(0, **kw).save_pretrained(ref)
    tiny_llama(1, **kw).save_pretrained(cand)  # another draw of the weights: a candidate unlike the reference
    make_tiny_model.train_tokenizer(make_tiny_model.pseudo_text(0), ref, 2048)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ref / f, cand / f)
    fp32 = 2 * (ref / "model.safetensors").stat().st_size  # bf16 on disk
    assert fp32 > 200e6
    one, _ = _peak(sys.executable, "-c", ONE_MODEL, str(ref), "512", "128")
    both, out = _peak(sys.executable, "-m", "quantkit.cli", "eval", str(ref), str(cand), "--max-tokens", "512",
                      "--window", "128", "--json")
    r = json.loads(out)
    assert r["tokens"] == 512 - 4 and r["kl"]["mean"] > 0
    assert both < one + 1.5 * fp32, f"eval peak {both / 1e6:.0f} MB, one model {one / 1e6:.0f} MB, " \
                                    f"one model's float32 weights {fp32 / 1e6:.0f} MB"


def _peak(*cmd: str) -> tuple[int, str]:
    """(peak resident memory of the command's process in bytes, its stdout); it must succeed."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
        _, status, usage = os.wait4(p.pid, 0)  # this child's own rusage (RUSAGE_CHILDREN would mix in others)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        assert p.returncode == 0, err.read()
        return usage.ru_maxrss * 1024, out.read()  # Linux reports KiB


def test_default_models_training_forward_is_transformers_llama(tmp_path):
    """scripts/train_default_model.py trains with its own dense forward (the runtime's paged one cannot be
    differentiated): its logits against transformers' LlamaForCausalLM on the checkpoint its `save` writes
    (random weights and norms, seed fixed; both in float32 on the saved bf16 weights)."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    import train_default_model as train
    from quantkit.runtime.models import from_hf

    params = train.init_params(jax.random.PRNGKey(3))
    keys = iter(jax.random.split(jax.random.PRNGKey(4), 64))
    params["layers"] = [{k: v + 0.1 * jax.random.normal(next(keys), v.shape) if v.ndim == 1 else v
                         for k, v in p.items()} for p in params["layers"]]  # norms away from 1
    as_saved = lambda x: jnp.asarray(np.asarray(x).astype(ml_dtypes.bfloat16), jnp.float32)  # noqa: E731
    params = jax.tree_util.tree_map(as_saved, params)
    train.save(params, tmp_path)
    tokens = np.random.default_rng(5).integers(0, train.CONFIG["vocab_size"], (2, 48))
    ours = np.asarray(train.dense_logits(params, from_hf(train.CONFIG), jnp.asarray(tokens)))
    ref = T.LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(torch.as_tensor(tokens)).logits.numpy()
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 1e-4
