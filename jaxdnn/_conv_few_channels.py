"""Few-channel convolutions (an RGB stem: 2 to 7 input channels), rewritten for the tensor cores.

The implicit-GEMM kernels take channels in multiples of 8 (TMA's 16-byte rows): with C < 8 they pad
the channels to 8, and their reduction tiles of 64 channels per tap then multiply mostly zeros. Two
rewrites avoid that (measured on an H200: ResNet's 7x7/2 stem forward went from 2.9 ms through the
padded kernels and 1.9 ms as an explicit GEMM to 0.67 ms with space-to-depth; cuDNN 0.96 ms):
- Strided (`space_to_depth`): each s x s block of pixels becomes one pixel of s^2 C channels and the
  window shrinks to ceil(k / s) taps of stride 1, the filter rearranged to match (zero taps pad it
  to a multiple of s). The result is an ordinary convolution for the kernels, with 4x the channels
  (12 for RGB, padded to 16) and no stride; x and w move through XLA's pad/reshape/transpose (and
  their gradients back), about one copy of x.
- Unit stride (`gemm_convolve`): XLA gathers each output pixel's window into a row of a patches
  matrix (im2col, taps * C values padded to a multiple of 8) and dense's GEMM multiplies it by the
  filter, the bias and activation in its epilogue; its gradients are two more GEMMs (the weight
  gradient split over the rows) and XLA's transpose of the gather. The patches matrix, taps times
  x, is kept for the backward.
The space-to-depth form also serves the 16-bit strided dgrad of any channel count
(jaxdnn/_conv_kernels.py's `_dgrad_by_blocks`): `filter_blocks` and the transpose of `input_blocks`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax.numpy as jnp
from jax import lax

from jaxdnn.dense import dense


def _few_channels(x_shape, w_shape, geometry) -> bool:
    """One group, no lhs dilation, 2 <= C < 8 (C = 1 is a depthwise kernel's), nothing empty."""
    return (geometry.groups == 1 and geometry.lhs_dilation == (1, 1, 1) and 2 <= x_shape[-1] < 8
            and math.prod(x_shape) > 0 and math.prod(w_shape) > 0 and math.prod(geometry.out_spatial) > 0)


def takes_space_to_depth(x_shape, w_shape, geometry) -> bool:
    """Whether `space_to_depth` rewrites the convolution `geometry` (a jaxdnn._conv_kernels.Conv) of
    x [N, D, H, W, C] with w [T, U, V, C, K]: few channels, a stride > 1, no filter dilation on the
    strided axes."""
    strided = [s > 1 for s in geometry.strides]
    return (_few_channels(x_shape, w_shape, geometry) and any(strided)
            and all(d == 1 for d, st in zip(geometry.rhs_dilation, strided) if st))


def takes_gemm(x_shape, w_shape, geometry) -> bool:
    """Whether `gemm_convolve` takes the (unit-stride) few-channel convolution `geometry`."""
    return _few_channels(x_shape, w_shape, geometry) and math.prod(geometry.window) > 1


def pad_channels(a, axis):
    """Zeros appended on `axis` up to a multiple of 8."""
    extra = -a.shape[axis] % 8
    if not extra:
        return a
    return jnp.pad(a, [(0, extra if i == axis % a.ndim else 0) for i in range(a.ndim)])


def _blocks_plan(geometry):
    """The space-to-depth rewrite of `geometry`: the padding of x and of w on each axis, and the
    unit-stride geometry (see `space_to_depth`)."""
    g = geometry
    x_pads, w_pads, new = [(0, 0)], [], dict(in_spatial=[], window=[], pads=[])
    for extent, out, k, s, lo in zip(g.in_spatial, g.out_spatial, g.window, g.strides, g.pads):
        if s == 1:
            x_pads.append((0, 0))
            w_pads.append((0, 0))
            new["in_spatial"].append(extent)
            new["window"].append(k)
            new["pads"].append(lo)
            continue
        taps = -(-k // s)
        length = (out + taps - 1) * s
        x_pads.append((lo, length - extent - lo))
        w_pads.append((0, taps * s - k))
        new["in_spatial"].append(length // s)
        new["window"].append(taps)
        new["pads"].append(0)
    unit = dataclasses.replace(g, in_spatial=tuple(new["in_spatial"]), window=tuple(new["window"]),
                               pads=tuple(new["pads"]), strides=(1, 1, 1))
    return x_pads, w_pads, unit


def input_blocks(x, geometry):
    """x [N, D, H, W, C] -> xs [N, D', H', W', C'], the input of `space_to_depth`'s convolution (linear
    in x: pad, reshape, transpose)."""
    x_pads, _, unit = _blocks_plan(geometry)
    x = lax.pad(x, jnp.zeros((), x.dtype), [p + (0,) for p in x_pads + [(0, 0)]])
    n, channels = x.shape[0], x.shape[-1]
    blocks = [(e, s) for e, s in zip(unit.in_spatial, geometry.strides)]
    x = x.reshape((n,) + sum(blocks, ()) + (channels,)).transpose(0, 1, 3, 5, 2, 4, 6, 7)
    return pad_channels(x.reshape((n,) + unit.in_spatial + (-1,)), -1)


def filter_blocks(w, geometry):
    """w [T, U, V, C, K] -> (ws [T', U', V', C', K], the unit-stride geometry) of `space_to_depth`."""
    _, w_pads, unit = _blocks_plan(geometry)
    w = jnp.pad(w, w_pads + [(0, 0), (0, 0)])
    channels, filters = w.shape[-2:]
    taps = [(t, s) for t, s in zip(unit.window, geometry.strides)]
    w = w.reshape(sum(taps, ()) + (channels, filters)).transpose(0, 2, 4, 1, 3, 5, 6, 7)
    return pad_channels(w.reshape(unit.window + (-1, filters)), -2), unit


def space_to_depth(x, w, geometry):
    """(x [N, D, H, W, C], w [T, U, V, C, K], geometry) -> the same convolution with every stride 1:
    (xs [N, D', H', W', C'], ws [T', U', V', C', K], its geometry), C' = C * the product of the
    strides, padded to a multiple of 8. On a strided axis (stride s, window k, output extent P) x
    is padded to (P + k' - 1) * s with k' = ceil(k / s), cut into blocks of s, and the block offset
    joins the channels; w gets zero taps up to k' * s, cut the same way."""
    ws, unit = filter_blocks(w, geometry)
    return input_blocks(x, geometry), ws, unit


def patches(x, geometry):
    """x [N, D, H, W, C] -> [N, P, Q, R, Kp]: each output pixel's window, taps in row-major (T U V)
    order with C values each, zero-padded to Kp = taps * C rounded up to a multiple of 8."""
    g = geometry
    # The high padding that makes the padded extent exactly what the windows span (may crop).
    high = tuple((o - 1) * s + (t - 1) * d + 1 - i - lo for o, s, t, d, i, lo in
                 zip(g.out_spatial, g.strides, g.window, g.rhs_dilation, g.in_spatial, g.pads))
    xp = lax.pad(x, jnp.zeros((), x.dtype),
                 ((0, 0, 0),) + tuple((lo, hi, 0) for lo, hi in zip(g.pads, high)) + ((0, 0, 0),))
    columns = []
    for tap in itertools.product(*(range(t) for t in g.window)):
        start = tuple(t * d for t, d in zip(tap, g.rhs_dilation))
        limit = tuple(b + (o - 1) * s + 1 for b, o, s in zip(start, g.out_spatial, g.strides))
        columns.append(lax.slice(xp, (0,) + start + (0,), (x.shape[0],) + limit + (x.shape[-1],),
                                 (1,) + g.strides + (1,)))
    return pad_channels(jnp.concatenate(columns, axis=-1), -1)


def gemm_convolve(x, w, geometry, bias=None, activation=None):
    """act(conv(x, w) + bias): x [N, D, H, W, C], w [T, U, V, C, K], bias None or [K] -> [N, P, Q, R, K]
    in x's dtype (float32 accumulation), differentiable to any order (XLA's gather and transpose
    around dense's). float32 products are exact unless geometry.tf32 allows TF32 (as the other
    convolution kernels)."""
    filters = pad_channels(w.reshape(-1, w.shape[-1]), 0)  # rows as the patches' columns
    precision = "default" if geometry.tf32 else "highest"
    return dense(patches(x, geometry), filters, bias, activation=activation, precision=precision)
