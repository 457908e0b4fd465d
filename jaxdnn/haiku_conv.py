"""Haiku convolution modules over ``jaxdnn.conv_general_dilated``.

``ConvND`` subclasses ``hk.ConvND``, and ``Conv1D``/``Conv2D``/``Conv3D`` are it with 1/2/3 spatial
axes, as in Haiku. They keep Haiku's constructor (and so its argument handling: ints or per-axis
sequences, "SAME"/"VALID", (low, high) pairs or ``hk.pad`` functions, ``data_format``) and its
names: the module ``conv2_d`` (``conv1_d``, ``conv3_d``, ``conv_nd``)
holds ``w`` ``(*window, C / feature_group_count, K)`` and ``b`` (``(K,)`` channels last,
``(K, 1, ..., 1)`` channels first), created in the input's dtype, so params made with stock Haiku
load unchanged. Only ``__call__`` differs: the convolution runs on jaxdnn's kernels (float32,
bfloat16 or float16). Channels-first layouts (NCHW) are transposed to channels last around the
kernels by ``jaxdnn.conv_general_dilated``.

Shapes: inputs ``(N, *spatial, C)`` (or ``(N, C, *spatial)`` channels first), or without ``N`` for
a single example -> the same layout with ``K`` output channels. ``precision`` is
``jaxdnn.conv_general_dilated``'s (float32 as TF32 on a GPU unless HIGHEST, as ``hk.ConvND`` on
XLA). Reverse-mode autodiff works to any order; ``jvp`` does not.
"""

from __future__ import annotations

import haiku as hk
import jax.numpy as jnp
import numpy as np

import jaxdnn

__all__ = ["Conv1D", "Conv2D", "Conv3D", "ConvND"]


class ConvND(hk.ConvND):
    """``hk.ConvND`` (same constructor, module and param names) on ``jaxdnn.conv_general_dilated``."""

    def __call__(self, inputs, *, precision=None):
        """inputs ``(N, *spatial, C)`` (``(N, C, *spatial)`` channels first), or without ``N`` for one
        example -> the same layout with ``output_channels`` K channels."""
        inputs = jnp.asarray(inputs)
        module = f"jaxdnn haiku {type(self).__name__}"
        rank = self.num_spatial_dims + 1
        if inputs.ndim not in (rank, rank + 1):
            raise ValueError(f"{module}: inputs must have rank {rank} (unbatched) or {rank + 1}, got "
                             f"shape {inputs.shape}")
        unbatched = inputs.ndim == rank
        if unbatched:
            inputs = inputs[None]
        channels = inputs.shape[self.channel_index]
        groups = self.feature_group_count
        if groups < 1 or channels % groups:
            raise ValueError(f"{module}: feature_group_count ({groups}) must divide the input channels "
                             f"C = {channels} (inputs shape {inputs.shape})")
        w_shape = self.kernel_shape + (channels // groups, self.output_channels)
        if self.mask is not None and self.mask.shape != w_shape:
            raise ValueError(f"{module}: mask must have the weights' shape {w_shape}, got {self.mask.shape}")
        # Haiku's default: a truncated normal with stddev 1 / sqrt(fan_in).
        w_init = self.w_init or hk.initializers.TruncatedNormal(stddev=1.0 / np.sqrt(np.prod(w_shape[:-1])))
        w = hk.get_parameter("w", w_shape, inputs.dtype, init=w_init)
        if self.mask is not None:
            w = w * self.mask
        out = jaxdnn.conv_general_dilated(
            inputs, w, self.stride, self.padding, lhs_dilation=self.lhs_dilation,
            rhs_dilation=self.kernel_dilation, dimension_numbers=self.dimension_numbers,
            feature_group_count=groups, precision=precision)
        if self.with_bias:
            channels_last = self.channel_index == -1
            b_shape = (self.output_channels,) + (() if channels_last else (1,) * self.num_spatial_dims)
            out = out + hk.get_parameter("b", b_shape, inputs.dtype, init=self.b_init)
        return out[0] if unbatched else out


class Conv1D(ConvND):
    """``hk.Conv1D`` (same constructor, module and param names) on ``jaxdnn.conv_general_dilated``."""

    def __init__(self, output_channels, kernel_shape, stride=1, rate=1, padding="SAME", with_bias=True,
                 w_init=None, b_init=None, data_format="NWC", mask=None, feature_group_count=1, name=None):
        """As ``hk.Conv1D``: ``data_format`` is "NWC" (default) or "NCW"."""
        super().__init__(num_spatial_dims=1, output_channels=output_channels, kernel_shape=kernel_shape,
                         stride=stride, rate=rate, padding=padding, with_bias=with_bias, w_init=w_init,
                         b_init=b_init, data_format=data_format, mask=mask,
                         feature_group_count=feature_group_count, name=name)


class Conv2D(ConvND):
    """``hk.Conv2D`` (same constructor, module and param names) on ``jaxdnn.conv_general_dilated``."""

    def __init__(self, output_channels, kernel_shape, stride=1, rate=1, padding="SAME", with_bias=True,
                 w_init=None, b_init=None, data_format="NHWC", mask=None, feature_group_count=1, name=None):
        """As ``hk.Conv2D``: ``data_format`` is "NHWC" (default) or "NCHW"."""
        super().__init__(num_spatial_dims=2, output_channels=output_channels, kernel_shape=kernel_shape,
                         stride=stride, rate=rate, padding=padding, with_bias=with_bias, w_init=w_init,
                         b_init=b_init, data_format=data_format, mask=mask,
                         feature_group_count=feature_group_count, name=name)


class Conv3D(ConvND):
    """``hk.Conv3D`` (same constructor, module and param names) on ``jaxdnn.conv_general_dilated``."""

    def __init__(self, output_channels, kernel_shape, stride=1, rate=1, padding="SAME", with_bias=True,
                 w_init=None, b_init=None, data_format="NDHWC", mask=None, feature_group_count=1, name=None):
        """As ``hk.Conv3D``: ``data_format`` is "NDHWC" (default) or "NCDHW"."""
        super().__init__(num_spatial_dims=3, output_channels=output_channels, kernel_shape=kernel_shape,
                         stride=stride, rate=rate, padding=padding, with_bias=with_bias, w_init=w_init,
                         b_init=b_init, data_format=data_format, mask=mask,
                         feature_group_count=feature_group_count, name=name)
