"""Haiku modules over jaxdnn's fused normalization kernels.

Drop-in replacements for ``hk.LayerNorm``, ``hk.RMSNorm``, ``hk.GroupNorm`` (channels
last, statistics over every non-batch axis) and ``hk.BatchNorm`` (see its docstring):
same constructor arguments, same module names (``layer_norm``, ``group_norm``,
``rms_norm``, ``batch_norm``) and parameter names (``scale``, ``offset``, created in
the input's dtype), so a params dict made with stock Haiku loads unchanged.
As the Haiku style has it, each module is partial application of the functional
op (``jaxdnn.layer_norm`` / ``jaxdnn.rms_norm``) to its parameters.

Shapes: ``x`` is ``(..., D)``; LayerNorm and RMSNorm take statistics over ``axis``
(the last by default; trailing axes are flattened into one, a free reshape, others are
first moved last, a transpose of x and one of y back in XLA) in float32 (stock Haiku
computes them in the input's dtype, so half-precision results agree to half-precision
rounding, and are the more accurate of the two). Their params (``param_axis``) and
call-time ``scale``/``offset`` must not vary along axes that are not normalized (the
kernels take one scale and offset for all rows): those raise ``ValueError``.
``use_fast_variance`` is accepted with either value: the kernels compute the
variance from centred values in float32. Reverse-mode autodiff works; forward-mode
``jvp`` does not.

Haiku is an optional dependency: only ``import jaxdnn.haiku`` imports it.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable

try:
    import haiku as hk
except ImportError as e:
    raise ImportError(
        "jaxdnn.haiku needs Haiku; install it with `pip install 'jaxdnn[haiku]'`."
    ) from e

import jax
import jax.numpy as jnp

import jaxdnn
from jaxdnn.norm import over_axes
from jaxdnn.haiku_conv import Conv1D, Conv2D, Conv3D, ConvND
from jaxdnn.haiku_dense import Linear
from jaxdnn.haiku_rnn import lstm_weights_from_haiku

__all__ = ["BatchNorm", "Conv1D", "Conv2D", "Conv3D", "ConvND", "GroupNorm", "LayerNorm", "Linear", "RMSNorm",
           "lstm_weights_from_haiku"]

Initializer = Callable[..., Any]


def _abs_axes(module: str, arg: str, axis: Any, ndim: int | None) -> tuple[int, ...] | None:
    """``axis`` (an int, a sequence of ints or a slice, as in Haiku) as sorted non-negative axes of
    an input of rank ``ndim``, or a ValueError naming ``arg``. With ``ndim=None`` (at construction)
    only its form is checked; returns None."""
    if isinstance(axis, slice):
        ok = all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in
                 (axis.start, axis.stop, axis.step))
        axes = tuple(range(ndim)[axis]) if ok and ndim is not None else None
        ok = ok and (ndim is None or len(axes) > 0)
    else:
        try:
            axes = (operator.index(axis),) if not isinstance(axis, bool) else None
        except TypeError:
            try:
                axes = tuple(operator.index(a) for a in axis if not isinstance(a, bool))
                axes = axes if len(axes) == len(tuple(axis)) else None
            except TypeError:
                axes = None
        ok = axes is not None and len(axes) > 0 and (ndim is None or all(-ndim <= a < ndim for a in axes))
        if ok and ndim is not None:
            axes = tuple(sorted({a % ndim for a in axes}))
    if not ok:
        where = "" if ndim is None else f" for an input of rank {ndim}"
        raise ValueError(f"jaxdnn {module}: {arg} must be an axis, a sequence of axes or a slice of the "
                         f"input's, got {axis!r}{where}.")
    return None if ndim is None else axes


def _param_shape(shape: tuple[int, ...], param_axes: tuple[int, ...]) -> tuple[int, ...]:
    """Haiku's shape of a norm's params: (D,) for the last axis, else x's rank with 1s elsewhere."""
    if param_axes == (len(shape) - 1,):
        return shape[-1:]
    return tuple(n if i in param_axes else 1 for i, n in enumerate(shape))


def _over_reduced(module: str, name: str, p: Any, shape: tuple[int, ...],
                  reduction: tuple[int, ...]) -> jax.Array | None:
    """A scale/offset (a param, or a call-time value broadcastable to x's ``shape``) as an array over
    the normalized axes ``reduction`` only; one that varies along another axis raises."""
    if p is None:
        return None
    p = jnp.asarray(p)
    rowless = tuple(n if i in reduction else 1 for i, n in enumerate(shape))
    try:
        p = jnp.broadcast_to(p, rowless)
    except ValueError:
        raise ValueError(
            f"jaxdnn {module}: `{name}` (shape {p.shape}) must not vary along axes that are not "
            f"normalized (input shape {shape}, normalized axes {reduction}): jaxdnn's kernels take one "
            f"{name} for all rows; use Haiku's own {module.split('.')[-1]} for such params.") from None
    return p.reshape(tuple(shape[i] for i in reduction))


def _as_feature_vector(module: str, name: str, p: Any, d: int) -> jax.Array:
    """A call-time scale/offset (Haiku allows anything broadcastable) as shape (D,).

    Per-feature values (shapes like ``(D,)``, ``(1, 1, D)``) or a single value are
    served; values that vary along other axes are not, and raise.
    """
    p = jnp.asarray(p)
    if p.size == 1:
        return jnp.broadcast_to(p.reshape(()), (d,))
    if p.shape[-1:] == (d,) and all(s == 1 for s in p.shape[:-1]):
        return p.reshape(d)
    raise ValueError(
        f"jaxdnn {module}: a call-time `{name}` must hold one value per feature "
        f"(shape (D,) = ({d},), or broadcastable as (1, ..., 1, D)) or be a single "
        f"value; got shape {p.shape}.")


def _as_channel_vector(module: str, name: str, p: Any, channels: int) -> jax.Array:
    """A BatchNorm scale/offset (one value per channel, e.g. (1, 1, 1, C), or one value) as (C,)."""
    p = jnp.asarray(p)
    if p.size == 1:
        return jnp.broadcast_to(p.reshape(()), (channels,))
    if p.size == channels and channels in p.shape:
        return p.reshape(channels)
    raise ValueError(f"jaxdnn {module}: `{name}` must hold one value per channel ({channels}) or a single "
                     f"value; got shape {p.shape}.")


def _run(fn, x, params, **kw):
    """Calls kernel ``fn``, in the dtype Haiku's arithmetic would give.

    Haiku's result dtype is ``result_type(x, *params)`` (params may have been
    loaded in another dtype than x). x is widened to that type (exactly) if needed,
    and params outside {float32, x.dtype} are widened to float32 (exactly).
    """
    present = [p for p in params if p is not None]
    out_dtype = jnp.result_type(x, *present) if present else x.dtype
    if not jnp.issubdtype(out_dtype, jnp.floating):
        out_dtype = jnp.promote_types(out_dtype, jnp.float32)
    x = x.astype(out_dtype)
    fitted = []
    for p in params:
        if p is not None and p.dtype != jnp.float32 and p.dtype != x.dtype:
            p = p.astype(jnp.float32)
        fitted.append(p)
    return fn(x, *fitted, **kw)


class LayerNorm(hk.Module):
    """Layer normalization over the last axis (or ``axis``), on jaxdnn's fused kernel.

    Mirrors ``hk.LayerNorm``: ``y = (x - mean) / sqrt(var + eps) * scale + offset``
    per row of ``x`` with shape ``(..., D)``.
    """

    def __init__(
        self,
        axis: int | tuple[int, ...] | slice = -1,
        create_scale: bool = True,
        create_offset: bool = True,
        eps: float = 1e-5,
        scale_init: Initializer | None = None,
        offset_init: Initializer | None = None,
        use_fast_variance: bool = False,
        name: str | None = None,
        *,
        param_axis: int | tuple[int, ...] | slice | None = None,
    ):
        """Constructs a LayerNorm module.

        Args:
          axis: the axes to normalize over (an int, a sequence or a slice; default: the last).
          create_scale: whether to create a trainable ``scale`` (shape (D,) by default).
          create_offset: whether to create a trainable ``offset`` (shape (D,) by default).
          eps: added to the variance to avoid dividing by zero.
          scale_init: initializer for ``scale`` (default: ones).
          offset_init: initializer for ``offset`` (default: zeros).
          use_fast_variance: accepted for compatibility, either value.
          name: the module name.
          param_axis: the parameters' axes (default: the last); each must be normalized.
        """
        super().__init__(name=name)
        if not create_scale and scale_init is not None:
            raise ValueError("Cannot set `scale_init` if `create_scale=False`.")
        if not create_offset and offset_init is not None:
            raise ValueError("Cannot set `offset_init` if `create_offset=False`.")
        _abs_axes("hk.LayerNorm", "axis", axis, None)
        if param_axis is not None:
            _abs_axes("hk.LayerNorm", "param_axis", param_axis, None)
        self.axis = axis
        self.param_axis = -1 if param_axis is None else param_axis
        self.create_scale = create_scale
        self.create_offset = create_offset
        self.eps = eps
        self.scale_init = scale_init or jnp.ones
        self.offset_init = offset_init or jnp.zeros
        self.use_fast_variance = use_fast_variance

    def __call__(self, inputs: jax.Array, scale: jax.Array | None = None,
                 offset: jax.Array | None = None) -> jax.Array:
        """Normalizes ``inputs`` of shape ``(..., D)`` over ``D``.

        Args:
          inputs: an array of shape ``(..., D)``.
          scale: a per-feature scale, only if ``create_scale=False``.
          offset: a per-feature offset, only if ``create_offset=False``.

        Returns:
          The normalized array, shape ``(..., D)``.
        """
        x = jnp.asarray(inputs)
        if self.create_scale and scale is not None:
            raise ValueError("Cannot pass `scale` at call time if `create_scale=True`.")
        if self.create_offset and offset is not None:
            raise ValueError("Cannot pass `offset` at call time if `create_offset=True`.")
        if x.ndim == 0:
            raise ValueError("jaxdnn hk.LayerNorm: inputs must have at least one axis "
                             "(the feature axis D), got a scalar.")
        reduction = _abs_axes("hk.LayerNorm", "axis", self.axis, x.ndim)
        param_shape = _param_shape(x.shape, _abs_axes("hk.LayerNorm", "param_axis", self.param_axis, x.ndim))
        if self.create_scale:
            scale = hk.get_parameter("scale", param_shape, x.dtype, init=self.scale_init)
        if self.create_offset:
            offset = hk.get_parameter("offset", param_shape, x.dtype, init=self.offset_init)
        params = [_over_reduced("hk.LayerNorm", name, p, x.shape, reduction)
                  for name, p in (("scale", scale), ("offset", offset))]
        kernel = functools.partial(over_axes, jaxdnn.layer_norm, reduction=reduction, features=reduction)
        return _run(kernel, x, params, epsilon=self.eps)


class RMSNorm(hk.Module):
    """RMS normalization over the last axis (or ``axis``), on jaxdnn's fused kernel.

    Mirrors ``hk.RMSNorm``: ``y = x / sqrt(mean(x**2) + eps) * scale`` per row of
    ``x`` with shape ``(..., D)``.
    """

    def __init__(
        self,
        axis: int | tuple[int, ...] | slice = -1,
        eps: float = 1e-5,
        scale_init: Initializer | None = None,
        name: str | None = None,
        create_scale: bool = True,
        *,
        param_axis: int | tuple[int, ...] | slice | None = None,
    ):
        """Constructs an RMSNorm module.

        Args:
          axis: the axes to normalize over (an int, a sequence or a slice; default: the last).
          eps: added to the mean square to avoid dividing by zero.
          scale_init: initializer for ``scale`` (default: ones).
          name: the module name.
          create_scale: whether to create a trainable ``scale`` (shape (D,) by default).
          param_axis: the parameter's axes (default: the last); each must be normalized.
        """
        super().__init__(name=name)
        if not create_scale and scale_init is not None:
            raise ValueError("Cannot set `scale_init` if `create_scale=False`.")
        _abs_axes("hk.RMSNorm", "axis", axis, None)
        if param_axis is not None:
            _abs_axes("hk.RMSNorm", "param_axis", param_axis, None)
        self.axis = axis
        self.param_axis = -1 if param_axis is None else param_axis
        self.eps = eps
        self.create_scale = create_scale
        self.scale_init = scale_init or jnp.ones

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Normalizes ``inputs`` of shape ``(..., D)`` over ``D``; same shape out."""
        x = jnp.asarray(inputs)
        if x.ndim == 0:
            raise ValueError("jaxdnn hk.RMSNorm: inputs must have at least one axis "
                             "(the feature axis D), got a scalar.")
        reduction = _abs_axes("hk.RMSNorm", "axis", self.axis, x.ndim)
        scale = None
        if self.create_scale:
            param_axes = _abs_axes("hk.RMSNorm", "param_axis", self.param_axis, x.ndim)
            scale = hk.get_parameter("scale", _param_shape(x.shape, param_axes), x.dtype,
                                     init=self.scale_init)
            scale = _over_reduced("hk.RMSNorm", "scale", scale, x.shape, reduction)
        kernel = functools.partial(over_axes, jaxdnn.rms_norm, reduction=reduction, features=reduction)
        return _run(kernel, x, (scale,), epsilon=self.eps)


class BatchNorm(hk.Module):
    """Batch normalization on jaxdnn's kernels, mirroring ``hk.BatchNorm``.

    Same constructor and call arguments, module name (``batch_norm``), parameters
    (``scale``/``offset`` of Haiku's broadcastable shape, e.g. ``(1, 1, 1, C)``, in
    the input's dtype) and state (the ``mean_ema``/``var_ema`` moving averages, kept
    by ``hk.ExponentialMovingAverage`` as in Haiku), so params and state load
    unchanged. Statistics are over every axis but the channel axis (``axis`` must be
    None), computed in float32 (Haiku uses the input's dtype); ``cross_replica_axis``
    must be None: under jit with a sharded batch the statistics are already global.
    """

    def __init__(self, create_scale: bool, create_offset: bool, decay_rate: float, eps: float = 1e-5,
                 scale_init: Initializer | None = None, offset_init: Initializer | None = None,
                 axis: Any = None, cross_replica_axis: Any = None,
                 cross_replica_axis_index_groups: Any = None,
                 data_format: str = "channels_last", name: str | None = None):
        super().__init__(name=name)
        module = "haiku.BatchNorm"
        if axis is not None:
            raise ValueError(f"jaxdnn {module}: axis must be None (statistics over every axis but the "
                             f"channels), got {axis!r}; use Haiku's own BatchNorm for other axes.")
        if cross_replica_axis is not None or cross_replica_axis_index_groups is not None:
            raise ValueError(f"jaxdnn {module}: cross_replica_axis is not supported, got "
                             f"{cross_replica_axis!r}; under jit with a sharded batch the statistics are "
                             "already global.")
        if not create_scale and scale_init is not None:
            raise ValueError("Cannot set `scale_init` if `create_scale=False`")
        if not create_offset and offset_init is not None:
            raise ValueError("Cannot set `offset_init` if `create_offset=False`")
        self.create_scale = create_scale
        self.create_offset = create_offset
        self.eps = eps
        self.scale_init = scale_init or jnp.ones
        self.offset_init = offset_init or jnp.zeros
        self.channel_index = hk.get_channel_index(data_format)
        self.mean_ema = hk.ExponentialMovingAverage(decay_rate, name="mean_ema")
        self.var_ema = hk.ExponentialMovingAverage(decay_rate, name="var_ema")

    def __call__(self, inputs: jax.Array, is_training: bool, test_local_stats: bool = False,
                 scale: jax.Array | None = None, offset: jax.Array | None = None) -> jax.Array:
        """Normalizes ``inputs`` (channels on the data format's axis); returns its shape."""
        module = "haiku.BatchNorm"
        if self.create_scale and scale is not None:
            raise ValueError("Cannot pass `scale` at call time if `create_scale=True`.")
        if self.create_offset and offset is not None:
            raise ValueError("Cannot pass `offset` at call time if `create_offset=True`.")
        inputs = jnp.asarray(inputs)
        channel = self.channel_index % inputs.ndim
        channels = inputs.shape[channel]
        w_shape = [channels if i == channel else 1 for i in range(inputs.ndim)]
        if self.create_scale:
            scale = hk.get_parameter("scale", w_shape, inputs.dtype, self.scale_init)
        if self.create_offset:
            offset = hk.get_parameter("offset", w_shape, inputs.dtype, self.offset_init)
        params = [None if p is None else _as_channel_vector(module, name, p, channels)
                  for name, p in (("scale", scale), ("offset", offset))]
        local_stats = is_training or test_local_stats
        # The moving averages are the shift of the batch sums (close to the batch mean); with
        # momentum 0 jaxdnn.batch_norm returns the batch statistics themselves.
        running = []
        for ema in (self.mean_ema, self.var_ema):
            ema.initialize(w_shape, inputs.dtype)  # Haiku's state: zeros until the first update
            running.append(ema.average.astype(jnp.float32).reshape(channels))
        y, mean, var = _run(
            lambda x, s, o: jaxdnn.batch_norm(x, s, o, *running, training=local_stats, momentum=0.0,
                                              epsilon=self.eps, axis=channel), inputs, params)
        if is_training:
            self.mean_ema(mean.reshape(w_shape).astype(inputs.dtype))
            self.var_ema(var.reshape(w_shape).astype(inputs.dtype))
        return y


class GroupNorm(hk.Module):
    """Group normalization, channels last, on jaxdnn's fused kernel.

    Mirrors ``hk.GroupNorm``: ``x`` of shape ``(N, ..., C)`` is normalized per sample and
    group of ``C / groups`` channels over every other axis, then scaled and offset per
    channel. Only ``data_format="channels_last"`` and statistics over every axis but the
    first (``axis=slice(1, None)``, the default) are supported; others raise ValueError.
    """

    def __init__(
        self,
        groups: int,
        axis: int | slice | tuple[int, ...] = slice(1, None),
        create_scale: bool = True,
        create_offset: bool = True,
        eps: float = 1e-5,
        scale_init: Initializer | None = None,
        offset_init: Initializer | None = None,
        data_format: str = "channels_last",
        name: str | None = None,
    ):
        """Constructs a GroupNorm module.

        Args:
          groups: G, the number of channel groups; must divide the channels.
          axis: the axes to normalize over: every axis but the first (the default).
          create_scale: whether to create a trainable ``scale`` of shape (C,).
          create_offset: whether to create a trainable ``offset`` of shape (C,).
          eps: added to the variance to avoid dividing by zero.
          scale_init: initializer for ``scale`` (default: ones).
          offset_init: initializer for ``offset`` (default: zeros).
          data_format: must be channels last ("channels_last", or a format ending in "C").
          name: the module name.
        """
        super().__init__(name=name)
        if not create_scale and scale_init is not None:
            raise ValueError("Cannot set `scale_init` if `create_scale=False`.")
        if not create_offset and offset_init is not None:
            raise ValueError("Cannot set `offset_init` if `create_offset=False`.")
        if hk.get_channel_index(data_format) != -1:
            raise ValueError(f"jaxdnn hk.GroupNorm: only channels-last data is supported, got "
                             f"data_format={data_format!r}; use Haiku's own GroupNorm for it.")
        self.groups = groups
        self.axis = axis
        self.create_scale = create_scale
        self.create_offset = create_offset
        self.eps = eps
        self.scale_init = scale_init or jnp.ones
        self.offset_init = offset_init or jnp.zeros

    def _check_axis(self, ndim: int) -> None:
        if ndim < 2:
            raise ValueError(f"jaxdnn hk.GroupNorm: inputs must have a batch axis and a channel "
                             f"axis (rank >= 2), got rank {ndim}.")
        try:
            if isinstance(self.axis, slice):
                axes = range(ndim)[self.axis]
            elif isinstance(self.axis, bool):
                axes = None
            else:
                try:
                    axes = (operator.index(self.axis),)
                except TypeError:
                    axes = tuple(operator.index(a) for a in self.axis)
            canonical = None if axes is None else sorted({a % ndim for a in axes})
        except TypeError:
            canonical = None
        if canonical != list(range(1, ndim)):
            raise ValueError(
                f"jaxdnn hk.GroupNorm: axis must cover every axis but the first, got "
                f"{self.axis!r} for an input of rank {ndim}. jaxdnn's kernel takes statistics "
                "per sample over all positions; use Haiku's own GroupNorm otherwise.")

    def __call__(self, x: jax.Array, scale: jax.Array | None = None,
                 offset: jax.Array | None = None) -> jax.Array:
        """Normalizes ``x`` of shape ``(N, ..., C)``; returns the same shape.

        Args:
          x: an array of shape ``(N, ..., C)``.
          scale: a per-channel scale, only if ``create_scale=False``.
          offset: a per-channel offset, only if ``create_offset=False``.
        """
        x = jnp.asarray(x)
        if self.create_scale and scale is not None:
            raise ValueError("Cannot pass `scale` at call time if `create_scale=True`.")
        if self.create_offset and offset is not None:
            raise ValueError("Cannot pass `offset` at call time if `create_offset=True`.")
        self._check_axis(x.ndim)
        c = x.shape[-1]
        if c % self.groups != 0:
            raise ValueError("The number of channels must be divisible by the number of groups, "
                             f"was channels={c}, groups={self.groups}")
        if self.create_scale:
            scale = hk.get_parameter("scale", (c,), x.dtype, init=self.scale_init)
        elif scale is not None:
            scale = _as_feature_vector("hk.GroupNorm", "scale", scale, c)
        if self.create_offset:
            offset = hk.get_parameter("offset", (c,), x.dtype, init=self.offset_init)
        elif offset is not None:
            offset = _as_feature_vector("hk.GroupNorm", "offset", offset, c)
        groups = self.groups
        return _run(lambda x, s, o, **kw: jaxdnn.group_norm(x, groups, s, o, **kw), x, (scale, offset),
                    epsilon=self.eps)
