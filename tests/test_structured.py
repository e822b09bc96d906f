"""Structured outputs (runtime/structured.py, the mask in step.pick): `quantkit serve` as a real process driven
by the official `openai` client, outputs validated by `jsonschema`, `json` and `re.fullmatch` (none of them
quantkit's), over several seeds at temperature 1 and greedy.

The model is the default model's recipe at 2 layers with random weights: it writes no JSON by chance (the
control below). One planted habit keeps constrained strings short: every token embedding shares a constant
component on one hidden coordinate, which survives two layers of small random weights and the final norm,
and the output rows of `"`, `}` and `]` point along it, so those are likely wherever they are allowed. On its
own the habit writes runs of quotes, not JSON.
"""

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Literal

import jsonschema
import numpy as np
import openai
import pydantic
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import make_tiny_model  # noqa: E402
from helpers import ServerProc  # noqa: E402

NAME = "tiny"
CHAT = [{"role": "user", "content": "describe a person"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from quantkit.formats.safetensors_io import SafetensorsFile, write_safetensors
    from quantkit.runtime.tokenizer import TextCodec

    path = make_tiny_model.build(tmp_path_factory.mktemp("structured") / NAME, num_hidden_layers=2)
    file = SafetensorsFile(path / "model.safetensors")
    tensors = {name: np.array(file.read(name)).astype(np.float32) for name in file.tensors}
    codec = TextCodec(path)
    tensors["model.embed_tokens.weight"][:, 0] = 2.0
    for s, w in (('"', 1.0), ("}", 0.6), ("]", 0.6)):
        (i,) = codec.encode(s)
        tensors["lm_head.weight"][i, 0] = w
    import ml_dtypes

    write_safetensors(path / "planted.safetensors", {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()},
                      {"format": "pt"})
    (path / "planted.safetensors").replace(path / "model.safetensors")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return path


# a Hermes-style template (as Qwen's): the tools listed in a system turn, earlier calls as <tool_call> blocks,
# tool results as <tool_response> turns
TEMPLATE = ("{% if tools %}<s>system: tools:{% for t in tools %} {{ t.function | tojson }}{% endfor %}</s>{% endif %}"
            "{% for m in messages %}{% if m.role == 'tool' %}<s>tool: <tool_response>{{ m.content }}</tool_response></s>"
            "{% elif m.tool_calls %}<s>assistant: {% for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, "
            "'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}</s>"
            "{% else %}<s>{{ m.role }}: {{ m.content }}</s>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    s = ServerProc(model_dir, tmp / "server.log", tmp / "cache", "--max-model-len", "1024", "--max-num-seqs", "16",
                   "--max-num-batched-tokens", "64", name=NAME, uds=tmp / "quantkit.sock")  # on a Unix socket
    yield s
    assert s.stop() == 0


@pytest.fixture
def client(server):
    return server.openai()


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    zip: int = pydantic.Field(ge=10000, le=99999)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    tags: list[Literal["a", "b", "c"]] = pydantic.Field(min_length=1, max_length=3)
    address: Address


SCHEMA = Person.model_json_schema()


def _outside_strings(text: str) -> str:
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def test_mask_application_matches_numpy():
    """The on-device mask (step.allowed_logits, from masks structured.spread puts in the device layout)
    against a numpy reading of llguidance's bit order: token t is allowed by bit t % 32 of int32 word t // 32.
    A vocabulary of 100 (the last word partial), random words incl. sign bits, a padding row of all ones;
    and pick's tokens and log-probabilities unchanged by a mask that allows every token (its padding bits
    clear, so the masked path runs)."""
    import jax.numpy as jnp

    from quantkit.runtime.step import allowed_logits, pick, sample_rows, sampling_arrays
    from quantkit.runtime.structured import device_words, spread

    rng = np.random.default_rng()
    logits = rng.standard_normal((4, 100)).astype(np.float32)
    allow = rng.integers(-2**31, 2**31, (4, 4), dtype=np.int64).astype(np.int32)
    allow[2] = -1
    t0 = int(logits[0].argmax())  # row 0's best token disallowed, so that the mask changes a token
    allow.view(np.uint32)[0, t0 // 32] &= ~np.uint32(1 << (t0 % 32))
    bits = (allow.view(np.uint32)[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
    ref = np.where(bits.reshape(4, -1)[:, :100] == 1, logits, -np.inf)
    device = lambda masks: jnp.asarray(np.stack([spread(m, device_words(100)) for m in masks]))  # noqa: E731
    out = np.full_like(logits, np.nan)  # poisoned
    out[:] = allowed_logits(jnp.asarray(logits), device(allow))
    assert np.array_equal(out, ref) and np.array_equal(out[2], logits[2])

    s = {k: jnp.asarray(v) for k, v in sampling_arrays(4, 100).items()}
    everything = np.full((4, 4), -1, np.int32)
    everything[:, 3] = (1 << 4) - 1  # tokens 96..99 set, the 28 padding bits clear
    s["logprobs"] = jnp.ones(4, bool)
    plain = pick(jnp.asarray(logits), s, jnp.arange(4))
    masked = pick(jnp.asarray(logits), {**s, "allow": device(everything)}, jnp.arange(4))
    for a, b in zip(plain, masked):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    only = pick(jnp.asarray(logits), {**s, "allow": device(allow)}, jnp.arange(4))
    assert all(bits[r, int(t) // 32, int(t) % 32] for r, t in enumerate(np.asarray(only[0])))
    # the one-program step samples without masks (a masked step runs split): the same arrays, unmasked tokens
    batch = {"sampling": {**s, "allow": device(allow)}, "kv_lens": jnp.arange(4), "slot": jnp.arange(4)}
    (tok, *_), last = sample_rows(jnp.asarray(logits), jnp.zeros(5, jnp.int32), batch, masks=False)
    assert np.array_equal(np.asarray(tok), logits.argmax(-1)) and np.array_equal(np.asarray(last)[:4], np.asarray(tok))
    assert int(only[0][0]) != t0  # (the mask does change them)


def test_parse_a_pydantic_model(client):
    """chat.completions.parse with a pydantic model (nested object, enum, bounded array, integer ranges,
    bounded strings): every choice parses, greedy and three seeds at temperature 1; compact whitespace:
    outside strings, only the single spaces after ',' and ':'."""
    outs = [client.chat.completions.parse(model=NAME, messages=CHAT, response_format=Person, max_tokens=300,
                                          temperature=0)]
    outs.append(client.chat.completions.parse(model=NAME, messages=CHAT, response_format=Person, max_tokens=300,
                                              temperature=1, seed=3, n=3))
    choices = [c for r in outs for c in r.choices]
    assert len(choices) == 4 and len({c.message.content for c in choices}) >= 3
    for c in choices:
        assert c.finish_reason == "stop" and isinstance(c.message.parsed, Person), c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        assert re.fullmatch(r"(?:[^\s]|(?<=[,:]) )*", _outside_strings(c.message.content)), c.message.content


def test_json_schema_streamed_and_whole_and_json_object(client):
    """response_format json_schema (strict) streamed equals whole for a seed and validates; json_object gives
    JSON objects; the control: the same requests unconstrained are not JSON."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    kw = dict(model=NAME, messages=CHAT, max_tokens=300, temperature=1, seed=11, response_format=fmt)
    whole = client.chat.completions.create(**kw).choices[0]
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                   if c.choices)
    assert text == whole.message.content and whole.finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    for seed in (0, 1, 2):
        obj = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=400, temperature=1, seed=seed,
                                             response_format={"type": "json_object"}).choices[0]
        assert obj.finish_reason == "stop" and isinstance(json.loads(obj.message.content), dict), obj.message.content
        free = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=60, temperature=1,
                                              seed=seed).choices[0].message.content
        with pytest.raises(ValueError):
            json.loads(free)


def test_regex_choice_and_grammars_on_completions_and_chat(client):
    """vLLM's structured_outputs: regex (fullmatch), choice, a Lark grammar and a GBNF one, on completions
    (n = 3 at temperature 1) and chat (greedy)."""
    cases = [({"regex": r"[a-z]{3}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t)),
             ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
             ({"grammar": 'start: item item item\nitem: "a" | "bb" | "ccc"'}, lambda t: re.fullmatch("(a|bb|ccc){3}", t)),
             ({"grammar": 'root ::= "(" d d? ("+" d)? ")"\nd ::= [0-9]'}, lambda t: re.fullmatch(r"\([0-9]{1,2}(\+[0-9])?\)", t))]
    for so, ok in cases:
        r = client.completions.create(model=NAME, prompt="the answer is", max_tokens=40, temperature=1, seed=5, n=3,
                                      extra_body={"structured_outputs": so})
        chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=40, temperature=0,
                                              extra_body={"structured_outputs": so}).choices[0]
        for text, finish in [(c.text, c.finish_reason) for c in r.choices] + [(chat.message.content, chat.finish_reason)]:
            assert finish == "stop" and ok(text), (so, text)


def test_masked_logprobs_and_bad_constraints(client):
    """Log-probabilities are those of the masked distribution: every alternative reported is a digit; an
    impossible constraint (min_tokens beyond what a regex allows) ends the request with the text so far; bad
    constraints are 400s naming the field; the server goes on serving."""
    r = client.completions.create(model=NAME, prompt="the answer is", max_tokens=8, temperature=0, logprobs=5,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{4}"}}).choices[0]
    assert re.fullmatch("[0-9]{4}", r.text) and all(re.fullmatch("[0-9]+", t) for top in r.logprobs.top_logprobs
                                                    for t in top if top[t] > -9999)
    dead = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=20, temperature=0,
                                          extra_body={"structured_outputs": {"regex": "ab"}, "min_tokens": 5}).choices[0]
    assert (dead.message.content, dead.finish_reason) == ("ab", "stop")
    bad = [({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "regex"),
           ({"structured_outputs": {"json": {"type": "strange"}}}, "structured_outputs.json", "strange"),
           ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "foo"),
           ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
           ({"structured_outputs": {"colour": "red"}}, "structured_outputs", "unknown keys ['colour']"),
           ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
           ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
           ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
            "response_format", "schema"),
           ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
            "not both")]
    for body, param, words in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=5, extra_body=body)
        assert e.value.status_code == 400 and e.value.body["param"] == param and words in e.value.body["message"], \
            (body, e.value.body)
    assert client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=3).choices[0].message.content


def test_16_concurrent_mixed_streams_and_metrics(server):
    """16 concurrent streams, every other one constrained by the schema, at temperature 1: all complete,
    every constrained one valid; /metrics counts the constrained sequences and the mask time."""
    before = server.metrics()

    async def main():
        client = server.openai(aio=True)

        async def one(i):
            extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}} \
                if i % 2 == 0 else {}
            stream = await client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=300 if extra else 40,
                                                          temperature=1, seed=i, stream=True, **extra)
            parts, finish = [], None
            async for c in stream:
                if c.choices:
                    parts.append(c.choices[0].delta.content or "")
                    finish = c.choices[0].finish_reason or finish
            return bool(extra), "".join(parts), finish

        return await asyncio.gather(*(one(i) for i in range(16)))

    results = asyncio.run(main())
    assert all(finish in ("stop", "length") for _, _, finish in results)
    for constrained, text, finish in results:
        if constrained:
            assert finish == "stop"
            jsonschema.validate(json.loads(text), SCHEMA)
    m = server.metrics()
    assert m["quantkit_structured_requests_total"] - before["quantkit_structured_requests_total"] == 8
    masks = m["quantkit_structured_masks_total"] - before["quantkit_structured_masks_total"]
    assert masks >= 8 * 20 and m["quantkit_structured_mask_seconds_total"] > before["quantkit_structured_mask_seconds_total"]
    assert 0 < m["quantkit_structured_mask_steps_total"] - before["quantkit_structured_mask_steps_total"] <= masks


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                             "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _streamed_calls(stream) -> tuple[str, dict, str]:
    """(content, {index: (name, arguments)}, finish_reason) assembled from a chat stream's deltas."""
    content, calls, finish = "", {}, None
    for c in stream:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            name, args = calls.get(tc.index, ("", ""))
            calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
        finish = c.choices[0].finish_reason or finish
    return content, calls, finish


def test_tool_calls_required_named_and_auto(client):
    """tools with tool_choice required (greedy and three seeds at temperature 1), a named function, and auto:
    every call names a given tool with arguments valid against its parameters, finish_reason tool_calls,
    streamed deltas equal to the whole answer. Under auto the model's own text is parsed: a Hermes
    <tool_call> block and a Gemma 4 <|tool_call> one (the model made to write them by a regex) become calls
    and the text around them content, never streamed as content; so does Llama 3's bare JSON call; plain text
    stays content."""
    kw = dict(model=NAME, messages=[{"role": "user", "content": "weather in oslo?"}], tools=TOOLS, max_tokens=200)
    outs = [client.chat.completions.create(**kw, tool_choice="required", temperature=0),
            client.chat.completions.create(**kw, tool_choice="required", temperature=1, seed=4, n=3)]
    for c in [c for r in outs for c in r.choices]:
        assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls
        for tc in c.message.tool_calls:
            assert tc.type == "function" and tc.id.startswith("call_")
            jsonschema.validate(json.loads(tc.function.arguments), PARAMS[tc.function.name])
    whole = client.chat.completions.create(**kw, tool_choice="required", temperature=1, seed=9).choices[0]
    content, calls, finish = _streamed_calls(client.chat.completions.create(**kw, tool_choice="required",
                                                                             temperature=1, seed=9, stream=True))
    assert finish == "tool_calls" and not content
    assert calls == {k: (tc.function.name, tc.function.arguments) for k, tc in enumerate(whole.message.tool_calls)}

    named = client.chat.completions.create(**kw, temperature=1, seed=2,
                                           tool_choice={"type": "function", "function": {"name": "add"}}).choices[0]
    (tc,) = named.message.tool_calls
    assert tc.function.name == "add" and named.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(tc.function.arguments), PARAMS["add"])
    assert _streamed_calls(client.chat.completions.create(
        **kw, temperature=1, seed=2, stream=True, tool_choice={"type": "function", "function": {"name": "add"}})
    ) == ("", {0: ("add", tc.function.arguments)}, "tool_calls")

    forced = {"structured_outputs": {"regex": r'Sure\. <tool_call>\{"name": "get_weather", "arguments": '
                                              r'\{"city": "[a-z]{3}", "unit": "c"\}\}</tool_call>'}}
    auto = client.chat.completions.create(**kw, temperature=1, seed=3, extra_body=forced).choices[0]
    (tc,) = auto.message.tool_calls
    assert auto.finish_reason == "tool_calls" and auto.message.content == "Sure. " and tc.function.name == "get_weather"
    assert re.fullmatch("[a-z]{3}", json.loads(tc.function.arguments)["city"])
    content, calls, finish = _streamed_calls(client.chat.completions.create(**kw, temperature=1, seed=3, stream=True,
                                                                             extra_body=forced))
    assert (content, finish) == ("Sure. ", "tool_calls") and calls == {0: ("get_weather", tc.function.arguments)}
    gemma = {"structured_outputs": {"regex": r'<\|tool_call>call:get_weather\{city:<\|"\|>[a-z]{3}<\|"\|>,unit:<\|"\|>f<\|"\|>\}'
                                             r'<tool_call\|>ok'}}  # Gemma 4's own format
    g = client.chat.completions.create(**kw, temperature=1, seed=6, extra_body=gemma).choices[0]
    (tc,) = g.message.tool_calls
    assert g.message.content == "ok" and tc.function.name == "get_weather"
    args = json.loads(tc.function.arguments)
    assert args["unit"] == "f" and re.fullmatch("[a-z]{3}", args["city"])
    content, calls, finish = _streamed_calls(client.chat.completions.create(**kw, temperature=1, seed=6, stream=True,
                                                                             extra_body=gemma))
    assert (content, finish) == ("ok", "tool_calls") and calls == {0: ("get_weather", tc.function.arguments)}
    llama = {"structured_outputs": {"regex": r'\{"name": "add", "parameters": \{"a": [0-9], "b": [0-9]\}\}'}}
    (tc,) = client.chat.completions.create(**kw, temperature=1, seed=7, extra_body=llama).choices[0].message.tool_calls
    assert tc.function.name == "add" and re.fullmatch(r'\{"a": [0-9], "b": [0-9]\}', tc.function.arguments)  # Llama 3
    plain = client.chat.completions.create(**kw, temperature=1, seed=3,
                                           extra_body={"structured_outputs": {"regex": "[a-z]{5}"}}).choices[0]
    assert plain.finish_reason == "stop" and not plain.message.tool_calls and re.fullmatch("[a-z]{5}", plain.message.content)


def test_tool_results_go_back_through_the_template(client, model_dir):
    """An assistant turn with a tool call and the tool's result render through the checkpoint's template
    (jinja2 and tokenizers, not quantkit, render and count the expected prompt); bad tool fields are 400s."""
    import jinja2
    from tokenizers import Tokenizer

    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    messages = [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    r = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, max_tokens=2, temperature=0)
    expected = jinja2.Environment().from_string(TEMPLATE).render(
        tools=TOOLS, add_generation_prompt=True, messages=[
            messages[0], {"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
            messages[2]])
    assert '<tool_call>{"arguments": {"a": 2, "b": 3}, "name": "add"}</tool_call>' in expected
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert r.usage.prompt_tokens == len(tok.encode(expected, add_special_tokens=False).ids)
    bad = [({"tool_choice": "required"}, "tool_choice"), ({"tools": [{"type": "function"}]}, "tools"),
           ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
           ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice")]
    for body, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=5, extra_body=body)
        assert e.value.body["param"] == param, (body, e.value.body)
