"""Building blocks shared by the model families: pure functions over arrays and weight pytrees.

Weights: layers of one kind (config.layer_kinds: "full", "sliding") are stacked along a leading axis and
run with `jax.lax.scan` (`run_layers`), so the traced program does not grow with depth. A stacked linear
weight is dense [layers, in, out] or a QTensor [layers, in, out] (MoE experts: [layers * experts, in, out]);
inside the scan a layer's QTensor stays the whole stack plus the layer index (`At`), and the quantized
matmul reads that layer's tiles straight from the stack (gmm_v2's group offset), never a sliced copy.

A step's tokens are flattened: x [T, hidden], positions [T]. The KV cache of a kind is one array
[layers, pages, page_size, kv_heads * 2 * head_dim] (runtime/cache.py); `batch` carries the step's
metadata (runtime/step.py): per kind the flat cache slot of every token ("slots") and the block tables,
and the ragged layout (cu_q_lens, kv_lens, num_seqs).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from quantkit.quant.qtensor import QTensor
from quantkit.runtime.config import ModelConfig


@dataclass(frozen=True)
class At:
    """Layer `index` (traced) of a stacked QTensor weight; `groups` groups (experts) per layer."""

    w: QTensor
    index: Any
    groups: int = 1


def layer_params(stack: dict, i) -> dict:
    """Layer i of a kind's stacked weights: dense leaves indexed, QTensors as At views."""
    n = len(stack["attn_norm"])  # layers in the stack (unrolled on CPU: a tuple of per-layer arrays)
    return {key: At(w, i, w.shape[0] // n) if isinstance(w, QTensor) else w[i] for key, w in stack.items()}


def run_layers(body: Callable, kinds: tuple[str, ...], carry, unroll: bool = False):
    """carry = body(kind, i, carry) for every layer in order, i its (traced) index within its kind's stack.

    unroll: a plain Python loop instead (CPU serving, where XLA:CPU loops are slow; plan's cost analysis of
    shallow variants, since XLA's cost analysis counts a loop body once, whatever its trip count).

    Consecutive layers of a kind are one scan; a repeating pattern of runs (Gemma's 5 sliding + 1 full)
    is an outer scan over repetitions whose body runs one inner scan per run, so each kind's body is
    traced a fixed number of times whatever the depth; leftover runs after the last repetition follow.
    """
    if unroll:
        for i, kind in enumerate(kinds):
            carry = body(kind, kinds[:i].count(kind), carry)
        return carry
    runs = [(k, len(list(g))) for k, g in itertools.groupby(kinds)]
    unit, reps = runs, 1
    for u in range(1, len(runs) // 2 + 1):
        m = 1
        while runs[m * u:(m + 1) * u] == runs[:u]:
            m += 1
        if m > 1:
            unit, reps = runs[:u], m
            break
    per_unit = {k: sum(n for kk, n in unit if kk == k) for k, _ in unit}

    def run(kind, first, n, carry):
        if n == 1:
            return body(kind, first, carry)
        return jax.lax.scan(lambda c, j: (body(kind, first + j, c), None), carry, jnp.arange(n, dtype=jnp.int32))[0]

    def unit_body(carry, r):
        seen = dict.fromkeys(per_unit, 0)
        for kind, n in unit:
            carry = run(kind, r * per_unit[kind] + seen[kind], n, carry)
            seen[kind] += n
        return carry

    if reps > 1:
        carry = jax.lax.scan(lambda c, r: (unit_body(c, r), None), carry, jnp.arange(reps, dtype=jnp.int32))[0]
    else:
        carry = unit_body(carry, 0)
    done = {k: reps * per_unit.get(k, 0) for k in per_unit}
    for kind, n in runs[reps * len(unit):]:
        carry = run(kind, done.get(kind, 0), n, carry)
        done[kind] = done.get(kind, 0) + n
    return carry


def linear(x: jax.Array, w, bias: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ w [in, out] (+ bias), f32 accumulation, result in x.dtype; w dense or an At view."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(w, (At, QTensor)):
        from quantkit.runtime.ops import qmatmul

        y = qmatmul(x2, w.w, w.index) if isinstance(w, At) else qmatmul(x2, w)
    else:
        y = jnp.dot(x2, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    if bias is not None:
        y = (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)
    return y.reshape(*lead, y.shape[-1])


def grouped(x: jax.Array, w, sizes: jax.Array) -> jax.Array:
    """x [rows, in] sorted by expert, w one layer's experts [experts, in, out] (an At view of the stacked
    QTensor, or dense) -> [rows, out]."""
    if isinstance(w, At):
        from quantkit.runtime.ops import grouped_matmul

        return grouped_matmul(x, w.w, sizes, w.index * w.groups)
    return jax.lax.ragged_dot(x, w.astype(x.dtype), sizes, preferred_element_type=jnp.float32).astype(x.dtype)


def gated(x: jax.Array, gate, up, act: str, sizes: jax.Array | None = None) -> jax.Array:
    """GATES[act](x @ gate) * (x @ up) (kernels/gmm_v2.py GATES): an MLP's gate and up projections, by `linear`,
    or with sizes by `grouped` (rows sorted by expert). At views of one layer's stacks are one gated gmm_v2
    call where the two pair (runtime/ops.py grouped_matmul): x read once, the two products and the pass that
    multiplies them kept out of HBM."""
    from quantkit.kernels.gmm_v2 import GATES

    if isinstance(gate, At) and isinstance(up, At):
        from quantkit.runtime.ops import grouped_matmul

        x2 = x.reshape(-1, x.shape[-1])
        sizes = jnp.full((1,), x2.shape[0], jnp.int32) if sizes is None else sizes
        y = grouped_matmul(x2, gate.w, sizes, gate.index * gate.groups, up=up.w, gate=act)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    if sizes is None:
        return GATES[act](linear(x, gate)) * linear(x, up)
    return GATES[act](grouped(x, gate, sizes)) * grouped(x, up, sizes)


def live_tokens(batch: dict, t: int) -> jax.Array | None:
    """[t] bool: which of a step's t tokens belong to a sequence (the rest pad the token bucket), or None
    where `batch` does not say (a head run on its own tokens)."""
    if "cu_q_lens" not in batch or "num_seqs" not in batch:
        return None
    return jnp.arange(t) < batch["cu_q_lens"][batch["num_seqs"][0]]


def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w: tuple, num_experts: int,
                   act: Callable | str, mesh=None, bias: tuple | None = None,
                   live: jax.Array | None = None) -> jax.Array:
    """Sum over each token's chosen experts of weight * down(act(gate(x), up(x))); act a GATES key: the
    gated pair GATES[act](gate(x)) * up(x) (`gated`).

    x [T, hidden]; weights, experts [T, k] (float32, int); w: one layer's (gate, up, down) experts; bias: their
    biases [experts, out] each (gpt-oss), added to each row's outputs. The T * k rows are sorted by expert and
    run through the grouped matmul, one group per expert (`_sorted_rows`); rows whose expert is >= num_experts
    (another device's, under expert parallelism) add nothing.
    mesh: the expert-parallel mesh (runtime/sharding.py "e"), if any: see `_expert_parallel`; or the mesh
    axis's name (a str) inside the data-parallel step, whose devices each run their own tokens: see
    `_data_parallel_experts`.
    live: [T] bool (`live_tokens`): a padding token's rows go to no expert, so that no expert's weights are
    read for it (a decode step of one sequence in an 8-token bucket: 8 experts' instead of up to 64)."""
    if live is not None:
        experts = jnp.where(live[:, None], experts, num_experts)
    if isinstance(mesh, str):
        return _data_parallel_experts(x, weights, experts, w, num_experts, act, mesh, bias)
    if mesh is not None:
        return _expert_parallel(x, weights, experts, w, num_experts, act, mesh, bias)
    hidden = x.shape[-1]
    x = _served(x, w)
    k = experts.shape[-1]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    y = _sorted_rows(x[token], flat[order], weights.reshape(-1)[order], w, num_experts, act, bias)
    return jnp.zeros(x.shape, jnp.float32).at[token].add(y)[:, :hidden].astype(x.dtype)


def _served(x: jax.Array, w: tuple) -> jax.Array:
    """x [T, hidden] padded to the width the experts are served at (runtime/family.py experts: lane-padded,
    zero inputs; the outputs' extra columns are cut)."""
    served = (w[0].w if isinstance(w[0], At) else w[0]).shape[-2]
    return jnp.pad(x, ((0, 0), (0, served - x.shape[-1]))) if served > x.shape[-1] else x


def _sorted_rows(xs: jax.Array, ids: jax.Array, weights: jax.Array, w: tuple, num_experts: int,
                 act: Callable | str, bias: tuple | None) -> jax.Array:
    """Rows xs [R, served] sorted by their expert ids [R] through the grouped matmuls, each output row times
    its routing weight [R]; a row whose id is >= num_experts gives zeros. The weight scales the down
    projection's input (it is linear; rows past the groups come out of it zero): no float32 pass over the
    [R, hidden] outputs; it scales the outputs, in float32, where the down projection has biases (gpt-oss)
    or quantizes its input rows (W8A8, NVFP4: their quantization is of the unweighted rows)."""
    sizes = jnp.bincount(ids, length=num_experts).astype(jnp.int32)
    row_expert = jnp.minimum(ids, num_experts - 1)

    def run(rows, j):
        y = grouped(rows, w[j], sizes)
        if bias is None:
            return y
        return (y.astype(jnp.float32) + bias[j][row_expert].astype(jnp.float32)).astype(y.dtype)

    h = gated(xs, w[0], w[1], act, sizes) if isinstance(act, str) else act(run(xs, 0), run(xs, 1))
    if bias is None and not getattr(getattr(w[2], "w", w[2]), "act", None):
        return run(h * weights[:, None].astype(h.dtype), 2)
    return jnp.where((ids < num_experts)[:, None], run(h, 2).astype(jnp.float32) * weights[:, None], 0.0)


def _expert_parallel(x, weights, experts, w: tuple, num_experts: int, act: Callable | str, mesh,
                     bias: tuple | None = None) -> jax.Array:
    """routed_experts with each device holding num_experts / tp whole experts: every device sees all tokens
    (x is replicated after the tensor-parallel attention), runs the rows routed to its own experts through
    its grouped matmul (gmm_v2 on its local [layers * local, k, n] QTensor, no weight moves), and one psum
    (all-reduce of [T, hidden]) combines the partial sums: no dispatch collective, and the combine moves the
    bytes a row-parallel dense MLP's all-reduce moves. Expert biases come replicated; each device takes its
    experts' rows."""
    from jax.sharding import PartitionSpec as P

    from quantkit.runtime.sharding import AXIS, spec

    tp = mesh.shape[AXIS]
    local = num_experts // tp
    # At views of device-major stacked QTensors (their arrays, the layer), or one layer's dense experts
    parts = [(a.w.arrays, jnp.asarray(a.index, jnp.int32)) if isinstance(a, At) else a for a in w]
    specs = [(a.w.per_array(spec("e", 3), spec("e", 3), P(AXIS)), P()) if isinstance(a, At) else spec("e", 3)
             for a in w]

    def body(x, weights, experts, parts, bias):
        mine = tuple(At(a.w.with_arrays(p[0], mesh=None, split=""), p[1], local) if isinstance(a, At) else p
                     for p, a in zip(parts, w))
        e, bias = _localized(experts, bias, local, AXIS)
        return jax.lax.psum(routed_experts(x, weights, e, mine, local, act, bias=bias), AXIS)  # in x's dtype

    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), specs, P()), out_specs=P(), check_vma=False)(
        x, weights, experts, parts, bias)


def _localized(experts: jax.Array, bias: tuple | None, local: int, axis: str):
    """(experts, bias) as the device of mesh axis `axis` holding experts [i * local, (i + 1) * local) (i its
    index) runs them: its own experts' ids from 0, every other expert `local` (a row that adds nothing);
    expert biases come whole (replicated), and it takes its experts' rows."""
    first = jax.lax.axis_index(axis) * local
    e = experts - first
    e = jnp.where((e >= 0) & (e < local), e, local)
    return e, None if bias is None else tuple(jax.lax.dynamic_slice_in_dim(b, first, local) for b in bias)


def pack_routing(experts: jax.Array, weights: jax.Array) -> jax.Array:
    """Each token's routing [T, k] expert ids and float32 weights as one int32 array [T, 2k] (the weights'
    bits), so that one all-gather carries both; `unpack_routing` inverts it bit for bit."""
    return jnp.concatenate([experts.astype(jnp.int32), jax.lax.bitcast_convert_type(weights, jnp.int32)], axis=-1)


def unpack_routing(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(expert ids [T, k] int32, weights [T, k] float32) of `pack_routing`'s [T, 2k]."""
    k = packed.shape[-1] // 2
    return packed[:, :k], jax.lax.bitcast_convert_type(packed[:, k:], jnp.float32)


EXPERT_PASS = 1.5  # rows a pass of the data-parallel expert loop takes, in multiples of a device's own T * k: a
# balanced step's device gets T * k, and one 1.5x that (hot experts) still runs one pass
_ONE_PASS = [False]


@contextlib.contextmanager
def balanced_expert_passes():
    """Programs traced inside run the data-parallel expert loop as the one pass of a balanced step, which
    is what `plan` costs: XLA's cost analysis counts the body of a loop whose trip count the data decides
    more than once (+0.43 GB a Qwen3.5-397B layer, docs/plan.md). Not for serving: the rows past the first
    pass would be dropped."""
    _ONE_PASS[0] = True
    try:
        yield
    finally:
        _ONE_PASS[0] = False


def _data_parallel_experts(x, weights, experts, w: tuple, num_experts: int, act: Callable | str, axis: str,
                           bias: tuple | None = None) -> jax.Array:
    """routed_experts inside the data-parallel step (runtime/step.py): each device of `axis` has its own
    tokens x [T, hidden] and holds num_experts / n whole experts (w: already its own). The tokens' routing
    (ids and weights packed into one int32 array) and the tokens themselves are all-gathered (two
    all-gathers), each device runs the rows of all n * T tokens routed to its experts, and a reduce-scatter
    returns each device the sums over all experts of its own T rows (Ironwood's "option B").

    Of the n * T * k rows a device sees, T * k are its own on average (all n * T * k at worst): they are sorted
    to the front and run in passes of EXPERT_PASS * T * k rows (a loop of as many passes as they need, so
    a balanced step runs one pass of its expected rows, not the worst case's n times as many; each further
    pass reads the experts its rows visit again)."""
    n, (t, k) = jax.lax.axis_size(axis), experts.shape
    local = num_experts // n
    ids, weights = unpack_routing(jax.lax.all_gather(pack_routing(experts, weights), axis, tiled=True))
    xs = _served(jax.lax.all_gather(x, axis, tiled=True), w)  # [n * T, served]
    e, bias = _localized(ids.reshape(-1), bias, local, axis)  # another device's expert: `local`, sorted last
    rows = min(n * t * k, 8 * math.ceil(EXPERT_PASS * t * k / 8))
    order = jnp.argsort(e, stable=True)
    order = jnp.pad(order, (0, -order.shape[0] % rows), mode="edge")
    mine = jnp.sum(e < local)

    def one_pass(i, out):
        idx = jax.lax.dynamic_slice_in_dim(order, i * rows, rows)  # sorted rows i * rows ...
        ids = jnp.where(i * rows + jnp.arange(rows) < mine, e[idx], local)  # (past the last: padding)
        y = _sorted_rows(xs[idx // k], ids, weights.reshape(-1)[idx], w, local, act, bias)
        return out.at[idx // k].add(y.astype(out.dtype))

    out = jnp.zeros(xs.shape, x.dtype)  # a token's few rows here (k / n on average); the devices' sums in x.dtype
    out = one_pass(0, out) if _ONE_PASS[0] else jax.lax.fori_loop(0, (mine + rows - 1) // rows, one_pass, out)
    out = out[:, :x.shape[-1]]
    return jax.lax.psum_scatter(out, axis, scatter_dimension=0, tiled=True)


def router_logits(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, in] @ w [in, out] in float32 at full precision: a router's (and Qwen3.5's shared-expert gate's)
    logits. A TPU multiplies float32 operands as one bf16 pass by default, which moves the logits by ~1e-3
    and so picks another expert wherever two are that close (the tiny MoE families' on-chip runs did)."""
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm in float32; Gemma 3 scales by (1 + w), hence `offset`; w None: no scale (Gemma 4's v norm)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y if w is None else y * (offset + w.astype(jnp.float32))).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig, kind: str = "full") -> jax.Array:
    """Inverse frequencies [head_dim / 2] of the layers of `kind`: full layers use rope_theta with the
    configured scaling (Llama 3 long-context, or linear), or Gemma 4's "proportional" RoPE (the first
    rope_partial of the dims rotate, at frequencies over the whole head size; the rest get 0: unrotated);
    sliding-window layers rope_local_theta unscaled (Gemma 3 and 4), or as the full ones (gpt-oss)."""
    local = kind == "sliding" and not cfg.rope_local_scaled
    d = cfg.rope_dims or cfg.kv_shape(kind)[1]  # Qwen3.5: frequencies over the rotated dims only
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if local:
        return inv
    if cfg.rope_partial < 1.0:
        inv = jnp.where(jnp.arange(d // 2) < int(cfg.rope_partial * d // 2), inv, 0.0)
    if cfg.rope_scaling is None:
        return inv
    if cfg.rope_scaling[0] == "yarn":
        return _yarn_frequencies(inv, d, theta, cfg.rope_scaling)
    if len(cfg.rope_scaling) == 1:
        return inv / cfg.rope_scaling[0]
    factor, low, high, original = cfg.rope_scaling
    wavelen = 2 * jnp.pi / inv
    low_wl, high_wl = original / low, original / high
    smooth = (original / wavelen - low) / (high - low)
    scaled = jnp.where(wavelen > low_wl, inv / factor, inv)
    mid = (1 - smooth) * inv / factor + smooth * inv
    return jnp.where((wavelen <= low_wl) & (wavelen >= high_wl), mid, scaled)


def _yarn_frequencies(inv: jax.Array, d: int, theta: float, scaling: tuple) -> jax.Array:
    """YaRN's inverse frequencies (transformers' _compute_yarn_parameters): the original ones for dims that
    turn more than beta_fast times over the original context, those divided by the factor for dims that turn
    less than beta_slow times, a linear ramp over the dims between."""
    _, factor, fast, slow, original, truncate, _ = scaling

    def dim_of(rotations: float) -> float:
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high += 0.001 if low == high else 0.0
    ramp = jnp.clip((jnp.arange(d // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    return inv / factor * ramp + inv * (1 - ramp)


def rope_attention_factor(cfg: ModelConfig, kind: str = "full") -> float:
    """What cos and sin are scaled by: YaRN's attention factor on the layers it rotates, else 1."""
    scaling = cfg.rope_scaling
    scaled = kind != "sliding" or cfg.rope_local_scaled
    return scaling[-1] if scaling is not None and scaling[0] == "yarn" and scaled else 1.0


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, factor: float = 1.0,
               head_dim: int | None = None) -> jax.Array:
    """Rotates x [T, ..., n] by positions [T] (rotate-half convention of Hugging Face) over the first
    2 * len(inv_freq) dims of each head of `head_dim` lanes along its last axis (default: all n, one head;
    a projection's output [T, heads * head_dim] can be rotated before it is split into heads), cos and sin
    scaled by `factor` (YaRN); the rest pass unrotated (Qwen3.5's partial RoPE). Elementwise over lanes, the
    partner lane half a rotation away taken by a roll in x's own dtype (exact), so that XLA computes it in
    one fusion without float32 copies of slices (on a v6e, Llama-3-8B's 512-token step read 1.9 GB less
    when its q and k were rotated so, before the split, docs/benchmarks.md)."""
    n, half = x.shape[-1], inv_freq.shape[0]
    d = head_dim or n
    rotated = jnp.arange(d) < 2 * half
    angles = positions.reshape(-1, *[1] * (x.ndim - 1)).astype(jnp.float32) * jnp.concatenate(
        [inv_freq, inv_freq, jnp.zeros(d - 2 * half, inv_freq.dtype)])
    # one head's cos and sin [T, d], materialized (the barrier keeps XLA from fusing them into the rotation,
    # where they were computed per lane of every head: on a v5e 8.7 us a layer for q at 64 rows, 32 heads'
    # worth of transcendentals), then tiled over the heads by lane: tiling, not indexing (an index is a gather,
    # which a TPU runs element by element: 40 us a layer of a Llama-3-8B decode step)
    cos, sin = jax.lax.optimization_barrier((jnp.where(rotated, jnp.cos(angles) * factor, 1.0),
                                            jnp.where(rotated, jnp.sin(angles) * factor, 0.0)))
    reps = [1] * (x.ndim - 1) + [n // d]
    cos, sin = jnp.tile(cos, reps), jnp.tile(sin, reps)
    lane = jnp.arange(n) % d
    partner = jnp.where(lane < half, -jnp.roll(x, -half, axis=-1), jnp.roll(x, half, axis=-1))  # -x2 | x1
    return (x.astype(jnp.float32) * cos + partner.astype(jnp.float32) * sin).astype(x.dtype)


def attention_block(p: dict, x: jax.Array, kv: jax.Array, i, batch: dict, cfg: ModelConfig, kind: str
                    ) -> tuple[jax.Array, jax.Array]:
    """q/k/v projections (+ optional q/k norms, Gemma 4's weightless v norm; no v projection in a k_eq_v
    layer: V is the raw k projection), RoPE, cache write, paged attention, output projection.

    x [T, hidden]; kv: this kind's stacked cache, layer i written and read; returns (out [T, hidden], kv)."""
    from quantkit.runtime.attention import attention, write_kv

    t = x.shape[0]
    h, (kvh, d) = cfg.num_heads, cfg.kv_shape(kind)
    eps, offset = cfg.rms_norm_eps, cfg.norm_offset
    inv, scale = rope_frequencies(cfg, kind), rope_attention_factor(cfg, kind)
    pos = batch["positions"]
    q, k = linear(x, p["q"], p.get("q_bias")), linear(x, p["k"], p.get("k_bias"))
    v = linear(x, p["v"], p.get("v_bias")).reshape(t, kvh, d) if "v" in p else k.reshape(t, kvh, d)
    # rotated as they come, before the split into heads; not when the heads are split over a mesh, where
    # the roll along the projection's sharded axis would be a collective
    flat = not (cfg.attn_gate or cfg.qk_norm) and batch.get("mesh") is None
    if flat:
        q, k = apply_rope(q, pos, inv, scale, d), apply_rope(k, pos, inv, scale, d)
    q, k = q.reshape(t, h, -1), k.reshape(t, kvh, d)
    if cfg.attn_gate:  # Qwen3.5: [query | gate] per head
        q, gate = q[..., :d], q[..., d:].reshape(t, h * d)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], eps, offset)
        k = rms_norm(k, p["k_norm"], eps, offset)
    if cfg.v_norm:
        v = rms_norm(v, None, eps)
    sliding = kind == "sliding"
    if not flat:
        q, k = apply_rope(q, pos, inv, scale), apply_rope(k, pos, inv, scale)
    ks = p.get("kv_scale")  # [2, KVH] with an FP8 cache
    kv = write_kv(kv, i, k, v, batch["slots"][kind], ks, batch.get("kv_fp8"), batch.get("mesh"))
    if ks is not None:  # dequantization folded into q (k's scale) and the output (v's): scalars per KV head
        head = jnp.arange(h) // (h // kvh)
        q = (q.astype(jnp.float32) * ks[0, head][:, None]).astype(q.dtype)
    out = attention(q, kv, i, batch["kv_lens"], batch["tables"][kind], batch["cu_q_lens"], batch["num_seqs"],
                    scale=cfg.scale, sliding_window=cfg.sliding_window if sliding else None, mesh=batch.get("mesh"),
                    sinks=p.get("sinks"), short=1 + batch.get("verify", 0))
    if ks is not None:
        out = (out.astype(jnp.float32) * ks[1, head][:, None]).astype(out.dtype)
    out = out.reshape(t, h * d)
    if cfg.attn_gate:
        out = out * jax.nn.sigmoid(gate)
    return linear(out, p["o"], p.get("o_bias")), kv


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the largest value) as two plain reductions: the
    variadic (value, index) reduction of jnp.argmax took 1.5 s of a v6e compile at a 128k vocabulary, this
    0.7 s."""
    hit = x == jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(hit, jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1), x.shape[-1] - 1), axis=-1)


def logits(params: dict, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final projection of h [n, hidden] to the vocabulary (tied to the embedding when configured), float32."""
    if cfg.tie_word_embeddings:  # contract with the embedding's rows as they lie: a transposed copy of the
        # whole table per step (2.8 GB for Gemma-3-27B) is what `embed.T` compiled to on TPU
        out = jax.lax.dot_general(h, params["embed"].astype(h.dtype), (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    else:
        out = linear(h, params["lm_head"]).astype(jnp.float32)
    if cfg.final_logit_softcap:
        out = jnp.tanh(out / cfg.final_logit_softcap) * cfg.final_logit_softcap
    return out
