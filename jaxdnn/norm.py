"""LayerNorm and RMSNorm over the last axis.

Shapes: x [..., D] (any number of leading axes, R rows in all), scale and bias [D], the saved
statistics mean and rstd [...]. Statistics and accumulation are float32; outputs have x's dtype.

Each function is a `jax.custom_vjp` over two kernel stages, `*_fwd` (saves mean/rstd) and `*_bwd`
(dx, dscale, dbias). layer_norm's kernels fuse an optional activation,
y = act(xhat * scale + bias); its backward recomputes the affine output for act'. Both stages have
their own VJP through the reference implementation, so grad of grad works; forward-mode `jax.jvp`
is not provided (custom_vjp).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdnn import _ffi  # noqa: F401  (registers the FFI targets)
from jaxdnn import reference
from jaxdnn._primitive import ffi_primitive, match_varying, move_to_front, per_row_shard
from jaxdnn.activation import KIND_NAMES, epilogue, epilogue_attrs
from jaxdnn.reference.activation import FUNCTIONS

_FLOAT_TYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_F32 = jnp.float32


def _num_partials(rows, features: int, sums: int) -> int:
    """Rows of the backward workspace: the CUDA kernel's blocks each write one partial sum of
    dscale/dbias, reduced in a fixed order afterwards. At most 1024 and 128 MiB, and at most the
    rows when their number is known (under `jax.export` it may be symbolic)."""
    bound = max(1, min(1024, (1 << 27) // (4 * sums * features)))
    return min(rows, bound) if isinstance(rows, int) and rows > 0 else bound


# --- the four kernel stages -------------------------------------------------------------------

def _fwd_avals(x, scale, *bias, rms, **attrs):
    stat = jax.core.ShapedArray(x.shape[:-1], _F32)
    y = jax.core.ShapedArray(x.shape, x.dtype)
    return [y, stat] if rms else [y, stat, stat]


def _bwd_avals(dy, x, scale, *stats, rms, **attrs):
    rows = math.prod(x.shape[:-1])
    features = x.shape[-1]
    sums = 1 if rms else 2
    per_feature = jax.core.ShapedArray((features,), _F32)
    workspace = jax.core.ShapedArray((_num_partials(rows, features, sums), sums, features), _F32)
    dx = jax.core.ShapedArray(x.shape, x.dtype)
    return [dx] + [per_feature] * sums + [workspace]


def _fwd_batch_rule(prim, args, dims, *, rms, **attrs):
    """Folds the vmapped axis into the rows. A batched scale/bias keeps the kernel's statistics and
    applies the per-example affine (and activation) in XLA."""
    x, params = args[0], args[1:]
    size = x.shape[dims[0]] if dims[0] is not None else next(
        a.shape[d] for a, d in zip(args, dims) if d is not None)
    x = move_to_front(x, dims[0], size)
    if all(d is None for d in dims[1:]):
        return prim.bind(x, *params, **attrs), [0] * (2 if rms else 3)
    ones = jnp.ones(x.shape[-1:], _F32)
    plain = dict(attrs, **({} if rms else epilogue_attrs("identity", 0.0)))
    stats = prim.bind(x, ones, *([] if rms else [jnp.zeros_like(ones)]), **plain)
    expand = (slice(None),) + (None,) * (x.ndim - 2)
    scale = move_to_front(params[0], dims[1], size)[expand]
    bias = None if rms else move_to_front(params[1], dims[2], size)[expand]
    mean = None if rms else stats[1]
    y = (x.astype(_F32) - (0 if rms else mean[..., None])) * stats[-1][..., None] * scale
    if bias is not None:
        y = y + bias
    if not rms:
        y = FUNCTIONS[KIND_NAMES[int(attrs["activation"])]](y, attrs["activation_param"])
    return [y.astype(x.dtype), *stats[1:]], [0] * len(stats)


def _bwd_batch_rule(prim, args, dims, *, rms, **attrs):
    """Folds the vmapped axis into the rows for dx; the per-example dscale/dbias (sums over each
    example's rows only) are reduced in XLA. A batched scale or bias computes dx in XLA too."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    params = 1 if rms else 2  # scale (and bias) follow dy and x
    dy, x, *stats = [move_to_front(a, d, size) for i, (a, d) in enumerate(zip(args, dims))
                     if not 2 <= i < 2 + params]
    scale, bias = args[2], (None if rms else args[3])
    mean, rstd = (None, stats[0]) if rms else stats
    kind = "identity" if rms else KIND_NAMES[int(attrs["activation"])]
    param = 0.0 if rms else float(attrs["activation_param"])
    if any(d is not None for d in dims[2:2 + params]):
        scale = move_to_front(scale, dims[2], size)
        bias = None if rms else move_to_front(bias, dims[3], size)
        dx = jax.vmap(lambda *a: reference.norm_bwd(*a, rms, kind, param)[0])(dy, x, scale, bias, mean, rstd)
        scale_rows = scale[(slice(None),) + (None,) * (x.ndim - 2)]
        bias_rows = None if rms else bias[(slice(None),) + (None,) * (x.ndim - 2)]
    else:
        dx = prim.bind(dy, x, *args[2:2 + params], *stats, **attrs)[0]
        scale_rows, bias_rows = scale, bias
    xhat = (x.astype(_F32) - (0 if rms else mean[..., None])) * rstd[..., None]
    row_axes = tuple(range(1, x.ndim - 1))
    dyf = dy.astype(_F32)
    if kind != "identity":  # dscale/dbias take dy through the activation
        pre = xhat * scale_rows + bias_rows
        dyf = jax.vjp(lambda p: FUNCTIONS[kind](p, param), pre)[1](dyf)[0]
    sums = [jnp.sum(dyf * xhat, axis=row_axes)] + ([] if rms else [jnp.sum(dyf, axis=row_axes)])
    return [dx, *sums], [0] * (1 + len(sums))


_layer_norm_fwd = ffi_primitive(
    "jaxdnn_layer_norm_fwd", "jaxdnn_layer_norm_fwd_v2",
    result_avals=functools.partial(_fwd_avals, rms=False),
    batch_rule=functools.partial(_fwd_batch_rule, rms=False),
    sharding_rule="... d, d, d -> ... d, ..., ...")
_rms_norm_fwd = ffi_primitive(
    "jaxdnn_rms_norm_fwd", "jaxdnn_rms_norm_fwd_v1",
    result_avals=functools.partial(_fwd_avals, rms=True),
    batch_rule=functools.partial(_fwd_batch_rule, rms=True),
    sharding_rule="... d, d -> ... d, ...")
_layer_norm_bwd = ffi_primitive(
    "jaxdnn_layer_norm_bwd", "jaxdnn_layer_norm_bwd_v2",
    result_avals=functools.partial(_bwd_avals, rms=False),
    batch_rule=functools.partial(_bwd_batch_rule, rms=False),
    scratch_results=1, reduced_results=(1, 2),
    sharding_rule="... d, ... d, d, d, ..., ... -> ... d, d, d")
_rms_norm_bwd = ffi_primitive(
    "jaxdnn_rms_norm_bwd", "jaxdnn_rms_norm_bwd_v1",
    result_avals=functools.partial(_bwd_avals, rms=True),
    batch_rule=functools.partial(_bwd_batch_rule, rms=True),
    scratch_results=1, reduced_results=(1,),
    sharding_rule="... d, ... d, d, ... -> ... d, d")


# --- differentiable stages (second order through the reference) -------------------------------
# `act` is (kind, param): the fused activation of layer_norm, ("identity", 0.0) for rms_norm.



@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm_fwd(x, scale, bias, epsilon, rms, act):
    """(y, mean or None, rstd) from the kernel."""
    if rms:
        y, rstd = _rms_norm_fwd.bind(x, scale, epsilon=epsilon)
        return y, None, rstd
    return tuple(_layer_norm_fwd.bind(x, scale, bias, epsilon=epsilon, **epilogue_attrs(*act)))


def _norm_fwd_fwd(x, scale, bias, epsilon, rms, act):
    return _norm_fwd(x, scale, bias, epsilon, rms, act), (x, scale, bias)


def _norm_fwd_bwd(epsilon, rms, act, inputs, cotangents):
    _, vjp = jax.vjp(lambda *a: reference.norm_fwd(*a, epsilon, rms, *act), *inputs)
    return vjp(cotangents)


_norm_fwd.defvjp(_norm_fwd_fwd, _norm_fwd_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _norm_bwd(dy, x, scale, bias, mean, rstd, rms, act):
    """(dx, dscale, dbias or None) from the kernel; bias is None for rms_norm."""
    if rms:
        dx, dscale = _rms_norm_bwd.bind(dy, x, scale, rstd)
        return dx, dscale, None
    return tuple(_layer_norm_bwd.bind(dy, x, scale, bias, mean, rstd, **epilogue_attrs(*act)))


def _norm_bwd_fwd(dy, x, scale, bias, mean, rstd, rms, act):
    return _norm_bwd(dy, x, scale, bias, mean, rstd, rms, act), (dy, x, scale, bias, mean, rstd)


def _norm_bwd_bwd(rms, act, inputs, cotangents):
    _, vjp = jax.vjp(lambda *a: reference.norm_bwd(*a, rms, *act), *inputs)
    return vjp(cotangents)


_norm_bwd.defvjp(_norm_bwd_fwd, _norm_bwd_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm(x, scale, bias, epsilon, rms, act):
    return _norm_fwd(x, scale, bias, epsilon, rms, act)[0]


def _norm_vjp_fwd(x, scale, bias, epsilon, rms, act):
    y, mean, rstd = _norm_fwd(x, scale, bias, epsilon, rms, act)
    return y, (x, scale, bias, mean, rstd)


def _norm_vjp_bwd(epsilon, rms, act, residuals, dy):
    x, scale, bias, mean, rstd = residuals
    return _norm_bwd(dy, x, scale, bias, mean, rstd, rms, act)


_norm.defvjp(_norm_vjp_fwd, _norm_vjp_bwd)


# --- public API -------------------------------------------------------------------------------

def _check_param(fn, name, param, x):
    if param is None:
        return None
    if not hasattr(param, "shape") or not hasattr(param, "dtype"):
        param = jnp.asarray(param)
    if param.dtype not in (jnp.dtype(_F32), x.dtype):
        raise TypeError(f"{fn}: {name} must be float32 or x's dtype {x.dtype}, got {param.dtype}")
    if param.shape != x.shape[-1:]:
        raise ValueError(f"{fn}: {name} must have shape (D,) = {x.shape[-1:]} to match x.shape "
                         f"{x.shape}, got {name}.shape {param.shape}")
    return param.astype(_F32)


def _check_x(fn, x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if x.dtype not in [jnp.dtype(t) for t in _FLOAT_TYPES]:
        raise TypeError(f"{fn}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{fn}: x must have rank >= 1 (it is normalized over its last axis), "
                         f"got shape {x.shape}")
    if x.shape[-1] == 0:
        raise ValueError(f"{fn}: x's last axis must be non-empty, got shape {x.shape}")
    return x


def _check_epsilon(fn, epsilon):
    if not np.isfinite(epsilon) or epsilon < 0:
        raise ValueError(f"{fn}: epsilon must be a finite number >= 0, got {epsilon}")
    return np.float32(epsilon)


def over_axes(kernel, x, *params, reduction: tuple[int, ...], features: tuple[int, ...], **kw):
    """``kernel`` (`layer_norm` or `rms_norm`, params of shape (D,)) run over the axes ``reduction``
    of ``x`` (sorted, non-negative), with params shaped as ``x`` along ``features`` (some of those
    axes, sorted: Flax's layout); the Flax and Haiku modules' normalization over other axes.

    The reduced axes go last, a transpose in XLA unless they already are, and are flattened into
    one axis of D elements (a free reshape); each param is broadcast over the reduced axes that are
    not features and flattened to (D,); the result goes back to x's layout."""
    perm = (*(a for a in range(x.ndim) if a not in reduction), *reduction)
    moved = perm != tuple(range(x.ndim))
    xt = jnp.transpose(x, perm) if moved else x
    reduced = xt.shape[x.ndim - len(reduction):]
    d = math.prod(reduced)
    param_shape = tuple(n if a in features else 1 for a, n in zip(reduction, reduced))
    flat = [None if p is None else jnp.broadcast_to(jnp.reshape(p, param_shape), reduced).reshape(d)
            for p in params]
    y = kernel(xt.reshape(*xt.shape[:x.ndim - len(reduction)], d), *flat, **kw).reshape(xt.shape)
    return jnp.transpose(y, np.argsort(perm)) if moved else y


def layer_norm(x, scale=None, bias=None, *, epsilon=1e-6, activation=None):
    """Layer normalization over the last axis: `act((x - mean) / sqrt(var + epsilon) * scale + bias)`.

    Args:
      x: [..., D] float32, bfloat16 or float16; any number of leading axes (empty ones too).
      scale: [D] in float32 or x's dtype, or None (no scaling).
      bias: [D] in float32 or x's dtype, or None (no shift).
      epsilon: added to the variance.
      activation: None, or a name of `jaxdnn.activation.EPILOGUES` (e.g. "gelu", "silu") fused into
        the kernels (their backward recomputes the affine output for its derivative).

    Returns:
      [..., D] in x's dtype. Mean and variance are computed in float32.

    Differentiable with `jax.grad`/`jax.vjp` to any order; `jax.jvp` is not supported.
    """
    x = _check_x("layer_norm", x)
    scale = _check_param("layer_norm", "scale", scale, x)
    bias = _check_param("layer_norm", "bias", bias, x)
    epsilon = _check_epsilon("layer_norm", epsilon)
    act = epilogue("layer_norm", activation)
    ones = jnp.ones(x.shape[-1:], _F32)
    return per_row_shard(lambda x, scale, bias: _norm(x, *match_varying(x, scale, bias), epsilon, False, act),
                         x, ones if scale is None else scale,
                         jnp.zeros_like(ones) if bias is None else bias)


def rms_norm(x, scale=None, *, epsilon=1e-6):
    """Root-mean-square normalization over the last axis: `x / sqrt(mean(x**2) + epsilon) * scale`.

    Args:
      x: [..., D] float32, bfloat16 or float16; any number of leading axes (empty ones too).
      scale: [D] in float32 or x's dtype, or None (no scaling).
      epsilon: added to the mean square.

    Returns:
      [..., D] in x's dtype. The mean square is computed in float32.

    Differentiable with `jax.grad`/`jax.vjp` to any order; `jax.jvp` is not supported.
    """
    x = _check_x("rms_norm", x)
    scale = _check_param("rms_norm", "scale", scale, x)
    epsilon = _check_epsilon("rms_norm", epsilon)
    return per_row_shard(lambda x, scale: _norm(x, *match_varying(x, scale), None, epsilon, True,
                                                ("identity", 0.0)),
                         x, jnp.ones(x.shape[-1:], _F32) if scale is None else scale)
