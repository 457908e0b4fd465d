"""Reference GroupNorm, channels last. Shapes: x [N, ..., C] (the spatial axes `...`, S positions in
all), C channels in G groups of K = C / G, scale and bias [C], statistics mean and rstd [N, G].

y = act((x - mean) * rstd * scale + bias), the statistics per (sample, group) over the S * K values.
Computation runs in float32, or float64 when given float64 inputs (the tests' oracle)."""

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxdnn.reference.activation import FUNCTIONS


def _compute_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _grouped(x, num_groups):
    """x [N, ..., C] as [N, S, G, K]."""
    n, c = x.shape[0], x.shape[-1]
    return x.reshape(n, math.prod(x.shape[1:-1]), num_groups, c // num_groups)


def _xhat(x, mean, rstd, num_groups):
    """(x - mean) * rstd as [N, S, G, K], in the statistics' dtype."""
    xg = _grouped(x, num_groups).astype(rstd.dtype)
    return (xg - mean[:, None, :, None]) * rstd[:, None, :, None]


def group_norm_fwd(x, scale, bias, num_groups, epsilon, activation="identity", activation_param=0.0):
    """Returns (y in x.dtype, mean [N, G], rstd [N, G]); `activation` is a key of FUNCTIONS."""
    xg = _grouped(x, num_groups).astype(_compute_dtype(x.dtype))
    mean = jnp.mean(xg, axis=(1, 3))
    var = jnp.mean(jnp.square(xg - mean[:, None, :, None]), axis=(1, 3))
    rstd = lax.rsqrt(var + epsilon)
    pre = _xhat(x, mean, rstd, num_groups).reshape(x.shape) * scale + bias
    return FUNCTIONS[activation](pre, activation_param).astype(x.dtype), mean, rstd


def group_norm_bwd(dy, x, scale, bias, mean, rstd, num_groups, activation="identity",
                   activation_param=0.0):
    """The VJP of `group_norm_fwd` for y's cotangent dy, given the saved statistics.

    Returns (dx in x.dtype, dscale [C] in scale.dtype, dbias [C] in bias.dtype), the sums over
    samples and positions."""
    compute = rstd.dtype
    xhat = _xhat(x, mean, rstd, num_groups).reshape(x.shape)
    pre = xhat * scale + bias
    _, act_vjp = jax.vjp(lambda p: FUNCTIONS[activation](p, activation_param), pre)
    d = act_vjp(dy.astype(compute))[0]  # dy * act'(pre)
    g = _grouped(d * scale, num_groups)
    xhat_g = _grouped(xhat, num_groups)
    mean_g = jnp.mean(g, axis=(1, 3), keepdims=True)
    mean_g_xhat = jnp.mean(g * xhat_g, axis=(1, 3), keepdims=True)
    dx = rstd[:, None, :, None] * (g - mean_g - xhat_g * mean_g_xhat)
    sum_axes = tuple(range(x.ndim - 1))
    dscale = jnp.sum(d * xhat, axis=sum_axes)
    dbias = jnp.sum(d, axis=sum_axes)
    return dx.reshape(x.shape).astype(x.dtype), dscale.astype(scale.dtype), dbias.astype(bias.dtype)


def group_norm(x, num_groups, scale=None, bias=None, *, epsilon=1e-5, activation=None):
    """GroupNorm of x [N, ..., C] with optional scale and bias [C]; `activation` is None or a name
    of jaxdnn.activation.EPILOGUES."""
    # Imported here: jaxdnn.activation imports this package.
    from jaxdnn.activation import epilogue

    kind, param = epilogue("group_norm", activation)
    compute = _compute_dtype(x.dtype)
    scale = jnp.ones(x.shape[-1:], compute) if scale is None else scale.astype(compute)
    bias = jnp.zeros(x.shape[-1:], compute) if bias is None else bias.astype(compute)
    return group_norm_fwd(x, scale, bias, num_groups, epsilon, kind, param)[0]
