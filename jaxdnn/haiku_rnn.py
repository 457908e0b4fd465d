"""Haiku parameters for jaxdnn's fused recurrences (re-exported by ``jaxdnn.haiku``).

``hk.LSTM`` converts exactly: ``lstm_weights_from_haiku`` turns the ``linear`` params of
``hk.LSTM`` modules (one per pseudo-layer, cuDNN's order: layer 0 forward, layer 0 reverse, ...)
into the flat vector of ``jaxdnn.lstm``. ``hk.GRU`` has no converter: it applies the reset gate
before the recurrent product (r * h) W, which cuDNN's GRU formulation, r * (h W), cannot express.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp

from jaxdnn.reference import rnn as _ref


def lstm_weights_from_haiku(linears: Sequence[Mapping[str, Any]], input_size: int) -> jax.Array:
    """The flat weights of ``jaxdnn.lstm`` from each ``hk.LSTM``'s ``linear`` params: w [F + H, 4H]
    over the concatenated (input, hidden), b [4H], gate columns (i, g, f, o), and 1 added to the
    forget gate's pre-activation. F is `input_size` for the first layer, D H above it."""
    params = []
    for index, linear in enumerate(linears):
        w, b = jnp.asarray(linear["w"]), jnp.asarray(linear["b"])
        hidden = b.shape[0] // 4
        features = w.shape[0] - hidden
        if index == 0 and features != input_size:
            raise ValueError(f"lstm_weights_from_haiku: the first w has {features} input rows, "
                             f"input_size is {input_size}")
        i, g, f, o = jnp.split(w, 4, axis=1)
        b_i, b_g, b_f, b_o = jnp.split(b, 4)
        w = jnp.concatenate([i, f, g, o], axis=1).T  # cuDNN's gate rows (i, f, g, o)
        b_ih = jnp.concatenate([b_i, b_f + 1, b_g, b_o])
        params.append((w[:, :features], w[:, features:], b_ih, jnp.zeros_like(b_ih)))
    return _ref.pack_weights(params)
