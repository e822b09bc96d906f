"""Gated DeltaNet (GDN) linear attention, the layer kind with a fixed-size state per sequence (Qwen3.5's
"linear_attention" layers; runtime/models/qwen3_5.py).

A GDN layer (transformers models/qwen3_5, Qwen3_5GatedDeltaNet), per token x [hidden]:
  qkv = conv(in_proj_qkv x)        depthwise causal conv1d over the last K inputs of the sequence, then SiLU
  q, k [Hk, dk], v [Hv, dv]        split; q, k L2-normalised (eps 1e-6), q times dk^-1/2; each q/k head
                                   serves Hv / Hk consecutive v heads
  beta = sigmoid(in_proj_b x)      [Hv]: how much the token writes
  g = -exp(A_log) softplus(in_proj_a x + dt_bias)      [Hv]: log decay, <= 0
  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T      the delta rule on a float32 state S [Hv, dk, dv]
  o = S^T q                        [Hv, dv]
  out_proj(RMSNorm_w(o) * silu(in_proj_z x))          per head, weight w (not 1 + w)

A sequence's state between steps is one slot of the "linear" cache (runtime/cache.py): the last K - 1 conv
inputs (one row [1, (K - 1) * conv channels]) and S per layer. A row that starts at position 0 starts from
zeros, so a slot freed by a finished request needs no clearing; padding rows use the scratch slot
max_num_seqs and padding tokens are masked out of every state update.

Each row's tokens run in chunks of CHUNK (the chunked delta rule: within a chunk a unit lower-triangular
solve (I + A) X = B replaces the token loop; the state passes from chunk to chunk and step to step); a step
whose rows all have one token (decode) runs one recurrence step per row instead (chunks of 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from quantkit.runtime.config import ModelConfig
from quantkit.runtime.models.common import linear, rms_norm
from quantkit.runtime.ops import interpret, tpu_chip

CHUNK = 64
HI = jax.lax.Precision.HIGHEST  # the state maths in float32 (TPU's default f32 dot is one bf16 pass)


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _unit_lower_solve(a: jax.Array, b: jax.Array) -> jax.Array:
    """(I + a)^-1 b for strictly lower-triangular a [..., C, C]: a is nilpotent (a^C = 0), so
    (I + a)^-1 = (I - a)(I + a^2)(I + a^4)... over log2(C) factors: matmuls only (the MXU's work; XLA's
    triangular solve is a sequential loop on a TPU and compiles slowly on a CPU)."""
    def factor(_, px):  # as a loop: one body to compile (a float32 matmul is six MXU passes on a TPU)
        p, x = px
        return jnp.einsum("...tu,...uv->...tv", p, p, precision=HI), x + jnp.einsum("...tu,...uv->...tv", p, x,
                                                                                   precision=HI)

    return jax.lax.fori_loop(0, max(1, (a.shape[-1] - 1).bit_length()), factor, (-a, b))[1]


def delta_rule_chunk(s0, q, k, v, g, beta):
    """One chunk of C tokens for each of B = [rows, Hv] independent recurrences.

    s0 [B, dk, dv] state before the chunk; q, k [B, C, dk]; v [B, C, dv]; g, beta [B, C] (a padding token:
    k = v = beta = g = 0, changes nothing). Returns (o [B, C, dv], state after the chunk)."""
    c = q.shape[-2]
    cum = jnp.cumsum(g, axis=-1)  # [B, C]: log decay from the chunk's start through token t
    lower = jnp.tril(jnp.ones((c, c), bool))
    pair = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [B, C, C], t >= u
    kb, vb = k * beta[..., None], v * beta[..., None]
    a = jnp.einsum("...tk,...uk->...tu", kb, k, precision=HI) * pair * (1 - jnp.eye(c))
    # (I + A) [u | w] = [beta v | beta k exp(cum)]: the chunk's writes, before and after reading s0
    rhs = jnp.concatenate([vb, kb * jnp.exp(cum)[..., None]], axis=-1)
    x = _unit_lower_solve(a, rhs)
    u, w = x[..., :v.shape[-1]], x[..., v.shape[-1]:]
    v_new = u - jnp.einsum("...tk,...kv->...tv", w, s0, precision=HI)
    att = jnp.einsum("...tk,...uk->...tu", q, k, precision=HI) * pair
    o = (jnp.einsum("...tk,...kv->...tv", q * jnp.exp(cum)[..., None], s0, precision=HI)
         + jnp.einsum("...tu,...uv->...tv", att, v_new, precision=HI))
    last = cum[..., -1:]
    s1 = (s0 * jnp.exp(last)[..., None] + jnp.einsum("...tk,...tv->...kv", k * jnp.exp(last - cum)[..., None],
                                                     v_new, precision=HI))
    return o, s1


def _rows(batch: dict, t: int):
    """Per token: its row and index in the row; per row: its first token and token count."""
    cu = batch["cu_q_lens"]
    tok = jnp.arange(t)
    row = jnp.minimum(jnp.searchsorted(cu[1:], tok, side="right"), cu.shape[0] - 2)
    return row, tok - cu[row], cu[:-1], cu[1:] - cu[:-1]


def _slots_of(stack: jax.Array, i, slot) -> jax.Array:
    """Layer i's slots `slot` of a stacked conv state [L, slots, ...]: the layer sliced first, so that XLA
    keeps the stack's row-major layout (a gather over both indices had it copy the whole stack into another
    order and back: the step program of one Qwen3.5-35B-A3B layer counted 1,385 MB instead of 981)."""
    return jax.lax.dynamic_index_in_dim(stack, i, 0, keepdims=False)[slot]


def _set_slots(stack: jax.Array, i, slot, rows: jax.Array) -> jax.Array:
    """`stack` with layer i's slots `slot` set to rows (as `_slots_of`: through the layer's slice)."""
    layer = jax.lax.dynamic_index_in_dim(stack, i, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(stack, layer.at[slot].set(rows.astype(stack.dtype)), i, 0)


def _conv(qkv: jax.Array, w: jax.Array, c0: jax.Array, row, j, first, n):
    """Depthwise causal conv + SiLU of qkv [T, C] (w [K, C]) over each row's previous K - 1 inputs c0
    [rows, K - 1, C] and its own tokens; returns (out [T, C], each row's last K - 1 inputs)."""
    kk = w.shape[0]
    t = qkv.shape[0]
    out = jnp.zeros(qkv.shape, jnp.float32)
    for m in range(kk):  # m tokens back
        back = j - m
        x = jnp.where((back >= 0)[:, None], qkv[jnp.maximum(jnp.arange(t) - m, 0)],
                      c0[row, jnp.clip(kk - 1 + back, 0, kk - 2)])
        out = out + x.astype(jnp.float32) * w[kk - 1 - m].astype(jnp.float32)
    return jax.nn.silu(out).astype(qkv.dtype), _conv_tail(qkv, c0, first, n)


def _conv_tail(qkv: jax.Array, c0: jax.Array, first, n):
    """Each row's conv state after its first n [rows] tokens of qkv [T, C]: the last K - 1 of (c0 ++ them)."""
    kk1, t = c0.shape[1], qkv.shape[0]
    at = n[:, None] + jnp.arange(kk1)  # [rows, K - 1] index into that concatenation
    mine = qkv[jnp.clip(first[:, None] + at - kk1, 0, t - 1)]
    return jnp.where((at >= kk1)[..., None], mine.astype(c0.dtype),
                     jnp.take_along_axis(c0, jnp.minimum(at, kk1 - 1)[..., None], axis=1))


def _checkpoints(raw, c0, s0, q, k, v, g, beta, first, n, drafts: int):
    """Speculative decoding: each row's (conv, recurrent) state after its first 1, 2, ... `drafts` tokens
    (conv [rows, drafts, ...]; recurrent: a list of `drafts` [rows, ...]; raw: the conv's input [T, C]),
    the token-by-token delta rule from s0, so that a row whose drafts are partly rejected continues from
    the state after the ones it kept."""
    t = q.shape[0]
    convs, recs, s = [], [], s0
    for m in range(drafts):
        at, ok = jnp.minimum(first + m, t - 1), (m < n)
        one = lambda a: jnp.where(ok.reshape(-1, *[1] * (a.ndim - 1)), a[at], 0)[:, :, None]  # noqa: E731
        s = delta_rule_chunk(s, one(q), one(k), one(v), one(g), one(beta))[1]
        convs.append(_conv_tail(raw, c0, first, jnp.minimum(n, m + 1)))
        recs.append(s)
    return jnp.stack(convs, axis=1), recs


def _recurrence(q, k, v, g, beta, s0, first, n, decode: bool = False):
    """The delta rule over every row's tokens: q, k [T, Hv, dk], v [T, Hv, dv], g, beta [T, Hv] (float32),
    s0 [rows, Hv, dk, dv]; returns (o [T, Hv, dv], state after the row's tokens). Token by token where no row
    has more than one (a branch chosen on device, or statically with `decode`: a program of decode steps
    then holds no chunked path, which XLA's count and compile time would include), else by chunks."""
    t = q.shape[0]

    def run(c: int, s0):
        def chunk(i, carry):
            o, s = carry
            pos = i * c + jnp.arange(c)  # [C] index within the row
            ok = pos[None, :] < n[:, None]  # [rows, C]
            idx = jnp.where(ok, first[:, None] + pos, t)  # t: out of range, dropped on write
            take = lambda a: jnp.where(ok.reshape(*ok.shape, *[1] * (a.ndim - 1)),  # noqa: E731
                                       a[jnp.minimum(idx, t - 1)], 0).swapaxes(1, 2)  # [rows, Hv, C, ...]
            oc, s = delta_rule_chunk(s, take(q), take(k), take(v), take(g), take(beta))
            return o.at[idx].set(oc.swapaxes(1, 2), mode="drop"), s

        o = jnp.zeros(v.shape, jnp.float32)
        return jax.lax.fori_loop(0, (jnp.max(n) + c - 1) // c, chunk, (o, s0))

    c = min(CHUNK, t)
    if c == 1 or decode:
        return run(1, s0)
    return jax.lax.cond(jnp.max(n) <= 1, lambda s: run(1, s), lambda s: run(c, s), s0)


def _kernel(f, batch: dict, **kw):
    """A GDN kernel (kernels/gdn_decode.py, gdn_prefill.py) as the step runs it: in Pallas interpret mode
    under ops.interpreted_tpu_kernels, and on a mesh under shard_map with everything replicated (the states
    and their inputs: every device runs the same rows; XLA cannot partition a Mosaic call)."""
    run = functools.partial(f, interpret=interpret(), **kw)
    if batch.get("mesh") is None:
        return run
    from jax.sharding import PartitionSpec as P

    return jax.shard_map(run, mesh=batch["mesh"], in_specs=P(), out_specs=P(), check_vma=False)


def gdn_block(p: dict, x: jax.Array, state: tuple, i, batch: dict, cfg: ModelConfig) -> tuple[jax.Array, tuple]:
    """A Gated DeltaNet layer on x [T, hidden] (already normed); state: the "linear" cache (conv [L, slots,
    1, (K - 1) * C], recurrent [L, slots, Hv, dk, dv]; with speculative decoding also their checkpoints [L,
    slots, k, ...] after each of a row's first k tokens, `_checkpoints`), layer i read and written at the
    rows' slots."""
    conv_all, rec_all, *ckpt = state
    t = x.shape[0]
    hk, hv, dk, dv = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    row, j, first, n = _rows(batch, t)
    slot = batch["slot"]
    fresh = (batch["kv_lens"] - n == 0)[:, None, None]  # rows starting at position 0 start from zeros
    kernels = not ckpt and tpu_chip() is not None  # each row's recurrent state read and written once
    fused = kernels and batch.get("decode")  # and the conv state
    raw = linear(x, p["in_qkv"])
    if fused:
        from quantkit.kernels.gdn_decode import conv_decode, gdn_decode

        at, valid = jnp.minimum(first, t - 1), n > 0  # each row's one token
        qkv, conv_all = _kernel(conv_decode, batch)(raw[at], p["conv"], conv_all, i, slot, fresh[:, 0, 0], valid)
        x_rows = x[at]
    else:
        kk1 = cfg.conv_kernel - 1
        c0 = jnp.where(fresh, 0, _slots_of(conv_all, i, slot).reshape(-1, kk1, raw.shape[-1]))
        s0 = jnp.where(fresh[..., None], 0, rec_all[i, slot])
        qkv, c1 = _conv(raw, p["conv"], c0, row, j, first, n)
        conv_all, x_rows = _set_slots(conv_all, i, slot, c1.reshape(-1, 1, kk1 * raw.shape[-1])), x
    m = qkv.shape[0]  # tokens, or (fused) rows
    qkv = qkv.astype(jnp.float32)
    rep = hv // hk
    q = jnp.repeat(_l2norm(qkv[:, :hk * dk].reshape(m, hk, dk)), rep, axis=1) * dk ** -0.5
    k = jnp.repeat(_l2norm(qkv[:, hk * dk:2 * hk * dk].reshape(m, hk, dk)), rep, axis=1)
    v = qkv[:, 2 * hk * dk:].reshape(m, hv, dv)
    beta = jax.nn.sigmoid(linear(x_rows, p["in_b"]).astype(jnp.float32))  # [m, Hv]
    g = -jnp.exp(p["A_log"]) * jax.nn.softplus(linear(x_rows, p["in_a"]).astype(jnp.float32) + p["dt_bias"])
    if fused:
        o_rows, rec_all = _kernel(gdn_decode, batch)(q, k, v, g, beta, rec_all, i, slot, fresh[:, 0, 0], valid)
        o = jnp.zeros((t, hv, dv), jnp.float32).at[jnp.where(valid, first, t)].set(o_rows, mode="drop")
    elif kernels:  # the chunked rule, each row's state carried in VMEM across its chunks
        from quantkit.kernels.gdn_prefill import gdn_prefill

        o, rec_all = _kernel(gdn_prefill, batch, chunk=CHUNK)(q, k, v, g, beta, rec_all, i, slot, fresh[:, 0, 0],
                                                              first, n)
    else:
        o, s1 = _recurrence(q, k, v, g, beta, s0, first, n, batch.get("decode", False))
        rec_all = rec_all.at[i, slot].set(s1)
    z = linear(x, p["in_z"]).reshape(t, hv, dv)
    o = rms_norm(o.astype(x.dtype), p["gdn_norm"], cfg.rms_norm_eps) * jax.nn.silu(z.astype(jnp.float32))
    out = linear(o.astype(x.dtype).reshape(t, hv * dv), p["out"])
    state = (conv_all, rec_all)
    if ckpt and batch.get("verify"):  # (a step without drafts passes them on)
        c, r = _checkpoints(raw, c0, s0, q, k, v, g, beta, first, n, ckpt[1].shape[2])
        rec_ck = ckpt[1]
        for m, rm in enumerate(r):  # each state straight into its place: stacked first, then scattered, they
            rec_ck = rec_ck.at[i, slot, m].set(rm)  # counted 0.36 GB more a layer (docs/benchmarks.md)
        ckpt = (_set_slots(ckpt[0], i, slot, c.reshape(*c.shape[:2], 1, -1)), rec_ck)
    return out, (*state, *ckpt)


def keep_checkpoints(state: tuple, batch: dict, count: jax.Array) -> tuple:
    """After a verifying step: each drafted row's GDN state set to its checkpoint after the `count` [S]
    tokens it kept (unchanged where it kept them all: the step's own state after its tokens)."""
    conv_all, rec_all, conv_ck, rec_ck = state
    slot, drafts = batch["slot"], batch["drafts"]
    use = count <= drafts  # kept fewer than its 1 + drafts tokens
    at = jnp.clip(count - 1, 0, rec_ck.shape[2] - 1)

    def pick(now, ck):
        keep = use.reshape(1, -1, *[1] * (now.ndim - 2))
        return now.at[:, slot].set(jnp.where(keep, ck[:, slot, at], now[:, slot]), mode="drop")

    return pick(conv_all, conv_ck), pick(rec_all, rec_ck), conv_ck, rec_ck
