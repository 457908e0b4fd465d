"""Recurrent networks: a multi-layer, optionally bidirectional LSTM with cuDNN's flat weight layout,
a drop-in for `jax.experimental.rnn.lstm` on CPU and GPU, in float32, bfloat16 and float16.

Shapes: B batch rows, T time steps, I input features, H hidden units, G = 4H gates (i, f, g, o),
L layers, D directions (2 when bidirectional); pseudo-layer p = l D + d.

Per layer and direction:
- the input projection of every time step, gates_x = x W_ih^T + b_ih + b_hh [B, T, G], is one GEMM
  done by XLA (`jnp.einsum`, float32 results);
- the recurrence is the kernel stage `lstm_fwd` (target jaxdnn_lstm_fwd_v1): h_seq, c_seq, the gate
  activations (the backward's residuals) and the final states;
- backward through time is the kernel stage `lstm_bwd` (jaxdnn_lstm_bwd_v1): the gradient of
  gates_x and of the initial states; the weight gradients (dW_ih, dW_hh, the biases) and the input
  gradient are GEMMs / sums over dgates done by XLA afterwards.
Each stage is a primitive differentiated through `jaxdnn.reference.rnn` (second order works); the
whole stack is one `jax.custom_vjp`.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxdnn import _ffi  # noqa: F401  (registers the FFI targets)
from jaxdnn._primitive import explicit_row_sharding, ffi_primitive, match_varying, move_to_front
from jaxdnn.reference import rnn as _ref

_FLOAT_TYPES = [jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16)]
_F32 = jnp.float32


# --- the kernel stages ------------------------------------------------------------------------

def _fwd_avals(gates_x, w_hh, h0, c0, seq_lengths, **attrs):
    """(h_seq, c_seq [B, T, H], acts [B, T, G], h_n, c_n [B, H]), all float32."""
    batch, steps, gates = gates_x.shape
    per_unit = jax.core.ShapedArray((batch, steps, gates // 4), _F32)
    state = jax.core.ShapedArray((batch, gates // 4), _F32)
    return [per_unit, per_unit, jax.core.ShapedArray(gates_x.shape, _F32), state, state]


def _bwd_avals(dh_seq, dh_n, dc_n, acts, c_seq, c0, w_hh, seq_lengths, **attrs):
    """(dgates [B, T, G], dh0, dc0 [B, H]), all float32."""
    state = jax.core.ShapedArray(dh_n.shape, _F32)
    return [jax.core.ShapedArray(acts.shape, _F32), state, state]


def _fold_rows_batch_rule(prim, args, dims, *, weight_index, reference, **attrs):
    """vmap folds the mapped axis into the batch rows, [V, B, ...] -> [V B, ...] (unbatched operands
    broadcast), with W_hh shared. A batched W_hh (vmap over the weights) has no kernel: the stage
    runs through its reference in XLA."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if dims[weight_index] is not None:
        outs = jax.vmap(lambda *a: reference(*a, bool(attrs["reverse"])), in_axes=tuple(dims))(*args)
        return list(outs), [0] * len(outs)

    def fold(a, d):
        a = move_to_front(a, d, size)
        return a.reshape((size * a.shape[1],) + a.shape[2:])

    outs = prim.bind(*(a if i == weight_index else fold(a, d) for i, (a, d) in enumerate(zip(args, dims))),
                     **attrs)
    return [o.reshape((size, -1) + o.shape[1:]) for o in outs], [0] * len(outs)


_lstm_fwd = ffi_primitive(
    "jaxdnn_lstm_fwd", "jaxdnn_lstm_fwd_v1", result_avals=_fwd_avals,
    batch_rule=functools.partial(_fold_rows_batch_rule, weight_index=1, reference=_ref.lstm_fwd),
    sharding_rule="... t g, g h, ... h, ... h, ... -> ... t h, ... t h, ... t g, ... h, ... h")
_lstm_bwd = ffi_primitive(
    "jaxdnn_lstm_bwd", "jaxdnn_lstm_bwd_v1", result_avals=_bwd_avals,
    batch_rule=functools.partial(_fold_rows_batch_rule, weight_index=6, reference=_ref.lstm_bwd),
    sharding_rule="... t h, ... h, ... h, ... t g, ... t h, ... h, g h, ... -> ... t g, ... h, ... h")


def _with_reference_vjp(kernel, reference, *args):
    """kernel(*args), differentiated through reference(*args) (grad of grad of the whole op)."""
    fn = jax.custom_vjp(kernel)
    fn.defvjp(lambda *a: (kernel(*a), a), lambda a, ct: jax.vjp(reference, *a)[1](ct))
    return fn(*args)


def _fwd_stage(gates_x, w_hh, h0, c0, seq_lengths, reverse):
    """(h_seq, c_seq, acts, h_n, c_n) of one layer and direction."""
    return _with_reference_vjp(lambda *a: tuple(_lstm_fwd.bind(*a, reverse=np.int64(reverse))),
                               lambda *a: _ref.lstm_fwd(*a, reverse), gates_x, w_hh, h0, c0, seq_lengths)


def _bwd_stage(dh_seq, dh_n, dc_n, acts, c_seq, c0, w_hh, seq_lengths, reverse):
    """(dgates, dh0, dc0) of one layer and direction."""
    return _with_reference_vjp(lambda *a: tuple(_lstm_bwd.bind(*a, reverse=np.int64(reverse))),
                               lambda *a: _ref.lstm_bwd(*a, reverse),
                               dh_seq, dh_n, dc_n, acts, c_seq, c0, w_hh, seq_lengths)


# --- the differentiable stack -----------------------------------------------------------------

def _previous_states(h_seq, h0, seq_lengths, reverse):
    """h_prev [B, T, H]: the state each step started from (h0 at a row's first step), the right
    operand of dW_hh = sum_t dgates_t^T h_prev_t. Steps past a row's end have dgates = 0."""
    steps = h_seq.shape[1]
    zero = jnp.zeros_like(h_seq[:, :1])
    if reverse:
        shifted = jnp.concatenate([h_seq[:, 1:], zero], axis=1)
        first = jnp.arange(steps)[None, :] == _ref.valid_steps(seq_lengths, steps)[:, None] - 1
    else:
        shifted = jnp.concatenate([zero, h_seq[:, :-1]], axis=1)
        first = jnp.broadcast_to(jnp.arange(steps)[None, :] == 0, h_seq.shape[:2])
    return jnp.where(first[..., None], h0[:, None], shifted)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _lstm_stack(x, h_0, c_0, weights, seq_lengths, sizes, precision):
    """(y [B, T, D H] in x's dtype, h_n, c_n [L D, B, H] float32); h_0 and c_0 are float32.
    sizes = (input_size, hidden_size, num_layers, bidirectional)."""
    return _lstm_stack_fwd(x, h_0, c_0, weights, seq_lengths, sizes, precision)[0]


def _lstm_stack_fwd(x, h_0, c_0, weights, seq_lengths, sizes, precision):
    directions = 2 if sizes[3] else 1
    params = _ref.unpack_lstm_weights(weights, *sizes)
    layer_in, inputs, saved, h_n, c_n = x, [], [], [], []
    for layer in range(sizes[2]):
        inputs.append(layer_in)
        outputs = []
        for d in range(directions):
            p = layer * directions + d
            w_ih, w_hh, b_ih, b_hh = params[p]
            gates_x = _ref.project_inputs(layer_in, w_ih, b_ih, b_hh, precision)
            h_seq, c_seq, acts, h, c = _fwd_stage(gates_x, w_hh, h_0[p], c_0[p], seq_lengths, d == 1)
            saved.append((h_seq, c_seq, acts))
            h_n.append(h)
            c_n.append(c)
            outputs.append(h_seq.astype(x.dtype))
        layer_in = outputs[0] if directions == 1 else jnp.concatenate(outputs, axis=-1)
    results = (layer_in, jnp.stack(h_n), jnp.stack(c_n))
    return results, (inputs, saved, h_0, c_0, weights, seq_lengths)


def _lstm_stack_bwd(sizes, precision, residuals, cotangents):
    inputs, saved, h_0, c_0, weights, seq_lengths = residuals
    dy, dh_n, dc_n = cotangents
    hidden, layers, directions = sizes[1], sizes[2], 2 if sizes[3] else 1
    params = _ref.unpack_lstm_weights(weights, *sizes)
    grads = [None] * (layers * directions)
    dh_0, dc_0 = [None] * len(grads), [None] * len(grads)
    d_out = dy.astype(_F32)
    dot = functools.partial(jnp.einsum, precision=precision, preferred_element_type=_F32)
    for layer in reversed(range(layers)):
        layer_in, d_in = inputs[layer], []
        for d in range(directions):
            p = layer * directions + d
            w_ih, w_hh, _, _ = params[p]
            h_seq, c_seq, acts = saved[p]
            dgates, dh_0[p], dc_0[p] = _bwd_stage(d_out[..., d * hidden:(d + 1) * hidden], dh_n[p], dc_n[p],
                                                  acts, c_seq, c_0[p], w_hh, seq_lengths, d == 1)
            h_prev = _previous_states(h_seq, h_0[p], seq_lengths, d == 1)
            db = jnp.sum(dgates, axis=(0, 1))
            grads[p] = (dot("btg,bti->gi", dgates, layer_in.astype(_F32)), dot("btg,bth->gh", dgates, h_prev),
                        db, db)
            d_in.append(dot("btg,gi->bti", dgates, w_ih.astype(_F32)))
        d_out = functools.reduce(operator.add, d_in)
    dweights = _ref.pack_lstm_weights(grads).astype(weights.dtype)
    return (d_out.astype(inputs[0].dtype), jnp.stack(dh_0), jnp.stack(dc_0), dweights, None)


_lstm_stack.defvjp(_lstm_stack_fwd, _lstm_stack_bwd)


# --- public API -------------------------------------------------------------------------------

def _as_array(v):
    return v if hasattr(v, "shape") and hasattr(v, "dtype") else jnp.asarray(v)


def _positive_int(name, value, minimum=1):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"lstm: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _float_array(name, value):
    value = _as_array(value)
    if value.dtype not in _FLOAT_TYPES:
        raise TypeError(f"lstm: {name} must be float32, bfloat16 or float16, got {value.dtype}")
    return value


def lstm(x, h_0, c_0, weights, seq_lengths, input_size, hidden_size, num_layers, dropout, bidirectional,
         precision=None):
    """A multi-layer LSTM over whole sequences, with `jax.experimental.rnn.lstm`'s signature and
    results, so its `init_lstm_weight` and `unpack_lstm_weights` work unchanged.

    Args:
      x: [B, T, I] float32, bfloat16 or float16 (batch first).
      h_0, c_0: [L D, B, H] initial states, float32 (or bfloat16/float16; the state is carried in
        float32 either way).
      weights: [P] cuDNN's flat vector (see `jax.experimental.rnn`): (W_ih, W_hh) of every
        pseudo-layer, then (b_ih, b_hh) of every pseudo-layer; gates in the order (i, f, g, o).
        float32, bfloat16 or float16.
      seq_lengths: [B] int32. Row b runs over its first len_b = clip(seq_lengths[b], 0, T) steps:
        y is zero past them, h_n and c_n are the states after the last valid step (h_0 and c_0 when
        len_b = 0), and the reverse direction runs over each row's valid part from its end.
      input_size, hidden_size, num_layers: I, H, L.
      dropout: must be 0 (or False). Dropout between layers needs a PRNG key, which this signature
        has no place for: a ValueError until a keyed variant exists.
      bidirectional: D = 2 when True; y concatenates the directions' outputs on the last axis.
      precision: `lax.Precision` of the input-projection and weight-gradient GEMMs (XLA); the
        recurrence always multiplies exactly and accumulates in float32.

    Returns:
      (y [B, T, D H] in x's dtype, h_n [L D, B, H] in h_0's dtype, c_n [L D, B, H] in c_0's dtype).

    Differentiable with `jax.grad`/`jax.vjp` to any order (not with `jax.jvp`); the backward pass
    through time is a kernel, deterministic.
    """
    x, h_0, c_0, weights = (_float_array(n, v) for n, v in (("x", x), ("h_0", h_0), ("c_0", c_0),
                                                             ("weights", weights)))
    seq_lengths = _as_array(seq_lengths)
    input_size = _positive_int("input_size", input_size)
    hidden_size = _positive_int("hidden_size", hidden_size)
    num_layers = _positive_int("num_layers", num_layers)
    if not isinstance(bidirectional, (bool, np.bool_)):
        raise TypeError(f"lstm: bidirectional must be a bool, got {bidirectional!r}")
    bidirectional = bool(bidirectional)
    if dropout != 0:
        raise ValueError(f"lstm: dropout must be 0, got {dropout!r}: dropout between layers needs a PRNG "
                         "key, which jax.experimental.rnn.lstm's signature has no place for")
    if x.ndim != 3 or x.shape[2] != input_size:
        raise ValueError(f"lstm: x must have shape (B, T, input_size) = (B, T, {input_size}), got {x.shape}")
    batch = x.shape[0]
    states = (num_layers * (2 if bidirectional else 1), batch, hidden_size)
    for name, state in (("h_0", h_0), ("c_0", c_0)):
        if state.shape != states:
            raise ValueError(f"lstm: {name} must have shape (num_layers * directions, B, hidden_size) = "
                             f"{states}, got {state.shape}")
    count = _ref.lstm_weight_count(input_size, hidden_size, num_layers, bidirectional)
    if weights.shape != (count,):
        raise ValueError(f"lstm: weights must be a flat vector of {count} elements for input_size="
                         f"{input_size}, hidden_size={hidden_size}, num_layers={num_layers}, "
                         f"bidirectional={bidirectional}, got shape {weights.shape}")
    if seq_lengths.dtype != jnp.int32:
        raise TypeError(f"lstm: seq_lengths must be int32, got {seq_lengths.dtype}")
    if seq_lengths.shape != (batch,):
        raise ValueError(f"lstm: seq_lengths must have shape (B,) = ({batch},), got {seq_lengths.shape}")
    sizes = (input_size, hidden_size, num_layers, bidirectional)

    def run(x, h_0, c_0, weights, seq_lengths):
        # Inside shard_map the weights (and replicated states) vary like x, so their gradients are
        # summed over the devices' rows by the transpose of that cast.
        h_0, c_0, weights = match_varying(x, h_0.astype(_F32), c_0.astype(_F32), weights)
        return _lstm_stack(x, h_0, c_0, weights, seq_lengths, sizes, precision)

    # Batch rows sharded over Explicit mesh axes (part of x's type): each device runs its rows. Other
    # cases (no mesh, Auto axes) are partitioned by the primitives' own rule.
    explicit = explicit_row_sharding(x, whole_axes=2)
    if explicit is None:
        y, h_n, c_n = run(x, h_0, c_0, weights, seq_lengths)
    else:
        mesh, x_spec, axes = explicit
        rows = x_spec[0]
        state_spec = PartitionSpec(None, rows, None)
        y, h_n, c_n = jax.shard_map(
            run, mesh=mesh, in_specs=(x_spec, state_spec, state_spec, PartitionSpec(), PartitionSpec(rows)),
            out_specs=(x_spec, state_spec, state_spec),
            axis_names=set(axes))(x, h_0, c_0, weights, seq_lengths)
    return y, h_n.astype(h_0.dtype), c_n.astype(c_0.dtype)
