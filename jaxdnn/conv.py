"""Convolution with `lax.conv_general_dilated`'s signature and meaning: `conv_general_dilated`.

Shapes: the kernels see one canonical layout, batch first and channels last, 3-D:
  x [N, D, H, W, C]  *  w [T, U, V, Cg, K]  ->  y [N, P, Q, R, K]
with G feature groups (C = G * Cg, K = G * Kg; output feature k reads the input channels of group
k // Kg). Any `dimension_numbers` is transposed to that layout and back (channels-last operands,
NHWC / HWIO / NHWC and their 1-D and 3-D forms, need no transpose), and 1-D and 2-D convolutions get
size-1 spatial axes in front. `batch_group_count` B is rewritten as B feature groups over the batch
split in B (as XLA does). Every stage accumulates in float32 and writes the operands' dtype.

Three kernel stages (FFI targets, see ffi/conv/conv.h): fprop (the forward), dgrad (the gradient
w.r.t. x) and wgrad (the gradient w.r.t. w). They are bilinear and each one's VJP is made of the
other two, so every order of reverse-mode derivatives (gradient penalties, grad of grad) runs on the
kernels. Forward-mode `jax.jvp` is not provided (custom_vjp).
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdnn import _ffi  # noqa: F401  (registers the FFI targets)
from jaxdnn._primitive import ffi_primitive, match_varying, move_to_front, per_row_shard

_FLOAT_TYPES = [jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16)]


@dataclasses.dataclass(frozen=True)
class _Conv:
    """A convolution on the kernels' 3-D form (axes d, h, w); hashable, a static argument."""
    in_spatial: tuple[int, int, int]   # D H W
    out_spatial: tuple[int, int, int]  # P Q R
    window: tuple[int, int, int]       # T U V
    strides: tuple[int, int, int]
    pads: tuple[int, int, int]         # low padding (may be negative); the high one shows in P Q R
    lhs_dilation: tuple[int, int, int]
    rhs_dilation: tuple[int, int, int]
    groups: int

    def attrs(self) -> dict:
        """The targets' attributes (int64, see ffi/conv/conv.h)."""
        values = {"in": self.in_spatial, "out": self.out_spatial, "window": self.window,
                  "stride": self.strides, "pad": self.pads, "lhs_dilation": self.lhs_dilation,
                  "rhs_dilation": self.rhs_dilation}
        attrs = {f"{name}_{axis}": np.int64(v[i])
                 for name, v in values.items() for i, axis in enumerate("dhw")}
        attrs["groups"] = np.int64(self.groups)
        return attrs


def _spatial(attrs, prefix):
    return tuple(int(attrs[f"{prefix}_{axis}"]) for axis in "dhw")


# --- the kernel stages ----------------------------------------------------------------------------

def _fprop_avals(x, w, **attrs):
    return [jax.core.ShapedArray((x.shape[0],) + _spatial(attrs, "out") + (w.shape[-1],), x.dtype)]


def _dgrad_avals(dy, w, **attrs):
    channels = int(attrs["groups"]) * w.shape[3]
    return [jax.core.ShapedArray((dy.shape[0],) + _spatial(attrs, "in") + (channels,), dy.dtype)]


def _wgrad_avals(x, dy, **attrs):
    group_channels = x.shape[-1] // int(attrs["groups"])
    return [jax.core.ShapedArray(_spatial(attrs, "window") + (group_channels, dy.shape[-1]), x.dtype)]


def _stack_features(a, size):
    """[B, ..., F] -> [..., B * F]: the vmapped copies side by side as feature groups."""
    return jnp.moveaxis(a, 0, -2).reshape(a.shape[1:-1] + (size * a.shape[-1],))


def _unstack_features(a, size):
    """[..., B * F] -> [B, ..., F]: the inverse of _stack_features."""
    return jnp.moveaxis(a.reshape(a.shape[:-1] + (size, a.shape[-1] // size)), -2, 0)


def _batch_rule(prim, args, dims, *, fold_into_batch, **attrs):
    """Batching of a stage (a, b) -> out. When only the batch-major operand `a` is vmapped (and the
    stage allows it, `fold_into_batch`), the vmapped axis joins N. Otherwise each vmapped copy becomes
    its own set of feature groups: channels, filters and outputs of the B copies side by side, B * G
    groups (unbatched operands are broadcast first)."""
    (a, b), (a_dim, b_dim) = args, dims
    size = a.shape[a_dim] if a_dim is not None else b.shape[b_dim]
    if fold_into_batch and b_dim is None:
        a = jnp.moveaxis(a, a_dim, 0)
        out = prim.bind(a.reshape((-1,) + a.shape[2:]), b, **attrs)[0]
        return [out.reshape((size, -1) + out.shape[1:])], [0]
    a, b = move_to_front(a, a_dim, size), move_to_front(b, b_dim, size)
    attrs = dict(attrs, groups=np.int64(size * int(attrs["groups"])))
    out = prim.bind(_stack_features(a, size), _stack_features(b, size), **attrs)[0]
    return [_unstack_features(out, size)], [0]


def _stage(name, result_avals, rule, fold_into_batch, **kwargs):
    return ffi_primitive(f"jaxdnn_conv_{name}", f"jaxdnn_conv_{name}_v1", result_avals=result_avals,
                         sharding_rule=rule,
                         batch_rule=functools.partial(_batch_rule, fold_into_batch=fold_into_batch), **kwargs)


# `...` is N: a batch-sharded x or dy runs per shard; the filter is replicated and its gradient is
# summed over the shards. Every other axis has its own factor (their sizes differ between operands).
_fprop_stage = _stage("fprop", _fprop_avals, "... d h w c, t u v i k -> ... p q r o", True)
_dgrad_stage = _stage("dgrad", _dgrad_avals, "... p q r k, t u v i o -> ... d h w c", True)
_wgrad_stage = _stage("wgrad", _wgrad_avals, "... d h w c, ... p q r k -> t u v i o", False,
                      reduced_results=(0,))


# --- three bilinear stages, each differentiated by the other two ---------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fprop(x, w, conv):
    return _fprop_stage.bind(x, w, **conv.attrs())[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dgrad(dy, w, conv):
    return _dgrad_stage.bind(dy, w, **conv.attrs())[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _wgrad(x, dy, conv):
    return _wgrad_stage.bind(x, dy, **conv.attrs())[0]


def _fprop_bwd(conv, residuals, dy):
    x, w = residuals
    return _dgrad(dy, w, conv), _wgrad(x, dy, conv)


def _dgrad_bwd(conv, residuals, ddx):
    dy, w = residuals  # dgrad(dy, w) = fprop's transpose in x: <ddx, dgrad(dy, w)> = <fprop(ddx, w), dy>
    return _fprop(ddx, w, conv), _wgrad(ddx, dy, conv)


def _wgrad_bwd(conv, residuals, ddw):
    x, dy = residuals  # <ddw, wgrad(x, dy)> = <fprop(x, ddw), dy>
    return _dgrad(dy, ddw, conv), _fprop(x, ddw, conv)


_fprop.defvjp(lambda x, w, conv: (_fprop(x, w, conv), (x, w)), _fprop_bwd)
_dgrad.defvjp(lambda dy, w, conv: (_dgrad(dy, w, conv), (dy, w)), _dgrad_bwd)
_wgrad.defvjp(lambda x, dy, conv: (_wgrad(x, dy, conv), (x, dy)), _wgrad_bwd)


# --- argument checks ------------------------------------------------------------------------------

def _ints(name, values, length, minimum):
    try:
        values = tuple(operator.index(v) for v in values)
    except TypeError:
        raise TypeError(f"conv_general_dilated: {name} must be a sequence of ints, got {values!r}") from None
    if len(values) != length:
        raise ValueError(f"conv_general_dilated: {name} must have {length} entries (one per spatial axis), "
                         f"got {values}")
    if any(v < minimum for v in values):
        raise ValueError(f"conv_general_dilated: {name} entries must be >= {minimum}, got {values}")
    return values


def _count(name, value):
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"conv_general_dilated: {name} must be an int, got {value!r}") from None
    if value < 1:
        raise ValueError(f"conv_general_dilated: {name} must be >= 1, got {value}")
    return value


def _dilate(size, dilation):
    return 0 if size == 0 else (size - 1) * dilation + 1


def _pads(padding, in_spatial, window, strides, lhs_dilation, rhs_dilation):
    """(low, high) per spatial axis from "SAME", "SAME_LOWER", "VALID" or explicit pairs (negative
    ones crop, as in lax); strings pad the dilated shapes, as lax does."""
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "SAME_LOWER", "VALID"):
            raise ValueError("conv_general_dilated: padding must be 'SAME', 'SAME_LOWER', 'VALID' or a "
                             f"sequence of (low, high) pairs, got {padding!r}")
        return tuple(tuple(int(p) for p in pair) for pair in lax.padtype_to_pads(
            tuple(map(_dilate, in_spatial, lhs_dilation)), tuple(map(_dilate, window, rhs_dilation)), strides,
            padding.upper()))
    try:
        pads = tuple((operator.index(lo), operator.index(hi)) for lo, hi in padding)
    except (TypeError, ValueError):
        raise TypeError("conv_general_dilated: padding must be a string or a sequence of (low, high) int "
                        f"pairs, got {padding!r}") from None
    if len(pads) != len(in_spatial):
        raise ValueError(f"conv_general_dilated: padding must have {len(in_spatial)} (low, high) pairs "
                         f"(one per spatial axis), got {pads}")
    return pads


def _dimension_numbers(lhs, rhs, dimension_numbers):
    try:
        return lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    except (TypeError, ValueError, AssertionError) as error:
        raise ValueError(f"conv_general_dilated: bad dimension_numbers {dimension_numbers!r} for lhs of "
                         f"shape {lhs.shape} and rhs of shape {rhs.shape}: {error}") from None


def _check_operands(lhs, rhs, preferred_element_type):
    for name, a in (("lhs", lhs), ("rhs", rhs)):
        if a.dtype not in _FLOAT_TYPES:
            raise TypeError(f"conv_general_dilated: {name} must be float32, bfloat16 or float16, got "
                            f"{a.dtype}")
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"conv_general_dilated: lhs and rhs must have the same dtype, got {lhs.dtype} and "
                        f"{rhs.dtype}")
    if preferred_element_type is not None and jnp.dtype(preferred_element_type) != lhs.dtype:
        raise TypeError("conv_general_dilated: preferred_element_type must be None or the operands' dtype "
                        f"{lhs.dtype} (the kernels accumulate in float32 and write the operands' dtype), got "
                        f"{jnp.dtype(preferred_element_type)}")
    if lhs.ndim != rhs.ndim or not 3 <= lhs.ndim <= 5:
        raise ValueError("conv_general_dilated: lhs and rhs must have the same rank, 3 to 5 (1 to 3 spatial "
                         f"axes), got shapes {lhs.shape} and {rhs.shape}")


def _check_groups(x, w, feature_groups, batch_groups, lhs_shape, rhs_shape):
    """Checks the canonical x [N, *spatial, C] and w [*window, I, K] against the group counts."""
    shapes = f"(lhs shape {lhs_shape}, rhs shape {rhs_shape})"
    batch, channels, in_features, filters = x.shape[0], x.shape[-1], w.shape[-2], w.shape[-1]
    if feature_groups > 1 and batch_groups > 1:
        raise ValueError("conv_general_dilated: at most one of feature_group_count and batch_group_count may "
                         f"be > 1, got {feature_groups} and {batch_groups}")
    if channels % feature_groups:
        raise ValueError(f"conv_general_dilated: feature_group_count = {feature_groups} must divide lhs's "
                         f"{channels} input features {shapes}")
    if channels != feature_groups * in_features:
        raise ValueError(f"conv_general_dilated: channel mismatch: lhs has {channels} input features, rhs "
                         f"{in_features} per group x feature_group_count {feature_groups} {shapes}")
    for name, groups in (("feature_group_count", feature_groups), ("batch_group_count", batch_groups)):
        if filters % groups:
            raise ValueError(f"conv_general_dilated: {name} = {groups} must divide rhs's {filters} output "
                             f"features {shapes}")
    if batch % batch_groups:
        raise ValueError(f"conv_general_dilated: batch_group_count = {batch_groups} must divide lhs's batch "
                         f"size {batch} {shapes}")


def _permute(a, perm):
    return a if tuple(perm) == tuple(range(a.ndim)) else jnp.transpose(a, perm)


# --- public API -----------------------------------------------------------------------------------

def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count=1, batch_group_count=1, precision=None,
                         preferred_element_type=None):
    """A general dilated convolution, as `jax.lax.conv_general_dilated` (same arguments, same result).

    Args:
      lhs: the input, rank 3 to 5 (1 to 3 spatial axes) in the layout `dimension_numbers` names
        (default NC*spatial*); float32, bfloat16 or float16.
      rhs: the filter, rhs's rank and dtype (default layout OI*spatial*); its input-feature axis holds
        C / feature_group_count features.
      window_strides: the step per spatial axis (ints >= 1).
      padding: "SAME", "SAME_LOWER", "VALID" (computed on the dilated shapes, as lax does) or a
        (low, high) pair of ints per spatial axis; negative entries crop.
      lhs_dilation: input dilation per spatial axis (a transposed convolution); default 1.
      rhs_dilation: filter (atrous) dilation per spatial axis; default 1.
      dimension_numbers: None, a `lax.ConvDimensionNumbers` or a tuple of three layout strings such
        as ("NHWC", "HWIO", "NHWC"). Channels-last layouts run without transposes; any other is
        transposed to them around the kernels.
      feature_group_count: G: grouped (and, with G = C, depthwise) convolution.
      batch_group_count: B: lhs's batch split in B groups, each convolved with K / B of the filters
        (at most one of the two counts may exceed 1, as in lax).
      precision: accepted for compatibility and ignored: the kernels multiply in the operands' type
        and accumulate in float32.
      preferred_element_type: None or the operands' dtype (the result's dtype is the operands').

    Returns:
      The convolution in the layout of `dimension_numbers`' output spec, the operands' dtype.
      Differentiable with `jax.grad`/`jax.vjp` to any order; `jax.jvp` is not supported.
    """
    del precision  # the kernels always accumulate in float32
    lhs, rhs = (a if hasattr(a, "shape") and hasattr(a, "dtype") else jnp.asarray(a) for a in (lhs, rhs))
    _check_operands(lhs, rhs, preferred_element_type)
    numbers = _dimension_numbers(lhs, rhs, dimension_numbers)
    spatial = lhs.ndim - 2
    feature_groups = _count("feature_group_count", feature_group_count)
    batch_groups = _count("batch_group_count", batch_group_count)
    strides = _ints("window_strides", window_strides, spatial, 1)
    lhs_dilation = (1,) * spatial if lhs_dilation is None else _ints("lhs_dilation", lhs_dilation, spatial, 1)
    rhs_dilation = (1,) * spatial if rhs_dilation is None else _ints("rhs_dilation", rhs_dilation, spatial, 1)

    # The canonical layout: x [N, *spatial, C], w [*window, I, K], y [N, *out, K].
    lhs_perm = (numbers.lhs_spec[0], *numbers.lhs_spec[2:], numbers.lhs_spec[1])
    rhs_perm = (*numbers.rhs_spec[2:], numbers.rhs_spec[1], numbers.rhs_spec[0])
    out_perm = (numbers.out_spec[0], *numbers.out_spec[2:], numbers.out_spec[1])
    x, w = _permute(lhs, lhs_perm), _permute(rhs, rhs_perm)
    _check_groups(x, w, feature_groups, batch_groups, lhs.shape, rhs.shape)
    in_spatial, window = x.shape[1:-1], w.shape[:-2]
    if any(size < 1 for size in window):
        raise ValueError(f"conv_general_dilated: rhs's spatial sizes must be >= 1, got {window} (rhs shape "
                         f"{rhs.shape})")
    pads = _pads(padding, in_spatial, window, strides, lhs_dilation, rhs_dilation)
    out_spatial = []
    for axis in range(spatial):
        room = (_dilate(in_spatial[axis], lhs_dilation[axis]) + sum(pads[axis])
                - _dilate(window[axis], rhs_dilation[axis]))
        if room < 0:
            raise ValueError(f"conv_general_dilated: rhs's window on spatial axis {axis} (size "
                             f"{window[axis]}, dilation {rhs_dilation[axis]}) is larger than the dilated, "
                             f"padded lhs (size {in_spatial[axis]}, dilation {lhs_dilation[axis]}, padding "
                             f"{pads[axis]}); lhs shape {lhs.shape}, rhs shape {rhs.shape}")
        out_spatial.append(room // strides[axis] + 1)

    if batch_groups > 1:  # batch group b of N/B samples becomes feature group b of the channels
        x = _stack_features(x.reshape((batch_groups, -1) + x.shape[1:]), batch_groups)
    missing = 3 - spatial
    ones = (1,) * missing
    conv = _Conv(in_spatial=ones + tuple(in_spatial), out_spatial=ones + tuple(out_spatial),
                 window=ones + tuple(window), strides=ones + strides,
                 pads=(0,) * missing + tuple(lo for lo, _ in pads), lhs_dilation=ones + lhs_dilation,
                 rhs_dilation=ones + rhs_dilation, groups=feature_groups * batch_groups)
    x = x.reshape(x.shape[:1] + conv.in_spatial + x.shape[-1:])
    w = w.reshape(conv.window + w.shape[-2:])
    y = per_row_shard(lambda x, w: _fprop(x, *match_varying(x, w), conv), x, w, whole_axes=4)
    y = y.reshape(y.shape[:1] + tuple(out_spatial) + y.shape[-1:])
    return _permute(y, np.argsort(out_perm))


def _transpose_pads(window, stride, padding):
    """(low, high) padding of the lhs-dilated input for a transposed convolution on one axis, as
    lax.conv_transpose: 'SAME'/'VALID' (or a forward (low, high) pair under consistent padding) name
    the padding of the forward convolution it transposes."""
    if padding == "SAME":
        total = window + stride - 2
        low = window - 1 if stride > window - 1 else -(-total // 2)
    elif padding == "VALID":
        total = window + stride - 2 + max(window - stride, 0)
        low = window - 1
    else:
        low, high = window - 1 - padding[0], window - 1 - padding[1]
        total = low + high
    return low, total - low


_TRANSPOSE_LAYOUTS = {3: ("NHC", "HIO", "NHC"), 4: ("NHWC", "HWIO", "NHWC"), 5: ("NHWDC", "HWDIO", "NHWDC")}


def conv_transpose(lhs, rhs, strides, padding, rhs_dilation=None, dimension_numbers=None,
                   transpose_kernel=False, precision=None, preferred_element_type=None,
                   use_consistent_padding=False):
    """A transposed ("fractionally strided") convolution, as `jax.lax.conv_transpose`: lhs dilated by
    `strides` and convolved with stride 1 by `conv_general_dilated`'s kernels.

    Args:
      lhs, rhs: as `conv_general_dilated`; the default `dimension_numbers` is channels last (NHC/HIO,
        NHWC/HWIO, NHWDC/HWDIO), as lax's.
      strides: the fractional stride per spatial axis (the lhs dilation).
      padding: "SAME" or "VALID" (the padding of the forward convolution this transposes), or
        (low, high) pairs: of the transposed convolution itself, or of the forward one when
        `use_consistent_padding` (PyTorch's convention).
      rhs_dilation, precision, preferred_element_type: as `conv_general_dilated`.
      transpose_kernel: flip the window and swap rhs's input and output feature axes (Keras'
        Conv2DTranspose on the same kernel).

    Returns:
      The transposed convolution, in lhs's dtype. Differentiable to any order; not with `jax.jvp`.
    """
    lhs, rhs = (a if hasattr(a, "shape") and hasattr(a, "dtype") else jnp.asarray(a) for a in (lhs, rhs))
    _check_operands(lhs, rhs, preferred_element_type)
    if dimension_numbers is None:
        dimension_numbers = _TRANSPOSE_LAYOUTS[lhs.ndim]
    numbers = _dimension_numbers(lhs, rhs, dimension_numbers)
    spatial = lhs.ndim - 2
    strides = _ints("strides", strides, spatial, 1)
    rhs_dilation = (1,) * spatial if rhs_dilation is None else _ints("rhs_dilation", rhs_dilation, spatial, 1)
    if use_consistent_padding or isinstance(padding, str):
        if isinstance(padding, str):
            if padding not in ("SAME", "VALID"):
                raise ValueError("conv_transpose: padding must be 'SAME', 'VALID' or a sequence of (low, "
                                 f"high) pairs, got {padding!r}")
            padding = (padding,) * spatial
        window = [_dilate(rhs.shape[axis], d) for axis, d in zip(numbers.rhs_spec[2:], rhs_dilation)]
        padding = tuple(_transpose_pads(k, s, p) for k, s, p in zip(window, strides, padding))
    if transpose_kernel:
        rhs = jnp.flip(rhs, tuple(numbers.rhs_spec[2:])).swapaxes(numbers.rhs_spec[0], numbers.rhs_spec[1])
    return conv_general_dilated(lhs, rhs, (1,) * spatial, padding, lhs_dilation=strides,
                                rhs_dilation=rhs_dilation, dimension_numbers=numbers, precision=precision,
                                preferred_element_type=preferred_element_type)
