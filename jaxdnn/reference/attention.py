"""Reference scaled dot-product attention (materializes the [B, N, T, S] logits): the tests' oracle
and the second-order derivatives of the kernels. Shapes as `jaxdnn.dot_product_attention`:
q [B, T, N, H], k and v [B, S, K, H], N a multiple of K; lse and delta [B, N, T].

Computed in float32 (float64 for float64 inputs). The options (`AttentionOptions`) and the
optional operands follow the kernels' targets (ffi/attention/attention.h): bias [Bb, Nb, Tb, Sb]
float32 broadcastable to [B, N, T, S], mask bool likewise, q_lens/kv_lens [B] int32, q_seg [B, T]
and kv_seg [B, S] int32, dropout_seed [B, 2] uint32 (each None when absent). A query row with no key
to attend has output 0 and logsumexp -inf. Dropout regenerates the kernels' mask: the same hash of
(seed, n, t, s) as ffi/attention/attention_problem.h (head 0's for every head where they share one).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


KEEP_ALL = 1 << 24  # dropout_keep of no dropout


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """The static options of one attention call; window sides are None when unbounded."""
    scale: float
    is_causal: bool = False
    window_left: int | None = None
    window_right: int | None = None
    logits_soft_cap: float | None = None
    dropout_keep: int = KEEP_ALL  # keep a probability when its 24-bit hash is below this
    dropout_heads: bool = True  # a mask per head; False: the heads share head 0's


def dropout_keep(rate: float) -> int:
    """The kernels' integer keep threshold for a dropout rate in [0, 1)."""
    return max(1, round((1.0 - rate) * KEEP_ALL))


def _mix_bits(x):
    """attention_problem.h's MixBits on uint32 arrays (multiplications wrap)."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x21F0AAAD)
    x = x ^ (x >> 15)
    x = x * np.uint32(0x735A2D97)
    return x ^ (x >> 15)


def dropout_scale(seed, keep, heads, t_len, s_len, dtype, per_head=True):
    """[B, N, T, S]: 0 where dropped, KEEP_ALL / keep where kept (the kernels' DropoutScale); every
    head head 0's unless `per_head`."""
    u32 = jnp.uint32
    n = (jnp.arange(heads, dtype=u32) if per_head else jnp.zeros((heads,), u32))[None, :, None, None]
    t = jnp.arange(t_len, dtype=u32)[None, None, :, None]
    s = jnp.arange(s_len, dtype=u32)[None, None, None, :]
    seed = seed.astype(u32)
    h = _mix_bits(seed[:, 0, None, None, None] ^ n)
    h = _mix_bits(h ^ t)
    h = _mix_bits((h + s * np.uint32(0x9E3779B9)) ^ seed[:, 1, None, None, None])
    return jnp.where((h >> 8) < np.uint32(keep), jnp.asarray(KEEP_ALL / keep, dtype), jnp.asarray(0, dtype))


def _compute_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def attends(options: AttentionOptions, t_len, s_len, mask=None, q_lens=None, kv_lens=None, q_seg=None,
            kv_seg=None):
    """Whether query t attends key s: bool broadcastable to [B, N, T, S]."""
    t = jnp.arange(t_len)[:, None]
    s = jnp.arange(s_len)[None, :]
    allowed = jnp.ones((1, 1, t_len, s_len), bool)
    if options.is_causal:
        allowed &= s <= t
    if options.window_left is not None:
        allowed &= s >= t - options.window_left
    if options.window_right is not None:
        allowed &= s <= t + options.window_right
    if mask is not None:
        allowed &= mask
    if q_lens is not None:
        allowed &= (jnp.arange(t_len)[None, :] < q_lens[:, None])[:, None, :, None]
    if kv_lens is not None:
        allowed &= (jnp.arange(s_len)[None, :] < kv_lens[:, None])[:, None, None, :]
    if q_seg is not None:
        allowed &= (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
    return allowed


def _grouped(x, kv_heads):
    """[B, T, N, H] -> [B, T, K, G, H]."""
    return x.reshape(x.shape[0], x.shape[1], kv_heads, x.shape[2] // kv_heads, x.shape[3])


def _raw_logits(q, k, options):
    """scale q.k, soft-capped: [B, N, T, S] in the compute dtype."""
    compute = _compute_dtype(q.dtype)
    qg = _grouped(q.astype(compute), k.shape[2])
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(compute)) * options.scale
    logits = logits.reshape(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    if options.logits_soft_cap is not None:
        logits = options.logits_soft_cap * jnp.tanh(logits / options.logits_soft_cap)
    return logits


def _logits(q, k, bias, options):
    logits = _raw_logits(q, k, options)
    return logits if bias is None else logits + bias.astype(logits.dtype)


def _probs(logits, allowed, lse):
    """exp(logit - lse) where attended and the row has a key; 0 elsewhere (gradient-safe)."""
    live = allowed & jnp.isfinite(lse)[..., None]
    safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]
    return jnp.where(live, jnp.exp(jnp.where(live, logits, 0.0) - safe_lse), 0.0)


def _attend_values(p, v, q_shape):
    """sum_s p v: [B, N, T, S] x [B, S, K, H] -> [B, T, N, H]."""
    b, t, n, h = q_shape
    kv_heads = v.shape[2]
    pg = p.reshape(b, kv_heads, n // kv_heads, t, v.shape[1])
    return jnp.einsum("bkgts,bskh->btkgh", pg, v.astype(p.dtype)).reshape(b, t, n, h)


def _dropped(p, dropout_seed, options):
    """p with the dropout mask applied (p itself without dropout)."""
    if dropout_seed is None:
        return p
    return p * dropout_scale(dropout_seed, options.dropout_keep, p.shape[1], p.shape[2], p.shape[3], p.dtype,
                             options.dropout_heads)


def attention_fwd(q, k, v, bias, mask, q_lens, kv_lens, q_seg, kv_seg, dropout_seed,
                  options: AttentionOptions):
    """(o [B, T, N, H] in q's dtype, lse [B, N, T] float32, float64 for float64 inputs)."""
    logits = _logits(q, k, bias, options)
    allowed = attends(options, q.shape[1], k.shape[1], mask, q_lens, kv_lens, q_seg, kv_seg)
    row_max = jax.lax.stop_gradient(jnp.max(jnp.where(allowed, logits, -jnp.inf), axis=-1))
    safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    exps = jnp.where(allowed, jnp.exp(jnp.where(allowed, logits, 0.0) - safe_max[..., None]), 0.0)
    total = jnp.sum(exps, axis=-1)
    lse = jnp.where(total > 0, safe_max + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    o = _attend_values(_dropped(_probs(logits, allowed, lse), dropout_seed, options), v, q.shape)
    return o.astype(q.dtype), lse.astype(_compute_dtype(q.dtype))


def attention_bwd(d_out, q, k, v, o, lse, bias, mask, q_lens, kv_lens, q_seg, kv_seg, dropout_seed,
                  options: AttentionOptions):
    """(dq, dk, dv in their operands' dtypes, dbias [B, N, T, S] or None without a bias) from the
    forward's o and lse, as the kernels compute them: p = exp(logit - lse), delta = rowsum(do o),
    ds = p (do.v - delta)."""
    compute = _compute_dtype(q.dtype)
    b, t_len, n, h = q.shape
    kv_heads = k.shape[2]
    raw = _raw_logits(q, k, options)
    logits = raw if bias is None else raw + bias.astype(raw.dtype)
    allowed = attends(options, t_len, k.shape[1], mask, q_lens, kv_lens, q_seg, kv_seg)
    p = _probs(logits, allowed, lse.astype(compute))
    do_c = d_out.astype(compute)
    delta = jnp.sum(do_c * o.astype(compute), axis=-1).transpose(0, 2, 1)  # [B, N, T]
    dog = _grouped(do_c, kv_heads)
    dp = jnp.einsum("btkgh,bskh->bkgts", dog, v.astype(compute)).reshape(p.shape)
    ds = p * (_dropped(dp, dropout_seed, options) - delta[..., None])
    g = ds
    if options.logits_soft_cap is not None:
        g = g * (1.0 - jnp.square(raw / options.logits_soft_cap))
    g = (g * options.scale).reshape(b, kv_heads, n // kv_heads, t_len, k.shape[1])
    pg = _dropped(p, dropout_seed, options).reshape(g.shape)
    dq = jnp.einsum("bkgts,bskh->btkgh", g, k.astype(compute)).reshape(q.shape)
    qg = _grouped(q.astype(compute), kv_heads)
    dk = jnp.einsum("bkgts,btkgh->bskh", g, qg)
    dv = jnp.einsum("bkgts,btkgh->bskh", pg, dog)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None if bias is None else ds.astype(_compute_dtype(bias.dtype)))


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                          q_segment_ids=None, kv_segment_ids=None, logits_soft_cap=None, dropout_rate=0.0,
                          dropout_seed=None, dropout_heads=True):
    """Attention over [B, T, N, H] / [B, S, K, H] inputs as `jaxdnn.dot_product_attention` computes
    it (rank-4 inputs; rows with no key give 0), materializing the logits; dropout_seed [B, 2] uint32
    is the kernels' per-batch seed, dropout_heads False shares head 0's mask with every head."""
    if isinstance(local_window_size, (int, np.integer)):
        local_window_size = (local_window_size, local_window_size)
    left, right = local_window_size if local_window_size is not None else (None, None)
    options = AttentionOptions(
        scale=float(1.0 / np.sqrt(query.shape[-1]) if scale is None else scale), is_causal=bool(is_causal),
        window_left=left, window_right=right, logits_soft_cap=logits_soft_cap,
        dropout_keep=dropout_keep(dropout_rate), dropout_heads=bool(dropout_heads))
    return attention_fwd(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
                         q_segment_ids, kv_segment_ids, dropout_seed if dropout_rate else None, options)[0]
