"""Softmax and log-softmax with `jax.nn`'s signatures.

Shapes: x [..., D, ...], normalized over `axis` (D), or over several axes or all of them (axis a
tuple, or None), as jax.nn's. The kernels work on the last axis; other axes are moved there and back
(two transposes, which XLA may fuse with neighbours), several of them merged into one. Sums and
exponentials are float32; outputs have x's dtype.

`where` (a boolean mask broadcastable to x, as jax.nn's) is applied around the kernels: entries
outside it enter the kernel as the dtype's lowest finite value, so they get no weight (a row with
no entry inside normalizes uniformly, never NaN), and their outputs are replaced by 0 (softmax) or
-inf (log_softmax), as jax.nn's; XLA runs the two selects as elementwise passes beside the kernel.

Each function is a `jax.custom_vjp` over two kernel stages: `*_fwd` (x -> y) and `*_bwd`
((dy, y) -> dx, from the saved output). Both stages have their own VJP through the reference
implementation, so grad of grad works; forward-mode `jax.jvp` is not provided (custom_vjp).
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp

from jaxdnn import _ffi  # noqa: F401  (registers the FFI targets)
from jaxdnn import reference
from jaxdnn._primitive import ffi_primitive, per_row_shard, rows_batch_rule

_FLOAT_TYPES = [jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16)]


def _like_last_operand(*operands):
    """One result with the last operand's shape and dtype (x for the forward, y for the backward)."""
    return [jax.core.ShapedArray(operands[-1].shape, operands[-1].dtype)]


def _stage(name, rule):
    return ffi_primitive(f"jaxdnn_{name}", f"jaxdnn_{name}_v1", result_avals=_like_last_operand,
                         batch_rule=rows_batch_rule, sharding_rule=rule)


_FWD = {False: _stage("softmax_fwd", "... d -> ... d"), True: _stage("log_softmax_fwd", "... d -> ... d")}
_BWD = {False: _stage("softmax_bwd", "... d, ... d -> ... d"),
        True: _stage("log_softmax_bwd", "... d, ... d -> ... d")}


# --- differentiable stages (second order through the reference) -------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _softmax_fwd(x, log):
    return _FWD[log].bind(x)[0]


def _softmax_fwd_fwd(x, log):
    return _softmax_fwd(x, log), x


def _softmax_fwd_bwd(log, x, dy):
    return jax.vjp(lambda x: reference.softmax_fwd(x, log), x)[1](dy)


_softmax_fwd.defvjp(_softmax_fwd_fwd, _softmax_fwd_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _softmax_bwd(dy, y, log):
    return _BWD[log].bind(dy, y)[0]


def _softmax_bwd_fwd(dy, y, log):
    return _softmax_bwd(dy, y, log), (dy, y)


def _softmax_bwd_bwd(log, residuals, ddx):
    return jax.vjp(lambda dy, y: reference.softmax_bwd(dy, y, log), *residuals)[1](ddx)


_softmax_bwd.defvjp(_softmax_bwd_fwd, _softmax_bwd_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _softmax(x, log):
    return _softmax_fwd(x, log)


def _softmax_vjp_fwd(x, log):
    y = _softmax_fwd(x, log)
    return y, y


def _softmax_vjp_bwd(log, y, dy):
    return (_softmax_bwd(dy, y, log),)


_softmax.defvjp(_softmax_vjp_fwd, _softmax_vjp_bwd)


# --- public API -------------------------------------------------------------------------------

def _check(fn, x, axis, where):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if x.dtype not in _FLOAT_TYPES:
        raise TypeError(f"{fn}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{fn}: x must have rank >= 1, got shape {x.shape}")
    if where is not None:
        try:
            broadcast = jnp.broadcast_shapes(jnp.shape(where), x.shape)
        except ValueError:
            broadcast = None
        if broadcast != x.shape:
            raise ValueError(f"{fn}: where of shape {jnp.shape(where)} must broadcast to x's shape {x.shape}")
    if axis is None:
        listed = tuple(range(x.ndim))
    else:
        listed = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    axes = []
    for a in listed:
        try:
            a = operator.index(a)
        except TypeError:
            raise TypeError(f"{fn}: axis must be an int, a tuple of ints or None, got {axis!r}") from None
        if not -x.ndim <= a < x.ndim:
            raise ValueError(f"{fn}: axis {a} is out of range for x of shape {x.shape}")
        axes.append(a % x.ndim)
    if len(set(axes)) != len(axes):
        raise ValueError(f"{fn}: axis {axis} repeats an axis of x (shape {x.shape})")
    for a in axes:
        if x.shape[a] == 0:
            raise ValueError(f"{fn}: the normalized axis {a} of x (shape {x.shape}) must be non-empty")
    return x, tuple(axes)


def _apply(x, axes, where, log):
    """The op over `axes` (distinct, non-negative; none: each entry alone, a row of one)."""
    if where is not None:  # see the module's docstring
        lowest = jnp.asarray(jnp.finfo(x.dtype).min, x.dtype)
        y = _apply(jnp.where(where, x, lowest), axes, None, log)
        return jnp.where(where, y, jnp.asarray(-jnp.inf if log else 0, x.dtype))
    trailing = tuple(range(x.ndim - len(axes), x.ndim))
    moved = jnp.moveaxis(x, axes, trailing) if axes != trailing else x
    if len(axes) == 1:
        y = per_row_shard(lambda x: _softmax(x, log), moved)
    else:  # the axes merged into one row (a row of one entry for no axes)
        rows = moved.shape[:moved.ndim - len(axes)]
        flat = moved.reshape(rows + (math.prod(moved.shape[len(rows):]),))
        y = per_row_shard(lambda x: _softmax(x, log), flat).reshape(moved.shape)
    return jnp.moveaxis(y, trailing, axes) if axes != trailing else y


def softmax(x, axis=-1, where=None):
    """Softmax over `axis`: `exp(x - max) / sum(exp(x - max))`, as `jax.nn.softmax`.

    Args:
      x: float32, bfloat16 or float16 array of rank >= 1.
      axis: the axis to normalize over, a tuple of axes, or None (all axes), as jax.nn's (axes other
        than the last cost two transposes).
      where: optional mask broadcastable to x's shape: normalize over the entries where it is True;
        the others give 0 (as `jax.nn.softmax`'s `where`).

    Returns:
      x's shape and dtype; computed in float32. Differentiable to any order with `jax.grad`/`jax.vjp`;
      `jax.jvp` is not supported.
    """
    x, axis = _check("softmax", x, axis, where)
    return _apply(x, axis, where, log=False)


def log_softmax(x, axis=-1, where=None):
    """Log-softmax over `axis`: `x - max - log(sum(exp(x - max)))`, as `jax.nn.log_softmax`.

    Args and returns as `softmax`; entries outside `where` give -inf (as `jax.nn.log_softmax`'s).
    """
    x, axis = _check("log_softmax", x, axis, where)
    return _apply(x, axis, where, log=True)
