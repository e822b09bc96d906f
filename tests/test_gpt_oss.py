"""gpt-oss in its own published layout: experts as MXFP4 blocks and E8M0 scales (quant_method "mxfp4"), read by
quantkit as they are (formats/gpt_oss.py), against transformers loading the same files and dequantizing them
(integrations/mxfp4.py), and the compressed-tensors library decompressing what `quantkit convert` makes of them.
The bf16 layout's parity (sinks, biases, YaRN, alternating windows, chunked and mixed steps) is test_runtime's
`gpt_oss` family.

Tolerance: float32 logits within 1e-4 of transformers on the dequantized model (both compute in float32 on the
same exactly-representable weights; only summation order differs); weights compared bit for bit.
"""

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as T
from safetensors.numpy import save_file

from ct_oracle import library_decompress
from helpers import gpt_oss_model, greedy_parity, pack_native, rel_err
from quantkit.convert import convert
from quantkit.errors import InvalidInput

@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """The tiny gpt-oss in the native MXFP4 layout, transformers' model of it (dequantized on load), and the
    intended expert values, which transformers must have loaded exactly."""
    path = tmp_path_factory.mktemp("gpt-oss") / "native"
    intended = pack_native(gpt_oss_model(), path)
    ref = T.GptOssForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              quantization_config=T.Mxfp4Config(dequantize=True)).eval()
    for name, values in intended.items():
        loaded = ref.get_parameter(name).detach().numpy()
        assert loaded.shape == values.shape and np.array_equal(loaded, values), name
    return path, ref, intended


def test_native_mxfp4_served_as_published_matches_transformers(native):
    """The published blocks and scales become the MXFP4 QTensor gmm_v2 serves (codes and E8M0 scales as stored,
    nothing dequantized): float32 logits within 1e-4 of transformers over a prompt (two sliding windows long)
    and ten greedy decode steps, the same tokens."""
    path, ref, _ = native
    model = greedy_parity(path, ref, jnp.float32, 1e-4)
    from safetensors.numpy import load_file

    stored = load_file(str(path / "model.safetensors"))
    w = model.params["layers"]["sliding"]["experts_up"]  # layer 0's experts first
    assert type(w).__name__ == "QTensor" and w.qtype == "mxfp4"
    up_scales = stored["model.layers.0.mlp.experts.gate_up_proj_scales"][:, 1::2]  # [E, I, in/32], odd rows: up
    e, i, g = up_scales.shape  # the served scales: [E, in/32, I], lane-padded (E8M0 127) beyond in/32 and I
    assert np.array_equal(np.asarray(w.scales)[:e, :g, :i], up_scales.transpose(0, 2, 1))


def test_convert_native_to_mxfp4a16_is_lossless(native, tmp_path):
    """convert --scheme MXFP4A16 copies the published bytes into compressed-tensors per-expert Linears: the
    library decompresses every expert to exactly the values transformers loads; attention and router stay as
    they were. quantkit serves the result with the same logits."""
    path, ref, intended = native
    report = convert(path, tmp_path / "ct", "MXFP4A16")
    assert report["quantized_tensors"] == 0 and all(r["action"] == "copy" for r in report["tensors"])
    lib = library_decompress(tmp_path / "ct")
    e = intended["model.layers.0.mlp.experts.gate_up_proj"].shape[0]
    assert len(lib) == 3 * 3 * e  # layers x (gate, up, down) x experts, nothing else quantized
    for name, values in intended.items():
        root = name.rsplit(".", 1)[0]
        for x in range(e):
            parts = [("down_proj", values[x])] if name.endswith("down_proj") else \
                [("gate_proj", values[x][:, 0::2]), ("up_proj", values[x][:, 1::2])]
            for part, v in parts:
                assert np.array_equal(lib[f"{root}.{x}.{part}.weight"], v.T), (name, x, part)
    greedy_parity(tmp_path / "ct", ref, jnp.float32, 1e-4, steps=2)


@pytest.mark.parametrize("scheme", ["DENSE", "W4A16"])
def test_convert_native_to_other_schemes_from_its_values(native, tmp_path, scheme):
    """Any other scheme starts from the dequantized experts: DENSE gives exactly the published values in bf16;
    W4A16 quantizes those (the library's decompression within int4's error of them, where gate and up swapped
    or a wrong nibble order would be ~100% off)."""
    path, _, intended = native
    convert(path, tmp_path / scheme, scheme, group_size=32)
    v = intended["model.layers.2.mlp.experts.gate_up_proj"][5][:, 1::2].T  # expert 5's up_proj [out, in]
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    if scheme == "DENSE":
        from safetensors.torch import load_file

        got = load_file(str(next((tmp_path / scheme).glob("*.safetensors"))))[name]
        assert got.dtype == torch.bfloat16 and np.array_equal(got.float().numpy(), v)
    else:
        assert rel_err(library_decompress(tmp_path / scheme)[name], v) < 0.12


def test_inspect_native_and_bad_native_tensors(native, tmp_path):
    """inspect reads the native checkpoint without converting it: quant_method mxfp4, experts served as MXFP4,
    exit 0; a _blocks tensor without its _scales is one error line naming it, nothing else read."""
    import shutil

    from quantkit.formats.hf import Checkpoint
    from quantkit.inspect import inspect_checkpoint

    path, _, _ = native
    r = inspect_checkpoint(path)
    assert r["quant_method"] == "mxfp4" and r["exit_code"] == 0 and r["servable"], r["problems"]
    experts = [x for x in r["layers"] if ".experts." in x["name"]]
    assert experts and {x["format"] for x in experts} == {"mxfp4-pack-quantized"}
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    from safetensors.numpy import load_file

    t = load_file(str(bad / "model.safetensors"))
    del t["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(InvalidInput, match=r"model\.layers\.1\.mlp\.experts\.down_proj: _blocks and _scales"):
        Checkpoint.open(bad)


# ---- chat: the harmony format through the server ------------------------------------------------------

HARMONY_TEMPLATE = (  # the structure of gpt-oss's own template: a system message (with the reasoning effort
    # when a request sets one), each message as <|start|>role<|message|>text<|end|>, then <|start|>assistant
    "{% if reasoning_effort is defined %}<|start|>system<|message|>Reasoning: {{ reasoning_effort }} "
    "{{ reasoning_effort }} {{ reasoning_effort }}<|end|>{% endif %}"
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]


def harmony_model(path) -> None:
    """The tiny gpt-oss (bf16 layout) made a bigram model over a harmony tokenizer: every layer's output
    projections and experts zeroed, so the final hidden state is the current token's embedding, and lm_head
    rows that follow a fixed successor table: assistant -> <|channel|> -> analysis | final (a tie) ->
    <|message|> -> "hello" -> " world" -> <|end|> | <|return|> (a tie) ; <|end|> -> <|start|> -> assistant.
    Sampled, a completion is a random run of analysis and final messages "hello world", ended by <|return|>
    (an end-of-sequence id)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world, what is up"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", *MARKERS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens(["assistant", "analysis", "final"])
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(HARMONY_TEMPLATE)  # where gpt-oss keeps its template
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>"}))
    ids = {s: tok.token_to_id(s) for s in [*MARKERS, "assistant", "analysis", "final"]}
    hello, world = tok.encode("hello world").ids
    succ = {ids["assistant"]: [ids["<|channel|>"]], ids["<|channel|>"]: [ids["analysis"], ids["final"]],
            ids["analysis"]: [ids["<|message|>"]], ids["final"]: [ids["<|message|>"]], ids["<|message|>"]: [hello],
            hello: [world], world: [ids["<|end|>"], ids["<|return|>"]], ids["<|end|>"]: [ids["<|start|>"]],
            ids["<|start|>"]: [ids["assistant"]]}
    model = gpt_oss_model(vocab_size=320)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    assert tok.get_vocab_size() <= vocab and len(succ) <= hidden
    basis = {a: i for i, a in enumerate(succ)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "o_proj" in name or "experts.down_proj" in name:
                p.zero_()
        model.model.embed_tokens.weight.normal_(0, 0.01)
        model.lm_head.weight.zero_()
        for a, i in basis.items():
            model.model.embed_tokens.weight[a] = torch.nn.functional.one_hot(torch.tensor(i), hidden).float()
            for b in succ[a]:
                model.lm_head.weight[b, i] = 20.0
        model.model.norm.weight.fill_(1.0)
    model.config.eos_token_id = [ids["<|return|>"], ids["<|call|>"]]
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    from helpers import ServerProc

    tmp = tmp_path_factory.mktemp("harmony")
    harmony_model(tmp / "model")
    s = ServerProc(tmp / "model", tmp / "server.log", tmp / "cache", "--max-model-len", "96", "--max-num-seqs", "8",
                   "--max-num-batched-tokens", "64")
    yield s
    assert s.stop() == 0


def test_harmony_reasoning_and_content_with_the_openai_client(harmony_server):
    """Chat completions through the checkpoint's harmony template: each choice's analysis messages come back as
    `reasoning_content`, its final ones as `content` (markers and headers in neither), whole and streamed
    alike (the same seeds); the expectation is counted from the choice's own tokens (logprobs): "hello world"
    once per analysis / final header it holds. reasoning_effort reaches the template; a bad one is a 400."""
    import openai

    client = openai.OpenAI(base_url=harmony_server.url + "/v1", api_key="none", max_retries=0)
    ask = dict(model="tiny", messages=[{"role": "user", "content": "what is up"}], n=8, seed=3, temperature=1.0,
               max_tokens=60, logprobs=True)
    whole = client.chat.completions.create(**ask)
    both = 0
    for c in whole.choices:
        tokens = [t.token for t in c.logprobs.content]
        reasoning = getattr(c.message, "reasoning_content", None) or ""
        assert reasoning == "hello world" * tokens.count("analysis"), (tokens, reasoning)
        assert (c.message.content or "") == "hello world" * tokens.count("final"), (tokens, c.message.content)
        assert c.finish_reason == ("stop" if len(tokens) < 60 else "length")
        both += bool(reasoning and c.message.content)
    assert both >= 1  # some choice holds both kinds of message
    streamed = {}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for ch in chunk.choices:
            r, t = streamed.get(ch.index, ("", ""))
            extra = ch.delta.model_extra or {}
            streamed[ch.index] = (r + (extra.get("reasoning_content") or ""), t + (ch.delta.content or ""))
    assert [streamed[j] for j in range(8)] == [(getattr(c.message, "reasoning_content", None) or "",
                                               c.message.content or "") for c in whole.choices]
    plain = client.chat.completions.create(**{**ask, "n": 1, "max_tokens": 1})
    high = client.chat.completions.create(**{**ask, "n": 1, "max_tokens": 1}, reasoning_effort="high")
    assert high.usage.prompt_tokens > plain.usage.prompt_tokens  # the system line the template adds for it
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        client.chat.completions.create(**{**ask, "n": 1}, extra_body={"reasoning_effort": "extreme"})


def test_harmony_tool_calls_with_the_openai_client(harmony_server):
    """gpt-oss's own tool calls under tool_choice auto: a message addressed `to=functions.NAME` on the
    commentary channel, ended by <|call|>, comes back as a call with its text as the arguments, not as
    content; the analysis before it as reasoning_content; finish_reason tool_calls, whole and streamed. (The
    bigram model is made to write the call by a Lark grammar naming harmony's special tokens.)"""
    import openai

    client = openai.OpenAI(base_url=harmony_server.url + "/v1", api_key="none", max_retries=0)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    grammar = ('start: <|channel|> "analysis" <|message|> "hello world" <|end|> <|start|> "assistant" <|channel|> '
               '"commentary to=functions.add" <|message|> ARGS <|call|>\n' + r'ARGS: /\{"a": [0-9], "b": [0-9]\}/')
    ask = dict(model="tiny", messages=[{"role": "user", "content": "what is up"}], tools=tools, temperature=1.0,
               seed=5, max_tokens=80, extra_body={"structured_outputs": {"grammar": grammar}})
    whole = client.chat.completions.create(**ask).choices[0]
    (tc,) = whole.message.tool_calls
    assert whole.finish_reason == "tool_calls" and not whole.message.content
    assert whole.message.model_extra.get("reasoning_content") == "hello world"
    assert tc.function.name == "add" and re.fullmatch(r'\{"a": [0-9], "b": [0-9]\}', tc.function.arguments)
    reasoning, content, calls, finish = "", "", [], None
    for chunk in client.chat.completions.create(**ask, stream=True):
        for ch in chunk.choices:
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            content += ch.delta.content or ""
            calls += [(t.function.name, t.function.arguments) for t in ch.delta.tool_calls or []]
            finish = ch.finish_reason or finish
    assert (reasoning, content, calls, finish) == ("hello world", "", [("add", tc.function.arguments)], "tool_calls")
