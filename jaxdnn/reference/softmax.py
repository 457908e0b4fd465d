"""Reference softmax / log-softmax over the last axis (float32 compute, float64 for float64 inputs)."""

import jax
import jax.numpy as jnp


def _compute_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def softmax_fwd(x, log):
    """softmax(x) (log_softmax when `log`) over the last axis, in x's dtype."""
    xf = x.astype(_compute_dtype(x.dtype))
    return (jax.nn.log_softmax(xf) if log else jax.nn.softmax(xf)).astype(x.dtype)


def softmax_bwd(dy, y, log):
    """The VJP of `softmax_fwd` given its output y: y * (dy - sum(dy * y)), or for log-softmax
    dy - exp(y) * sum(dy), sums over the last axis."""
    compute = _compute_dtype(y.dtype)
    dyf, yf = dy.astype(compute), y.astype(compute)
    if log:
        dx = dyf - jnp.exp(yf) * jnp.sum(dyf, axis=-1, keepdims=True)
    else:
        dx = yf * (dyf - jnp.sum(dyf * yf, axis=-1, keepdims=True))
    return dx.astype(y.dtype)


def softmax(x, axis=-1):
    """jax.nn.softmax computed in float32 (float64 for float64 x), returned in x's dtype."""
    return jnp.moveaxis(softmax_fwd(jnp.moveaxis(x, axis, -1), False), -1, axis)


def log_softmax(x, axis=-1):
    """jax.nn.log_softmax computed in float32 (float64 for float64 x), returned in x's dtype."""
    return jnp.moveaxis(softmax_fwd(jnp.moveaxis(x, axis, -1), True), -1, axis)
