"""lstm, gru and the plain rnn (tanh and relu) against the float64 reference (itself checked against
jax.experimental.rnn.lstm_ref, flax.linen.GRUCell and a step-by-step numpy RNN): forward and VJP of
every input over layers, directions, ragged, empty and out-of-range seq_lengths, dtypes; transforms,
batch sharding, export, errors, and the custom calls in the HLO.

A test's `mode` is cuDNN's name of the cell, as jaxdnn.reference.rnn's: "lstm", "gru", "rnn_tanh",
"rnn_relu" (jaxdnn.rnn with that nonlinearity)."""

import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import rnn as jax_rnn
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdnn
from helpers import (ISA_ORDER, assert_close, dtype_id, f64, isa_child_report, normal, on_gpu, rel_err,
                     tolerance)
from jaxdnn.reference import rnn as ref

MODES = ("lstm", "gru", "rnn_tanh", "rnn_relu")
mode_param = pytest.mark.parametrize("mode", MODES)
# (B, T, I, H, L, bidirectional, seq_lengths or None for all T)
CASES = [
    (3, 7, 5, 6, 1, False, None),
    (4, 6, 4, 3, 2, False, [6, 1, 3, 4]),
    (3, 7, 5, 6, 1, True, [7, 2, 5]),
    (2, 5, 3, 4, 2, True, [5, 3]),
    (1, 9, 3, 5, 1, True, None),               # one row: on a GPU, the cluster kernels
    (1, 6, 3, 5, 2, True, [4]),
    (1, 5, 2, 4, 1, False, [0]),
    (5, 4, 2, 7, 1, False, [0, 4, 1, 0, 2]),  # empty sequences keep their initial state
    (3, 5, 3, 4, 1, True, [-2, 9, 3]),         # out of range: clamped to [0, T]
    (19, 6, 3, 4, 1, True, [6, 1, 0, 5, 3, 6, 2, 4, 6, 6, 1, 3, 5, 0, 2, 6, 4, 3, 6]),  # 2 CPU row chunks
]
case_param = pytest.mark.parametrize("case", CASES, ids=str)


def _state_names(mode):
    return ("h_0", "c_0") if mode == "lstm" else ("h_0",)


def _name(mode):
    """The function of `mode` (lstm, gru or rnn), which names its FFI targets and its errors."""
    return mode.partition("_")[0]


def _function(module, mode, suffix=""):
    """`mode`'s function (suffix "_cell": its cell) in `module`, jaxdnn or the reference; the plain
    RNN's with its nonlinearity bound."""
    name, _, nonlinearity = mode.partition("_")
    fn = getattr(module, name + suffix)
    return functools.partial(fn, nonlinearity=nonlinearity) if nonlinearity else fn


def _inputs(rng, mode, case, dtype=jnp.float32, state_dtype=jnp.float32):
    """((x, states, weights, seq_lengths), sizes) for `case`; states = (h_0, c_0) or (h_0,)."""
    batch, steps, inputs, hidden, layers, bidirectional, lengths = case
    shape = (layers * (2 if bidirectional else 1), batch, hidden)
    x = normal(rng, (batch, steps, inputs), dtype)
    states = tuple(normal(rng, shape, state_dtype) for _ in _state_names(mode))
    count = ref.weight_count(mode, inputs, hidden, layers, bidirectional)
    bound = min(0.6, 2 / np.sqrt(hidden))  # wider layers: a relu RNN's state would overflow float16
    weights = jnp.asarray(rng.uniform(-bound, bound, count), dtype)
    seq_lengths = jnp.asarray([steps] * batch if lengths is None else lengths, jnp.int32)
    return (x, states, weights, seq_lengths), (inputs, hidden, layers, 0.0, bidirectional)


def _ours(mode, x, states, weights, seq_lengths, sizes):
    """(y, *final states) of jaxdnn.lstm / jaxdnn.gru / jaxdnn.rnn."""
    return _function(jaxdnn, mode)(x, *states, weights, seq_lengths, *sizes)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _oracle(mode, x, states, weights, seq_lengths, sizes):
    """The reference in float64."""
    return _function(ref, mode)(f64(x), *map(f64, states), f64(weights), seq_lengths, *sizes)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _oracle_rounding_layers(mode, x, states, weights, seq_lengths, sizes):
    """The reference in float64 but for x: each layer's output is rounded to x's dtype, as jaxdnn's."""
    return _function(ref, mode)(x, *map(f64, states), f64(weights), seq_lengths, *sizes)


def _to64(args):
    x, states, weights, seq_lengths = args
    return f64(x), tuple(map(f64, states)), f64(weights), seq_lengths


def _cotangents(rng, outputs):
    return tuple(normal(rng, o.shape, o.dtype) for o in outputs)


@functools.partial(jax.jit, static_argnums=(0, 1, 4))
def _vjp(fn, mode, args, cts, sizes):
    """(outputs, grads of (x, states, weights)) of fn for the cotangents cts, under jit."""
    x, states, weights, seq_lengths = args
    out, pullback = jax.vjp(lambda *a: fn(mode, *a, seq_lengths, sizes), x, states, weights)
    return out, pullback(tuple(c.astype(o.dtype) for c, o in zip(cts, out)))


def _check(mode, args, sizes, cts, tol, grad_tol):
    out, grads = _vjp(_ours, mode, args, cts, sizes)
    # relu' jumps at 0: a layer output rounded to 16 bits by jaxdnn and not by the oracle can move a
    # next-layer pre-activation across 0 and flip its derivative, so that oracle rounds them too.
    if mode == "rnn_relu":
        want, want_grads = _vjp(_oracle_rounding_layers, mode, (args[0],) + _to64(args)[1:], cts, sizes)
    else:
        want, want_grads = _vjp(_oracle, mode, _to64(args), cts, sizes)
    inputs = [args[0], *args[1], args[2]]
    for name, o, w, a in zip(("y",) + _state_names(mode), out, want, inputs):
        assert o.dtype == a.dtype, name
        assert_close(o, w, tol, name)
    names = ("x",) + _state_names(mode) + ("weights",)
    for name, g, w, a in zip(names, jax.tree.leaves(grads), jax.tree.leaves(want_grads), inputs):
        assert g.dtype == a.dtype, name
        assert_close(g, w, grad_tol, f"d{name}")


@case_param
def test_reference_matches_jax_lstm_ref(case, rng):
    """The LSTM oracle is jax.experimental.rnn's own reference wherever that is defined (len >= 1)."""
    args, sizes = _inputs(rng, "lstm", case)
    x, (h_0, c_0), weights, seq_lengths = _to64(args)
    lengths = np.asarray(seq_lengths)
    if lengths.min() < 1 or lengths.max() > x.shape[1]:
        pytest.skip("lstm_ref indexes step len - 1: defined for 1 <= len <= T only")
    unpacked = jax_rnn.unpack_lstm_weights(weights, sizes[0], sizes[1], sizes[2], sizes[4])
    want = jax_rnn.lstm_ref(x, h_0, c_0, *unpacked, seq_lengths, *sizes)
    for name, o, w in zip(["y", "h_n", "c_n"], _oracle("lstm", *args, sizes), want):
        assert_close(o, w, 1e-12, name)


def test_gru_matches_flax_gru_cell(rng):
    """cuDNN's GRU is flax.linen.GRUCell's math with b_ir = b_iz = 0 (Flax has no recurrent r, z
    biases): one layer scanned by Flax in float64 against jaxdnn.gru with the converted weights."""
    batch, steps, inputs, hidden = 3, 8, 5, 6
    cell = nn.GRUCell(features=hidden, dtype=jnp.float64, param_dtype=jnp.float64)
    x, h_0 = normal(rng, (batch, steps, inputs)), normal(rng, (batch, hidden))
    params = cell.init(jax.random.PRNGKey(0), f64(h_0), f64(x[:, 0]))["params"]
    params = jax.tree.map(lambda p: p + 0.3 * normal(rng, p.shape, jnp.float64), params)
    step = lambda h, xt: cell.apply({"params": params}, h, xt)  # noqa: E731
    h_n, ys = jax.lax.scan(step, f64(h_0), jnp.swapaxes(f64(x), 0, 1))
    zero = jnp.zeros((hidden,), jnp.float64)
    kernels = lambda names: jnp.concatenate([params[n]["kernel"].T for n in names])  # noqa: E731
    weights = ref.pack_weights([(kernels(["ir", "iz", "in"]), kernels(["hr", "hz", "hn"]),
                                 jnp.concatenate([params[n]["bias"] for n in ["ir", "iz", "in"]]),
                                 jnp.concatenate([zero, zero, params["hn"]["bias"]]))])
    y, h = jaxdnn.gru(x, h_0[None], weights.astype(jnp.float32), jnp.full((batch,), steps, jnp.int32), inputs,
                      hidden, 1, 0.0, False)
    assert_close(y, jnp.swapaxes(ys, 0, 1), 1e-5, "y")
    assert_close(h[0], h_n, 1e-5, "h_n")


def _rnn_step_by_step(x, h_0, weights, lengths, sizes, nonlinearity):
    """The plain RNN written out row by row and step by step in numpy float64, the flat weights
    unpacked by hand: an oracle sharing no code with the reference (no scans, flips or masks)."""
    inputs, hidden, layers, _, bidirectional = sizes
    directions = 2 if bidirectional else 1
    act = np.tanh if nonlinearity == "tanh" else (lambda v: np.maximum(v, 0.0))
    x, h_0, weights = (np.asarray(a, np.float64) for a in (x, h_0, weights))
    matrices, offset = [], 0
    for p in range(layers * directions):  # (W_ih, W_hh) of every pseudo-layer, then the biases
        width = inputs if p < directions else directions * hidden
        for rows, cols in ((hidden, width), (hidden, hidden)):
            matrices.append(weights[offset:offset + rows * cols].reshape(rows, cols))
            offset += rows * cols
    biases = weights[offset:].reshape(layers * directions, 2, hidden)  # (b_ih, b_hh) per pseudo-layer
    batch, steps = x.shape[:2]
    y, h_n = np.zeros((batch, steps, directions * hidden)), h_0.copy()
    for b in range(batch):
        valid = min(max(int(lengths[b]), 0), steps)
        layer_in = x[b]
        for layer in range(layers):
            out = np.zeros((steps, directions * hidden))
            for d in range(directions):
                p = layer * directions + d
                h = h_0[p, b]
                for t in (range(valid) if d == 0 else reversed(range(valid))):
                    w_ih, w_hh = matrices[2 * p], matrices[2 * p + 1]
                    h = act(w_ih @ layer_in[t] + biases[p, 0] + w_hh @ h + biases[p, 1])
                    out[t, d * hidden:(d + 1) * hidden] = h
                h_n[p, b] = h
            layer_in = out
        y[b] = layer_in
    return y, h_n


@pytest.mark.parametrize("mode", ["rnn_tanh", "rnn_relu"])
@case_param
def test_rnn_matches_step_by_step(mode, case, rng):
    """jaxdnn.rnn (float32) and its float64 reference against the plain RNN written out in numpy."""
    args, sizes = _inputs(rng, mode, case)
    x, (h_0,), weights, seq_lengths = args
    want = _rnn_step_by_step(x, h_0, weights, np.asarray(seq_lengths), sizes, mode.removeprefix("rnn_"))
    for name, o, r, w in zip(["y", "h_n"], _ours(mode, *args, sizes), _oracle(mode, *args, sizes), want):
        assert_close(o, w, tolerance(jnp.float32), name)
        assert_close(r, w, 1e-12, f"reference {name}")


def test_rnn_relu_kink():
    """relu's derivative is 0 at 0, as jax.nn.relu's: zero weights and h_0 keep every pre-activation at
    exactly 0, so nothing reaches x, h_0 or the weights' inputs."""
    x, h_0 = jnp.ones((2, 3, 4), jnp.float32), jnp.zeros((1, 2, 5), jnp.float32)
    weights = jnp.zeros((ref.weight_count("rnn_relu", 4, 5, 1, False),), jnp.float32)
    lengths = jnp.full((2,), 3, jnp.int32)

    def loss(fn, x, h_0, weights):
        return jnp.sum(fn(x, h_0, weights, lengths, 4, 5, 1, 0.0, False, nonlinearity="relu")[0])

    got = jax.grad(functools.partial(loss, jaxdnn.rnn), argnums=(0, 1, 2))(x, h_0, weights)
    want = jax.grad(functools.partial(loss, ref.rnn), argnums=(0, 1, 2))(x, h_0, weights)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert not np.any(np.asarray(got[0]))


@pytest.mark.skipif(on_gpu(), reason="the CPU kernels' tanh (a GPU's is libdevice's tanhf)")
def test_cpu_tanh_within_two_ulps():
    """The CPU kernels' tanh (common/activation.h's host Tanh: a polynomial below 0.625, exp above) is
    within 2 ulp of float64's, read through a plain RNN whose step is h = tanh(x): W_ih the identity
    at HIGHEST precision (x passes exactly), W_hh and the biases zero. Both sides of the split, tiny
    and huge values, and the values that round to 1."""
    hidden = 64
    split = np.float32(0.625)
    around = [np.nextafter(split, np.float32(0)), split, np.nextafter(split, np.float32(1))]
    values = np.concatenate([np.linspace(0, 12, 64 * 60, dtype=np.float32), around,
                             np.float32([1e-20, 1e-10, 1e-5, 1e-3, 9.0, 9.1, 50.0, 1e3, 3e38])])
    values = np.concatenate([values, -values])
    values = np.pad(values, (0, -len(values) % hidden))  # whole steps of `hidden` values
    x = jnp.asarray(values.reshape(1, -1, hidden))
    steps = x.shape[1]
    weights = jnp.concatenate([jnp.eye(hidden, dtype=jnp.float32).ravel(),
                               jnp.zeros((hidden * hidden + 2 * hidden,), jnp.float32)])
    assert weights.shape[0] == ref.weight_count("rnn_tanh", hidden, hidden, 1, False)
    y = jaxdnn.rnn(x, jnp.zeros((1, 1, hidden), jnp.float32), weights, jnp.full((1,), steps, jnp.int32),
                   hidden, hidden, 1, 0.0, False, precision=jax.lax.Precision.HIGHEST)[0]
    got = np.asarray(y, np.float64).ravel()
    exact = np.tanh(values.astype(np.float64))
    ulps = np.abs(got - exact) / np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    assert np.max(ulps) <= 2, (values[np.argmax(ulps)], np.max(ulps))


def test_rnn_bad_nonlinearity(rng):
    with pytest.raises(ValueError, match="rnn: nonlinearity must be 'tanh' or 'relu', got 'gelu'"):
        _bad_call("rnn_tanh", nonlinearity="gelu")
    with pytest.raises(ValueError, match="rnn: nonlinearity must be 'tanh' or 'relu', got None"):
        _bad_call("rnn_tanh", nonlinearity=None)
    args, sizes = _inputs(rng, "rnn_tanh", CASES[0])
    with pytest.raises(ValueError, match="rnn: nonlinearity must be 'tanh' or 'relu', got 'Tanh'"):
        ref.rnn(args[0], *args[1], *args[2:], *sizes, nonlinearity="Tanh")
    from jaxdnn import recurrent as stages  # the kernels check the attribute too
    gates_x, h0 = normal(rng, (2, 3, 1, 4)), normal(rng, (2, 1, 4))
    with pytest.raises(jax.errors.JaxRuntimeError, match='nonlinearity must be "tanh" or "relu", got "gelu"'):
        # Waited for: on a GPU the kernel's error surfaces when the (asynchronous) result is.
        prim, _ = stages._rnn_fwd
        outs = prim.bind(gates_x, jnp.ones((1, 4, 4)), h0, jnp.full((2,), 3, jnp.int32),
                         reverse=np.int64(0), nonlinearity="gelu", tf32=np.int64(0),
                         bf16_state=np.int64(0))
        jax.block_until_ready(outs)


# A batch of 5 rows, H 64, two bidirectional layers: on a GPU the tensor-core cluster kernels (the
# backward with 16-bit weights only).
CLUSTER_BATCH_CASE = (5, 6, 8, 64, 2, True, [6, 2, 0, 5, 6])


@mode_param
@pytest.mark.parametrize("case", [*CASES, CLUSTER_BATCH_CASE], ids=str)
def test_forward_and_grad_f32(mode, case, rng):
    args, sizes = _inputs(rng, mode, case)
    cts = _cotangents(rng, _ours(mode, *args, sizes))
    _check(mode, args, sizes, cts, tolerance(jnp.float32), tolerance(jnp.float32, grad=True))


@mode_param
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=dtype_id)
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CLUSTER_BATCH_CASE], ids=str)
def test_forward_and_grad_half(mode, case, dtype, rng):
    """Half-precision x and weights; the state stays float32 (h_0, c_0 float32 here)."""
    args, sizes = _inputs(rng, mode, case, dtype)
    cts = _cotangents(rng, _ours(mode, *args, sizes))
    _check(mode, args, sizes, cts, tolerance(dtype), tolerance(dtype, grad=True))


@mode_param
def test_half_states_and_mixed_weights(mode, rng):
    """bfloat16 states come back in bfloat16; float32 weights (init_lstm_weight's) with bf16 x."""
    args, sizes = _inputs(rng, mode, CASES[2], jnp.bfloat16, state_dtype=jnp.bfloat16)
    args = (args[0], args[1], args[2].astype(jnp.float32), args[3])
    cts = _cotangents(rng, _ours(mode, *args, sizes))
    _check(mode, args, sizes, cts, tolerance(jnp.bfloat16), tolerance(jnp.bfloat16, grad=True))


def test_init_lstm_weight_and_long_sequence(rng):
    """jax.experimental.rnn's own initializer, a longer sequence and a wider layer."""
    batch, steps, inputs, hidden = 2, 40, 24, 33
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    weights = jax_rnn.init_lstm_weight(key, inputs, hidden, 1, True)
    args, sizes = _inputs(rng, "lstm", (batch, steps, inputs, hidden, 1, True, [40, 17]))
    args = (args[0], args[1], weights, args[3])
    cts = _cotangents(rng, _ours("lstm", *args, sizes))
    _check("lstm", args, sizes, cts, tolerance(jnp.float32), tolerance(jnp.float32, grad=True))


@mode_param
@pytest.mark.parametrize("batch,steps", [(0, 4), (3, 0), (1, 0)],
                         ids=["no-rows", "no-steps", "one-row-no-steps"])
def test_empty(mode, batch, steps, rng):
    args, sizes = _inputs(rng, mode, (batch, steps, 3, 4, 2, True, [steps] * batch))
    x, states, weights, seq_lengths = args
    y, *finals = jax.jit(lambda *a: _ours(mode, *a, sizes))(*args)
    assert y.shape == (batch, steps, 8)
    for final, state in zip(finals, states):  # no step ran: the final states are the initial ones
        np.testing.assert_array_equal(final, state)
    grad = jax.grad(lambda s: jnp.sum(_ours(mode, x, s, weights, seq_lengths, sizes)[1]))(states)
    np.testing.assert_array_equal(grad[0], jnp.ones_like(states[0]))


@mode_param
def test_nan_stays_in_its_row(mode, rng):
    """A NaN with every payload bit set (the CUDA forward's fill of h values not yet published) in one
    row's x at step 2 and in another row's h_0 turns those rows' outputs to NaN from there and leaves
    every other row as the reference's; 19 rows put a GPU on the persistent kernels, whose steps
    await each h as it is published."""
    args, sizes = _inputs(rng, mode, (19, 5, 3, 8, 1, False, None))
    x, states, weights, seq_lengths = args
    nan = np.array(0xFFFFFFFF, np.uint32).view(np.float32)
    x = x.at[4, 2].set(nan)
    states = (states[0].at[0, 7].set(nan),) + states[1:]
    y = jax.jit(lambda *a: _ours(mode, *a, sizes)[0])(x, states, weights, seq_lengths)
    expected = _oracle(mode, x, states, weights, seq_lengths, sizes)[0]
    clean = np.setdiff1d(np.arange(19), [4, 7])
    assert_close(y[clean], expected[clean], tolerance(jnp.float32), "rows without a NaN")
    assert np.all(np.isnan(y[4, 2:])) and np.all(np.isnan(y[7]))
    assert np.all(np.isfinite(y[4, :2]))


@mode_param
def test_transforms(mode, rng):
    args, sizes = _inputs(rng, mode, (3, 5, 4, 5, 1, True, [5, 2, 4]))  # layers: test_forward_and_grad
    x, states, weights, seq_lengths = args
    xs = normal(rng, (3, 2) + x.shape[1:])  # vmapped axis 1: [B, V, T, I]

    def y_of(fn, x, states, weights):
        return fn(mode, x, states, weights, seq_lengths, sizes)[0]

    ours, oracle = functools.partial(y_of, _ours), functools.partial(y_of, _oracle)
    over_x = dict(in_axes=(1, None, None), out_axes=1)
    got = jax.vmap(ours, **over_x)(xs, states, weights)
    want = jax.vmap(oracle, **over_x)(f64(xs), states, weights)
    assert_close(got, want, 1e-5, "vmap over x (axis 1), states and weights unbatched")
    many_weights = jnp.stack([weights, weights[::-1]])
    got = jax.vmap(ours, in_axes=(None, None, 0))(x, states, many_weights)
    want = jax.vmap(oracle, in_axes=(None, None, 0))(x, states, f64(many_weights))
    assert_close(got, want, 1e-5, "vmap over the weights (reference path)")
    ct = normal(rng, (2,) + x.shape[:2] + (10,))

    def loss(fn, x, states, weights, ct):
        return jnp.sum(jnp.sin(y_of(fn, x, states, weights)) * ct.astype(x.dtype))

    over_examples = dict(in_axes=(1, None, None, 0))
    per_example = jax.vmap(jax.grad(functools.partial(loss, _ours), argnums=(0, 2)), **over_examples)
    per_example_want = jax.vmap(jax.grad(functools.partial(loss, _oracle), argnums=(0, 2)), **over_examples)
    for name, g, w in zip(["x", "weights"], per_example(xs, states, weights, ct),
                          per_example_want(f64(xs), tuple(map(f64, states)), f64(weights), f64(ct))):
        assert_close(g, w, 1e-4, f"vmap(grad) {name}")

    def penalty(fn, *a):
        g = jax.grad(lambda *a: loss(fn, *a, ct[0]), argnums=(0, 1, 2))(*a)
        return sum(jnp.sum(t ** 2) for t in jax.tree.leaves(g))

    got = jax.jit(jax.grad(functools.partial(penalty, _ours), argnums=(0, 1, 2)))(x, states, weights)
    want = jax.jit(jax.grad(functools.partial(penalty, _oracle), argnums=(0, 1, 2)))(*_to64(args)[:3])
    names = ("x",) + _state_names(mode) + ("weights",)
    for name, g, w in zip(names, jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w, 1e-4, f"grad of grad {name}")

    wide_sizes = (10, 5, 1, 0.0, True)  # input = the bidirectional output, fed back

    def scanned(fn, x, weights):
        step = jax.checkpoint(lambda h: fn(mode, h, tuple(s.astype(h.dtype) for s in states), weights,
                                           seq_lengths, wide_sizes)[0])
        h, _ = jax.lax.scan(lambda h, _: (step(h), None), x, None, length=2)
        return jnp.sum(h * ct[0].astype(h.dtype))

    wide = normal(rng, x.shape[:2] + (10,))
    wide_count = ref.weight_count(mode, *wide_sizes[:3], True)
    wide_weights = jnp.asarray(rng.uniform(-0.5, 0.5, wide_count), jnp.float32)
    got = jax.grad(functools.partial(scanned, _ours), argnums=(0, 1))(wide, wide_weights)
    want = jax.grad(functools.partial(scanned, _oracle), argnums=(0, 1))(f64(wide), f64(wide_weights))
    for name, g, w in zip(["x", "weights"], got, want):
        assert_close(g, w, 1e-4, f"scan(checkpoint) {name}")
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda x: _ours(mode, x, states, weights, seq_lengths, sizes)[0], (x,), (x,))


@mode_param
def test_hlo_holds_the_custom_calls(mode, rng):
    args, sizes = _inputs(rng, mode, CASES[2])
    x, states, weights, seq_lengths = args
    hlo = jax.jit(jax.grad(lambda x, w: jnp.sum(_ours(mode, x, states, w, seq_lengths, sizes)[0] ** 2),
                           argnums=(0, 1))).lower(x, weights).as_text()
    for target in [f"jaxdnn_{_name(mode)}_fwd_v4", f"jaxdnn_{_name(mode)}_bwd_v3"]:
        assert hlo.count(target) == 1, target  # one for both directions


@pytest.mark.parametrize("precision,tf32", [
    (None, 0), (jax.lax.Precision.DEFAULT, 1), ("tensorfloat32", 1), (jax.lax.Precision.HIGHEST, 0),
    ((jax.lax.Precision.HIGH, jax.lax.Precision.HIGHEST), 0), ("F32_F32_F32", 0)], ids=str)
def test_precision_reaches_the_kernels(precision, tf32, rng):
    """`precision` sets the forward stages' tf32 and bf16_state attributes and the backward stages'
    bf16_gradients alike (None follows jax_default_matmul_precision, which conftest sets to "highest")."""
    args, sizes = _inputs(rng, "lstm", CASES[0])
    x, states, weights, seq_lengths = args
    loss = lambda x, w: jnp.sum(jaxdnn.lstm(x, *states, w, seq_lengths, *sizes, precision=precision)[0])
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, weights).as_text()
    assert hlo.count(f"tf32 = {tf32} : i64") == 1 and hlo.count(f"tf32 = {1 - tf32} : i64") == 0
    for name in ("bf16_state", "bf16_gradients"):
        assert hlo.count(f"{name} = {tf32} : i64") == 1 and hlo.count(f"{name} = {1 - tf32} : i64") == 0


@pytest.mark.parametrize("precision,operand", [(jax.lax.Precision.DEFAULT, "bf16"), (None, "f32"),
                                               (jax.lax.Precision.HIGHEST, "f32")], ids=str)
def test_bf16_gradient_gemms_follow_precision(precision, operand, rng):
    """A bfloat16 layer's weight- and input-gradient GEMMs take bfloat16 operands where `precision`
    allows reduced-precision products (None is HIGHEST under conftest), float32 ones otherwise; float32
    sums either way, and the gradients stay within bfloat16's tolerance of the float64 reference."""
    args, sizes = _inputs(rng, "lstm", CASES[3], jnp.bfloat16)
    x, states, weights, seq_lengths = args
    lstm = functools.partial(jaxdnn.lstm, precision=precision)
    loss = lambda x, w: jnp.sum(lstm(x, *states, w, seq_lengths, *sizes)[0].astype(jnp.float32) ** 2)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, weights).as_text()
    dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
    # per layer: the input projection (bf16 operands always), dW_ih, dW_hh and dx; all sum in float32
    assert len(dots) == 4 * sizes[2], dots
    assert all(line.split("->")[-1].strip().endswith("xf32>") for line in dots), dots
    matching = [line for line in dots if f"x{operand}>, tensor<" in line]
    assert len(matching) == (4 if operand == "bf16" else 3) * sizes[2], dots
    got = jax.grad(loss, argnums=(0, 1))(x, weights)
    oracle = lambda x, w: jnp.sum(ref.lstm(x, *map(f64, states), w, seq_lengths, *sizes)[0] ** 2)
    want = jax.grad(oracle, argnums=(0, 1))(f64(x), f64(weights))
    for name, g, w in zip(["x", "weights"], got, want):
        assert_close(g, w, tolerance(jnp.bfloat16, grad=True), f"d{name}")


def test_precision_allows_tf32_as_jax_rnn_allows_cudnn():
    """The precision rule itself, dot algorithms included (which XLA's CPU dots cannot lower)."""
    from jaxdnn._precision import allows_tf32
    with jax.default_matmul_precision(None):
        assert allows_tf32(None)
    assert allows_tf32("default") and allows_tf32(jax.lax.Precision.HIGH)
    assert not allows_tf32("highest") and not allows_tf32("float32")
    assert allows_tf32("TF32_TF32_F32") and allows_tf32(jax.lax.DotAlgorithmPreset.BF16_BF16_F32)
    assert not allows_tf32("TF32_TF32_F32_X3") and not allows_tf32(jax.lax.DotAlgorithmPreset.F32_F32_F32)
    assert not allows_tf32(("default", "highest"))


@mode_param
def test_deterministic(mode, rng):
    args, sizes = _inputs(rng, mode, (6, 8, 5, 9, 2, True, [8, 3, 7, 1, 8, 5]))
    cts = _cotangents(rng, _ours(mode, *args, sizes))
    first, second = _vjp(_ours, mode, args, cts, sizes), _vjp(_ours, mode, args, cts, sizes)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(a, b)


# A child process's run, on the CPU, of every mode's forward and VJP against the float64 reference,
# its sizes in CONFIG (a line put before it, see _rnn_child): it reports the relative errors, a
# digest of the results' bits, the cores it ran on and the CPU build it took (cpu_isa).
_RNN_CHILD = """
import hashlib, json, os
if CONFIG["one_core"]:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import jax, jax.numpy as jnp, numpy as np
import jaxdnn
from jaxdnn.reference import rnn as ref
jax.config.update("jax_enable_x64", True)
digest, errors = hashlib.sha256(), []
batch, steps, inputs, hidden, layers, bidirectional = (
    CONFIG[k] for k in ("batch", "steps", "inputs", "hidden", "layers", "bidirectional"))
for i, mode in enumerate(("lstm", "gru", "rnn_tanh")):
    name, _, nonlinearity = mode.partition("_")
    extra = {"nonlinearity": nonlinearity} if nonlinearity else {}
    ours, oracle = getattr(jaxdnn, name), getattr(ref, name)
    kx, kh, kc, kw, kt = jax.random.split(jax.random.key(i), 5)
    x = jax.random.normal(kx, (batch, steps, inputs), jnp.float32)
    keys = (kh, kc) if name == "lstm" else (kh,)
    states = [jax.random.normal(k, ((1 + bidirectional) * layers, batch, hidden), jnp.float32) for k in keys]
    count = ref.weight_count(mode, inputs, hidden, layers, bidirectional)
    w = jax.random.uniform(kw, (count,), jnp.float32, -CONFIG["scale"], CONFIG["scale"])
    lengths = jnp.asarray(CONFIG["lengths"], jnp.int32)
    def run(fn, x, states, w):
        return fn(x, *states, w, lengths, inputs, hidden, layers, 0.0, bidirectional, **extra)
    out, pullback = jax.vjp(jax.jit(lambda x, s, w: run(ours, x, s, w)), x, states, w)
    cts = [jax.random.normal(jax.random.fold_in(kt, j), o.shape, jnp.float32) for j, o in enumerate(out)]
    f64 = lambda a: a.astype(jnp.float64)
    want, want_pullback = jax.vjp(lambda x, s, w: run(oracle, x, s, w), f64(x), [f64(a) for a in states],
                                  f64(w))
    got_all = jax.tree.leaves((out, pullback(tuple(cts))))
    want_all = jax.tree.leaves((want, want_pullback(tuple(f64(c) for c in cts))))
    for got, ref_value in zip(got_all, want_all):
        digest.update(np.asarray(got).tobytes())
        got, ref_value = np.asarray(got, np.float64), np.asarray(ref_value)
        errors.append(float(np.linalg.norm(got - ref_value) / np.linalg.norm(ref_value)))
print(json.dumps({"isa": jaxdnn.cpu_isa(), "cpus": len(os.sched_getaffinity(0)), "digest": digest.hexdigest(),
                  "errors": errors}))
"""


def _rnn_child(cap, one_core=False, **sizes):
    """_RNN_CHILD's report, run under the JAXDNN_CPU_ISA cap `cap` (isa_child_report)."""
    return isa_child_report(f"CONFIG = {dict(sizes, one_core=one_core)!r}\n" + _RNN_CHILD, cap)


# The CPU kernel's per-step products in each build the CPU can run (JAXDNN_CPU_ISA caps the choice,
# made once per process): hidden size 20 (panels of 32, 16 or 8 columns, the last partial), 7 ragged
# rows in both directions (tiles of 1 to 4 running rows) and two layers.
@pytest.mark.parametrize("cap", ISA_ORDER)
def test_cpu_kernel_builds(cap):
    report = _rnn_child(cap, batch=7, steps=6, inputs=5, hidden=20, layers=2, bidirectional=True, scale=0.3,
                        lengths=[6, 1, 4, 6, 3, 0, 5])
    # lstm: y, h_n, c_n, dx, dh_0, dc_0, dw; gru and rnn_tanh: y, h_n, dx, dh_0, dw
    assert len(report["errors"]) == 17
    assert max(report["errors"]) < tolerance(jnp.float32, grad=True), report


@pytest.mark.skipif(on_gpu(), reason="the CPU kernels' thread split")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split over")
def test_cpu_one_row_products_split_over_threads():
    """One batch row of one direction is one chunk: on several cores, its per-step products are split
    by columns over a team of threads (rnn_cpu.cc's ForEachChunk, RoundTeam). A child process on one
    core (one thread in XLA's pool: no split) and one on every core give the same bits, within
    tolerance of float64 (hidden 300: 1200 gate columns forward, 300 backward, parts of at least 128)."""
    sizes = dict(batch=1, steps=5, inputs=7, hidden=300, layers=1, bidirectional=False, scale=0.05,
                 lengths=[4])
    one, every = (_rnn_child(ISA_ORDER[-1], one_core=pinned, **sizes) for pinned in (True, False))
    assert one["cpus"] == 1 and every["cpus"] >= 2, (one, every)
    assert len(every["errors"]) == 17
    assert max(every["errors"]) < tolerance(jnp.float32, grad=True), every
    assert one["digest"] == every["digest"], (one, every)


def _sharded_inputs(rng, mode, mesh):
    """Inputs with the batch (x's axis 0, the states' axis 1, seq_lengths) over the mesh axis "b"."""
    args, sizes = _inputs(rng, mode, (8, 4, 3, 5, 1, True, [4, 1, 3, 4, 0, 2, 4, 4]))
    x, states, weights, seq_lengths = args
    rows, per_row = NamedSharding(mesh, P("b")), NamedSharding(mesh, P(None, "b"))
    placed = (jax.device_put(x, rows), tuple(jax.device_put(s, per_row) for s in states), weights,
              jax.device_put(seq_lengths, rows))
    return args, placed, sizes


def _check_sharded(mode, out, grads, args, sizes, cts):
    want, want_grads = _vjp(_oracle, mode, _to64(args), cts, sizes)
    for name, o, w in zip(("y",) + _state_names(mode), out, want):
        assert_close(o, w, 1e-5, f"sharded {name}")
    names = ("x",) + _state_names(mode) + ("weights",)
    for name, g, w in zip(names, jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert_close(g, w, 1e-4, f"sharded d{name}")


@mode_param
def test_batch_sharded_runs_per_shard(mode, rng, devices):
    mesh = jax.sharding.Mesh(np.array(devices), ("b",))
    args, placed, sizes = _sharded_inputs(rng, mode, mesh)
    cts = _cotangents(rng, _ours(mode, *args, sizes))
    placed_cts = (jax.device_put(cts[0], placed[0].sharding),) + tuple(
        jax.device_put(c, s.sharding) for c, s in zip(cts[1:], placed[1]))
    hlo = _vjp.lower(_ours, mode, placed, placed_cts, sizes).compile().as_text()
    assert "all-gather" not in hlo
    calls = [line for line in hlo.splitlines() if f'custom_call_target="jaxdnn_{_name(mode)}_' in line]
    assert calls and all("f32[2,4,2,5]" in line for line in calls), calls  # 2 rows [T, D, H] per device
    out, grads = _vjp(_ours, mode, placed, placed_cts, sizes)
    _check_sharded(mode, out, grads, args, sizes, cts)
    assert out[0].sharding.spec[0] == "b"


@mode_param
def test_explicit_mesh_runs_per_shard(mode, rng, devices):
    if not hasattr(jax.sharding, "AxisType"):
        pytest.skip("needs Explicit mesh axes")
    mesh = jax.make_mesh((4,), ("b",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    args, placed, sizes = _sharded_inputs(rng, mode, mesh)
    cts = _cotangents(rng, _ours(mode, *args, sizes))
    with jax.set_mesh(mesh):
        out, grads = _vjp(_ours, mode, placed, cts, sizes)
    assert out[0].sharding.spec[0] == "b"
    _check_sharded(mode, out, grads, args, sizes, cts)


@mode_param
def test_inside_shard_map(mode, rng, devices):
    """Called inside the user's shard_map: each device runs its rows; the weight gradient of the
    whole batch is the sum over devices (the weights are replicated)."""
    mesh = jax.sharding.Mesh(np.array(devices), ("b",))
    args, _, sizes = _sharded_inputs(rng, mode, mesh)
    per_row = (P(None, "b"),) * len(args[1])
    per_device = jax.shard_map(lambda *a: _ours(mode, *a, sizes), mesh=mesh,
                               in_specs=(P("b"), per_row, P(), P("b")), out_specs=(P("b"), *per_row))
    cts = _cotangents(rng, _ours(mode, *args, sizes))
    out, grads = _vjp(lambda mode, *a: per_device(*a[:4]), mode, args, cts, sizes)
    _check_sharded(mode, out, grads, args, sizes, cts)


@mode_param
def test_export_round_trip(mode, rng):
    args, sizes = _inputs(rng, mode, CASES[3])
    x, states, weights, seq_lengths = args
    f = jax.jit(jax.grad(lambda x, w: jnp.sum(_ours(mode, x, states, w, seq_lengths, sizes)[0] ** 2),
                         argnums=(0, 1)))
    exported = jax.export.export(f, disabled_checks=jaxdnn.export_safety_checks())(x, weights)
    restored = jax.export.deserialize(exported.serialize())
    for got, want in zip(restored.call(x, weights), f(x, weights)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


@mode_param
def test_dropout_between_layers(mode, rng):
    """dropout > 0 with a key: the reference with the same key's masks, forward and gradients; the
    same key gives the same result, another key another one; a single layer has nothing to drop."""
    args, sizes = _inputs(rng, mode, (3, 6, 4, 5, 3, True, [6, 2, 4]))
    dropped = sizes[:3] + (0.4,) + sizes[4:]
    key = jax.random.key(3)

    def ours(mode, x, states, weights, seq_lengths, sizes, key=key):
        return _function(jaxdnn, mode)(x, *states, weights, seq_lengths, *sizes, dropout_rng=key)

    def oracle(mode, x, states, weights, seq_lengths, sizes):
        return _function(ref, mode)(x, *states, weights, seq_lengths, *sizes, dropout_rng=key)

    cts = _cotangents(rng, ours(mode, *args, dropped))
    out, grads = _vjp(ours, mode, args, cts, dropped)
    want, want_grads = _vjp(oracle, mode, _to64(args), cts, dropped)
    for name, o, w in zip(("y",) + _state_names(mode), out, want):
        assert_close(o, w, tolerance(jnp.float32), name)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert_close(g, w, tolerance(jnp.float32, grad=True), "grad")
    undropped = _ours(mode, *args, sizes)
    # Dropout changed y: far beyond rounding (the size of the change follows the random inputs; a
    # fixed 0.1 failed for some seeds).
    assert float(jnp.max(jnp.abs(out[0] - undropped[0]))) > 1e-3
    # The same key gives the same result (bit for bit in one program; the VJP's forward is another
    # program, whose XLA projections may round differently).
    again = ours(mode, *args, dropped)[0]
    np.testing.assert_array_equal(ours(mode, *args, dropped)[0], again)
    assert_close(again, out[0], tolerance(jnp.float32), "y again")
    other = ours(mode, *args, dropped, key=jax.random.key(4))[0]
    assert float(jnp.max(jnp.abs(other - out[0]))) > 1e-3
    one_layer, one_sizes = _inputs(rng, mode, (2, 4, 3, 5, 1, False, None))
    np.testing.assert_array_equal(ours(mode, *one_layer, one_sizes[:3] + (0.5,) + one_sizes[4:])[0],
                                  _ours(mode, *one_layer, one_sizes)[0])


def _bad_call(mode, **overrides):
    """lstm / gru / rnn on valid inputs (B=2, T=3, I=4, H=5, one layer, one direction) with some replaced."""
    f32 = jnp.float32
    args = dict(x=jnp.ones((2, 3, 4), f32), h_0=jnp.ones((1, 2, 5), f32),
                weights=jnp.ones((ref.weight_count(mode, 4, 5, 1, False),), f32),
                seq_lengths=jnp.full((2,), 3, jnp.int32), input_size=4, hidden_size=5, num_layers=1,
                dropout=0.0, bidirectional=False)
    if mode == "lstm":
        args["c_0"] = jnp.ones((1, 2, 5), f32)
    args.update(overrides)
    return _function(jaxdnn, mode)(**args)


BAD_INPUTS = [
    (dict(x=jnp.ones((2, 3, 4), jnp.int32)), TypeError, "x must be float32, bfloat16 or float16, got int32"),
    (dict(x=jnp.ones((2, 3, 6), jnp.float32)), ValueError, r"x must have shape \(B, T, input_size\)"),
    (dict(x=jnp.ones((3, 4), jnp.float32)), ValueError, "x must have shape"),
    (dict(h_0=jnp.ones((2, 2, 5), jnp.float32)), ValueError, r"h_0 must have shape .* = \(1, 2, 5\)"),
    (dict(h_0=jnp.ones((1, 2, 5), jnp.int32)), TypeError, "h_0 must be float32"),
    (dict(weights=jnp.ones((7,), jnp.float32)), ValueError, "weights must be a flat vector of"),
    (dict(bidirectional=True), ValueError, "h_0 must have shape"),
    (dict(seq_lengths=jnp.full((2,), 3, jnp.int64)), TypeError, "seq_lengths must be int32, got int64"),
    (dict(seq_lengths=jnp.full((3,), 3, jnp.int32)), ValueError,
     r"seq_lengths must have shape \(B,\) = \(2,\)"),
    (dict(dropout=0.5), ValueError, "dropout = 0.5 needs a dropout_rng key"),
    (dict(dropout=1.0, dropout_rng=jax.random.key(0)), ValueError, r"dropout must be a number in \[0, 1\)"),
    (dict(hidden_size=0), ValueError, "hidden_size must be an int >= 1"),
    (dict(num_layers=1.0), ValueError, "num_layers must be an int"),
    (dict(bidirectional=1), TypeError, "bidirectional must be a bool"),
]


@mode_param
@pytest.mark.parametrize("overrides,error,message", BAD_INPUTS, ids=[
    "x-int", "x-width", "x-rank", "h0-shape", "h0-dtype", "weights-size", "directions", "lengths-dtype",
    "lengths-shape", "dropout-key", "dropout-rate", "hidden", "layers", "bidirectional"])
def test_bad_input(mode, overrides, error, message):
    with pytest.raises(error, match=f"{_name(mode)}: {message}"):
        _bad_call(mode, **overrides)


def test_bad_lstm_cell_state():
    with pytest.raises(ValueError, match="lstm: c_0 must have shape"):
        _bad_call("lstm", c_0=jnp.ones((1, 3, 5), jnp.float32))
    with pytest.raises(ValueError, match="weights must be a flat vector of 220 elements"):
        _bad_call("lstm", weights=jnp.ones((165,), jnp.float32))  # a GRU's weights


def _scan_cells(mode, x, states, params, cell):
    """cell scanned over x [B, T, I] from states: (y [B, T, H], final states)."""
    def step(carry, xt):
        new = cell(xt, *carry, *params)
        new = new if isinstance(new, tuple) else (new,)
        return new, new[0]
    final, ys = jax.lax.scan(step, tuple(states), jnp.swapaxes(x, 0, 1))
    return jnp.swapaxes(ys, 0, 1), final


def _reference_cell(mode):
    """One step of the float64 reference (a one-step, one-layer sequence)."""
    def cell(x, *rest):
        *states, w_ih, w_hh, b_ih, b_hh = rest
        inputs, hidden = x.shape[1], states[0].shape[1]
        weights = ref.pack_weights([(w_ih, w_hh, b_ih, b_hh)])
        _, *new = _function(ref, mode)(x[:, None], *(s[None] for s in states), weights,
                                     jnp.ones(x.shape[:1], jnp.int32), inputs, hidden, 1, 0.0, False)
        new = tuple(n[0] for n in new)
        return new if mode == "lstm" else new[0]
    return cell


@mode_param
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_cell_in_a_scan(mode, dtype, rng):
    """lstm_cell / gru_cell / rnn_cell scanned over a sequence: the values and gradients of the
    reference."""
    args, sizes = _inputs(rng, mode, (3, 6, 4, 5, 1, False, None), dtype)
    x, states, weights, _ = args
    states = tuple(s[0] for s in states)
    params = ref.unpack_weights(weights, mode, *sizes[:3], False)[0]
    cell = _function(jaxdnn, mode, "_cell")
    ct = normal(rng, x.shape[:2] + (5,))

    def loss(cell, x, states, params, size=lambda a: a):
        y, final = _scan_cells(mode, x, states, params, cell)
        return jnp.sum(size(y * ct.astype(y.dtype))) + sum(jnp.sum(size(jnp.sin(f))) for f in final)

    got = jax.jit(jax.value_and_grad(functools.partial(loss, cell), argnums=(0, 1, 2)))(x, states, params)
    want_args = f64(x), tuple(map(f64, states)), tuple(map(f64, params))
    reference_loss = functools.partial(loss, _reference_cell(mode))
    want = jax.jit(jax.value_and_grad(reference_loss, argnums=(0, 1, 2)))(*want_args)
    # The loss sums terms of both signs: its error is relative to the terms' magnitudes, not the sum's.
    magnitude = float(reference_loss(*want_args, size=jnp.abs))
    assert abs(float(got[0]) - float(want[0])) <= tolerance(dtype) * magnitude, (got[0], want[0], magnitude)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        assert g.dtype == dtype or g.dtype == jnp.float32
        assert_close(g, w, tolerance(dtype, grad=True), "cell gradient")
    hlo = jax.jit(jax.grad(functools.partial(loss, cell))).lower(x, states, params).as_text()
    assert f"jaxdnn_{_name(mode)}_fwd_v4" in hlo and f"jaxdnn_{_name(mode)}_bwd_v3" in hlo


@mode_param
def test_cell_vmap_and_grad_of_grad(mode, rng):
    args, sizes = _inputs(rng, mode, (3, 1, 4, 5, 1, False, None))
    x, states, weights, _ = args
    x, states = x[:, 0], tuple(s[0] for s in states)
    params = ref.unpack_weights(weights, mode, *sizes[:3], False)[0]
    cell, oracle = _function(jaxdnn, mode, "_cell"), _reference_cell(mode)
    xs = normal(rng, (2,) + x.shape)
    got = jax.vmap(lambda x: cell(x, *states, *params))(xs)
    want = jax.vmap(lambda x: oracle(x, *map(f64, states), *map(f64, params)))(f64(xs))
    assert_close(jax.tree.leaves(got)[0], jax.tree.leaves(want)[0], 1e-5, "vmap")

    def penalty(cell, x, params):
        g = jax.grad(lambda x, p: sum(jnp.sum(jnp.sin(t)) for t in jax.tree.leaves(cell(x, *states, *p))),
                     argnums=(0, 1))(x, params)
        return sum(jnp.sum(t ** 2) for t in jax.tree.leaves(g))

    got = jax.grad(functools.partial(penalty, cell), argnums=(0, 1))(x, params)
    want = jax.grad(functools.partial(penalty, oracle), argnums=(0, 1))(f64(x), tuple(map(f64, params)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w, 1e-4, "cell grad of grad")


def test_cell_bad_input():
    f32 = jnp.float32
    x, h = jnp.ones((2, 4), f32), jnp.ones((2, 5), f32)
    w_ih, w_hh, b = jnp.ones((20, 4), f32), jnp.ones((20, 5), f32), jnp.ones((20,), f32)
    with pytest.raises(ValueError, match=r"lstm_cell: c must have shape \(B, H\)"):
        jaxdnn.lstm_cell(x, h, jnp.ones((3, 5), f32), w_ih, w_hh, b, b)
    with pytest.raises(ValueError, match=r"lstm_cell: w_hh must have shape \(20, 5\)"):
        jaxdnn.lstm_cell(x, h, h, w_ih, jnp.ones((20, 4), f32), b, b)
    with pytest.raises(ValueError, match=r"gru_cell: w_ih must have shape \(15, 4\)"):
        jaxdnn.gru_cell(x, h, w_ih, w_hh, b, b)
    with pytest.raises(ValueError, match=r"gru_cell: x must have shape \(B, I\)"):
        jaxdnn.gru_cell(x[None], h, w_ih, w_hh, b, b)
    with pytest.raises(TypeError, match="gru_cell: h must be float32"):
        jaxdnn.gru_cell(x, h.astype(jnp.int32), w_ih, w_hh, b, b)
    w_ih, w_hh, b = jnp.ones((5, 4), f32), jnp.ones((5, 5), f32), jnp.ones((5,), f32)
    with pytest.raises(ValueError, match=r"rnn_cell: b_hh must have shape \(5,\) \(G = 1H rows\)"):
        jaxdnn.rnn_cell(x, h, w_ih, w_hh, b, jnp.ones((15,), f32))
    with pytest.raises(ValueError, match="rnn_cell: nonlinearity must be 'tanh' or 'relu', got 'sigmoid'"):
        jaxdnn.rnn_cell(x, h, w_ih, w_hh, b, b, nonlinearity="sigmoid")


# (B, T, H) of the kernel-stage tests. On a GPU: one batch row, which runs in a thread-block cluster (3 units
# a block, the last of 14 blocks with one; a length short of T); a batch of 11 rows on the tensor-core cluster
# kernels (the TF32 forward and the backward; rows 8 to 10 in a second mma tile), at H 160 (forward: 12 units
# a block, the last of 14 with 4) and at H 352 (the plain RNN only: 24 units a block, the last of 15 with 16;
# the other cells' slices are too large); a small layer at one unit a block (the backward 2, in 8-warp
# blocks); 43 rows over 100 blocks of 3 units, in two batch chunks (129 (row, unit) pairs a block: the
# backward's 16-warp blocks); a layer whose H is a multiple of 32, where the TF32 forward reads its rows
# straight from L2 (9 rows: a partial second n tile; 9 units a block: 36 LSTM rows, two passes of m tiles;
# H a multiple of 64 too, where a bfloat16 forward may multiply bfloat16 copies of h); 130 rows, more (row,
# unit) pairs a block than threads in both kernels (their cells loop over the pairs); a layer whose W_hh
# slices do not fit in one SM's shared memory on a 132-SM Hopper, which takes the per-row kernel
# (rnn_persistent.h); and one whose slices fit over all 132 SMs but not over half of them, so that two
# directions take one launch each ("split", run with two directions only).
STAGE_SIZES = {"cluster": (1, 7, 40), "cluster-batch": (11, 5, 160), "cluster-batch-wide": (11, 4, 352),
               "small": (5, 6, 7), "chunks": (43, 5, 300), "direct": (9, 4, 1088), "rows": (130, 3, 640),
               "wide": (2, 3, {"lstm": 2048, "gru": 2304, "rnn_tanh": 4096, "rnn_relu": 4096}),
               "split": (3, 3, {"lstm": 1536, "gru": 1792, "rnn_tanh": 3072, "rnn_relu": 3072})}
# (D, reverse): the stage's directions, and whether direction 0 runs from each row's end.
STAGE_DIRECTIONS = {"forward": (1, False), "reverse": (1, True), "both": (2, False),
                    "both-reversed": (2, True)}
# The sizes are the GPU kernels' cases. On CPU the larger ones would only repeat the smaller ones at
# more cost: the CPU kernel's own paths (chunks of 16 rows, tiles of 4 rows with a tail as rows
# finish, column panels of 8 with a tail, the reduction's tail) are all in these four sizes.
STAGE_CPU_SIZES = ("cluster", "cluster-batch", "small", "chunks")
STAGE_LAYOUTS = [pytest.param(size, *directions, id=f"{size}-{name}") for size in STAGE_SIZES
                 for name, directions in STAGE_DIRECTIONS.items()
                 if (size != "split" or directions[0] == 2) and (on_gpu() or size in STAGE_CPU_SIZES)]


# The CPU kernels ignore tf32 and bf16_gradients (their products are exact): there the reduced cases
# would repeat the exact ones, so they run on a GPU only.
STAGE_TF32 = [False, True] if on_gpu() else [False]


def _persistent_backward(size, mode):
    """Whether a GPU runs the size's backward stage on the persistent kernel (rnn_persistent.cu), which
    rounds the gate gradients it passes between steps to bfloat16 when bf16_gradients allows: the
    others take the cluster kernels (at H 352 the plain RNN's alone) or the per-row kernel, exact."""
    return (size in ("small", "chunks", "direct", "rows", "split")
            or (size == "cluster-batch-wide" and mode in ("lstm", "gru")))


def _bf16_state(size):
    """Whether a GPU runs the size's forward stage on the persistent kernel with H a multiple of 64,
    which multiplies bfloat16 copies of h (a bfloat16 W_hh) when bf16_state allows."""
    return size in ("direct", "rows", "split")


@mode_param
@pytest.mark.parametrize("size, directions, reverse", STAGE_LAYOUTS)
@pytest.mark.parametrize("tf32", STAGE_TF32, ids=lambda t: "reduced" if t else "exact")
def test_kernel_stages_match_their_references(mode, size, directions, reverse, tf32, rng):
    """Each kernel stage (the FFI targets' contract, every result incl. the saved residuals and the
    zeros past each row's end) against its reference stage in float64, with bf16 W_hh, in one or two
    directions (direction 1 runs the other way). Reduced (the forward's tf32 and bf16_state, the
    backward's bf16_gradients): the persistent CUDA forward kernels round the state they multiply to
    TF32 (2^-11 relative), or to bfloat16 (2^-9) where H is a multiple of 64, and the persistent
    backward its gate gradients to bfloat16: looser tolerances, and on a GPU the rounding must show
    (the "wide" sizes run the exact per-row kernels, the cluster sizes' backward is within 2^-22 of
    exact); the CPU kernels stay exact."""
    from jaxdnn import recurrent as stages
    batch, steps, hidden = STAGE_SIZES[size]
    hidden = hidden[mode] if isinstance(hidden, dict) else hidden
    gates = ref.GATES[mode] * hidden
    lengths = rng.integers(-1, steps + 2, batch)
    lengths[0] = steps if batch > 1 else steps - 2  # one full row; a lone row short of T
    lengths = jnp.asarray(lengths, jnp.int32)
    gates_x = normal(rng, (batch, steps, directions, gates))
    w_hh = normal(rng, (directions, gates, hidden), jnp.bfloat16, scale=min(0.4, 1.5 / np.sqrt(hidden)))
    h0, c0 = normal(rng, (batch, directions, hidden)), normal(rng, (batch, directions, hidden))
    options = {}  # attributes beyond reverse, given to the reference as they are
    if mode == "lstm":
        fwd_args = (gates_x, w_hh, h0, c0, lengths)
        (fwd_prim, fwd_ref), (bwd_prim, bwd_ref) = stages._lstm_fwd, stages._lstm_bwd
    elif mode == "gru":
        fwd_args = (gates_x, w_hh, normal(rng, (directions, gates)), h0, lengths)
        (fwd_prim, fwd_ref), (bwd_prim, bwd_ref) = stages._gru_fwd, stages._gru_bwd
    else:
        fwd_args = (gates_x, w_hh, h0, lengths)
        (fwd_prim, fwd_ref), (bwd_prim, bwd_ref) = stages._rnn_fwd, stages._rnn_bwd
        options = dict(nonlinearity=mode.removeprefix("rnn_"))
    attrs = dict(reverse=np.int64(reverse), **options)
    bf16_state = tf32 and on_gpu() and _bf16_state(size)
    rounds = tf32 and on_gpu() and size != "wide"
    to64 = lambda args: [a if a.dtype == jnp.int32 else f64(a) for a in args]  # noqa: E731

    def forward(state):
        return jax.jit(lambda *a: fwd_prim.bind(*a, tf32=np.int64(tf32), bf16_state=np.int64(state),
                                                **attrs))(*fwd_args)

    got = forward(tf32)
    want = fwd_ref(*to64(fwd_args), reverse=reverse, **options)
    for g, w in zip(got, want):
        assert_close(g, w, 1e-2 if bf16_state else 5e-3 if tf32 else 1e-5, f"{mode} fwd stage")
    if rounds:
        assert max(rel_err(g, w) for g, w in zip(got, want)) > 1e-7, "the TF32 product ran exactly"
    if bf16_state:  # the product took the bfloat16 copies of h, not the TF32 state
        tf32_only = forward(False)
        for g, w in zip(tf32_only, want):
            assert_close(g, w, 5e-3, f"{mode} fwd stage, tf32 alone")
        assert max(rel_err(g, w) for g, w in zip(got, tf32_only)) > 1e-7, "bf16_state changed nothing"
    if mode == "lstm":
        h_seq, c_seq, acts = got[:3]
        cotangents = (normal(rng, h_seq.shape), normal(rng, h0.shape), normal(rng, c0.shape))
        bwd_args = (*cotangents, acts, c_seq, c0, w_hh, lengths)
    elif mode == "gru":
        h_seq, saved = got[:2]
        bwd_args = (normal(rng, h_seq.shape), normal(rng, h0.shape), saved, h_seq, h0, w_hh, lengths)
    else:
        h_seq = got[0]
        bwd_args = (normal(rng, h_seq.shape), normal(rng, h0.shape), h_seq, w_hh, lengths)
    got = jax.jit(lambda *a: bwd_prim.bind(*a, bf16_gradients=np.int64(tf32), **attrs))(*bwd_args)
    want = bwd_ref(*to64(bwd_args), reverse=reverse, **options)  # from the forward's (rounded) residuals
    bf16_rounds = tf32 and on_gpu() and _persistent_backward(size, mode)
    for g, w in zip(got, want):
        assert_close(g, w, 1e-2 if bf16_rounds else 1e-5, f"{mode} bwd stage")
    if bf16_rounds:
        assert max(rel_err(g, w) for g, w in zip(got, want)) > 1e-5, "the backward passed exact gradients"
    past_end = np.arange(steps)[None, :] >= np.minimum(np.asarray(lengths), steps)[:, None]
    assert np.all(np.asarray(got[0])[past_end] == 0)
