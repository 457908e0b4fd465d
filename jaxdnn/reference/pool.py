"""Reference max / average pooling with flax.linen's semantics and signatures.

Shapes: inputs [..., *spatial, C] (any number of leading batch axes, none included), windows over
the 1 to 3 spatial axes; max pooling pads with -inf. Computation runs in float32, or float64 for
float64 inputs (the tests' oracle); results have the inputs' dtype. Gradients are JAX's own
(select_and_scatter for max pooling)."""

import jax.numpy as jnp
import numpy as np
from jax import lax


def _compute_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _reduce(x, init, op, window_shape, strides, padding):
    """lax.reduce_window of `op` over the spatial axes of x, as flax.linen.pooling.pool."""
    window_shape = tuple(window_shape)
    spatial = len(window_shape)
    batch_axes = x.ndim - spatial - 1
    strides = tuple(strides) if strides is not None else (1,) * spatial
    if not isinstance(padding, str):
        padding = ((0, 0),) * batch_axes + tuple(tuple(p) for p in padding) + ((0, 0),)
    return lax.reduce_window(x, init, op, (1,) * batch_axes + window_shape + (1,),
                             (1,) * batch_axes + strides + (1,), padding)


def max_pool(inputs, window_shape, strides=None, padding="VALID"):
    """flax.linen.max_pool: the maximum over each window (padding counts as -inf)."""
    x = inputs.astype(_compute_dtype(inputs.dtype))
    return _reduce(x, -jnp.inf, lax.max, window_shape, strides, padding).astype(inputs.dtype)


def avg_pool(inputs, window_shape, strides=None, padding="VALID", count_include_pad=True):
    """flax.linen.avg_pool: each window's sum over its volume, or over its elements inside the
    inputs when not count_include_pad."""
    x = inputs.astype(_compute_dtype(inputs.dtype))
    total = _reduce(x, 0.0, lax.add, window_shape, strides, padding)
    if count_include_pad:
        divisor = np.prod(window_shape)
    else:
        spatial = len(window_shape)
        ones = jnp.ones(inputs.shape[inputs.ndim - spatial - 1:-1] + (1,), x.dtype)
        divisor = _reduce(ones, 0.0, lax.add, window_shape, strides, padding)
    return (total / divisor).astype(inputs.dtype)
