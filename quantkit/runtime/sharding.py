"""Tensor parallelism: a 1-D mesh with a "model" axis; weights placed with NamedShardings, XLA's SPMD
partitioner inserting the collectives, and quantized matmuls run per shard (runtime/ops.py).

- column-parallel (output features split, "n"): q, k, v (+ biases), gate, up, lm_head;
- row-parallel (input features split, "k", all-reduce after): o, down. A row-parallel QTensor splits its
  values along k and its scale rows with them (k/group rows per shard), so grouped int4 works; channel
  scales (one row) are replicated, which is exact since every shard's partial sum uses the same scale.
- KV heads (and the KV cache) are split when their count divides the mesh, else replicated.
Everything else (embeddings, norms, router, MoE experts) is replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from quantkit.errors import InvalidInput
from quantkit.quant.qtensor import QTensor
from quantkit.runtime.config import ModelConfig

AXIS = "model"
COLUMN = ("q", "k", "v", "q_bias", "k_bias", "v_bias", "gate", "up", "lm_head")
ROW = ("o", "down")


def row_major(sharding, ndim: int):
    """The placement of an array of `ndim` dims in row-major order on `sharding`. Weights are pinned to it (the
    Runner's arrays and plan's abstract ones alike): left free, XLA:TPU lays out an array with few rows per
    leading index otherwise (Gemma-3-27B g128: the [52, 42, 21504] stacked scales as [42, 52, 21504]) and the
    kernel, which reads one layer's rows, then gets a relayout copy of the whole stack every step (0.2 GiB
    of temporaries)."""
    from jax.experimental.layout import Format, Layout

    return Format(Layout(tuple(range(ndim))), sharding)


def place_row_major(tree):
    """`tree` with every array row-major on its own sharding; an array already so is kept, not copied (a copy
    of every weight would hold the model twice in HBM while the loader's arrays are alive)."""
    def put(x):
        if x.format.layout.major_to_minor == tuple(range(x.ndim)):
            return x
        return jax.device_put(x, row_major(x.sharding, x.ndim))

    return jax.tree_util.tree_map(put, tree)


def make_mesh(tp: int, devices=None) -> Mesh:
    """A mesh over the first `tp` of `devices` (default: this process's devices)."""
    devices = jax.devices() if devices is None else devices
    if tp > len(devices):
        raise InvalidInput(f"--tp {tp} needs {tp} devices, {len(devices)} available")
    return Mesh(np.array(devices[:tp]), (AXIS,))


def _spec(split: str, ndim: int) -> P:
    """PartitionSpec of an array [..., in, out] split along "n" (out), "k" (in) or not at all ("")."""
    if split == "n":
        return P(*([None] * (ndim - 1)), AXIS)
    if split == "k":
        return P(*([None] * (ndim - 2)), AXIS, None)
    return P()


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh, put=jax.device_put) -> dict:
    """Places every leaf of the weight pytree on `mesh` by the rules above.

    put(leaf, sharding): jax.device_put for real weights; `plan` passes one that makes abstract
    ShapeDtypeStructs."""
    tp = mesh.shape[AXIS]
    if cfg.num_heads % tp:
        raise InvalidInput(f"{cfg.num_heads} attention heads do not split over {tp} devices")
    def place(key: str, w, kind: str = "full"):
        kv_split = cfg.kv_shape(kind)[0] % tp == 0
        split = "" if key in ("k", "v", "k_bias", "v_bias") and not kv_split else \
            "n" if key in COLUMN else "k" if key in ROW else ""
        if not isinstance(w, QTensor):
            return put(w, NamedSharding(mesh, _spec(split, w.ndim)))
        rows = w.scales.shape[1]
        if split == "k" and rows > 1 and rows % tp:
            raise InvalidInput(f"{key}: {rows} scale groups along the input features do not split over {tp} "
                               "devices; use a smaller --tp or channel scales")
        scale_split = "" if split == "k" and rows == 1 else split
        return QTensor(put(w.values, NamedSharding(mesh, _spec(split, 3))),
                       put(w.scales, NamedSharding(mesh, _spec(scale_split, 3))), w.qtype, w.group, mesh, split)

    out = {k: place(k, v) for k, v in params.items() if k != "layers"}
    out["layers"] = {kind: {key: place(key, w, kind) for key, w in stack.items()}
                     for kind, stack in params["layers"].items()}
    return out


def cache_sharding(cfg: ModelConfig, mesh: Mesh, kind: str) -> NamedSharding:
    """Stacked KV pages of a kind [layers, pages, page_size, kv_heads * 2 * head_dim]: heads split when they
    divide the mesh (each head's keys and values are adjacent, so a split of the last axis is a split of heads)."""
    tp = mesh.shape[AXIS]
    return NamedSharding(mesh, P(None, None, None, AXIS) if cfg.kv_shape(kind)[0] % tp == 0 else P())
