"""Max and average pooling with flax.linen's signatures: `max_pool` and `avg_pool`.

Shapes: inputs [N..., *spatial, C]: batch first (any number of batch axes N..., or none), then 1 to 3
spatial axes (the window's), channels last; outputs [N..., *pooled, C]. The kernels see every case as
3-D pooling of [N, D, H, W, C] into [N, P, Q, R, C] (size-1 axes in front of the missing spatial
ones). Accumulation is float32; outputs have the inputs' dtype.

Max pooling pads with -inf. Its training forward saves the argmax of each output (the offset of
the chosen element in its window: uint8, or int32 for windows of more than 256 elements), and the
backward is a gather (each input element sums the dy of the windows that chose it), not a scatter.
Ties go where JAX sends them (the first maximal element in the window's row-major order). Without
differentiation the forward writes no argmax.

Each function is a `jax.custom_vjp`. Max pooling: the forward and backward stages have their own VJP
through the reference, so grad of grad works. Average pooling is linear: its forward and backward
kernels are each other's transpose, so every order of reverse-mode derivatives runs on the kernels.
Forward-mode `jax.jvp` is not provided (custom_vjp).
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from jaxdnn import _ffi  # noqa: F401  (registers the FFI targets)
from jaxdnn import reference
from jaxdnn._primitive import ffi_primitive, images_in_unit_axis, per_row_shard, rows_batch_rule

_FLOAT_TYPES = [jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16)]
_MAX_UINT8_WINDOW = 256  # argmax offsets of larger windows do not fit uint8


@dataclasses.dataclass(frozen=True)
class _Window:
    """A pooling window on the kernels' 3-D form (axes d, h, w); hashable, a static argument."""
    window: tuple[int, int, int]
    strides: tuple[int, int, int]
    pads: tuple[tuple[int, int], ...]  # (low, high) per axis
    in_spatial: tuple[int, int, int]   # D H W
    out_spatial: tuple[int, int, int]  # P Q R

    def attrs(self) -> dict:
        """The targets' attributes (int64, see ffi/pool/pool.h)."""
        values = {"window": self.window, "stride": self.strides, "pad": tuple(lo for lo, _ in self.pads),
                  "in": self.in_spatial, "out": self.out_spatial}
        return {f"{name}_{axis}": np.int64(v[i])
                for name, v in values.items() for i, axis in enumerate("dhw")}

    @property
    def argmax_dtype(self):
        return jnp.uint8 if int(np.prod(self.window)) <= _MAX_UINT8_WINDOW else jnp.int32


# --- the kernel stages ----------------------------------------------------------------------------

def _resized(x, spatial, dtype=None):
    """An aval of x's leading and channel axes around the spatial sizes `spatial`."""
    return jax.core.ShapedArray(x.shape[:-4] + tuple(spatial) + x.shape[-1:], dtype or x.dtype)


def _spatial(attrs, prefix):
    return tuple(int(attrs[f"{prefix}_{axis}"]) for axis in "dhw")


def _pooled_avals(x, count_include_pad=None, **attrs):
    return [_resized(x, _spatial(attrs, "out"))]


def _pooled_argmax_avals(x, **attrs):
    volume = int(np.prod(_spatial(attrs, "window")))
    return [_resized(x, _spatial(attrs, "out")),
            _resized(x, _spatial(attrs, "out"), jnp.uint8 if volume <= _MAX_UINT8_WINDOW else jnp.int32)]


def _unpooled_avals(dy, *argmax, count_include_pad=None, **attrs):
    return [_resized(dy, _spatial(attrs, "in"))]


def _rows_as_spatial(attrs, shapes):
    """The CPU's view of a 1-D or 2-D window's arrays (images_in_unit_axis, in rank 4): [rows..., 1,
    H, W, C] as [B, H, W, C], the images the kernels' D axis, and [rows..., 1, 1, W, C] as [1, B, W,
    C]. Without it, 3x3/2 max pooling of 16 x 112^2 x 64 took 5.5-8.5 ms where the kernel takes 3.4."""
    window, stride, pad, ins, outs = (_spatial(attrs, name)
                                      for name in ("window", "stride", "pad", "in", "out"))
    trivial = [window[a] == stride[a] == ins[a] == outs[a] == 1 and pad[a] == 0 for a in range(2)]
    return images_in_unit_axis(attrs, shapes, trivial, rank=4)


def _stage(name, result_avals, rule):
    return ffi_primitive(f"jaxdnn_{name}", f"jaxdnn_{name}_v1", result_avals=result_avals,
                         batch_rule=rows_batch_rule, sharding_rule=rule, cpu_view=_rows_as_spatial)


# The leading axes (`...`) are the batch axes: sharded ones run per shard. The pooled spatial axes
# have their own factors (their sizes differ from the input's); channels are independent.
_max_pool_infer = _stage("max_pool_infer", _pooled_avals, "... d h w c -> ... p q r c")
_max_pool_fwd_stage = _stage("max_pool_fwd", _pooled_argmax_avals, "... d h w c -> ... p q r c, ... p q r c")
_max_pool_bwd_stage = _stage("max_pool_bwd", _unpooled_avals, "... p q r c, ... p q r c -> ... d h w c")
_avg_pool_fwd_stage = _stage("avg_pool_fwd", _pooled_avals, "... d h w c -> ... p q r c")
_avg_pool_bwd_stage = _stage("avg_pool_bwd", _unpooled_avals, "... p q r c -> ... d h w c")


# --- max pooling: differentiable stages (second order through the reference) --------------------

def _reference_max_pool(x, window):
    return reference.max_pool(x, window.window, window.strides, window.pads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _max_pool_fwd(x, window):
    """(y, argmax) from the kernel."""
    return tuple(_max_pool_fwd_stage.bind(x, **window.attrs()))


def _max_pool_fwd_fwd(x, window):
    return _max_pool_fwd(x, window), x


def _max_pool_fwd_bwd(window, x, cotangents):
    dy, _ = cotangents  # argmax is an integer output: no cotangent
    return jax.vjp(lambda x: _reference_max_pool(x, window), x)[1](dy)


_max_pool_fwd.defvjp(_max_pool_fwd_fwd, _max_pool_fwd_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _max_pool_bwd(dy, argmax, x, window):
    """dx from the kernel; x only serves this stage's own VJP (linear in dy: the reference's
    transpose, which picks the same elements)."""
    return _max_pool_bwd_stage.bind(dy, argmax, **window.attrs())[0]


def _max_pool_bwd_fwd(dy, argmax, x, window):
    return _max_pool_bwd(dy, argmax, x, window), x


def _max_pool_bwd_bwd(window, x, ddx):
    def backward(dy):
        return jax.vjp(lambda x: _reference_max_pool(x, window), x)[1](dy)[0]
    _, transpose = jax.vjp(backward, jnp.zeros(x.shape[:-4] + window.out_spatial + x.shape[-1:], x.dtype))
    return transpose(ddx)[0], None, None  # dx does not depend on x or argmax almost everywhere


_max_pool_bwd.defvjp(_max_pool_bwd_fwd, _max_pool_bwd_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _max_pool(x, window):
    return _max_pool_infer.bind(x, **window.attrs())[0]


def _max_pool_vjp_fwd(x, window):
    y, argmax = _max_pool_fwd(x, window)
    return y, (x, argmax)


def _max_pool_vjp_bwd(window, residuals, dy):
    x, argmax = residuals
    return (_max_pool_bwd(dy, argmax, x, window),)


_max_pool.defvjp(_max_pool_vjp_fwd, _max_pool_vjp_bwd)


# --- average pooling: two linear stages, each the other's transpose -------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _avg_pool(x, window, count_include_pad):
    return _avg_pool_fwd_stage.bind(x, **window.attrs(), count_include_pad=count_include_pad)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _avg_pool_bwd(dy, window, count_include_pad):
    return _avg_pool_bwd_stage.bind(dy, **window.attrs(), count_include_pad=count_include_pad)[0]


_avg_pool.defvjp(lambda x, window, cip: (_avg_pool(x, window, cip), None),
                 lambda window, cip, _, dy: (_avg_pool_bwd(dy, window, cip),))
_avg_pool_bwd.defvjp(lambda dy, window, cip: (_avg_pool_bwd(dy, window, cip), None),
                     lambda window, cip, _, ddx: (_avg_pool(ddx, window, cip),))


# --- public API -----------------------------------------------------------------------------------

def _positive_ints(fn, name, values, length=None):
    try:
        values = tuple(operator.index(v) for v in values)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be a sequence of ints, got {values!r}") from None
    if length is not None and len(values) != length:
        raise ValueError(f"{fn}: {name} must have {length} entries (one per window axis), got {values}")
    if any(v < 1 for v in values):
        raise ValueError(f"{fn}: {name} entries must be >= 1, got {values}")
    return values


def _pads(fn, padding, in_spatial, window, strides):
    """(low, high) padding per spatial axis from "SAME", "VALID" or explicit pairs."""
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ValueError(f"{fn}: padding must be 'SAME', 'VALID' or a sequence of (low, high) pairs, "
                             f"got {padding!r}")
        return tuple(tuple(p) for p in jax.lax.padtype_to_pads(in_spatial, window, strides, padding.upper()))
    try:
        pads = tuple((operator.index(lo), operator.index(hi)) for lo, hi in padding)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: padding must be 'SAME', 'VALID' or a sequence of (low, high) int pairs, "
                        f"got {padding!r}") from None
    if len(pads) != len(window):
        raise ValueError(f"{fn}: padding must have {len(window)} (low, high) pairs (one per window axis), "
                         f"got {pads}")
    if any(lo < 0 or hi < 0 for lo, hi in pads):
        raise ValueError(f"{fn}: padding must be >= 0, got {pads}")
    return pads


def _prepare(fn, inputs, window_shape, strides, padding):
    """Validates the arguments; returns (x as [N..., D, H, W, C], its window, the output's shape)."""
    if not hasattr(inputs, "shape") or not hasattr(inputs, "dtype"):
        inputs = jnp.asarray(inputs)
    if inputs.dtype not in _FLOAT_TYPES:
        raise TypeError(f"{fn}: inputs must be float32, bfloat16 or float16, got {inputs.dtype}")
    if isinstance(window_shape, int) or not 1 <= len(window_shape) <= 3:
        raise ValueError(f"{fn}: window_shape must be a sequence of 1 to 3 ints (one per spatial axis), "
                         f"got {window_shape!r}")
    window = _positive_ints(fn, "window_shape", window_shape)
    spatial = len(window)
    if inputs.ndim < spatial + 1:
        raise ValueError(f"{fn}: inputs must have shape (batch..., {spatial} spatial axes, channels) for a "
                         f"{spatial}-D window_shape {window}, got shape {inputs.shape}")
    strides = (1,) * spatial if strides is None else _positive_ints(fn, "strides", strides, spatial)
    in_spatial = tuple(inputs.shape[inputs.ndim - spatial - 1:-1])
    pads = _pads(fn, padding, in_spatial, window, strides)
    for axis, (size, w, (lo, hi)) in enumerate(zip(in_spatial, window, pads)):
        if size + lo + hi < w:
            raise ValueError(f"{fn}: window_shape[{axis}] = {w} is larger than the padded input: spatial "
                             f"axis {axis} of inputs (shape {inputs.shape}) has {size} elements + "
                             f"{lo + hi} padding")
    out_spatial = tuple((size + lo + hi - w) // s + 1
                        for size, w, s, (lo, hi) in zip(in_spatial, window, strides, pads))
    missing = 3 - spatial
    key = _Window(window=(1,) * missing + window, strides=(1,) * missing + strides,
                  pads=((0, 0),) * missing + pads, in_spatial=(1,) * missing + in_spatial,
                  out_spatial=(1,) * missing + out_spatial)
    batch = inputs.shape[:inputs.ndim - spatial - 1] or (1,)  # flax's unbatched inputs: a batch of one
    x = inputs.reshape(batch + key.in_spatial + inputs.shape[-1:])
    out_shape = inputs.shape[:inputs.ndim - spatial - 1] + out_spatial + inputs.shape[-1:]
    return x, key, out_shape


def max_pool(inputs, window_shape, strides=None, padding="VALID"):
    """Max pooling, as `flax.linen.max_pool`: the maximum of each window, padding counting as -inf.

    Args:
      inputs: [N..., *spatial, C] float32, bfloat16 or float16: any number of batch axes (none too),
        1 to 3 spatial axes, channels last.
      window_shape: the window's size per spatial axis (1 to 3 ints).
      strides: the step per spatial axis (default 1).
      padding: "SAME", "VALID" or a (low, high) pair of ints >= 0 per spatial axis.

    Returns:
      [N..., *pooled, C] in the inputs' dtype. Differentiable with `jax.grad`/`jax.vjp` to any order
      (the gradient goes to the first maximal element of each window, as JAX's); `jax.jvp` is not
      supported.
    """
    x, window, out_shape = _prepare("max_pool", inputs, window_shape, strides, padding)
    y = per_row_shard(lambda x: _max_pool(x, window), x, whole_axes=4)
    return y.reshape(out_shape)


def avg_pool(inputs, window_shape, strides=None, padding="VALID", count_include_pad=True):
    """Average pooling, as `flax.linen.avg_pool`: each window's sum over its divisor.

    Args:
      inputs, window_shape, strides, padding: as `max_pool` (padding adds zeros).
      count_include_pad: divide by the window's volume (True) or by the number of its elements inside
        the inputs (False; a window entirely in the padding gives NaN, as flax's).

    Returns:
      [N..., *pooled, C] in the inputs' dtype; sums in float32. Differentiable with
      `jax.grad`/`jax.vjp` to any order; `jax.jvp` is not supported.
    """
    if not isinstance(count_include_pad, (bool, np.bool_)):
        raise TypeError(f"avg_pool: count_include_pad must be a bool, got {count_include_pad!r}")
    x, window, out_shape = _prepare("avg_pool", inputs, window_shape, strides, padding)
    y = per_row_shard(lambda x: _avg_pool(x, window, bool(count_include_pad)), x, whole_axes=4)
    return y.reshape(out_shape)
