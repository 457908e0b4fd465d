"""Flax linen convolution modules over ``jaxdnn.conv_general_dilated`` / ``jaxdnn.conv_transpose``.

``Conv`` and ``ConvTranspose`` subclass ``flax.linen.Conv`` / ``flax.linen.ConvTranspose``, so they
have exactly the stock attributes, defaults and initializers, and create the same params
(``kernel`` ``(*window, C / feature_group_count, K)``, ``bias`` ``(K,)``, in ``param_dtype``):
a params tree made with stock Flax loads unchanged and vice versa. Only ``__call__`` differs: the
convolution runs on jaxdnn's kernels (float32, bfloat16 or float16 after Flax's dtype promotion),
and the bias is added after it.

Shapes: inputs ``(*batch, *spatial, C)`` channels last (1 to 3 spatial axes; several leading batch
axes are flattened into one and restored, no batch axis means a batch of one) -> ``(*batch,
*out_spatial, K)``.

Padding: "SAME", "VALID", ints, (low, high) pairs, and for ``Conv`` also "CIRCULAR", "REFLECT"
(the input is padded with ``jnp.pad`` first, as Flax does) and "CAUSAL" (1-D only).
``ConvTranspose`` with "CIRCULAR" padding raises ``ValueError``, as do the deprecated
``conv_general_dilated``/``conv_general_dilated_cls`` overrides. ``precision`` is
``jaxdnn.conv_general_dilated``'s (float32 as TF32 on a GPU unless HIGHEST, as Flax's stock modules
on XLA). Reverse-mode autodiff works to any order; forward-mode ``jvp`` does not (custom_vjp).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp
from flax.linen.linear import canonicalize_padding

import jaxdnn

__all__ = ["Conv", "ConvTranspose"]

# Flax's layouts, channels last: jaxdnn's kernels run them without transposes.
_LAYOUTS = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC"), 3: ("NDHWC", "DHWIO", "NDHWC")}


def _per_axis(value: None | int | Sequence[int], spatial: int) -> tuple[int, ...]:
    """An int (or None, Flax's old spelling of 1) repeated per spatial axis, or the sequence as is."""
    if value is None:
        value = 1
    return (value,) * spatial if isinstance(value, int) else tuple(value)


def _window(kernel_size: int | Sequence[int]) -> tuple[int, ...]:
    return (kernel_size,) if isinstance(kernel_size, int) else tuple(kernel_size)


def _flatten_batch(module: str, inputs, spatial: int):
    """inputs (*batch, *spatial, C) as (N, *spatial, C), and the function that restores *batch."""
    inputs = jnp.asarray(inputs)
    if inputs.ndim < spatial + 1:
        raise ValueError(f"jaxdnn {module}: inputs must have shape (*batch, *spatial, C) with {spatial} "
                         f"spatial axes (the kernel_size's length), got shape {inputs.shape}")
    batch = inputs.shape[:inputs.ndim - spatial - 1]
    if len(batch) == 1:
        return inputs, lambda y: y
    flat = inputs.reshape((-1,) + inputs.shape[len(batch):])
    return flat, lambda y: y.reshape(batch + y.shape[1:])


def _pad_input(module: str, inputs, padding, window, kernel_dilation):
    """Flax's non-lax paddings done on the input (then convolved with "VALID"): "CIRCULAR" wraps
    and "REFLECT" mirrors, centred on the dilated window; "CAUSAL" left-pads a 1-D axis."""
    dilated = [(k - 1) * d + 1 for k, d in zip(window, kernel_dilation)]
    if padding == "CAUSAL":
        if len(window) != 1:
            raise ValueError(f"jaxdnn {module}: padding='CAUSAL' is only defined for 1-D convolutions, "
                             f"got kernel_size {window}")
        pads = [(dilated[0] - 1, 0)]
        mode = "constant"
    else:
        pads = [((k - 1) // 2, k // 2) for k in dilated]
        mode = {"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding]
    return jnp.pad(inputs, [(0, 0)] + pads + [(0, 0)], mode=mode)


def _add_bias(y, bias):
    return y if bias is None else y + bias.reshape((1,) * (y.ndim - 1) + (-1,))


def conv_input(module: str, inputs, window, padding, kernel_dilation):
    """The input of a Flax-style Conv as the kernels take it: (inputs (N, *spatial, C), its lax
    padding, the function restoring the caller's batch axes on the output). Shared with the NNX Conv."""
    inputs, restore = _flatten_batch(module, inputs, len(window))
    padding = canonicalize_padding(padding, len(window))
    if padding in ("CIRCULAR", "REFLECT", "CAUSAL"):
        inputs = _pad_input(module, inputs, padding, window, kernel_dilation)
        padding = "VALID"
    return inputs, padding, restore


def check_kernel(module: str, inputs, groups: int, kernel_shape, mask) -> None:
    """ValueError unless G divides C and the mask (if any) has the kernel's shape."""
    if groups < 1 or inputs.shape[-1] % groups:
        raise ValueError(f"jaxdnn {module}: feature_group_count ({groups}) must divide the input features "
                         f"C = {inputs.shape[-1]} (inputs shape {inputs.shape})")
    if mask is not None and mask.shape != tuple(kernel_shape):
        raise ValueError(f"jaxdnn {module}: mask must have the kernel's shape {tuple(kernel_shape)}, got "
                         f"{mask.shape}")


def conv_with_bias(inputs, kernel, bias, strides, padding, input_dilation, kernel_dilation, groups,
                   precision, preferred_element_type=None):
    """jaxdnn.conv_general_dilated on inputs (N, *spatial, C) and kernel (*window, C/G, K), + bias (K,)."""
    y = jaxdnn.conv_general_dilated(inputs, kernel, strides, padding, lhs_dilation=input_dilation,
                                    rhs_dilation=kernel_dilation, dimension_numbers=_LAYOUTS[kernel.ndim - 2],
                                    feature_group_count=groups, precision=precision,
                                    preferred_element_type=preferred_element_type)
    return _add_bias(y, bias)


def _kernel_and_bias(module, kernel_shape):
    """A linen conv module's params, as flax declares them: the kernel (masked by `mask`) and the
    bias [K] (None without `use_bias`)."""
    kernel = module.param("kernel", module.kernel_init, kernel_shape, module.param_dtype)
    if module.mask is not None:
        kernel = kernel * module.mask
    bias = (module.param("bias", module.bias_init, (module.features,), module.param_dtype)
            if module.use_bias else None)
    return kernel, bias


class Conv(nn.Conv):
    """``flax.linen.Conv`` (same attributes and params) computing on ``jaxdnn.conv_general_dilated``.

    Attributes: those of ``flax.linen.Conv`` (features K, kernel_size, strides, padding,
    input_dilation, kernel_dilation, feature_group_count G, use_bias, mask, dtype, param_dtype,
    precision, kernel_init, bias_init, promote_dtype).
    """

    @nn.compact
    def __call__(self, inputs):
        """inputs (*batch, *spatial, C) -> (*batch, *out_spatial, K); C must be divisible by G."""
        if self.conv_general_dilated is not None or self.conv_general_dilated_cls is not None:
            raise ValueError("jaxdnn flax.linen.Conv: conv_general_dilated / conv_general_dilated_cls "
                             "must be None (this module always runs jaxdnn.conv_general_dilated)")
        window = _window(self.kernel_size)
        spatial = len(window)
        kernel_dilation = _per_axis(self.kernel_dilation, spatial)
        inputs, padding, restore = conv_input("flax.linen.Conv", inputs, window, self.padding,
                                              kernel_dilation)
        groups = self.feature_group_count
        kernel_shape = window + (inputs.shape[-1] // max(groups, 1), self.features)
        check_kernel("flax.linen.Conv", inputs, groups, kernel_shape, self.mask)
        kernel, bias = _kernel_and_bias(self, kernel_shape)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        y = conv_with_bias(inputs, kernel, bias, _per_axis(self.strides, spatial), padding,
                           _per_axis(self.input_dilation, spatial), kernel_dilation, groups, self.precision)
        return restore(y)


class ConvTranspose(nn.ConvTranspose):
    """``flax.linen.ConvTranspose`` (same attributes and params) computing on ``jaxdnn.conv_transpose``.

    Attributes: those of ``flax.linen.ConvTranspose`` (features K, kernel_size, strides, padding,
    kernel_dilation, use_bias, mask, dtype, param_dtype, precision, kernel_init,
    bias_init, transpose_kernel, promote_dtype, preferred_element_type (None or a float type at
    least as wide as the computation dtype)). padding="CIRCULAR" is not supported.
    """

    @nn.compact
    def __call__(self, inputs):
        """inputs (*batch, *spatial, C) -> (*batch, *out_spatial, K)."""
        window = _window(self.kernel_size)
        spatial = len(window)
        padding = canonicalize_padding(self.padding, spatial)
        if padding == "CIRCULAR":
            raise ValueError("jaxdnn flax.linen.ConvTranspose: padding='CIRCULAR' is not supported; use "
                             "'SAME', 'VALID' or (low, high) pairs")
        inputs, restore = _flatten_batch("flax.linen.ConvTranspose", inputs, spatial)
        strides = _per_axis(self.strides, spatial)
        kernel_dilation = _per_axis(self.kernel_dilation, spatial)
        in_features = inputs.shape[-1]
        kernel_shape = window + ((self.features, in_features) if self.transpose_kernel
                                 else (in_features, self.features))
        check_kernel("flax.linen.ConvTranspose", inputs, 1, kernel_shape, self.mask)
        kernel, bias = _kernel_and_bias(self, kernel_shape)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        y = jaxdnn.conv_transpose(inputs, kernel, strides, padding, rhs_dilation=kernel_dilation,
                                  transpose_kernel=self.transpose_kernel, precision=self.precision,
                                  preferred_element_type=self.preferred_element_type)
        return restore(_add_bias(y, bias))
