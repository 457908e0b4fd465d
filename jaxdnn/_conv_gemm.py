"""Few-channel convolutions (an RGB stem: 2 to 7 input channels) as an explicit GEMM: XLA gathers
each output pixel's window into a row of a patches matrix (im2col), and dense's tensor-core GEMM
multiplies it by the filter, the bias and activation in its epilogue.

Why not the implicit-GEMM kernels: with C < 8 they need the channels zero-padded to 8 (TMA's 16-byte
rows), their im2col loads then move 16 bytes per pixel and tap, and the backward's strided dgrad
runs stride^2 times the work on a zero-inserted dy. Here the patches row is dense (taps * C values,
padded once to a multiple of 8), so the product runs at the GEMM's speed, its gradients are two
more GEMMs (the weight gradient split over the rows, see dense.py), and XLA's transpose of the
gather (a sum of strided pads) scatters the patches' gradient back to x. The cost is the patches
matrix in memory: taps / stride^2 times x (12x for ResNet's 7x7/2 stem), kept for the backward.
"""

from __future__ import annotations

import itertools
import math

import jax.numpy as jnp
from jax import lax

from jaxdnn.dense import dense


def takes(x_shape, w_shape, geometry) -> bool:
    """Whether the convolution `geometry` (a jaxdnn._conv_kernels.Conv) of x [N, D, H, W, C] with
    w [T, U, V, C, K] runs here: one group, no lhs dilation, 2 <= C < 8 (C = 1 is a depthwise
    kernel's), a window of more than one tap, nothing empty."""
    channels = x_shape[-1]
    return (geometry.groups == 1 and geometry.lhs_dilation == (1, 1, 1) and 2 <= channels < 8
            and math.prod(geometry.window) > 1 and math.prod(x_shape) > 0 and math.prod(w_shape) > 0
            and math.prod(geometry.out_spatial) > 0)


def _patches(x, geometry):
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
    width = len(columns) * x.shape[-1]
    if width % 8:
        columns.append(jnp.zeros(columns[0].shape[:-1] + (8 - width % 8,), x.dtype))
    return jnp.concatenate(columns, axis=-1)


def convolve(x, w, geometry, bias=None, activation=None):
    """act(conv(x, w) + bias): x [N, D, H, W, C], w [T, U, V, C, K], bias None or [K] -> [N, P, Q, R, K]
    in x's dtype (float32 accumulation), differentiable to any order (XLA's gather and transpose
    around dense's)."""
    patches = _patches(x, geometry)
    filters = w.reshape(-1, w.shape[-1])
    filters = jnp.pad(filters, ((0, patches.shape[-1] - filters.shape[0]), (0, 0)))
    return dense(patches, filters, bias, activation=activation)
