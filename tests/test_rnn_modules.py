"""The Flax layers over whole sequences and the parameter converters from Flax's LSTMCell /
OptimizedLSTMCell / GRUCell / SimpleCell and Haiku's LSTM: jaxdnn.lstm / gru / rnn with the converted
weights give the stock cells' outputs (scanned in float64 by the stock modules themselves)."""

import functools

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdnn
import jaxdnn.flax as jflax
import jaxdnn.haiku as jhk
from helpers import assert_close, f64, normal


def _stack_scan(step_fns, x, hidden, bidirectional):
    """The stock cells run as cuDNN stacks them: per layer a forward pass (and a reverse one over the
    time-reversed sequence), the directions' outputs concatenated as the next layer's input.
    step_fns[p](carry, x_t) -> (carry, y_t); returns y [B, T, D H]."""
    directions = 2 if bidirectional else 1
    layer_in = x
    for layer in range(len(step_fns) // directions):
        outputs = []
        for d in range(directions):
            seq = jnp.swapaxes(layer_in, 0, 1)
            if d == 1:
                seq = seq[::-1]
            _, ys = jax.lax.scan(step_fns[layer * directions + d], hidden(layer_in.shape[0]), seq)
            outputs.append(jnp.swapaxes(ys[::-1] if d == 1 else ys, 0, 1))
        layer_in = jnp.concatenate(outputs, axis=-1)
    return layer_in


def _perturbed(rng, params):
    """Stock params with every entry moved off its initializer (zero biases included)."""
    return jax.tree.map(lambda p: p + 0.3 * normal(rng, p.shape, jnp.float64), params)


@pytest.mark.parametrize("cell_type", [nn.LSTMCell, nn.OptimizedLSTMCell], ids=lambda c: c.__name__)
def test_lstm_weights_from_flax(cell_type, rng):
    batch, steps, inputs, hidden, layers = 3, 7, 5, 6, 2
    x = normal(rng, (batch, steps, inputs))
    cells, params = [], []
    for p in range(layers * 2):
        cell = cell_type(features=hidden, dtype=jnp.float64, param_dtype=jnp.float64)
        width = inputs if p < 2 else 2 * hidden
        carry = cell.initialize_carry(jax.random.key(p), (batch, width))
        init = cell.init(jax.random.key(p), carry, jnp.zeros((batch, width)))
        params.append(_perturbed(rng, init["params"]))
        cells.append(cell)
    steps_fns = [lambda c, xt, cell=cell, p=p: cell.apply({"params": p}, c, xt)
                 for cell, p in zip(cells, params)]
    zero = lambda b: (jnp.zeros((b, hidden), jnp.float64),) * 2  # noqa: E731
    want = _stack_scan(steps_fns, f64(x), zero, True)
    weights = jflax.lstm_weights_from_flax(params).astype(jnp.float32)
    states = jnp.zeros((layers * 2, batch, hidden), jnp.float32)
    lengths = jnp.full((batch,), steps, jnp.int32)
    y, _, _ = jaxdnn.lstm(x, states, states, weights, lengths, inputs, hidden, layers, 0.0, True)
    assert_close(y, want, 1e-5, "y")


def test_gru_weights_from_flax(rng):
    batch, steps, inputs, hidden = 2, 6, 4, 5
    x = normal(rng, (batch, steps, inputs))
    cell = nn.GRUCell(features=hidden, dtype=jnp.float64, param_dtype=jnp.float64)
    params = [_perturbed(rng, cell.init(jax.random.key(p), jnp.zeros((batch, hidden)),
                                        jnp.zeros((batch, inputs if p == 0 else hidden)))["params"])
              for p in range(2)]
    step_fns = [lambda h, xt, p=p: cell.apply({"params": p}, h, xt) for p in params]
    want = _stack_scan(step_fns, f64(x), lambda b: jnp.zeros((b, hidden), jnp.float64), False)
    weights = jflax.gru_weights_from_flax(params).astype(jnp.float32)
    h_0, lengths = jnp.zeros((2, batch, hidden), jnp.float32), jnp.full((batch,), steps, jnp.int32)
    y, _ = jaxdnn.gru(x, h_0, weights, lengths, inputs, hidden, 2, 0.0, False)
    assert_close(y, want, 1e-5, "y")


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_simple_rnn_weights_from_flax(nonlinearity, rng):
    batch, steps, inputs, hidden = 2, 6, 4, 5
    x = normal(rng, (batch, steps, inputs))
    activation = jax.nn.relu if nonlinearity == "relu" else jnp.tanh
    cell = nn.SimpleCell(features=hidden, activation_fn=activation, dtype=jnp.float64,
                         param_dtype=jnp.float64)
    params = [_perturbed(rng, cell.init(jax.random.key(p), jnp.zeros((batch, hidden)),
                                        jnp.zeros((batch, inputs if p < 2 else 2 * hidden)))["params"])
              for p in range(4)]
    step_fns = [lambda h, xt, p=p: cell.apply({"params": p}, h, xt) for p in params]
    want = _stack_scan(step_fns, f64(x), lambda b: jnp.zeros((b, hidden), jnp.float64), True)
    weights = jflax.simple_rnn_weights_from_flax(params).astype(jnp.float32)
    h_0, lengths = jnp.zeros((4, batch, hidden), jnp.float32), jnp.full((batch,), steps, jnp.int32)
    y, _ = jaxdnn.rnn(x, h_0, weights, lengths, inputs, hidden, 2, 0.0, True, nonlinearity=nonlinearity)
    assert_close(y, want, 1e-5, "y")


def test_lstm_weights_from_haiku(rng):
    batch, steps, inputs, hidden = 3, 6, 4, 5

    def unrolled(x):
        core = hk.LSTM(hidden)
        return hk.dynamic_unroll(core, jnp.swapaxes(x, 0, 1), core.initial_state(batch))[0]

    model = hk.without_apply_rng(hk.transform(unrolled))
    x = normal(rng, (batch, steps, inputs))
    params = _perturbed(rng, jax.tree.map(f64, model.init(jax.random.key(0), f64(x))))
    want = jnp.swapaxes(model.apply(params, f64(x)), 0, 1)
    weights = jhk.lstm_weights_from_haiku([params["lstm/linear"]], inputs).astype(jnp.float32)
    zero = jnp.zeros((1, batch, hidden), jnp.float32)
    lengths = jnp.full((batch,), steps, jnp.int32)
    y, _, _ = jaxdnn.lstm(x, zero, zero, weights, lengths, inputs, hidden, 1, 0.0, False)
    assert_close(y, want, 1e-5, "y")
    with pytest.raises(ValueError, match="input_size is 7"):
        jhk.lstm_weights_from_haiku([params["lstm/linear"]], 7)


@pytest.mark.parametrize("layer_type", [jflax.LSTM, jflax.GRU, jflax.SimpleRNN,
                                        functools.partial(jflax.SimpleRNN, nonlinearity="relu")],
                         ids=["LSTM", "GRU", "SimpleRNN-tanh", "SimpleRNN-relu"])
def test_flax_layer(layer_type, rng):
    """The layer's `weights` feed the functional op unchanged; dropout between layers draws from the
    "dropout" stream when not deterministic."""
    batch, steps, inputs, hidden = 3, 5, 4, 6
    layer = layer_type(hidden_size=hidden, num_layers=2, bidirectional=True, dropout_rate=0.5)
    x = normal(rng, (batch, steps, inputs))
    lengths = jnp.asarray([5, 2, 4], jnp.int32)
    variables = layer.init(jax.random.key(0), x, lengths)
    weights = variables["params"]["weights"]
    assert weights.shape == (jaxdnn.reference.rnn.weight_count(layer.mode, inputs, hidden, 2, True),)
    y, finals = layer.apply(variables, x, lengths)
    zero = jnp.zeros((4, batch, hidden), jnp.float32)
    want = layer.op(x, *([zero] * (2 if layer.mode == "lstm" else 1)), weights, lengths, inputs, hidden, 2,
                    0.0, True)
    np.testing.assert_array_equal(y, want[0])
    assert y.shape == (batch, steps, 2 * hidden)
    dropped, _ = layer.apply(variables, x, lengths, deterministic=False, rngs={"dropout": jax.random.key(1)})
    assert float(jnp.max(jnp.abs(dropped - y))) > 0.1 * float(jnp.max(jnp.abs(y)))  # dropout changed y
    grads = jax.grad(lambda v: jnp.sum(layer.apply(v, x, lengths)[0] ** 2))(variables)
    assert bool(jnp.all(jnp.isfinite(grads["params"]["weights"])))
    del finals
