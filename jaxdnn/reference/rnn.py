"""Reference LSTM, GRU and plain RNN: `jax.experimental.rnn.lstm`'s math on cuDNN's flat weight
layout, cuDNN's GRU and plain (Elman) RNN on the same layout, and the kernel stages of
jaxdnn.recurrent.

Shapes: B batch rows, T time steps, I input features, H hidden units, G gate pre-activations (LSTM:
4H in the order (i, f, g, o); GRU: 3H, (r, z, n); plain RNN: H), L layers, D directions (2 when
bidirectional). `mode` names the cell as cuDNN's cudnnRNNMode_t does: "lstm", "gru", "rnn_tanh" or
"rnn_relu" (the plain RNN with its nonlinearity).
Row b runs over its first len_b = clip(seq_lengths[b], 0, T) steps; the reverse direction runs over
that valid part backwards.
Steps past a row's end hold zeros, and a row with len_b = 0 keeps its initial state (where
`jax.experimental.rnn.lstm_ref` would index step -1). Computation runs in float32, or float64 when
given float64 inputs.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np


def _compute_type(*arrays):
    return jnp.result_type(jnp.float32, *(a.dtype for a in arrays))


GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}  # gate rows per hidden unit, per mode
NONLINEARITIES = ("tanh", "relu")  # of the plain RNN: its modes are "rnn_" + nonlinearity


def weight_shapes(mode, input_size, hidden_size, num_layers, bidirectional):
    """The shapes in cuDNN's flat weight vector of `mode` (a key of GATES), in order: (W_ih [G, I_l],
    W_hh [G, H]) for every pseudo-layer p = l D + d, then (b_ih [G], b_hh [G]) for every pseudo-layer.
    I_l is input_size for the first layer and D H after it (the directions' outputs concatenated)."""
    directions = 2 if bidirectional else 1
    gates = GATES[mode] * hidden_size
    matrices, biases = [], []
    for p in range(num_layers * directions):
        width = input_size if p < directions else directions * hidden_size
        matrices += [(gates, width), (gates, hidden_size)]
        biases += [(gates,), (gates,)]
    return matrices + biases


def weight_count(mode, input_size, hidden_size, num_layers, bidirectional):
    """The length of the flat weight vector (`jax.experimental.rnn.get_num_params_in_lstm` for LSTM)."""
    return sum(math.prod(s) for s in weight_shapes(mode, input_size, hidden_size, num_layers, bidirectional))


def unpack_weights(weights, mode, input_size, hidden_size, num_layers, bidirectional):
    """[(W_ih, W_hh, b_ih, b_hh)] per pseudo-layer from the flat weight vector."""
    shapes = weight_shapes(mode, input_size, hidden_size, num_layers, bidirectional)
    pieces, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        pieces.append(weights[offset:offset + size].reshape(shape))
        offset += size
    half = len(shapes) // 2
    return [(pieces[2 * p], pieces[2 * p + 1], pieces[half + 2 * p], pieces[half + 2 * p + 1])
            for p in range(half // 2)]


def pack_weights(params):
    """The inverse of `unpack_weights`: the flat vector of [(W_ih, W_hh, b_ih, b_hh)]."""
    matrices = [m.reshape(-1) for w_ih, w_hh, _, _ in params for m in (w_ih, w_hh)]
    biases = [b for _, _, b_ih, b_hh in params for b in (b_ih, b_hh)]
    return jnp.concatenate(matrices + biases)


def valid_steps(seq_lengths, steps):
    return jnp.clip(seq_lengths, 0, steps)


def flip_sequences(a, seq_lengths):
    """a [B, T, ...] with each row's valid part reversed in place (step s <-> len - 1 - s) and the
    steps past its end reversed among themselves, so padding stays at the end (an involution)."""
    steps = a.shape[1]
    lens = valid_steps(seq_lengths, steps)[:, None]
    s = jnp.arange(steps)[None, :]
    index = jnp.where(s < lens, lens - 1 - s, steps - 1 - s + lens)
    return jnp.take_along_axis(a, index.reshape(index.shape + (1,) * (a.ndim - 2)), axis=1)


def _activate(pre):
    i, f, g, o = jnp.split(pre, 4, axis=-1)
    return jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)


def lstm_fwd(gates_x, w_hh, h0, c0, seq_lengths, reverse):
    """The recurrence of one layer and direction: (h_seq [B, T, H], c_seq [B, T, H], acts [B, T, G],
    h_n [B, H], c_n [B, H]) from gates_x [B, T, G] (x W_ih^T + b_ih + b_hh), w_hh [G, H], h0, c0
    [B, H] and seq_lengths [B]; acts holds the gate activations (the backward's residuals)."""
    dtype = _compute_type(gates_x, w_hh, h0, c0)
    gates_x, w_hh, h0, c0 = (a.astype(dtype) for a in (gates_x, w_hh, h0, c0))
    lens = valid_steps(seq_lengths, gates_x.shape[1])
    if reverse:
        gates_x = flip_sequences(gates_x, seq_lengths)

    def step(carry, inputs):
        h, c = carry
        gx, s = inputs
        i, f, g, o = _activate(gx + h @ w_hh.T)
        c_new = f * c + i * g
        h_new = o * jnp.tanh(c_new)
        valid = (s < lens)[:, None]
        keep = lambda v: jnp.where(valid, v, 0)  # noqa: E731
        outputs = (keep(h_new), keep(c_new), keep(jnp.concatenate([i, f, g, o], axis=-1)))
        return (jnp.where(valid, h_new, h), jnp.where(valid, c_new, c)), outputs

    steps = jnp.arange(gates_x.shape[1])
    (h_n, c_n), seqs = jax.lax.scan(step, (h0, c0), (jnp.swapaxes(gates_x, 0, 1), steps))
    seqs = [jnp.swapaxes(a, 0, 1) for a in seqs]
    if reverse:
        seqs = [flip_sequences(a, seq_lengths) for a in seqs]
    return (*seqs, h_n, c_n)


def lstm_bwd(dh_seq, dh_n, dc_n, acts, c_seq, c0, w_hh, seq_lengths, reverse):
    """Backward through time of `lstm_fwd`: (dgates [B, T, G], dh0 [B, H], dc0 [B, H]) from the
    cotangents of h_seq, h_n, c_n and the forward's acts and c_seq."""
    dtype = _compute_type(dh_seq, dh_n, dc_n, acts, c_seq, c0, w_hh)
    dh_seq, dh_n, dc_n, acts, c_seq, c0, w_hh = (
        a.astype(dtype) for a in (dh_seq, dh_n, dc_n, acts, c_seq, c0, w_hh))
    lens = valid_steps(seq_lengths, acts.shape[1])
    if reverse:
        dh_seq, acts, c_seq = (flip_sequences(a, seq_lengths) for a in (dh_seq, acts, c_seq))
    c_prev = jnp.concatenate([c0[:, None], c_seq[:, :-1]], axis=1)

    def step(carry, inputs):
        dh_next, dc_next = carry
        dy, a, c, cp, s = inputs
        i, f, g, o = jnp.split(a, 4, axis=-1)
        dh = dy + dh_next
        tanh_c = jnp.tanh(c)
        dc = dc_next + dh * o * (1 - tanh_c * tanh_c)
        d_pre = jnp.concatenate([dc * g * i * (1 - i), dc * cp * f * (1 - f), dc * i * (1 - g * g),
                                 dh * tanh_c * o * (1 - o)], axis=-1)
        valid = (s < lens)[:, None]
        d_pre = jnp.where(valid, d_pre, 0)
        carry = (jnp.where(valid, d_pre @ w_hh, dh_next), jnp.where(valid, dc * f, dc_next))
        return carry, d_pre

    steps = jnp.arange(acts.shape[1])
    per_step = [jnp.swapaxes(a, 0, 1) for a in (dh_seq, acts, c_seq, c_prev)]
    (dh0, dc0), dgates = jax.lax.scan(step, (dh_n, dc_n), (*per_step, steps), reverse=True)
    dgates = jnp.swapaxes(dgates, 0, 1)
    if reverse:
        dgates = flip_sequences(dgates, seq_lengths)
    return dgates, dh0, dc0


def project_inputs(x, w_ih, bias, precision=None):
    """gates_x = x W_ih^T + bias [B, T, G], in float32 (or float64 for float64 inputs)."""
    dtype = _compute_type(x, w_ih)
    gates = jnp.einsum("bti,gi->btg", x, w_ih, precision=precision, preferred_element_type=dtype)
    return gates + bias.astype(dtype)


def folded_bias(b_ih, b_hh):
    """b_ih + b_hh (the LSTM's and the plain RNN's projection bias) in float32, or float64 for
    float64 biases: summed in a 16-bit dtype, the bias would be rounded once more than the rest of
    the float32 pre-activation."""
    dtype = _compute_type(b_ih, b_hh)
    return b_ih.astype(dtype) + b_hh.astype(dtype)


def gru_fwd(gates_x, w_hh, b_hh, h0, seq_lengths, reverse):
    """The GRU recurrence of one layer and direction (cuDNN's: the reset gate scales the recurrent
    product): (h_seq [B, T, H], saved [B, T, 4H], h_n [B, H]) from gates_x [B, T, 3H] (x W_ih^T +
    b_ih), w_hh [3H, H], b_hh [3H], h0 [B, H] and seq_lengths [B]; saved = (r, z, n, hp_n) with
    hp = h_prev W_hh^T + b_hh, the backward's residuals."""
    dtype = _compute_type(gates_x, w_hh, b_hh, h0)
    gates_x, w_hh, b_hh, h0 = (a.astype(dtype) for a in (gates_x, w_hh, b_hh, h0))
    lens = valid_steps(seq_lengths, gates_x.shape[1])
    if reverse:
        gates_x = flip_sequences(gates_x, seq_lengths)

    def step(h, inputs):
        gx, s = inputs
        x_r, x_z, x_n = jnp.split(gx, 3, axis=-1)
        h_r, h_z, h_n = jnp.split(h @ w_hh.T + b_hh, 3, axis=-1)
        r, z = jax.nn.sigmoid(x_r + h_r), jax.nn.sigmoid(x_z + h_z)
        n = jnp.tanh(x_n + r * h_n)
        h_new = (1 - z) * n + z * h
        valid = (s < lens)[:, None]
        outputs = (jnp.where(valid, h_new, 0), jnp.where(valid, jnp.concatenate([r, z, n, h_n], axis=-1), 0))
        return jnp.where(valid, h_new, h), outputs

    h_n, seqs = jax.lax.scan(step, h0, (jnp.swapaxes(gates_x, 0, 1), jnp.arange(gates_x.shape[1])))
    seqs = [jnp.swapaxes(a, 0, 1) for a in seqs]
    if reverse:
        seqs = [flip_sequences(a, seq_lengths) for a in seqs]
    return (*seqs, h_n)


def gru_bwd(dh_seq, dh_n, saved, h_seq, h0, w_hh, seq_lengths, reverse):
    """Backward through time of `gru_fwd`: (dgates_x, dgates_h [B, T, 3H], dh0 [B, H]), the
    gradients of gates_x and of the recurrent pre-activations hp."""
    dtype = _compute_type(dh_seq, dh_n, saved, h_seq, h0, w_hh)
    dh_seq, dh_n, saved, h_seq, h0, w_hh = (a.astype(dtype) for a in (dh_seq, dh_n, saved, h_seq, h0, w_hh))
    lens = valid_steps(seq_lengths, saved.shape[1])
    if reverse:
        dh_seq, saved, h_seq = (flip_sequences(a, seq_lengths) for a in (dh_seq, saved, h_seq))
    h_prev = jnp.concatenate([h0[:, None], h_seq[:, :-1]], axis=1)

    def step(dh_next, inputs):
        dy, keep, hp, s = inputs
        r, z, n, h_n = jnp.split(keep, 4, axis=-1)
        dh = dy + dh_next
        dn = dh * (1 - z) * (1 - n * n)
        dr = dn * h_n * r * (1 - r)
        dz = dh * (hp - n) * z * (1 - z)
        valid = (s < lens)[:, None]
        d_x = jnp.where(valid, jnp.concatenate([dr, dz, dn], axis=-1), 0)
        d_h = jnp.where(valid, jnp.concatenate([dr, dz, dn * r], axis=-1), 0)
        return jnp.where(valid, d_h @ w_hh + dh * z, dh_next), (d_x, d_h)

    per_step = [jnp.swapaxes(a, 0, 1) for a in (dh_seq, saved, h_prev)]
    dh0, grads = jax.lax.scan(step, dh_n, (*per_step, jnp.arange(saved.shape[1])), reverse=True)
    grads = [jnp.swapaxes(a, 0, 1) for a in grads]
    if reverse:
        grads = [flip_sequences(a, seq_lengths) for a in grads]
    return (*grads, dh0)


def rnn_fwd(gates_x, w_hh, h0, seq_lengths, reverse, nonlinearity):
    """The plain RNN recurrence of one layer and direction (cuDNN's RNN_TANH / RNN_RELU):
    (h_seq [B, T, H], h_n [B, H]) from gates_x [B, T, H] (x W_ih^T + b_ih + b_hh), w_hh [H, H], h0
    [B, H] and seq_lengths [B]: h = act(gates_x + h_prev W_hh^T), act `nonlinearity` ("tanh" or
    "relu"). h_seq is the backward's only residual (act' is taken from the output)."""
    dtype = _compute_type(gates_x, w_hh, h0)
    gates_x, w_hh, h0 = (a.astype(dtype) for a in (gates_x, w_hh, h0))
    act = jnp.tanh if nonlinearity == "tanh" else jax.nn.relu
    lens = valid_steps(seq_lengths, gates_x.shape[1])
    if reverse:
        gates_x = flip_sequences(gates_x, seq_lengths)

    def step(h, inputs):
        gx, s = inputs
        h_new = act(gx + h @ w_hh.T)
        valid = (s < lens)[:, None]
        return jnp.where(valid, h_new, h), jnp.where(valid, h_new, 0)

    h_n, h_seq = jax.lax.scan(step, h0, (jnp.swapaxes(gates_x, 0, 1), jnp.arange(gates_x.shape[1])))
    h_seq = jnp.swapaxes(h_seq, 0, 1)
    if reverse:
        h_seq = flip_sequences(h_seq, seq_lengths)
    return h_seq, h_n


def rnn_bwd(dh_seq, dh_n, h_seq, w_hh, seq_lengths, reverse, nonlinearity):
    """Backward through time of `rnn_fwd`: (dgates [B, T, H], dh0 [B, H]), dgates the gradient of
    the pre-activations (of gates_x and of h_prev W_hh^T alike), with act' from the output h:
    1 - h^2 for tanh, [h > 0] for relu (0 at the kink, as jax.nn.relu's gradient)."""
    dtype = _compute_type(dh_seq, dh_n, h_seq, w_hh)
    dh_seq, dh_n, h_seq, w_hh = (a.astype(dtype) for a in (dh_seq, dh_n, h_seq, w_hh))
    lens = valid_steps(seq_lengths, h_seq.shape[1])
    if reverse:
        dh_seq, h_seq = (flip_sequences(a, seq_lengths) for a in (dh_seq, h_seq))

    def step(dh_next, inputs):
        dy, h, s = inputs
        dh = dy + dh_next
        d_pre = dh * (1 - h * h) if nonlinearity == "tanh" else jnp.where(h > 0, dh, 0)
        valid = (s < lens)[:, None]
        d_pre = jnp.where(valid, d_pre, 0)
        return jnp.where(valid, d_pre @ w_hh, dh_next), d_pre

    per_step = [jnp.swapaxes(a, 0, 1) for a in (dh_seq, h_seq)]
    dh0, dgates = jax.lax.scan(step, dh_n, (*per_step, jnp.arange(h_seq.shape[1])), reverse=True)
    dgates = jnp.swapaxes(dgates, 0, 1)
    if reverse:
        dgates = flip_sequences(dgates, seq_lengths)
    return dgates, dh0


def dropout_masks(dropout_rng, rate, shape, num_layers):
    """The scales that dropout between layers multiplies the outputs of layers 0 .. L - 2 by: one
    float32 array of `shape` [B, T, D H] per boundary, 1 / (1 - rate) where kept and 0 where dropped,
    drawn from `dropout_rng` folded with the layer's index (the same key gives the same masks)."""
    if not rate:
        return ()
    keep = 1.0 - rate
    return tuple(jax.random.bernoulli(jax.random.fold_in(dropout_rng, layer), keep, shape).astype(jnp.float32)
                 / np.float32(keep) for layer in range(num_layers - 1))


def _stack(mode, x, states, weights, seq_lengths, input_size, hidden_size, num_layers, dropout, bidirectional,
           precision, dropout_rng=None):
    """y [B, T, D H] in x's dtype and the final states [L D, B, H] (one per entry of `states`)."""
    directions = 2 if bidirectional else 1
    masks = dropout_masks(dropout_rng, dropout, x.shape[:2] + (directions * hidden_size,), num_layers)
    params = unpack_weights(weights, mode, input_size, hidden_size, num_layers, bidirectional)
    layer_in, finals = x, [[] for _ in states]
    for layer in range(num_layers):
        outputs = []
        for d in range(directions):
            p = layer * directions + d
            w_ih, w_hh, b_ih, b_hh = params[p]
            if mode == "lstm":
                gates_x = project_inputs(layer_in, w_ih, folded_bias(b_ih, b_hh), precision)
                h_seq, _, _, *last = lstm_fwd(gates_x, w_hh, states[0][p], states[1][p], seq_lengths, d == 1)
            elif mode == "gru":
                gates_x = project_inputs(layer_in, w_ih, b_ih, precision)
                h_seq, _, *last = gru_fwd(gates_x, w_hh, b_hh, states[0][p], seq_lengths, d == 1)
            else:  # "rnn_tanh", "rnn_relu"
                gates_x = project_inputs(layer_in, w_ih, folded_bias(b_ih, b_hh), precision)
                nonlinearity = mode.removeprefix("rnn_")
                h_seq, *last = rnn_fwd(gates_x, w_hh, states[0][p], seq_lengths, d == 1, nonlinearity)
            outputs.append(h_seq.astype(x.dtype))
            for final, state in zip(finals, last):
                final.append(state)
        layer_in = jnp.concatenate(outputs, axis=-1)
        if layer < len(masks):
            layer_in = (layer_in * masks[layer].astype(layer_in.dtype)).astype(x.dtype)
    return layer_in, tuple(jnp.stack(f).astype(s.dtype) for f, s in zip(finals, states))


def lstm(x, h_0, c_0, weights, seq_lengths, input_size, hidden_size, num_layers, dropout, bidirectional,
         precision=None, dropout_rng=None):
    """`jax.experimental.rnn.lstm` in pure JAX: (y [B, T, D H], h_n [L D, B, H], c_n [L D, B, H]).

    x [B, T, I]; h_0, c_0 [L D, B, H]; weights the flat cuDNN vector; seq_lengths [B] int32. y has
    x's dtype (each layer's output is rounded to it before the next layer), h_n and c_n those of h_0
    and c_0. dropout > 0 scales each layer's output but the last by `dropout_masks(dropout_rng, ...)`.
    """
    y, (h_n, c_n) = _stack("lstm", x, (h_0, c_0), weights, seq_lengths, input_size, hidden_size, num_layers,
                           dropout, bidirectional, precision, dropout_rng)
    return y, h_n, c_n


def gru(x, h_0, weights, seq_lengths, input_size, hidden_size, num_layers, dropout, bidirectional,
        precision=None, dropout_rng=None):
    """cuDNN's GRU in pure JAX, on the flat weight layout of `lstm` with G = 3H gates (r, z, n):
    (y [B, T, D H], h_n [L D, B, H]). Conventions as `lstm`."""
    y, (h_n,) = _stack("gru", x, (h_0,), weights, seq_lengths, input_size, hidden_size, num_layers, dropout,
                       bidirectional, precision, dropout_rng)
    return y, h_n


def rnn(x, h_0, weights, seq_lengths, input_size, hidden_size, num_layers, dropout, bidirectional,
        precision=None, dropout_rng=None, nonlinearity="tanh"):
    """cuDNN's plain (Elman) RNN in pure JAX, h = act(W_ih x + b_ih + W_hh h_prev + b_hh) with act
    `nonlinearity` ("tanh" or "relu"), on the flat weight layout of `lstm` with G = H rows:
    (y [B, T, D H], h_n [L D, B, H]). Conventions as `lstm`."""
    if nonlinearity not in NONLINEARITIES:
        raise ValueError(f"rnn: nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
    y, (h_n,) = _stack("rnn_" + nonlinearity, x, (h_0,), weights, seq_lengths, input_size, hidden_size,
                       num_layers, dropout, bidirectional, precision, dropout_rng)
    return y, h_n
