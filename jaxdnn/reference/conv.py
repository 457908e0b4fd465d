"""Reference convolution: `lax.conv_general_dilated` computed in float32 (float64 for float64
operands, the tests' oracle), the result in the operands' dtype. The same arguments as
`jaxdnn.conv_general_dilated`; gradients are JAX's own."""

import jax.numpy as jnp
from jax import lax


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count=1, batch_group_count=1, precision=None,
                         preferred_element_type=None):
    """lax.conv_general_dilated with float32 accumulation (precision HIGHEST), in lhs's dtype."""
    del precision, preferred_element_type  # always the most precise product, in the operands' dtype
    compute = jnp.promote_types(lhs.dtype, jnp.float32)
    y = lax.conv_general_dilated(
        lhs.astype(compute), rhs.astype(compute), window_strides, padding, lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count, batch_group_count=batch_group_count,
        precision=lax.Precision.HIGHEST)
    return y.astype(lhs.dtype)
