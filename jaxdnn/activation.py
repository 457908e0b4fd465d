"""Activations with `jax.nn`'s names and arguments, as standalone kernels.

Elementwise over any shape; computed in float32, returned in x's dtype (float32, bfloat16 or
float16). Their math lives in one C++ header (ffi/common/activation.h) that other families' fused
epilogues share. Standalone they run at XLA's speed (both are bound by memory); the point of the
shared math is fusion into other kernels.

Each function is a `jax.custom_vjp` over two kernel stages, f (x -> y) and its backward
((dy, x) -> dy * f'(x)); both have their own VJP through the reference, so grad of grad works.
Forward-mode `jax.jvp` is not provided (custom_vjp).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxdnn import _ffi  # noqa: F401  (registers the FFI targets)
from jaxdnn._primitive import ffi_primitive, move_to_front, per_row_shard, rows_batch_rule, with_reference_vjp
from jaxdnn.reference import activation as _ref

_FLOAT_TYPES = [jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16)]

# name -> the `kind` attribute of the targets (the Activation enum of ffi/common/activation.h).
KINDS = {"identity": 0, "relu": 1, "relu6": 2, "leaky_relu": 3, "elu": 4, "sigmoid": 5, "tanh": 6,
         "gelu_tanh": 7, "gelu_erf": 8, "silu": 9, "softplus": 10, "hard_tanh": 11}
KIND_NAMES = {value: name for name, value in KINDS.items()}  # the `kind` attribute -> its name


def _like_last_operand(*operands, kind, param):
    return [jax.core.ShapedArray(operands[-1].shape, operands[-1].dtype)]


_fwd = ffi_primitive("jaxdnn_activation_fwd", "jaxdnn_activation_fwd_v1", result_avals=_like_last_operand,
                     batch_rule=rows_batch_rule, sharding_rule="... -> ...")
_bwd = ffi_primitive("jaxdnn_activation_bwd", "jaxdnn_activation_bwd_v1", result_avals=_like_last_operand,
                     batch_rule=rows_batch_rule, sharding_rule="..., ... -> ...")


def _attrs(name, param):
    return dict(kind=np.int64(KINDS[name]), param=np.float32(param))


def _bias_chunks(columns: int, dtype) -> int:
    """P, the chunks of rows whose column sums the backward with the bias gradient writes: about 528
    blocks of the CUDA kernel (4 an SM of an H100/H200) over its tiles of 256 16-byte packs of
    columns. A function of C alone, so that a row shard's call has the global call's shape."""
    tiles = max(1, -(-columns * jnp.dtype(dtype).itemsize // (16 * 256)))
    return max(1, -(-528 // tiles))


def _bwd_bias_avals(dy, x, *, kind, param):
    return [jax.core.ShapedArray(x.shape, x.dtype),
            jax.core.ShapedArray((_bias_chunks(x.shape[-1], x.dtype), x.shape[-1]), jnp.float32)]


def _bwd_bias_batch_rule(prim, args, dims, **attrs):
    """Under vmap the kernel's chunks would mix the examples' rows: dx from the plain backward's
    kernel and each example's column sums by XLA, in the first of its chunks."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    dy, x = (move_to_front(a, d, size) for a, d in zip(args, dims))
    dx = _bwd.bind(dy, x, **attrs)[0]
    sums = jnp.sum(dx, axis=tuple(range(1, dx.ndim - 1)), dtype=jnp.float32)
    partials = jnp.zeros((size, _bias_chunks(x.shape[-1], x.dtype), x.shape[-1]), jnp.float32)
    return [dx, partials.at[:, 0].set(sums)], [0, 0]


_bwd_bias = ffi_primitive("jaxdnn_activation_bwd_bias", "jaxdnn_activation_bwd_bias_v1",
                          result_avals=_bwd_bias_avals, batch_rule=_bwd_bias_batch_rule,
                          sharding_rule="... c, ... c -> ... c, p c", reduced_results=(1,))


def backward_with_bias_grad(dy, z, name, param):
    """The backward of act(z), z = (a product) + bias, in one pass over dy and z [..., C]: (dz, dbias)
    with dz = dy * act'(z) in z's dtype and dbias [C] the float32 sum of dz over every axis but
    the last (its rounded values, which the products' gradients read). Differentiable through the
    reference, as the activation's own backward."""
    def kernel(dy, z):
        dz, partials = _bwd_bias.bind(dy, z, **_attrs(name, param))
        return dz, jnp.sum(partials, axis=0)

    def reference(dy, z):
        dz = _ref.activation_bwd(dy, z, name, param)
        return dz, jnp.sum(dz, axis=tuple(range(dz.ndim - 1)), dtype=jnp.float32)
    return with_reference_vjp(kernel, reference, dy, z)


# The `activation=` argument of fused kernels (layer_norm, batch_norm, group_norm, ...): a name ->
# (the kernel's kind, its parameter), with jax.nn's default parameters.
EPILOGUES = {"relu": ("relu", 0.0), "relu6": ("relu6", 0.0), "leaky_relu": ("leaky_relu", 1e-2),
             "elu": ("elu", 1.0), "sigmoid": ("sigmoid", 0.0), "tanh": ("tanh", 0.0),
             "gelu": ("gelu_tanh", 0.0), "gelu_exact": ("gelu_erf", 0.0), "silu": ("silu", 0.0),
             "softplus": ("softplus", 0.0), "hard_tanh": ("hard_tanh", 0.0)}


def epilogue(fn: str, activation) -> tuple[str, float]:
    """Validates the `activation=` argument of the fused op `fn`: None or a name of `EPILOGUES`.

    Returns (kind, param): a key of `KINDS` ("identity" for None) and the activation's parameter,
    for `epilogue_attrs` and `jaxdnn.reference.activation.activation_fwd`.
    """
    if activation is None:
        return "identity", 0.0
    if not isinstance(activation, str) or activation not in EPILOGUES:
        raise ValueError(f"{fn}: activation must be None or one of {sorted(EPILOGUES)}, got {activation!r}")
    return EPILOGUES[activation]


def epilogue_attrs(kind: str, param: float) -> dict:
    """The `activation`/`activation_param` attributes of a fused kernel, typed for the FFI."""
    return dict(activation=np.int64(KINDS[kind]), activation_param=np.float32(param))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _activation_fwd(x, name, param):
    return _fwd.bind(x, **_attrs(name, param))[0]


def _activation_fwd_fwd(x, name, param):
    return _activation_fwd(x, name, param), x


def _activation_fwd_bwd(name, param, x, dy):
    return jax.vjp(lambda x: _ref.activation_fwd(x, name, param), x)[1](dy)


_activation_fwd.defvjp(_activation_fwd_fwd, _activation_fwd_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _activation_bwd(dy, x, name, param):
    return _bwd.bind(dy, x, **_attrs(name, param))[0]


def _activation_bwd_fwd(dy, x, name, param):
    return _activation_bwd(dy, x, name, param), (dy, x)


def _activation_bwd_bwd(name, param, residuals, ddx):
    return jax.vjp(lambda dy, x: _ref.activation_bwd(dy, x, name, param), *residuals)[1](ddx)


_activation_bwd.defvjp(_activation_bwd_fwd, _activation_bwd_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _activation(x, name, param):
    return _activation_fwd(x, name, param)


def _activation_vjp_fwd(x, name, param):
    return _activation_fwd(x, name, param), x


def _activation_vjp_bwd(name, param, x, dy):
    return (_activation_bwd(dy, x, name, param),)


_activation.defvjp(_activation_vjp_fwd, _activation_vjp_bwd)


def _apply(fn, x, name, param=0.0):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if x.dtype not in _FLOAT_TYPES:
        raise TypeError(f"{fn}: x must be float32, bfloat16 or float16, got {x.dtype}")
    param = float(param)
    if not np.isfinite(param):
        raise ValueError(f"{fn}: the parameter must be finite, got {param}")
    return per_row_shard(lambda x: _activation(x, name, param), x, whole_axes=0)


def relu(x):
    """max(x, 0), as `jax.nn.relu` (gradient 0 at 0)."""
    return _apply("relu", x, "relu")


def relu6(x):
    """min(max(x, 0), 6), as `jax.nn.relu6` (gradient 0 at 0 and 6)."""
    return _apply("relu6", x, "relu6")


def leaky_relu(x, negative_slope=1e-2):
    """x if x >= 0 else negative_slope * x, as `jax.nn.leaky_relu`."""
    return _apply("leaky_relu", x, "leaky_relu", negative_slope)


def elu(x, alpha=1.0):
    """x if x > 0 else alpha * (exp(x) - 1), as `jax.nn.elu`."""
    return _apply("elu", x, "elu", alpha)


def sigmoid(x):
    """1 / (1 + exp(-x)), as `jax.nn.sigmoid`."""
    return _apply("sigmoid", x, "sigmoid")


def tanh(x):
    """tanh(x), as `jnp.tanh`."""
    return _apply("tanh", x, "tanh")


def gelu(x, approximate: bool = True):
    """GELU, as `jax.nn.gelu`: the tanh approximation by default, the exact erf form otherwise."""
    if not isinstance(approximate, (bool, np.bool_)):
        raise TypeError(f"gelu: approximate must be a bool, got {approximate!r}")
    return _apply("gelu", x, "gelu_tanh" if approximate else "gelu_erf")


def silu(x):
    """x * sigmoid(x), as `jax.nn.silu` (swish)."""
    return _apply("silu", x, "silu")


def softplus(x):
    """log(1 + exp(x)), as `jax.nn.softplus`."""
    return _apply("softplus", x, "softplus")


def hard_tanh(x):
    """clip(x, -1, 1), as `jax.nn.hard_tanh` (gradient 1 on [-1, 1])."""
    return _apply("hard_tanh", x, "hard_tanh")


ACTIVATIONS = {"relu": relu, "relu6": relu6, "leaky_relu": leaky_relu, "elu": elu, "sigmoid": sigmoid,
               "tanh": tanh, "gelu": gelu, "silu": silu, "softplus": softplus, "hard_tanh": hard_tanh}
