"""Depthwise convolutions (feature_group_count = C: one input channel per group, K = C * m features
for a channel multiplier m) against lax in float64: forward and VJP (lhs and rhs, random cotangent)
through conv_general_dilated, and conv(..., groups=C) with its fused bias, residual and activation.

The cases aim at the GPU's depthwise kernels (ffi/conv/depthwise.cu and depthwise_sm90.cu): the 3x3
window they specialize and the streaming kernels' 5x5 and 7x7 (strides 1 and 2, any padding, H
dilation, several channel packs per block, several column tiles, rings of stages that wrap), their
generic kernels (other windows, W dilation,
multipliers, 1-D and 3-D), the scalar path (odd C), and batches large enough to split wgrad's
reduction over blocks. On the CPU they check the same semantics on the CPU kernels."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxdnn
from helpers import DTYPES, assert_close, check_fused_conv, dtype_id, f64, normal, tolerance

_CHANNELS_LAST = {3: ("NWC", "WIO", "NWC"), 4: ("NHWC", "HWIO", "NHWC"), 5: ("NDHWC", "DHWIO", "NDHWC")}

# (x shape [N, *spatial, C], window, multiplier m, kwargs of conv_general_dilated): w is
# [*window, 1, C * m], channels last.
CASES = [
    # the 3x3 kernel: SAME / VALID, C a multiple of 8 (one and several packs per block), strides
    ((2, 9, 10, 16), (3, 3), 1, dict(window_strides=(1, 1), padding="SAME")),
    ((2, 11, 12, 24), (3, 3), 1, dict(window_strides=(2, 2), padding="SAME")),
    ((1, 7, 9, 136), (3, 3), 1, dict(window_strides=(1, 1), padding="VALID")),
    ((2, 9, 8, 8), (3, 3), 1, dict(window_strides=(2, 2), padding="VALID")),
    # its edges: negative and asymmetric padding, H dilation and stride, rows narrower than the window
    ((1, 9, 11, 8), (3, 3), 1, dict(window_strides=(1, 1), padding=((-1, 2), (2, -1)))),
    ((2, 10, 7, 16), (3, 3), 1, dict(window_strides=(3, 1), padding=((2, 2), (1, 1)), rhs_dilation=(2, 1))),
    ((3, 4, 2, 8), (3, 3), 1, dict(window_strides=(1, 1), padding="SAME")),
    # the generic kernels: W dilation, multipliers, odd C (the scalar path), other windows
    ((1, 9, 10, 8), (3, 3), 1, dict(window_strides=(1, 1), padding="SAME", rhs_dilation=(2, 2))),
    ((2, 8, 7, 8), (3, 3), 2, dict(window_strides=(2, 2), padding="SAME")),
    ((2, 9, 8, 5), (3, 3), 1, dict(window_strides=(1, 1), padding="SAME")),
    ((1, 7, 6, 3), (2, 3), 3, dict(window_strides=(1, 2), padding=((0, 1), (1, 1)))),
    ((2, 12, 11, 16), (5, 5), 1, dict(window_strides=(2, 2), padding="SAME")),
    ((1, 9, 10, 7), (7, 7), 1, dict(window_strides=(1, 1), padding="SAME")),
    # 1-D: a causal window of 4, a strided dilated one; 3-D: a full window, a 1x3x3 one over depth
    ((2, 17, 12), (4,), 1, dict(window_strides=(1,), padding=((3, 0),))),
    ((1, 15, 9), (3,), 2, dict(window_strides=(2,), padding=((1, 1),), rhs_dilation=(2,))),
    ((1, 5, 4, 6, 8), (3, 3, 3), 1, dict(window_strides=(2, 1, 1), padding="SAME")),
    ((2, 5, 6, 7, 8), (1, 3, 3), 1, dict(window_strides=(2, 1, 1), padding=((1, 1), (1, 1), (1, 1)))),
    # the streaming kernels of TMA GPUs (depthwise_sm90.cu): rows wider than a block's columns
    # (several column tiles, stride 1 and 2), and enough units that each block's ring of stages
    # wraps several times (tiny blocks of 4 columns)
    ((2, 6, 100, 64), (3, 3), 1, dict(window_strides=(1, 1), padding=((1, 1), (2, 0)))),
    ((1, 13, 150, 48), (3, 3), 1, dict(window_strides=(2, 2), padding="SAME")),
    ((2, 6400, 4, 8), (3, 3), 1, dict(window_strides=(1, 1), padding="SAME")),
    # their 5 x 5 and 7 x 7 windows (a thread: 2 channels of 3 columns): widths not a multiple of 3,
    # several channel chunks and column tiles, strides 1 and 2, images smaller than the window
    ((2, 9, 31, 24), (7, 7), 1, dict(window_strides=(1, 1), padding="SAME")),
    ((1, 11, 100, 64), (5, 5), 1, dict(window_strides=(1, 1), padding=((1, 3), (2, 2)))),
    ((2, 13, 80, 48), (7, 7), 1, dict(window_strides=(2, 2), padding="SAME")),
    ((2, 15, 14, 136), (5, 5), 1, dict(window_strides=(2, 2), padding="VALID")),
    ((3, 5, 4, 16), (7, 7), 1, dict(window_strides=(1, 1), padding="SAME")),
    ((2, 14, 14, 384), (7, 7), 1, dict(window_strides=(1, 1), padding="SAME")),
    ((8, 20, 20, 32), (5, 5), 1, dict(window_strides=(1, 1), padding="SAME")),
    # units of 7 output rows in the forward (heights 14 and 7: none computed past the image)
    ((3, 14, 14, 256), (3, 3), 1, dict(window_strides=(1, 1), padding="SAME")),
    ((2, 14, 13, 32), (3, 3), 1, dict(window_strides=(2, 2), padding="SAME")),
    # an empty batch (dw is zeros), and batches whose wgrad is split over many blocks
    ((0, 6, 6, 8), (3, 3), 1, dict(window_strides=(1, 1), padding="SAME")),
    ((4, 32, 32, 64), (3, 3), 1, dict(window_strides=(1, 1), padding="SAME")),
    ((2, 24, 40, 24), (3, 3), 1, dict(window_strides=(2, 2), padding="SAME")),
]


def _operands(rng, x_shape, window, multiplier, dtype):
    x = normal(rng, x_shape, dtype)
    w = normal(rng, window + (1, x_shape[-1] * multiplier), dtype, scale=0.5)
    return x, w


def _op(fn, x, kwargs):
    return functools.partial(fn, dimension_numbers=_CHANNELS_LAST[x.ndim], feature_group_count=x.shape[-1],
                             **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("x_shape,window,multiplier,kwargs", CASES, ids=str)
def test_forward_and_grad(dtype, x_shape, window, multiplier, kwargs, rng):
    x, w = _operands(rng, x_shape, window, multiplier, dtype)
    op, oracle = _op(jaxdnn.conv_general_dilated, x, kwargs), _op(lax.conv_general_dilated, x, kwargs)
    y = jax.jit(op)(x, w)
    want_y, pullback = jax.vjp(oracle, f64(x), f64(w))
    assert y.shape == want_y.shape and y.dtype == dtype
    assert_close(y, want_y, tolerance(dtype), "forward")
    cotangent = normal(rng, y.shape, dtype)
    dx, dw = jax.jit(lambda x, w, ct: jax.vjp(op, x, w)[1](ct))(x, w, cotangent)
    want_dx, want_dw = pullback(f64(cotangent))
    assert dx.dtype == dtype and dw.dtype == dtype
    assert_close(dx, want_dx, tolerance(dtype, grad=True), "grad x")
    assert_close(dw, want_dw, tolerance(dtype, grad=True), "grad w")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=str)
def test_non_finite_stays_in_its_channel(dtype, value, rng):
    """An inf or NaN of one channel reaches that channel's outputs only, through the fused
    epilogue too (a kernel that multiplies a pixel's channels together, as a tensor-core product
    by each tap's diagonal would, must not let it reach the others)."""
    x, w = _operands(rng, (2, 9, 40, 32), (3, 3), 1, dtype)
    x = x.at[1, 4, 21, 5].set(value)
    bias = normal(rng, (32,), dtype)
    kwargs = dict(window_strides=(1, 1), padding="SAME")
    op, oracle = _op(jaxdnn.conv_general_dilated, x, kwargs), _op(lax.conv_general_dilated, x, kwargs)
    fused = jax.jit(lambda x, w, b: jaxdnn.conv(x, w, b, groups=32))
    want_y = oracle(f64(x), f64(w))
    for got, want in ((jax.jit(op)(x, w), want_y), (fused(x, w, bias), want_y + f64(bias))):
        assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))
        finite = np.isfinite(np.asarray(want))
        assert finite.sum() < want.size and not finite[1, 3:6, 20:23, 5].any()
        assert_close(np.where(finite, got, 0), np.where(finite, want, 0), tolerance(dtype), "finite outputs")


@pytest.mark.parametrize("window", [3, 7])
def test_wgrad_skips_outputs_past_the_edge(window, rng):
    """x's last columns, read by no output (negative high padding), hold inf: dw stays finite. The
    streaming kernels compute whole blocks of columns (3 a thread for 7 x 7) and must not multiply
    such x by the zero dy that TMA gives for the outputs past the edge."""
    x, w = _operands(rng, (2, 9, 40, 32), (window, window), 1, jnp.bfloat16)
    x = x.at[:, :, -2:, :].set(float("inf"))
    pad = window // 2
    kwargs = dict(window_strides=(1, 1), padding=((pad, pad), (pad, -2)))
    op, oracle = _op(jaxdnn.conv_general_dilated, x, kwargs), _op(lax.conv_general_dilated, x, kwargs)
    cotangent = normal(rng, jax.eval_shape(op, x, w).shape, jnp.bfloat16)
    dw = jax.jit(lambda x, w, ct: jax.vjp(op, x, w)[1](ct)[1])(x, w, cotangent)
    want_dw = jax.vjp(oracle, f64(x), f64(w))[1](f64(cotangent))[1]
    assert np.isfinite(np.asarray(want_dw)).all()
    assert_close(dw, want_dw, tolerance(jnp.bfloat16, grad=True), "grad w")


def test_hlo_holds_the_custom_calls(rng):
    x, w = _operands(rng, (2, 9, 10, 16), (3, 3), 1, jnp.bfloat16)
    op = _op(jaxdnn.conv_general_dilated, x, dict(window_strides=(1, 1), padding="SAME"))
    hlo = jax.jit(jax.grad(lambda x, w: jnp.sum(op(x, w).astype(jnp.float32) ** 2), argnums=(0, 1))).lower(
        x, w).as_text()
    assert all(f"jaxdnn_conv_{stage}_v4" in hlo for stage in ("fprop", "dgrad", "wgrad"))
    assert "convolution" not in hlo


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_second_order(dtype, rng):
    """A gradient penalty: the backward stages differentiated again (their VJPs run the other
    stages, on the GPU the streaming kernels in bf16)."""
    x, w = _operands(rng, (2, 12, 10, 16), (3, 3), 1, dtype)
    kwargs = dict(window_strides=(1, 1), padding="SAME")
    op, oracle = _op(jaxdnn.conv_general_dilated, x, kwargs), _op(lax.conv_general_dilated, x, kwargs)
    ct = normal(rng, x.shape, dtype)

    def penalty(fn, x, w):
        dx, dw = jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w)) * ct.astype(x.dtype)), argnums=(0, 1))(x, w)
        return jnp.sum(dx.astype(jnp.float32) ** 2) + jnp.sum(jnp.cos(dw.astype(jnp.float32)))
    got = jax.jit(jax.grad(functools.partial(penalty, op), argnums=(0, 1)))(x, w)
    want = jax.grad(functools.partial(penalty, oracle), argnums=(0, 1))(f64(x), f64(w))
    assert_close(got[0], want[0], tolerance(dtype, grad=True), "grad of grad x")
    assert_close(got[1], want[1], tolerance(dtype, grad=True), "grad of grad w")


@pytest.mark.parametrize("x_axis,w_axis", [(0, None), (None, 0), (1, 3)], ids=str)
def test_vmap(x_axis, w_axis, rng):
    """vmap stacks the copies as more feature groups: still depthwise, C times the batch."""
    x_shape, w_shape = [2, 7, 6, 8], [3, 3, 1, 8]
    if x_axis is not None:
        x_shape.insert(x_axis, 3)
    if w_axis is not None:
        w_shape.insert(w_axis, 3)
    x, w = normal(rng, x_shape), normal(rng, w_shape)
    kwargs = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=_CHANNELS_LAST[4],
                  feature_group_count=8)
    op = functools.partial(jaxdnn.conv_general_dilated, **kwargs)
    oracle = functools.partial(lax.conv_general_dilated, **kwargs)

    def grads(fn, x, w):
        return jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w))), argnums=(0, 1)),
                        in_axes=(x_axis, w_axis))(x, w)
    got = jax.jit(functools.partial(grads, op))(x, w)
    want = grads(oracle, f64(x), f64(w))
    assert_close(got[0], want[0], 1e-5, "vmap(grad) x")
    assert_close(got[1], want[1], 1e-5, "vmap(grad) w")


# (x shape, window, multiplier, kwargs of conv); groups = C, bias and residual added by the test.
FUSED_CASES = [
    ((2, 9, 10, 16), (3, 3), 1, dict(padding="SAME")),
    ((2, 11, 12, 8), (3, 3), 1, dict(strides=2, padding="SAME")),
    ((2, 8, 7, 5), (3, 3), 2, dict(padding="VALID", dilation=(1, 2))),
    ((2, 16, 8), (5,), 1, dict(padding="SAME")),
]
FUSED_EPILOGUES = [(jnp.float32, "gelu"), (jnp.float32, "leaky_relu"), (jnp.bfloat16, "relu"),
                   (jnp.float16, "silu")]


@pytest.mark.parametrize("dtype,activation", FUSED_EPILOGUES, ids=str)
@pytest.mark.parametrize("x_shape,window,multiplier,kwargs", FUSED_CASES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["bias", "bias+residual"])
def test_conv_fused(dtype, activation, x_shape, window, multiplier, kwargs, with_residual, rng):
    x, w = _operands(rng, x_shape, window, multiplier, dtype)
    op, args = check_fused_conv(x, w, dict(kwargs, groups=x_shape[-1]), activation, with_residual, rng)
    assert "jaxdnn_conv_fprop_fused_v4" in op.lower(*args).as_text()
