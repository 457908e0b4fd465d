"""Reference batch norm: Flax's `BatchNorm` math, and the kernel stages of jaxdnn.batch_norm.

The stages see x as [O, C, I] (C channels; O the axes before the channel axis, I those after it) and
per-channel vectors as [C]. Computation runs in float32, or float64 when given float64 inputs.
"""

import jax
import jax.numpy as jnp
from jax import lax

from jaxdnn.reference.activation import FUNCTIONS


def _compute(x):
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _per_channel(v):
    return v[None, :, None]


def _pre_activation(x, a, mean, bias, residual):
    pre = (_compute(x) - _per_channel(mean)) * _per_channel(a) + _per_channel(bias)
    return pre if residual is None else pre + _compute(residual)


def stats(x, shift):
    """(sum(x - shift), sum((x - shift)^2)) over O and I: [C] each."""
    v = _compute(x) - _per_channel(shift)
    return jnp.sum(v, axis=(0, 2)), jnp.sum(v * v, axis=(0, 2))


def fwd(x, a, mean, bias, residual, kind, param):
    """act(a (x - mean) + bias [+ residual]) in x's dtype."""
    return FUNCTIONS[kind](_pre_activation(x, a, mean, bias, residual), param).astype(x.dtype)


def _grad(dy, x, a, mean, bias, residual, kind, param):
    """g = dy act'(pre-activation), in the compute dtype."""
    _, vjp = jax.vjp(lambda pre: FUNCTIONS[kind](pre, param), _pre_activation(x, a, mean, bias, residual))
    return vjp(_compute(dy))[0]


def bwd_sums(dy, x, a, mean, bias, residual, kind, param):
    """(sum(g), sum(g (x - mean))) over O and I: [C] each."""
    g = _grad(dy, x, a, mean, bias, residual, kind, param)
    return jnp.sum(g, axis=(0, 2)), jnp.sum(g * (_compute(x) - _per_channel(mean)), axis=(0, 2))


def bwd_grad(dy, x, a, mean, bias, residual, kind, param):
    """(g in x's dtype, sum(g), sum(g (x - mean))): the sums of `bwd_sums` and g itself."""
    g = _grad(dy, x, a, mean, bias, residual, kind, param)
    return (g.astype(x.dtype), jnp.sum(g, axis=(0, 2)),
            jnp.sum(g * (_compute(x) - _per_channel(mean)), axis=(0, 2)))


def bwd_dx(dy, x, a, mean, bias, k1, k0, residual, kind, param):
    """(dx = a g + k1 (x - mean) + k0, g) in x's dtype; g is dresidual."""
    g = _grad(dy, x, a, mean, bias, residual, kind, param)
    dx = _per_channel(a) * g + _per_channel(k1) * (_compute(x) - _per_channel(mean)) + _per_channel(k0)
    return dx.astype(x.dtype), g.astype(x.dtype)


def batch_norm(x, scale, bias, running_mean, running_var, *, training, momentum=0.99, epsilon=1e-5, axis=-1,
               residual=None, activation="identity", activation_param=0.0):
    """Flax's BatchNorm: returns (act(y [+ residual]), new running mean, new running variance).

    Training normalizes with the biased batch variance over every axis but `axis` and updates the
    running statistics as `momentum * running + (1 - momentum) * batch`; inference uses the running
    statistics and returns them unchanged. `activation` is a kind of `FUNCTIONS`.
    """
    axis = axis % x.ndim
    reduce_axes = tuple(i for i in range(x.ndim) if i != axis)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    xf = _compute(x)
    if training:
        mean = jnp.mean(xf, axis=reduce_axes)
        var = jnp.mean(jnp.square(xf - mean.reshape(shape)), axis=reduce_axes)
        new_mean = momentum * running_mean + (1 - momentum) * lax.stop_gradient(mean)
        new_var = momentum * running_var + (1 - momentum) * lax.stop_gradient(var)
    else:
        mean, var = running_mean.astype(xf.dtype), running_var.astype(xf.dtype)
        new_mean, new_var = running_mean, running_var
    y = (xf - mean.reshape(shape)) * lax.rsqrt(var.reshape(shape) + epsilon)
    if scale is not None:
        y = y * scale.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    if residual is not None:
        y = y + _compute(residual)
    y = FUNCTIONS[activation](y, activation_param)
    return y.astype(x.dtype), new_mean.astype(running_mean.dtype), new_var.astype(running_var.dtype)
