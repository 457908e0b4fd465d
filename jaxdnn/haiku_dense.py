"""Haiku ``Linear`` over ``jaxdnn.dense`` (re-exported by ``jaxdnn.haiku``).

A subclass of ``hk.Linear``: the same constructor (plus the keyword ``activation``, None or a name
of ``jaxdnn.activation.EPILOGUES``, fused into the kernel's epilogue), module name (``linear``) and
params ``w`` ``(C, K)`` and ``b`` ``(K,)`` created in the input's dtype, so params made with stock
Haiku load unchanged. Only ``__call__`` differs: act(inputs @ w + b) in one GEMM kernel call.

Shapes: inputs ``(..., C)`` -> ``(..., K)``. ``precision`` is ``jaxdnn.dense``'s (float32 operands as
TF32 on a GPU unless it asks for HIGHEST, as stock ``Linear`` under XLA). Reverse-mode autodiff works
to any order; ``jvp`` does not.
"""

from __future__ import annotations

import haiku as hk
import jax.numpy as jnp
import numpy as np

import jaxdnn

__all__ = ["Linear"]


class Linear(hk.Linear):
    """``hk.Linear`` (same constructor, module and param names) on ``jaxdnn.dense``."""

    def __init__(self, output_size, with_bias=True, w_init=None, b_init=None, name=None, *, activation=None):
        """As ``hk.Linear``, plus ``activation`` (None or an epilogue name, e.g. "gelu")."""
        super().__init__(output_size, with_bias=with_bias, w_init=w_init, b_init=b_init, name=name)
        self.activation = activation

    def __call__(self, inputs, *, precision=None):
        """inputs (..., C) -> act(inputs @ w + b), (..., K)."""
        inputs = jnp.asarray(inputs)
        if not inputs.shape:
            raise ValueError("jaxdnn haiku Linear: inputs must not be a scalar (shape (..., C))")
        self.input_size = inputs.shape[-1]
        # Haiku's default: a truncated normal with stddev 1 / sqrt(fan_in).
        w_init = self.w_init or hk.initializers.TruncatedNormal(stddev=1.0 / np.sqrt(self.input_size))
        w = hk.get_parameter("w", [self.input_size, self.output_size], inputs.dtype, init=w_init)
        b = (hk.get_parameter("b", [self.output_size], inputs.dtype, init=self.b_init) if self.with_bias
             else None)
        return jaxdnn.dense(inputs, w, b, activation=self.activation, precision=precision)
