"""Flax NNX modules over jaxdnn's fused normalization kernels.

Drop-in replacements for ``flax.nnx.LayerNorm``, ``flax.nnx.RMSNorm``,
``flax.nnx.GroupNorm`` (channels last, statistics over every non-batch axis) and
``flax.nnx.BatchNorm`` (with its ``nnx.BatchStat`` ``mean``/``var``): same
constructor arguments, same ``nnx.Param`` attributes (``scale``, ``bias``, shapes
``(D,)``), and the same dtype rule: input and params are first promoted together
with ``promote_dtype`` (to ``dtype`` when given), statistics are taken in float32,
and the result has the promoted dtype. ``nnx.update(jaxdnn_module,
nnx.state(stock_module))`` therefore loads stock weights unchanged.

Shapes: ``x`` is ``(..., D)`` with ``D = num_features``; LayerNorm and RMSNorm also take
other ``reduction_axes`` (as ``jaxdnn.flax.linen``'s do).

Options the kernels cannot serve raise a ``ValueError`` (at construction where
possible): feature axes that are not reduction axes, ``axis_name``/``axis_index_groups``, and
``mask``. ``use_fast_variance`` is accepted with either value (see
``jaxdnn.flax.linen``). Reverse-mode autodiff works; forward-mode ``jvp`` does not.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

try:
    from flax import nnx
    from flax.nnx.nn import dtypes as _nnx_dtypes
except ImportError as e:  # flax is an optional dependency of jaxdnn
    raise ImportError(
        "jaxdnn.flax.nnx needs Flax; install it with `pip install 'jaxdnn[flax]'`."
    ) from e

import jax
import jax.numpy as jnp

import jaxdnn
from jaxdnn.flax.linen import (_channel_axis, _check_batch_norm_options, _check_group_axes, _check_mask,
                               _check_options, _fit_param, _group_count, norm_axes)
from jaxdnn.flax.nnx_conv import Conv
from jaxdnn.flax.nnx_dense import Linear
from jaxdnn.norm import over_axes

__all__ = ["BatchNorm", "Conv", "GroupNorm", "LayerNorm", "Linear", "RMSNorm"]

Dtype = Any
Initializer = Any
Axes = Any


def _param(create: bool, init, rngs, shape, dtype, metadata):
    """An ``nnx.Param`` made by ``init``, as the stock modules make ``scale``/``bias``, or an empty
    slot (``nnx.data(None)``) when ``create`` is False."""
    return nnx.Param(init(rngs.params(), shape, dtype), **metadata) if create else nnx.data(None)


def _normalize(fn, module: str, x, params, *, reduction_axes, feature_axes,
               epsilon, mask):
    """Runs kernel ``fn`` on ``x`` and ``params``, already promoted by promote_dtype."""
    x = jnp.asarray(x)
    _check_mask(module, mask)
    if x.ndim == 0:
        raise ValueError(f"jaxdnn {module}: x must have at least one axis (the "
                         "feature axis D), got a scalar.")
    # The axes can only be checked against the rank now.
    reduction, features = norm_axes(module, reduction_axes, feature_axes, x.ndim)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"jaxdnn {module}: the input promotes to {x.dtype}; a real "
                         "floating dtype is needed.")
    # After Flax's promotion every param has x's dtype, which the kernel takes as
    # is; _fit_param only matters for a custom promote_dtype that leaves them apart.
    return over_axes(fn, x, *(_fit_param(p, x.dtype) for p in params), reduction=reduction, features=features,
                     epsilon=epsilon)


class LayerNorm(nnx.Module):
    """Layer normalization over the last axis (or ``reduction_axes``), on jaxdnn's fused kernel.

    Mirrors ``flax.nnx.LayerNorm``: ``y = (x - mean) / sqrt(var + epsilon) * scale
    + bias`` per row of ``x`` with shape ``(..., D)``, ``D = num_features``.

    Args:
      num_features: D, the size of the last axis.
      epsilon: added to the variance to avoid dividing by zero.
      dtype: the dtype of the computation's inputs and result (default: promoted
        from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      use_bias: if True, ``bias`` is added.
      use_scale: if True, the output is multiplied by ``scale``.
      bias_init: initializer for ``bias`` (default: zeros).
      scale_init: initializer for ``scale`` (default: ones).
      reduction_axes: the axes of the statistics (default: the last); axes that are
        not trailing cost a transpose of x and of y.
      feature_axes: the params' axes (default: the last); each must be a reduction axis.
      axis_name: must be None (no cross-device statistics).
      axis_index_groups: must be None.
      use_fast_variance: accepted, either value.
      promote_dtype: promotes ``(x, scale, bias)`` to a common dtype, as in Flax.
      rngs: an ``nnx.Rngs`` supplying the ``params`` stream.
      bias_metadata: metadata for the ``bias`` Param.
      scale_metadata: metadata for the ``scale`` Param.
    """

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: Initializer = nnx.initializers.zeros_init(),
        scale_init: Initializer = nnx.initializers.ones_init(),
        reduction_axes: Axes = -1,
        feature_axes: Axes = -1,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: Any = _nnx_dtypes.promote_dtype,
        rngs: nnx.Rngs,
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        scale_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        _check_options("flax.nnx.LayerNorm", reduction_axes=reduction_axes,
                       feature_axes=feature_axes, axis_name=axis_name,
                       axis_index_groups=axis_index_groups)
        feature_shape = (num_features,)
        self.scale = _param(use_scale, scale_init, rngs, feature_shape, param_dtype, scale_metadata)
        self.bias = _param(use_bias, bias_init, rngs, feature_shape, param_dtype, bias_metadata)

        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_bias = use_bias
        self.use_scale = use_scale
        self.reduction_axes = reduction_axes
        self.feature_axes = feature_axes
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype

    def __call__(self, x, *, mask: jax.Array | None = None):
        """Normalizes ``x`` of shape ``(..., D)`` over ``D``; returns the same shape."""
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        return _normalize(jaxdnn.layer_norm, "flax.nnx.LayerNorm", x, (scale, bias),
                          reduction_axes=self.reduction_axes,
                          feature_axes=self.feature_axes, epsilon=self.epsilon,
                          mask=mask)


class RMSNorm(nnx.Module):
    """RMS normalization over the last axis (or ``reduction_axes``), on jaxdnn's fused kernel.

    Mirrors ``flax.nnx.RMSNorm``: ``y = x / sqrt(mean(x**2) + epsilon) * scale`` per
    row of ``x`` with shape ``(..., D)``, ``D = num_features``.

    Args:
      num_features: D, the size of the last axis.
      epsilon: added to the mean square to avoid dividing by zero.
      dtype: the dtype of the computation's inputs and result (default: promoted
        from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      use_scale: if True, the output is multiplied by ``scale``.
      scale_init: initializer for ``scale`` (default: ones).
      reduction_axes: the axes of the statistics (default: the last); axes that are
        not trailing cost a transpose of x and of y.
      feature_axes: the params' axes (default: the last); each must be a reduction axis.
      axis_name: must be None (no cross-device statistics).
      axis_index_groups: must be None.
      use_fast_variance: accepted, either value.
      promote_dtype: promotes ``(x, scale)`` to a common dtype, as in Flax.
      rngs: an ``nnx.Rngs`` supplying the ``params`` stream.
      scale_metadata: metadata for the ``scale`` Param.
    """

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_scale: bool = True,
        scale_init: Initializer = nnx.initializers.ones,
        reduction_axes: Axes = -1,
        feature_axes: Axes = -1,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: Any = _nnx_dtypes.promote_dtype,
        rngs: nnx.Rngs,
        scale_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        _check_options("flax.nnx.RMSNorm", reduction_axes=reduction_axes,
                       feature_axes=feature_axes, axis_name=axis_name,
                       axis_index_groups=axis_index_groups)
        feature_shape = (num_features,)
        self.scale = _param(use_scale, scale_init, rngs, feature_shape, param_dtype, scale_metadata)

        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_scale = use_scale
        self.reduction_axes = reduction_axes
        self.feature_axes = feature_axes
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype

    def __call__(self, x, mask: jax.Array | None = None):
        """Normalizes ``x`` of shape ``(..., D)`` over ``D``; returns the same shape."""
        scale = self.scale[...] if self.scale is not None else None
        x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        return _normalize(jaxdnn.rms_norm, "flax.nnx.RMSNorm", x, (scale,),
                          reduction_axes=self.reduction_axes,
                          feature_axes=self.feature_axes, epsilon=self.epsilon,
                          mask=mask)


class BatchNorm(nnx.Module):
    """Batch normalization on jaxdnn's kernels, mirroring ``flax.nnx.BatchNorm``.

    ``x`` has ``num_features`` channels on ``axis``; statistics are over every other
    axis. ``scale``/``bias`` are ``nnx.Param``s and ``mean``/``var`` float32
    ``nnx.BatchStat``s, all of shape ``(num_features,)``. Without running averages
    the batch statistics normalize ``x`` and update ``mean``/``var`` as
    ``momentum * running + (1 - momentum) * batch``. ``axis_name`` and
    ``axis_index_groups`` must be None; ``use_fast_variance`` takes either value.
    """

    def __init__(
        self,
        num_features: int,
        *,
        use_running_average: bool | None = False,
        axis: int = -1,
        momentum: float = 0.99,
        epsilon: float = 1e-5,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: Initializer = nnx.initializers.zeros_init(),
        scale_init: Initializer = nnx.initializers.ones_init(),
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: Any = _nnx_dtypes.promote_dtype,
        rngs: nnx.Rngs,
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        scale_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        _check_batch_norm_options("flax.nnx.BatchNorm", axis_name=axis_name,
                                  axis_index_groups=axis_index_groups)
        feature_shape = (num_features,)
        self.mean = nnx.BatchStat(jnp.zeros(feature_shape, jnp.float32))
        self.var = nnx.BatchStat(jnp.ones(feature_shape, jnp.float32))
        self.scale = _param(use_scale, scale_init, rngs, feature_shape, param_dtype, scale_metadata)
        self.bias = _param(use_bias, bias_init, rngs, feature_shape, param_dtype, bias_metadata)
        self.num_features = num_features
        self.use_running_average = use_running_average
        self.axis = axis
        self.momentum = momentum
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_bias = use_bias
        self.use_scale = use_scale
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype

    def __call__(self, x, use_running_average: bool | None = None, *, mask: jax.Array | None = None):
        """Normalizes ``x``; returns an array of its shape."""
        module = "flax.nnx.BatchNorm"
        if use_running_average is None:
            use_running_average = self.use_running_average
        if use_running_average is None:
            raise ValueError(f"jaxdnn {module}: pass use_running_average to the constructor or the call.")
        _check_mask(module, mask)
        axis = _channel_axis(module, self.axis, jnp.ndim(x))
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"jaxdnn {module}: the input promotes to {x.dtype}; a real floating dtype "
                             "is needed.")
        y, mean, var = jaxdnn.batch_norm(
            x, *(_fit_param(p, x.dtype) for p in (scale, bias)), self.mean[...], self.var[...],
            training=not use_running_average, momentum=self.momentum, epsilon=self.epsilon, axis=axis)
        if not use_running_average:
            self.mean[...] = mean
            self.var[...] = var
        return y


class GroupNorm(nnx.Module):
    """Group normalization, channels last, on jaxdnn's fused kernel.

    Mirrors ``flax.nnx.GroupNorm``: ``x`` of shape ``(N, ..., C)``, ``C = num_features``,
    is normalized per sample and group of ``C / G`` channels over every other axis, then
    scaled and shifted per channel.

    Args:
      num_features: C, the size of the last axis.
      num_groups: G, the number of channel groups (default 32); None to use group_size.
      group_size: channels per group (with ``num_groups=None``).
      epsilon: added to the variance to avoid dividing by zero.
      dtype: the dtype of the computation's inputs and result (default: promoted
        from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      use_bias: if True, ``bias`` is added.
      use_scale: if True, the output is multiplied by ``scale``.
      bias_init: initializer for ``bias`` (default: zeros).
      scale_init: initializer for ``scale`` (default: ones).
      reduction_axes: None or every axis but the first.
      axis_name: must be None (no cross-device statistics).
      axis_index_groups: must be None.
      use_fast_variance: accepted, either value.
      promote_dtype: promotes ``(x, scale, bias)`` to a common dtype, as in Flax.
      rngs: an ``nnx.Rngs`` supplying the ``params`` stream.
      bias_metadata: metadata for the ``bias`` Param.
      scale_metadata: metadata for the ``scale`` Param.
    """

    def __init__(
        self,
        num_features: int,
        num_groups: int | None = 32,
        group_size: int | None = None,
        *,
        epsilon: float = 1e-6,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: Initializer = nnx.initializers.zeros_init(),
        scale_init: Initializer = nnx.initializers.ones_init(),
        reduction_axes: Axes | None = None,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: Any = _nnx_dtypes.promote_dtype,
        rngs: nnx.Rngs,
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        scale_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        _check_options("flax.nnx.GroupNorm", axis_name=axis_name,
                       axis_index_groups=axis_index_groups)
        self.num_groups = _group_count("flax.nnx.GroupNorm", num_groups, group_size, num_features)
        self.group_size = num_features // self.num_groups
        feature_shape = (num_features,)
        self.scale = _param(use_scale, scale_init, rngs, feature_shape, param_dtype, scale_metadata)
        self.bias = _param(use_bias, bias_init, rngs, feature_shape, param_dtype, bias_metadata)

        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_bias = use_bias
        self.use_scale = use_scale
        self.reduction_axes = reduction_axes
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype

    def __call__(self, x, *, mask: jax.Array | None = None):
        """Normalizes ``x`` of shape ``(N, ..., C)``; returns the same shape."""
        module = "flax.nnx.GroupNorm"
        _check_mask(module, mask)
        _check_group_axes(module, self.reduction_axes, jnp.ndim(x))
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"jaxdnn {module}: the input promotes to {x.dtype}; a real "
                             "floating dtype is needed.")
        return jaxdnn.group_norm(x, self.num_groups, *(_fit_param(p, x.dtype) for p in (scale, bias)),
                                 epsilon=self.epsilon)
