"""The attention entry the models call: the Pallas paged-attention kernel on TPU, the pure-JAX path
(kernels/xla.py, same signature) elsewhere; and the cache write that precedes it."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv(kv: jax.Array, layer, k: jax.Array, v: jax.Array, slots: jax.Array, kv_scale=None,
             fp8=None, mesh=None) -> jax.Array:
    """Stores each token's keys and values k, v [T, KVH, D] into layer `layer` of the stacked pages
    kv [L, P, page_size, KVH * 2 * D] at flat slots [T] (page * page_size + offset; padding tokens go to
    the scratch page 0). A scatter into the scan's carried cache: updated in place.

    fp8 (a float8 dtype): an FP8 cache; each value is divided by its layer's scale (kv_scale [2, KVH]: k
    then v, per KV head), clamped to the format's finite range (as compressed-tensors and vLLM saturate)
    and rounded to fp8; the pages hold those fp8 values (on CPU as float32: XLA:CPU copies the whole cache
    on every scatter into a float8 array, as into bf16).

    A row is each KV head's key then value; without a tensor-parallel `mesh` (whose heads are split) and
    FP8, it is put together from lane slices of k and v as the projections give them, [T, KVH x D]:
    stacking the [T, KVH, D] arrays took XLA two relayouts of the step's keys and values on a TPU (2 MB a
    layer of Llama-3-8B's 80-token verifying step on a v6e, docs/benchmarks.md)."""
    t, kvh, d = k.shape
    if fp8 is not None or mesh is not None:
        rows = jnp.stack([k, v], axis=2)  # [T, KVH, 2, D]
        if fp8 is not None:
            big = float(jnp.finfo(fp8).max)
            rows = jnp.clip(rows.astype(jnp.float32) / kv_scale.T[None, :, :, None], -big, big).astype(fp8)
        rows = rows.reshape(t, -1)
    else:
        k, v = k.reshape(t, -1), v.reshape(t, -1)
        rows = jnp.concatenate([x[:, j * d:(j + 1) * d] for j in range(kvh) for x in (k, v)], axis=1)
    ps = kv.shape[2]
    return kv.at[layer, slots // ps, slots % ps].set(rows.astype(kv.dtype))


def attention(q, kv, layer, kv_lens, block_tables, cu_q_lens, num_seqs, *, scale: float,
              sliding_window: int | None = None, soft_cap: float | None = None, mesh=None,
              sinks: jax.Array | None = None, short: int = 1) -> jax.Array:
    """Ragged paged attention of q [T, H, D] over layer `layer` of kv (kernels/xla.py documents the
    contract); on a TPU target the Pallas kernel (head sizes kernels/paged_attention.HEAD_SIZES), elsewhere and
    for other head sizes the pure-JAX path.

    mesh: the tensor-parallel mesh (runtime/sharding.py). XLA cannot partition a Mosaic kernel, so the
    call runs per device under shard_map: each device its query heads over its KV heads when the cache's
    heads are split, else (KV replicated) every device the whole attention.
    sinks: [H] per-head sink logits (gpt-oss), split with the heads. short: the pure-JAX path computes the
    rows of sequences with at most this many queries together (a verifying step: 1 + its drafts)."""
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if mesh is not None:
        from jax.sharding import PartitionSpec as P

        from quantkit.runtime.sharding import AXIS

        split = kv.shape[-1] // (2 * q.shape[-1]) % mesh.shape[AXIS] == 0  # KV heads divide the mesh (cache_sharding)
        qs, kvs = (P(None, AXIS, None), P(None, None, None, AXIS)) if split else (P(), P())
        return jax.shard_map(lambda *args: attention(*args[:7], sinks=args[7], short=short, **kw), mesh=mesh,
                             in_specs=(qs, kvs, P(), P(), P(), P(), P(), P(AXIS) if split else P()), out_specs=qs,
                             check_vma=False)(q, kv, layer, kv_lens, block_tables, cu_q_lens, num_seqs, sinks)
    kw["sinks"] = sinks
    from quantkit.runtime.ops import interpret, tpu_chip

    from quantkit.kernels.paged_attention import HEAD_SIZES, paged_attention

    chip = tpu_chip()
    if chip is not None and q.shape[-1] in HEAD_SIZES:  # other head sizes (tiny models' 32): the pure-JAX path
        return paged_attention(q, kv, layer, kv_lens, block_tables, cu_q_lens, num_seqs, **kw, chip=chip,
                               interpret=interpret())
    from quantkit.kernels.xla import paged_attention_xla

    return paged_attention_xla(q, kv, layer, kv_lens, block_tables, cu_q_lens, num_seqs, **kw, short=short)
