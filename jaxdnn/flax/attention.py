"""`attention_fn` for Flax's `MultiHeadDotProductAttention` (linen) and `MultiHeadAttention` (nnx)::

    flax.linen.MultiHeadDotProductAttention(num_heads=8, attention_fn=jaxdnn.flax.dot_product_attention)
    flax.nnx.MultiHeadAttention(..., attention_fn=jaxdnn.flax.dot_product_attention)

The modules' parameters are unchanged (the projections stay Flax's), so checkpoints load either way.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxdnn.attention import dot_product_attention as _attention


def _fold_batch(x, batch_shape, trailing):
    """[*batch, *trailing axes] -> [prod(batch), *trailing axes], broadcasting x's batch axes."""
    x = jnp.broadcast_to(x, tuple(batch_shape) + x.shape[x.ndim - trailing:])
    return x.reshape((math.prod(batch_shape),) + x.shape[len(batch_shape):])


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                          dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                          force_fp32_for_softmax=False, is_causal=False):
    """Flax's `dot_product_attention` contract on jaxdnn's fused kernels.

    Args:
      query: [batch..., T, N, H]; key, value: [batch..., S, K, H] (K dividing N).
      bias, mask: None or broadcastable to [batch..., N, T, S] (mask: nonzero attends).
      broadcast_dropout, dropout_rate, dropout_rng, deterministic: dropout as
        jaxdnn.dot_product_attention's: one [T, S] mask shared by every batch element and head
        (broadcast_dropout=True, Flax's default), or a mask per batch element and head. The masks
        are jaxdnn's hash of the key, not Flax's `random.bernoulli` draws.
      dtype: None or the dtype to compute in (q, k, v are cast to it).
      precision, force_fp32_for_softmax: met as asked: logits, softmax and sums are always float32.
      module: must be None (`sow_weights` needs the [T, S] weights, which the kernels never form).
      is_causal: nnx's flag; s <= t.

    Returns:
      [batch..., T, N, H]. A query row whose keys are all masked gives 0 (Flax's own function
      averages every value there).
    """
    del precision, force_fp32_for_softmax
    dropout = {}
    if dropout_rate > 0.0 and not deterministic:
        dropout = dict(dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                       broadcast_dropout=bool(broadcast_dropout))
    if module is not None:
        raise ValueError("jaxdnn.flax.dot_product_attention: sow_weights is not supported (the kernels never "
                         "form the attention weights)")
    if dtype is not None:
        query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    if mask is not None:
        mask = jnp.asarray(mask).astype(bool)  # Flax's masks are often float 0/1
    batch_shape = query.shape[:-3]
    if len(batch_shape) == 1:
        return _attention(query, key, value, bias, mask, is_causal=is_causal, **dropout)
    bias, mask = (None if m is None else _fold_batch(jnp.asarray(m), batch_shape, 3) for m in (bias, mask))
    out = _attention(*(_fold_batch(x, batch_shape, 3) for x in (query, key, value)), bias, mask,
                     is_causal=is_causal, **dropout)
    return out.reshape(query.shape)
