"""Reference dense layer: act(x @ w + bias) computed in float32 (float64 for float64 inputs, the
tests' oracle), rounded once to x's dtype. The same arguments as `jaxdnn.dense`; gradients are JAX's
own."""

import jax.numpy as jnp
from jax import lax


def dense(x, w, bias=None, *, activation=None):
    """jaxdnn.dense's math: x [..., K] @ w [K, N] (+ bias [N]), then the activation, in x's dtype."""
    from jaxdnn.activation import epilogue  # the `activation=` names (imported here: no import cycle)
    from jaxdnn.reference.activation import FUNCTIONS

    kind, param = epilogue("dense", activation)
    compute = jnp.promote_types(x.dtype, jnp.float32)
    z = jnp.matmul(x.astype(compute), w.astype(compute), precision=lax.Precision.HIGHEST)
    if bias is not None:
        z = z + bias.astype(compute)
    return FUNCTIONS[kind](z, param).astype(x.dtype)
