"""Qwen3.5's MTP layer as a draft head (speculative method "mtp", models/qwen3_5.Mtp): the drafts a step
proposes against a reference built from transformers' own Qwen3.5 modules, and greedy output through the
engine identical to the target alone.

Oracles: transformers' Qwen3_5ForCausalLM (the target's final normed hidden state, its lm_head),
Qwen3_5DecoderLayer of the full-attention kind, Qwen3_5RMSNorm and the model's rotary embedding assembled as
vLLM's Qwen3_5MultiTokenPredictor defines the layer (a causal pass over the whole sequence each draft, no
cache); the plain forward step one token at a time for greedy output.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from quantkit.errors import Unsupported
from quantkit.runtime.engine import Engine, Request, Runner
from quantkit.runtime.loader import load
from quantkit.runtime.speculative import SpeculativeConfig, drafter_for

from helpers import check_draft_head, greedy_reference, qwen3_5_model

MTP = SpeculativeConfig("mtp", 3)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny random Qwen3.5 (3 GDN layers, then gated attention) with a random MTP layer saved beside its
    weights as `mtp.*` (transformers' own layer of the full-attention kind: its names are the checkpoint's)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen3_5 import modeling_qwen3_5 as M

    path = tmp_path_factory.mktemp("mtp") / "qwen3_5"
    model = qwen3_5_model(False)
    model.save_pretrained(path)
    cfg, h = model.config, model.config.hidden_size
    torch.manual_seed(3)
    mtp = torch.nn.ModuleDict({"layer": M.Qwen3_5DecoderLayer(cfg, layer_idx=cfg.layer_types.index("full_attention")),
                               "fc": torch.nn.Linear(2 * h, h, bias=False), "norm": M.Qwen3_5RMSNorm(h, cfg.rms_norm_eps),
                               "pre_fc_norm_embedding": M.Qwen3_5RMSNorm(h, cfg.rms_norm_eps),
                               "pre_fc_norm_hidden": M.Qwen3_5RMSNorm(h, cfg.rms_norm_eps)}).eval()
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if "norm" in name:  # zero-centred (1 + w): nonzero, so that which norm scales what shows
                p.copy_(torch.rand(p.shape) * 0.5)
    file = next(path.glob("*.safetensors"))
    tensors = load_file(file)
    for name, p in mtp.state_dict().items():
        tensors["mtp." + name.replace("layer.", "layers.0.")] = p.contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    return model, mtp, path


def _reference(model, mtp):
    """drafts(seq, next_token, k): the MTP layer's k greedy drafts after seq + [next_token]."""
    import torch

    rope = model.model.rotary_emb

    def head(emb, hidden):  # [1, n, H] each: a causal pass over the whole sequence
        n = emb.shape[1]
        x = mtp["fc"](torch.cat([mtp["pre_fc_norm_embedding"](emb), mtp["pre_fc_norm_hidden"](hidden)], dim=-1))
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        pos = torch.arange(n)[None]
        return mtp["norm"](mtp["layer"](x, position_embeddings=rope(x, pos), attention_mask=mask, position_ids=pos))

    @torch.no_grad()
    def drafts(seq: list, nxt: int, k: int) -> list:
        hidden = model.model(torch.tensor([seq])).last_hidden_state  # normed, as the target's head reads it
        emb = model.model.embed_tokens(torch.tensor([seq[1:] + [nxt]]))
        out = []
        for _ in range(k):
            g = head(emb, hidden)[:, -1:]
            out.append(int(torch.argmax(model.lm_head(g)[0, 0])))
            emb = torch.cat([emb, model.model.embed_tokens(torch.tensor([[out[-1]]]))], dim=1)
            hidden = torch.cat([hidden, g], dim=1)
        return out

    return drafts


def test_mtp_drafts_match_a_transformers_reference(qwen):
    """Two sequences in one ragged step, then one verifying three drafts of which two are accepted (the
    layer restarts from the last kept position; the GDN states roll back to it) beside a plain decode: every
    draft equals the reference's."""
    model, mtp, path = qwen
    loaded = load(path, dtype=jnp.float32, mtp=True)
    runner = Runner(loaded, max_model_len=128, max_num_seqs=2, page_size=8, max_num_batched_tokens=64,
                    speculative=3, drafter=drafter_for(MTP, loaded))
    rng = np.random.default_rng(2)
    check_draft_head(runner, model, [rng.integers(3, 256, 19).tolist(), rng.integers(3, 256, 9).tolist()],
                     _reference(model, mtp), 256)


def test_greedy_mtp_gives_the_targets_tokens(qwen):
    """Staggered requests with prompts chunked by a 16-token budget beside drafted decodes, one stopping on
    max_tokens: every request's tokens equal the target's own one at a time."""
    _, _, path = qwen
    loaded = load(path, dtype=jnp.float32, mtp=True)
    engine = Engine(Runner(loaded, max_model_len=128, max_num_seqs=4, page_size=8, max_num_batched_tokens=16,
                           speculative=3, drafter=drafter_for(MTP, loaded)), speculative=MTP)
    engine.fill_only = False
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in (30, 7, 21)]
    reqs = []
    for p, n in zip(prompts, (20, 14, 9)):
        reqs.append(engine.submit(Request(p, n)))
        engine.step()
    while engine.busy():
        engine.step()
    assert engine.pages_used == 0 and engine.drafts > 0
    assert [r.out for r in reqs] == [greedy_reference(loaded, p, n) for p, n in zip(prompts, (20, 14, 9))]


def test_plans_view_of_the_mtp_layer_is_what_load_holds(qwen):
    """`plan` compiles the MTP layer from loader.abstract(mtp=True): the same tree, shapes and dtypes as
    load(mtp=True) holds in params["draft"]."""
    import jax

    from quantkit.runtime.loader import abstract

    loaded = load(qwen[2], dtype=jnp.bfloat16, mtp=True)
    shapes = lambda t: jax.tree_util.tree_map(lambda a: (a.shape, str(a.dtype)), t)  # noqa: E731
    assert shapes(abstract(loaded.cfg, None, jnp.bfloat16, mtp=True)["draft"]) == shapes(loaded.params["draft"])
    assert "draft" not in abstract(loaded.cfg, None, jnp.bfloat16)


def test_mtp_needs_the_layer(tmp_path):
    """A checkpoint without mtp.* tensors: one line naming what is missing."""
    qwen3_5_model(False).save_pretrained(tmp_path / "q")
    with pytest.raises(Unsupported, match="needs a Qwen3.5 checkpoint with its MTP layer"):
        load(tmp_path / "q", dtype=jnp.float32, mtp=True)
