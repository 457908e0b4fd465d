"""lstm against the float64 reference (itself checked against jax.experimental.rnn.lstm_ref):
forward and VJP of every input over layers, directions, ragged and out-of-range seq_lengths, dtypes;
transforms, batch sharding, export, errors, and the custom calls in the HLO."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import rnn as jax_rnn
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdnn
from helpers import assert_close, dtype_id, f64, normal, tolerance
from jaxdnn.reference import rnn as ref

# (B, T, I, H, L, bidirectional, seq_lengths or None for all T)
CASES = [
    (3, 7, 5, 6, 1, False, None),
    (4, 6, 4, 3, 2, False, [6, 1, 3, 4]),
    (3, 7, 5, 6, 1, True, [7, 2, 5]),
    (2, 5, 3, 4, 2, True, [5, 3]),
    (1, 9, 3, 5, 1, True, None),
    (5, 4, 2, 7, 1, False, [0, 4, 1, 0, 2]),  # empty sequences keep their initial state
    (3, 5, 3, 4, 1, True, [-2, 9, 3]),         # out of range: clamped to [0, T]
]
case_param = pytest.mark.parametrize("case", CASES, ids=str)


def _inputs(rng, case, dtype=jnp.float32, state_dtype=jnp.float32):
    batch, steps, inputs, hidden, layers, bidirectional, lengths = case
    states = (layers * (2 if bidirectional else 1), batch, hidden)
    x = normal(rng, (batch, steps, inputs), dtype)
    h_0, c_0 = normal(rng, states, state_dtype), normal(rng, states, state_dtype)
    count = ref.lstm_weight_count(inputs, hidden, layers, bidirectional)
    weights = jnp.asarray(rng.uniform(-0.6, 0.6, count), dtype)
    seq_lengths = jnp.asarray([steps] * batch if lengths is None else lengths, jnp.int32)
    return (x, h_0, c_0, weights, seq_lengths), (inputs, hidden, layers, 0.0, bidirectional)


def _ours(x, h_0, c_0, weights, seq_lengths, sizes):
    return jaxdnn.lstm(x, h_0, c_0, weights, seq_lengths, *sizes)


@functools.partial(jax.jit, static_argnums=(5,))
def _oracle(x, h_0, c_0, weights, seq_lengths, sizes):
    return ref.lstm(f64(x), f64(h_0), f64(c_0), f64(weights), seq_lengths, *sizes)


def _cotangents(rng, outputs):
    return tuple(normal(rng, o.shape, o.dtype) for o in outputs)


def _vjp(fn, args, sizes, cts):
    """(outputs, grads of x, h_0, c_0, weights) of fn for the cotangents cts, under jit."""
    @jax.jit
    def run(x, h_0, c_0, weights, seq_lengths, cts):
        out, pullback = jax.vjp(lambda *a: fn(*a, seq_lengths, sizes), x, h_0, c_0, weights)
        return out, pullback(tuple(c.astype(o.dtype) for c, o in zip(cts, out)))
    return run(*args, cts)


def _check(args, sizes, cts, tol, grad_tol):
    out, grads = _vjp(_ours, args, sizes, cts)
    want, want_grads = _vjp(_oracle, [f64(a) for a in args[:4]] + [args[4]], sizes, cts)
    for name, o, w, a in zip(["y", "h_n", "c_n"], out, want, (args[0], args[1], args[2])):
        assert o.dtype == a.dtype, name
        assert_close(o, w, tol, name)
    for name, g, w, a in zip(["x", "h_0", "c_0", "weights"], grads, want_grads, args):
        assert g.dtype == a.dtype, name
        assert_close(g, w, grad_tol, f"d{name}")


@case_param
def test_reference_matches_jax_lstm_ref(case, rng):
    """The oracle is jax.experimental.rnn's own reference wherever that is defined (len >= 1)."""
    args, sizes = _inputs(rng, case)
    x, h_0, c_0, weights, seq_lengths = (*map(f64, args[:4]), args[4])
    lengths = np.asarray(seq_lengths)
    if lengths.min() < 1 or lengths.max() > x.shape[1]:
        pytest.skip("lstm_ref indexes step len - 1: defined for 1 <= len <= T only")
    unpacked = jax_rnn.unpack_lstm_weights(weights, sizes[0], sizes[1], sizes[2], sizes[4])
    want = jax_rnn.lstm_ref(x, h_0, c_0, *unpacked, seq_lengths, *sizes)
    for name, o, w in zip(["y", "h_n", "c_n"], _oracle(*args, sizes), want):
        assert_close(o, w, 1e-12, name)


@case_param
def test_forward_and_grad_f32(case, rng):
    args, sizes = _inputs(rng, case)
    cts = _cotangents(rng, _ours(*args, sizes))
    _check(args, sizes, cts, tolerance(jnp.float32), tolerance(jnp.float32, grad=True))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=dtype_id)
@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=str)
def test_forward_and_grad_half(case, dtype, rng):
    """Half-precision x and weights; the state stays float32 (h_0, c_0 float32 here)."""
    args, sizes = _inputs(rng, case, dtype)
    cts = _cotangents(rng, _ours(*args, sizes))
    _check(args, sizes, cts, tolerance(dtype), tolerance(dtype, grad=True))


def test_half_states_and_mixed_weights(rng):
    """bfloat16 states come back in bfloat16; float32 weights (init_lstm_weight's) with bf16 x."""
    case = CASES[2]
    args, sizes = _inputs(rng, case, jnp.bfloat16, state_dtype=jnp.bfloat16)
    args = (args[0], args[1], args[2], args[3].astype(jnp.float32), args[4])
    cts = _cotangents(rng, _ours(*args, sizes))
    _check(args, sizes, cts, tolerance(jnp.bfloat16), tolerance(jnp.bfloat16, grad=True))


def test_init_lstm_weight_and_long_sequence(rng):
    """jax.experimental.rnn's own initializer, a longer sequence and a wider layer."""
    batch, steps, inputs, hidden = 2, 40, 24, 33
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    weights = jax_rnn.init_lstm_weight(key, inputs, hidden, 1, True)
    args, sizes = _inputs(rng, (batch, steps, inputs, hidden, 1, True, [40, 17]))
    args = (args[0], args[1], args[2], weights, args[4])
    cts = _cotangents(rng, _ours(*args, sizes))
    _check(args, sizes, cts, tolerance(jnp.float32), tolerance(jnp.float32, grad=True))


@pytest.mark.parametrize("batch,steps", [(0, 4), (3, 0)], ids=["no-rows", "no-steps"])
def test_empty(batch, steps, rng):
    args, sizes = _inputs(rng, (batch, steps, 3, 4, 2, True, [steps] * batch))
    y, h_n, c_n = jax.jit(lambda *a: _ours(*a, sizes))(*args)
    assert y.shape == (batch, steps, 8)
    np.testing.assert_array_equal(h_n, args[1])  # no step ran: the final state is the initial one
    np.testing.assert_array_equal(c_n, args[2])
    grad = jax.grad(lambda h: jnp.sum(_ours(args[0], h, *args[2:], sizes)[1]))(args[1])
    np.testing.assert_array_equal(grad, jnp.ones_like(args[1]))


def test_transforms(rng):
    case = (3, 5, 4, 5, 2, True, [5, 2, 4])
    args, sizes = _inputs(rng, case)
    x, h_0, c_0, weights, seq_lengths = args
    xs = normal(rng, (3, 2) + x.shape[1:])  # vmapped axis 1: [B, V, T, I]

    def y_of(fn, x, h_0, c_0, weights):
        return fn(x, h_0, c_0, weights, seq_lengths, sizes)[0]

    over_x = dict(in_axes=(1, None, None, None), out_axes=1)
    got = jax.vmap(functools.partial(y_of, _ours), **over_x)(xs, h_0, c_0, weights)
    want = jax.vmap(functools.partial(y_of, _oracle), **over_x)(f64(xs), f64(h_0), f64(c_0), f64(weights))
    assert_close(got, want, 1e-5, "vmap over x (axis 1), states and weights unbatched")
    many_weights = jnp.stack([weights, weights[::-1]])
    got = jax.vmap(functools.partial(y_of, _ours), in_axes=(None, None, None, 0))(x, h_0, c_0, many_weights)
    want = jax.vmap(functools.partial(y_of, _oracle), in_axes=(None, None, None, 0))(
        f64(x), f64(h_0), f64(c_0), f64(many_weights))
    assert_close(got, want, 1e-5, "vmap over the weights (reference path)")
    ct = normal(rng, (2,) + x.shape[:2] + (10,))

    def loss(fn, x, h_0, c_0, weights, ct):
        return jnp.sum(jnp.sin(y_of(fn, x, h_0, c_0, weights)) * ct.astype(x.dtype))

    over_examples = dict(in_axes=(1, None, None, None, 0))
    per_example = jax.vmap(jax.grad(functools.partial(loss, _ours), argnums=(0, 3)), **over_examples)
    per_example_want = jax.vmap(jax.grad(functools.partial(loss, _oracle), argnums=(0, 3)), **over_examples)
    for name, g, w in zip(["x", "weights"], per_example(xs, h_0, c_0, weights, ct),
                          per_example_want(f64(xs), f64(h_0), f64(c_0), f64(weights), f64(ct))):
        assert_close(g, w, 1e-4, f"vmap(grad) {name}")

    def penalty(fn, *a):
        g = jax.grad(lambda *a: loss(fn, *a, ct[0]), argnums=(0, 1, 2, 3))(*a)
        return sum(jnp.sum(t ** 2) for t in g)

    got = jax.jit(jax.grad(functools.partial(penalty, _ours), argnums=(0, 1, 2, 3)))(x, h_0, c_0, weights)
    want = jax.jit(jax.grad(functools.partial(penalty, _oracle), argnums=(0, 1, 2, 3)))(*map(f64, args[:4]))
    for name, g, w in zip(["x", "h_0", "c_0", "weights"], got, want):
        assert_close(g, w, 1e-4, f"grad of grad {name}")

    def scanned(fn, x, weights):
        step = jax.checkpoint(lambda h: fn(h, h_0.astype(h.dtype), c_0.astype(h.dtype), weights, seq_lengths,
                                           (10, 5, 2, 0.0, True))[0])
        h, _ = jax.lax.scan(lambda h, _: (step(h), None), x, None, length=2)
        return jnp.sum(h * ct[0].astype(h.dtype))

    wide = normal(rng, x.shape[:2] + (10,))
    wide_weights = jnp.asarray(rng.uniform(-0.5, 0.5, ref.lstm_weight_count(10, 5, 2, True)), jnp.float32)
    got = jax.grad(functools.partial(scanned, _ours), argnums=(0, 1))(wide, wide_weights)
    want = jax.grad(functools.partial(scanned, _oracle), argnums=(0, 1))(f64(wide), f64(wide_weights))
    for name, g, w in zip(["x", "weights"], got, want):
        assert_close(g, w, 1e-4, f"scan(checkpoint) {name}")
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda x: _ours(x, h_0, c_0, weights, seq_lengths, sizes)[0], (x,), (x,))


def test_hlo_holds_the_custom_calls(rng):
    args, sizes = _inputs(rng, CASES[2])
    hlo = jax.jit(jax.grad(lambda x, w: jnp.sum(_ours(x, *args[1:3], w, args[4], sizes)[0] ** 2),
                           argnums=(0, 1))).lower(args[0], args[3]).as_text()
    for target in ["jaxdnn_lstm_fwd_v1", "jaxdnn_lstm_bwd_v1"]:
        assert hlo.count(target) >= 2, target  # one per direction


def test_deterministic(rng):
    args, sizes = _inputs(rng, (6, 8, 5, 9, 2, True, [8, 3, 7, 1, 8, 5]))
    cts = _cotangents(rng, _ours(*args, sizes))
    first, second = _vjp(_ours, args, sizes, cts), _vjp(_ours, args, sizes, cts)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(a, b)


def _sharded_inputs(rng, mesh):
    args, sizes = _inputs(rng, (8, 4, 3, 5, 1, True, [4, 1, 3, 4, 0, 2, 4, 4]))
    rows, states = NamedSharding(mesh, P("b")), NamedSharding(mesh, P(None, "b"))
    x, h_0, c_0, weights, seq_lengths = args
    placed = (jax.device_put(x, rows), jax.device_put(h_0, states), jax.device_put(c_0, states), weights,
              jax.device_put(seq_lengths, rows))
    return args, placed, sizes


def test_batch_sharded_runs_per_shard(rng, devices):
    mesh = jax.sharding.Mesh(np.array(devices), ("b",))
    args, placed, sizes = _sharded_inputs(rng, mesh)
    cts = _cotangents(rng, _ours(*args, sizes))
    placed_cts = tuple(jax.device_put(c, p.sharding) for c, p in zip(cts, placed))

    def step(x, h_0, c_0, weights, seq_lengths, cts):
        out, pullback = jax.vjp(lambda *a: _ours(*a, seq_lengths, sizes), x, h_0, c_0, weights)
        return out, pullback(cts)

    hlo = jax.jit(step).lower(*placed, placed_cts).compile().as_text()
    assert "all-gather" not in hlo
    calls = [line for line in hlo.splitlines() if 'custom_call_target="jaxdnn_lstm_' in line]
    assert calls and all("f32[2,4,20]" in line for line in calls), calls  # 2 rows [T, 4H] per device
    out, grads = jax.jit(step)(*placed, placed_cts)
    want, want_grads = _vjp(_oracle, [f64(a) for a in args[:4]] + [args[4]], sizes, cts)
    for name, o, w in zip(["y", "h_n", "c_n"], out, want):
        assert_close(o, w, 1e-5, f"sharded {name}")
    for name, g, w in zip(["x", "h_0", "c_0", "weights"], grads, want_grads):
        assert_close(g, w, 1e-4, f"sharded d{name}")
    assert out[0].sharding.spec[0] == "b"


def test_export_round_trip(rng):
    args, sizes = _inputs(rng, CASES[3])
    f = jax.jit(jax.grad(lambda x, w: jnp.sum(_ours(x, *args[1:3], w, args[4], sizes)[0] ** 2),
                         argnums=(0, 1)))
    exported = jax.export.export(f, disabled_checks=jaxdnn.export_safety_checks())(args[0], args[3])
    restored = jax.export.deserialize(exported.serialize())
    for got, want in zip(restored.call(args[0], args[3]), f(args[0], args[3])):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def _bad_call(**overrides):
    """lstm on valid inputs (B=2, T=3, I=4, H=5, one layer, one direction) with some replaced."""
    f32 = jnp.float32
    args = dict(x=jnp.ones((2, 3, 4), f32), h_0=jnp.ones((1, 2, 5), f32), c_0=jnp.ones((1, 2, 5), f32),
                weights=jnp.ones((ref.lstm_weight_count(4, 5, 1, False),), f32),
                seq_lengths=jnp.full((2,), 3, jnp.int32), input_size=4, hidden_size=5, num_layers=1,
                dropout=0.0, bidirectional=False)
    args.update(overrides)
    return jaxdnn.lstm(**args)


@pytest.mark.parametrize("overrides,error,message", [
    (dict(x=jnp.ones((2, 3, 4), jnp.int32)), TypeError, "x must be float32, bfloat16 or float16, got int32"),
    (dict(x=jnp.ones((2, 3, 6), jnp.float32)), ValueError, r"x must have shape \(B, T, input_size\)"),
    (dict(x=jnp.ones((3, 4), jnp.float32)), ValueError, "x must have shape"),
    (dict(h_0=jnp.ones((2, 2, 5), jnp.float32)), ValueError, r"h_0 must have shape .* = \(1, 2, 5\)"),
    (dict(c_0=jnp.ones((1, 3, 5), jnp.float32)), ValueError, "c_0 must have shape"),
    (dict(c_0=jnp.ones((1, 2, 5), jnp.int32)), TypeError, "c_0 must be float32"),
    (dict(weights=jnp.ones((7,), jnp.float32)), ValueError, "weights must be a flat vector of 220 elements"),
    (dict(bidirectional=True), ValueError, "h_0 must have shape"),
    (dict(seq_lengths=jnp.full((2,), 3, jnp.int64)), TypeError, "seq_lengths must be int32, got int64"),
    (dict(seq_lengths=jnp.full((3,), 3, jnp.int32)), ValueError,
     r"seq_lengths must have shape \(B,\) = \(2,\)"),
    (dict(dropout=0.5), ValueError, "dropout must be 0"),
    (dict(hidden_size=0), ValueError, "hidden_size must be an int >= 1"),
    (dict(num_layers=1.0), ValueError, "num_layers must be an int"),
    (dict(bidirectional=1), TypeError, "bidirectional must be a bool"),
], ids=["x-int", "x-width", "x-rank", "h0-shape", "c0-shape", "c0-dtype", "weights-size", "directions",
        "lengths-dtype", "lengths-shape", "dropout", "hidden", "layers", "bidirectional"])
def test_bad_input(overrides, error, message):
    with pytest.raises(error, match=message):
        _bad_call(**overrides)


def test_explicit_mesh_runs_per_shard(rng, devices):
    if not hasattr(jax.sharding, "AxisType"):
        pytest.skip("needs Explicit mesh axes")
    mesh = jax.make_mesh((4,), ("b",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    args, placed, sizes = _sharded_inputs(rng, mesh)
    cts = _cotangents(rng, _ours(*args, sizes))
    want, want_grads = _vjp(_oracle, [f64(a) for a in args[:4]] + [args[4]], sizes, cts)
    with jax.set_mesh(mesh):
        out, grads = _vjp(_ours, placed, sizes, cts)
    assert out[0].sharding.spec[0] == "b"
    for name, o, w in zip(["y", "h_n", "c_n"], out, want):
        assert_close(o, w, 1e-5, f"explicit {name}")
    for name, g, w in zip(["x", "h_0", "c_0", "weights"], grads, want_grads):
        assert_close(g, w, 1e-4, f"explicit d{name}")


def test_inside_shard_map(rng, devices):
    """Called inside the user's shard_map: each device runs its rows; the weight gradient of the
    whole batch is the sum over devices (the weights are replicated)."""
    mesh = jax.sharding.Mesh(np.array(devices), ("b",))
    args, _, sizes = _sharded_inputs(rng, mesh)
    states = P(None, "b")
    per_device = jax.shard_map(lambda *a: _ours(*a, sizes), mesh=mesh,
                               in_specs=(P("b"), states, states, P(), P("b")),
                               out_specs=(P("b"), states, states))
    cts = _cotangents(rng, _ours(*args, sizes))
    out, grads = _vjp(lambda *a: per_device(*a[:5]), args, None, cts)
    want, want_grads = _vjp(_oracle, [f64(a) for a in args[:4]] + [args[4]], sizes, cts)
    for name, o, w in zip(["y", "h_n", "c_n"], out, want):
        assert_close(o, w, 1e-5, f"shard_map {name}")
    for name, g, w in zip(["x", "h_0", "c_0", "weights"], grads, want_grads):
        assert_close(g, w, 1e-4, f"shard_map d{name}")
