"""conv_general_dilated against lax.conv_general_dilated in float64: forward and VJP (lhs and rhs,
random cotangent) for 1-D/2-D/3-D, several dimension_numbers, strides, both dilations, every padding
kind (negative too), groups, depthwise, batch groups, transposed convolution and an empty batch;
transforms, second order, sharding, export, errors, and the custom calls in the HLO."""

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export, lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdnn
from jaxdnn import _conv_kernels as conv_kernels, _conv_regroup as regroup
from jaxdnn.conv import _prepare
from helpers import (DTYPES, GRAD_FACTOR, ISA_ORDER, assert_close, batch_mesh, check_fused_conv, dtype_id,
                     f64, isa_child_report, normal, on_gpu, rel_err, tolerance)

TARGETS = ("jaxdnn_conv_fprop_v4", "jaxdnn_conv_dgrad_v4", "jaxdnn_conv_wgrad_v4")

# (lhs shape, rhs shape, kwargs of conv_general_dilated). Odd sizes, channel counts with and without
# a multiple of 8, size-1 axes; the rhs shape is in the layout dimension_numbers names.
NHWC = ("NHWC", "HWIO", "NHWC")
NWC = ("NWC", "WIO", "NWC")
CASES = [
    ((2, 3, 9, 8), (5, 3, 3, 3), dict(window_strides=(1, 1), padding="SAME")),
    ((2, 9, 8, 6), (3, 3, 6, 16), dict(window_strides=(2, 1), padding="VALID", dimension_numbers=NHWC)),
    ((3, 7, 10, 5), (3, 2, 5, 4), dict(window_strides=(1, 2), padding=((1, 2), (0, 1)),
                                      dimension_numbers=NHWC, rhs_dilation=(2, 3))),
    ((2, 9, 8, 6), (3, 2, 3, 4), dict(window_strides=(2, 1), padding=((1, -1), (2, 0)), lhs_dilation=(2, 1),
                                      rhs_dilation=(1, 2), dimension_numbers=NHWC, feature_group_count=2)),
    ((2, 8, 7, 12), (3, 3, 1, 12), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC,
                                       feature_group_count=12)),  # depthwise
    ((2, 8, 7, 6), (3, 3, 1, 12), dict(window_strides=(2, 2), padding="SAME_LOWER", dimension_numbers=NHWC,
                                      feature_group_count=6)),  # depthwise, channel multiplier 2
    ((2, 5, 6, 4), (4, 4, 4, 3), dict(window_strides=(1, 1), padding=((2, 2), (2, 2)), lhs_dilation=(2, 2),
                                     dimension_numbers=NHWC)),  # transposed convolution, stride 2
    ((4, 7, 6), (3, 6, 4), dict(window_strides=(1,), padding="SAME", dimension_numbers=("NWC", "WIO", "NWC"),
                                batch_group_count=2)),
    ((3, 5, 13), (7, 5, 3), dict(window_strides=(3,), padding="VALID")),  # 1-D, NCW / OIW
    ((2, 11, 4), (4, 4, 3), dict(window_strides=(2,), padding=((2, 1),),
                                 dimension_numbers=("NWC", "WIO", "NWC"), rhs_dilation=(2,))),
    ((2, 3, 5, 6, 7), (4, 3, 2, 2, 3), dict(window_strides=(1, 2, 1), padding="SAME",
                                           rhs_dilation=(2, 1, 1))),
    ((1, 5, 4, 6, 6), (3, 2, 3, 3, 8), dict(window_strides=(2, 1, 2), padding=((1, 0), (1, 1), (0, 2)),
                                           dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
                                           feature_group_count=2)),
    ((6, 3, 2, 7), (3, 3, 2, 5), dict(window_strides=(1, 1), padding="VALID",
                                      dimension_numbers=("HNCW", "HWIO", "NWHC"))),  # mixed layouts
    ((2, 7, 7, 5), (8, 5, 1, 1), dict(window_strides=(2, 2), padding="VALID",
                                      dimension_numbers=("NHWC", "OIHW", "NCHW"))),  # 1x1, stride 2
    ((0, 6, 6, 4), (3, 3, 4, 5), dict(window_strides=(1, 1), padding="SAME",
                                      dimension_numbers=NHWC)),  # empty batch
    # Rows of 128 pixels or more, which the CPU kernels take in segments: strided, in groups; a
    # last segment shorter than the others.
    ((2, 300, 8), (5, 4, 6), dict(window_strides=(2,), padding="SAME",
                                  dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=2)),
    ((1, 2, 133, 6), (3, 3, 6, 4), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
]
case_param = pytest.mark.parametrize("lhs_shape,rhs_shape,kwargs", CASES, ids=str)
dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)


def _op(fn, kwargs):
    return lambda lhs, rhs: fn(lhs, rhs, **kwargs)


def _oracle(kwargs, lhs, rhs, cotangent=None):
    """lax's output on the operands in float64, and its VJP (lhs, rhs) for `cotangent`."""
    y, pullback = jax.vjp(_op(lax.conv_general_dilated, kwargs), f64(lhs), f64(rhs))
    return y, None if cotangent is None else pullback(f64(cotangent))


def _vjp(fn, lhs, rhs, cotangent):
    return jax.jit(lambda lhs, rhs, ct: jax.vjp(fn, lhs, rhs)[1](ct))(lhs, rhs, cotangent)


def _check_against(op, oracle, lhs, rhs, tol, rng):
    """op(lhs, rhs) against `oracle` run in float64: the output (its shape and dtype too) within tol,
    its VJP for a random cotangent within GRAD_FACTOR x tol. Returns the cotangent."""
    y = jax.jit(op)(lhs, rhs)
    want_y, pullback = jax.vjp(oracle, f64(lhs), f64(rhs))
    assert y.shape == want_y.shape and y.dtype == lhs.dtype
    assert_close(y, want_y, tol, "forward")
    cotangent = normal(rng, y.shape, lhs.dtype)
    dlhs, drhs = _vjp(op, lhs, rhs, cotangent)
    want_dlhs, want_drhs = pullback(f64(cotangent))
    assert dlhs.dtype == lhs.dtype and drhs.dtype == rhs.dtype
    assert_close(dlhs, want_dlhs, GRAD_FACTOR * tol, "grad lhs")
    assert_close(drhs, want_drhs, GRAD_FACTOR * tol, "grad rhs")
    return cotangent


@dtype_param
@case_param
def test_forward_and_grad(dtype, lhs_shape, rhs_shape, kwargs, rng):
    lhs, rhs = normal(rng, lhs_shape, dtype), normal(rng, rhs_shape, dtype, scale=0.5)
    _check_against(_op(jaxdnn.conv_general_dilated, kwargs), _op(lax.conv_general_dilated, kwargs), lhs, rhs,
                   tolerance(dtype), rng)


# Problems the GPU's tensor-core kernels take (16-bit, one group, K a multiple of 8):
# 2-D windows, 1-D and 3-D ones with a trivial depth folded into 2-D, strides (dgrad then runs on
# the space-to-depth form, or on zero-inserted dy for windows narrower than their strides),
# dilations, explicit padding, the tall (K <= 64) and wide tiles, 7x7/2 stems.
# On the CPU they check the same semantics on the CPU kernels.
TENSOR_CORE_CASES = [
    ((2, 9, 10, 16), (3, 3, 16, 24), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
    ((2, 12, 11, 8), (3, 3, 8, 80), dict(window_strides=(2, 2), padding="SAME", dimension_numbers=NHWC)),
    ((1, 10, 9, 32), (5, 3, 32, 16), dict(window_strides=(1, 1), padding="VALID", rhs_dilation=(2, 1),
                                         dimension_numbers=NHWC)),
    ((2, 8, 8, 72), (3, 3, 72, 136), dict(window_strides=(1, 1), padding=((2, 0), (1, 1)),
                                          dimension_numbers=NHWC)),
    ((2, 20, 16), (3, 16, 8), dict(window_strides=(2,), padding="SAME",
                                   dimension_numbers=("NWC", "WIO", "NWC"))),
    ((2, 3, 6, 7, 8), (1, 3, 3, 8, 16), dict(window_strides=(1, 1, 1), padding="SAME",
                                            dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))),
    ((2, 20, 20, 8), (7, 7, 8, 16), dict(window_strides=(2, 2), padding="SAME", dimension_numbers=NHWC)),
    ((2, 13, 9, 24), (5, 3, 24, 16), dict(window_strides=(3, 2), padding=((2, 1), (0, 2)),
                                          dimension_numbers=NHWC)),
    ((3, 8, 8, 16), (2, 2, 16, 8), dict(window_strides=(2, 2), padding="VALID", dimension_numbers=NHWC)),
    ((2, 9, 10, 16), (1, 1, 16, 24), dict(window_strides=(2, 2), padding="VALID", dimension_numbers=NHWC)),
    # channels padded to a multiple of 8: an RGB stem, and C = 12
    ((2, 20, 20, 3), (7, 7, 3, 16), dict(window_strides=(2, 2), padding="SAME", dimension_numbers=NHWC)),
    ((3, 7, 9, 12), (3, 3, 12, 8), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
    # a batch of 45 and one output tile: wgrad in 16 slices of 2 or 3 images
    ((45, 6, 5, 8), (3, 3, 8, 16), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
    # 64 -> 64 3x3 SAME: the halo kernels (CTAs taking ranges of the image rows): fewer rows than
    # CTAs, ranges crossing images (150 rows of 17 pixels: a partial 16-pixel step), and rows of 64
    # pixels (one whole strip) in images of 3 rows
    ((3, 9, 11, 64), (3, 3, 64, 64), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
    ((5, 30, 17, 64), (3, 3, 64, 64), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
    ((1, 3, 64, 64), (3, 3, 64, 64), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
    # ... rows wider than 64 pixels in strips of 64 (the last of 2), units ordered by strip then row;
    # 1x3 windows (one tap row): a 1-D convolution over 300 samples (5 strips, the last of 44), and
    # a 2-D one over rows of 70 pixels
    ((2, 5, 130, 64), (3, 3, 64, 64), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
    ((3, 300, 64), (3, 64, 64), dict(window_strides=(1,), padding="SAME", dimension_numbers=NWC)),
    ((2, 4, 70, 64), (1, 3, 64, 64), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
    # ... their wgrad with 128 channels on one side (a CTA a 64-channel half): 3x3 64 -> 128, 1-D 128 -> 64
    ((2, 6, 70, 64), (3, 3, 64, 128), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
    ((3, 200, 128), (3, 128, 64), dict(window_strides=(1,), padding="SAME", dimension_numbers=NWC)),
    # ... rows of 5 and 7 taps (the stages from 2 and 3 pixels before the strip; the wgrad's warpgroups
    # owning 2 and 3 taps, a 5-tap window's sixth dropped): 1-D over 300 samples, 1x7 over rows of 70,
    # and a 1-D 5-tap wgrad of 128 -> 64
    ((3, 300, 64), (5, 64, 64), dict(window_strides=(1,), padding="SAME", dimension_numbers=NWC)),
    ((2, 4, 70, 64), (1, 7, 64, 64), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
    ((3, 200, 128), (5, 128, 64), dict(window_strides=(1,), padding="SAME", dimension_numbers=NWC)),
    # 1x1 with 64 channels on one side: the pointwise halo wgrad (CTAs taking ranges of 64-pixel
    # chunks, the last one partial): fewer chunks than CTAs, x or dy the narrow side, 128 or 256
    # wide, and about 5 chunks a CTA (the stage ring wraps)
    ((3, 7, 9, 64), (1, 1, 64, 256), dict(window_strides=(1, 1), padding="VALID", dimension_numbers=NHWC)),
    ((2, 5, 13, 256), (1, 1, 256, 64), dict(window_strides=(1, 1), padding="VALID", dimension_numbers=NHWC)),
    ((32, 36, 40, 64), (1, 1, 64, 128), dict(window_strides=(1, 1), padding="VALID", dimension_numbers=NHWC)),
    # the im2col kernels (a multiple of 64 input and 128 output channels): boxes of 128 positions
    # crossing rows and images, a partial last tile; strides (fprop); a dilated, unevenly padded
    # window over three 64-channel chunks
    ((3, 9, 11, 128), (3, 3, 128, 128), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
    ((4, 28, 28, 128), (3, 3, 128, 128), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
    ((2, 13, 12, 64), (3, 3, 64, 256), dict(window_strides=(2, 2), padding="SAME", dimension_numbers=NHWC)),
    ((2, 10, 9, 192), (3, 3, 192, 128), dict(window_strides=(1, 1), padding=((2, 2), (1, 3)),
                                             rhs_dilation=(2, 2), dimension_numbers=NHWC)),
    ((2, 11, 10, 128), (3, 2, 128, 128), dict(window_strides=(1, 1), padding=((0, 1), (1, 0)),
                                              rhs_dilation=(1, 3), dimension_numbers=NHWC)),
    # empty reductions: no input channels (y is zeros), no output channels (dx is zeros)
    ((2, 7, 6, 0), (3, 3, 0, 128), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
    ((2, 7, 6, 64), (3, 3, 64, 0), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=dtype_id)
@pytest.mark.parametrize("lhs_shape,rhs_shape,kwargs", TENSOR_CORE_CASES, ids=str)
def test_tensor_core_shapes(dtype, lhs_shape, rhs_shape, kwargs, rng):
    test_forward_and_grad(dtype, lhs_shape, rhs_shape, kwargs, rng)


@pytest.mark.parametrize("lhs_shape,rhs_shape", [((4, 88, 96, 64), (3, 3, 64, 256)),
                                                 ((8, 88, 96, 128), (3, 3, 128, 64)),
                                                 ((4, 112, 76, 64), (3, 3, 64, 128))], ids=str)
def test_im2col_more_tiles_than_ctas(lhs_shape, rhs_shape, rng):
    """The persistent im2col kernels with several tiles a CTA on a 132-SM GPU, one case for each of
    the heuristic's tiles: the forward of 64 -> 256 on 264 tiles of 128 x 256, the dgrad of 128 -> 64
    on 264 of 256 x 128 (two whole rounds each, which the smaller tiles do not beat), the forward of
    64 -> 128 on 266 of 128 x 128 (133 of 256 x 128 would leave a round almost empty); the tile of
    256 x 64 takes the forward of 128 -> 64 (264 tiles) and the dgrad of 64 -> 128 (133). The stage
    ring runs across tiles, and each result tile is refilled once its store has read it."""
    kwargs = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)
    test_forward_and_grad(jnp.bfloat16, lhs_shape, rhs_shape, kwargs, rng)


@pytest.mark.parametrize("window,strides,dgrad_strides", [((3, 3), (2, 2), (1, 1)), ((2, 3), (2, 3), (1, 1)),
                                                         ((1, 1), (2, 2), (2, 2))])
def test_strided_dgrad_runs_on_space_to_depth(window, strides, dgrad_strides, rng, blocks_on_cpu):
    """A 16-bit strided dgrad whose window spans its stride binds the unit-stride dgrad of the
    space-to-depth form on a GPU (a window narrower than its stride keeps the strided one)."""
    x = normal(rng, (2, 12, 12, 16), jnp.bfloat16)
    w = normal(rng, window + (16, 8), jnp.bfloat16)
    kwargs = dict(window_strides=strides, padding="SAME", dimension_numbers=NHWC)
    op = _op(jaxdnn.conv_general_dilated, kwargs)
    dy = normal(rng, jax.eval_shape(op, x, w).shape, jnp.bfloat16)
    hlo = jax.jit(lambda x, dy: jax.vjp(lambda x: op(x, w), x)[1](dy)).lower(x, dy).as_text()
    dgrad = hlo[hlo.index("jaxdnn_conv_dgrad_v4"):].splitlines()[0]
    assert re.search(rf"stride_h = {dgrad_strides[0]} .*stride_w = {dgrad_strides[1]} ", dgrad)
    # ... and gives lax's dx (the CPU's own strided dgrad runs the other cases' tests)
    want_dx = _oracle(kwargs, x, w, dy)[1][0]
    assert_close(_vjp(op, x, w, dy)[0], want_dx, GRAD_FACTOR * tolerance(jnp.bfloat16))


# float32 with TF32 allowed (precision DEFAULT): on a GPU the forward multiplies on the tensor cores
# as TF32, and the backward runs as other products: dgrad as a forward of dy with the flipped filter
# (the CPU's products are exact, so there the float32 tolerance checks these rewrites; on a GPU TF32's
# 10-bit mantissas (float16's) get float16's tolerance); wgrad, on a GPU only, of a window of several
# taps on at least 32 channels ("parts") as 16-bit wgrads of x's and dy's bfloat16 parts with float32
# results, of others ("gemm") as dense's GEMM of im2col patches (test_tf32_wgrad_rewrites checks
# both on any platform); "dense": the few-channel layer runs as `dense`, its explicit-GEMM form.
# `dgrad_stage`: whether the dgrad target remains (the cases no rewrite serves; the GPU's forms, as
# the strided dgrad's space-to-depth, run on the CPU too here: `blocks_on_cpu`).
SAME, VALID = dict(padding="SAME"), dict(padding="VALID")
TF32_CASES = [
    ((2, 9, 10, 32), (3, 3, 32, 24), dict(SAME, window_strides=(1, 1)), False, "parts"),
    ((1, 10, 9, 32), (5, 3, 32, 16), dict(VALID, window_strides=(1, 1), rhs_dilation=(2, 1)), False, "parts"),
    ((2, 8, 8, 32), (3, 3, 32, 16), dict(window_strides=(1, 1), padding=((2, -1), (0, 3))), False, "parts"),
    ((2, 12, 11, 32), (3, 3, 32, 24), dict(SAME, window_strides=(2, 2)), False, "parts"),  # space-to-depth
    ((2, 9, 10, 16), (1, 1, 16, 24), dict(VALID, window_strides=(2, 3)), False, "gemm"),  # the subgrid
    ((2, 9, 10, 16), (1, 1, 16, 24), dict(VALID, window_strides=(1, 1)), False, "gemm"),  # pointwise
    ((3, 8, 8, 16), (2, 2, 16, 8), dict(SAME, window_strides=(3, 3)), True, "gemm"),  # window < stride
    ((2, 11, 10, 5), (3, 3, 5, 8), dict(SAME, window_strides=(1, 1)), False, "dense"),  # few channels
    ((2, 20, 32), (3, 32, 8), dict(SAME, window_strides=(2,)), False, "parts"),  # 1-D, strided
    ((2, 3, 6, 7, 16), (3, 3, 3, 16, 16), dict(SAME, window_strides=(1, 1, 1)), False, "parts"),  # 3-D
]
_CHANNELS_LAST = {3: ("NWC", "WIO", "NWC"), 4: NHWC, 5: ("NDHWC", "DHWIO", "NDHWC")}


_MLIR_TYPES = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.bfloat16): "bf16"}


def _wgrad_calls(hlo):
    """The wgrad target's calls in lowered StableHLO: (x's, dy's, dw's element type) of each."""
    tensor = r"tensor<(?:\d+x)*([a-z]\w*)>"
    return re.findall(rf"@jaxdnn_conv_wgrad_v4\(.*: \({tensor}, {tensor}\) -> \({tensor}", hlo)


def _assert_tf32_wgrad(hlo, rewrite="parts"):
    """A float32 wgrad at TF32: on a GPU 16-bit wgrad calls of bfloat16 parts with float32 results
    ("parts"; three a convolution of one group and 64 filters or more, two below) or dense's GEMM
    ("gemm"); on the CPU the exact float32 stage; "dense": none (the explicit-GEMM form's own VJP)."""
    calls = _wgrad_calls(hlo)
    if rewrite == "dense":
        assert not calls and "jaxdnn_gemm_v3" in hlo, calls
    elif not on_gpu():
        assert calls and all(call == ("f32", "f32", "f32") for call in calls), calls
    elif rewrite == "parts":
        assert calls and all(call == ("bf16", "bf16", "f32") for call in calls), calls
    else:
        assert not calls and "jaxdnn_gemm_v3" in hlo, calls


@pytest.mark.parametrize("lhs_shape,rhs_shape,kwargs,dgrad_stage,wgrad", TF32_CASES, ids=str)
def test_tf32_forward_and_grad(lhs_shape, rhs_shape, kwargs, dgrad_stage, wgrad, rng, blocks_on_cpu):
    kwargs = dict(kwargs, dimension_numbers=_CHANNELS_LAST[len(lhs_shape)], precision=lax.Precision.DEFAULT)
    op = _op(jaxdnn.conv_general_dilated, kwargs)
    lhs, rhs = normal(rng, lhs_shape), normal(rng, rhs_shape, scale=0.5)
    tol = tolerance(jnp.float16 if on_gpu() else jnp.float32)
    cotangent = _check_against(op, _op(lax.conv_general_dilated, kwargs), lhs, rhs, tol, rng)
    hlo = jax.jit(lambda x, w, ct: jax.vjp(op, x, w)[1](ct)).lower(lhs, rhs, cotangent).as_text()
    assert "convolution" not in hlo
    _assert_tf32_wgrad(hlo, wgrad)
    assert ("jaxdnn_conv_dgrad_v4" in hlo) == dgrad_stage
    # The forward: the conv target, or (few channels) the GEMM of the explicit-GEMM form, as TF32.
    assert re.search(r"@jaxdnn_(conv_fprop_v4|gemm_v3).*tf32 = 1 ", jax.jit(op).lower(lhs, rhs).as_text())


@pytest.mark.parametrize("x_shape,w_shape,strides,padding", [
    ((4, 16, 16, 32), (3, 3, 32, 64), (1, 1), "SAME"),
    ((3, 11, 9, 16), (5, 3, 16, 8), (2, 1), ((2, 1), (0, 3))),
    ((2, 7, 6, 24), (1, 1, 24, 16), (2, 2), "VALID"),
], ids=str)
def test_tf32_wgrad_rewrites(x_shape, w_shape, strides, padding, rng):
    """The TF32 wgrad's two rewrites on any platform (the CPU runs its own stage in their place): the
    products of bfloat16 parts, each within about 2^-16 of float32's (TF32 operands: about 3e-4 here,
    bfloat16 ones 2e-3); the GEMM of patches (exact on the CPU, TF32 on a GPU); and the float32-sums
    stage the parts run on, vmapped over dy alone (wider filters) and over both (groups)."""
    kwargs = dict(window_strides=strides, padding=padding, dimension_numbers=NHWC)
    x, w = normal(rng, x_shape), normal(rng, w_shape)
    dy = normal(rng, jax.eval_shape(lambda x, w: lax.conv_general_dilated(x, w, **kwargs), x, w).shape)
    _, _, conv, _ = _prepare("test", x, w, strides, padding, None, None, NHWC, 1, 1, None, "default")
    want = _oracle(kwargs, x, w, dy)[1][1]
    parts = jax.jit(conv_kernels._wgrad_in_bfloat16_parts, static_argnums=2)(x[:, None], dy[:, None], conv)
    assert parts.dtype == jnp.float32 and rel_err(parts[0], want) < 2e-5
    gemm = jax.jit(conv_kernels._wgrad_by_gemm, static_argnums=2)(x[:, None], dy[:, None], conv)
    assert_close(gemm[0], want, tolerance(jnp.float16 if on_gpu() else jnp.float32, grad=True), "GEMM")
    calls = _wgrad_calls(jax.jit(conv_kernels._wgrad_in_bfloat16_parts, static_argnums=2).lower(
        x[:, None], dy[:, None], conv).as_text())
    assert len(calls) == (3 if w_shape[-1] >= 64 else 2)  # dy's parts side by side below 64 filters
    xb, dyb = x.astype(jnp.bfloat16), dy.astype(jnp.bfloat16)
    want = _oracle(kwargs, xb.astype(jnp.float32), w, dyb.astype(jnp.float32))[1][1]
    want = np.stack([want, -want])
    sums = jax.jit(conv_kernels._wgrad_value, static_argnums=(2, 3))

    def on_parts(x, dy):
        return sums(x[:, None], dy[:, None], conv, True)[0]
    got = jax.vmap(on_parts, in_axes=(None, 0))(xb, jnp.stack([dyb, -dyb]))
    assert got.dtype == jnp.float32
    assert_close(got, want, tolerance(jnp.float32), "float32 sums, vmapped over dy")
    got = jax.vmap(on_parts)(jnp.stack([xb, -xb]), jnp.stack([dyb, dyb]))
    assert_close(got, want, tolerance(jnp.float32), "float32 sums, vmapped over x and dy")


# Grouped convolutions (not depthwise) and 3-D windows, which run as convolutions of one group and a
# 2-D window (jaxdnn/_conv_regroup.py) wherever the tensor cores may multiply them (16-bit; float32 at
# a TF32 precision): blocks of several groups (block-diagonal filters), one convolution a group, all
# groups in one block, depth windows with strides, dilation and uneven or negative padding, both
# rewrites at once with a depth-only window (a pointwise 2-D convolution), and a 1-D grouped one.
REGROUP_CASES = [
    ((2, 9, 8, 256), (3, 3, 8, 256), dict(window_strides=(1, 1), padding="SAME", feature_group_count=32)),
    ((2, 9, 8, 128), (3, 3, 4, 128), dict(window_strides=(2, 1), padding="SAME", feature_group_count=32)),
    ((2, 7, 6, 256), (3, 3, 128, 256), dict(window_strides=(1, 1), padding="VALID", feature_group_count=2)),
    ((2, 9, 8, 24), (3, 3, 8, 12), dict(window_strides=(1, 1), padding=((1, 0), (2, -1)), rhs_dilation=(1, 2),
                                       feature_group_count=3)),
    ((2, 5, 9, 8, 16), (3, 3, 3, 16, 8), dict(window_strides=(2, 1, 1), padding=((1, 0), (1, 1), (0, 2)),
                                             rhs_dilation=(2, 1, 1))),
    ((1, 6, 7, 5, 8), (2, 3, 3, 8, 16), dict(window_strides=(1, 2, 2), padding=((-1, 2), (1, 1), (1, 1)))),
    ((2, 5, 9, 8, 12), (3, 1, 1, 4, 6), dict(window_strides=(1, 1, 1), padding="SAME",
                                            feature_group_count=3)),
    ((2, 20, 12), (5, 3, 24), dict(window_strides=(2,), padding="SAME", feature_group_count=4)),
]


def _conv_calls(hlo):
    """The attributes of every convolution target in `hlo` (one string each)."""
    return re.findall(r"@jaxdnn_conv_\w+\(.*", hlo)


@pytest.fixture
def blocks_on_cpu(monkeypatch):
    """The GPU's forms of stages (blocks of groups, the depth fold, the strided dgrad's space-to-depth)
    on the CPU too, to check them there."""
    monkeypatch.setattr(regroup, "BLOCKS_ON_CPU", True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=dtype_id)
@pytest.mark.parametrize("lhs_shape,rhs_shape,kwargs", REGROUP_CASES, ids=str)
def test_regrouped(dtype, lhs_shape, rhs_shape, kwargs, rng, blocks_on_cpu):
    """The forward and its VJP against lax; every stage they bind has one group and a 2-D window."""
    precision = lax.Precision.DEFAULT if dtype == jnp.float32 else None
    kwargs = dict(kwargs, dimension_numbers=_CHANNELS_LAST[len(lhs_shape)], precision=precision)
    op = _op(jaxdnn.conv_general_dilated, kwargs)
    lhs, rhs = normal(rng, lhs_shape, dtype), normal(rng, rhs_shape, dtype, scale=0.5)
    tol = tolerance(jnp.float16 if dtype == jnp.float32 and on_gpu() else dtype)
    ct = _check_against(op, _op(lax.conv_general_dilated, kwargs), lhs, rhs, tol, rng)
    hlo = jax.jit(lambda x, w, ct: (op(x, w), jax.vjp(op, x, w)[1](ct))).lower(lhs, rhs, ct).as_text()
    calls = _conv_calls(hlo)
    assert calls and all("groups = 1 :" in c and "window_d = 1 :" in c for c in calls)


def test_regrouped_second_order(rng, blocks_on_cpu):
    """A gradient penalty through both rewrites (grouped, 3-D; float32 as TF32) against lax: the
    stages' VJPs are the rewritten stages too."""
    kwargs = dict(window_strides=(1, 2, 1), padding="SAME", feature_group_count=2,
                  dimension_numbers=_CHANNELS_LAST[5], precision=lax.Precision.DEFAULT)
    op, oracle = _op(jaxdnn.conv_general_dilated, kwargs), _op(lax.conv_general_dilated, kwargs)
    lhs, rhs = normal(rng, (2, 4, 6, 5, 16)), normal(rng, (2, 3, 3, 8, 8), scale=0.5)

    def penalty(fn, lhs, rhs):
        dlhs, drhs = jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w))), argnums=(0, 1))(lhs, rhs)
        return jnp.sum(dlhs ** 2) + jnp.sum(jnp.cos(drhs))
    got = jax.jit(jax.grad(functools.partial(penalty, op), argnums=(0, 1)))(lhs, rhs)
    want = jax.grad(functools.partial(penalty, oracle), argnums=(0, 1))(f64(lhs), f64(rhs))
    tol = tolerance(jnp.float16 if on_gpu() else jnp.float32, grad=True)
    assert_close(got[0], want[0], tol, "grad of grad lhs")
    assert_close(got[1], want[1], tol, "grad of grad rhs")
    hlo = jax.jit(jax.grad(functools.partial(penalty, op), argnums=(0, 1))).lower(lhs, rhs).as_text()
    calls = _conv_calls(hlo)
    assert calls and all("groups = 1 :" in c and "window_d = 1 :" in c for c in calls)


def test_grouped_blocks_only_on_a_gpu(rng):
    """By default a grouped stage binds its own kernel (G groups) on the CPU, whose kernels take the
    groups as they are, and blocks of one group on a GPU; the results agree with lax either way."""
    kwargs = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC, feature_group_count=4)
    op = _op(jaxdnn.conv_general_dilated, kwargs)
    lhs, rhs = normal(rng, (2, 6, 5, 32), jnp.bfloat16), normal(rng, (3, 3, 8, 32), jnp.bfloat16, scale=0.5)
    ct = _check_against(op, _op(lax.conv_general_dilated, kwargs), lhs, rhs, tolerance(jnp.bfloat16), rng)
    hlo = jax.jit(lambda x, w, ct: (op(x, w), jax.vjp(op, x, w)[1](ct))).lower(lhs, rhs, ct).as_text()
    groups = {int(g) for g in re.findall(r"groups = (\d+) :", "\n".join(_conv_calls(hlo)))}
    assert groups == ({1} if on_gpu() else {4})


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=dtype_id)
def test_depth_fold_only_on_a_gpu(dtype, rng):
    """By default every stage of a 3-D window binds its own kernel with the depth window (T = 3) on
    the CPU, whose kernels take 3-D windows, and the fold's 2-D windows (T = 1) on a GPU; the results
    agree with lax either way."""
    kwargs = dict(window_strides=(1, 1, 1), padding="SAME", dimension_numbers=_CHANNELS_LAST[5],
                  precision=lax.Precision.DEFAULT if dtype == jnp.float32 else None)
    op = _op(jaxdnn.conv_general_dilated, kwargs)
    lhs, rhs = normal(rng, (2, 5, 6, 5, 16), dtype), normal(rng, (3, 1, 1, 16, 8), dtype, scale=0.5)
    tol = tolerance(jnp.float16 if dtype == jnp.float32 and on_gpu() else dtype)
    ct = _check_against(op, _op(lax.conv_general_dilated, kwargs), lhs, rhs, tol, rng)
    hlo = jax.jit(lambda x, w, ct: (op(x, w), jax.vjp(op, x, w)[1](ct))).lower(lhs, rhs, ct).as_text()
    depths = {int(d) for d in re.findall(r"window_d = (\d+) :", "\n".join(_conv_calls(hlo)))}
    assert depths == ({1} if on_gpu() else {3})


@pytest.mark.parametrize("groups,channels,filters,per_block", [
    (32, 4, 4, 32), (32, 32, 32, 4), (32, 16, 32, 8), (2, 128, 192, 1), (2, 64, 96, 2), (6, 24, 24, 6),
    (12, 16, 16, 12)], ids=str)
def test_groups_per_block(groups, channels, filters, per_block):
    """The fewest groups (a divisor) with 128 channels and filters; all of them if none reach it."""
    assert regroup.groups_per_block(groups, channels, filters) == per_block


@pytest.mark.parametrize("precision,tf32", [
    (None, 0), ("highest", 0), ("default", 1), (lax.Precision.HIGH, 1), ("F32_F32_F32", 0),
    ("BF16_BF16_F32", 1)], ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_precision_picks_the_kernels(precision, tf32, dtype, rng):
    """float32 at a precision that allows TF32 gets tf32 = 1 and the rewritten backward; HIGHEST
    (and None here: the tests set jax_default_matmul_precision to "highest") keeps every stage's
    target; 16-bit operands ignore the precision."""
    tf32 = int(tf32 and dtype == jnp.float32)
    op = _op(jaxdnn.conv_general_dilated, dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC,
                                               precision=precision))
    lhs, rhs = normal(rng, (2, 6, 5, 32), dtype), normal(rng, (3, 3, 32, 8), dtype)
    hlo = jax.jit(jax.grad(lambda x, w: jnp.sum(op(x, w) ** 2), argnums=(0, 1))).lower(lhs, rhs).as_text()
    assert re.search(rf"jaxdnn_conv_fprop_v4.*tf32 = {tf32} ", hlo)
    assert ("jaxdnn_conv_dgrad_v4" in hlo) != tf32  # as a forward under TF32
    if tf32:
        _assert_tf32_wgrad(hlo)
    else:
        assert _wgrad_calls(hlo) == [(*[_MLIR_TYPES[jnp.dtype(dtype)]] * 3,)]


@pytest.mark.gpu
def test_tf32_runs_on_the_tensor_cores(rng):
    """On a GPU, float32 at DEFAULT differs from the exact products by TF32's rounding in every
    stage (its kernels ran), and at HIGHEST it is exact to float32."""
    lhs, rhs = normal(rng, (4, 16, 16, 32)), normal(rng, (3, 3, 32, 64))
    ct = normal(rng, (4, 16, 16, 64))
    kwargs = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)
    want = _oracle(kwargs, lhs, rhs, ct)
    want = (want[0],) + want[1]
    # (low, high) of y, dx and dw. dw's parts: errors of about 2^-16 (4.5e-6 in float64 on a CPU).
    default = [(2e-5, tolerance(jnp.float16))] * 2 + [(1e-6, 2e-5)]
    for precision, bounds in ((lax.Precision.DEFAULT, default), ("highest", [(0, 1e-5)] * 3)):
        op = _op(jaxdnn.conv_general_dilated, dict(kwargs, precision=precision))
        got = jax.jit(lambda x, w, ct: (lambda y, f: (y, *f(ct)))(*jax.vjp(op, x, w)))(lhs, rhs, ct)
        for name, g, w, (low, high) in zip(("y", "dx", "dw"), got, want, bounds):
            assert low <= rel_err(g, w) <= high, (precision, name, rel_err(g, w))


def test_wgrad_slices():
    """The tensor-core wgrad's slice count (its cost model): enough slices to fill the SMs where the
    output tiles are few, counts that even out the last wave of CTAs, one slice where the partial sums
    would cost more than the wave they save, at most one per image and 16."""
    from jaxdnn._conv_kernels import _wgrad_slices

    def slices(batch, size, channels, filters, window=3, tile_rows=64):
        padded_filter = window * window * channels * filters
        return _wgrad_slices(batch, batch * size * size, padded_filter, filters, tile_rows)

    assert slices(128, 56, 64, 64) == 16  # 5 tiles: as many slices as allowed
    assert slices(128, 28, 128, 128) == 7  # 18 tiles: 126 CTAs (15 slices: 270, 3 waves)
    assert slices(128, 14, 256, 256) == 3  # 72 tiles: 216 CTAs, 2 waves of 1.6 (4 slices: 3 of 2.2)
    assert slices(128, 7, 512, 512) == 1  # 288 tiles: 3 waves of 2.2, not worth a second slice's sums
    assert slices(128, 28, 128, 128, tile_rows=128) == 13  # the wide tile: 9 tiles; 10 images a slice
    assert slices(3, 56, 256, 64, window=1) == 3  # one image a slice
    assert slices(1, 56, 64, 64) == slices(0, 56, 64, 64) == slices(128, 28, 128, 0) == 1  # no filters


# A grouped, strided, dilated NHWC convolution for the transform tests (groups make the vmap rule's
# feature-group stacking nontrivial).
GROUPED = dict(window_strides=(2, 1), padding="SAME", rhs_dilation=(1, 2), dimension_numbers=NHWC,
               feature_group_count=2)


@pytest.mark.parametrize("lhs_axis,rhs_axis", [(1, None), (2, 0), (None, 3), (0, 4)], ids=str)
def test_vmap(lhs_axis, rhs_axis, rng):
    op, oracle = _op(jaxdnn.conv_general_dilated, GROUPED), _op(lax.conv_general_dilated, GROUPED)
    lhs_shape, rhs_shape = [2, 7, 6, 4], [3, 2, 2, 6]
    if lhs_axis is not None:
        lhs_shape.insert(lhs_axis, 3)
    if rhs_axis is not None:
        rhs_shape.insert(rhs_axis, 3)
    lhs, rhs = normal(rng, lhs_shape), normal(rng, rhs_shape)
    vmapped = jax.vmap(op, in_axes=(lhs_axis, rhs_axis), out_axes=1)
    want = jax.vmap(oracle, in_axes=(lhs_axis, rhs_axis), out_axes=1)(f64(lhs), f64(rhs))
    assert_close(jax.jit(vmapped)(lhs, rhs), want, 1e-5, "vmap")
    # The batch is folded into N or into feature groups: one kernel call, not a loop.
    hlo = jax.jit(vmapped).lower(lhs, rhs).as_text()
    assert hlo.count("@jaxdnn_conv_fprop_v4(") == 1 and "stablehlo.while" not in hlo
    ct = normal(rng, want.shape)

    def grads(fn, lhs, rhs, ct):
        return jax.vmap(jax.grad(lambda x, w, c: jnp.sum(fn(x, w) * c), argnums=(0, 1)),
                        in_axes=(lhs_axis, rhs_axis, 1))(lhs, rhs, ct)
    got = jax.jit(functools.partial(grads, op))(lhs, rhs, ct)
    want = grads(oracle, f64(lhs), f64(rhs), f64(ct))
    assert_close(got[0], want[0], 1e-5, "vmap(grad) lhs")
    assert_close(got[1], want[1], 1e-5, "vmap(grad) rhs")


def _kernel_form(*shape, platform=None):
    """A 2-D convolution's pixel array [N, 1, H, W, C] as its stages' calls take it, "Nx1xHxWxC"; on
    the CPU "1xNxHxWxC", the images in the depth axis (_conv_kernels._images_in_unit_axis). platform:
    the one the calls are lowered for, by default jax's default backend."""
    if (platform or jax.default_backend()) == "cpu":
        shape = (1, shape[0]) + shape[2:]
    return "x".join(map(str, shape))


@pytest.mark.parametrize("x_shape,w_shape,numbers,operand", [
    ((2, 9, 10, 8), (3, 3, 8, 4), NHWC, "1x2x9x10x8"),  # the images in the depth axis
    ((2, 40, 8), (3, 8, 4), NWC, "1x1x2x40x8"),  # 1-D: in the height axis
    ((2, 3, 9, 10, 8), (3, 3, 3, 8, 4), ("NDHWC", "DHWIO", "NDHWC"), "2x3x9x10x8"),  # 3-D: as it is
], ids=str)
def test_cpu_view_puts_the_images_in_a_unit_axis(x_shape, w_shape, numbers, operand, rng):
    """Lowered for the CPU, the three stages take a 2-D or 1-D convolution's x (dgrad: dx) with the
    images in an axis the window does not span (no unit axis after the images, which made XLA:CPU
    copy x on every call); a 3-D one's as it is."""
    x, w = normal(rng, x_shape), normal(rng, w_shape)
    op = _op(jaxdnn.conv_general_dilated, dict(window_strides=(1,) * (len(x_shape) - 2), padding="SAME",
                                               dimension_numbers=numbers))
    f = jax.jit(jax.grad(lambda x, w: jnp.sum(op(x, w) ** 2), argnums=(0, 1)))
    hlo = f.trace(x, w).lower(lowering_platforms=("cpu",)).as_text()
    calls = [line for line in hlo.splitlines() if "stablehlo.custom_call @jaxdnn_conv" in line]
    assert len(calls) == 3 and all(f"tensor<{operand}xf32>" in line for line in calls), calls


@pytest.mark.parametrize("lhs_axis", [None, 0], ids=str)
def test_vmap_over_filters(lhs_axis, rng, blocks_on_cpu):
    """Per-copy filters on a shared input widen one convolution (the forward and wgrad, as lax's
    batching does); otherwise (dgrad, or per-copy inputs) they become feature groups, one per copy,
    which on a GPU (and here, the blocks on) run as convolutions of one group: the stages of
    vmap(grad) and the fused forward's too."""
    kwargs = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)
    in_axes = (lhs_axis, 0)
    op = jax.vmap(_op(jaxdnn.conv_general_dilated, kwargs), in_axes)
    oracle = jax.vmap(_op(lax.conv_general_dilated, kwargs), in_axes)
    lhs = normal(rng, (2, 6, 5, 16) if lhs_axis is None else (3, 2, 6, 5, 16), jnp.bfloat16)
    rhs = normal(rng, (3, 3, 3, 16, 8), jnp.bfloat16, scale=0.3)
    ct = _check_against(op, oracle, lhs, rhs, tolerance(jnp.bfloat16), rng)
    hlo = jax.jit(lambda x, w, ct: (op(x, w), jax.vjp(op, x, w)[1](ct))).lower(lhs, rhs, ct).as_text()
    calls = _conv_calls(hlo)
    assert calls and all("groups = 1 :" in c for c in calls)
    # fprop (x, the 3 copies' 8 filters side by side) and wgrad (x, dy of 3 x 8 features)
    x, dy = _kernel_form(2, 1, 6, 5, 16), _kernel_form(2, 1, 6, 5, 24)
    widened = [c for c in calls if f"(tensor<{x}xbf16>, tensor<1x3x3x16x24xbf16>)" in c
               or f"(tensor<{x}xbf16>, tensor<{dy}xbf16>)" in c]
    assert len(widened) == (2 if lhs_axis is None else 0), calls

    bias = normal(rng, (3, 8), jnp.bfloat16)
    fused = jax.vmap(lambda x, w, b: jaxdnn.conv(x, w, b, activation="relu"), (lhs_axis, 0, 0))
    want = jax.nn.relu(oracle(f64(lhs), f64(rhs)) + f64(bias)[:, None, None, None, :])
    assert_close(jax.jit(fused)(lhs, rhs, bias), want, tolerance(jnp.bfloat16), "fused")
    calls = _conv_calls(jax.jit(fused).lower(lhs, rhs, bias).as_text())
    assert calls and all("fprop_fused" in c and "groups = 1 :" in c for c in calls)


def test_second_order_runs_on_the_kernels(rng):
    """A gradient penalty (grad of a function of grad) and the third order, against lax."""
    op, oracle = _op(jaxdnn.conv_general_dilated, GROUPED), _op(lax.conv_general_dilated, GROUPED)
    lhs, rhs = normal(rng, (2, 7, 6, 4)), normal(rng, (3, 2, 2, 6))
    ct = normal(rng, (2, 4, 6, 6))

    def penalty(fn, lhs, rhs):
        def loss(x, w):
            return jnp.sum(jnp.sin(fn(x, w)) * ct.astype(x.dtype))
        dlhs, drhs = jax.grad(loss, argnums=(0, 1))(lhs, rhs)
        return jnp.sum(dlhs ** 2) + jnp.sum(jnp.cos(drhs))
    got = jax.jit(jax.grad(functools.partial(penalty, op), argnums=(0, 1)))(lhs, rhs)
    want = jax.grad(functools.partial(penalty, oracle), argnums=(0, 1))(f64(lhs), f64(rhs))
    assert_close(got[0], want[0], 1e-5, "grad of grad lhs")
    assert_close(got[1], want[1], 1e-5, "grad of grad rhs")

    def third(fn):
        return jax.grad(lambda x, w: jnp.sum(jax.grad(lambda x: penalty(fn, x, w))(x) ** 2), argnums=1)
    assert_close(jax.jit(third(op))(lhs, rhs), third(oracle)(f64(lhs), f64(rhs)), 1e-5, "third order")
    hlo = jax.jit(third(op)).lower(lhs, rhs).as_text()
    assert all(target in hlo for target in TARGETS)
    assert "convolution" not in hlo


def test_checkpoint_scan_and_jvp(rng):
    kwargs = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)  # shape-preserving
    op, oracle = _op(jaxdnn.conv_general_dilated, kwargs), _op(lax.conv_general_dilated, kwargs)
    lhs, rhs = normal(rng, (2, 6, 5, 4)), normal(rng, (3, 3, 4, 4), scale=0.3)
    ct = normal(rng, lhs.shape)

    def scanned(fn, lhs, rhs):
        h, _ = lax.scan(lambda h, _: (jax.checkpoint(fn)(h, rhs) * 1.5 - 0.2, None), lhs, None, length=3)
        return jnp.sum(h * ct.astype(h.dtype))
    got = jax.jit(jax.grad(functools.partial(scanned, op), argnums=(0, 1)))(lhs, rhs)
    want = jax.grad(functools.partial(scanned, oracle), argnums=(0, 1))(f64(lhs), f64(rhs))
    assert_close(got[0], want[0], 1e-5, "scan(checkpoint) lhs")
    assert_close(got[1], want[1], 1e-5, "scan(checkpoint) rhs")
    small_lhs, small_rhs = lhs[:1, :3, :3, :2], rhs[:2, :2, :2, :3]
    jac = jax.jacrev(op, argnums=(0, 1))(small_lhs, small_rhs)
    want_jac = jax.jacrev(oracle, argnums=(0, 1))(f64(small_lhs), f64(small_rhs))
    assert_close(jac[0], want_jac[0], 1e-6, "jacrev lhs")
    assert_close(jac[1], want_jac[1], 1e-6, "jacrev rhs")
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(op, (lhs, rhs), (lhs, rhs))


def test_hlo_holds_the_custom_calls(rng):
    lhs, rhs = normal(rng, (2, 6, 5, 8)), normal(rng, (3, 3, 8, 8))
    op = _op(jaxdnn.conv_general_dilated, dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC))
    fwd_hlo = jax.jit(op).lower(lhs, rhs).as_text()
    assert TARGETS[0] in fwd_hlo and TARGETS[1] not in fwd_hlo and "convolution" not in fwd_hlo
    assert "transpose" not in fwd_hlo  # channels-last needs none
    grad = jax.grad(lambda x, w: jnp.sum(op(x, w) ** 2), argnums=(0, 1))
    grad_hlo = jax.jit(grad).lower(lhs, rhs).as_text()
    assert all(target in grad_hlo for target in TARGETS) and "convolution" not in grad_hlo


@pytest.mark.parametrize("strides,padding,dilation,kernels", [
    ((2, 1), ((2, 1), (-1, 2)), (1, 2), "jaxdnn_conv_"),  # space-to-depth on H (W keeps its dilation)
    ((3, 2), "SAME", 1, "jaxdnn_conv_"),                   # both axes, a stride larger than the window
    ((1, 1), ((2, 1), (-1, 2)), (2, 1), "jaxdnn_gemm_"),   # unit stride: the explicit GEMM
], ids=["space_to_depth_h", "space_to_depth_hw", "explicit_gemm"])
def test_few_channels_are_rewritten(strides, padding, dilation, kernels, rng):
    """2 to 7 input channels (an RGB stem): strided convolutions become unit-stride ones on more
    channels (space-to-depth), the others XLA's im2col and the GEMM kernel. Forward and backward
    with a fused epilogue against the float64 reference; the HLO holds the expected kernels only."""
    x, w, bias = normal(rng, (2, 11, 10, 3)), normal(rng, (3, 4, 3, 5)), normal(rng, (5,))
    kwargs = dict(strides=strides, padding=padding, dilation=dilation)
    op = functools.partial(jaxdnn.conv, activation="gelu", **kwargs)
    oracle = functools.partial(jaxdnn.reference.conv, activation="gelu", **kwargs)
    hlo = jax.jit(jax.grad(lambda *a: jnp.sum(op(*a) ** 2), argnums=(0, 1, 2))).lower(x, w, bias).as_text()
    other = "jaxdnn_gemm_" if kernels == "jaxdnn_conv_" else "jaxdnn_conv_"
    assert kernels in hlo and other not in hlo and "convolution" not in hlo
    ct = normal(rng, op(x, w, bias).shape)
    got_y, pullback = jax.vjp(op, x, w, bias)
    want_y, want_pullback = jax.vjp(oracle, f64(x), f64(w), f64(bias))
    assert_close(got_y, want_y, 1e-5, "y")
    for name, got, want in zip(("x", "w", "bias"), pullback(ct), want_pullback(f64(ct))):
        assert_close(got, want, 1e-5, f"d{name}")


@pytest.mark.parametrize("channels", [8, 6], ids=["kernels", "space_to_depth"])
@pytest.mark.parametrize("mesh_kind", ["mesh", "auto", "explicit"])
def test_batch_sharded_runs_per_shard(mesh_kind, channels, devices, rng):
    kwargs = dict(window_strides=(2, 2), padding="SAME", dimension_numbers=NHWC)
    op = _op(jaxdnn.conv_general_dilated, kwargs)
    mesh = batch_mesh(mesh_kind, devices)
    lhs = jax.device_put(normal(rng, (8, 9, 10, channels)), NamedSharding(mesh, P("b")))
    rhs = jax.device_put(normal(rng, (3, 3, channels, 5)), NamedSharding(mesh, P()))
    ct = jax.device_put(normal(rng, (8, 5, 5, 5)), NamedSharding(mesh, P("b")))
    step = jax.jit(lambda x, w, ct: (lambda y, pullback: (y, *pullback(ct)))(*jax.vjp(op, x, w)))
    with jax.set_mesh(mesh) if mesh_kind == "explicit" else contextlib.nullcontext():
        hlo = step.lower(lhs, rhs, ct).compile().as_text()
        y, dlhs, drhs = step(lhs, rhs, ct)
    assert "all-gather" not in hlo
    calls = [line for line in hlo.splitlines() if 'custom_call_target="jaxdnn_' in line]
    assert len(calls) == 3, calls
    # Every stage reads or writes lhs's per-shard [2, 1, 9, 10, 8] in the kernels' 3-D form; with 6
    # channels, space-to-depth's [2, 1, 6, 6, 24] (2 x 2 blocks of pixels, the input padded to 12 x 12).
    # These tests' devices are CPUs (also on a GPU machine), so in the CPU's form: _kernel_form.
    dims = (2, 1, 9, 10, 8) if channels == 8 else (2, 1, 6, 6, 24)
    x_shape = f"f32[{_kernel_form(*dims, platform='cpu').replace('x', ',')}]"
    assert all(x_shape in line for line in calls), calls
    want_y, (want_dlhs, want_drhs) = _oracle(kwargs, np.asarray(lhs), np.asarray(rhs), np.asarray(ct))
    assert_close(y, want_y, 1e-5, "sharded forward")
    assert_close(dlhs, want_dlhs, 1e-5, "sharded grad lhs")
    assert_close(drhs, want_drhs, 1e-5, "sharded grad rhs")
    assert y.sharding.spec[0] == "b" and dlhs.sharding.spec[0] == "b"


@pytest.mark.parametrize("out_spec", [P("b"), P(), P(None, None, "b")], ids=["batch", "replicated", "width"])
def test_out_sharding(out_spec, devices, rng):
    """lax's out_sharding under an Explicit mesh: the result in that sharding, as lax's, and the
    gradients of the batch-sharded operands as theirs."""
    kwargs = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)
    mesh = batch_mesh("explicit", devices)
    lhs = jax.device_put(normal(rng, (8, 6, 8, 4)), NamedSharding(mesh, P("b")))
    rhs = jax.device_put(normal(rng, (3, 3, 4, 5)), NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x, w: jaxdnn.conv_general_dilated(x, w, **kwargs, out_sharding=out_spec))(lhs, rhs)
        want = jax.jit(lambda x, w: lax.conv_general_dilated(x, w, **kwargs, out_sharding=out_spec))(lhs, rhs)
        dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(
            jaxdnn.conv_general_dilated(x, w, **kwargs, out_sharding=out_spec) ** 2), (0, 1)))(lhs, rhs)
    assert y.sharding.is_equivalent_to(want.sharding, y.ndim)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), y.ndim)
    assert dx.sharding.spec[0] == "b"
    want_y, (want_dx, want_dw) = _oracle(kwargs, np.asarray(lhs), np.asarray(rhs), 2 * np.asarray(want))
    assert_close(y, want_y, 1e-5, "forward")
    assert_close(dx, want_dx, 1e-4, "grad lhs")
    assert_close(dw, want_dw, 1e-4, "grad rhs")


@pytest.mark.parametrize("lhs_shape,rhs_shape,kwargs", [
    ((8, 9, 10, 16), (3, 3, 16, 8), dict(window_strides=(2, 2), dimension_numbers=NHWC)),
    ((8, 4, 6, 5, 8), (3, 3, 3, 8, 8), dict(window_strides=(1, 1, 1), dimension_numbers=_CHANNELS_LAST[5])),
    ((8, 6, 5, 32), (3, 3, 8, 32), dict(window_strides=(1, 1), dimension_numbers=NHWC,
                                        feature_group_count=4)),
], ids=["strided", "3-D", "grouped"])
@pytest.mark.parametrize("mesh_kind", ["mesh", "auto", "explicit"])
def test_rewrites_batch_sharded(mesh_kind, lhs_shape, rhs_shape, kwargs, devices, rng, blocks_on_cpu):
    """The 16-bit rewrites whose dgrad transposes XLA's gathers (space-to-depth, the depth fold) or
    slices the groups, with the batch sharded: per shard, no all-gather, against lax."""
    kwargs = dict(kwargs, padding="SAME")
    op = _op(jaxdnn.conv_general_dilated, kwargs)
    mesh = batch_mesh(mesh_kind, devices)
    lhs = jax.device_put(normal(rng, lhs_shape, jnp.bfloat16), NamedSharding(mesh, P("b")))
    rhs = jax.device_put(normal(rng, rhs_shape, jnp.bfloat16, scale=0.5), NamedSharding(mesh, P()))
    ct_shape = jax.eval_shape(op, lhs, rhs).shape
    ct = jax.device_put(normal(rng, ct_shape, jnp.bfloat16), NamedSharding(mesh, P("b")))
    step = jax.jit(lambda x, w, ct: (lambda y, pullback: (y, *pullback(ct)))(*jax.vjp(op, x, w)))
    with jax.set_mesh(mesh) if mesh_kind == "explicit" else contextlib.nullcontext():
        assert "all-gather" not in step.lower(lhs, rhs, ct).compile().as_text()
        got = step(lhs, rhs, ct)
    y, (dlhs, drhs) = _oracle(kwargs, np.asarray(lhs), np.asarray(rhs), np.asarray(ct))
    for name, g, want in zip(("forward", "grad lhs", "grad rhs"), got, (y, dlhs, drhs)):
        assert_close(g, want, tolerance(jnp.bfloat16, grad=name != "forward"), f"sharded {name}")


@pytest.mark.parametrize("mesh_kind", ["mesh", "auto", "explicit"])
def test_tf32_batch_sharded(mesh_kind, devices, rng):
    """The TF32 backward's rewrites (a forward for dgrad; on a GPU, bfloat16 parts for wgrad) keep a
    batch-sharded step per shard: no all-gather, dw summed over the shards."""
    kwargs = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC, precision="default")
    op = _op(jaxdnn.conv_general_dilated, kwargs)
    mesh = batch_mesh(mesh_kind, devices)
    lhs = jax.device_put(normal(rng, (8, 9, 10, 32)), NamedSharding(mesh, P("b")))
    rhs = jax.device_put(normal(rng, (3, 3, 32, 16)), NamedSharding(mesh, P()))
    ct = jax.device_put(normal(rng, (8, 9, 10, 16)), NamedSharding(mesh, P("b")))
    step = jax.jit(lambda x, w, ct: (lambda y, pullback: (y, *pullback(ct)))(*jax.vjp(op, x, w)))
    with jax.set_mesh(mesh) if mesh_kind == "explicit" else contextlib.nullcontext():
        hlo = step.lower(lhs, rhs, ct).compile().as_text()
        got = step(lhs, rhs, ct)
    assert "all-gather" not in hlo and 'custom_call_target="jaxdnn_conv_wgrad_v4"' in hlo
    want_y, want_grads = _oracle(kwargs, np.asarray(lhs), np.asarray(rhs), np.asarray(ct))
    tol = tolerance(jnp.float16 if on_gpu() else jnp.float32)
    for name, g, w in zip(("y", "dx", "dw"), got, (want_y, *want_grads)):
        assert_close(g, w, tol if name == "y" else 10 * tol, f"sharded {name}")
    assert got[0].sharding.spec[0] == "b" and got[1].sharding.spec[0] == "b"


def test_shard_map_grad(devices, rng):
    kwargs = dict(window_strides=(1, 1), padding="VALID", dimension_numbers=NHWC)
    op = _op(jaxdnn.conv_general_dilated, kwargs)
    mesh = batch_mesh("mesh", devices)
    lhs, rhs, ct = normal(rng, (8, 6, 5, 3)), normal(rng, (2, 2, 3, 4)), normal(rng, (8, 5, 4, 4))
    per_shard = jax.shard_map(lambda x, w, ct: jax.vjp(op, x, w)[1](ct), mesh=mesh,
                              in_specs=(P("b"), P(), P("b")), out_specs=(P("b"), P()))
    got = jax.jit(per_shard)(lhs, rhs, ct)
    _, want = _oracle(kwargs, lhs, rhs, ct)
    assert_close(got[0], want[0], 1e-5, "shard_map grad lhs")
    assert_close(got[1], want[1], 1e-5, "shard_map grad rhs (summed over the shards)")


def test_export_round_trip(rng):
    lhs, rhs = normal(rng, (3, 4, 9, 8)), normal(rng, (5, 4, 3, 3))
    op = _op(jaxdnn.conv_general_dilated, dict(window_strides=(2, 1), padding="SAME"))
    f = jax.jit(jax.grad(lambda x, w: jnp.sum(op(x, w) ** 2), argnums=(0, 1)))
    exported = export.export(f, disabled_checks=jaxdnn.export_safety_checks())(lhs, rhs)
    restored = export.deserialize(exported.serialize())
    for got, want in zip(restored.call(lhs, rhs), f(lhs, rhs)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_batch_polymorphic_export(rng):
    kwargs = dict(window_strides=(1, 2), padding="SAME", dimension_numbers=NHWC)
    op = _op(jaxdnn.conv_general_dilated, kwargs)
    batch, = export.symbolic_shape("batch")
    rhs = normal(rng, (3, 2, 4, 5))
    exported = export.export(jax.jit(op), disabled_checks=jaxdnn.export_safety_checks())(
        jax.ShapeDtypeStruct((batch, 7, 6, 4), jnp.float32), rhs)
    restored = export.deserialize(exported.serialize())
    lhs = normal(rng, (5, 7, 6, 4))
    for rows in (5, 1):
        want = _oracle(kwargs, lhs[:rows], rhs)[0]
        assert_close(restored.call(lhs[:rows], rhs), want, 1e-5, f"batch={rows}")


L, R = (2, 6, 6, 4), (3, 3, 4, 8)  # NHWC / HWIO
LF, RF = (L, jnp.float32), (R, jnp.float32)


@pytest.mark.parametrize("lhs,rhs,kwargs,error,message", [
    ((L, jnp.int32), (R, jnp.int32), {}, TypeError, "lhs must be float32, bfloat16 or float16, got int32"),
    (LF, (R, jnp.float64), {}, TypeError, "rhs must be float32, bfloat16 or float16, got float64"),
    (LF, (R, jnp.bfloat16), {}, TypeError, "same dtype"),
    (LF, ((3, 3, 5, 8), jnp.float32), {}, ValueError, "channel mismatch: lhs has 4 input features"),
    (LF, ((3, 3, 2, 8), jnp.float32), dict(feature_group_count=3), ValueError,
     "feature_group_count = 3 must divide lhs's 4 input features"),
    (LF, ((3, 3, 2, 7), jnp.float32), dict(feature_group_count=2), ValueError,
     "feature_group_count = 2 must divide rhs's 7 output features"),
    (LF, RF, dict(batch_group_count=3), ValueError, "batch_group_count = 3 must divide"),
    (LF, ((4, 3, 2, 8), jnp.float32), dict(feature_group_count=2, batch_group_count=2), ValueError,
     "at most one of feature_group_count and batch_group_count"),
    (LF, ((7, 3, 4, 8), jnp.float32), dict(padding="VALID"), ValueError,
     "rhs's window on spatial axis 0 .* is larger than the dilated, padded lhs"),
    (LF, RF, dict(padding="VALID", rhs_dilation=(3, 1)), ValueError,
     "larger than the dilated, padded lhs"),
    (LF, RF, dict(dimension_numbers=("NHWC", "HWIO")), ValueError,
     "bad dimension_numbers"),
    (LF, RF, dict(dimension_numbers=("NHWC", "HWIX", "NHWC")), ValueError,
     "bad dimension_numbers"),
    (LF, ((3, 4, 8), jnp.float32), {}, ValueError, "same rank, 3 to 5"),
    (LF, RF, dict(window_strides=(1,)), ValueError, "window_strides must have 2"),
    (LF, RF, dict(window_strides=(0, 1)), ValueError, "window_strides entries must be >= 1"),
    (LF, RF, dict(lhs_dilation=(1, 0)), ValueError, "lhs_dilation entries must be >= 1"),
    (LF, RF, dict(padding="FULL"), ValueError, "padding must be 'SAME'"),
    (LF, RF, dict(padding=((1, 1),)), ValueError, "padding must have 2"),
    (LF, RF, dict(padding=3), TypeError, "padding must be a string or"),
    (LF, RF, dict(padding="SAME", lhs_dilation=(2, 1)), ValueError,
     "string padding 'SAME' is not supported with lhs_dilation"),
    (LF, RF, dict(feature_group_count=0), ValueError, "feature_group_count must be >= 1"),
    (LF, RF, dict(preferred_element_type=jnp.bfloat16), TypeError,
     "preferred_element_type must not be narrower than the operands' dtype float32, got bfloat16"),
    (LF, RF, dict(preferred_element_type=jnp.int32), TypeError,
     "preferred_element_type must be None, float32, bfloat16 or float16 for float32 operands, got int32"),
], ids=["int", "float64", "mixed-dtypes", "channels", "groups-channels", "groups-filters", "batch-groups",
        "both-groups", "window-too-large", "dilated-window-too-large", "dimension-numbers-length",
        "dimension-numbers-letters", "rank", "strides-length", "zero-stride", "zero-dilation", "padding-name",
        "padding-pairs", "padding-type", "string-padding-dilated-lhs", "zero-groups", "preferred-narrower",
        "preferred-int"])
def test_bad_input(lhs, rhs, kwargs, error, message):
    kwargs = dict(dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC), **kwargs)
    with pytest.raises(error, match=message):
        jaxdnn.conv_general_dilated(jnp.ones(*lhs), jnp.ones(*rhs), **kwargs)


def test_precision_and_preferred_type_are_accepted(rng):
    lhs, rhs = normal(rng, L, jnp.bfloat16), normal(rng, R, jnp.bfloat16)
    kwargs = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)
    y = jaxdnn.conv_general_dilated(lhs, rhs, precision=lax.Precision.HIGHEST,
                                    preferred_element_type=jnp.bfloat16, **kwargs)
    assert y.dtype == jnp.bfloat16
    assert_close(y, _oracle(kwargs, lhs, rhs)[0], tolerance(jnp.bfloat16), "precision=HIGHEST")
    reference = jaxdnn.reference.conv_general_dilated(lhs, rhs, **kwargs)
    assert reference.dtype == jnp.bfloat16
    assert_close(reference, _oracle(kwargs, lhs, rhs)[0], tolerance(jnp.bfloat16), "reference")


@pytest.mark.parametrize("dtype,preferred", [(jnp.bfloat16, jnp.float32), (jnp.float16, jnp.float32),
                                             (jnp.bfloat16, jnp.float16)], ids=str)
@pytest.mark.parametrize("x_shape,w_shape", [((2, 9, 10, 16), (3, 3, 16, 24)),
                                             ((2, 9, 10, 64), (3, 3, 64, 128))], ids=str)
def test_preferred_element_type_wider(dtype, preferred, x_shape, w_shape, rng):
    """A preferred float type at least as wide as the 16-bit operands: the result in it, its values
    the exact products' float32 sums (float32's tolerance where the result is float32), and the
    gradients in the operands' dtype, as lax's (the 64 -> 128 case is one the 16-bit tensor-core
    kernels would take)."""
    x, w = normal(rng, x_shape, dtype), normal(rng, w_shape, dtype, scale=0.5)
    kwargs = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)
    op = _op(functools.partial(jaxdnn.conv_general_dilated, preferred_element_type=preferred), kwargs)
    y = jax.jit(op)(x, w)
    want_y, pullback = jax.vjp(_op(lax.conv_general_dilated, kwargs), f64(x), f64(w))
    lax_y = lax.conv_general_dilated(x, w, preferred_element_type=preferred, **kwargs)
    assert y.dtype == lax_y.dtype == jnp.dtype(preferred)
    assert_close(y, want_y, tolerance(preferred), "forward")
    cotangent = normal(rng, y.shape, preferred)
    dx, dw = _vjp(op, x, w, cotangent)
    assert dx.dtype == dw.dtype == jnp.dtype(dtype)
    want_dx, want_dw = pullback(f64(cotangent))
    assert_close(dx, want_dx, GRAD_FACTOR * tolerance(dtype), "grad lhs")
    assert_close(dw, want_dw, GRAD_FACTOR * tolerance(dtype), "grad rhs")


# (lhs shape, rhs shape, kwargs of conv_transpose).
TRANSPOSE_CASES = [
    ((2, 5, 6, 4), (3, 3, 4, 6), dict(strides=(2, 2), padding="SAME")),
    ((2, 5, 6, 4), (4, 3, 4, 3), dict(strides=(2, 3), padding="VALID", rhs_dilation=(1, 2))),
    ((2, 5, 6, 4), (3, 3, 6, 4), dict(strides=(2, 2), padding="SAME", transpose_kernel=True)),
    ((2, 5, 6, 4), (3, 3, 4, 5), dict(strides=(2, 1), padding=((1, 2), (0, 1)))),
    ((2, 5, 6, 4), (3, 3, 4, 5), dict(strides=(2, 2), padding=((1, 1), (1, 0)), use_consistent_padding=True)),
    ((2, 7, 3), (4, 3, 5), dict(strides=(3,), padding="SAME")),
    ((1, 3, 4, 5, 2), (2, 3, 2, 2, 3), dict(strides=(2, 1, 2), padding="VALID")),
    ((2, 4, 6, 5), (3, 4, 3, 3), dict(strides=(2, 2), padding="SAME",
                                      dimension_numbers=("NCHW", "OIHW", "NCHW"))),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("lhs_shape,rhs_shape,kwargs", TRANSPOSE_CASES, ids=str)
def test_conv_transpose(dtype, lhs_shape, rhs_shape, kwargs, rng):
    op = _op(jaxdnn.conv_transpose, kwargs)
    lhs, rhs = normal(rng, lhs_shape, dtype), normal(rng, rhs_shape, dtype, scale=0.5)
    _check_against(op, _op(lax.conv_transpose, kwargs), lhs, rhs, tolerance(dtype), rng)
    # It runs as the dgrad of the strided convolution it transposes (no zero-dilated input).
    hlo = jax.jit(op).lower(lhs, rhs).as_text()
    assert "jaxdnn_conv_dgrad_v4" in hlo and "jaxdnn_conv_fprop" not in hlo and "convolution" not in hlo


@pytest.mark.parametrize("lhs_shape,rhs_shape,kwargs", [
    ((2, 5, 6, 8), (4, 4, 8, 32), dict(strides=(2, 2), padding="SAME")),  # DCGAN's upsampling
    ((2, 5, 6, 16), (2, 2, 16, 32), dict(strides=(2, 2), padding="VALID")),  # U-Net's
    ((2, 7, 8), (3, 8, 32), dict(strides=(3,), padding="SAME")),
], ids=str)
def test_conv_transpose_tf32(lhs_shape, rhs_shape, kwargs, rng, blocks_on_cpu):
    """float32 at DEFAULT: the dgrad it runs as goes through space-to-depth (a GPU's form) to a TF32
    forward (no dgrad target left), its VJP's forward is TF32 too and its wgrad runs in bfloat16
    parts."""
    kwargs = dict(kwargs, precision=lax.Precision.DEFAULT)
    op = _op(jaxdnn.conv_transpose, kwargs)
    oracle = _op(lax.conv_transpose, dict(kwargs, precision="highest"))
    lhs, rhs = normal(rng, lhs_shape), normal(rng, rhs_shape, scale=0.5)
    tol = tolerance(jnp.float16 if on_gpu() else jnp.float32)
    cotangent = _check_against(op, oracle, lhs, rhs, tol, rng)
    hlo = jax.jit(lambda x, w, ct: jax.vjp(op, x, w)[1](ct)).lower(lhs, rhs, cotangent).as_text()
    assert "jaxdnn_conv_dgrad" not in hlo and "convolution" not in hlo
    _assert_tf32_wgrad(hlo)
    assert re.search(r"jaxdnn_conv_fprop_v4.*tf32 = 1 ", jax.jit(op).lower(lhs, rhs).as_text())


# (x shape, w shape, kwargs of conv), channels last; bias and residual are added by the test.
FUSED_CASES = [
    ((2, 9, 8, 6), (3, 3, 6, 10), dict(strides=2, padding="SAME")),
    ((2, 7, 8, 6), (3, 2, 3, 8), dict(strides=(1, 2), padding="VALID", dilation=(2, 1), groups=2)),
    ((3, 11, 5), (3, 5, 7), dict(padding=((1, 2),))),
    ((1, 4, 5, 6, 4), (2, 3, 2, 4, 5), dict(strides=(1, 2, 1))),
]


# Every activation kind in float32; the 16-bit types on a few (the epilogue's math is type-independent).
FUSED_EPILOGUES = [(jnp.float32, a) for a in (None, "relu", "gelu", "silu", "leaky_relu")] + [
    (jnp.bfloat16, "relu"), (jnp.bfloat16, "gelu"), (jnp.float16, "silu")]


@pytest.mark.parametrize("dtype,activation", FUSED_EPILOGUES, ids=str)
@pytest.mark.parametrize("x_shape,w_shape,kwargs", FUSED_CASES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["bias", "bias+residual"])
def test_conv_fused(dtype, activation, x_shape, w_shape, kwargs, with_residual, rng):
    x, w = normal(rng, x_shape, dtype), normal(rng, w_shape, dtype, scale=0.5)
    check_fused_conv(x, w, kwargs, activation, with_residual, rng)


@pytest.mark.parametrize("dtype,activation", [(jnp.bfloat16, "gelu"), (jnp.float16, "relu")], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["bias", "bias+residual"])
@pytest.mark.parametrize("channels,filters",
                         [(16, 24), (64, 64), (64, 128), (128, 256), (128, 64), (128, 192)], ids=str)
def test_conv_fused_tensor_core_shapes(dtype, activation, with_residual, channels, filters, rng):
    """The epilogue of the tensor-core forward (16-bit, channels multiples of 8 on a GPU; 64 -> 64 on the
    halo kernel, 64 -> 128 and 128 -> 256 on the im2col kernels' tiles of 128 and 256 features, 128 ->
    64 and 128 -> 192 on their tile of 64: one and three tiles across the output channels)."""
    test_conv_fused(dtype, activation, (2, 9, 10, channels), (3, 3, channels, filters), dict(padding="SAME"),
                    with_residual, rng)


@pytest.mark.parametrize("with_residual", [False, True], ids=["bias", "bias+residual"])
@pytest.mark.parametrize("x_shape,w_shape", [((2, 3, 130, 64), (3, 3, 64, 64)), ((2, 150, 64), (3, 64, 64)),
                                             ((2, 150, 64), (7, 64, 64))], ids=str)
def test_conv_fused_halo_strips(x_shape, w_shape, with_residual, rng):
    """The halo kernels' epilogue on strips of a row (a residual read and a store clipped at the row's
    end): a 3x3 layer over rows of 130 pixels and 1-D ones of 3 and 7 taps over 150 samples, 64 -> 64."""
    test_conv_fused(jnp.bfloat16, "silu", x_shape, w_shape, dict(padding="SAME"), with_residual, rng)


def test_conv_fused_hlo_and_second_order(rng):
    x, w, bias = normal(rng, (2, 6, 5, 4)), normal(rng, (3, 3, 4, 6)), normal(rng, (6,))
    residual = normal(rng, (2, 6, 5, 6))

    def op(fn):
        return lambda x, w, bias: fn(x, w, bias, activation="silu", residual=residual)
    infer_hlo = jax.jit(op(jaxdnn.conv)).lower(x, w, bias).as_text()
    assert "jaxdnn_conv_fprop_fused_v4" in infer_hlo and "jaxdnn_activation" not in infer_hlo
    assert "convolution" not in infer_hlo

    def penalty(fn, x, w, bias):
        dx = jax.grad(lambda x: jnp.sum(jnp.sin(op(fn)(x, w, bias))))(x)
        return jnp.sum(dx ** 2)
    grad = jax.jit(jax.grad(functools.partial(penalty, jaxdnn.conv), argnums=(0, 1, 2)))
    want = jax.grad(functools.partial(penalty, jaxdnn.reference.conv), argnums=(0, 1, 2))
    for name, g, want_g in zip(("x", "w", "bias"), grad(x, w, bias), want(f64(x), f64(w), f64(bias))):
        assert_close(g, want_g, 1e-5, f"grad of grad {name}")
    hlo = grad.lower(x, w, bias).as_text()
    assert all(target in hlo for target in TARGETS + ("jaxdnn_conv_fprop_fused_v4",))
    assert "jaxdnn_activation_bwd_bias_v1" in hlo  # dz and dbias in one pass
    assert "convolution" not in hlo


@pytest.mark.parametrize("x_axis,w_axis,bias_axis", [(0, None, None), (1, 0, 0), (None, None, 0)], ids=str)
def test_conv_fused_vmap(x_axis, w_axis, bias_axis, rng):
    kwargs = dict(strides=(2, 1), groups=2, activation="relu")
    shapes = [[2, 7, 6, 4], [3, 3, 2, 6], [6]]
    for shape, axis in zip(shapes, (x_axis, w_axis, bias_axis)):
        if axis is not None:
            shape.insert(axis, 3)
    x, w, bias = (normal(rng, shape) for shape in shapes)
    residual = normal(rng, (3, 2, 4, 6, 6))  # always batched at 0
    in_axes = (x_axis, w_axis, bias_axis, 0)
    def batched(fn):
        return jax.vmap(lambda x, w, b, r: fn(x, w, b, residual=r, **kwargs), in_axes)
    got = jax.jit(batched(jaxdnn.conv))(x, w, bias, residual)
    want = batched(jaxdnn.reference.conv)(f64(x), f64(w), f64(bias), f64(residual))
    assert_close(got, want, 1e-5, "vmap")


@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_conv_fused_batch_sharded(mesh_kind, devices, rng):
    mesh = batch_mesh(mesh_kind, devices)
    row = NamedSharding(mesh, P("b"))
    x = jax.device_put(normal(rng, (8, 9, 10, 6)), row)
    residual = jax.device_put(normal(rng, (8, 9, 10, 5)), row)
    ct = jax.device_put(normal(rng, (8, 9, 10, 5)), row)
    w, bias = normal(rng, (3, 3, 6, 5)), normal(rng, (5,))

    def op(fn):
        return lambda x, w, b, r: fn(x, w, b, activation="relu", residual=r)
    def train_step(args, ct):
        y, pullback = jax.vjp(op(jaxdnn.conv), *args)
        return y, pullback(ct)
    step = jax.jit(train_step)
    with jax.set_mesh(mesh) if mesh_kind == "explicit" else contextlib.nullcontext():
        hlo = step.lower((x, w, bias, residual), ct).compile().as_text()
        y, grads = step((x, w, bias, residual), ct)
    assert "all-gather" not in hlo
    want_y, pullback = jax.vjp(op(jaxdnn.reference.conv), *(f64(np.asarray(a))
                                                            for a in (x, w, bias, residual)))
    assert_close(y, want_y, 1e-5, "sharded forward")
    for name, g, want_g in zip(("x", "w", "bias", "residual"), grads, pullback(f64(np.asarray(ct)))):
        assert_close(g, want_g, 1e-5, f"sharded grad {name}")


X4, W4 = jnp.ones((2, 6, 6, 4), jnp.float32), jnp.ones((3, 3, 4, 8), jnp.float32)


@pytest.mark.parametrize("args,kwargs,error,message", [
    ((X4, W4), dict(activation="swish"), ValueError, "conv: activation must be None or one of"),
    ((X4, W4, jnp.ones((7,), jnp.float32)), {}, ValueError, r"conv: bias must have shape \(8,\), got \(7,\)"),
    ((X4, W4, jnp.ones((8,), jnp.int32)), {}, TypeError, "conv: bias must be float32"),
    ((X4, W4), dict(residual=jnp.ones((2, 6, 6, 7), jnp.float32)), ValueError,
     r"conv: residual must have shape \(2, 6, 6, 8\)"),
    ((X4, W4), dict(residual=jnp.ones((2, 6, 6, 8), jnp.bfloat16)), TypeError,
     "residual must have x's dtype"),
    ((X4, W4), dict(strides=(1, 2, 3)), ValueError, "conv: strides must have 2 entries"),
    ((X4, jnp.ones((3, 3, 3, 8), jnp.float32)), dict(groups=2), ValueError,
     "conv: channel mismatch: x has 4 input features, w 3 per group"),
    ((jnp.ones((6, 4), jnp.float32), jnp.ones((3, 4), jnp.float32)), {}, ValueError,
     "conv: x and w must have the same rank, 3 to 5"),
], ids=["activation", "bias-shape", "bias-dtype", "residual-shape", "residual-dtype", "strides", "groups",
        "rank"])
def test_conv_bad_input(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        jaxdnn.conv(*args, **kwargs)


# The CPU kernel's matmuls in each build the CPU can run (JAXDNN_CPU_ISA caps the choice, which is made
# once per process): a child process per cap, on the CPU, computes the forward and both gradients of
# convolutions whose tiles have partial rows and padded columns, taps in several chunks, invalid
# taps, strides, dilation, groups, and wgrad in several slices (of 1024 output pixels or more) and
# items of taps, and reports the relative errors against lax in float64.
_ISA_CHILD = """
import json, jax, jax.numpy as jnp, numpy as np
from jax import lax
import jaxdnn
jax.config.update("jax_enable_x64", True)
DIMS = ("NHWC", "HWIO", "NHWC")
cases = [  # x shape, w shape, strides, padding, dilation, groups
    ((2, 9, 11, 24), (3, 3, 24, 20), (1, 1), "SAME", (1, 1), 1),
    ((2, 9, 11, 24), (3, 3, 12, 20), (2, 2), "SAME", (1, 1), 2),
    ((1, 10, 7, 8), (3, 2, 8, 36), (1, 1), ((2, 1), (0, 3)), (2, 3), 1),
    ((1, 5, 5, 300), (3, 3, 300, 8), (1, 1), "VALID", (1, 1), 1),
    ((2, 9, 11, 40), (5, 5, 1, 40), (2, 1), "SAME", (1, 2), 40),  # depthwise: its own kernels
    ((1, 48, 48, 64), (3, 3, 64, 64), (1, 1), "SAME", (1, 1), 1),  # 2304 output pixels: wgrad in 2
    # slices of 2 items (5 and 4 taps)
]
errors = []
for i, (xs, ws, strides, padding, dilation, groups) in enumerate(cases):
    kx, kw, kc = jax.random.split(jax.random.key(i), 3)
    x = jax.random.normal(kx, xs, jnp.float32)
    w = jax.random.normal(kw, ws, jnp.float32)
    def conv(lib, x, w):
        return lib.conv_general_dilated(x, w, strides, padding, rhs_dilation=dilation,
                                        feature_group_count=groups, dimension_numbers=DIMS)
    y, pullback = jax.vjp(jax.jit(lambda x, w: conv(jaxdnn, x, w)), x, w)
    ct = jax.random.normal(kc, y.shape, jnp.float32)
    want, want_pullback = jax.vjp(lambda x, w: conv(lax, x, w), x.astype(jnp.float64), w.astype(jnp.float64))
    for got, ref in zip((y, *pullback(ct)), (want, *want_pullback(ct.astype(jnp.float64)))):
        got, ref = np.asarray(got, np.float64), np.asarray(ref)
        errors.append(float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))
print(json.dumps({"isa": jaxdnn.cpu_isa(), "errors": errors}))
"""


@pytest.mark.parametrize("cap", ISA_ORDER)
def test_cpu_kernel_builds(cap):
    report = isa_child_report(_ISA_CHILD, cap)
    assert len(report["errors"]) == 18
    forward, grads = report["errors"][0::3], report["errors"][1::3] + report["errors"][2::3]
    assert max(forward) < tolerance(jnp.float32), report
    assert max(grads) < tolerance(jnp.float32, grad=True), report
