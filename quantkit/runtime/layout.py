"""Where every weight of a model lives: the pytree of Slots (checkpoint module, kind, logical shape) that the
loader fills, `plan` describes abstractly and `inspect` reads its served shapes from, and the lane padding
the runtime applies. No jax: `inspect` uses it on its header-only path.

Name mapping is an explicit table per family (its module's `layer`, docs/architecture.md, rule 8): every pytree
leaf names exactly one checkpoint module, and a missing module is an error naming it (runtime/loader.py).
"""

from __future__ import annotations

from quantkit.formats.compressed_tensors import QuantConfig, weight_qtype
from quantkit.formats.ct_tensors import kernel_shapes
from quantkit.kernels.tiling import LANES, round_up
from quantkit.runtime.config import ModelConfig
from quantkit.runtime.family import Slot
from quantkit.runtime.models import family_of

def skeleton(cfg: ModelConfig, widths: tuple[int, int] = (0, 0)) -> dict:
    """The weight pytree of `cfg` with a Slot at every leaf: what `load` fills and `abstract` describes;
    `widths`: the (dense MLP, experts) intermediate widths (0: as configured; see `lane_widths`). Each layer's
    Slots are its family's (`Family.layer`); layers of one kind are stacked."""
    h, fam = cfg.hidden_size, family_of(cfg)
    layers = [fam.layer(cfg, f"{cfg.prefix}layers.{i}.", kind, widths) for i, kind in enumerate(cfg.layer_kinds)]
    stacks = {kind: {key: Slot("stack", tuple(layers[i][key] for i in ids), (len(ids), *layers[ids[0]][key].shape))
                     for key in layers[ids[0]]}
              for kind in cfg.kinds for ids in [[i for i, k in enumerate(cfg.layer_kinds) if k == kind]]}
    params = {"embed": Slot("embed", cfg.prefix + "embed_tokens", (cfg.vocab_size, h)), "layers": stacks,
              "final_norm": Slot("norm", cfg.prefix + "norm", (h,))}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = Slot("linear", "lm_head", (h, cfg.vocab_size))
    return params


def lane_widths(cfg: ModelConfig, qc: QuantConfig | None) -> tuple[int, int]:
    """(dense MLP, experts) intermediate widths on device: each rounded up to 128 lanes, since gmm_v2 serves
    only [k, n] in multiples of 128 and anything else falls back to dequantizing the weight in HBM every
    step (Gemma-4-26B-A4B: MLP 2112 -> 2176, experts 704 -> 768; unpadded, its compiled decode step read
    16x the weights). The padding is zero weights: act(0) * 0 = 0 into zero rows of down_proj, so every
    output is exactly unchanged. Not padded where the down projection's scale groups do not tile the
    padded width."""
    stack = skeleton(cfg)["layers"][cfg.layer_kinds[0]]

    def width(m: int, key: str) -> int:
        padded = round_up(m, LANES)
        if padded == m or key not in stack:
            return m
        down = stack[key].module[0]  # layer 0's Slot
        scheme = qc.scheme_for(down.module[0] if down.kind == "experts" else down.module, "Linear") if qc else None
        if weight_qtype(scheme) == "dense":
            return padded
        return padded if padded % kernel_shapes(scheme, (cfg.hidden_size, padded)).group == 0 else m

    return width(cfg.intermediate_size, "down"), width(cfg.moe_intermediate_size, "experts_down")


def slots(tree) -> list[Slot]:
    """Every module Slot of a skeleton (stacks opened: one Slot per layer)."""
    if isinstance(tree, dict):
        return [s for v in tree.values() for s in slots(v)]
    return [s for one in tree.module for s in slots(one)] if tree.kind == "stack" else [tree]


def described_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Per checkpoint module of a linear or expert, the [out, in] config.json describes, unpadded: what the
    checkpoint must store (validate.py refuses another shape, which the loader would pad or misread)."""
    out = {}
    for key, stack in ((k, s) for kind in skeleton(cfg)["layers"].values() for k, s in kind.items()):
        for s in stack.module:
            if s.kind == "linear":
                out[s.module] = (s.shape[-1], s.shape[-2])
            elif s.kind == "experts":  # the Slot's hidden side is served padded to 128 lanes (`experts`)
                k, n = s.shape[-2:]
                k, n = (k, cfg.hidden_size) if key == "experts_down" else (cfg.hidden_size, n)
                out |= {m: (n, k) for m in s.module}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = (cfg.vocab_size, cfg.hidden_size)
    return out


def served_shapes(cfg: ModelConfig, qc: QuantConfig | None) -> dict[str, tuple[int, int]]:
    """Per checkpoint module of a linear or expert, the [out, in] the runtime serves: its logical shape with
    the loader's lane padding (`lane_widths`). What `inspect` judges the kernel path on, what the loader
    places and `plan` compiles: one answer for all three."""
    out = {}
    for s in slots(skeleton(cfg, lane_widths(cfg, qc))):
        if s.kind == "linear":
            out[s.module] = (s.shape[-1], s.shape[-2])
        elif s.kind == "experts":
            out |= {m: (s.shape[-1], s.shape[-2]) for m in s.module}
    return out
