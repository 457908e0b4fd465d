"""Flax NNX ``Linear`` over ``jaxdnn.dense`` (re-exported by ``jaxdnn.flax.nnx``).

A subclass of ``flax.nnx.Linear``: the same constructor (plus the keyword ``activation``, None or a
name of ``jaxdnn.activation.EPILOGUES``, fused into the kernel's epilogue), the same ``nnx.Param``
attributes ``kernel`` ``(C, K)`` and ``bias`` ``(K,)``, so ``nnx.update(jaxdnn_linear,
nnx.state(stock_linear))`` loads stock weights. Only ``__call__`` differs: one GEMM kernel call.
Kept out of ``jaxdnn.flax.dense`` because ``flax.nnx`` is imported only on demand.

``dot_general`` must be left at its default (``lax.dot_general``) and ``out_sharding`` None (each a
``ValueError`` otherwise); ``precision`` and ``preferred_element_type`` are ``jaxdnn.dense``'s
(float32 operands as TF32 on a GPU unless it asks for HIGHEST, as stock ``Linear`` under XLA; a
preferred type at least as wide as the computation dtype). Reverse-mode autodiff works to any
order; forward-mode ``jvp`` does not.
"""

from __future__ import annotations

from flax import nnx
from jax import lax

import jaxdnn

__all__ = ["Linear"]


class Linear(nnx.Linear):
    """``flax.nnx.Linear`` (same constructor and params) computing on ``jaxdnn.dense``."""

    def __init__(self, in_features: int, out_features: int, *, activation: str | None = None, **kwargs):
        """As ``flax.nnx.Linear``, plus ``activation`` (None or an epilogue name, e.g. "gelu")."""
        super().__init__(in_features, out_features, **kwargs)
        self.activation = activation

    def __call__(self, inputs, out_sharding=None):
        """inputs (..., C) with C = in_features -> act(inputs @ kernel + bias), (..., K)."""
        module = "jaxdnn flax.nnx.Linear"
        if self.dot_general is not lax.dot_general:
            raise ValueError(f"{module}: dot_general must be left at its default (this module always runs "
                             "jaxdnn.dense)")
        if out_sharding is not None:
            raise ValueError(f"{module}: out_sharding must be None (the output follows the input's row "
                             "sharding)")
        if inputs.shape[-1:] != (self.in_features,):
            raise ValueError(f"{module}: inputs must have {self.in_features} features (in_features), got "
                             f"shape {inputs.shape}")
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        return jaxdnn.dense(inputs, kernel, bias, activation=self.activation, precision=self.precision,
                            preferred_element_type=self.preferred_element_type)
