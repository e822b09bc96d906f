"""Several devices: tensor and expert parallelism on 8 fake CPU devices, sharded loading, and a run over two
processes (jax.distributed with a local coordinator). The oracle is the same checkpoint on one device.

Tolerance: float32 logits on n devices vs one within 1e-5 relative (only the order of the all-reduce
summations differs, ~1e-7 per op); greedy tokens identical (bf16 too: the CLI and server runs).
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import make_tiny_model  # noqa: E402

SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=256)


def _env(devices: int) -> dict:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"  # conftest's too
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A dense Llama (8 heads, 2 KV heads: split at tp 2, replicated at 4 and 8) and a Qwen3-MoE (8 experts)
    converted to W4A16_ASYM g32 (zero points) by quantkit, experts included, in activation order (each
    linear and expert its own g_idx: the activations gathered per row's expert, on each device's own experts
    under expert parallelism, on the whole activation before a tensor-parallel split), both with a tokenizer;
    test_runtime's tiny gpt-oss in OpenAI's MXFP4 layout (sinks, biases, experts with biases); the tiny
    Gemma 4 MoE (8 experts beside the dense MLP, 4 heads) and Qwen3.5-MoE (Gated DeltaNet layers and their
    state slots, gated attention with 4 heads / 2 KV heads, 8 experts and a shared expert; NVFP4A16: a global
    scale per expert, split with the experts under expert parallelism, replicated under tensor parallelism)."""
    from quantkit.convert import convert

    tmp = tmp_path_factory.mktemp("parallel")
    dense = make_tiny_model.build(tmp / "dense", **SHAPE)
    from ct_oracle import to_activation_order
    from helpers import activation_order_moe
    from helpers import family as _family

    torch.manual_seed(0)
    moe = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**SHAPE, moe_intermediate_size=256, num_experts=8,
                                                 num_experts_per_tok=2, norm_topk_prob=True))
    sigmas = activation_order_moe(moe)
    moe.save_pretrained(tmp / "moe")
    make_tiny_model.train_tokenizer(make_tiny_model.pseudo_text(), tmp / "moe", SHAPE["vocab_size"])
    convert(tmp / "moe", tmp / "moe-c", "W4A16_ASYM", 32)
    to_activation_order(tmp / "moe-c", tmp / "moe-w4", sigmas, 32)

    torch.manual_seed(0)
    _family("gemma4_moe").save_pretrained(tmp / "gemma4-moe")  # bf16 experts packed in 3-D tensors
    _family("qwen3_5_moe").save_pretrained(tmp / "qwen3_5-moe")
    convert(tmp / "qwen3_5-moe", tmp / "qwen3_5-moe-w4", "NVFP4A16")  # GDN projections left bf16, replicated
    convert(dense, tmp / "w8a8", "W8A8")
    from helpers import gpt_oss_model, pack_native

    pack_native(gpt_oss_model(), tmp / "gpt-oss")  # OpenAI's MXFP4 layout
    return {"dense": dense, "moe": tmp / "moe-w4", "gemma4_moe": tmp / "gemma4-moe", "qwen3_5_moe": tmp / "qwen3_5-moe-w4",
            "w8a8": tmp / "w8a8", "gpt_oss": tmp / "gpt-oss"}


RUNNER_SCRIPT = r"""
import json, sys
import numpy as np, jax, jax.numpy as jnp
from quantkit.runtime.engine import Runner, generate
from quantkit.runtime.loader import load
from quantkit.runtime.sharding import start
assert len(jax.devices()) == 8
ids = np.random.default_rng(0).integers(3, 250, 12).tolist()  # within every test model's vocabulary
out = []
for tp, ep, weights in json.loads(sys.argv[2]):
    model = load(sys.argv[1], dtype=jnp.float32, mesh=start(tp), ep=ep)
    runner = Runner(model, max_model_len=64, weights=weights, scan=json.loads(sys.argv[3]))
    logits = runner.forward([(0, ids, 0)])[0]
    runner.pool.release(0)
    tokens = generate(runner, ids, 8)
    out.append({"tp": tp, "ep": ep, "weights": weights, "tokens": tokens, "logits": logits.tolist()})
print("JSON", json.dumps(out))
"""


RUNS = {  # (tp, expert parallel, weights): the dense model has no quantized weights to keep packed. Meshes of 2
    # (2 KV heads split exactly) and of 4 or 8 (replicated), with and without expert parallelism; the first run
    # (one device, packed: dequantized per call) is the reference of all (dequantized once at load: the same
    # float32 products, test_runtime checks 1e-5)
    "dense": [(1, False, "auto"), (2, False, "auto"), (8, False, "auto")],
    "moe": [(1, False, "packed"), (2, False, "packed"), (8, True, "packed"), (4, True, "dense")],
    "gemma4_moe": [(1, False, "auto"), (2, True, "auto")],  # global layers' one KV head replicated
    "qwen3_5_moe": [(1, False, "packed"), (4, True, "packed")],  # KV heads and GDN key heads replicated
    # int8 rows: each quantized on the whole row before a row-split layer's shards take their columns
    "w8a8": [(1, False, "packed"), (2, False, "packed"), (8, False, "packed")],
    # gpt-oss's published MXFP4 experts with biases, attention sinks split with the heads (2: KV heads split)
    # or replicated with the KV (4), experts split whole with their biases (4)
    "gpt_oss": [(1, False, "packed"), (2, False, "packed"), (4, True, "packed")],
}


# The MoEs run with their layers scanned, as on a TPU: about half the compile time of the unrolled CPU
# default, which the dense model here and test_generate_cli_takes_tp_and_expert_parallel (the W4A16 MoE at
# --tp 4 with expert parallelism) keep covering.
SCANNED = ("moe", "gemma4_moe", "qwen3_5_moe", "w8a8", "gpt_oss")


# The dense model in float weights (CI: exhaustive only): the W8A8 runs take the same model over the same meshes, and
# test_runtime's test_tensor_parallel_on_four_devices_matches_one[dense] splits float weights over 4 devices. The
# W4A16 MoE (CI: exhaustive only): Qwen3.5-MoE's case runs the same expert layers over the same meshes, and this
# MoE itself runs at --tp 4 with expert parallelism over two processes and data parallel in the generate tests.
@pytest.mark.parametrize("name", [pytest.param("dense", marks=pytest.mark.exhaustive),
                                  pytest.param("moe", marks=pytest.mark.exhaustive), "gemma4_moe", "qwen3_5_moe",
                                  "w8a8", "gpt_oss"])
def test_two_four_eight_devices_give_one_devices_tokens(models, name):
    """Tensor parallel (and for the MoEs, expert parallel too), with packed int4 / nvfp4 weights (the grouped matmul per
    shard / on each device's own experts) and dequantized dense ones, Gemma 4's bf16 experts, and W8A8's
    int8 weights with int8 activation rows (the same codes on every device count): the
    prompt's float32 logits within 1e-5 of one device's, and the same 8 greedy tokens."""
    import numpy as np

    scan = name in SCANNED or None  # None: the CPU default (layers unrolled)
    p = subprocess.run([sys.executable, "-c", RUNNER_SCRIPT, str(models[name]), json.dumps(RUNS[name]), json.dumps(scan)],
                       capture_output=True, text=True, timeout=900, env=_env(8))
    assert p.returncode == 0, p.stderr[-3000:]
    runs = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("JSON"))[5:])
    assert len(runs) == len(RUNS[name])
    one = runs[0]
    assert one["tp"] == 1
    ref = np.array(one["logits"])
    for r in runs[1:]:
        rel = np.linalg.norm(np.array(r["logits"]) - ref) / np.linalg.norm(ref)
        assert rel < 1e-5 and r["tokens"] == one["tokens"], (r["tp"], r["ep"], r["weights"], rel)


def _cli(*args: str, devices: int = 8, env=None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantkit.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env or _env(devices), **kw)


def test_generate_cli_takes_tp_and_expert_parallel(models):
    """`generate --tp N` prints one device's greedy text for the bf16 dense model, and so does the W4A16 MoE
    with --data-parallel-size 4 --enable-expert-parallel (its sequence on one device, the experts split over
    all four; the MoE with --tensor-parallel-size 4 --enable-expert-parallel: the two-process test below);
    what cannot be split is refused in one line."""
    for name, flags in (("dense", ["--tp", "8"]), ("moe", ["--data-parallel-size", "4", "--enable-expert-parallel"])):
        base = ["generate", str(models[name]), "--prompt", "the data of the model", "--max-tokens", "12"]
        one, many = _cli(*base), _cli(*base, *flags)
        assert one.returncode == 0 and many.returncode == 0, many.stderr[-2000:]
        assert many.stdout == one.stdout and len(one.stdout) > 1, (name, one.stdout, many.stdout)
        assert re.search(r"on (4|8) cpu devices", many.stderr), many.stderr
    base = ["generate", str(models["dense"]), "--prompt", "x"]
    heads = _cli(*base, "--tp", "3")
    assert heads.returncode == 1 and "8 attention heads do not split over 3 devices" in heads.stderr
    more = _cli(*base, "--tp", "16")
    assert more.returncode == 1 and "--tp 16 needs 16 devices, 8 available" in more.stderr
    both = _cli(*base, "--tp", "2", "--data-parallel-size", "2")
    assert both.returncode == 1 and "--data-parallel-size with --tp is not supported yet" in both.stderr
    for p in (heads, more, both):
        assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1


def test_eval_cli_takes_tp(models):
    """`eval --tp 4` (expert parallel) reports the perplexities one device reports (float32 runners: within
    1e-5), and the candidate equals the reference."""
    base = ["eval", str(models["moe"]), str(models["moe"]), "--max-tokens", "96", "--window", "48", "--json"]
    one, four = _cli(*base), _cli(*base, "--tp", "4", "--enable-expert-parallel")
    assert one.returncode == 0 and four.returncode == 0, four.stderr[-2000:]
    a, b = json.loads(one.stdout), json.loads(four.stdout)
    assert a["tokens"] == b["tokens"] == 2 * 47  # two windows of 48 tokens, 47 predictions each
    assert abs(b["ppl_reference"] - a["ppl_reference"]) < 1e-5 * a["ppl_reference"]
    assert b["kl"]["max"] < 1e-6 and b["top1_agreement"]["value"] == 1.0
    assert (a["devices"], a["expert_parallel"], b["devices"], b["expert_parallel"]) == (1, False, 4, True)


def test_serve_with_data_parallel_answers_the_openai_client(models, tmp_path):
    """`serve --data-parallel-size 4 --enable-expert-parallel` (W4A16 MoE; 4 sequences, one a device) answers
    the official client with one device's greedy text, four requests at once each their own; a structured
    output, not served with data parallelism yet, is answered 400 with the reason."""
    import httpx
    import openai

    prompt = "return the file type"
    one = _cli("generate", str(models["moe"]), "--prompt", prompt, "--max-tokens", "10")
    assert one.returncode == 0, one.stderr
    log = tmp_path / "serve.log"
    p = subprocess.Popen([sys.executable, "-m", "quantkit.cli", "serve", str(models["moe"]), "--port", "0",
                          "--data-parallel-size", "4", "--enable-expert-parallel", "--max-model-len", "128",
                          "--max-num-seqs", "4", "--max-num-batched-tokens", "64"],
                         env=_env(4), stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    try:
        deadline = time.monotonic() + 600
        while not (m := re.search(r"http://127\.0\.0\.1:(\d+)", log.read_text())):
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        url = f"http://127.0.0.1:{m.group(1)}"
        while True:
            try:
                if httpx.get(url + "/ready").status_code == 200:
                    break
            except httpx.ConnectError:
                pass
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        served = client.completions.create(model="moe-w4", prompt=[prompt] * 4, max_tokens=10, temperature=0)
        assert [one.stdout] * 4 == [c.text + "\n" for c in served.choices] and served.usage.completion_tokens > 0
        assert "on 4 devices, data parallel (1 sequence each) (experts split whole)" in log.read_text()
        with pytest.raises(openai.BadRequestError, match="without data parallelism only"):
            client.completions.create(model="moe-w4", prompt=prompt, max_tokens=4,
                                      extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    finally:
        p.terminate()
        assert p.wait(60) == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_give_one_process_tokens(models):
    """`generate --tensor-parallel-size 4 --enable-expert-parallel` (vLLM's spelling of --tp) over two processes
    with two CPU devices each (jax.distributed, a local coordinator, gloo collectives): process 0 prints one
    process's greedy text, process 1 nothing; both exit 0."""
    base = ["generate", str(models["moe"]), "--prompt", "the data of the model", "--max-tokens", "12"]
    one = _cli(*base)
    assert one.returncode == 0, one.stderr
    addr = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "quantkit.cli", *base, "--tensor-parallel-size", "4",
                               "--enable-expert-parallel",
                               "--coordinator-address", addr, "--num-processes", "2", "--process-id", str(i)],
                              env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert outs[0][0] == one.stdout and outs[1][0] == ""
    assert "on 4 cpu devices in 2 processes" in outs[0][1]


DATA_PARALLEL_SCRIPT = r"""
import json, re, sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from quantkit.runtime.engine import Engine, Request, Runner
from quantkit.runtime.loader import load
from quantkit.runtime.models.common import pack_routing, unpack_routing
from quantkit.runtime.sharding import make_mesh
from quantkit.runtime.step import STEP
path, gdn = sys.argv[1], sys.argv[2] == "1"
rng = np.random.default_rng(int(sys.argv[3]))
mesh = make_mesh(8)
out = {}
# forward: eight prompts of different lengths as one ragged step, each on its own device; packed weights
prompts = [rng.integers(3, 250, n).tolist() for n in (12, 7, 20, 5, 9, 16, 3, 11)]
kw = dict(max_model_len=64, max_num_seqs=8, weights="packed", scan=True)
one = Runner(load(path, dtype=jnp.float32), **kw).forward([(i, p, 0) for i, p in enumerate(prompts)])
dp = Runner(load(path, dtype=jnp.float32, mesh=mesh, ep=True, dp=True), **kw)
many = dp.forward([(i, p, 0) for i, p in enumerate(prompts)])
out["rel"] = [float(np.linalg.norm(a - b) / np.linalg.norm(a)) for a, b in zip(one, many)]
# serving: ten requests sharing a prefix on 4 devices (2 sequences each), dense weights, prefix caching (for the
# Gated DeltaNet model with state snapshots, copied on each device)
shared = rng.integers(3, 250, 40).tolist()
prompts = [shared + rng.integers(3, 250, n).tolist() for n in (12, 7, 20, 5, 9, 16, 3, 11, 4, 6)]
def serve(runner):
    e = Engine(runner)
    reqs = [e.submit(Request(p, 6)) for p in prompts]
    devices = set()
    while e.busy():
        e.step()
        devices |= {runner.pool.device(r.slot) for r in reqs if r.slot >= 0}
    return [r.out for r in reqs], sorted(devices), e.prefix_hits
kw = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, prefix_states=8 if gdn else 0)
out["one"] = serve(Runner(load(path, dtype=jnp.float32), **kw))
out["dp"] = serve(Runner(load(path, dtype=jnp.float32, mesh=make_mesh(4), ep=True, dp=True), **kw))
# the compiled step's collectives (layers unrolled: each MoE layer's own)
r = Runner(load(path, dtype=jnp.float32, mesh=mesh, ep=True, dp=True), max_model_len=64, max_num_seqs=8, scan=False)
hlo = r._programs[STEP].lower(r.params, r.kv, r.last, r.empty(8)).compile().as_text()
out["collectives"] = re.findall(r"= (\w+\[[\d,]*\])\S* (all-gather|reduce-scatter|all-reduce|all-to-all)\(", hlo)
# routing metadata through an all-gather: ids and float32 weights (signed zeros, subnormals, NaNs) bit for bit
ids = rng.integers(0, 512, (8 * 5, 3)).astype(np.int32)
w = rng.standard_normal((8 * 5, 3)).astype(np.float32)
w.reshape(-1)[:5] = [-0.0, 1e-45, np.inf, np.nan, -3e-39]
w.view(np.int32).reshape(-1)[5] = 0x7FC00123  # a NaN with a payload
gathered = jax.jit(jax.shard_map(lambda i, v: jax.lax.all_gather(pack_routing(i, v), "model", tiled=True), mesh=mesh,
                                 in_specs=(P("model"), P("model")), out_specs=P(), check_vma=False))(ids, w)
back_ids, back_w = unpack_routing(gathered)
out["metadata"] = [np.array_equal(np.asarray(back_ids), ids), np.array_equal(np.asarray(back_w).view(np.int32),
                                                                                  w.view(np.int32))]
print("JSON", json.dumps(out))
"""


# The W4A16 MoE (CI: exhaustive only): Qwen3.5-MoE's case runs the same expert layers beside its GDN states, and
# test_serve_with_data_parallel_answers_the_openai_client serves this MoE with data and expert parallelism.
@pytest.mark.parametrize("name", [pytest.param("moe", marks=pytest.mark.exhaustive), "qwen3_5_moe"])
def test_data_parallel_with_expert_parallel_gives_one_devices_logits_and_tokens(models, name, seed):
    """--data-parallel-size 8 with --enable-expert-parallel (Qwen3-MoE W4A16 in activation order; Qwen3.5-MoE
    NVFP4A16, with Gated DeltaNet state slots on each device): eight prompts run as one ragged step, one on
    each device, give one device's float32 logits within 1e-5 (relative norm: only the order of the experts'
    sums differs); ten requests served on 4 devices give one device's greedy tokens, spread over every
    device, prefix caching hitting on each device's own pages (and state snapshots); the compiled step
    exchanges per MoE layer exactly one all-gather of the packed int32 routing [devices * tokens, 2k], one
    of the tokens [devices * tokens, hidden] and one reduce-scatter of the sums [tokens, hidden] (else
    only the few-byte all-reduces that gather the sampled tokens); the packed routing round-trips an
    all-gather bit for bit."""
    import numpy as np

    p = subprocess.run([sys.executable, "-c", DATA_PARALLEL_SCRIPT, str(models[name]),
                        "1" if name == "qwen3_5_moe" else "0", str(seed)],
                       capture_output=True, text=True, timeout=900, env=_env(8))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("JSON"))[5:])
    assert max(r["rel"]) < 1e-5, r["rel"]
    (tokens, _, hits), (dp_tokens, devices, dp_hits) = r["one"], r["dp"]
    assert dp_tokens == tokens and devices == [0, 1, 2, 3], (devices, seed)
    assert hits > 0 and dp_hits > 0  # each device's requests after its first hit its shared-prefix pages
    cfg = json.loads((Path(models[name]) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    layers, k, hidden = cfg["num_hidden_layers"], cfg["num_experts_per_tok"], cfg["hidden_size"]
    t = 8  # the decode bucket of one sequence a device
    ops = sorted((op, shape) for shape, op in r["collectives"] if op != "all-reduce")
    assert ops == sorted([("all-gather", f"s32[{8 * t},{2 * k}]"), ("all-gather", f"f32[{8 * t},{hidden}]"),
                          ("reduce-scatter", f"f32[{t},{hidden}]")] * layers), r["collectives"]
    assert all(str(hidden) not in shape for shape, op in r["collectives"] if op == "all-reduce"), r["collectives"]
    assert r["metadata"] == [True, True]


EXPERT_PASSES_SCRIPT = r"""
import json, sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import quantkit.runtime.models.common as common
from quantkit.runtime.sharding import AXIS, make_mesh
rng = np.random.default_rng(int(sys.argv[1]))
n, t, k, hidden, inter, experts = 8, 4, 2, 16, 24, 16  # 2 experts a device
mesh = make_mesh(n)
gate, up, down = (rng.standard_normal(s).astype(np.float32) * 0.3
                  for s in ((experts, hidden, inter), (experts, hidden, inter), (experts, inter, hidden)))
x = rng.standard_normal((n * t, hidden)).astype(np.float32)
weights = rng.random((n * t, k)).astype(np.float32)

def reference(ids):  # numpy: sum over each token's experts of weight * down(silu(gate x) * up x)
    out = np.zeros_like(x)
    for i in range(n * t):
        for j in range(k):
            e = ids[i, j]
            g, u = x[i] @ gate[e], x[i] @ up[e]
            out[i] += weights[i, j] * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out

def run(ids):
    body = lambda x, w, e, g, u, d: common.routed_experts(x, w, e, (g, u, d), experts,
                                                          lambda a, b: jax.nn.silu(a) * b, AXIS)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 6, out_specs=P(AXIS), check_vma=False))
    args = (x, weights, jnp.asarray(ids, jnp.int32), gate, up, down)
    whiles = str(f.trace(*args).jaxpr).count(" while[")
    return np.asarray(f(*args)), whiles

devices = np.stack([np.arange(n * t) % n, (np.arange(n * t) + 1) % n], axis=1)  # T * k = 8 rows a device
balanced = 2 * devices + rng.integers(0, 2, (n * t, k))  # either of the device's two experts
skewed = np.stack([rng.permutation(2)[:k] for _ in range(n * t)])  # every row on device 0's two experts
out = {}
for name, ids in (("balanced", balanced), ("skewed", skewed)):
    ref = reference(ids)
    got, loops = run(ids)
    with common.balanced_expert_passes():
        one, one_loops = run(ids)
    again, _ = run(ids)
    rel = lambda a: float(np.linalg.norm(a - ref) / np.linalg.norm(ref))
    out[name] = {"rel": rel(got), "one_pass_rel": rel(one), "again_rel": rel(again), "loops": loops,
                 "one_pass_loops": one_loops, "most_rows": int(max(np.bincount(ids.ravel() // 2, minlength=n)))}
print("JSON", json.dumps(out))
"""


def test_data_parallel_expert_passes_sum_every_row_and_plans_one_pass(seed):
    """_data_parallel_experts on 8 fake CPU devices (16 dense experts, 2 a device, 4 tokens a device, top-2)
    against a NumPy reference of the routed sum: routing spread evenly over the devices, and every row on device 0's
    two experts (64 rows where a pass takes 1.5 x 4 x 2 = 12: six passes) both within 1e-5 (float32; only the
    order of the sums differs). Under `balanced_expert_passes` (what plan compiles) the step holds no loop
    and runs one pass: the spread routing's rows all fit it (the same sums), the skewed one's do not (its rows
    past the first pass missing: why it is not for serving); after it the loop is back."""
    p = subprocess.run([sys.executable, "-c", EXPERT_PASSES_SCRIPT, str(seed)], capture_output=True, text=True,
                       timeout=600, env=_env(8))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("JSON"))[5:])
    b, s = r["balanced"], r["skewed"]
    assert s["most_rows"] == 64 and b["most_rows"] == 8, r
    for case in (b, s):
        assert case["rel"] < 1e-5 and case["again_rel"] < 1e-5 and case["loops"] >= 1 and case["one_pass_loops"] == 0, r
    assert b["one_pass_rel"] < 1e-5 and s["one_pass_rel"] > 0.5, r


PLACEMENT_SCRIPT = r"""
import json, sys
import numpy as np, jax
calls = []
put = jax.device_put
def recording(x, *a, **k):  # the size of each transfer of data (not of the empty buffers it fills)
    calls.append(int(np.size(x)) if np.any(np.asarray(x) != 0) else 0)
    return put(x, *a, **k)
jax.device_put = recording
from quantkit.quant.qtensor import QTensor
from quantkit.runtime.loader import load
from quantkit.runtime.sharding import start
model = load(sys.argv[1], mesh=start(4), ep=True)
rows = {}
for path, leaf in jax.tree_util.tree_flatten_with_path(model.params, is_leaf=lambda x: isinstance(x, QTensor))[0]:
    name = jax.tree_util.keystr(path)
    for part, a in ((("values", leaf.values), ("scales", leaf.scales)) if isinstance(leaf, QTensor) else (("", leaf),)):
        rows[name + part] = {"size": int(a.size), "shards": sorted({int(s.data.size) for s in a.addressable_shards}),
                             "devices": len(a.addressable_shards)}
print("JSON", json.dumps({"leaves": rows, "largest_put": max(calls)}))
"""


def test_loading_places_only_each_devices_part(models):
    """Load at --tp 4 with expert parallelism: every weight of the decoder that the rules split lies on each
    device as exactly a quarter of it (the embedding and lm_head by vocabulary rows; attention, MLP and
    experts by heads, columns, rows or whole experts), only the norms, router and the 2 KV heads (fewer than
    the devices) are whole on each; and no transfer to a device during the load was larger than one layer's
    quarter of the largest weight (the empty per-device buffers are filled in place)."""
    p = subprocess.run([sys.executable, "-c", PLACEMENT_SCRIPT, str(models["moe"])], capture_output=True, text=True,
                       timeout=600, env=_env(4))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("JSON"))[5:])
    whole = {n for n in r["leaves"] if re.search(r"norm|router|\['k'\]|\['v'\]", n)}
    # the final norm; of the layers (one kind): 4 norms, the router, k and v values and scales
    assert len(whole) == 1 + 4 + 1 + 4, sorted(whole)
    for name, leaf in r["leaves"].items():
        assert leaf["devices"] == 4
        assert leaf["shards"] == [leaf["size"] if name in whole else leaf["size"] // 4], name
    # the largest single weight: the embedding / lm_head [512, 128] or an expert stack [8, 128, 256] per layer;
    # a transfer is one layer's part on one device: at most 8 * 128 * 256 / 4 values
    assert r["largest_put"] <= 8 * 128 * 256 // 4, r["largest_put"]


@pytest.mark.slow
def test_host_memory_while_loading_does_not_grow_with_the_model(tmp_path):
    """Host memory while loading bf16 checkpoints of 0.47 and 0.93 GB (5 and 10 layers of the same tensors)
    at --tp 4, measured as benchmarks/parallel_load.py does in a fresh process: the anonymous RSS at its
    peak minus before minus what the placed arrays hold at the end (on CPU the devices are host memory).
    Medians of 3: the larger model's transient is under 8x the largest tensor (22 MiB; mostly the one-time
    compilation of the placement programs, ~100 MiB) and exceeds the smaller one's by less than 2x the
    largest tensor, where a host buffer of any whole stacked weight would add 5 x 22 MiB or more."""
    import importlib.util

    import numpy as np

    # loaded by path: benchmarks/ on sys.path would shadow the `kernels` package that transformers imports
    # (benchmarks/kernels.py) in every later test of this worker
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "parallel_load.py"
    spec = importlib.util.spec_from_file_location("parallel_load", path)
    parallel_load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parallel_load)

    paths = {n: make_tiny_model.build(tmp_path / f"l{n}", num_hidden_layers=n, **parallel_load.SHAPE) for n in (5, 10)}
    size = sum(f.stat().st_size for f in paths[10].glob("*.safetensors"))
    assert 0.9e9 < size < 1.0e9
    runs = {5: [], 10: []}
    for _ in range(3):
        for n, path in paths.items():
            p = subprocess.run([sys.executable, parallel_load.__file__, "--measure", str(path), "4", "0"],
                               capture_output=True, text=True, timeout=600, env=_env(4))
            assert p.returncode == 0, p.stderr[-2000:]
            runs[n].append(json.loads(p.stdout.strip().splitlines()[-1]))
    largest = runs[10][0]["largest_tensor"]
    assert largest == 5632 * 2048 * 2 and all(r["held"] > 0.95 * size for r in runs[10])
    transient = {n: float(np.median([r["transient"] for r in rs])) for n, rs in runs.items()}
    assert transient[10] < 8 * largest, transient
    assert transient[10] - transient[5] < 2 * largest, transient
