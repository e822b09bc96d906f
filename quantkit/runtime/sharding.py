"""Tensor parallelism: a 1-D mesh with a "model" axis; weights placed with NamedShardings and XLA's SPMD
partitioner inserting the collectives.

- column-parallel (output features split): q, k, v, gate, up, lm_head;
- row-parallel (input features split, all-reduce after): o, down. A row-parallel QTensor splits its
  values along k and its scale rows with them (k/group rows per shard), so grouped int4 works; channel
  scales (one row) are replicated, which is exact since every shard's partial sum uses the same scale.
- KV heads (and the KV cache) are split when their count divides the mesh, else replicated.
Everything else (embeddings, norms, router) is replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from quantkit.errors import InvalidInput
from quantkit.quant.qtensor import QTensor
from quantkit.runtime.config import ModelConfig

COLUMN = ("q", "k", "v", "gate", "up", "lm_head")
ROW = ("o", "down")


def make_mesh(tp: int) -> Mesh:
    devices = jax.devices()
    if tp > len(devices):
        raise InvalidInput(f"--tp {tp} needs {tp} devices, {len(devices)} available")
    return Mesh(np.array(devices[:tp]), ("model",))


def _spec(key: str, ndim: int, column: bool, kv_split: bool) -> P:
    """PartitionSpec of a [.., in, out] weight (or [g, rows, out] scales) named `key`."""
    if key in ("k", "v", "k_bias", "v_bias") and not kv_split:
        return P()
    if column:
        return P(*([None] * (ndim - 1)), "model")
    return P(*([None] * (ndim - 2)), "model", None)


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Places every leaf of the weight pytree on `mesh` by the rules above."""
    tp = mesh.shape["model"]
    if cfg.num_heads % tp:
        raise InvalidInput(f"{cfg.num_heads} attention heads do not split over {tp} devices")
    kv_split = cfg.num_kv_heads % tp == 0

    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))

    def place(key: str, w):
        if isinstance(w, QTensor):
            if key in COLUMN:
                return QTensor(put(w.values, _spec(key, 3, True, kv_split)),
                               put(w.scales, _spec(key, 3, True, kv_split)), w.qtype, w.group)
            rows_split = w.scales.shape[1] % tp == 0 and w.scales.shape[1] > 1
            return QTensor(put(w.values, _spec(key, 3, False, True)),
                           put(w.scales, _spec(key, 3, False, True) if rows_split else P()), w.qtype, w.group)
        if key in COLUMN or key.endswith("_bias") and key[0] in "qkv":
            return put(w, _spec(key, w.ndim, True, kv_split))
        if key in ROW:
            return put(w, _spec(key, w.ndim, False, True))
        return put(w, P())

    layers = [{key: place(key, w) for key, w in layer.items()} for layer in params["layers"]]
    out = {k: place(k, v) for k, v in params.items() if k != "layers"}
    out["layers"] = layers
    return out


def cache_sharding(cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
    """KV pages [pages, page_size, kv_heads, head_dim]: heads split when they divide the mesh."""
    tp = mesh.shape["model"]
    return NamedSharding(mesh, P(None, None, "model", None) if cfg.num_kv_heads % tp == 0 else P())
