"""Convolution: `conv_general_dilated` and `conv_transpose` with lax's signatures and meaning, and
`conv` (flax-style NHWC / HWIO) with a fused bias, residual and activation epilogue.

Shapes: the kernels see one canonical layout, batch first and channels last, 3-D (see
jaxdnn/_conv_kernels.py): x [N, D, H, W, C] * w [T, U, V, Cg, K] -> y [N, P, Q, R, K], G feature
groups (C = G * Cg, K = G * Kg). Any `dimension_numbers` is transposed to that layout and back
(channels-last operands, NHWC / HWIO / NHWC and their 1-D and 3-D forms, need no transpose), and
1-D and 2-D convolutions get size-1 spatial axes in front. `batch_group_count` B is rewritten as B
feature groups over the batch split in B (as XLA does). Every stage accumulates in float32 and
writes the operands' dtype.

Convolutions of 2 to 7 input channels with one group (an RGB stem) are rewritten first
(jaxdnn/_conv_few_channels.py): strided ones by space-to-depth into unit-stride ones on more
channels, unit-stride ones into XLA's im2col and dense's GEMM.

Differentiable with `jax.grad`/`jax.vjp` to any order (every derivative runs on the fprop, dgrad
and wgrad kernels, or dense's GEMM for the explicit-GEMM form); forward-mode `jax.jvp` is not
provided (custom_vjp).

float32 at a `precision` that allows TF32 (None unless `jax_default_matmul_precision` says
otherwise, DEFAULT, HIGH: where XLA's float32 convolutions use TF32 too) multiplies on a GPU's
tensor cores as TF32; HIGHEST keeps exact float32 products. The backward then runs as a forward
(dgrad) and, on a GPU, for windows of several taps on 32 or more channels, three 16-bit wgrads of
x's and dy's bfloat16 parts with float32 sums (within about 2^-16 of exact products, where TF32 is
2^-10), else dense's GEMM over XLA's im2col patches of x (the CPU runs its own exact wgrad): see
jaxdnn/_conv_kernels.py.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jaxdnn import _conv_few_channels as few_channels
from jaxdnn._conv_kernels import (Conv, Epilogue, fprop, fused, runs_as_dgrad, stack_features,
                                  transposed_by_dgrad)
from jaxdnn._precision import allows_tf32, result_dtype
from jaxdnn._primitive import explicit_row_sharding, match_varying, per_row_shard
from jaxdnn.activation import epilogue

_FLOAT_TYPES = [jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16)]


# --- argument checks ------------------------------------------------------------------------------

def _ints(fn, name, values, length, minimum):
    try:
        values = tuple(operator.index(v) for v in values)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be a sequence of ints, got {values!r}") from None
    if len(values) != length:
        raise ValueError(f"{fn}: {name} must have {length} entries (one per spatial axis), "
                         f"got {values}")
    if any(v < minimum for v in values):
        raise ValueError(f"{fn}: {name} entries must be >= {minimum}, got {values}")
    return values


def _count(fn, name, value):
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be an int, got {value!r}") from None
    if value < 1:
        raise ValueError(f"{fn}: {name} must be >= 1, got {value}")
    return value


def _dilations(fn, name, values, spatial):
    return (1,) * spatial if values is None else _ints(fn, name, values, spatial, 1)


def _dilate(size, dilation):
    return 0 if size == 0 else (size - 1) * dilation + 1


def _pads(fn, padding, in_spatial, window, strides, lhs_dilation, rhs_dilation):
    """(low, high) per spatial axis from "SAME", "SAME_LOWER", "VALID" (computed for the dilated
    window, as lax does) or explicit pairs (negative ones crop, as in lax)."""
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "SAME_LOWER", "VALID"):
            raise ValueError(f"{fn}: padding must be 'SAME', 'SAME_LOWER', 'VALID' or a "
                             f"sequence of (low, high) pairs, got {padding!r}")
        if any(d != 1 for d in lhs_dilation):  # as lax: the output size would be ambiguous
            raise ValueError(f"{fn}: string padding {padding!r} is not supported with lhs_dilation "
                             f"{lhs_dilation} (a transposed convolution): give (low, high) pairs, or use "
                             "conv_transpose")
        return tuple(tuple(int(p) for p in pair) for pair in lax.padtype_to_pads(
            in_spatial, tuple(map(_dilate, window, rhs_dilation)), strides, padding.upper()))
    try:
        pads = tuple((operator.index(lo), operator.index(hi)) for lo, hi in padding)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: padding must be a string or a sequence of (low, high) int "
                        f"pairs, got {padding!r}") from None
    if len(pads) != len(in_spatial):
        raise ValueError(f"{fn}: padding must have {len(in_spatial)} (low, high) pairs "
                         f"(one per spatial axis), got {pads}")
    return pads


def _dimension_numbers(fn, lhs, rhs, dimension_numbers):
    try:
        return lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    except (TypeError, ValueError, AssertionError) as error:
        raise ValueError(f"{fn}: bad dimension_numbers {dimension_numbers!r} for lhs of "
                         f"shape {lhs.shape} and rhs of shape {rhs.shape}: {error}") from None


def _operand_names(fn):
    """How `fn`'s messages name its input and filter: lax's lhs / rhs, or conv's x / w."""
    return ("x", "w") if fn == "conv" else ("lhs", "rhs")


def _check_operands(fn, lhs, rhs, preferred_element_type):
    """Checks the operands' dtypes, ranks and `preferred_element_type`; returns the result's dtype:
    the operands', or a preferred float type at least as wide (lax's rules)."""
    lhs_name, rhs_name = _operand_names(fn)
    for name, a in ((lhs_name, lhs), (rhs_name, rhs)):
        if a.dtype not in _FLOAT_TYPES:
            raise TypeError(f"{fn}: {name} must be float32, bfloat16 or float16, got {a.dtype}")
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"{fn}: {lhs_name} and {rhs_name} must have the same dtype, got {lhs.dtype} and "
                        f"{rhs.dtype}")
    if lhs.ndim != rhs.ndim or not 3 <= lhs.ndim <= 5:
        raise ValueError(f"{fn}: {lhs_name} and {rhs_name} must have the same rank, 3 to 5 (1 to 3 spatial "
                         f"axes), got shapes {lhs.shape} and {rhs.shape}")
    return result_dtype(fn, lhs.dtype, preferred_element_type)


def _check_groups(fn, x, w, feature_groups, batch_groups, lhs_shape, rhs_shape):
    """Checks the canonical x [N, *spatial, C] and w [*window, I, K] against the group counts."""
    lhs_name, rhs_name = _operand_names(fn)
    shapes = f"({lhs_name} shape {lhs_shape}, {rhs_name} shape {rhs_shape})"
    batch, channels, in_features, filters = x.shape[0], x.shape[-1], w.shape[-2], w.shape[-1]
    if feature_groups > 1 and batch_groups > 1:
        raise ValueError(f"{fn}: at most one of feature_group_count and batch_group_count may "
                         f"be > 1, got {feature_groups} and {batch_groups}")
    if channels % feature_groups:
        raise ValueError(f"{fn}: feature_group_count = {feature_groups} must divide {lhs_name}'s "
                         f"{channels} input features {shapes}")
    if channels != feature_groups * in_features:
        raise ValueError(f"{fn}: channel mismatch: {lhs_name} has {channels} input features, {rhs_name} "
                         f"{in_features} per group x feature_group_count {feature_groups} {shapes}")
    for name, groups in (("feature_group_count", feature_groups), ("batch_group_count", batch_groups)):
        if filters % groups:
            raise ValueError(f"{fn}: {name} = {groups} must divide {rhs_name}'s {filters} output "
                             f"features {shapes}")
    if batch % batch_groups:
        raise ValueError(f"{fn}: batch_group_count = {batch_groups} must divide {lhs_name}'s batch "
                         f"size {batch} {shapes}")


def _permute(a, perm):
    return a if tuple(perm) == tuple(range(a.ndim)) else jnp.transpose(a, perm)


def _prepare(fn, lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
             feature_group_count, batch_group_count, preferred_element_type, precision):
    """Validates a convolution's arguments. Returns (x [N, D, H, W, C], w [T, U, V, Cg, K], its Conv,
    finish), where finish maps the kernels' y [N, P, Q, R, K] back to the caller's layout and dtype.

    A `preferred_element_type` other than the 16-bit operands' dtype runs the float32 kernels on the
    operands widened to float32 with TF32 products (exact for them: _precision.result_dtype). The
    gradients come back in the operands' dtype, as lax's."""
    lhs, rhs = (a if hasattr(a, "shape") and hasattr(a, "dtype") else jnp.asarray(a) for a in (lhs, rhs))
    out_dtype = _check_operands(fn, lhs, rhs, preferred_element_type)
    widened = out_dtype != lhs.dtype
    if widened:
        lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    numbers = _dimension_numbers(fn, lhs, rhs, dimension_numbers)
    spatial = lhs.ndim - 2
    feature_groups = _count(fn, "feature_group_count", feature_group_count)
    batch_groups = _count(fn, "batch_group_count", batch_group_count)
    strides = _ints(fn, "window_strides", window_strides, spatial, 1)
    lhs_dilation = _dilations(fn, "lhs_dilation", lhs_dilation, spatial)
    rhs_dilation = _dilations(fn, "rhs_dilation", rhs_dilation, spatial)

    # The canonical layout: x [N, *spatial, C], w [*window, I, K], y [N, *out, K].
    lhs_perm = (numbers.lhs_spec[0], *numbers.lhs_spec[2:], numbers.lhs_spec[1])
    rhs_perm = (*numbers.rhs_spec[2:], numbers.rhs_spec[1], numbers.rhs_spec[0])
    out_perm = (numbers.out_spec[0], *numbers.out_spec[2:], numbers.out_spec[1])
    x, w = _permute(lhs, lhs_perm), _permute(rhs, rhs_perm)
    _check_groups(fn, x, w, feature_groups, batch_groups, lhs.shape, rhs.shape)
    in_spatial, window = x.shape[1:-1], w.shape[:-2]
    if any(size < 1 for size in window):
        raise ValueError(f"{fn}: rhs's spatial sizes must be >= 1, got {window} (rhs shape {rhs.shape})")
    pads = _pads(fn, padding, in_spatial, window, strides, lhs_dilation, rhs_dilation)
    out_spatial = []
    for axis in range(spatial):
        room = (_dilate(in_spatial[axis], lhs_dilation[axis]) + sum(pads[axis])
                - _dilate(window[axis], rhs_dilation[axis]))
        if room < 0:
            raise ValueError(f"{fn}: rhs's window on spatial axis {axis} (size "
                             f"{window[axis]}, dilation {rhs_dilation[axis]}) is larger than the dilated, "
                             f"padded lhs (size {in_spatial[axis]}, dilation {lhs_dilation[axis]}, padding "
                             f"{pads[axis]}); lhs shape {lhs.shape}, rhs shape {rhs.shape}")
        out_spatial.append(room // strides[axis] + 1)

    if batch_groups > 1:  # batch group b of N/B samples becomes feature group b of the channels
        x = stack_features(x.reshape((batch_groups, -1) + x.shape[1:]), batch_groups)
    missing = 3 - spatial
    ones = (1,) * missing
    conv = Conv(in_spatial=ones + tuple(in_spatial), out_spatial=ones + tuple(out_spatial),
                window=ones + tuple(window), strides=ones + strides,
                pads=(0,) * missing + tuple(lo for lo, _ in pads), lhs_dilation=ones + lhs_dilation,
                rhs_dilation=ones + rhs_dilation, groups=feature_groups * batch_groups,
                tf32=bool(x.dtype == jnp.float32 and (widened or allows_tf32(precision))))
    x = x.reshape(x.shape[:1] + conv.in_spatial + x.shape[-1:])
    w = w.reshape(conv.window + w.shape[-2:])

    def finish(y):
        y = y.reshape(y.shape[:1] + tuple(out_spatial) + y.shape[-1:])
        y = _permute(y, np.argsort(out_perm))
        return y.astype(out_dtype) if widened else y
    return x, w, conv, finish


# --- public API -----------------------------------------------------------------------------------

def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count=1, batch_group_count=1, precision=None,
                         preferred_element_type=None, out_sharding=None):
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
      precision: as lax's: for float32 operands, None (unless `jax_default_matmul_precision` says
        otherwise), DEFAULT or HIGH let a GPU multiply them as TF32 on the tensor cores (as XLA's
        float32 convolutions do); HIGHEST (or a float32-accurate dot algorithm) keeps the products
        exact. 16-bit operands are multiplied exactly either way; sums are float32.
      preferred_element_type: None (the operands' dtype) or the result's float dtype, at least as
        wide as the operands' (lax's rules). For 16-bit operands and a float32 (or the other 16-bit)
        result, the float32 kernels run on the operands widened to float32 (exact products, float32
        sums rounded once): twice the bytes, and on a GPU the TF32 rate.
      out_sharding: None, or the result's sharding (a `NamedSharding`, or a `PartitionSpec` under an
        Explicit mesh), as lax's: the result is resharded to it (`jax.sharding.reshard`).

    Returns:
      The convolution in the layout of `dimension_numbers`' output spec, in `preferred_element_type`
      (the operands' dtype by default); gradients in the operands' dtype.
      Differentiable with `jax.grad`/`jax.vjp` to any order; `jax.jvp` is not supported.
    """
    x, w, conv, finish = _prepare("conv_general_dilated", lhs, rhs, window_strides, padding, lhs_dilation,
                                  rhs_dilation, dimension_numbers, feature_group_count, batch_group_count,
                                  preferred_element_type, precision)
    y = finish(per_row_shard(lambda x, w: _forward(x, w, conv), x, w, whole_axes=4))
    return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)


def _forward(x, w, geometry, bias=None, residual=None, activation=None):
    """act(conv(x, w) + bias + residual) on the canonical layout, on the convolution kernels (with
    an epilogue, in the fused kernel's). Few-channel convolutions are rewritten first
    (jaxdnn/_conv_few_channels.py): strided ones by space-to-depth, the others as an explicit GEMM;
    transposed ones (lhs dilation) run as the dgrad of the strided convolution they transpose."""
    if bias is None and residual is None and activation is None and runs_as_dgrad(geometry):
        return transposed_by_dgrad(x, *match_varying(x, w), geometry)
    if few_channels.takes_space_to_depth(x.shape, w.shape, geometry):
        x, w, geometry = few_channels.space_to_depth(x, w, geometry)
    elif residual is None and few_channels.takes_gemm(x.shape, w.shape, geometry):
        return few_channels.gemm_convolve(x, w, geometry, bias, activation)
    kind, param = epilogue("conv", activation)
    if bias is None and residual is None and kind == "identity":
        return fprop(x, *match_varying(x, w), geometry)
    if bias is None:
        bias = jnp.zeros((w.shape[-1],), x.dtype)
    w, bias = match_varying(x, w, bias)
    return fused(x, w, bias, residual, geometry, Epilogue(kind, float(param), residual is not None))


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
    _check_operands("conv_transpose", lhs, rhs, preferred_element_type)
    if dimension_numbers is None:
        dimension_numbers = _TRANSPOSE_LAYOUTS[lhs.ndim]
    numbers = _dimension_numbers("conv_transpose", lhs, rhs, dimension_numbers)
    spatial = lhs.ndim - 2
    strides = _ints("conv_transpose", "strides", strides, spatial, 1)
    rhs_dilation = _dilations("conv_transpose", "rhs_dilation", rhs_dilation, spatial)
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


_CHANNELS_LAST = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC"), 3: ("NDHWC", "DHWIO", "NDHWC")}


def _per_axis(fn, name, value, spatial):
    """An int for every spatial axis, or one int per axis."""
    try:
        return (operator.index(value),) * spatial
    except TypeError:
        return _ints(fn, name, value, spatial, 1)


def _fused_operand(fn, name, a, shape):
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        a = jnp.asarray(a)
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{fn}: {name} must have shape {tuple(shape)}, got {tuple(a.shape)}")
    if a.dtype not in _FLOAT_TYPES:
        raise TypeError(f"{fn}: {name} must be float32, bfloat16 or float16, got {a.dtype}")
    return a


def conv(x, w, bias=None, *, activation=None, residual=None, strides=1, padding="SAME", dilation=1,
         groups=1, precision=None):
    """act(conv(x, w) + bias + residual), the epilogue fused into the forward kernel.

    Args:
      x: [N, *spatial, C], 1 to 3 spatial axes, channels last; float32, bfloat16 or float16.
      w: [*window, C / groups, K] (flax's `kernel` layout, HWIO), x's dtype.
      bias: None or [K], float32, bfloat16 or float16 (used in x's dtype).
      activation: None or a name of `jaxdnn.activation.EPILOGUES` ("relu", "gelu", "silu", ...).
      residual: None or [N, *out, K], the output's shape, x's dtype (e.g. a ResNet shortcut).
      strides, dilation: an int or one int per spatial axis (dilation is the kernel's).
      padding: "SAME", "SAME_LOWER", "VALID" or a (low, high) pair per spatial axis.
      groups: feature groups (C for depthwise).
      precision: as `conv_general_dilated`'s (float32 as TF32 on a GPU unless HIGHEST).

    Returns:
      [N, *out, K] in x's dtype. Differentiable to any order (`jax.jvp` is not supported); with an
      activation the backward's one pass over dy and z writes dz = act'(z) dy and dbias's column
      sums.
    """
    kind, _ = epilogue("conv", activation)  # checks the name early
    x, w = (a if hasattr(a, "shape") and hasattr(a, "dtype") else jnp.asarray(a) for a in (x, w))
    spatial = x.ndim - 2
    if spatial in _CHANNELS_LAST:
        strides = _per_axis("conv", "strides", strides, spatial)
        dilation = _per_axis("conv", "dilation", dilation, spatial)
    x5, w5, geometry, finish = _prepare("conv", x, w, strides, padding, None, dilation,
                                        _CHANNELS_LAST.get(spatial), groups, 1, None, precision)
    if bias is None and residual is None and kind == "identity":
        return finish(per_row_shard(lambda x, w: _forward(x, w, geometry), x5, w5, whole_axes=4))
    filters = w.shape[-1]
    if bias is None:
        bias = jnp.zeros((filters,), x.dtype)
    bias = _fused_operand("conv", "bias", bias, (filters,)).astype(x.dtype)
    y_shape = x5.shape[:1] + geometry.out_spatial + (filters,)
    operands = [x5, w5, bias]
    if residual is not None:
        out_shape = x.shape[:1] + geometry.out_spatial[3 - spatial:] + (filters,)
        residual = _fused_operand("conv", "residual", residual, out_shape)
        if residual.dtype != x.dtype:
            raise TypeError(f"conv: residual must have x's dtype {x.dtype}, got {residual.dtype}")
        operands.append(residual.reshape(y_shape))

    def run(x, w, bias, *residual):
        return _forward(x, w, geometry, bias, residual[0] if residual else None, activation)

    sharded = explicit_row_sharding(x5, whole_axes=4)
    if sharded is None:
        return finish(run(*operands))
    mesh, spec, axes = sharded  # Explicit mesh axes: x and the residual run per shard
    in_specs = (spec, PartitionSpec(), PartitionSpec()) + (spec,) * (len(operands) - 3)
    y = jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=spec, axis_names=set(axes))(*operands)
    return finish(y)
