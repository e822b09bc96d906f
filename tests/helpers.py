"""Helpers shared by the test modules (which import from here, from ct_oracle and conftest's fixtures, never
from one another): the relative error every comparison uses, the tiny models of every family, the greedy
parity check against transformers and a trained tokenizer.

torch, transformers and the runtime are imported inside the functions that need them, so that a module using
only `rel_err` (the kernel tests) does not pay for importing transformers.
"""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np

COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, head_dim=32, max_position_embeddings=256)

# Qwen3.5: 3 Gated DeltaNet layers, then gated attention (the default layer pattern over 4 layers)
QWEN3_5_SMALL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=256, head_dim=32, max_position_embeddings=512, linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
                     linear_conv_kernel_dim=4)


def rel_err(out, ref) -> float:
    """||out - ref||_F / ||ref||_F in float64 (numpy, jax or CPU torch arrays, any shape)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def family(name):
    """A tiny random transformers model of family `name` (COMMON's shapes)."""
    import transformers as T

    if name == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**COMMON))
    if name == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(**COMMON))
    if name == "qwen3_moe":
        return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**COMMON, moe_intermediate_size=64, num_experts=8,
                                                      num_experts_per_tok=2, norm_topk_prob=True))
    if name == "gemma3":  # sliding window 8 < prompt length, so local layers really slide
        return T.Gemma3ForCausalLM(T.Gemma3TextConfig(
            **COMMON, sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"]))
    if name.startswith("gemma4"):
        return perturbed(T.Gemma4ForCausalLM(gemma4_config(moe=name == "gemma4_moe")))
    if name.startswith("qwen3_5"):  # its own tests: test_qwen3_5.py
        return qwen3_5_model(name == "qwen3_5_moe")
    if name == "gpt_oss":
        return gpt_oss_model()
    raise KeyError(name)


def gpt_oss_model(**kw):
    """A tiny random gpt-oss: sliding (window 8 < prompt length), full, sliding; YaRN over an original context of
    8; 8 experts, top-4; hidden size 96, which the experts serve padded to 128 lanes (as gpt-oss's 2880 to 2944).
    transformers initialises biases to 0 and sinks near 0, where a bias or sink applied
    wrongly (or not at all) would not show: all drawn at random, sinks ~ N(0, 1); SwiGLU limit 0.3, so that
    the clamps cut these small activations (at the published 7 they never would)."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    cfg = T.GptOssConfig(**COMMON | dict(hidden_size=96, intermediate_size=64) | kw, sliding_window=8, num_local_experts=8,
                         num_experts_per_tok=4, swiglu_limit=0.3,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                          "truncate": False, "original_max_position_embeddings": 8,
                                          "rope_theta": 10000.0})
    model = T.GptOssForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return model.eval()


def gemma4_config(moe: bool = False, **kw):
    """A tiny Gemma 4 text config: the default 5:1 pattern over 7 layers (the last forced full), full
    layers with their own head size (64) and one KV head shared by K and V (attention_k_eq_v), sliding
    window 8 < prompt length, logit soft-capping; `moe`: a routed expert block in every layer."""
    import transformers as T

    args = {**COMMON, "num_hidden_layers": 7, "sliding_window": 8, "global_head_dim": 64,
            "num_global_key_value_heads": 1, "attention_k_eq_v": True, "hidden_size_per_layer_input": 0,
            "final_logit_softcapping": 30.0}
    if moe:
        args |= dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=64)
    return T.Gemma4TextConfig(**{**args, **kw})


def perturbed(model):
    """transformers initialises norms, layer scalars and router scales to 1, where a bug in how they
    apply (w vs 1 + w, which tensor a scalar multiplies) would not show: draw them at random. q/k norm
    weights in [0.1, 0.4]: Gemma 4 does not scale attention logits by 1/sqrt(d), and with weights near 1 the
    logits of these random heads reach ~50, a softmax so sharp that bf16 rounding of one weight moves the
    output logits by 15% (measured): a test of quantized weights would then measure chaos, not the code.
    Router weights x20, for the same reason."""
    import torch

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(torch.rand(p.shape, generator=g) * 0.3 + 0.1)
            elif "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("router.proj.weight"):  # router logits spread ~5, not ~0.2: no near-ties in
                p.mul_(20.0)  # the top-k that bf16 rounding would flip (one flip moves a token's logits ~50%)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand(b.shape, generator=g) + 0.5)
    return model


def qwen3_5_model(moe: bool, **kw):
    """A tiny random Qwen3.5 (3 GDN layers, then gated attention): norms drawn in [0, 0.5] (zero-centred:
    scale 1 + w; transformers initialises them to 0, where w vs 1 + w would not show), the GDN output
    norm's weight in [0.5, 1.5] (scale w)."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    top_k, kw = kw.pop("top_k", 2), {**QWEN3_5_SMALL, **kw}  # kw overrides the small shapes
    if moe:
        cfg = T.Qwen3_5MoeTextConfig(**kw, moe_intermediate_size=64, shared_expert_intermediate_size=96,
                                     num_experts=8, num_experts_per_tok=top_k)
        model = T.Qwen3_5MoeForCausalLM(cfg)
    else:
        model = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**kw, intermediate_size=256))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) * 0.5)
    return model.eval()


def per_expert_linears(ex):
    """Per-expert gate/up/down Linears (fresh weights) in place of packed 3-D experts `ex` (what
    llm-compressor does before quantizing), so the library's config can target them by name."""
    import torch

    n, two_i, h = ex.gate_up_proj.shape
    mods = torch.nn.ModuleList()
    for _ in range(n):
        m = torch.nn.Module()
        m.gate_proj = torch.nn.Linear(h, two_i // 2, bias=False)
        m.up_proj = torch.nn.Linear(h, two_i // 2, bias=False)
        m.down_proj = torch.nn.Linear(two_i // 2, h, bias=False)
        mods.append(m)
    return mods


def greedy_parity(path, ref_model, dtype, tol, prompt_len=20, steps=10):
    """Prefill and `steps` greedy decode steps through the paged cache vs the reference's logits
    (quantized weights kept packed: the XLA path of the quantized matmul; layers scanned as on a TPU).
    Greedy tokens: each is the reference's own argmax on the same sequence, or, where the reference's best
    two are closer than the tolerance allows (tol x its largest logit), one within that of its best (a
    near tie that the tolerated error may break either way: the FP8_BLOCK checkpoint's first token, whose
    top two differ by 1% of the largest logit with transformers 5.25)."""
    import torch

    from quantkit.runtime.engine import Runner
    from quantkit.runtime.loader import load

    model = load(path, dtype=dtype)
    runner = Runner(model, max_model_len=64, page_size=8, weights="packed", scan=True)
    rng = np.random.default_rng(0)
    ids = [int(x) for x in rng.integers(0, 256, prompt_len)]
    ours = runner.forward([(0, ids, 0)])
    for i in range(steps):
        ids.append(int(ours[-1][-1].argmax()))
        ours += runner.forward([(0, [ids[-1]], prompt_len + i)])
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float().numpy()  # [prompt + steps, vocab]
    mine = np.concatenate(ours)  # same rows: prompt logits, then one per decode step
    assert rel_err(mine[: prompt_len + steps], ref[: prompt_len + steps]) < tol
    for i, chosen in enumerate(ids[prompt_len:]):
        r = ref[prompt_len - 1 + i]
        assert chosen == r.argmax() or r.max() - r[chosen] < tol * np.abs(r).max(), (i, chosen, int(r.argmax()))
    return model


def with_tokenizer(path):
    """Trains a 300-token byte-level BPE tokenizer into checkpoint directory `path`, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<s>assistant:{% endif %}"}))


def activation_order_moe(model, seed: int = 7) -> dict:
    """Permutes the input columns of a transformers Qwen3-MoE's attention Linears and of each expert (its fused
    gate_up_proj [E, 2I, H] and down_proj [E, H, I], in place) at random; returns module name -> permutation by
    the per-expert Linear names `quantkit convert` writes (gate and up share theirs, as one fused parameter),
    for ct_oracle.to_activation_order."""
    import torch

    rng = np.random.default_rng(seed)
    sigmas = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            p = f"model.layers.{i}."
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                lin = getattr(layer.self_attn, n)
                sigmas[f"{p}self_attn.{n}"] = s = torch.as_tensor(rng.permutation(lin.in_features))
                lin.weight.copy_(lin.weight[:, s])
            ex = layer.mlp.experts
            for e in range(ex.gate_up_proj.shape[0]):
                s1, s2 = (torch.as_tensor(rng.permutation(n)) for n in (ex.gate_up_proj.shape[-1], ex.down_proj.shape[-1]))
                ex.gate_up_proj[e].copy_(ex.gate_up_proj[e][:, s1])
                ex.down_proj[e].copy_(ex.down_proj[e][:, s2])
                sigmas |= {f"{p}mlp.experts.{e}.gate_proj": s1, f"{p}mlp.experts.{e}.up_proj": s1,
                           f"{p}mlp.experts.{e}.down_proj": s2}
    return sigmas


class ServerProc:
    """`quantkit serve PATH *flags` as a process on a free loopback port (or on the Unix socket `uds`), waited
    for until /ready; `early`: what /health, /ready and /v1/models answered while it was still loading. `http`:
    an httpx client of the server (relative URLs), `openai()`: the official client, both on its socket."""

    def __init__(self, path, log, cache, *flags: str, name: str = "tiny", key: str = "none", uds=None):
        import httpx
        self.log, self.launched, self.uds = log, time.time(), None if uds is None else str(uds)
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "QUANTKIT_JAX_CACHE": str(cache)}
        where = ["--port", "0"] if uds is None else ["--uds", self.uds]
        self.p = subprocess.Popen([sys.executable, "-m", "quantkit.cli", "serve", str(path), *where,
                                   "--served-model-name", name, *flags], env=env, stdout=subprocess.DEVNULL,
                                  stderr=open(log, "w"))
        try:
            deadline = time.monotonic() + 60
            address = r"http://127\.0\.0\.1:(\d+)" if uds is None else r"unix:(\S+) \("
            while not (m := re.search(address, log.read_text())):
                assert self.p.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            self.url = f"http://127.0.0.1:{m.group(1)}" if uds is None else "http://localhost"
            # a connection a request (as httpx.get): a kept-alive one that the server closes as it is reused fails
            self.http = httpx.Client(base_url=self.url, timeout=60, transport=self._transport(httpx.HTTPTransport),
                                     limits=httpx.Limits(max_keepalive_connections=0))
            # /health answers while the model is still loading and compiling; /ready does not
            deadline = time.monotonic() + 30
            while True:
                try:
                    health = self.http.get("/health")
                    break
                except httpx.ConnectError:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
            self.early = (health.status_code, self.http.get("/ready").status_code,
                          self.http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}))
            deadline = time.monotonic() + 600
            while self.http.get("/ready").status_code != 200:
                assert self.p.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        except BaseException:
            self.p.kill()  # no fixture will stop it
            raise

    def _transport(self, kind):
        return None if self.uds is None else kind(uds=self.uds)

    def openai(self, key: str = "none", aio: bool = False):
        """The official openai client (AsyncOpenAI with `aio`) of this server, on its TCP port or Unix socket
        (a transport of the httpx the client is built on: openai 3 ships its own fork, httpx2)."""
        import openai

        httpx = sys.modules[openai.DefaultHttpxClient.__mro__[1].__module__.split(".")[0]]
        if aio:
            http = openai.DefaultAsyncHttpxClient(transport=self._transport(httpx.AsyncHTTPTransport))
            return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, http_client=http)
        http = openai.DefaultHttpxClient(transport=self._transport(httpx.HTTPTransport))
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, http_client=http)

    def metrics(self) -> dict:
        from prometheus_client.parser import text_string_to_metric_families

        """Every sample of /metrics, parsed by prometheus_client, as 'name{label="value",...}' (labels sorted)."""
        text = self.http.get("/metrics").text
        return {s.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())) + "}" if s.labels else ""):
                s.value for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self) -> int:
        import signal
        import subprocess

        self.p.send_signal(signal.SIGTERM)
        try:
            return self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise


FP4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)  # e2m1 by code
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def pack_native(model, path, seed: int = 0) -> dict:
    """Writes `model` as OpenAI publishes gpt-oss (following transformers' loader): each expert tensor [E, in, out]
    as `_blocks` uint8 [E, out, in/32, 16] (random codes; the even input in the low nibble) and `_scales` uint8
    [E, out, in/32] (random E8M0 exponents around 2^-8), the rest float32, config.json with the mxfp4
    quantization_config. Returns the intended expert values {tensor name: [E, in, out]}."""
    rng = np.random.default_rng(seed)
    tensors, intended = {}, {}
    for name, w in model.state_dict().items():
        w = w.detach().numpy()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, k, n = w.shape
            blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
            scales = rng.integers(118, 122, (e, n, k // 32), dtype=np.uint8)
            codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(e, n, k)
            values = FP4[codes] * np.exp2(scales.astype(np.float32) - 127).repeat(32, axis=-1)
            intended[name] = values.transpose(0, 2, 1)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        else:
            tensors[name] = w
    path.mkdir(parents=True, exist_ok=True)
    from safetensors.numpy import save_file

    save_file(tensors, str(path / "model.safetensors"))
    model.config.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config |= {"architectures": ["GptOssForCausalLM"],
               "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}}
    (path / "config.json").write_text(json.dumps(config))
    return intended


def tiny_llama(path):
    """A tiny random Llama (2 layers, hidden 64, vocabulary 128), saved at path (seed 0)."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128, head_dim=16,
                                     max_position_embeddings=256)).save_pretrained(path)
    return path


def tiny_gemma3(path):
    """A tiny random Gemma 3 with an 8-token window (two local layers, then a global one), saved at path."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, head_dim=16, max_position_embeddings=256, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])).save_pretrained(path)
    return path


def greedy_reference(model, prompt, n):
    """Greedy tokens one at a time through the plain forward step (no engine, no sampling code)."""
    from quantkit.runtime.engine import Runner

    r = Runner(model, max_model_len=128, page_size=8)
    logits = r.forward([(0, prompt, 0)])[0][-1]
    out = []
    for i in range(n):
        out.append(int(np.argmax(logits)))
        logits = r.forward([(0, [out[-1]], len(prompt) + i)])[0][-1]
    return out


def check_draft_head(runner, target, prompts, reference, vocab: int):
    """A draft head's proposals through two steps against `reference(seq, next_token, k)` (a test's own
    transformers-built head): two sequences' prompts in one ragged step (each proposes k drafts after the
    target's token), then the first verifying three drafts of which two are right (the head must restart
    from the last kept position) beside the second's plain decode. Greedy tokens from transformers' own
    `generate` on the target."""
    import torch

    from quantkit.runtime.step import Row

    k = runner.speculative
    with torch.no_grad():
        greedy = [target.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False)[0, len(p):].tolist()
                  for p in prompts]
    for slot, p in enumerate(prompts):
        assert runner.pool.reserve(slot, 0, len(p) + 8)
    out = runner.run(runner.batch([Row(s, 0, len(p), p) for s, p in enumerate(prompts)]))
    tok, proposed = np.asarray(out[0]), np.asarray(out[-1])
    assert tok[:2, 0].tolist() == [g[0] for g in greedy]
    for s, p in enumerate(prompts):
        assert proposed[s].tolist() == reference(p, greedy[s][0], k)
    a, b = greedy
    out = runner.run(runner.batch([Row(0, len(prompts[0]), 4, None, drafts=(a[1], a[2], (a[3] + 1) % vocab)),
                                   Row(1, len(prompts[1]), 1, None)]))
    tok, count, proposed = np.asarray(out[0]), np.asarray(out[1]), np.asarray(out[-1])
    assert count[:2].tolist() == [3, 1] and tok[0, :3].tolist() == a[1:4] and tok[1, 0] == b[1]
    assert proposed[0].tolist() == reference(prompts[0] + a[:3], a[3], k)
    assert proposed[1].tolist() == reference(prompts[1] + b[:1], b[1], k)
