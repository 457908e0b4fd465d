"""Batch normalization, with the fused residual + activation epilogue of the ResNet pattern.

Shapes: x [..., C, ...] with the channels on `axis` (last for NHWC, 1 for NCHW); scale, bias and the
running statistics [C]. The kernels see x as [O, C, I] (O the axes before `axis` folded together, I
those after it), a free reshape. Statistics and accumulation are float32; outputs have x's dtype.

Four kernel stages, each a primitive whose VJP goes through `jaxdnn.reference.batch_norm`:
- stats: the per-channel sums of (x - shift) and its square, about a sample of the batch as the
  shift (within the batch's spread of its mean, so the variance does not cancel); partial sums
  over row shards are summed across devices, so a batch sharded over a mesh gets the global
  statistics (sync BN);
- fwd: y = act(a (x - mean) + bias [+ residual]) with a = scale * rstd;
- bwd_sums: sum(g) and sum(g (x - mean)) with g = dy act'(pre-activation);
- bwd_dx: dx = a g + k1 (x - mean) + k0 (k1, k0 carry the batch statistics' gradient in training),
  and dresidual = g.
The per-channel coefficients between the stages are computed in JAX on [C] vectors.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxdnn import _ffi  # noqa: F401  (registers the FFI targets)
from jaxdnn._primitive import (explicit_row_sharding, ffi_primitive, match_varying, move_to_front,
                               with_reference_vjp)
from jaxdnn.activation import epilogue, epilogue_attrs
from jaxdnn.reference import batch_norm as _ref

_FLOAT_TYPES = [jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16)]
_F32 = jnp.float32


def _num_partials(outer) -> int:
    """Rows P of the sum stages' workspace [P, 2, C]: the CUDA kernels' blocks each write one partial
    sum per channel, added in a fixed order afterwards. At most 1024, and at most O when known."""
    return min(outer, 1024) if isinstance(outer, int) and outer > 0 else 1024


# --- the kernel stages ------------------------------------------------------------------------

def _sums_avals(x, *operands, **attrs):
    """(sum1 [C], sum2 [C], workspace [P, 2, C]); the first operand (x or dy) is [O, C, I]."""
    channel = jax.core.ShapedArray(x.shape[1:2], _F32)
    workspace = jax.core.ShapedArray((_num_partials(x.shape[0]), 2, x.shape[1]), _F32)
    return [channel, channel, workspace]


def _like_x_avals(first, *operands, results=1, **attrs):
    """Results of x's shape and dtype (the first operand, x or dy, has them)."""
    return [jax.core.ShapedArray(first.shape, first.dtype)] * results


def _fold_channels_batch_rule(prim, args, dims, **attrs):
    """vmap folds the mapped axis into the channels: [B, O, C, I] -> [O, B*C, I] (a transpose unless
    O == 1) and [B, C] -> [B*C], since each example has statistics and coefficients of its own."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)

    def fold(a, d):
        a = move_to_front(a, d, size)
        if a.ndim == 4:
            return jnp.moveaxis(a, 0, 1).reshape(a.shape[1], size * a.shape[2], a.shape[3])
        return a.reshape(size * a.shape[1])

    def unfold(out):
        if out.ndim == 3:
            return jnp.moveaxis(out.reshape(out.shape[0], size, -1, out.shape[2]), 1, 0)
        return out.reshape(size, -1)

    outs = prim.bind(*(fold(a, d) for a, d in zip(args, dims)), **attrs)
    return [unfold(o) for o in outs], [0] * len(outs)


def _primitive(stage, version, rule, residual=False, **kwargs):
    name = f"jaxdnn_batch_norm_{stage}" + ("_residual" if residual else "")
    return ffi_primitive(name, f"jaxdnn_batch_norm_{stage}_v{version}", sharding_rule=rule,
                         batch_rule=_fold_channels_batch_rule, **kwargs)


_X = "... c i"
_stats = _primitive("stats", 1, f"{_X}, c -> c, c", result_avals=_sums_avals, scratch_results=1,
                    reduced_results=(0, 1))
# One primitive per arity: without / with the residual operand.
_fwd = {r: _primitive("fwd", 1, f"{_X}, c, c, c{', ' + _X if r else ''} -> {_X}", r,
                      result_avals=_like_x_avals)
        for r in (False, True)}
_bwd_sums = _primitive("bwd_sums", 2, f"{_X}, {_X}, c, c, c -> c, c", result_avals=_sums_avals,
                       scratch_results=1, reduced_results=(0, 1))
_bwd_grad = _primitive("bwd_grad", 1, f"{_X}, {_X}, c, c, c, {_X} -> {_X}, c, c",
                       result_avals=lambda dy, *ops, **attrs: [dy, *_sums_avals(dy)], scratch_results=1,
                       reduced_results=(1, 2))
_bwd_dx = _primitive("bwd_dx", 2, f"{_X}, {_X}, c, c, c, c, c -> {_X}", result_avals=_like_x_avals)


def _stats_stage(x, shift):
    return with_reference_vjp(lambda x, s: tuple(_stats.bind(x, s)), _ref.stats, x, *match_varying(x, shift))


def _fwd_stage(x, a, mean, bias, residual, kind, param):
    attrs = epilogue_attrs(kind, param)
    ops = (x, *match_varying(x, a, mean, bias)) + (() if residual is None else (residual,))
    return with_reference_vjp(
        lambda *ops: _fwd[residual is not None].bind(*ops, **attrs)[0],
        lambda x, a, mean, bias, r=None: _ref.fwd(x, a, mean, bias, r, kind, param), *ops)


def _bwd_sums_stage(dy, x, a, mean, bias, kind, param):
    """(sg, sgx) [C]."""
    ops = (dy, x, *match_varying(x, a, mean, bias))
    return with_reference_vjp(
        lambda *ops: tuple(_bwd_sums.bind(*ops, **epilogue_attrs(kind, param))),
        lambda *ops: _ref.bwd_sums(*ops, None, kind, param), *ops)


def _bwd_grad_stage(dy, x, a, mean, bias, residual, kind, param):
    """(g [O, C, I] in x's dtype, sg, sgx): the sums with a residual in the pre-activation, and g."""
    ops = (dy, x, *match_varying(x, a, mean, bias), residual)
    return with_reference_vjp(
        lambda *ops: tuple(_bwd_grad.bind(*ops, **epilogue_attrs(kind, param))),
        lambda dy, x, a, mean, bias, r: _ref.bwd_grad(dy, x, a, mean, bias, r, kind, param), *ops)


def _bwd_dx_stage(dy, x, a, mean, bias, k1, k0, kind, param):
    """dx [O, C, I]."""
    ops = (dy, x, *match_varying(x, a, mean, bias, k1, k0))
    return with_reference_vjp(
        lambda *ops: _bwd_dx.bind(*ops, **epilogue_attrs(kind, param))[0],
        lambda *ops: _ref.bwd_dx(*ops, None, kind, param)[0], *ops)


# --- the differentiable op on [O, C, I] -------------------------------------------------------

def _sum_shards(values, sharded):
    """Per-shard sums summed over the mesh axes of `sharded` (its second entry), inside shard_map."""
    return [jax.lax.psum(v, sharded[1]) for v in values] if sharded else list(values)


def _shift(x, mean_in, sharded):
    """The point [C] the statistics are summed about: each channel's first element x[0, :, 0] (its
    mean over the shards, so that every shard sums about the same point), whose distance from the
    batch mean is of the order of the batch's spread, so s2 / n - delta^2 keeps float32's precision.
    The running mean can be far from it (at initialization above all), which cancelled digits."""
    if x.shape[0] == 0 or x.shape[2] == 0:
        return lax.stop_gradient(mean_in)
    first = lax.stop_gradient(x[0, :, 0].astype(_F32))
    return jax.lax.pmean(first, sharded[1]) if sharded else first


def _batch_stats(x, shift, sharded):
    """(mean, biased variance) [C] over O and I, and over every shard of an Explicit mesh."""
    count = x.shape[0] * x.shape[2] * (sharded[0] if sharded else 1)
    s1, s2 = _sum_shards(_stats_stage(x, shift), sharded)
    delta = s1 / count
    return shift + delta, jnp.maximum(s2 / count - delta * delta, 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _batch_norm(x, scale, bias, mean_in, var_in, residual, training, epsilon, kind, param, sharded):
    """(y, mean, var): mean/var are the batch statistics in training, mean_in/var_in otherwise.
    `sharded` is () or (shards, mesh axes) when this runs per shard inside shard_map."""
    return _batch_norm_fwd(x, scale, bias, mean_in, var_in, residual, training, epsilon, kind, param,
                           sharded)[0]


def _batch_norm_fwd(x, scale, bias, mean_in, var_in, residual, training, epsilon, kind, param, sharded):
    if training:
        mean, var = _batch_stats(x, _shift(x, mean_in, sharded), sharded)
    else:
        mean, var = mean_in, var_in
    rstd = lax.rsqrt(var + epsilon)
    a = scale * rstd
    y = _fwd_stage(x, a, mean, bias, residual, kind, param)
    return (y, mean, var), (x, bias, residual, mean, rstd, a, mean_in, var_in)


def _batch_norm_bwd(training, epsilon, kind, param, sharded, saved, cotangents):
    """The statistics outputs are not differentiated (the public function stops their gradient)."""
    x, bias, residual, mean, rstd, a, mean_in, var_in = saved
    dy = cotangents[0]
    if residual is not None and kind != "identity":
        # act' needs the pre-activation, residual included: the sums stage also writes g = dy act'
        # (dresidual), and dx is computed from g alone, without reading dy and the residual again.
        g, sg, sgx = _bwd_grad_stage(dy, x, a, mean, bias, residual, kind, param)
        sg, sgx = _sum_shards((sg, sgx), sharded)
        dy, kind, param, dresidual = g, "identity", 0.0, g
    else:
        sg, sgx = _sum_shards(_bwd_sums_stage(dy, x, a, mean, bias, kind, param), sharded)
        dresidual = None if residual is None else dy
    if training:
        count = x.shape[0] * x.shape[2] * (sharded[0] if sharded else 1)
        k1 = -a * rstd * rstd * sgx / count
        k0 = -a * sg / count
    else:
        k1 = k0 = jnp.zeros_like(a)
    dx = _bwd_dx_stage(dy, x, a, mean, bias, k1, k0, kind, param)
    return dx, sgx * rstd, sg, jnp.zeros_like(mean_in), jnp.zeros_like(var_in), dresidual


_batch_norm.defvjp(_batch_norm_fwd, _batch_norm_bwd)


# --- public API -------------------------------------------------------------------------------

def _as_array(v):
    return v if hasattr(v, "shape") and hasattr(v, "dtype") else jnp.asarray(v)


def _check_channel_vector(name, v, channels, allowed):
    v = _as_array(v)
    if v.dtype not in allowed:
        raise TypeError(f"batch_norm: {name} must be float32 or x's dtype, got {v.dtype}")
    if v.shape != (channels,):
        raise ValueError(f"batch_norm: {name} must have shape (C,) = ({channels},), got {v.shape}")
    return v


def batch_norm(x, scale, bias, running_mean, running_var, *, training, momentum=0.99, epsilon=1e-5, axis=-1,
               residual=None, activation=None):
    """Batch normalization as Flax's `BatchNorm`, optionally fused with a residual add and an activation.

    Computes `act((x - mean) / sqrt(var + epsilon) * scale + bias + residual)` per channel, where
    the statistics are over every axis but `axis`.

    Args:
      x: float32, bfloat16 or float16, any rank >= 1; channels on `axis`.
      scale, bias: [C] in float32 or x's dtype, or None.
      running_mean, running_var: [C] floating arrays (Flax's `batch_stats` `mean` and `var`).
      training: True: normalize with this batch's mean and biased variance and update the running
        statistics; False: normalize with the running statistics.
      momentum: running = momentum * running + (1 - momentum) * batch statistic.
      epsilon: added to the variance.
      axis: the channel axis (-1 for NHWC, 1 for NCHW).
      residual: None, or an array of x's shape and dtype added before the activation.
      activation: None or a name of `jaxdnn.activation.EPILOGUES` (e.g. "relu"), applied last.

    Returns:
      (y, new_running_mean, new_running_var): y in x's dtype; the running statistics in their own
      dtypes (returned unchanged when not training). The running statistics are not differentiated
      (their gradient is zero), as with cuDNN. Under `jit` with a batch sharded over a mesh (Auto or
      Explicit axes) the batch statistics are global, summed across devices (sync batch norm); called
      inside the user's own `shard_map`, each device normalizes with its own rows' statistics.

    Differentiable with `jax.grad`/`jax.vjp` to any order; `jax.jvp` is not supported.
    """
    x = _as_array(x)
    if x.dtype not in _FLOAT_TYPES:
        raise TypeError(f"batch_norm: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("batch_norm: x must have rank >= 1")
    if not isinstance(training, (bool, np.bool_)):
        raise TypeError(f"batch_norm: training must be a bool, got {training!r}")
    if not isinstance(axis, (int, np.integer)) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"batch_norm: axis must be an int in [{-x.ndim}, {x.ndim}), got {axis!r}")
    axis = int(axis) % x.ndim
    channels = x.shape[axis]
    param_types = (jnp.dtype(_F32), x.dtype)
    scale = None if scale is None else _check_channel_vector("scale", scale, channels, param_types)
    bias = None if bias is None else _check_channel_vector("bias", bias, channels, param_types)
    stats_types = [jnp.dtype(t) for t in (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)]
    running_mean = _check_channel_vector("running_mean", running_mean, channels, stats_types)
    running_var = _check_channel_vector("running_var", running_var, channels, stats_types)
    if residual is not None:
        residual = _as_array(residual)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"batch_norm: residual must have x's shape {x.shape} and dtype {x.dtype}, got "
                             f"{residual.shape} {residual.dtype}")
    if not np.isfinite(epsilon) or epsilon < 0:
        raise ValueError(f"batch_norm: epsilon must be a finite number >= 0, got {epsilon}")
    if not 0 <= momentum <= 1:
        raise ValueError(f"batch_norm: momentum must be in [0, 1], got {momentum}")
    kind, param = epilogue("batch_norm", activation)
    outer, inner = math.prod(x.shape[:axis]), math.prod(x.shape[axis + 1:])
    if training and outer * inner == 0:
        raise ValueError(f"batch_norm: training needs at least one element per channel, got x.shape "
                         f"{x.shape}")

    scale = jnp.ones((channels,), _F32) if scale is None else scale.astype(_F32)
    bias = jnp.zeros((channels,), _F32) if bias is None else bias.astype(_F32)
    options = (training, np.float32(epsilon), kind, float(param))

    def normalize(x, residual, *vectors, sharded=()):
        """batch_norm of x [..., C, ...] as [O, C, I] (per shard of an Explicit mesh if `sharded`)."""
        shape = x.shape
        x3 = x.reshape(math.prod(shape[:axis]), channels, math.prod(shape[axis + 1:]))
        residual3 = None if residual is None else residual.reshape(x3.shape)
        y, mean, var = _batch_norm(x3, *vectors, residual3, *options, sharded)
        return y.reshape(shape), mean, var

    vectors = (scale, bias, running_mean.astype(_F32), running_var.astype(_F32))
    # Rows sharded over Explicit mesh axes (part of x's type): each device normalizes its rows with
    # the statistics summed over every shard. Other cases are partitioned by the primitives' rules.
    explicit = explicit_row_sharding(x, whole_axes=x.ndim - axis)
    if explicit is None:
        y, mean, var = normalize(x, residual, *vectors)
    else:
        mesh, spec, axes = explicit
        sharded = (math.prod(mesh.shape[a] for a in axes), axes)
        args = (x,) + (() if residual is None else (residual,))
        y, mean, var = jax.shard_map(
            lambda *a: normalize(a[0], a[1] if residual is not None else None, *a[len(args):],
                                 sharded=sharded),
            mesh=mesh, in_specs=(spec,) * len(args) + (P(),) * len(vectors), out_specs=(spec, P(), P()),
            axis_names=set(axes))(*args, *vectors)
    if not training:
        return y, running_mean, running_var
    new_mean = momentum * running_mean.astype(_F32) + (1 - momentum) * lax.stop_gradient(mean)
    new_var = momentum * running_var.astype(_F32) + (1 - momentum) * lax.stop_gradient(var)
    return y, new_mean.astype(running_mean.dtype), new_var.astype(running_var.dtype)
