"""GroupNorm, channels last, with an optional fused activation.

Shapes: x [N, ..., C]: N samples, any number of spatial axes `...` (S positions in all, none for a
rank-2 x), C channels in G groups of K = C / G; scale and bias [C]; the saved statistics mean and
rstd [N, G]. Statistics are per (sample, group) over S * K values, in float32; outputs have x's dtype.

The kernels see x as [N, S, C] (a free reshape). `group_norm` is a `jax.custom_vjp` over two kernel
stages, `group_norm_fwd` (saves mean/rstd) and `group_norm_bwd` (dx, dscale, dbias; the activation's
input is recomputed from x and the statistics, not saved). Both stages have their own VJP through
the reference implementation, so grad of grad works; forward-mode `jax.jvp` is not provided.
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

from jaxdnn import _ffi  # noqa: F401  (registers the FFI targets)
from jaxdnn import reference
from jaxdnn._primitive import ffi_primitive, match_varying, move_to_front, per_row_shard
from jaxdnn.activation import KIND_NAMES, epilogue, epilogue_attrs
from jaxdnn.reference.activation import FUNCTIONS as _ACTIVATIONS

_FLOAT_TYPES = [jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16)]
_F32 = jnp.float32


def _num_chunks(batch, spatial, channels) -> int:
    """P, the chunks each sample's S positions are split into (one CUDA block each, per tile of
    channels): about 512 blocks in all, at least 16 positions a chunk, and a workspace
    [N, P, 2, C] f32 of at most 128 MiB. Sizes may be symbolic under `jax.export`."""
    if not isinstance(spatial, int):
        return 1
    chunks = max(1, spatial // 16)
    known_batch = isinstance(batch, int) and batch > 0
    chunks = min(chunks, -(-512 // batch) if known_batch else 8)
    bound = (1 << 27) // (8 * channels * (batch if known_batch else 1))
    return max(1, min(chunks, bound))


# --- the two kernel stages --------------------------------------------------------------------

def _fwd_avals(x, scale, bias, *, epsilon, num_groups, activation, activation_param):
    n, s, c = x.shape
    stat = jax.core.ShapedArray((n, num_groups), _F32)
    workspace = jax.core.ShapedArray((n, _num_chunks(n, s, c), 2, c), _F32)
    return [jax.core.ShapedArray(x.shape, x.dtype), stat, stat, workspace]


def _bwd_avals(dy, x, scale, bias, mean, rstd, *, num_groups, activation, activation_param):
    n, s, c = x.shape
    workspace = jax.core.ShapedArray((n, _num_chunks(n, s, c), 2, c), _F32)
    group_sums = jax.core.ShapedArray((n, num_groups, 2), _F32)
    return [jax.core.ShapedArray(x.shape, x.dtype), jax.core.ShapedArray((c,), scale.dtype),
            jax.core.ShapedArray((c,), bias.dtype), workspace, group_sums]


def _per_channel(stat, num_groups, channels):
    """[B, N, G] statistics as [B, N, 1, C], each group's value repeated over its channels."""
    return jnp.repeat(stat, channels // num_groups, axis=-1)[..., None, :]


def _fold(a, size):
    """[B, N, ...] -> [B * N, ...]."""
    return a.reshape(size * a.shape[1], *a.shape[2:])


def _fwd_batch_rule(prim, args, dims, **attrs):
    """Folds the vmapped axis into the samples. A batched scale/bias keeps the kernel's statistics
    and applies the per-example affine and activation in XLA."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    x = move_to_front(args[0], dims[0], size)  # [B, N, S, C]
    if dims[1] is None and dims[2] is None:
        y, mean, rstd = prim.bind(_fold(x, size), *args[1:], **attrs)
    else:
        ones = jnp.ones(x.shape[-1:], _F32)
        _, mean, rstd = prim.bind(_fold(x, size), ones, jnp.zeros_like(ones),
                                  **{**attrs, **epilogue_attrs("identity", 0.0)})
        scale, bias = (move_to_front(a, d, size)[:, None, None, :] for a, d in zip(args[1:], dims[1:]))
        g, c = attrs["num_groups"], x.shape[-1]
        mean, rstd = (a.reshape(size, -1, g) for a in (mean, rstd))
        pre = (x.astype(_F32) - _per_channel(mean, g, c)) * _per_channel(rstd, g, c) * scale + bias
        y = _ACTIVATIONS[KIND_NAMES[int(attrs["activation"])]](pre, attrs["activation_param"])
        return [y.astype(x.dtype), mean, rstd], [0, 0, 0]
    return [y.reshape(x.shape), mean.reshape(size, -1, mean.shape[-1]),
            rstd.reshape(size, -1, rstd.shape[-1])], [0, 0, 0]


def _bwd_batch_rule(prim, args, dims, *, num_groups, activation, activation_param):
    """Folds the vmapped axis into the samples for dx; the per-example dscale/dbias (sums over each
    example's samples only) are reduced in XLA. A batched scale/bias takes the reference path."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    dy, x, mean, rstd = (move_to_front(args[i], dims[i], size) for i in (0, 1, 4, 5))
    scale, bias = args[2], args[3]
    kind = KIND_NAMES[int(activation)]
    if dims[2] is not None or dims[3] is not None:
        bwd = functools.partial(reference.group_norm_bwd, num_groups=num_groups, activation=kind,
                                activation_param=float(activation_param))
        scale, bias = (move_to_front(args[i], dims[i], size) for i in (2, 3))
        return list(jax.vmap(bwd)(dy, x, scale, bias, mean, rstd)), [0, 0, 0]
    dx = prim.bind(_fold(dy, size), _fold(x, size), scale, bias, _fold(mean, size), _fold(rstd, size),
                   num_groups=num_groups, activation=activation, activation_param=activation_param)[0]
    c = x.shape[-1]
    xhat = (x.astype(_F32) - _per_channel(mean, num_groups, c)) * _per_channel(rstd, num_groups, c)
    _, act_vjp = jax.vjp(lambda p: _ACTIVATIONS[kind](p, float(activation_param)), xhat * scale + bias)
    d = act_vjp(dy.astype(_F32))[0]
    dscale, dbias = jnp.sum(d * xhat, axis=(1, 2)), jnp.sum(d, axis=(1, 2))
    return [dx.reshape(x.shape), dscale.astype(scale.dtype), dbias.astype(bias.dtype)], [0, 0, 0]


_group_norm_fwd = ffi_primitive(
    "jaxdnn_group_norm_fwd", "jaxdnn_group_norm_fwd_v1",
    result_avals=_fwd_avals, batch_rule=_fwd_batch_rule, scratch_results=1,
    sharding_rule="... s c, c, c -> ... s c, ... g, ... g")
_group_norm_bwd = ffi_primitive(
    "jaxdnn_group_norm_bwd", "jaxdnn_group_norm_bwd_v1",
    result_avals=_bwd_avals, batch_rule=_bwd_batch_rule, scratch_results=2, reduced_results=(1, 2),
    sharding_rule="... s c, ... s c, c, c, ... g, ... g -> ... s c, c, c")


# --- differentiable stages (second order through the reference) -------------------------------
# `config` = (num_groups, activation kind, activation param), static.

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gn_fwd(x, scale, bias, epsilon, config):
    """(y, mean, rstd) from the kernel; x is [N, S, C]."""
    num_groups, kind, param = config
    return tuple(_group_norm_fwd.bind(x, scale, bias, epsilon=epsilon, num_groups=np.int64(num_groups),
                                      **epilogue_attrs(kind, param)))


def _gn_fwd_fwd(x, scale, bias, epsilon, config):
    return _gn_fwd(x, scale, bias, epsilon, config), (x, scale, bias)


def _gn_fwd_bwd(epsilon, config, inputs, cotangents):
    _, vjp = jax.vjp(lambda *a: reference.group_norm_fwd(*a, config[0], epsilon, *config[1:]), *inputs)
    return vjp(cotangents)


_gn_fwd.defvjp(_gn_fwd_fwd, _gn_fwd_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _gn_bwd(dy, x, scale, bias, mean, rstd, config):
    """(dx, dscale, dbias) from the kernel."""
    num_groups, kind, param = config
    return tuple(_group_norm_bwd.bind(dy, x, scale, bias, mean, rstd, num_groups=np.int64(num_groups),
                                      **epilogue_attrs(kind, param)))


def _gn_bwd_fwd(dy, x, scale, bias, mean, rstd, config):
    return _gn_bwd(dy, x, scale, bias, mean, rstd, config), (dy, x, scale, bias, mean, rstd)


def _gn_bwd_bwd(config, inputs, cotangents):
    _, vjp = jax.vjp(lambda *a: reference.group_norm_bwd(*a, *config), *inputs)
    return vjp(cotangents)


_gn_bwd.defvjp(_gn_bwd_fwd, _gn_bwd_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gn(x, scale, bias, epsilon, config):
    return _gn_fwd(x, scale, bias, epsilon, config)[0]


def _gn_vjp_fwd(x, scale, bias, epsilon, config):
    y, mean, rstd = _gn_fwd(x, scale, bias, epsilon, config)
    return y, (x, scale, bias, mean, rstd)


def _gn_vjp_bwd(epsilon, config, residuals, dy):
    return _gn_bwd(dy, *residuals, config)


_gn.defvjp(_gn_vjp_fwd, _gn_vjp_bwd)


# --- public API -------------------------------------------------------------------------------

def _check_x(x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if x.dtype not in _FLOAT_TYPES:
        raise TypeError(f"group_norm: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"group_norm: x must have rank >= 2 (N, ..., C), got shape {x.shape}")
    if x.shape[-1] == 0:
        raise ValueError(f"group_norm: x's channel axis (the last) must be non-empty, got shape {x.shape}")
    return x


def _check_num_groups(num_groups, channels):
    if isinstance(num_groups, (bool, np.bool_)):
        raise TypeError(f"group_norm: num_groups must be an int, got {num_groups!r}")
    try:
        num_groups = operator.index(num_groups)
    except TypeError:
        raise TypeError(f"group_norm: num_groups must be an int, got {num_groups!r}") from None
    if num_groups < 1 or channels % num_groups != 0:
        raise ValueError(f"group_norm: num_groups must be >= 1 and divide the channels C = {channels}, "
                         f"got num_groups={num_groups}")
    return num_groups


def _check_param(name, param, x):
    if param is None:
        return None
    if not hasattr(param, "shape") or not hasattr(param, "dtype"):
        param = jnp.asarray(param)
    if param.dtype not in (jnp.dtype(_F32), x.dtype):
        raise TypeError(f"group_norm: {name} must be float32 or x's dtype {x.dtype}, got {param.dtype}")
    if param.shape != x.shape[-1:]:
        raise ValueError(f"group_norm: {name} must have shape (C,) = {x.shape[-1:]} to match x.shape "
                         f"{x.shape}, got {name}.shape {param.shape}")
    return param


def _params(scale, bias, channels):
    """scale and bias in one dtype, as the kernels take them: x's 16-bit dtype where both are in it
    (or one is and the other is None), else float32."""
    given = [p.dtype for p in (scale, bias) if p is not None]
    dtype = given[0] if given and all(d == given[0] for d in given) else jnp.dtype(_F32)
    scale = jnp.ones((channels,), dtype) if scale is None else scale.astype(dtype)
    bias = jnp.zeros((channels,), dtype) if bias is None else bias.astype(dtype)
    return scale, bias


def group_norm(x, num_groups, scale=None, bias=None, *, epsilon=1e-5, activation=None):
    """Group normalization, channels last: `act((x - mean) / sqrt(var + epsilon) * scale + bias)`.

    Statistics are per sample and group of channels, over every spatial position, as
    `flax.linen.GroupNorm(num_groups)` computes them (its default epsilon is 1e-6). Instance norm is
    `num_groups = C`; `num_groups = 1` normalizes each sample over everything.

    Args:
      x: [N, ..., C] float32, bfloat16 or float16; any number of spatial axes (empty ones too).
      num_groups: G, which must divide C.
      scale: [C] in float32 or x's dtype, or None (no scaling).
      bias: [C] in float32 or x's dtype, or None (no shift).
      epsilon: added to the variance.
      activation: None, or a name of `jaxdnn.activation.EPILOGUES` ("relu", "silu", "gelu", ...)
        applied to the result in the same kernel.

    Returns:
      [N, ..., C] in x's dtype. Mean and variance are computed in float32.

    Differentiable with `jax.grad`/`jax.vjp` to any order; `jax.jvp` is not supported. Sharding the
    batch axis runs each shard on its own samples; the spatial and channel axes are kept whole.
    """
    x = _check_x(x)
    channels = x.shape[-1]
    num_groups = _check_num_groups(num_groups, channels)
    scale = _check_param("scale", scale, x)
    bias = _check_param("bias", bias, x)
    if not np.isfinite(epsilon) or epsilon < 0:
        raise ValueError(f"group_norm: epsilon must be a finite number >= 0, got {epsilon}")
    kind, param = epilogue("group_norm", activation)
    config = (num_groups, kind, param)

    def run(x, scale, bias):
        scale, bias = match_varying(x, scale, bias)
        x3 = x.reshape(x.shape[0], math.prod(x.shape[1:-1]), channels)
        return _gn(x3, scale, bias, np.float32(epsilon), config).reshape(x.shape)

    return per_row_shard(run, x, *_params(scale, bias, channels), whole_axes=x.ndim - 1)
