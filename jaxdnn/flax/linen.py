"""Flax linen modules over jaxdnn's fused normalization kernels.

Drop-in replacements for ``flax.linen.LayerNorm``, ``flax.linen.RMSNorm``,
``flax.linen.GroupNorm`` (channels last, statistics over every non-batch axis) and
``flax.linen.BatchNorm`` (which also keeps Flax's ``batch_stats`` ``mean``/``var``):
same attributes, same parameter names (``scale``, ``bias``), shapes ``(D,)`` and
dtypes, and the same output dtype for every ``dtype`` / ``param_dtype`` setting,
so a params tree made with stock Flax loads unchanged and vice versa.

Shapes: ``x`` is ``(..., D)``; LayerNorm and RMSNorm take statistics over the last
axis ``D`` by default, and over any ``reduction_axes``: trailing ones are flattened
into one (a free reshape), others are first moved last (a transpose of x, and one of
y back, in XLA).

What differs from stock Flax is only what jaxdnn's kernels cannot serve, and each
of those raises a ``ValueError`` rather than quietly computing something else:
``feature_axes`` that are not all reduction axes (params that vary across the rows),
cross-device statistics (``axis_name``/``axis_index_groups``), ``mask``, and
``force_float32_reductions=False`` (the kernels always reduce in float32).
``use_fast_variance`` is accepted with either value: it is a speed hint, and the
kernels compute the variance in float32 from the centred values, which is at least
as accurate as either of Flax's formulas.

Mixed precision: with bfloat16 inputs and float32 params, stock Flax returns
float32, and so do these modules (the input is widened to float32 before the
kernel). Set ``dtype=jnp.bfloat16`` (or ``param_dtype=jnp.bfloat16``) to keep the
kernel's input and output in bfloat16, which moves half the bytes.

Like the functional API these modules are built on, they support reverse-mode
autodiff (``grad``, ``vjp``) but not forward-mode ``jvp``.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

try:
    import flax.linen as nn
    from flax.linen import initializers
except ImportError as e:  # flax is an optional dependency of jaxdnn
    raise ImportError(
        "jaxdnn.flax needs Flax; install it with `pip install 'jaxdnn[flax]'`."
    ) from e

import jax
import jax.numpy as jnp
import numpy as np

import jaxdnn
from jaxdnn.flax.conv import Conv, ConvTranspose
from jaxdnn.flax.dense import Dense
from jaxdnn.norm import over_axes

__all__ = ["BatchNorm", "Conv", "ConvTranspose", "Dense", "GroupNorm", "LayerNorm", "RMSNorm"]

Dtype = Any
Initializer = Any
Axes = Any


# --- helpers shared with jaxdnn.flax.nnx ---------------------------------------


def _as_axis_tuple(axes: Axes) -> tuple[Any, ...] | None:
    """``axes`` as a tuple, or None if it is neither an int nor an iterable."""
    if isinstance(axes, (int, np.integer)) and not isinstance(axes, bool):
        return (axes,)
    try:
        return tuple(axes)
    except TypeError:
        return None


def norm_axes(module: str, reduction_axes: Axes, feature_axes: Axes,
              ndim: int | None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Flax's ``reduction_axes`` and ``feature_axes`` of an input of rank ``ndim``, as Flax
    canonicalizes them (non-negative, sorted, without repeats), or a ValueError naming the one the
    kernels cannot serve: each must be one axis or several, and every feature axis must be reduced
    (params that varied between the kernel's rows could not be a vector of D). With ``ndim=None``
    (the rank not known yet, e.g. at NNX construction) only their form is checked; returns None."""
    canonical = []
    for name, axes in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
        t = _as_axis_tuple(axes)
        ok = t is not None and len(t) > 0 and all(
            isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in t)
        if ok and ndim is not None:
            ok = all(-ndim <= a < ndim for a in t)
        if not ok:
            where = "" if ndim is None else f" for an input of rank {ndim}"
            raise ValueError(f"jaxdnn {module}: {name} must be an axis or a sequence of axes of the "
                             f"input, got {axes!r}{where}.")
        if ndim is not None:
            canonical.append(tuple(sorted({int(a) % ndim for a in t})))
    if ndim is None:
        return None
    reduction, features = canonical
    if not set(features) <= set(reduction):
        raise ValueError(
            f"jaxdnn {module}: every feature axis must be a reduction axis, got feature_axes="
            f"{feature_axes!r} and reduction_axes={reduction_axes!r} (input rank {ndim}). jaxdnn's "
            f"kernels take one scale and bias for all rows; use flax's own "
            f"{module.split('.')[-1]} for params that vary across the normalized rows.")
    return reduction, features


def _check_options(
    module: str,
    *,
    ndim: int | None = None,
    reduction_axes: Axes = -1,
    feature_axes: Axes = -1,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
    force_float32_reductions: bool = True,
) -> None:
    """Raises a ValueError naming each option jaxdnn's kernels cannot serve (the axes: see
    ``norm_axes``; with ``ndim=None`` only their form, the rest once the input's rank is known).
    Returns ``norm_axes``'s canonical axes (None with ``ndim=None``)."""
    axes = norm_axes(module, reduction_axes, feature_axes, ndim)
    if axis_name is not None or axis_index_groups is not None:
        raise ValueError(
            f"jaxdnn {module}: axis_name/axis_index_groups (statistics pooled across "
            f"devices) are not supported, got axis_name={axis_name!r}, "
            f"axis_index_groups={axis_index_groups!r}. Under jit with sharded "
            "inputs no axis_name is needed: each row is normalized on its own.")
    if not force_float32_reductions:
        raise ValueError(
            f"jaxdnn {module}: force_float32_reductions=False is not supported: "
            "jaxdnn's kernels always compute statistics in float32.")
    return axes


def _check_mask(module: str, mask: Any) -> None:
    if mask is not None:
        raise ValueError(
            f"jaxdnn {module}: `mask` is not supported (got an array of shape "
            f"{jnp.shape(mask)}); jaxdnn's kernels normalize over every element "
            "of the last axis.")


def _fit_param(p: jax.Array | None, x_dtype: Dtype) -> jax.Array | None:
    """Casts a scale/bias to a dtype the kernel accepts (float32 or x's dtype).

    Any other floating dtype narrower than float32 (e.g. float16 params with
    bfloat16 inputs) converts to float32 exactly, so nothing is lost.
    """
    if p is None:
        return None
    p = jnp.asarray(p)
    if p.dtype == jnp.float32 or p.dtype == x_dtype:
        return p
    return p.astype(jnp.float32)


def _norm_in_float32_then_cast(fn, x, params, out_dtype, **kw):
    """Runs ``fn(x, *params, **kw)`` and returns the result in ``out_dtype``.

    Stock Flax computes a norm entirely in (at least) float32 and rounds once, to
    the output dtype. The kernels also compute in float32 and round once, to the
    dtype of their input. So the input goes to the kernel in the wider of its own
    dtype and ``out_dtype`` (widening is exact), and a narrower ``out_dtype`` is
    reached by one final cast of the float32 result: the same single rounding.
    """
    x = jnp.asarray(x)
    in_dtype = jnp.promote_types(x.dtype, out_dtype)
    if not jnp.issubdtype(in_dtype, jnp.floating):
        in_dtype = jnp.promote_types(in_dtype, jnp.float32)
    x = x.astype(in_dtype)
    y = fn(x, *(_fit_param(p, in_dtype) for p in params), **kw)
    return y.astype(out_dtype)


def _output_dtype(x, *params, dtype: Dtype | None) -> Dtype:
    """Flax's rule: ``dtype`` if given, else the promoted type of x and params."""
    if dtype is None:
        dtype = jnp.result_type(*(jnp.asarray(a) for a in (x, *params) if a is not None))
        if not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(jnp.float32, dtype)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"jaxdnn: the output dtype must be a real floating type, got {dtype}.")
    return dtype


def _group_count(module: str, num_groups: int | None, group_size: int | None,
                 channels: int) -> int:
    """G from Flax's ``num_groups``/``group_size`` (exactly one is set), with Flax's checks."""
    if (num_groups is None) == (group_size is None):
        raise ValueError(
            f"jaxdnn {module}: either `num_groups` or `group_size` should be specified "
            f"(got num_groups={num_groups!r}, group_size={group_size!r}); to give "
            "`group_size`, pass `num_groups=None`.")
    if group_size is not None:
        if group_size <= 0 or channels % group_size != 0:
            raise ValueError(f"jaxdnn {module}: the number of channels ({channels}) is not a "
                             f"multiple of the group size ({group_size}).")
        return channels // group_size
    if not isinstance(num_groups, (int, np.integer)) or num_groups <= 0 or channels % num_groups:
        raise ValueError(f"jaxdnn {module}: the number of groups ({num_groups!r}) does not divide "
                         f"the number of channels ({channels}).")
    return int(num_groups)


def _check_group_axes(module: str, reduction_axes: Axes, ndim: int) -> None:
    """GroupNorm's statistics must span every axis but the first (batch) one, channels last."""
    if ndim < 2:
        raise ValueError(f"jaxdnn {module}: x must have a batch axis and a channel axis "
                         f"(rank >= 2), got rank {ndim}.")
    if reduction_axes is None:
        return
    axes = _as_axis_tuple(reduction_axes)
    try:
        canonical = sorted({operator.index(a) % ndim for a in axes}) if axes is not None else None
    except TypeError:
        canonical = None
    if canonical != list(range(1, ndim)):
        raise ValueError(
            f"jaxdnn {module}: reduction_axes must be None or every axis but the first "
            f"({tuple(range(1, ndim))}), got {reduction_axes!r}. jaxdnn's kernel takes "
            "statistics per sample over all positions; use flax's own GroupNorm otherwise.")


# --- modules -------------------------------------------------------------------


class LayerNorm(nn.Module):
    """Layer normalization over the last axis (or ``reduction_axes``), on jaxdnn's fused kernel.

    Mirrors ``flax.linen.LayerNorm``: ``y = (x - mean) / sqrt(var + epsilon) * scale
    + bias`` per row of ``x`` with shape ``(..., D)``; ``scale`` and ``bias`` are
    params of shape ``(D,)`` (by default; x's extents along ``feature_axes``).
    Statistics are computed in float32.

    Attributes:
      epsilon: added to the variance to avoid dividing by zero.
      dtype: the dtype of the result (default: promoted from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      use_bias: if True, ``bias`` is added.
      use_scale: if True, the output is multiplied by ``scale``.
      bias_init: initializer for ``bias`` (default: zeros).
      scale_init: initializer for ``scale`` (default: ones).
      reduction_axes: the axes of the statistics (default: the last); axes that are
        not trailing cost a transpose of x and of y (see the module docstring).
      feature_axes: the params' axes (default: the last); each must be a reduction axis.
      axis_name: must be None (no cross-device statistics).
      axis_index_groups: must be None.
      use_fast_variance: accepted, either value (see the module docstring).
      force_float32_reductions: must be True.
    """

    epsilon: float = 1e-6
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Initializer = initializers.zeros
    scale_init: Initializer = initializers.ones
    reduction_axes: Axes = -1
    feature_axes: Axes = -1
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    @nn.compact
    def __call__(self, x, *, mask: jax.Array | None = None):
        """Normalizes ``x`` of shape ``(..., D)`` over ``D``; returns the same shape."""
        x = jnp.asarray(x)
        _check_mask("flax.linen.LayerNorm", mask)
        axes = _check_options(
            "flax.linen.LayerNorm", ndim=x.ndim,
            reduction_axes=self.reduction_axes, feature_axes=self.feature_axes,
            axis_name=self.axis_name, axis_index_groups=self.axis_index_groups,
            force_float32_reductions=self.force_float32_reductions)
        if x.ndim == 0:
            raise ValueError("jaxdnn flax.linen.LayerNorm: x must have at least one "
                             "axis (the feature axis D), got a scalar.")
        reduction, feature_axes = axes
        features = tuple(x.shape[a] for a in feature_axes)
        scale = (self.param("scale", self.scale_init, features, self.param_dtype)
                 if self.use_scale else None)
        bias = (self.param("bias", self.bias_init, features, self.param_dtype)
                if self.use_bias else None)
        out_dtype = _output_dtype(x, scale, bias, dtype=self.dtype)
        kernel = functools.partial(over_axes, jaxdnn.layer_norm, reduction=reduction, features=feature_axes)
        return _norm_in_float32_then_cast(kernel, x, (scale, bias), out_dtype, epsilon=self.epsilon)


class RMSNorm(nn.Module):
    """RMS normalization over the last axis (or ``reduction_axes``), on jaxdnn's fused kernel.

    Mirrors ``flax.linen.RMSNorm``: ``y = x / sqrt(mean(x**2) + epsilon) * scale``
    per row of ``x`` with shape ``(..., D)``; ``scale`` is a param of shape ``(D,)``
    (by default; x's extents along ``feature_axes``). Statistics are computed in float32.

    Attributes:
      epsilon: added to the mean square to avoid dividing by zero.
      dtype: the dtype of the result (default: promoted from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      use_scale: if True, the output is multiplied by ``scale``.
      scale_init: initializer for ``scale`` (default: ones).
      reduction_axes: the axes of the statistics (default: the last); axes that are
        not trailing cost a transpose of x and of y (see the module docstring).
      feature_axes: the params' axes (default: the last); each must be a reduction axis.
      axis_name: must be None (no cross-device statistics).
      axis_index_groups: must be None.
      use_fast_variance: accepted, either value (RMSNorm takes no mean anyway).
      force_float32_reductions: must be True.
    """

    epsilon: float = 1e-6
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    use_scale: bool = True
    scale_init: Initializer = initializers.ones
    reduction_axes: Axes = -1
    feature_axes: Axes = -1
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    @nn.compact
    def __call__(self, x, *, mask: jax.Array | None = None):
        """Normalizes ``x`` of shape ``(..., D)`` over ``D``; returns the same shape."""
        x = jnp.asarray(x)
        _check_mask("flax.linen.RMSNorm", mask)
        axes = _check_options(
            "flax.linen.RMSNorm", ndim=x.ndim,
            reduction_axes=self.reduction_axes, feature_axes=self.feature_axes,
            axis_name=self.axis_name, axis_index_groups=self.axis_index_groups,
            force_float32_reductions=self.force_float32_reductions)
        if x.ndim == 0:
            raise ValueError("jaxdnn flax.linen.RMSNorm: x must have at least one "
                             "axis (the feature axis D), got a scalar.")
        reduction, feature_axes = axes
        features = tuple(x.shape[a] for a in feature_axes)
        scale = (self.param("scale", self.scale_init, features, self.param_dtype)
                 if self.use_scale else None)
        out_dtype = _output_dtype(x, scale, dtype=self.dtype)
        kernel = functools.partial(over_axes, jaxdnn.rms_norm, reduction=reduction, features=feature_axes)
        return _norm_in_float32_then_cast(kernel, x, (scale,), out_dtype, epsilon=self.epsilon)


def _channel_axis(module: str, axis: Axes, ndim: int) -> int:
    """The one feature (channel) axis of a BatchNorm, as a non-negative int."""
    axes = _as_axis_tuple(axis)
    if axes is None or len(axes) != 1 or isinstance(axes[0], bool):
        raise ValueError(f"jaxdnn {module}: axis must be a single feature axis, got {axis!r}; "
                         "use flax's own BatchNorm for several feature axes.")
    a = operator.index(axes[0])
    if not -ndim <= a < ndim:
        raise ValueError(f"jaxdnn {module}: axis {a} is out of range for an input of rank {ndim}")
    return a % ndim


def _check_batch_norm_options(module: str, *, axis_name, axis_index_groups,
                              force_float32_reductions=True) -> None:
    if axis_name is not None or axis_index_groups is not None:
        raise ValueError(
            f"jaxdnn {module}: axis_name/axis_index_groups are not supported, got "
            f"axis_name={axis_name!r}. Under jit with a batch sharded over a mesh the "
            "statistics are already global (jaxdnn.batch_norm sums them across devices).")
    if not force_float32_reductions:
        raise ValueError(f"jaxdnn {module}: force_float32_reductions=False is not supported: "
                         "jaxdnn's kernels always compute statistics in float32.")


class BatchNorm(nn.Module):
    """Batch normalization on jaxdnn's kernels, mirroring ``flax.linen.BatchNorm``.

    ``x`` has its channels on ``axis`` (``(N, H, W, C)`` with the default -1);
    statistics are over every other axis. Params ``scale``/``bias`` and the
    ``batch_stats`` collection's ``mean``/``var`` (float32) have shape ``(C,)``, as
    in Flax. With ``use_running_average=False`` the batch statistics normalize
    ``x`` and update ``batch_stats`` (when it is mutable and not initializing):
    ``running = momentum * running + (1 - momentum) * batch``.

    Attributes are Flax's; ``axis`` must be a single axis, ``axis_name`` and
    ``axis_index_groups`` must be None, ``force_float32_reductions`` True;
    ``use_fast_variance`` is accepted with either value. Beyond Flax, the call takes
    the fused ResNet epilogue: ``bn(x, residual=r, activation="relu")`` computes
    ``relu(bn(x) + r)`` in the same kernels (see ``jaxdnn.batch_norm``).
    """

    use_running_average: bool | None = None
    axis: int = -1
    momentum: float = 0.99
    epsilon: float = 1e-5
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Initializer = initializers.zeros
    scale_init: Initializer = initializers.ones
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    @nn.compact
    def __call__(self, x, use_running_average: bool | None = None, *, mask: jax.Array | None = None,
                 residual: jax.Array | None = None, activation: str | None = None):
        """Normalizes ``x``, then adds ``residual`` and applies ``activation`` when given; returns an
        array of x's shape."""
        module = "flax.linen.BatchNorm"
        use_running_average = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average)
        x = jnp.asarray(x)
        _check_mask(module, mask)
        _check_batch_norm_options(module, axis_name=self.axis_name, axis_index_groups=self.axis_index_groups,
                                  force_float32_reductions=self.force_float32_reductions)
        axis = _channel_axis(module, self.axis, x.ndim)
        features = (x.shape[axis],)
        ra_mean = self.variable("batch_stats", "mean", lambda s: jnp.zeros(s, jnp.float32), features)
        ra_var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, jnp.float32), features)
        scale = (self.param("scale", self.scale_init, features, self.param_dtype)
                 if self.use_scale else None)
        bias = (self.param("bias", self.bias_init, features, self.param_dtype)
                if self.use_bias else None)
        out_dtype = _output_dtype(x, scale, bias, dtype=self.dtype)

        def normalize(x, scale, bias):
            y, mean, var = jaxdnn.batch_norm(
                x, scale, bias, ra_mean.value, ra_var.value, training=not use_running_average,
                momentum=self.momentum, epsilon=self.epsilon, axis=axis,
                residual=None if residual is None else jnp.asarray(residual).astype(x.dtype),
                activation=activation)
            if not use_running_average and not self.is_initializing():
                ra_mean.value, ra_var.value = mean, var
            return y

        return _norm_in_float32_then_cast(normalize, x, (scale, bias), out_dtype)


class GroupNorm(nn.Module):
    """Group normalization, channels last, on jaxdnn's fused kernel.

    Mirrors ``flax.linen.GroupNorm``: ``x`` of shape ``(N, ..., C)`` is normalized per
    sample and group of ``C / G`` channels over every other axis, then scaled and
    shifted per channel by params ``scale``/``bias`` of shape ``(C,)``. Statistics are
    computed in float32.

    Attributes:
      num_groups: G, the number of channel groups (default 32); None to use group_size.
      group_size: channels per group (with ``num_groups=None``).
      epsilon: added to the variance to avoid dividing by zero.
      dtype: the dtype of the result (default: promoted from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      use_bias: if True, ``bias`` is added.
      use_scale: if True, the output is multiplied by ``scale``.
      bias_init: initializer for ``bias`` (default: zeros).
      scale_init: initializer for ``scale`` (default: ones).
      reduction_axes: None or every axis but the first.
      axis_name: must be None (no cross-device statistics).
      axis_index_groups: must be None.
      use_fast_variance: accepted, either value (see the module docstring).
      force_float32_reductions: must be True.
    """

    num_groups: int | None = 32
    group_size: int | None = None
    epsilon: float = 1e-6
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Initializer = initializers.zeros
    scale_init: Initializer = initializers.ones
    reduction_axes: Axes | None = None
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    @nn.compact
    def __call__(self, x, *, mask: jax.Array | None = None):
        """Normalizes ``x`` of shape ``(N, ..., C)``; returns the same shape."""
        module = "flax.linen.GroupNorm"
        x = jnp.asarray(x)
        _check_mask(module, mask)
        _check_options(module, ndim=x.ndim, axis_name=self.axis_name,
                       axis_index_groups=self.axis_index_groups,
                       force_float32_reductions=self.force_float32_reductions)
        _check_group_axes(module, self.reduction_axes, x.ndim)
        groups = _group_count(module, self.num_groups, self.group_size, x.shape[-1])
        features = (x.shape[-1],)
        scale = (self.param("scale", self.scale_init, features, self.param_dtype)
                 if self.use_scale else None)
        bias = (self.param("bias", self.bias_init, features, self.param_dtype)
                if self.use_bias else None)
        out_dtype = _output_dtype(x, scale, bias, dtype=self.dtype)
        return _norm_in_float32_then_cast(
            lambda x, scale, bias, **kw: jaxdnn.group_norm(x, groups, scale, bias, **kw),
            x, (scale, bias), out_dtype, epsilon=self.epsilon)
