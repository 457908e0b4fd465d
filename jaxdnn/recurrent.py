"""Recurrent networks over whole sequences with cuDNN's flat weight layout: a multi-layer, optionally
bidirectional LSTM (a drop-in for `jax.experimental.rnn.lstm`), GRU (cuDNN's formulation) and plain
(Elman) RNN with a tanh or relu nonlinearity, on CPU and GPU, in float32, bfloat16 and float16.

Shapes: B batch rows, T time steps, I input features, H hidden units, G gate rows (LSTM 4H: i, f,
g, o; GRU 3H: r, z, n; plain RNN H), L layers, D directions (2 when bidirectional); pseudo-layer
p = l D + d. Internally `mode` is cuDNN's name of the cell: "lstm", "gru", "rnn_tanh", "rnn_relu".

Per layer, its D directions together:
- the input projection of every time step, gates_x = x W_ih^T + biases [B, T, D, G], is one GEMM done
  by XLA (`jnp.einsum`, float32 results);
- the recurrence is a kernel stage (`jaxdnn_lstm_fwd_v4`, `jaxdnn_gru_fwd_v4`, `jaxdnn_rnn_fwd_v4`):
  the hidden states [B, T, D, H] (so the layer's output, its directions side by side, is a
  reshape), the gate activations the backward needs, and the final states [B, D, H];
- backward through time is a kernel stage (`jaxdnn_lstm_bwd_v3`, `jaxdnn_gru_bwd_v3`,
  `jaxdnn_rnn_bwd_v3`): the gradients of gates_x, of the recurrent pre-activations (the same for the
  LSTM and the plain RNN) and of the initial states; the weight and bias gradients and the input
  gradient are GEMMs / sums over those, done by XLA after (float32 sums; for a bfloat16 W at the
  reduced precisions below, bfloat16 operands, as in XLA's autodiff of a bfloat16 layer).
`precision` None, DEFAULT or HIGH lets the CUDA kernels take reduced-precision recurrent products
(the stages' attributes tf32, bf16_state and bf16_gradients: TF32 forward products, and a bfloat16
W_hh's forward multiplying its state rounded to bfloat16 and its backward passing its gate gradients
from step to step in bfloat16), as XLA and cuDNN do at those precisions.
Each stage is a primitive differentiated through `jaxdnn.reference.rnn` (second order works); the
whole stack is one `jax.custom_vjp`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxdnn import _ffi  # noqa: F401  (registers the FFI targets)
from jaxdnn._precision import allows_tf32
from jaxdnn._primitive import (explicit_row_sharding, ffi_primitive, match_varying, move_to_front,
                               with_reference_vjp)
from jaxdnn.reference import rnn as _ref

_FLOAT_TYPES = [jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16)]
_F32 = jnp.float32


# --- the kernel stages ------------------------------------------------------------------------
# Each stage runs a layer's D directions at once: per-step operands [B, T, D, ...], states [B, D, H],
# weights [D, ...]; direction 0 runs in time order (reversed when the attribute reverse is 1),
# direction 1 the other way.

def _fwd_avals(gates_x, w_hh, h0, c0, seq_lengths, **attrs):
    """(h_seq, c_seq [B, T, D, H], acts [B, T, D, G], h_n, c_n [B, D, H]), all float32."""
    per_unit = jax.core.ShapedArray(gates_x.shape[:3] + (gates_x.shape[3] // 4,), _F32)
    state = jax.core.ShapedArray(h0.shape, _F32)
    return [per_unit, per_unit, jax.core.ShapedArray(gates_x.shape, _F32), state, state]


def _bwd_avals(dh_seq, dh_n, dc_n, acts, c_seq, c0, w_hh, seq_lengths, **attrs):
    """(dgates [B, T, D, G], dh0, dc0 [B, D, H]), all float32."""
    state = jax.core.ShapedArray(dh_n.shape, _F32)
    return [jax.core.ShapedArray(acts.shape, _F32), state, state]


def _gru_fwd_avals(gates_x, w_hh, b_hh, h0, seq_lengths, **attrs):
    """(h_seq [B, T, D, H], saved [B, T, D, 4H], h_n [B, D, H]), all float32."""
    hidden = gates_x.shape[3] // 3
    return [jax.core.ShapedArray(gates_x.shape[:3] + (hidden,), _F32),
            jax.core.ShapedArray(gates_x.shape[:3] + (4 * hidden,), _F32),
            jax.core.ShapedArray(h0.shape, _F32)]


def _gru_bwd_avals(dh_seq, dh_n, saved, h_seq, h0, w_hh, seq_lengths, **attrs):
    """(dgates_x, dgates_h [B, T, D, 3H], dh0 [B, D, H]), all float32."""
    gates = jax.core.ShapedArray(h_seq.shape[:3] + (3 * h_seq.shape[3],), _F32)
    return [gates, gates, jax.core.ShapedArray(dh_n.shape, _F32)]


def _rnn_fwd_avals(gates_x, w_hh, h0, seq_lengths, **attrs):
    """(h_seq [B, T, D, H], h_n [B, D, H]), float32 (G = H)."""
    return [jax.core.ShapedArray(gates_x.shape, _F32), jax.core.ShapedArray(h0.shape, _F32)]


def _rnn_bwd_avals(dh_seq, dh_n, h_seq, w_hh, seq_lengths, **attrs):
    """(dgates [B, T, D, H], dh0 [B, D, H]), float32."""
    return [jax.core.ShapedArray(h_seq.shape, _F32), jax.core.ShapedArray(dh_n.shape, _F32)]


def _over_directions(reference, shared):
    """A stage's reference over its D directions, from `reference`, one direction's function of
    [B, T, ...] / [B, H] operands, weights [G, ...] and (..., seq_lengths, reverse, **options);
    `shared` are the indices of the weight operands. Direction d runs reversed when reverse != (d == 1)."""
    def run(*operands, reverse, **options):
        directions = operands[shared[0]].shape[0]
        per_row = [i for i in range(len(operands) - 1) if i not in shared]  # seq_lengths is last
        outs = []
        for d in range(directions):
            ops = list(operands)
            for i in shared:
                ops[i] = operands[i][d]
            for i in per_row:  # states [B, D, H], per-step operands [B, T, D, ...]
                ops[i] = operands[i][:, d] if operands[i].ndim == 3 else operands[i][:, :, d]
            outs.append(reference(*ops, bool(reverse) != (d == 1), **options))
        return tuple(jnp.stack(o, axis=o[0].ndim - 1) for o in zip(*outs))
    return run


def _fold_rows_batch_rule(prim, args, dims, *, shared, reference, **attrs):
    """vmap folds the mapped axis into the batch rows, [V, B, ...] -> [V B, ...] (unbatched operands
    broadcast), with the operands at indices `shared` (W_hh, b_hh) shared. Batched ones (vmap over
    the weights) have no kernel: the stage runs through its reference in XLA, given the attributes
    as keywords (reverse as a bool, the plain RNN's nonlinearity as is)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if any(dims[i] is not None for i in shared):
        options = dict(attrs, reverse=bool(attrs["reverse"]))
        for name in _KERNEL_ATTRS:  # the reference's products run at JAX's default precision
            options.pop(name, None)
        outs = jax.vmap(lambda *a: reference(*a, **options), in_axes=tuple(dims))(*args)
        return list(outs), [0] * len(outs)

    def fold(a, d):
        a = move_to_front(a, d, size)
        return a.reshape((size * a.shape[1],) + a.shape[2:])

    outs = prim.bind(*(a if i in shared else fold(a, d) for i, (a, d) in enumerate(zip(args, dims))), **attrs)
    return [o.reshape((size, -1) + o.shape[1:]) for o in outs], [0] * len(outs)


def _primitive(name, version, result_avals, shared, reference, sharding_rule):
    """(the stage's primitive, its reference over the D directions)."""
    reference = _over_directions(reference, shared)
    batch_rule = functools.partial(_fold_rows_batch_rule, shared=shared, reference=reference)
    prim = ffi_primitive(f"jaxdnn_{name}", f"jaxdnn_{name}_v{version}", result_avals=result_avals,
                         batch_rule=batch_rule, sharding_rule=sharding_rule)
    return prim, reference


_lstm_fwd = _primitive("lstm_fwd", 4, _fwd_avals, (1,), _ref.lstm_fwd,
                       "... t d g, d g h, ... d h, ... d h, ... "
                       "-> ... t d h, ... t d h, ... t d g, ... d h, ... d h")
_lstm_bwd = _primitive("lstm_bwd", 3, _bwd_avals, (6,), _ref.lstm_bwd,
                       "... t d h, ... d h, ... d h, ... t d g, ... t d h, ... d h, d g h, ... "
                       "-> ... t d g, ... d h, ... d h")
_gru_fwd = _primitive("gru_fwd", 4, _gru_fwd_avals, (1, 2), _ref.gru_fwd,
                      "... t d g, d g h, d g, ... d h, ... -> ... t d h, ... t d s, ... d h")
_gru_bwd = _primitive("gru_bwd", 3, _gru_bwd_avals, (5,), _ref.gru_bwd,
                      "... t d h, ... d h, ... t d s, ... t d h, ... d h, d g h, ... "
                      "-> ... t d g, ... t d g, ... d h")
_rnn_fwd = _primitive("rnn_fwd", 4, _rnn_fwd_avals, (1,), _ref.rnn_fwd,
                      "... t d g, d g h, ... d h, ... -> ... t d h, ... d h")
_rnn_bwd = _primitive("rnn_bwd", 3, _rnn_bwd_avals, (3,), _ref.rnn_bwd,
                      "... t d h, ... d h, ... t d h, d g h, ... -> ... t d g, ... d h")


# The stages' attributes that only choose the kernels' precision (the references ignore them): tf32
# (forward: TF32 recurrent products), bf16_state (forward: a bfloat16 W_hh's products of the state
# rounded to bfloat16) and bf16_gradients (backward: a bfloat16 W_hh's gate gradients passed between
# steps in bfloat16).
_KERNEL_ATTRS = ("tf32", "bf16_state", "bf16_gradients")


def _stage(stage, *operands, **options):
    """A kernel stage (a pair from `_primitive`) of one layer, direction 0 in time order,
    differentiated through its reference; `options` are further attributes: those of _KERNEL_ATTRS
    (bools) go to the kernel alone, the others (the plain RNN's nonlinearity) to the reference too,
    as they are."""
    prim, reference = stage
    attrs = {k: np.int64(v) if k in _KERNEL_ATTRS else v for k, v in options.items()}
    reference_options = {k: v for k, v in options.items() if k not in _KERNEL_ATTRS}
    return with_reference_vjp(lambda *a: tuple(prim.bind(*a, reverse=np.int64(0), **attrs)),
                               lambda *a: reference(*a, reverse=False, **reference_options), *operands)


# --- the differentiable stack -----------------------------------------------------------------

def _nonlinearity(mode):
    """The plain RNN's nonlinearity, "tanh" or "relu", from its mode "rnn_tanh" or "rnn_relu"."""
    return mode.removeprefix("rnn_")


def _project_inputs(layer_in, w_ih, bias, precision):
    """gates_x = x W_ih[d]^T + bias[d] [B, T, D, G] in float32 (float64 for float64 inputs), from
    layer_in [B, T, I], w_ih [D, G, I] and bias [D, G]."""
    dtype = jnp.result_type(_F32, layer_in.dtype, w_ih.dtype)
    gates = jnp.einsum("bti,dgi->btdg", layer_in, w_ih, precision=precision, preferred_element_type=dtype)
    return gates + bias.astype(dtype)


def _layer_fwd(mode, layer_in, params, inits, seq_lengths, precision):
    """One layer in its D directions: (h_seq [B, T, D, H], residuals, final states [B, D, H]).
    params: (w_ih [D, G, I], w_hh [D, G, H], b_ih, b_hh [D, G]); inits: the states [B, D, H]."""
    w_ih, w_hh, b_ih, b_hh = params
    allowed = allows_tf32(precision)
    reduced = dict(tf32=allowed, bf16_state=allowed)  # the kernel's reduced-precision products
    if mode == "gru":
        gates_x = _project_inputs(layer_in, w_ih, b_ih, precision)  # b_hh is inside the reset gate
        h_seq, saved, h_n = _stage(_gru_fwd, gates_x, w_hh, b_hh.astype(_F32), inits[0], seq_lengths,
                                   **reduced)
        return h_seq, (saved,), (h_n,)
    # The LSTM and the plain RNN: both biases fold into the projection.
    gates_x = _project_inputs(layer_in, w_ih, _ref.folded_bias(b_ih, b_hh), precision)
    if mode == "lstm":
        h_seq, c_seq, acts, h_n, c_n = _stage(_lstm_fwd, gates_x, w_hh, *inits, seq_lengths, **reduced)
        return h_seq, (c_seq, acts), (h_n, c_n)
    h_seq, h_n = _stage(_rnn_fwd, gates_x, w_hh, inits[0], seq_lengths, nonlinearity=_nonlinearity(mode),
                        **reduced)
    return h_seq, (), (h_n,)  # act' comes from h_seq itself


def _layer_bwd(mode, dh_seq, d_finals, h_seq, residuals, inits, w_hh, seq_lengths, precision):
    """Backward through time of one layer in its D directions: (dgates_x, dgates_h [B, T, D, G],
    d_inits [B, D, H]), dgates_h the gradient of the recurrent pre-activations W_hh h_prev + b_hh."""
    reduced = allows_tf32(precision)
    if mode == "lstm":
        c_seq, acts = residuals
        dgates, dh0, dc0 = _stage(_lstm_bwd, dh_seq, *d_finals, acts, c_seq, inits[1], w_hh, seq_lengths,
                                  bf16_gradients=reduced)
        return dgates, dgates, (dh0, dc0)
    if mode == "gru":
        dgates_x, dgates_h, dh0 = _stage(_gru_bwd, dh_seq, d_finals[0], residuals[0], h_seq, inits[0],
                                         w_hh, seq_lengths, bf16_gradients=reduced)
        return dgates_x, dgates_h, (dh0,)
    dgates, dh0 = _stage(_rnn_bwd, dh_seq, d_finals[0], h_seq, w_hh, seq_lengths, bf16_gradients=reduced,
                         nonlinearity=_nonlinearity(mode))
    return dgates, dgates, (dh0,)


def _previous_states(h_seq, h0, seq_lengths):
    """h_prev [B, T, D, H]: the state each step started from (h0 [B, D, H] at a row's first step),
    the right operand of dW_hh = sum_t dgates_h_t^T h_prev_t; direction 1 runs backwards. Steps past
    a row's end have zero gradients."""
    steps = h_seq.shape[1]
    zero = jnp.zeros_like(h_seq[:, :1, :1])
    shifted = [jnp.concatenate([zero, h_seq[:, :-1, :1]], axis=1)]
    first = [jnp.broadcast_to(jnp.arange(steps)[None, :] == 0, h_seq.shape[:2])]
    if h_seq.shape[2] == 2:  # the reverse direction starts at each row's last valid step
        shifted.append(jnp.concatenate([h_seq[:, 1:, 1:], zero], axis=1))
        first.append(jnp.arange(steps)[None, :] == _ref.valid_steps(seq_lengths, steps)[:, None] - 1)
    return jnp.where(jnp.stack(first, axis=2)[..., None], h0[:, None], jnp.concatenate(shifted, axis=2))


def _layer_params(params, layer, directions):
    """(w_ih, w_hh, b_ih, b_hh) of a layer, each stacked over its D directions."""
    return tuple(jnp.stack(p) for p in zip(*params[layer * directions:(layer + 1) * directions]))


def _layer_states(states, layer, directions):
    """The states [L D, B, H] of a layer's directions as [B, D, H]."""
    return [jnp.swapaxes(s[layer * directions:(layer + 1) * directions], 0, 1) for s in states]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _rnn_stack(x, states, weights, seq_lengths, masks, mode, sizes, precision):
    """(y [B, T, D H] in x's dtype, final states [L D, B, H] float32, one per initial state); states
    = (h_0, c_0) for the LSTM, (h_0,) for the GRU and the plain RNN, float32. sizes = (I, H, L,
    bidirectional). masks: the dropout scales of the outputs of layers 0 .. len(masks) - 1
    (reference.rnn.dropout_masks)."""
    return _rnn_stack_fwd(x, states, weights, seq_lengths, masks, mode, sizes, precision)[0]


def _rnn_stack_fwd(x, states, weights, seq_lengths, masks, mode, sizes, precision):
    directions = 2 if sizes[3] else 1
    params = _ref.unpack_weights(weights, mode, *sizes)
    batch, steps = x.shape[:2]
    layer_in, inputs, saved, finals = x, [], [], [[] for _ in states]
    for layer in range(sizes[2]):
        inputs.append(layer_in)
        inits = _layer_states(states, layer, directions)
        h_seq, residuals, last = _layer_fwd(mode, layer_in, _layer_params(params, layer, directions), inits,
                                            seq_lengths, precision)
        saved.append((h_seq, residuals))
        for final, state in zip(finals, last):
            final.append(jnp.swapaxes(state, 0, 1))
        # The directions side by side: [B, T, D H].
        layer_in = h_seq.reshape(batch, steps, directions * sizes[1]).astype(x.dtype)
        if layer < len(masks):
            layer_in = (layer_in.astype(_F32) * masks[layer]).astype(x.dtype)
    results = (layer_in, tuple(jnp.concatenate(f) for f in finals))
    return results, (inputs, saved, states, weights, seq_lengths, masks)


def _rnn_stack_bwd(mode, sizes, precision, residuals, cotangents):
    inputs, saved, states, weights, seq_lengths, masks = residuals
    dy, d_finals = cotangents
    layers, directions = sizes[2], 2 if sizes[3] else 1
    params = _ref.unpack_weights(weights, mode, *sizes)
    grads = [None] * (layers * directions)
    d_states = [[None] * layers for _ in states]
    d_out = dy.astype(_F32)
    dot = functools.partial(jnp.einsum, precision=precision, preferred_element_type=_F32)
    # At reduced precision the GEMMs of a bfloat16 layer's gradients take bfloat16 operands (float32
    # sums), as XLA's autodiff of a bfloat16 layer does: half the bytes of float32 operands and twice
    # the tensor cores' TF32 rate.
    operand = jnp.bfloat16 if weights.dtype == jnp.bfloat16 and allows_tf32(precision) else _F32
    for layer in reversed(range(layers)):
        if layer < len(masks):  # d_out reached the next layer's input: through this layer's dropout
            d_out = d_out * masks[layer]
        layer_in = inputs[layer]
        w_ih, w_hh, _, _ = _layer_params(params, layer, directions)
        h_seq, layer_saved = saved[layer]
        inits = _layer_states(states, layer, directions)
        dh_seq = d_out.reshape(h_seq.shape)
        d_last = _layer_states(d_finals, layer, directions)
        dgates_x, dgates_h, d_inits = _layer_bwd(mode, dh_seq, d_last, h_seq, layer_saved, inits, w_hh,
                                                 seq_lengths, precision)
        for d_state, d_init in zip(d_states, d_inits):
            d_state[layer] = jnp.swapaxes(d_init, 0, 1)
        h_prev = _previous_states(h_seq, inits[0], seq_lengths)
        gemm_x, gemm_h = dgates_x.astype(operand), dgates_h.astype(operand)  # the GEMMs' operands
        layer_grads = (dot("btdg,bti->dgi", gemm_x, layer_in.astype(operand)),
                       dot("btdg,btdh->dgh", gemm_h, h_prev.astype(operand)),
                       jnp.sum(dgates_x, axis=(0, 1)), jnp.sum(dgates_h, axis=(0, 1)))
        for d in range(directions):
            grads[layer * directions + d] = tuple(g[d] for g in layer_grads)
        d_out = dot("btdg,dgi->bti", gemm_x, w_ih.astype(operand))
    dweights = _ref.pack_weights(grads).astype(weights.dtype)
    return (d_out.astype(inputs[0].dtype), tuple(jnp.concatenate(s) for s in d_states), dweights, None,
            tuple(jnp.zeros_like(m) for m in masks))


_rnn_stack.defvjp(_rnn_stack_fwd, _rnn_stack_bwd)


# --- public API -------------------------------------------------------------------------------

def _public_name(mode):
    """The public function of `mode`, which error messages name: lstm, gru, or rnn (rnn_tanh, rnn_relu)."""
    return mode.partition("_")[0]


def _check_nonlinearity(name, nonlinearity):
    if nonlinearity not in _ref.NONLINEARITIES:
        raise ValueError(f"{name}: nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
    return "rnn_" + str(nonlinearity)  # a str subclass (np.str_) becomes a plain static string


def _as_array(v):
    return v if hasattr(v, "shape") and hasattr(v, "dtype") else jnp.asarray(v)


def _positive_int(mode, name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{mode}: {name} must be an int >= 1, got {value!r}")
    return int(value)


def _float_array(mode, name, value):
    value = _as_array(value)
    if value.dtype not in _FLOAT_TYPES:
        raise TypeError(f"{mode}: {name} must be float32, bfloat16 or float16, got {value.dtype}")
    return value


def _rnn(mode, x, states, weights, seq_lengths, input_size, hidden_size, num_layers, dropout, bidirectional,
         precision, dropout_rng):
    """Checks the arguments of `lstm` / `gru` / `rnn` and runs the stack; states is {name: initial
    state}."""
    name = _public_name(mode)
    x, weights = _float_array(name, "x", x), _float_array(name, "weights", weights)
    states = {n: _float_array(name, n, s) for n, s in states.items()}
    seq_lengths = _as_array(seq_lengths)
    named = (("input_size", input_size), ("hidden_size", hidden_size), ("num_layers", num_layers))
    sizes = tuple(_positive_int(name, n, v) for n, v in named)
    if not isinstance(bidirectional, (bool, np.bool_)):
        raise TypeError(f"{name}: bidirectional must be a bool, got {bidirectional!r}")
    sizes += (bool(bidirectional),)
    if not isinstance(dropout, (int, float, np.integer, np.floating)) or not 0 <= dropout < 1:
        raise ValueError(f"{name}: dropout must be a number in [0, 1), got {dropout!r}")
    if dropout and dropout_rng is None:
        raise ValueError(f"{name}: dropout = {dropout} needs a dropout_rng key (jax.random.key)")
    if x.ndim != 3 or x.shape[2] != sizes[0]:
        raise ValueError(f"{name}: x must have shape (B, T, input_size) = (B, T, {sizes[0]}), got {x.shape}")
    batch = x.shape[0]
    state_shape = (sizes[2] * (2 if sizes[3] else 1), batch, sizes[1])
    for n, state in states.items():
        if state.shape != state_shape:
            raise ValueError(f"{name}: {n} must have shape (num_layers * directions, B, hidden_size) = "
                             f"{state_shape}, got {state.shape}")
    count = _ref.weight_count(mode, *sizes)
    if weights.shape != (count,):
        raise ValueError(f"{name}: weights must be a flat vector of {count} elements for "
                         f"input_size={sizes[0]}, hidden_size={sizes[1]}, num_layers={sizes[2]}, "
                         f"bidirectional={sizes[3]}, got shape {weights.shape}")
    if seq_lengths.dtype != jnp.int32:
        raise TypeError(f"{name}: seq_lengths must be int32, got {seq_lengths.dtype}")
    if seq_lengths.shape != (batch,):
        raise ValueError(f"{name}: seq_lengths must have shape (B,) = ({batch},), got {seq_lengths.shape}")
    initial = tuple(states.values())
    width = sizes[1] * (2 if sizes[3] else 1)
    masks = _ref.dropout_masks(dropout_rng, float(dropout), (batch, x.shape[1], width), sizes[2])

    def run(x, initial, weights, seq_lengths, masks):
        # Inside shard_map the weights (and replicated states) vary like x, so their gradients are
        # summed over the devices' rows by the transpose of that cast.
        *initial, weights = match_varying(x, *(s.astype(_F32) for s in initial), weights)
        return _rnn_stack(x, tuple(initial), weights, seq_lengths, masks, mode, sizes, precision)

    # Batch rows sharded over Explicit mesh axes (part of x's type): each device runs its rows. Other
    # cases (no mesh, Auto axes) are partitioned by the primitives' own rule.
    explicit = explicit_row_sharding(x, whole_axes=2)
    if explicit is None:
        y, finals = run(x, initial, weights, seq_lengths, masks)
    else:
        mesh, x_spec, axes = explicit
        rows = x_spec[0]
        state_specs = (PartitionSpec(None, rows, None),) * len(initial)
        mask_specs = (PartitionSpec(rows),) * len(masks)
        y, finals = jax.shard_map(
            run, mesh=mesh, in_specs=(x_spec, state_specs, PartitionSpec(), PartitionSpec(rows), mask_specs),
            out_specs=(x_spec, state_specs), axis_names=set(axes))(x, initial, weights, seq_lengths, masks)
    return (y,) + tuple(f.astype(s.dtype) for f, s in zip(finals, initial))


def lstm(x, h_0, c_0, weights, seq_lengths, input_size, hidden_size, num_layers, dropout, bidirectional,
         precision=None, dropout_rng=None):
    """A multi-layer LSTM over whole sequences, with `jax.experimental.rnn.lstm`'s signature and
    results, so its `init_lstm_weight` and `unpack_lstm_weights` work unchanged.

    Args:
      x: [B, T, I] float32, bfloat16 or float16 (batch first).
      h_0, c_0: [L D, B, H] initial states, float32 (or bfloat16/float16; the state is carried in
        float32 either way).
      weights: [P] cuDNN's flat vector (see `jax.experimental.rnn`): (W_ih, W_hh) of every
        pseudo-layer, then (b_ih, b_hh) of every pseudo-layer; G = 4H gate rows in the order
        (i, f, g, o). float32, bfloat16 or float16.
      seq_lengths: [B] int32. Row b runs over its first len_b = clip(seq_lengths[b], 0, T) steps:
        y is zero past them, h_n and c_n are the states after the last valid step (h_0 and c_0 when
        len_b = 0), and the reverse direction runs over each row's valid part from its end.
      input_size, hidden_size, num_layers: I, H, L.
      dropout: the rate of dropout between layers, in [0, 1): as in cuDNN, every layer's output but
        the last is scaled by 1 / (1 - dropout) or zeroed (no effect with one layer). > 0 needs
        `dropout_rng`.
      bidirectional: D = 2 when True; y concatenates the directions' outputs on the last axis.
      precision: `lax.Precision` (or dot algorithm) of the input-projection and weight-gradient
        GEMMs (XLA) and of the recurrence: at None (JAX's default precision), DEFAULT and HIGH the
        CUDA kernels may round W_hh and the state to TF32 for the forward's recurrent products
        (float32 sums), as cuDNN does under `jax.experimental.rnn`; with bfloat16 weights the
        forward may multiply the state rounded to bfloat16 instead (H a multiple of 64) and the
        backward through time passes its gate gradients between steps in bfloat16 (bf16
        tensor-core products, float32 sums) and the weight- and input-gradient GEMMs take them
        in bfloat16, as a bfloat16 `lax.scan` does; HIGHEST (or a float32-accurate algorithm)
        keeps them exact. The CPU kernels always multiply exactly.
      dropout_rng: a `jax.random.key` for the dropout masks (a jaxdnn addition to the signature);
        the same key gives the same masks, in the forward and its gradient
        (`jaxdnn.reference.rnn.dropout_masks` draws them).

    Returns:
      (y [B, T, D H] in x's dtype, h_n [L D, B, H] in h_0's dtype, c_n [L D, B, H] in c_0's dtype).

    Differentiable with `jax.grad`/`jax.vjp` to any order (not with `jax.jvp`); the backward pass
    through time is a kernel, deterministic.
    """
    return _rnn("lstm", x, {"h_0": h_0, "c_0": c_0}, weights, seq_lengths, input_size, hidden_size,
                num_layers, dropout, bidirectional, precision, dropout_rng)


def gru(x, h_0, weights, seq_lengths, input_size, hidden_size, num_layers, dropout, bidirectional,
        precision=None, dropout_rng=None):
    """A multi-layer GRU over whole sequences in cuDNN's formulation, with `lstm`'s conventions.

    Per step, with the input projections x_* = W_i* x + b_i* and the recurrent ones
    h_* = W_h* h_prev + b_h*: r = sigmoid(x_r + h_r), z = sigmoid(x_z + h_z),
    n = tanh(x_n + r h_n) (the reset gate applied after the recurrent matmul, as in cuDNN and
    PyTorch), h = (1 - z) n + z h_prev.

    Args:
      x: [B, T, I] float32, bfloat16 or float16 (batch first).
      h_0: [L D, B, H] initial state, float32 (or bfloat16/float16; carried in float32 either way).
      weights: [P] cuDNN's flat vector, laid out as `lstm`'s with G = 3H gate rows in the order
        (r, z, n): (W_ih, W_hh) of every pseudo-layer, then (b_ih, b_hh) of every pseudo-layer.
      seq_lengths, input_size, hidden_size, num_layers, dropout, bidirectional, precision,
      dropout_rng: as `lstm`.

    Returns:
      (y [B, T, D H] in x's dtype, h_n [L D, B, H] in h_0's dtype).

    Differentiable with `jax.grad`/`jax.vjp` to any order (not with `jax.jvp`); the backward pass
    through time is a kernel, deterministic.
    """
    return _rnn("gru", x, {"h_0": h_0}, weights, seq_lengths, input_size, hidden_size, num_layers, dropout,
                bidirectional, precision, dropout_rng)


def rnn(x, h_0, weights, seq_lengths, input_size, hidden_size, num_layers, dropout, bidirectional,
        precision=None, dropout_rng=None, nonlinearity="tanh"):
    """A multi-layer plain (Elman) RNN over whole sequences, cuDNN's RNN_TANH / RNN_RELU (PyTorch's
    `nn.RNN`), with `lstm`'s conventions.

    Per step: h = act(W_ih x + b_ih + W_hh h_prev + b_hh), act tanh or relu.

    Args:
      x: [B, T, I] float32, bfloat16 or float16 (batch first).
      h_0: [L D, B, H] initial state, float32 (or bfloat16/float16; carried in float32 either way).
      weights: [P] cuDNN's flat vector, laid out as `lstm`'s with G = H rows: (W_ih [H, I_l], W_hh
        [H, H]) of every pseudo-layer, then (b_ih [H], b_hh [H]) of every pseudo-layer
        (`jaxdnn.reference.rnn.unpack_weights(weights, "rnn_tanh", ...)` splits it).
      seq_lengths, input_size, hidden_size, num_layers, dropout, bidirectional, precision,
      dropout_rng: as `lstm`.
      nonlinearity: "tanh" (the default, as cuDNN and PyTorch) or "relu".

    Returns:
      (y [B, T, D H] in x's dtype, h_n [L D, B, H] in h_0's dtype).

    Differentiable with `jax.grad`/`jax.vjp` to any order (not with `jax.jvp`); the backward pass
    through time is a kernel, deterministic. relu's derivative is 0 at 0, as `jax.nn.relu`'s.
    """
    mode = _check_nonlinearity("rnn", nonlinearity)
    return _rnn(mode, x, {"h_0": h_0}, weights, seq_lengths, input_size, hidden_size, num_layers, dropout,
                bidirectional, precision, dropout_rng)


# --- single steps (cells) ---------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cell(mode, x, states, params):
    """One step of one layer: the new states (h, c) or (h,), float32; x [B, I], states float32."""
    return _cell_fwd(mode, x, states, params)[0]


def _cell_fwd(mode, x, states, params):
    one_step = jnp.ones(x.shape[:1], jnp.int32)
    one_direction = tuple(p[None] for p in params)  # [1, ...]: one direction's weights
    inits = [s[:, None] for s in states]  # [B, 1, H]
    h_seq, residuals, last = _layer_fwd(mode, x[:, None], one_direction, inits, one_step, None)
    return tuple(s[:, 0] for s in last), (x, states, params, h_seq, residuals, one_step)


def _cell_bwd(mode, saved, d_last):
    x, states, params, h_seq, residuals, one_step = saved
    w_ih, w_hh, _, _ = params
    no_output_grad = jnp.zeros_like(h_seq)  # the new h's gradient arrives as d_last[0]
    d_finals, inits = [d[:, None] for d in d_last], [s[:, None] for s in states]
    dgates_x, dgates_h, d_states = _layer_bwd(mode, no_output_grad, d_finals, h_seq, residuals, inits,
                                              w_hh[None], one_step, None)
    dgates_x, dgates_h = dgates_x[:, 0, 0], dgates_h[:, 0, 0]
    grads = (jnp.einsum("bg,bi->gi", dgates_x, x.astype(_F32)), jnp.einsum("bg,bh->gh", dgates_h, states[0]),
             jnp.sum(dgates_x, axis=0), jnp.sum(dgates_h, axis=0))
    dx = jnp.einsum("bg,gi->bi", dgates_x, w_ih.astype(_F32))
    return (dx.astype(x.dtype), tuple(d[:, 0] for d in d_states),
            tuple(g.astype(p.dtype) for g, p in zip(grads, params)))


_cell.defvjp(_cell_fwd, _cell_bwd)


def _check_cell(mode, x, states, w_ih, w_hh, b_ih, b_hh):
    gates_per_unit = _ref.GATES[mode]
    name = _public_name(mode) + "_cell"
    x = _float_array(name, "x", x)
    states = {n: _float_array(name, n, s) for n, s in states.items()}
    params = {n: _float_array(name, n, p) for n, p in
              (("w_ih", w_ih), ("w_hh", w_hh), ("b_ih", b_ih), ("b_hh", b_hh))}
    if x.ndim != 2:
        raise ValueError(f"{name}: x must have shape (B, I), got {x.shape}")
    batch, inputs = x.shape
    hidden = states["h"].shape[-1] if states["h"].ndim == 2 else None
    for n, state in states.items():
        if state.shape != (batch, hidden):
            raise ValueError(f"{name}: {n} must have shape (B, H) = ({batch}, H), one H for every "
                             f"state, got {state.shape}")
    gates = gates_per_unit * hidden
    expected = {"w_ih": (gates, inputs), "w_hh": (gates, hidden), "b_ih": (gates,), "b_hh": (gates,)}
    for n, shape in expected.items():
        if params[n].shape != shape:
            raise ValueError(f"{name}: {n} must have shape {shape} (G = {gates_per_unit}H rows), got "
                             f"{params[n].shape}")
    return x, states, tuple(params.values())


def lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh):
    """One LSTM step for a user's own `lax.scan` loop: `lstm`'s math on one time step.

    Args:
      x: [B, I] float32, bfloat16 or float16.
      h, c: [B, H] the state (float32 or a 16-bit float; carried in float32).
      w_ih [4H, I], w_hh [4H, H], b_ih [4H], b_hh [4H]: one pseudo-layer of `lstm`'s weights (as
        `jax.experimental.rnn.unpack_lstm_weights` gives them), gates (i, f, g, o).

    Returns:
      (h, c) after the step, in the dtypes of the given h and c.

    The recurrence is the `lstm` kernel run over one step (a custom call per step); the input
    projection and the weight gradients are XLA's. Differentiable to any order (not with `jax.jvp`).
    """
    x, states, params = _check_cell("lstm", x, {"h": h, "c": c}, w_ih, w_hh, b_ih, b_hh)
    initial = tuple(states.values())
    new = _cell("lstm", x, tuple(s.astype(_F32) for s in initial), params)
    return tuple(n.astype(s.dtype) for n, s in zip(new, initial))


def gru_cell(x, h, w_ih, w_hh, b_ih, b_hh):
    """One GRU step (cuDNN's formulation, see `gru`) for a user's own `lax.scan` loop.

    Args:
      x: [B, I] float32, bfloat16 or float16.
      h: [B, H] the state (carried in float32).
      w_ih [3H, I], w_hh [3H, H], b_ih [3H], b_hh [3H]: one pseudo-layer of `gru`'s weights, gates
        (r, z, n).

    Returns:
      h after the step, in the given h's dtype. Differentiable to any order (not with `jax.jvp`).
    """
    x, states, params = _check_cell("gru", x, {"h": h}, w_ih, w_hh, b_ih, b_hh)
    (new,) = _cell("gru", x, (states["h"].astype(_F32),), params)
    return new.astype(states["h"].dtype)


def rnn_cell(x, h, w_ih, w_hh, b_ih, b_hh, nonlinearity="tanh"):
    """One plain RNN step, h = act(W_ih x + b_ih + W_hh h + b_hh) (see `rnn`), for a user's own
    `lax.scan` loop.

    Args:
      x: [B, I] float32, bfloat16 or float16.
      h: [B, H] the state (carried in float32).
      w_ih [H, I], w_hh [H, H], b_ih [H], b_hh [H]: one pseudo-layer of `rnn`'s weights.
      nonlinearity: "tanh" or "relu".

    Returns:
      h after the step, in the given h's dtype. Differentiable to any order (not with `jax.jvp`).
    """
    mode = _check_nonlinearity("rnn_cell", nonlinearity)
    x, states, params = _check_cell(mode, x, {"h": h}, w_ih, w_hh, b_ih, b_hh)
    (new,) = _cell(mode, x, (states["h"].astype(_F32),), params)
    return new.astype(states["h"].dtype)
