"""Flax NNX ``Conv`` over ``jaxdnn.conv_general_dilated`` (re-exported by ``jaxdnn.flax.nnx``).

A subclass of ``flax.nnx.Conv``: the same constructor, the same ``nnx.Param`` attributes ``kernel``
``(*window, C / feature_group_count, K)`` and ``bias`` ``(K,)``, so ``nnx.update(jaxdnn_conv,
nnx.state(stock_conv))`` loads stock weights. Only ``__call__`` differs; it shares the linen
module's input handling (batch flattening, "CIRCULAR"/"REFLECT"/"CAUSAL" padding) from
``jaxdnn.flax.conv``. Kept out of that file because ``flax.nnx`` is imported only on demand.

``conv_general_dilated`` must be left at its default (or be ``jaxdnn.conv_general_dilated``), and
``out_sharding`` None; ``precision`` and ``preferred_element_type`` are
``jaxdnn.conv_general_dilated``'s (float32 as TF32 on a GPU unless HIGHEST; a preferred type at least
as wide as the computation dtype).
"""

from __future__ import annotations

from flax import nnx
from jax import lax

import jaxdnn
from jaxdnn.flax.conv import _per_axis, check_kernel, conv_input, conv_with_bias

__all__ = ["Conv"]


class Conv(nnx.Conv):
    """``flax.nnx.Conv`` (same constructor and params) computing on ``jaxdnn.conv_general_dilated``."""

    def __call__(self, inputs, out_sharding=None):
        """inputs (*batch, *spatial, C) with C = in_features -> (*batch, *out_spatial, K)."""
        module = "flax.nnx.Conv"
        if self.conv_general_dilated not in (lax.conv_general_dilated, jaxdnn.conv_general_dilated):
            raise ValueError(f"jaxdnn {module}: conv_general_dilated must be left at its default (this "
                             "module always runs jaxdnn.conv_general_dilated)")
        if out_sharding is not None:
            raise ValueError(f"jaxdnn {module}: out_sharding must be None (the output follows the "
                             "input's batch sharding)")
        window = self.kernel_size
        spatial = len(window)
        kernel_dilation = _per_axis(self.kernel_dilation, spatial)
        inputs, padding, restore = conv_input(module, inputs, window, self.padding, kernel_dilation)
        if inputs.shape[-1] != self.in_features:
            raise ValueError(f"jaxdnn {module}: inputs have {inputs.shape[-1]} features, the module was "
                             f"built with in_features={self.in_features}")
        check_kernel(module, inputs, self.feature_group_count, self.kernel_shape, self.mask)
        kernel = self.kernel[...]
        if self.mask is not None:
            kernel = kernel * self.mask
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        y = conv_with_bias(inputs, kernel, bias, _per_axis(self.strides, spatial), padding,
                           _per_axis(self.input_dilation, spatial), kernel_dilation, self.feature_group_count,
                           self.precision, self.preferred_element_type)
        return restore(y)
