"""Reference LayerNorm / RMSNorm. Shapes: x [..., D], scale and bias [D], statistics [...].

Computation runs in float32, or float64 when given float64 inputs (the tests' oracle)."""

import jax.numpy as jnp
from jax import lax


def _compute_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def norm_fwd(x, scale, bias, epsilon, rms):
    """Returns (y in x.dtype, mean [...] or None when rms, rstd [...])."""
    xf = x.astype(_compute_dtype(x.dtype))
    mean = None if rms else jnp.mean(xf, axis=-1)
    centered = xf if rms else xf - mean[..., None]
    rstd = lax.rsqrt(jnp.mean(jnp.square(centered), axis=-1) + epsilon)
    y = centered * rstd[..., None] * scale
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype), mean, rstd


def norm_bwd(dy, x, scale, mean, rstd, rms):
    """The VJP of `norm_fwd` for y's cotangent dy, given the saved statistics.

    Returns (dx in x.dtype, dscale [D], dbias [D] or None when rms), sums over every leading axis."""
    compute = _compute_dtype(x.dtype)
    dyf = dy.astype(compute)
    xhat = (x.astype(compute) - (0 if rms else mean[..., None])) * rstd[..., None]
    g = dyf * scale
    proj = jnp.mean(g * xhat, axis=-1, keepdims=True)
    centered_g = g if rms else g - jnp.mean(g, axis=-1, keepdims=True)
    dx = rstd[..., None] * (centered_g - xhat * proj)
    row_axes = tuple(range(x.ndim - 1))
    dscale = jnp.sum(dyf * xhat, axis=row_axes)
    dbias = None if rms else jnp.sum(dyf, axis=row_axes)
    return dx.astype(x.dtype), dscale, dbias


def layer_norm(x, scale=None, bias=None, *, epsilon=1e-6):
    """LayerNorm over the last axis of x [..., D] with optional scale and bias [D]."""
    return _affine_dtype_fwd(x, scale, bias, epsilon, rms=False)


def rms_norm(x, scale=None, *, epsilon=1e-6):
    """RMSNorm over the last axis of x [..., D] with optional scale [D]."""
    return _affine_dtype_fwd(x, scale, None, epsilon, rms=True)


def _affine_dtype_fwd(x, scale, bias, epsilon, rms):
    compute = _compute_dtype(x.dtype)
    scale = jnp.ones(x.shape[-1:], compute) if scale is None else scale.astype(compute)
    bias = None if bias is None else bias.astype(compute)
    return norm_fwd(x, scale, bias, epsilon, rms)[0]
