"""Scaled dot-product attention with `jax.nn.dot_product_attention`'s signature, on fused kernels.

Shapes: query [B, T, N, H], key and value [B, S, K, H] (or the same without B), N a multiple of K:
query head n reads key/value head n // (N // K) (grouped-query / multi-query attention without
repeating K and V). bias and mask broadcast to [B, N, T, S]; lse (the logsumexp) is [B, N, T].

Two kernel stages (ffi/attention/attention.h), each a primitive: `attention_fwd` (q, k, v, ...) ->
(o, lse) streams the keys through an online softmax, so memory is linear in T and S; and
`attention_bwd` (do, q, k, v, o, lse, ...) -> (dq, dk, dv, dbias) recomputes the probabilities from
lse (dK/dV summed over the query heads of a group inside the kernel, in a fixed order). The
backward is deterministic unless `jaxdnn.config.deterministic` is off when it is traced: then the
Hopper kernel for head sizes 65-128 adds its dq partials unordered (faster; dq's bits may differ
between runs, as with cuDNN's default). Each stage is differentiated through
`jaxdnn.reference.attention`, so grad of grad works; forward-mode `jax.jvp` is not provided
(custom_vjp).
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.sharding import PartitionSpec

from jaxdnn import _ffi  # noqa: F401  (registers the FFI targets)
from jaxdnn import config
from jaxdnn._primitive import (explicit_row_sharding, ffi_primitive, match_varying, move_to_front,
                               with_reference_vjp)
from jaxdnn.reference import attention as _ref
from jaxdnn.reference.attention import AttentionOptions

_FLOAT_TYPES = [jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16)]
_F32 = jnp.float32
_MAX_HEAD_DIM = 256
_WHO = "dot_product_attention: "  # the start of every error message
# The CUDA decoding backward's bounds (kDecodeMaxRows, kDecodeMinKeys, kDecodeKeys in
# ffi/attention/attention.cu), and the (b, n) rows below which it replaces the other kernels.
_DECODE_MAX_ROWS, _DECODE_MIN_KEYS, _DECODE_KEYS, _DECODE_MAX_BN = 4, 1024, 256, 264

# The optional operands in the targets' order, their dtypes, and their bits of the `present` attribute.
_OPTIONAL = ("bias", "mask", "q_lens", "kv_lens", "q_seg", "kv_seg", "dropout_seed")
_OPTIONAL_DTYPES = (jnp.float32, jnp.bool_, jnp.int32, jnp.int32, jnp.int32, jnp.int32, jnp.uint32)


# --- the kernel stages ------------------------------------------------------------------------

def _fwd_avals(q, k, v, *optional, **attrs):
    """(o [B, T, N, H], lse [B, N, T] float32)."""
    b, t, n, _ = q.shape
    return [jax.core.ShapedArray(q.shape, q.dtype), jax.core.ShapedArray((b, n, t), _F32)]


def _bwd_avals(d_out, q, k, v, o, lse, *optional, bias_grad, deterministic, **attrs):
    """(dq, dk, dv, dbias [B, N, T, S] (when bias_grad) or [0], and the workspaces: delta [B, N, T];
    dq_accum float32: for decoding (G T <= 4 query rows a kv head, S >= 1024 keys, and B N < 264,
    under which the other kernels' dq is a few hundred blocks each walking every key) the CUDA
    decoding kernel's dq partials, ceil(S / 256) x q's size (ffi/attention/attention.cu:
    DecodeBackwardTakes), else for the Hopper fused kernel (16-bit, 64 < H <= 128) q's shape, else
    [0]; and for the latter, when deterministic, the semaphores ordering its adds (B * N *
    ceil(T / 64) int32), else [0] (the kernel adds unordered)."""
    b, t, n, h = q.shape
    s = k.shape[1]
    dbias = (b, n, t, s) if bias_grad else (0,)
    fused = q.dtype in (jnp.bfloat16, jnp.float16) and 64 < h <= 128
    decode = (all(isinstance(d, int) for d in (b, t, s)) and (n // k.shape[2]) * t <= _DECODE_MAX_ROWS
              and s >= _DECODE_MIN_KEYS and b * n < _DECODE_MAX_BN)
    dq_accum = (-(-s // _DECODE_KEYS) * b * t * n * h,) if decode else q.shape if fused else (0,)
    return [jax.core.ShapedArray(q.shape, q.dtype), jax.core.ShapedArray(k.shape, k.dtype),
            jax.core.ShapedArray(v.shape, v.dtype), jax.core.ShapedArray(dbias, _F32),
            jax.core.ShapedArray((b, n, t), _F32), jax.core.ShapedArray(dq_accum, _F32),
            jax.core.ShapedArray((b * n * (-(-t // 64)),) if fused and not decode and deterministic else (0,),
                                 jnp.int32)]


def _optional_specs(batch, optional):
    """Shardy specs of the optional operands: batch-sharded (`...`) when they have the batch axis,
    replicated when broadcast over it or absent (a [0] placeholder)."""
    specs = []
    for i, x in enumerate(optional):
        if x.ndim == 1 and x.shape[0] == 0 and batch != 0:
            specs.append(f"z{i}")
        elif x.ndim == 4:  # bias, mask [Bb, Nb, Tb, Sb]
            names = [f"{a}{i}" for a in "bnts"]
            specs.append(" ".join(["..."] + names[1:]) if x.shape[0] == batch else " ".join(names))
        else:  # lengths [B], segment ids [B, T] / [B, S], dropout seeds [B, 2]
            specs.append(" ".join(["..."] + [f"l{i}"] * (x.ndim - 1)))
    return specs


@functools.lru_cache(maxsize=None)
def _stage_primitive(stage: str, optional_specs: tuple, bias_grad: bool):
    """The primitive of `stage` ("fwd" or "bwd") for one arrangement of the optional operands (their
    Shardy specs differ with broadcasting) and, for "bwd", whether it returns dbias."""
    q, kv, stat = "... t n h", "... s k h", "... n t"
    opt = ", ".join(optional_specs)
    if stage == "fwd":
        rule = f"{q}, {kv}, {kv}, {opt} -> {q}, {stat}"
        return ffi_primitive("jaxdnn_attention_fwd", "jaxdnn_attention_fwd_v2", result_avals=_fwd_avals,
                             sharding_rule=rule, batch_rule=_batch_rule)
    dbias = "... n t s" if bias_grad else "zb"
    rule = f"{q}, {q}, {kv}, {kv}, {q}, {stat}, {opt} -> {q}, {kv}, {kv}, {dbias}"
    return ffi_primitive("jaxdnn_attention_bwd", "jaxdnn_attention_bwd_v3", result_avals=_bwd_avals,
                         sharding_rule=rule, batch_rule=_batch_rule, scratch_results=3,
                         host_attrs=("deterministic",))


def _bind(stage, operands, attrs):
    """Binds the stage's primitive; operands = the fixed ones then the six optional ones ([0] if absent)."""
    batch = operands[0].shape[0]
    specs = tuple(_optional_specs(batch, operands[-len(_OPTIONAL):]))
    return _stage_primitive(stage, specs, bool(attrs.get("bias_grad", 0))).bind(*operands, **attrs)


def _batch_rule(prim, args, dims, **attrs):
    """vmap folds the mapped axis into B: [V, B, ...] -> [V * B, ...]. A bias or mask broadcast over
    B that is not mapped stays broadcast; placeholders stay as they are."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    first = list(args[0].shape)  # q (fwd) or do (bwd) without the mapped axis: [B, T, N, H]
    if dims[0] is not None:
        del first[dims[0]]
    batch = first[0]
    stage = "fwd" if len(args) == 3 + len(_OPTIONAL) else "bwd"  # (q, k, v, ...), (do, q, k, v, o, lse, ...)

    def fold(x, d, broadcastable):
        if x.ndim == 1 and x.shape[0] == 0 and d is None:  # an absent operand
            return x
        if broadcastable and d is None and x.shape[0] == 1:  # a bias/mask broadcast over B stays so
            return x
        x = move_to_front(x, d, size)
        if x.shape[1] != batch:  # a mapped bias/mask broadcast over B
            x = jnp.broadcast_to(x, (size, batch) + x.shape[2:])
        return x.reshape((size * batch,) + x.shape[2:])

    first_optional = len(args) - len(_OPTIONAL)  # bias and mask are the first two optional operands
    outs = _bind(stage, [fold(a, d, first_optional <= i < first_optional + 2)
                         for i, (a, d) in enumerate(zip(args, dims))], attrs)
    unfolded, out_dims = [], []
    for out in outs:
        if out.ndim == 1 and out.shape[0] == 0:  # no dbias
            unfolded.append(out)
            out_dims.append(None)
        else:
            unfolded.append(out.reshape((size, batch) + out.shape[1:]))
            out_dims.append(0)
    return unfolded, out_dims


def _attrs(options: AttentionOptions, optional):
    present = sum(1 << i for i, x in enumerate(optional) if x is not None)
    return dict(
        scale=np.float32(options.scale),
        logits_soft_cap=np.float32(options.logits_soft_cap or 0.0),
        is_causal=np.int64(options.is_causal),
        window_left=np.int64(-1 if options.window_left is None else options.window_left),
        window_right=np.int64(-1 if options.window_right is None else options.window_right),
        present=np.int64(present),
        dropout_keep=np.int64(options.dropout_keep),
        dropout_heads=np.int64(options.dropout_heads))


def _operands(q, optional):
    """The optional operands with [0] placeholders for the absent ones, typed to vary like q
    inside shard_map."""
    filled = [jnp.zeros((0,), dtype) if x is None else x for x, dtype in zip(optional, _OPTIONAL_DTYPES)]
    return match_varying(q, *filled)


def _fwd_stage(q, k, v, optional, options):
    def kernel(q, k, v, *optional):
        return tuple(_bind("fwd", [q, k, v, *_operands(q, optional)], _attrs(options, optional)))

    def reference(q, k, v, *optional):
        o, lse = _ref.attention_fwd(q, k, v, *optional, options)
        return o, lse.astype(_F32)

    return with_reference_vjp(kernel, reference, q, k, v, *optional)


def _bwd_stage(d_out, q, k, v, o, lse, optional, options, bias_grad):
    """(dq, dk, dv, dbias [B, N, T, S] float32, or None unless bias_grad)."""
    def kernel(d_out, q, k, v, o, lse, *optional):
        dq, dk, dv, dbias = _bind("bwd", [d_out, q, k, v, o, lse, *_operands(q, optional)],
                                  dict(_attrs(options, optional), bias_grad=np.int64(bias_grad),
                                       deterministic=bool(config.deterministic)))
        return dq, dk, dv, dbias if bias_grad else None

    def reference(d_out, q, k, v, o, lse, *optional):
        dq, dk, dv, dbias = _ref.attention_bwd(d_out, q, k, v, o, lse, *optional, options)
        return dq, dk, dv, dbias.astype(_F32) if bias_grad else None

    return with_reference_vjp(kernel, reference, d_out, q, k, v, o, lse, *optional)


# --- the differentiable op --------------------------------------------------------------------

def _sum_to_shape(x, shape):
    """Sums the [B, N, T, S] gradient over the axes a bias of `shape` broadcasts along."""
    axes = tuple(i for i, (have, want) in enumerate(zip(x.shape, shape)) if want == 1 and have != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, optional, options):
    """(o, lse) for q [B, T, N, H], k and v [B, S, K, H]; `optional` = (bias float32, mask, q_lens,
    kv_lens, q_seg, kv_seg, dropout_seed), None where absent."""
    return _fwd_stage(q, k, v, optional, options)


def _attention_fwd(q, k, v, optional, options):
    """With symbolic zeros, the arguments carry `.value` and `.perturbed`: dbias ([B, N, T, S]
    float32, the one output that is not linear in T and S) is only computed for a perturbed bias.
    Whether it is rides in the residuals' structure: () or (None,)."""
    bias = optional[0]
    bias_grad = () if bias is None or not bias.perturbed else (None,)
    q, k, v, optional = jax.tree.map(lambda a: a.value, (q, k, v, optional),
                                     is_leaf=lambda a: isinstance(a, CustomVJPPrimal))
    o, lse = _fwd_stage(q, k, v, optional, options)
    return (o, lse), (q, k, v, optional, o, lse, bias_grad)


def _attention_bwd(options, saved, cotangents):
    """lse's cotangent is ignored: the public function stops its gradient (as jax.nn does)."""
    q, k, v, optional, o, lse, bias_grad = saved
    d_out = cotangents[0]
    if isinstance(d_out, SymbolicZero):
        d_out = jnp.zeros(d_out.shape, d_out.dtype)
    dq, dk, dv, dbias = _bwd_stage(d_out, q, k, v, o, lse, optional, options, bool(bias_grad))
    d_optional = [None] * len(optional)
    if bias_grad:
        d_optional[0] = _sum_to_shape(dbias, optional[0].shape).astype(optional[0].dtype)
    return dq, dk, dv, tuple(d_optional)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def _per_batch_shard(fn, q, k, v, optional):
    """fn(q, k, v, optional), run per shard of B when query's B axis is sharded over Explicit mesh
    axes (with Auto axes, or none, the primitives' own sharding rule does it): q, k, v, the lengths
    and segment ids, and a bias or mask with a B axis, are split over B; the others are replicated
    (a replicated bias's gradient is summed across the shards by JAX). Other sharded axes are
    gathered."""
    sharded = explicit_row_sharding(q, whole_axes=3)
    if sharded is None:
        return fn(q, k, v, optional)
    mesh, q_spec, axes = sharded
    batch = q.shape[0]

    def spec(x):  # bias and mask [1, ...] stay whole when they broadcast over B
        split = x.shape[0] == batch and (x.ndim < 4 or batch > 1)
        return PartitionSpec(q_spec[0] if split else None, *([None] * (x.ndim - 1)))

    rows = PartitionSpec(q_spec[0], None, None, None)
    stat = PartitionSpec(q_spec[0], None, None)
    optional_specs = tuple(None if x is None else spec(x) for x in optional)
    return jax.shard_map(fn, mesh=mesh, in_specs=(rows, rows, rows, optional_specs), out_specs=(rows, stat),
                         axis_names=set(axes))(q, k, v, optional)


# --- public API -------------------------------------------------------------------------------

def _as_array(x):
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else jnp.asarray(x)


def _leading_ones(x, rank):
    return x.reshape((1,) * (rank - x.ndim) + x.shape)


def _check_broadcast(name, x, full):
    """bias/mask: rank <= 4 (leading axes added as jax.nn does), each axis 1 or full."""
    if x.ndim > 4:
        raise ValueError(_WHO + f"{name} must have rank <= 4 (broadcastable to [B, N, T, S] = "
                         f"{full}), got shape {x.shape}")
    x = _leading_ones(x, 4)
    if any(d not in (1, f) for d, f in zip(x.shape, full)):
        raise ValueError(_WHO + f"{name} of shape {x.shape} is not broadcastable to [B, N, T, S] "
                         f"= {full}")
    return x


def _check_int_vector(name, x, shape):
    x = _as_array(x)
    if x.dtype != jnp.int32:
        raise TypeError(_WHO + f"{name} must be int32, got {x.dtype}")
    if x.shape != shape:
        raise ValueError(_WHO + f"{name} must have shape {shape}, got {x.shape}")
    return x


def _window(local_window_size):
    if local_window_size is None:
        return None, None
    if isinstance(local_window_size, numbers.Integral):
        local_window_size = (local_window_size, local_window_size)
    if (not isinstance(local_window_size, (tuple, list)) or len(local_window_size) != 2
            or not all(isinstance(w, numbers.Integral) and w >= 0 for w in local_window_size)):
        raise ValueError(_WHO + "local_window_size must be a non-negative int or a pair "
                         f"(left, right) of them, got {local_window_size!r}")
    return int(local_window_size[0]), int(local_window_size[1])


def _static_number(name, value):
    if isinstance(value, jax.core.Tracer) or not isinstance(value, numbers.Real):
        raise TypeError(_WHO + f"{name} must be a Python number (static), got {value!r}")
    return float(value)


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False, q_segment_ids=None,
                          kv_segment_ids=None, logits_soft_cap=None, dropout_rate=0.0, dropout_rng=None,
                          broadcast_dropout=False):
    """Scaled dot-product attention, as `jax.nn.dot_product_attention`, on jaxdnn's fused kernels.

    softmax(scale q.k^T + bias) v per query head, with memory linear in T and S (the [B, N, T, S]
    logits are never stored).

    Args:
      query: [B, T, N, H] (or [T, N, H]), float32, bfloat16 or float16; H a multiple of 8, <= 256.
      key, value: [B, S, K, H] (or [S, K, H]) of query's dtype; N must be a multiple of K
        (K == N: multi-head, K < N: grouped-query, K == 1: multi-query attention).
      bias: None, or a floating array of rank <= 4 broadcastable to [B, N, T, S], added to the logits
        (after the soft cap). Its gradient is summed to its own shape. The kernels read it as float32.
      mask: None, or a bool array broadcastable to [B, N, T, S]; True takes part.
      scale: the logits' scale (a Python number); None: 1 / sqrt(H).
      is_causal: query t attends keys s <= t (jax.nn's top-left alignment when T != S).
      query_seq_lengths, key_value_seq_lengths: None or int32 [B]: query rows t >= length give 0 and
        keys s >= length are not attended.
      local_window_size: None, an int w or a pair (left, right): query t attends keys
        t - left <= s <= t + right.
      implementation: None or "jaxdnn": these kernels. "xla" or "cudnn": `jax.nn.dot_product_attention`
        itself (for comparisons; the options below beyond jax.nn's are then refused).
      return_residual: also return the logsumexp [B, T, N] (query's dtype, no gradient), as jax.nn.
      q_segment_ids, kv_segment_ids: None, or int32 [B, T] and [B, S] together: packed sequences,
        query t attends key s only when their ids are equal.
      logits_soft_cap: None or c > 0: logits = c tanh(logits / c) (Gemma 2), before the bias.
      dropout_rate: a Python float in [0, 1): each attention probability is zeroed with this
        probability and the kept ones scaled by 1 / (1 - dropout_rate) (after the softmax, whose
        normalizer and the logsumexp are undropped), as Flax does.
      dropout_rng: a `jax.random` key, required when dropout_rate > 0. The mask is a hash of two
        words per batch element drawn from it and of (head, query, key): the same key gives the
        same mask, in the backward too (which regenerates it rather than storing it).
      broadcast_dropout: False: a mask per batch element and head; True: one [T, S] mask shared by
        every batch element and head (Flax's `broadcast_dropout=True`, its default).

    Every masking option combines with the others. A query row with no key left to attend gives
    0 (jax.nn's "xla" path instead averages every value there, and reports a finite logsumexp where
    jaxdnn's is -inf).

    Returns:
      [B, T, N, H] (query's shape) in query's dtype; with return_residual, (output, logsumexp).
      Differentiable w.r.t. query, key, value and bias to any order with `jax.grad`/`jax.vjp`;
      `jax.jvp` is not supported.
    """
    if implementation in ("xla", "cudnn"):
        if q_segment_ids is not None or kv_segment_ids is not None or logits_soft_cap is not None:
            raise ValueError(_WHO + f"implementation={implementation!r} (jax.nn) does not "
                             "take q_segment_ids, kv_segment_ids or logits_soft_cap")
        if dropout_rate or dropout_rng is not None:
            raise ValueError(_WHO + f"implementation={implementation!r} (jax.nn) has no dropout")
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation=implementation,
            return_residual=return_residual)
    if implementation not in (None, "jaxdnn"):
        raise ValueError(_WHO + "implementation must be None, 'jaxdnn', 'xla' or 'cudnn', got "
                         f"{implementation!r}")
    query, key, value = _as_array(query), _as_array(key), _as_array(value)
    if query.ndim not in (3, 4):
        raise ValueError(_WHO + f"query must be [B, T, N, H] or [T, N, H], got shape {query.shape}")
    if key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(_WHO + f"key and value must have query's rank {query.ndim} "
                         f"([B, S, K, H]), got key {key.shape} and value {value.shape}")
    out_shape = query.shape
    q, k, v = (_leading_ones(x, 4) for x in (query, key, value))
    if q.dtype not in _FLOAT_TYPES:
        raise TypeError(_WHO + f"query must be float32, bfloat16 or float16, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(_WHO + f"key and value must have query's dtype {q.dtype}, got "
                        f"{k.dtype} and {v.dtype}")
    b, t, n, h = q.shape
    _, s, kv_heads, _ = k.shape
    if v.shape != k.shape:
        raise ValueError(_WHO + f"value must have key's shape {k.shape}, got {v.shape}")
    if k.shape[0] != b or k.shape[3] != h:
        raise ValueError(_WHO + f"key [B, S, K, H] = {k.shape} must match query [B, T, N, H] = "
                         f"{q.shape} in B and H")
    if kv_heads == 0 or n % kv_heads:
        raise ValueError(_WHO + f"the query heads N = {n} must be a multiple of the key/value "
                         f"heads K = {kv_heads}")
    if h % 8 or not 8 <= h <= _MAX_HEAD_DIM:
        raise ValueError(_WHO + f"the head size H = {h} must be a multiple of 8 in "
                         f"[8, {_MAX_HEAD_DIM}]")
    full = (b, n, t, s)
    if bias is not None:
        bias = _as_array(bias)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(_WHO + f"bias must be floating, got {bias.dtype}")
        bias = _check_broadcast("bias", bias, full)
    if mask is not None:
        mask = _as_array(mask)
        if mask.dtype != jnp.bool_:
            raise TypeError(_WHO + f"mask must be bool, got {mask.dtype}")
        mask = _check_broadcast("mask", mask, full)
    q_lens = (None if query_seq_lengths is None
              else _check_int_vector("query_seq_lengths", query_seq_lengths, (b,)))
    kv_lens = (None if key_value_seq_lengths is None
               else _check_int_vector("key_value_seq_lengths", key_value_seq_lengths, (b,)))
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(_WHO + "q_segment_ids and kv_segment_ids must be given together")
    q_seg = kv_seg = None
    if q_segment_ids is not None:
        q_seg = _check_int_vector("q_segment_ids", _leading_ones(_as_array(q_segment_ids), 2), (b, t))
        kv_seg = _check_int_vector("kv_segment_ids", _leading_ones(_as_array(kv_segment_ids), 2), (b, s))
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(_WHO + f"is_causal must be a bool, got {is_causal!r}")
    cap = None
    if logits_soft_cap is not None:
        cap = _static_number("logits_soft_cap", logits_soft_cap)
        if not cap > 0:
            raise ValueError(_WHO + f"logits_soft_cap must be > 0, got {logits_soft_cap!r}")
    left, right = _window(local_window_size)
    rate = _static_number("dropout_rate", dropout_rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(_WHO + f"dropout_rate must be in [0, 1), got {dropout_rate!r}")
    if not isinstance(broadcast_dropout, (bool, np.bool_)):
        raise TypeError(_WHO + f"broadcast_dropout must be a bool, got {broadcast_dropout!r}")
    broadcast = bool(broadcast_dropout)
    seed = None
    if rate > 0.0:
        if dropout_rng is None:
            raise ValueError(_WHO + "dropout_rate > 0 needs a dropout_rng key")
        # One seed per batch element (the hash leaves b out, so a shard's local b does not matter),
        # or one for all of them.
        seed = jax.random.bits(dropout_rng, (1 if broadcast else b, 2), jnp.uint32)
        seed = jnp.broadcast_to(seed, (b, 2))
    options = AttentionOptions(
        scale=float(1.0 / np.sqrt(h)) if scale is None else _static_number("scale", scale),
        is_causal=bool(is_causal), window_left=left, window_right=right, logits_soft_cap=cap,
        dropout_keep=_ref.dropout_keep(rate), dropout_heads=not broadcast)
    # The kernels read the bias as float32; its gradient comes back in its own dtype through astype.
    optional = (None if bias is None else bias.astype(_F32), mask, q_lens, kv_lens, q_seg, kv_seg, seed)
    o, lse = _per_batch_shard(lambda *args: _attention(*args, options), q, k, v, optional)
    o = o.reshape(out_shape)
    if not return_residual:
        return o
    lse = jax.lax.stop_gradient(lse).transpose(0, 2, 1).astype(q.dtype)  # [B, T, N], as jax.nn
    return o, lse.reshape(out_shape[:-1])
