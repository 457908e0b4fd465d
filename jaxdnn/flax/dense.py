"""Flax linen ``Dense`` over ``jaxdnn.dense``.

``Dense`` subclasses ``flax.linen.Dense``, so it has the stock attributes, defaults and
initializers and creates the same params (``kernel`` ``(C, K)``, ``bias`` ``(K,)``, in
``param_dtype``): a params tree made with stock Flax loads unchanged and vice versa. Only
``__call__`` differs: the matrix product, bias and (optionally) activation run as one GEMM kernel
call, on float32, bfloat16 or float16 after Flax's dtype promotion.

Shapes: inputs ``(..., C)`` -> ``(..., K)``.

One attribute is added: ``activation`` (None, or a name of ``jaxdnn.activation.EPILOGUES`` such as
"relu" or "gelu"), fused into the kernel's epilogue; with None the module computes what stock
``Dense`` does. ``dot_general``/``dot_general_cls`` must be None (a ``ValueError`` otherwise: the
module always runs jaxdnn's kernel); ``precision`` is ``jaxdnn.dense``'s (float32 operands as TF32 on
a GPU unless it asks for HIGHEST, as stock ``Dense`` under XLA).
Reverse-mode autodiff works to any order; forward-mode ``jvp`` does not (custom_vjp).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

import jaxdnn

__all__ = ["Dense"]


class Dense(nn.Dense):
    """``flax.linen.Dense`` (same attributes and params) computing on ``jaxdnn.dense``.

    Attributes: those of ``flax.linen.Dense`` (features K, use_bias, dtype, param_dtype, precision,
    kernel_init, bias_init, promote_dtype), and ``activation`` (None or an epilogue name).
    """

    activation: str | None = None

    @nn.compact
    def __call__(self, inputs):
        """inputs (..., C) -> act(inputs @ kernel + bias), (..., K)."""
        if self.dot_general is not None or self.dot_general_cls is not None:
            raise ValueError("jaxdnn flax.linen.Dense: dot_general / dot_general_cls must be None (this "
                             "module always runs jaxdnn.dense)")
        inputs = jnp.asarray(inputs)
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features),
                            self.param_dtype)
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias
                else None)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        return jaxdnn.dense(inputs, kernel, bias, activation=self.activation, precision=self.precision)
