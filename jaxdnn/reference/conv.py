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


def conv(x, w, bias=None, *, activation=None, residual=None, strides=1, padding="SAME", dilation=1,
         groups=1):
    """jaxdnn.conv's math: act(conv(x, w) + bias + residual), channels last, computed in float32
    (float64 for float64 inputs) and rounded once to x's dtype."""
    from jaxdnn.activation import epilogue  # the `activation=` names (imported here: no import cycle)
    from jaxdnn.reference.activation import activation_fwd

    kind, param = epilogue("conv", activation)
    spatial = x.ndim - 2
    strides = (strides,) * spatial if isinstance(strides, int) else tuple(strides)
    dilation = (dilation,) * spatial if isinstance(dilation, int) else tuple(dilation)
    layout = "N" + "DHW"[3 - spatial:] + "C"
    compute = jnp.promote_types(x.dtype, jnp.float32)
    numbers = (layout, layout[1:-1] + "IO", layout)
    z = lax.conv_general_dilated(x.astype(compute), w.astype(compute), strides, padding,
                                 rhs_dilation=dilation, dimension_numbers=numbers, feature_group_count=groups,
                                 precision=lax.Precision.HIGHEST)
    if bias is not None:
        z = z + bias.astype(compute)
    if residual is not None:
        z = z + residual.astype(compute)
    return activation_fwd(z, kind, param).astype(x.dtype)
