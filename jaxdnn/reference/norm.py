"""Reference LayerNorm / RMSNorm. Shapes: x [..., D], scale and bias [D], statistics [...].

Computation runs in float32, or float64 when given float64 inputs (the tests' oracle)."""

import jax
import jax.numpy as jnp
from jax import lax

from jaxdnn.reference.activation import FUNCTIONS


def _compute_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def norm_fwd(x, scale, bias, epsilon, rms, activation="identity", activation_param=0.0):
    """Returns (y in x.dtype, mean [...] or None when rms, rstd [...]); y = act(xhat * scale + bias)
    with `activation` a kind of `jaxdnn.reference.activation.FUNCTIONS`."""
    xf = x.astype(_compute_dtype(x.dtype))
    mean = None if rms else jnp.mean(xf, axis=-1)
    centered = xf if rms else xf - mean[..., None]
    rstd = lax.rsqrt(jnp.mean(jnp.square(centered), axis=-1) + epsilon)
    y = centered * rstd[..., None] * scale
    if bias is not None:
        y = y + bias
    y = FUNCTIONS[activation](y, activation_param)
    return y.astype(x.dtype), mean, rstd


def norm_bwd(dy, x, scale, bias, mean, rstd, rms, activation="identity", activation_param=0.0):
    """The VJP of `norm_fwd` for y's cotangent dy, given the saved statistics (bias is only read
    for the activation's derivative; None when rms).

    Returns (dx in x.dtype, dscale [D], dbias [D] or None when rms), sums over every leading axis."""
    compute = _compute_dtype(x.dtype)
    dyf = dy.astype(compute)
    xhat = (x.astype(compute) - (0 if rms else mean[..., None])) * rstd[..., None]
    if activation != "identity":  # dy through the activation, to the affine output
        pre = xhat * scale + (0 if bias is None else bias)
        dyf = jax.vjp(lambda p: FUNCTIONS[activation](p, activation_param), pre)[1](dyf)[0]
    g = dyf * scale
    proj = jnp.mean(g * xhat, axis=-1, keepdims=True)
    centered_g = g if rms else g - jnp.mean(g, axis=-1, keepdims=True)
    dx = rstd[..., None] * (centered_g - xhat * proj)
    row_axes = tuple(range(x.ndim - 1))
    dscale = jnp.sum(dyf * xhat, axis=row_axes)
    dbias = None if rms else jnp.sum(dyf, axis=row_axes)
    return dx.astype(x.dtype), dscale, dbias


def layer_norm(x, scale=None, bias=None, *, epsilon=1e-6, activation="identity", activation_param=0.0):
    """LayerNorm over the last axis of x [..., D] with optional scale and bias [D], then the
    activation (a kind of `jaxdnn.reference.activation.FUNCTIONS`)."""
    return _affine_dtype_fwd(x, scale, bias, epsilon, rms=False, activation=activation,
                             activation_param=activation_param)


def rms_norm(x, scale=None, *, epsilon=1e-6):
    """RMSNorm over the last axis of x [..., D] with optional scale [D]."""
    return _affine_dtype_fwd(x, scale, None, epsilon, rms=True)


def _affine_dtype_fwd(x, scale, bias, epsilon, rms, **activation):
    compute = _compute_dtype(x.dtype)
    scale = jnp.ones(x.shape[-1:], compute) if scale is None else scale.astype(compute)
    bias = None if bias is None else bias.astype(compute)
    return norm_fwd(x, scale, bias, epsilon, rms, **activation)[0]
