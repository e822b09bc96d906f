"""`quantkit serve` as a real process on loopback, driven by the official `openai` client (the API oracle).

The model is the default model's recipe at 2 layers (random bf16 weights, byte-level BPE tokenizer, chat
template), with one planted habit so that an end of sequence can be had on demand (`model_dir`). Logprob
values are checked against the runtime's plain forward step run in this process on the same weights: bf16
activations in both, so they agree to the bf16 rounding of the logits (0.05 absolute on log-probabilities
around -8; measured ~1e-3).
"""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import make_tiny_model  # noqa: E402
from helpers import ServerProc  # noqa: E402

KEY = "sk-test-123"
NAME = "tiny"
UNK, EOS = 0, 2  # <unk>, </s>


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model, taught one habit: after <unk> (which no text encodes to) comes </s>. <unk>'s embedding
    is a vector u of rms 1 (50x the others), so the last hidden state there is ~u; </s>'s output row is
    0.2 u / |u|: a logit of ~3.2 after <unk>, where the others' are ~N(0, 0.32) (at most ~1.2). Elsewhere
    </s>'s logit is ~N(0, 0.2): no likelier than any other token, as before."""
    from quantkit.formats.safetensors_io import SafetensorsFile, write_safetensors

    path = make_tiny_model.build(tmp_path_factory.mktemp("serve") / NAME, num_hidden_layers=2)
    file = SafetensorsFile(path / "model.safetensors")
    tensors = {name: np.array(file.read(name)) for name in file.tensors}
    u = np.random.default_rng(0).standard_normal(tensors["lm_head.weight"].shape[1])
    tensors["model.embed_tokens.weight"][UNK] = u
    tensors["lm_head.weight"][EOS] = 0.2 * u / np.linalg.norm(u)
    write_safetensors(path / "planted.safetensors", tensors, {"format": "pt"})
    os.replace(path / "planted.safetensors", path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """The module's server listens on a Unix socket (`--uds`): every test of this module but the drain test
    (TCP, its own server) talks to it through the official openai client or httpx on that socket, the way a
    TPU VM without TCP, or a local proxy, reaches it. Removed when the server exits."""
    tmp = tmp_path_factory.mktemp("server")
    s = ServerProc(model_dir, tmp / "server.log", tmp / "cache", "--max-model-len", "128", "--max-num-seqs", "8",
                   "--api-key", KEY, name=NAME, key=KEY, uds=tmp / "quantkit.sock")
    yield s
    assert s.stop() == 0 and not os.path.exists(s.uds)


@pytest.fixture
def client(server):
    return server.openai(KEY)


def test_health_before_ready_then_models(server, client):
    health, ready, models = server.early
    assert health == 200 and ready == 503
    assert models.status_code == 503 and "poll GET /ready" in models.json()["error"]["message"]
    listed = client.models.list().data
    assert [m.id for m in listed] == [NAME]
    assert server.launched - 5 <= listed[0].created <= time.time()  # when this server started, not 0


def test_completion_logprobs_match_the_runtime(server, client, model_dir):
    import jax.numpy as jnp

    from quantkit.runtime.engine import Runner
    from quantkit.runtime.loader import load
    from quantkit.runtime.tokenizer import TextCodec

    ids = TextCodec(model_dir).encode("the value of this list")
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0, logprobs=5)
    choice = r.choices[0]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 6 and choice.finish_reason == "length"
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.token_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) >= 4 and abs(chosen - max(top.values())) < 1e-6  # greedy picks the top token
    logits = Runner(load(model_dir, dtype=jnp.bfloat16), max_model_len=128).forward(
        [(0, ids, 0)])[0][-1].astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    codec = TextCodec(model_dir)
    expected = {codec.decode([int(i)]): logp[i] for i in np.argsort(-logp)[:5]}
    assert lp.top_logprobs[0].keys() & expected.keys()
    for tok in lp.top_logprobs[0].keys() & expected.keys():
        assert abs(lp.top_logprobs[0][tok] - expected[tok]) < 0.05


def test_streamed_chat_equals_whole_chat_and_seeds_reproduce(client):
    msgs = [{"role": "user", "content": "what is the value of this list?"}]
    kw = dict(model=NAME, messages=msgs, max_tokens=20, temperature=0.9, top_p=0.95, seed=7)
    whole = client.chat.completions.create(**kw)
    stream = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content and finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens > 0
    again = client.chat.completions.create(**kw)
    other = client.chat.completions.create(**{**kw, "seed": 8})
    assert again.choices[0].message.content == whole.choices[0].message.content
    assert other.choices[0].message.content != whole.choices[0].message.content
    lp = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3).choices[0].logprobs.content
    assert len(lp) == whole.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in lp)
    assert "".join(t.token for t in lp) == whole.choices[0].message.content


def test_stop_strings_cut_the_text(client):
    full = client.completions.create(model=NAME, prompt="the model of", max_tokens=24, temperature=0).choices[0]
    stop = full.text[8:11]
    cut = full.text[:full.text.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model=NAME, prompt="the model of", max_tokens=24, temperature=0, stop=[stop],
                                      stream=stream)
        text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert text == cut


def test_greedy_output_equals_quantkit_generate(client, model_dir):
    prompt = "return the file type"
    cli = subprocess.run([sys.executable, "-m", "quantkit.cli", "generate", str(model_dir), "--prompt", prompt,
                          "--max-tokens", "16"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert cli.returncode == 0, cli.stderr
    served = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    assert cli.stdout == served + "\n" and served


def test_prefix_cache_hits_in_metrics(server, client):
    """Prefix caching is on by default: a 40-token prompt, then one sharing its first 36 tokens, finds two
    16-token pages cached (what /metrics counts as hits); both prompts count as queried tokens."""
    ids = np.random.default_rng(7).integers(1000, 4000, 44).tolist()
    a, b = ids[:40], ids[:36] + ids[40:]
    before = server.metrics()
    outs = [client.completions.create(model=NAME, prompt=p, max_tokens=3, temperature=0).choices[0].text
            for p in (a, b)]
    m = server.metrics()
    delta = {k: m[k] - before[k] for k in ("quantkit_prefix_cache_queries_total", "quantkit_prefix_cache_hits_total")}
    assert delta == {"quantkit_prefix_cache_queries_total": 80, "quantkit_prefix_cache_hits_total": 32}
    assert m["quantkit_kv_pages_cached"] >= 2 and all(outs)


def test_prompt_lists_and_n_choices(client):
    """A list of P prompts with n choices each: P * n sequences, choice index prompt * n + i, each the text
    its prompt gives alone with seed + i; usage counts each prompt once and every choice's tokens; a stream
    carries each choice's index and the same texts."""
    prompts = ["the value of", "return the file type"]
    kw = dict(model=NAME, max_tokens=8, temperature=0.9, seed=11)
    alone = [[client.completions.create(prompt=p, **{**kw, "seed": 11 + i}) for i in range(2)] for p in prompts]
    r = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [a.choices[0].text for row in alone for a in row]
    assert r.choices[0].text != r.choices[1].text  # seeds 11 and 12
    assert r.usage.prompt_tokens == sum(row[0].usage.prompt_tokens for row in alone)
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for row in alone for a in row) > 0
    texts, finish, usage = [""] * 4, [None] * 4, None
    for chunk in client.completions.create(prompt=prompts, n=2, stream=True, stream_options={"include_usage": True},
                                           **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.text for c in r.choices] and finish == [c.finish_reason for c in r.choices]
    assert usage.completion_tokens == r.usage.completion_tokens and usage.prompt_tokens == r.usage.prompt_tokens
    ids = [[5, 6, 7, 8], [9, 10, 11]]  # lists of token ids too; greedy choices are all alike
    greedy = client.completions.create(model=NAME, prompt=ids, n=3, max_tokens=6, temperature=0)
    assert [c.text for c in greedy.choices] == [
        client.completions.create(model=NAME, prompt=p, max_tokens=6, temperature=0).choices[0].text
        for p in ids for _ in range(3)]


def test_chat_n_choices(client):
    msgs = [{"role": "user", "content": "what is the type of this file?"}]
    kw = dict(model=NAME, messages=msgs, max_tokens=10, temperature=0.9, seed=3)
    r = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [
        client.chat.completions.create(**{**kw, "seed": 3 + i}).choices[0].message.content for i in range(3)]
    roles, texts = {}, [""] * 3
    for chunk in client.chat.completions.create(n=3, stream=True, **kw):
        for c in chunk.choices:
            roles[c.index] = c.delta.role or roles.get(c.index)
            texts[c.index] += c.delta.content or ""
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert texts == [c.message.content for c in r.choices]


def test_ignore_eos_and_min_tokens(client, model_dir):
    """After <unk>, greedy decoding ends at once (the planted habit). ignore_eos keeps </s> and goes on to
    max_tokens; min_tokens keeps </s> from being drawn: the first token is then not the most likely one."""
    from quantkit.runtime.tokenizer import TextCodec

    kw = dict(model=NAME, prompt=TextCodec(model_dir).encode("the value of") + [UNK], max_tokens=12,
              temperature=0, logprobs=1)
    plain = client.completions.create(**kw)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == 0
    kept = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert kept.choices[0].finish_reason == "length" and kept.usage.completion_tokens == 12
    assert kept.choices[0].logprobs.tokens[0] == ""  # </s>, kept (special tokens render as no text)
    for n in (1, 5):
        r = client.completions.create(**kw, extra_body={"min_tokens": n})
        lp = r.choices[0].logprobs
        assert r.usage.completion_tokens >= n and lp.tokens[0] != ""
        assert lp.token_logprobs[0] < max(lp.top_logprobs[0].values()) - 1  # </s> was the likelier by far
    for extra in ({"min_tokens": 8}, {"ignore_eos": "yes"}):  # chat takes them too
        with pytest.raises(openai.BadRequestError, match=next(iter(extra))):
            client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=7,
                                           extra_body=extra)


def test_min_tokens_holds_off_stop_strings(client):
    """A stop string completed by one of the first min_tokens tokens does not count (vLLM's rule)."""
    kw = dict(model=NAME, prompt="the model of", max_tokens=24, temperature=0)
    full = client.completions.create(**kw, logprobs=0).choices[0]
    tokens = full.logprobs.tokens
    assert "".join(tokens) == full.text
    k = next(k for k in range(3, 23) if len(tokens[k].strip()) > 1 and "\ufffd" not in tokens[k]
             and full.text.index(tokens[k]) == len("".join(tokens[:k])))
    stop = tokens[k]  # first seen as the (k + 1)-th token
    for min_tokens, expected in ((0, "stop"), (k, "stop"), (k + 1, "past")):
        r = client.completions.create(**kw, stop=[stop], extra_body={"min_tokens": min_tokens}).choices[0]
        if expected == "stop":
            assert r.text == "".join(tokens[:k]) and r.finish_reason == "stop"
        else:
            assert r.text.startswith("".join(tokens[:k + 1]))


def test_metrics_count_sequences_in_prometheus_format(server, client):
    """/metrics in Prometheus' text format, under quantkit's names and vLLM's: after a 2-prompt x 2-choice
    completion and a chat, 5 sequences finished, their tokens counted, 2 HTTP requests."""
    before = server.metrics()
    r = client.completions.create(model=NAME, prompt=["the value of", "the list"], n=2, max_tokens=5, temperature=0)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    m = server.metrics()

    def delta(key):
        return m[key] - before.get(key, 0)

    label = '{model_name="tiny"}'
    each_prompt = r.usage.prompt_tokens  # counted once per prompt in usage, once per sequence in /metrics
    assert delta("vllm:prompt_tokens_total" + label) == 2 * each_prompt + chat.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total" + label) == r.usage.completion_tokens + chat.usage.completion_tokens
    assert sum(delta(k) for k in m if k.startswith("vllm:request_success_total{") and label[1:-1] in k) == 5
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"vllm:{name}_count" + label) == delta(f"quantkit_{name}_count") == 5
        assert m[f'vllm:{name}_bucket{{le="+Inf",model_name="tiny"}}'] == m[f"vllm:{name}_count" + label]
    for name in ("prompt_tokens_total", "generation_tokens_total"):
        assert delta(f"quantkit_{name}") == delta(f"vllm:{name}" + label)
    assert delta('quantkit_requests_total{route="/v1/completions",status="200"}') == 1
    # at least a step a generated token of the longer request (5), each with host time spent on it
    assert delta("quantkit_engine_steps_total") >= 5 and delta("quantkit_engine_host_seconds_total") > 0
    assert delta("quantkit_engine_readback_wait_seconds_total") >= 0
    assert delta('quantkit_requests_total{route="/v1/chat/completions",status="200"}') == 1
    used, total = m["quantkit_kv_pages_used"], m["quantkit_kv_pages_total"]
    assert m["vllm:kv_cache_usage_perc" + label] == m["vllm:gpu_cache_usage_perc" + label] == used / total
    assert m["vllm:num_requests_running" + label] == m["quantkit_num_requests_running"] == 0
    assert m["vllm:num_requests_waiting" + label] == 0
    assert m["vllm:prefix_cache_queries_total" + label] == m["quantkit_prefix_cache_queries_total"] > 0


def test_ready_after_the_first_bucket_and_the_rest_compiled_while_serving(server, client):
    """/ready turns 200 once the smallest token bucket's programs are compiled, and counts the rest, which
    compile while the server serves, in /ready and /metrics until all are: 7 buckets (8 .. 512 tokens),
    each a step and a structured-output split step. (After the module server's other tests: its programs
    compile while they run.)"""
    first = server.http.get("/ready").json()
    assert first["status"] == "ready" and first["programs"] == 14 and first["programs_compiled"] >= 2
    deadline = time.monotonic() + 300
    while (r := server.http.get("/ready").json())["programs_compiled"] < r["programs"]:
        assert time.monotonic() < deadline, r
        time.sleep(0.5)
    m = server.metrics()
    assert m["quantkit_programs_compiled"] == m["quantkit_programs"] == 14


def test_sigterm_while_compiling_ahead_exits_cleanly(model_dir, tmp_path):
    """A server stopped while its thread compiles the larger buckets (SIGTERM 1.5 s after /ready answers, past
    the half second of quiet it waits, with an empty compilation cache: a program takes seconds) exits 0 once
    the program being compiled is done (exiting under it aborted the process), and says nothing of it."""
    s = ServerProc(model_dir, tmp_path / "server.log", tmp_path / "cache", name=NAME, uds=tmp_path / "s.sock")
    time.sleep(1.5)
    assert s.http.get("/ready").json()["programs_compiled"] < 14
    assert s.stop() == 0, (tmp_path / "server.log").read_text()
    assert "Traceback" not in (tmp_path / "server.log").read_text()


def test_unix_socket_owner_only_and_a_second_server_refused(server, model_dir):
    """The socket is 0600; a second `serve` on the same path while the first answers there exits 1 with one
    line (before loading anything), and the first server goes on answering."""
    import stat

    assert stat.S_IMODE(os.stat(server.uds).st_mode) == 0o600 and stat.S_ISSOCK(os.stat(server.uds).st_mode)
    r = subprocess.run([sys.executable, "-m", "quantkit.cli", "serve", str(model_dir), "--uds", server.uds],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "another server is listening there" in r.stderr and "Traceback" not in r.stderr
    assert server.http.get("/ready").status_code == 200 and os.path.exists(server.uds)


def test_unix_socket_replaces_a_stale_one_and_refuses_other_files(tmp_path):
    """What a killed server leaves (a socket file nothing accepts on) is replaced; a live socket and a file
    that is not a socket are refused with what to do; a path too long for a socket says so."""
    import socket
    import stat

    from quantkit.errors import InvalidInput
    from quantkit.runtime.server import unix_socket

    path = str(tmp_path / "s.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays, as after SIGKILL
    live = unix_socket(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.connect(path)  # the new socket accepts
    probe.close()
    with pytest.raises(InvalidInput, match="another server is listening there; stop it or pick another --uds"):
        unix_socket(path)
    live.close()
    (tmp_path / "file").write_text("keep me")
    with pytest.raises(InvalidInput, match="not a socket"):
        unix_socket(str(tmp_path / "file"))
    assert (tmp_path / "file").read_text() == "keep me"
    with pytest.raises(InvalidInput, match="cannot listen on .*pick another --uds path"):
        unix_socket(str(tmp_path / ("x" * 120)))


def test_a_killed_servers_socket_is_replaced_at_the_next_start(model_dir, tmp_path):
    """SIGKILL leaves the socket file behind; the next `serve --uds` on that path replaces it and answers
    /health there while it loads, and SIGTERM removes the file."""
    sock, env = tmp_path / "s.sock", {**os.environ, "JAX_PLATFORMS": "cpu", "QUANTKIT_JAX_CACHE": str(tmp_path)}

    def start(log):
        p = subprocess.Popen([sys.executable, "-m", "quantkit.cli", "serve", str(model_dir), "--uds", str(sock)],
                             env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
        deadline = time.monotonic() + 60
        while f"unix:{sock}" not in log.read_text():
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        return p

    first = start(tmp_path / "first.log")
    first.kill()
    first.wait(30)
    assert sock.is_socket()  # stale: nothing accepts on it
    second = start(tmp_path / "second.log")
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock))) as c:
        deadline = time.monotonic() + 30
        while True:
            try:
                assert c.get("http://localhost/health").status_code == 200
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    second.send_signal(signal.SIGTERM)
    second.wait(60)
    assert not sock.exists()


def test_each_server_has_its_own_metrics_registry(model_dir):
    from prometheus_client import generate_latest

    from quantkit.runtime.server import Server

    a, b = Server(model_dir, served_model_name="a"), Server(model_dir, served_model_name="b")
    a.metrics.requests.labels("/v1/models", 200).inc()
    assert b'quantkit_requests_total{route="/v1/models",status="200"} 1.0' in generate_latest(a.metrics.registry)
    assert b"quantkit_requests_total{" not in generate_latest(b.metrics.registry)


def test_32_concurrent_streams_some_disconnecting(server):
    async def one(aclient, i):
        stream = await aclient.completions.create(model=NAME, prompt=f"request {i} of the test", stream=True,
                                                  max_tokens=100 if i % 4 == 0 else 24, temperature=0.8, seed=i,
                                                  stream_options={"include_usage": True})
        parts, usage, finish = [], None, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if i % 4 == 0 and len(parts) == 2:  # 8 clients hang up early
                await stream.close()
                return "gone"
        return finish, usage.completion_tokens

    async def main():
        aclient = server.openai(KEY, aio=True)
        return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    def errors(m):
        return sum(v for k, v in m.items() if k.startswith("quantkit_requests_total") and 'status="5' in k)

    before = server.metrics()
    results = asyncio.run(main())
    assert results.count("gone") == 8
    assert all(r in {("length", 24), ("stop", r[1])} for r in results if r != "gone")
    deadline = time.monotonic() + 10
    while (m := server.metrics())["quantkit_kv_pages_used"] or m["quantkit_num_requests_running"]:
        assert time.monotonic() < deadline, "KV pages leaked"
        time.sleep(0.1)
    assert errors(m) == errors(before)
    assert m['quantkit_requests_total{route="/v1/completions",status="200"}'] >= 32
    assert m["quantkit_time_to_first_token_seconds_count"] >= 32 and m["quantkit_kv_pages_total"] > 0
    log = server.log.read_text()
    assert log.count("client closed") >= 8  # aborted, not run to their 100 tokens


def _post(server, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = server.http.post("/v1/completions", content=raw if raw is not None else json.dumps(body),
                         headers={**headers, "Content-Type": "application/json"})
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return r.status_code, err


def test_bad_requests_get_openai_errors(server):
    ok = {"model": NAME, "prompt": "hello", "max_tokens": 4}
    assert _post(server, None, raw=b'{"model": "tiny", "prompt": ')[0] == 400
    status, err = _post(server, None, raw=b"[" * 100_000)  # deeper than Python's JSON parser recurses
    assert status == 400 and "nested too deeply" in err["message"]
    status, err = _post(server, {**ok, "max_tokens": "ten"})
    assert status == 400 and err["param"] == "max_tokens" and "int" in err["message"]
    status, err = _post(server, {**ok, "temperature": 9})
    assert status == 400 and err["param"] == "temperature"
    status, err = _post(server, {**ok, "model": "gpt-9"})
    assert status == 404 and err["code"] == "model_not_found" and NAME in err["message"]
    status, err = _post(server, {**ok, "prompt": "value " * 200, "max_tokens": 10})
    assert status == 400 and re.search(r"maximum context length is 128 tokens, but \d+ prompt tokens \+ 10",
                                       err["message"])
    for field, bad in (("n", 0), ("n", 129), ("n", 1.5), ("min_tokens", -1), ("min_tokens", 5), ("min_tokens", "2"),
                       ("ignore_eos", 1), ("ignore_eos", "true")):
        status, err = _post(server, {**ok, field: bad})
        assert status == 400 and err["param"] == field, (field, bad)
    for bad in ([], [[]], [["hello"]], [1, "a"], ["hello", ""]):
        status, err = _post(server, {**ok, "prompt": bad})
        assert status == 400 and err["param"] == "prompt", bad
    assert _post(server, ok, key=None)[0] == 401
    status, err = _post(server, ok, key="wrong")
    assert status == 401 and err["code"] == "invalid_api_key"
    assert _post(server, None, raw=b"x" * (9 << 20))[0] == 413
    with pytest.raises(openai.AuthenticationError):
        server.openai("nope").models.list()
    assert server.http.get("/health").status_code == 200  # still serving


def test_full_queue_429_and_sigterm_drains(model_dir, tmp_path):
    s = ServerProc(model_dir, tmp_path / "log", tmp_path / "cache", "--max-model-len", "128", "--max-num-seqs",
                   "1", "--max-waiting", "0", "--grace", "30", "--max-num-batched-tokens", "64")
    body = {"model": NAME, "prompt": "hello", "max_tokens": 120, "stream": True, "temperature": 0}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(lines)  # the one slot is now busy for ~120 more tokens
        busy = httpx.post(s.url + "/v1/completions", json={**body, "stream": False})
        s.p.send_signal(signal.SIGTERM)  # in flight: must still complete
        rest = [line for line in lines if line.startswith("data: ")]
    assert first.startswith("data: {")
    assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_exceeded"
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert s.p.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health")
