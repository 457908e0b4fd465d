"""Flax linen layers over whole sequences on jaxdnn's fused recurrences, and converters from the
parameters of Flax's step cells to cuDNN's flat weight vector that ``jaxdnn.lstm``/``jaxdnn.gru``/
``jaxdnn.rnn`` take.

    from jaxdnn.flax import LSTM, GRU, SimpleRNN
    from jaxdnn.flax import lstm_weights_from_flax, gru_weights_from_flax, simple_rnn_weights_from_flax

Pseudo-layers (the converters' ``cells`` lists) are ordered as cuDNN's: layer 0 forward, layer 0
reverse (bidirectional), layer 1 forward, ...
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import rnn as jax_rnn

import jaxdnn
from jaxdnn.reference import rnn as _ref


def _kernels(cell: Mapping[str, Any], names: Sequence[str]) -> jax.Array:
    """[G, F]: the named Dense kernels ([F, H] each) of a Flax cell, transposed and stacked by gate."""
    return jnp.concatenate([jnp.asarray(cell[n]["kernel"]).T for n in names])


def lstm_weights_from_flax(cells: Sequence[Mapping[str, Any]]) -> jax.Array:
    """The flat weights of ``jaxdnn.lstm`` from the ``params`` of ``flax.linen.LSTMCell`` or
    ``OptimizedLSTMCell`` (one per pseudo-layer): kernels ``ii``/``if``/``ig``/``io`` [F, H] (no
    bias) and ``hi``/``hf``/``hg``/``ho`` [H, H] with biases [H]. Flax's cell computes cuDNN's gates
    (i, f, g, o) with b_ih = 0, so the result gives the cell's outputs."""
    params = []
    for cell in cells:
        b_hh = jnp.concatenate([jnp.asarray(cell[f"h{g}"]["bias"]) for g in "ifgo"])
        params.append((_kernels(cell, [f"i{g}" for g in "ifgo"]), _kernels(cell, [f"h{g}" for g in "ifgo"]),
                       jnp.zeros_like(b_hh), b_hh))
    return _ref.pack_weights(params)


def gru_weights_from_flax(cells: Sequence[Mapping[str, Any]]) -> jax.Array:
    """The flat weights of ``jaxdnn.gru`` from the ``params`` of ``flax.linen.GRUCell`` (one per
    pseudo-layer): input kernels ``ir``/``iz``/``in`` with biases, recurrent ``hr``/``hz`` without
    and ``hn`` with one. Flax's cell is cuDNN's GRU (the reset gate scales the recurrent product)
    with b_hr = b_hz = 0."""
    params = []
    for cell in cells:
        hidden = jnp.asarray(cell["hn"]["bias"]).shape[0]
        zero = jnp.zeros((hidden,), jnp.asarray(cell["hn"]["bias"]).dtype)
        params.append((_kernels(cell, ["ir", "iz", "in"]), _kernels(cell, ["hr", "hz", "hn"]),
                       jnp.concatenate([jnp.asarray(cell[n]["bias"]) for n in ("ir", "iz", "in")]),
                       jnp.concatenate([zero, zero, jnp.asarray(cell["hn"]["bias"])])))
    return _ref.pack_weights(params)


def simple_rnn_weights_from_flax(cells: Sequence[Mapping[str, Any]]) -> jax.Array:
    """The flat weights of ``jaxdnn.rnn`` from the ``params`` of ``flax.linen.SimpleCell`` (one per
    pseudo-layer, ``residual=False``): input kernel ``i`` [F, H] with its bias, recurrent kernel ``h``
    [H, H] without (b_hh = 0). The nonlinearity is the layer's: the cell's ``activation_fn`` must be
    tanh or relu, named in ``jaxdnn.rnn(..., nonlinearity=)``."""
    params = []
    for cell in cells:
        b_ih = jnp.asarray(cell["i"]["bias"])
        params.append((_kernels(cell, ["i"]), _kernels(cell, ["h"]), b_ih, jnp.zeros_like(b_ih)))
    return _ref.pack_weights(params)


def _uniform_init(hidden_size: int):
    """cuDNN's and PyTorch's: every weight and bias uniform in [-1/sqrt(H), 1/sqrt(H)]."""
    bound = 1.0 / hidden_size ** 0.5
    return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


class _Recurrent(nn.Module):
    """A multi-layer (bidirectional) recurrence over whole sequences; the subclasses name the mode."""
    hidden_size: int
    num_layers: int = 1
    bidirectional: bool = False
    dropout_rate: float = 0.0
    param_dtype: Any = jnp.float32
    mode = "lstm"

    @nn.compact
    def __call__(self, x, seq_lengths=None, initial_states=None, deterministic: bool = True):
        """x [B, T, I] (batch first) -> (y [B, T, D H], final states: (h_n, c_n) for the LSTM,
        h_n for the GRU and the plain RNN, each [L D, B, H]). seq_lengths [B] int32 (default: T for
        every row); initial_states as the final ones (default zeros). Dropout between layers when not
        `deterministic`, from the "dropout" PRNG stream. The parameter `weights` is cuDNN's flat
        vector (``jax.experimental.rnn``'s layout)."""
        batch, steps, inputs = x.shape
        sizes = (inputs, self.hidden_size, self.num_layers, self.bidirectional)
        if self.mode == "lstm":
            init = lambda key, shape, dtype: jax_rnn.init_lstm_weight(key, *sizes).astype(dtype)  # noqa: E731
        else:
            init = _uniform_init(self.hidden_size)
        weights = self.param("weights", init, (_ref.weight_count(self.mode, *sizes),), self.param_dtype)
        if seq_lengths is None:
            seq_lengths = jnp.full((batch,), steps, jnp.int32)
        state_shape = (self.num_layers * (2 if self.bidirectional else 1), batch, self.hidden_size)
        count = 2 if self.mode == "lstm" else 1
        if initial_states is None:
            initial_states = (jnp.zeros(state_shape, jnp.float32),) * count
        elif self.mode != "lstm":
            initial_states = (initial_states,)
        rate = 0.0 if deterministic else self.dropout_rate
        key = self.make_rng("dropout") if rate else None
        out = self.op(x, *initial_states, weights, seq_lengths, *sizes[:3], rate, self.bidirectional,
                      dropout_rng=key)
        return out[0], (tuple(out[1:]) if self.mode == "lstm" else out[1])

    def op(self, *args, **kwargs):
        """The functional op the layer runs (``jaxdnn.lstm``, ``gru`` or ``rnn``)."""
        return getattr(jaxdnn, self.mode)(*args, **kwargs)


class LSTM(_Recurrent):
    """``jaxdnn.lstm`` as a linen layer; see ``_Recurrent.__call__``. Its initializer is
    ``jax.experimental.rnn.init_lstm_weight``."""
    mode = "lstm"


class GRU(_Recurrent):
    """``jaxdnn.gru`` (cuDNN's GRU) as a linen layer; see ``_Recurrent.__call__``. Weights start
    uniform in [-1/sqrt(H), 1/sqrt(H)], as cuDNN's and PyTorch's."""
    mode = "gru"


class SimpleRNN(_Recurrent):
    """``jaxdnn.rnn`` (cuDNN's RNN_TANH / RNN_RELU, PyTorch's ``nn.RNN``) as a linen layer; see
    ``_Recurrent.__call__``; ``nonlinearity`` "tanh" or "relu". Weights start uniform in
    [-1/sqrt(H), 1/sqrt(H)], as cuDNN's and PyTorch's."""
    nonlinearity: str = "tanh"

    @property
    def mode(self):
        return f"rnn_{self.nonlinearity}"

    def op(self, *args, **kwargs):
        return jaxdnn.rnn(*args, nonlinearity=self.nonlinearity, **kwargs)
