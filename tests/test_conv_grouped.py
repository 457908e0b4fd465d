"""Grouped convolutions that ffi/conv/grouped.cu's tensor-core kernels take as they are (16-bit, 16 or
32 channels and as many filters a group, unit strides): forward and VJP against lax in float64,
the fused epilogue, a second-order gradient, values no window reads, and which problems go there.
They bind stages of G groups on every platform (no blocks of one group): on a GPU the grouped
kernels run them, on the CPU its convolution kernel."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxdnn
from jaxdnn import _conv_kernels as conv_kernels
from helpers import GRAD_FACTOR, assert_close, check_fused_conv, dtype_id, f64, normal, tolerance

NHWC = ("NHWC", "HWIO", "NHWC")
_CHANNELS_LAST = {3: ("NWC", "WIO", "NWC"), 4: NHWC, 5: ("NDHWC", "DHWIO", "NDHWC")}

# (lhs shape, rhs shape, kwargs), channels last. Group widths 16 and 32; feature tiles of 64 whole,
# partial (K 48, 96) and several; images in one pixel tile and in several (rows, and columns
# past 64), with short last tiles, and more tiles than blocks; tiles of several whole images (7 x 7:
# two a tile, the last tile one); wgrad slices; 3x3, 5x5 (25 taps: three
# wgrad tap blocks), 5x3 with dilation and uneven padding, dilation 4 (a halo that shrinks the
# tile), negative padding, 1x1; 1-D, and 3-D with a depth window of 1 (folded into the batch).
CASES = [
    ((2, 9, 10, 64), (3, 3, 16, 64), dict(padding="SAME", feature_group_count=4)),
    ((2, 7, 6, 256), (3, 3, 32, 256), dict(padding="SAME", feature_group_count=8)),
    ((1, 11, 5, 96), (3, 3, 32, 96), dict(padding="VALID", feature_group_count=3)),
    ((2, 8, 9, 48), (5, 3, 16, 48), dict(padding=((2, 0), (1, 3)), rhs_dilation=(1, 2),
                                         feature_group_count=3)),
    ((2, 6, 6, 32), (3, 3, 16, 32), dict(padding=((-1, 1), (0, 0)), feature_group_count=2)),
    ((2, 7, 8, 32), (5, 5, 16, 32), dict(padding="SAME", feature_group_count=2)),
    ((2, 5, 5, 64), (1, 1, 16, 64), dict(padding="VALID", feature_group_count=4)),
    ((2, 20, 20, 64), (3, 3, 16, 64), dict(padding="SAME", feature_group_count=4)),
    ((5, 7, 7, 64), (3, 3, 16, 64), dict(padding="SAME", feature_group_count=4)),
    ((3, 13, 64), (3, 32, 64), dict(padding="SAME", feature_group_count=2)),
    ((1, 3, 5, 6, 64), (1, 3, 3, 32, 64), dict(padding="SAME", feature_group_count=2)),
    ((1, 12, 70, 32), (3, 3, 16, 32), dict(padding="SAME", feature_group_count=2)),
    ((2, 10, 20, 32), (3, 3, 16, 32), dict(padding="SAME", rhs_dilation=(4, 4), feature_group_count=2)),
]
case_param = pytest.mark.parametrize("lhs_shape,rhs_shape,kwargs", CASES, ids=str)
SIXTEEN_BIT = pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=dtype_id)


def _kwargs(lhs_shape, kwargs):
    spatial = len(lhs_shape) - 2
    return dict(kwargs, window_strides=(1,) * spatial, dimension_numbers=_CHANNELS_LAST[len(lhs_shape)])


def _op(fn, kwargs):
    return lambda lhs, rhs: fn(lhs, rhs, **kwargs)


def _bound_groups(fn, *args):
    """The `groups` attribute of every convolution target fn(*args) binds."""
    hlo = jax.jit(fn).lower(*args).as_text()
    calls = re.findall(r"@jaxdnn_conv_\w+\(.*", hlo)
    assert calls
    return {int(g) for g in re.findall(r"groups = (\d+) :", "\n".join(calls))}


@SIXTEEN_BIT
@case_param
def test_forward_and_grad(dtype, lhs_shape, rhs_shape, kwargs, rng):
    """The forward and its VJP (lhs, rhs; random cotangent) against lax in float64; every stage binds
    the convolution's own groups."""
    kwargs = _kwargs(lhs_shape, kwargs)
    op, oracle = _op(jaxdnn.conv_general_dilated, kwargs), _op(lax.conv_general_dilated, kwargs)
    lhs, rhs = normal(rng, lhs_shape, dtype), normal(rng, rhs_shape, dtype, scale=0.5)
    tol = tolerance(dtype)
    y = jax.jit(op)(lhs, rhs)
    want_y, pullback = jax.vjp(oracle, f64(lhs), f64(rhs))
    assert y.shape == want_y.shape and y.dtype == dtype
    assert_close(y, want_y, tol, "forward")
    ct = normal(rng, y.shape, dtype)
    fwd_bwd = lambda lhs, rhs, ct: (op(lhs, rhs), jax.vjp(op, lhs, rhs)[1](ct))
    _, (dlhs, drhs) = jax.jit(fwd_bwd)(lhs, rhs, ct)
    want_dlhs, want_drhs = pullback(f64(ct))
    assert dlhs.dtype == dtype and drhs.dtype == dtype
    assert_close(dlhs, want_dlhs, GRAD_FACTOR * tol, "grad lhs")
    assert_close(drhs, want_drhs, GRAD_FACTOR * tol, "grad rhs")
    assert _bound_groups(fwd_bwd, lhs, rhs, ct) == {kwargs["feature_group_count"]}


@pytest.mark.parametrize("activation,with_residual", [("relu", False), ("gelu", True)], ids=str)
def test_fused(activation, with_residual, rng):
    """jaxdnn.conv with groups: bias, residual and activation in the grouped forward's epilogue."""
    x, w = normal(rng, (2, 9, 7, 128), jnp.bfloat16), normal(rng, (3, 3, 32, 128), jnp.bfloat16, scale=0.5)
    fn, args = check_fused_conv(x, w, dict(padding="SAME", groups=4), activation, with_residual, rng)
    assert _bound_groups(fn, *args) == {4}


def test_second_order(rng):
    """A gradient penalty (grad of grad) through the grouped stages against lax."""
    kwargs = _kwargs((2, 6, 7, 64), dict(padding="SAME", feature_group_count=2))
    op, oracle = _op(jaxdnn.conv_general_dilated, kwargs), _op(lax.conv_general_dilated, kwargs)
    lhs, rhs = normal(rng, (2, 6, 7, 64), jnp.bfloat16), normal(rng, (3, 3, 32, 64), jnp.bfloat16, scale=0.5)

    def penalty(fn, lhs, rhs):
        dlhs, drhs = jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w))), argnums=(0, 1))(lhs, rhs)
        return jnp.sum(dlhs.astype(jnp.float32) ** 2) + jnp.sum(jnp.cos(drhs.astype(jnp.float32)))
    got = jax.jit(jax.grad(functools.partial(penalty, op), argnums=(0, 1)))(lhs, rhs)
    want = jax.grad(functools.partial(penalty, oracle), argnums=(0, 1))(f64(lhs), f64(rhs))
    tol = tolerance(jnp.bfloat16, grad=True)
    assert_close(got[0], want[0], tol, "grad of grad lhs")
    assert_close(got[1], want[1], tol, "grad of grad rhs")


def test_values_no_window_reads(rng):
    """x's last column, cropped by a negative high padding, holds inf: no output reads it, so y, dx
    and dw are finite and as lax's (a kernel that multiplied it, even by zero, would put NaN in dw)."""
    kwargs = _kwargs((2, 6, 9, 32), dict(padding=((1, 1), (1, -1)), feature_group_count=2))
    op, oracle = _op(jaxdnn.conv_general_dilated, kwargs), _op(lax.conv_general_dilated, kwargs)
    lhs = normal(rng, (2, 6, 9, 32), jnp.bfloat16).at[:, :, -1].set(jnp.inf)
    rhs = normal(rng, (3, 3, 16, 32), jnp.bfloat16, scale=0.5)
    y, pullback = jax.vjp(jax.jit(op), lhs, rhs)
    ct = normal(rng, y.shape, jnp.bfloat16)
    dlhs, drhs = pullback(ct)
    want_y, want_pullback = jax.vjp(oracle, f64(lhs), f64(rhs))
    want_dlhs, want_drhs = want_pullback(f64(ct))
    assert bool(jnp.all(jnp.isfinite(y))) and bool(jnp.all(jnp.isfinite(drhs)))
    tol = tolerance(jnp.bfloat16)
    assert_close(y, want_y, tol, "forward")
    assert_close(dlhs, want_dlhs, GRAD_FACTOR * tol, "grad lhs")
    assert_close(drhs, want_drhs, GRAD_FACTOR * tol, "grad rhs")


def _conv(groups, window=(1, 3, 3), strides=(1, 1, 1), pads=(0, 1, 1), lhs_dilation=(1, 1, 1),
          rhs_dilation=(1, 1, 1)):
    return conv_kernels.Conv(in_spatial=(1, 8, 8), out_spatial=(1, 8, 8), window=window, strides=strides,
                             pads=pads, lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation, groups=groups)


@pytest.mark.parametrize("dtype,conv,channels,filters,path", [
    (jnp.bfloat16, _conv(4), 64, 64, "kernel"),
    (jnp.float16, _conv(2), 64, 64, "kernel"),
    (jnp.bfloat16, _conv(32), 1024, 1024, "kernel"),
    (jnp.float32, _conv(4), 64, 64, "lax-like"),              # float32 at exact precision
    (jnp.bfloat16, _conv(32), 256, 256, "blocks"),            # 8 channels a group
    (jnp.bfloat16, _conv(2), 128, 128, "blocks"),             # 64 channels a group
    (jnp.bfloat16, _conv(4), 64, 128, "blocks"),              # 32 filters a group for 16 channels
    (jnp.bfloat16, _conv(4, strides=(1, 2, 2)), 64, 64, "blocks"),
    (jnp.bfloat16, _conv(4, window=(3, 3, 3), pads=(1, 1, 1)), 64, 64, "blocks"),
    (jnp.bfloat16, _conv(4, window=(1, 3, 5), rhs_dilation=(1, 4, 2)), 64, 64, "kernel"),  # reach 8
    (jnp.bfloat16, _conv(4, window=(1, 3, 3), rhs_dilation=(1, 5, 1)), 64, 64, "blocks"),  # reach 10
    (jnp.bfloat16, _conv(2, window=(1, 5, 5), pads=(0, 2, 2)), 64, 64, "blocks"),  # 25 taps x 32 channels
    (jnp.bfloat16, _conv(4, lhs_dilation=(1, 2, 1)), 64, 64, "lax-like"),
    (jnp.bfloat16, _conv(64), 64, 64, "lax-like"),            # depthwise: its own kernels
], ids=str)
def test_grouped_kernel_takes(dtype, conv, channels, filters, path):
    """The problems sent to grouped.cu (a copy of its GroupedApplies) rather than to the blocks of one
    group; "lax-like": neither, the stage's own target with its groups."""
    w_shape = conv.window + (channels // conv.groups, filters)
    rewrite = conv_kernels._rewrite(dtype, conv, (2,) + conv.in_spatial + (channels,), w_shape)
    assert conv_kernels._grouped_kernel_takes(dtype, conv, 2, channels, filters) == (path == "kernel")
    assert type(rewrite).__name__ == {"blocks": "GroupBlocks"}.get(path, "NoneType")


@pytest.mark.parametrize("width,filters,taps,pixels,slices", [
    (16, 512, 9, 128 * 196, 33), (32, 1024, 9, 128 * 49, 8), (32, 256, 16, 10 ** 6, 16),
    (16, 64, 25, 800, 13), (16, 64, 9, 20, 1), (16, 128, 9, 10 ** 7, 132), (16, 64, 1, 10 ** 7, 256)],
    ids=str)
def test_grouped_wgrad_slices(width, filters, taps, pixels, slices):
    """At most one wave of wgrad blocks (132 SMs, two blocks each; a block 64 features and up to 160 / W
    taps), at least 64 pixels a slice, at most 256 slices: the workspace the target gets holds them."""
    assert conv_kernels._grouped_wgrad_slices(width, filters, taps, pixels) == slices
