"""The convolution's kernel stages as JAX primitives, and their differentiation.

Canonical layout (ffi/conv/conv.h), batch first and channels last, 3-D:
  x [N, D, H, W, C]  *  w [T, U, V, Cg, K]  ->  y [N, P, Q, R, K]
with G feature groups (C = G * Cg, K = G * Kg). Stages: fprop, dgrad (w.r.t. x) and wgrad (w.r.t. w),
bilinear, each one's VJP made of the other two, so every order of reverse-mode derivatives runs on
the kernels; and the fused forward act(fprop(x, w) + bias + residual).

float32 with TF32 allowed (`Conv.tf32`, from `precision`): the GPU's forward multiplies on the
tensor cores as TF32; wgmma reads TF32 operands K-major only, which in these layouts the forward's
are and the backward stages' are not, so the backward runs as other products: dgrad as the forward
of dy with the flipped filter, its channels and filters swapped (`_dgrad_as_fprop`; strided windows
first through the space-to-depth form as the 16-bit dgrad, 1-wide strided windows on the input's
strided subgrid; exact float32 sums of the same values on the CPU, so the CPU tests check these);
wgrad, on a GPU only, of a window of several taps on at least 32 channels as 16-bit wgrads of x's
and dy's bfloat16 parts, hi + lo, with float32 sums (`_wgrad_in_bfloat16_parts`: each product's
error about 2^-16, where TF32's is 2^-10), other wgrads as dense's GEMM of XLA's im2col patches of x
with dy (`_wgrad_by_gemm`: for pointwise windows x itself). The CPU runs its exact float32 wgrad
stage instead (float32 fwd+bwd of ResNet-50's layers at N 2 1.7-4.0x faster than on the GEMM there;
tests call the two rewrites directly).

Grouped convolutions (not depthwise) and 3-D windows whose products may run on the tensor cores run
each stage as the same stage of convolutions of one group and a 2-D window (`_rewrite`,
jaxdnn/_conv_regroup.py), except the 16-bit grouped ones that ffi/conv/grouped.cu's kernels take as
they are (`_grouped_kernel_takes`: 16 or 32 channels and filters a group, unit strides).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdnn import _autotune, _ffi  # noqa: F401  (_ffi registers the FFI targets)
from jaxdnn import _conv_few_channels as few_channels
from jaxdnn import _conv_regroup as regroup
from jaxdnn._primitive import ffi_primitive, images_in_unit_axis, move_to_front, transpose_linear
from jaxdnn.activation import KIND_NAMES, _activation, backward_with_bias_grad, epilogue_attrs
from jaxdnn.dense import weight_gradient


@dataclasses.dataclass(frozen=True)
class Conv:
    """A convolution on the kernels' 3-D form (axes d, h, w); hashable, a static argument."""
    in_spatial: tuple[int, int, int]   # D H W
    out_spatial: tuple[int, int, int]  # P Q R
    window: tuple[int, int, int]       # T U V
    strides: tuple[int, int, int]
    pads: tuple[int, int, int]         # low padding (may be negative); the high one shows in P Q R
    lhs_dilation: tuple[int, int, int]
    rhs_dilation: tuple[int, int, int]
    groups: int
    tf32: bool = False  # float32 operands may be multiplied as TF32 on a GPU's tensor cores

    def attrs(self) -> dict:
        """The targets' attributes (int64, see ffi/conv/conv.h)."""
        values = {"in": self.in_spatial, "out": self.out_spatial, "window": self.window,
                  "stride": self.strides, "pad": self.pads, "lhs_dilation": self.lhs_dilation,
                  "rhs_dilation": self.rhs_dilation}
        attrs = {f"{name}_{axis}": np.int64(v[i])
                 for name, v in values.items() for i, axis in enumerate("dhw")}
        attrs["groups"] = np.int64(self.groups)
        attrs["tf32"] = np.int64(self.tf32)
        return attrs


def _spatial(attrs, prefix):
    return tuple(int(attrs[f"{prefix}_{axis}"]) for axis in "dhw")


def _conv_of(attrs) -> Conv:
    """The Conv whose attrs() a stage's attributes hold."""
    return Conv(in_spatial=_spatial(attrs, "in"), out_spatial=_spatial(attrs, "out"),
                window=_spatial(attrs, "window"), strides=_spatial(attrs, "stride"),
                pads=_spatial(attrs, "pad"), lhs_dilation=_spatial(attrs, "lhs_dilation"),
                rhs_dilation=_spatial(attrs, "rhs_dilation"), groups=int(attrs["groups"]),
                tf32=bool(int(attrs["tf32"])))


# --- the kernel stages ----------------------------------------------------------------------------

# The stages' last result, a workspace for the GPU's kernels. The tensor-core ones (ffi/conv/conv_sm90.cu)
# take 16-bit operands and one group: the filter in their layout [K, T, U, V, Cp], Cp the channels
# padded to a multiple of 8; x (dgrad: dx) with padded channels when C % 8 != 0; for dgrad with
# strides, dy with zeros between its pixels; for wgrad, float32 partial filter gradients of slices of
# the batch (CUTLASS's Hopper conv has no split-K; see _wgrad_slices), at most 16 (conv_sm90.h's
# kWgradMaxSlices: one launch's argument holds their parameters; a launch per slice cost more host time
# than it saved). The depthwise wgrad (ffi/conv/depthwise.cu, any dtype) splits its reduction the same
# way. Empty for everything else.
_SMS = 132
_MAX_WGRAD_SLICES = 16
# The wgrad cost model's constants, fitted to an H200's times (2026-11-26, ResNet-50's 3x3 layers): a 64 x
# 128 wgrad CTA's FLOP/s (one CTA an SM) and its fixed time (prologue, epilogue), and the rate at which
# a slice's float32 partial sums cost (written, read back, added).
_WGRAD_CTA_FLOPS = 4.2e12
_WGRAD_CTA_SECONDS = 2e-6
_PARTIAL_BYTES_PER_S = 2e12
# 64-channel 3x3 and 1x3 layers (ResNet's; 1-D ones), the wgrad of such layers with 128 channels on one
# side, and the wgrad of 1x1 ones with 64 channels on one side, take the halo kernels
# (ffi/conv/halo_sm90.h); their wgrad needs this many float32 filter gradients in its workspace
# (kHaloWgradSlices partial sums, kHaloWgradGroups sums of them).
_HALO_WGRAD_PARTIALS = 132 + 11


def _workspace(dtype, elements):
    return jax.core.ShapedArray((elements,), dtype)


def _on_tensor_cores(dtype, channels, attrs, forward=False):
    """Whether a stage may run on the tensor-core kernels: 16-bit operands, or float32 ones as TF32 in
    the forward when the tf32 attribute allows it; one group, not depthwise."""
    tf32 = forward and jnp.dtype(dtype) == jnp.float32 and int(attrs["tf32"])
    return ((jnp.dtype(dtype).itemsize == 2 or tf32) and int(attrs["groups"]) == 1
            and not _is_depthwise(channels, attrs))


def _is_depthwise(channels, attrs):
    """depthwise.h's IsDepthwise: one input channel per group, no lhs dilation."""
    return int(attrs["groups"]) == channels and _spatial(attrs, "lhs_dilation") == (1, 1, 1)


def _padded(channels):
    return -(-channels // 8) * 8


def _padded_filter(filter_shape):
    return math.prod(filter_shape[:3]) * _padded(filter_shape[3]) * filter_shape[4]


def _padded_input(input_shape):
    channels = input_shape[-1]
    return 0 if channels % 8 == 0 else math.prod(input_shape[:-1]) * _padded(channels)


def _wgrad_slices(batch, pixels, padded_filter, filters, tile_rows=64):
    """The tensor-core wgrad's number of batch slices: the one of least modeled time. The kernel runs
    (filters / tile_rows) x (R S Cp / 128) output tiles a slice, one CTA an SM (`_SMS`), in whole waves;
    a CTA takes its slice's share (ceil(batch / slices) of the images) of a whole-batch tile's FLOPs
    (2 tile_rows 128 pixels) at _WGRAD_CTA_FLOPS, plus _WGRAD_CTA_SECONDS; every slice adds its float32
    partial sums. More slices fill the SMs, or even out the last wave, at that price: e.g. 7 for 28x28
    128->128 3x3 (126 CTAs; 15 ran 270, 3 waves, the last nearly empty)."""
    if batch < 2 or pixels == 0 or filters == 0:
        return 1
    tiles = -(-filters // tile_rows) * -(-(padded_filter // filters) // 128)
    tile_seconds = 2 * tile_rows * 128 * pixels / _WGRAD_CTA_FLOPS

    def seconds(slices):
        waves = -(-tiles * slices // _SMS)
        cta = tile_seconds * -(-batch // slices) / batch + _WGRAD_CTA_SECONDS
        return waves * cta + slices * 8 * padded_filter / _PARTIAL_BYTES_PER_S

    return min(range(1, min(batch, _MAX_WGRAD_SLICES) + 1), key=seconds)


def _halo(stage, channels, filters, batch, attrs):
    """halo_sm90.cu's HaloApplies, for wgrad HaloWgradApplies (the dtype and the device checked
    elsewhere): one group of 64 channels to 64 filters (wgrad: or 128 on one side), a 3x3 window on
    (h, w) with SAME padding or one row of 3, 5 or 7 taps on w (a 1-D window along the rows, SAME),
    unit strides and dilations; the rows in strips of 64 pixels."""
    d, h, w = _spatial(attrs, "in")
    window = _spatial(attrs, "window")
    units = batch * d * h * -(-w // 64)
    limit = 2**31 - 1 - 128
    sizes = ((64, 64), (64, 128), (128, 64)) if stage == "wgrad" else ((64, 64),)
    windows = ((1, 3, 3), (1, 1, 3), (1, 1, 5), (1, 1, 7))
    return ((channels, filters) in sizes and int(attrs["groups"]) == 1 and window in windows
            and _spatial(attrs, "stride") == (1, 1, 1)
            and _spatial(attrs, "pad") == (0, window[1] // 2, window[2] // 2)
            and _spatial(attrs, "lhs_dilation") == (1, 1, 1) and _spatial(attrs, "rhs_dilation") == (1, 1, 1)
            and _spatial(attrs, "out") == (d, h, w) and 0 < w < limit and 0 < units < limit)


def _halo_pointwise(stage, channels, filters, batch, attrs):
    """halo_sm90.cu's PointwiseWgradApplies and PointwiseProductApplies (the dtype and the device
    checked elsewhere): one group, a 1x1 window with unit strides and no padding, 64 channels on one
    side (wgrad), or on the reduction's (fprop: C, dgrad: K), and 64, 128 or 256 on the other."""
    unit = (1, 1, 1)
    narrow, wide = {"wgrad": sorted((channels, filters)), "fprop": (channels, filters),
                    "dgrad": (filters, channels)}.get(stage, (0, 0))
    return (int(attrs["groups"]) == 1 and narrow == 64 and wide in (64, 128, 256)
            and _spatial(attrs, "window") == unit and _spatial(attrs, "stride") == unit
            and _spatial(attrs, "pad") == (0, 0, 0) and _spatial(attrs, "lhs_dilation") == unit
            and 0 < batch * math.prod(_spatial(attrs, "in")) < 2**31 - 65)


def _depthwise_wgrad_slices(batch, out_spatial, filters):
    """The bound of depthwise.cu's WgradSlices: about 3 blocks per SM of 128 features, each slice at
    least 32 strips of 4 output pixels of a row."""
    strips = batch * out_spatial[0] * out_spatial[1] * -(-out_spatial[2] // 4)
    return max(1, min(3 * _SMS // -(-filters // 128), strips // 32))


# grouped.cu's bounds: on the spatial sizes and pads its int coordinates take, on a window's reach
# ((window - 1) * dilation, per axis: a tile's halo), and on taps * Cg (the forward's filter, kept in
# shared memory).
_GROUPED_SIZE_LIMIT = 1 << 24
_GROUPED_MAX_REACH = 8
_GROUPED_MAX_FILTER_ROWS = 640


def _grouped_kernel_takes(dtype, conv, batch, channels, filters):
    """grouped.cu's GroupedApplies: 16-bit operands, 1 < G < C groups of 16 or 32 channels and as many
    filters, unit strides, no lhs dilation, no depth window or depth padding, windows reaching at
    most 8 pixels, nothing empty. Such convolutions run as they are (the blocks of _conv_regroup.py
    would multiply zeros)."""
    if jnp.dtype(dtype).itemsize != 2 or not 1 < conv.groups < channels:
        return False
    width, taps = channels // conv.groups, math.prod(conv.window)
    reach = max((k - 1) * d for k, d in zip(conv.window[1:], conv.rhs_dilation[1:]))
    sizes = (*conv.in_spatial[1:], *conv.out_spatial[1:], *map(abs, conv.pads[1:]), channels)
    return (width in (16, 32) and filters == channels and conv.strides == (1, 1, 1)
            and conv.lhs_dilation == (1, 1, 1) and conv.window[0] == 1 and conv.pads[0] == 0
            and reach <= _GROUPED_MAX_REACH and taps * width <= _GROUPED_MAX_FILTER_ROWS
            and min(batch, *conv.in_spatial, *conv.out_spatial) > 0 and max(sizes) <= _GROUPED_SIZE_LIMIT)


def _grouped_wgrad_slices(width, filters, taps, out_pixels):
    """grouped.cu's GroupedWgradSlices: at most one wave of blocks (each 64 features and up to 160 /
    width taps; _SMS SMs, two blocks each), each slice at least 64 pixels, at most 256 slices."""
    blocks = -(-filters // 64) * -(-taps // (160 // width))
    return max(1, min(2 * _SMS // blocks, -(-out_pixels // 64), 256))


# The `algorithm` attribute's kernels (ffi/conv/conv.h's ConvAlgorithm) that autotuning times.
_GEMM, _TILE_WIDE, _TILE_TALL, _TILE_SMALL, _HALO = 1, 2, 3, 4, 5
_IM2COL, _IM2COL_WIDE, _IM2COL_NARROW = 6, 7, 8  # tiles of 128, 256 and 64 output features


def _im2col(stage, channels, filters, attrs, tile):
    """im2col_sm90.cu's Im2colApplies (the dtype, the device and TMA's bounds checked elsewhere) for
    a tile of `tile` output features: the forward or a unit-stride dgrad of one group, a multiple of
    64 input channels (fprop: C, dgrad: K) and of `tile` output ones."""
    if stage not in ("fprop", "fused", "dgrad") or int(attrs["groups"]) != 1:
        return False
    into, out = (filters, channels) if stage == "dgrad" else (channels, filters)
    strides = _spatial(attrs, "stride")
    return into > 0 and into % 64 == 0 and out % tile == 0 and max(strides) <= (1 if stage == "dgrad" else 8)


def _candidates(stage, dtype, channels, filters, batch, attrs):
    """The algorithms a stage can run on (conv_sm90.cu's MakeProblem and conv.cu's PointwiseGemm
    conditions): none where the tensor cores cannot take it; the implicit-GEMM tiles; the GEMM for a
    pointwise stage (not the fused forward, whose epilogue the GEMM lacks); the halo kernels for the
    64-channel 3x3 layers and for 1x1 ones with 64 channels on one side (see _halo_pointwise)."""
    if not _on_tensor_cores(dtype, channels, attrs, forward=stage in ("fprop", "fused")) or filters % 8:
        return ()
    window, strides, pads = (_spatial(attrs, name) for name in ("window", "stride", "pad"))
    if window[0] != 1 or strides[0] != 1 or pads[0] != 0 or _spatial(attrs, "lhs_dilation") != (1, 1, 1):
        return ()
    tiles = (_TILE_WIDE, _TILE_TALL) + ((_TILE_SMALL,) if stage in ("fprop", "fused", "dgrad") else ())
    pointwise = window == (1, 1, 1) and strides == (1, 1, 1) and pads == (0, 0, 0)
    gemm = (_GEMM,) if stage != "fused" and pointwise and channels % 8 == 0 else ()
    sixteen_bit = jnp.dtype(dtype).itemsize == 2  # the halo and im2col kernels' only operands
    halo = sixteen_bit and (_halo(stage, channels, filters, batch, attrs)
                            or _halo_pointwise(stage, channels, filters, batch, attrs))
    im2col = tuple(a for a, tile in ((_IM2COL, 128), (_IM2COL_WIDE, 256), (_IM2COL_NARROW, 64))
                   if sixteen_bit and _im2col(stage, channels, filters, attrs, tile))
    return gemm + tiles + ((_HALO,) if halo else ()) + im2col


def _bind_tuned(prim, stage, operands, channels, filters, attrs):
    """prim's public result on operands, with the algorithm autotuning picks (0 when it is off)
    among the candidates of `stage` (a key of _candidates) for x's `channels` and `filters`."""
    candidates = _candidates(stage, operands[0].dtype, channels, filters, operands[0].shape[0], attrs)
    algorithm = _autotune.choose(prim, operands, attrs, candidates)
    return prim.bind(*operands, **attrs, algorithm=np.int64(algorithm))[0]


def _fprop_avals(x, w, **attrs):
    elements = 0
    if _on_tensor_cores(x.dtype, x.shape[-1], attrs, forward=True):
        elements = _padded_filter(w.shape) + _padded_input(x.shape)
    return [jax.core.ShapedArray((x.shape[0],) + _spatial(attrs, "out") + (w.shape[-1],), x.dtype),
            _workspace(x.dtype, elements)]


def _dgrad_avals(dy, w, **attrs):
    dx_shape = (dy.shape[0],) + _spatial(attrs, "in") + (int(attrs["groups"]) * w.shape[3],)
    elements = 0
    if _grouped_kernel_takes(dy.dtype, _conv_of(attrs), dy.shape[0], dx_shape[-1], dy.shape[-1]):
        elements = math.prod(w.shape)  # the flipped filter
    elif _on_tensor_cores(dy.dtype, dx_shape[-1], attrs):
        strides = _spatial(attrs, "stride")
        spread = 0
        if any(s > 1 for s in strides):
            spread_pixels = math.prod((o - 1) * s + 1 for o, s in zip(dy.shape[1:4], strides))
            spread = dy.shape[0] * spread_pixels * dy.shape[-1]
        elements = _padded_filter(w.shape) + spread + _padded_input(dx_shape)
    return [jax.core.ShapedArray(dx_shape, dy.dtype), _workspace(dy.dtype, elements)]


def _wgrad_avals(x, dy, *, float32_sums=0, **attrs):
    group_channels = x.shape[-1] // int(attrs["groups"])
    dw_shape = _spatial(attrs, "window") + (group_channels, dy.shape[-1])
    float32_bytes = 0
    extra = 0
    if _is_depthwise(x.shape[-1], attrs):
        slices = _depthwise_wgrad_slices(x.shape[0], dy.shape[1:4], dy.shape[-1])
        float32_bytes = 4 * slices * math.prod(dw_shape) if slices > 1 else 0
    elif _grouped_kernel_takes(x.dtype, _conv_of(attrs), x.shape[0], x.shape[-1], dy.shape[-1]):
        out_pixels = math.prod(dy.shape[:-1])
        slices = _grouped_wgrad_slices(group_channels, dy.shape[-1], math.prod(dw_shape[:3]), out_pixels)
        float32_bytes = 4 * slices * math.prod(dw_shape)
    elif _on_tensor_cores(x.dtype, x.shape[-1], attrs):
        padded_filter = _padded_filter(dw_shape)
        tile_rows = 128 if int(attrs.get("algorithm", 0)) == _TILE_WIDE else 64  # conv_sm90.cuh's Wgrad
        slices = _wgrad_slices(x.shape[0], math.prod(dy.shape[:-1]), padded_filter, dy.shape[-1], tile_rows)
        args = (x.shape[-1], dy.shape[-1], x.shape[0], attrs)
        halo = _halo("wgrad", *args) or _halo_pointwise("wgrad", *args)
        if int(attrs.get("algorithm", 0)) in (0, _HALO) and halo:
            slices = _HALO_WGRAD_PARTIALS
        float32_bytes = 4 * slices * padded_filter
        extra = _padded_input(x.shape)
    elements = -(-float32_bytes // jnp.dtype(x.dtype).itemsize) + extra
    dw_dtype = jnp.float32 if int(float32_sums) else x.dtype
    return [jax.core.ShapedArray(dw_shape, dw_dtype), _workspace(x.dtype, elements)]


def _fused_avals(x, w, bias, *residual, activation, activation_param, **attrs):
    return _fprop_avals(x, w, **attrs)


def stack_features(a, size):
    """[B, ..., F] -> [..., B * F]: the vmapped copies side by side as feature groups."""
    return jnp.moveaxis(a, 0, -2).reshape(a.shape[1:-1] + (size * a.shape[-1],))


def _unstack_features(a, size):
    """[..., B * F] -> [B, ..., F]: the inverse of stack_features."""
    return jnp.moveaxis(a.reshape(a.shape[:-1] + (size, a.shape[-1] // size)), -2, 0)


def _batch_rule(prim, args, dims, *, batch_major, **attrs):
    """Batching of a stage. When only its batch-major operands (indices `batch_major`: x, dy, the
    residual) are vmapped, the vmapped axis joins N. When x is shared and the convolution has one
    group (an ensemble of filters on one input), the copies' filters (wgrad: dy's features), biases
    and residuals side by side make one convolution with B times the filters, as lax's own batching
    does. Otherwise each vmapped copy becomes its own set of feature groups: the channels, filters,
    biases and outputs of the B copies side by side, B * G groups (unbatched operands are broadcast
    first). Both run through the stage's function (_STAGE_FUNCTIONS), so that the heuristics and the
    grouped rewrite (which takes groups to the tensor cores on a GPU) see the new problem. wgrad (no N
    in its result) never joins N."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    shared = all(d is None for i, d in enumerate(dims) if i not in batch_major)
    if batch_major and shared:
        ops = list(args)
        for i in batch_major:
            if i < len(ops):  # the fused stage's residual is optional
                a = move_to_front(ops[i], dims[i], size)
                ops[i] = a.reshape((-1,) + a.shape[2:])
        out = prim.bind(*ops, **attrs)[0]
        return [out.reshape((size, -1) + out.shape[1:])], [0]
    conv = _conv_of(attrs)
    if dims[0] is None and conv.groups == 1 and prim.name in _WIDENED_STAGES:
        stacked = zip(args[1:], dims[1:])
        ops = [args[0], *(stack_features(move_to_front(a, d, size), size) for a, d in stacked)]
    else:
        ops = [stack_features(move_to_front(a, d, size), size) for a, d in zip(args, dims)]
        conv = dataclasses.replace(conv, groups=size * conv.groups)
    return [_unstack_features(_STAGE_FUNCTIONS[prim.name](conv, attrs, *ops), size)], [0]


def _images_in_unit_axis(attrs, shapes):
    """The CPU's view of a 2-D or 1-D convolution's pixel arrays (images_in_unit_axis, in rank 5):
    [N..., 1, H, W, C] as [1, B, H, W, C], the images the kernels' D axis, and [N..., 1, 1, W, C] as
    [1, 1, B, W, C]. Without it (N 16, 56^2 64 -> 64 bf16) the 3x3 layer's gradient took 48 ms
    against 44-45."""
    conv = _conv_of(attrs)
    trivial = [conv.window[a] == conv.strides[a] == conv.lhs_dilation[a] == conv.rhs_dilation[a] == 1
               and conv.pads[a] == 0 and conv.in_spatial[a] == conv.out_spatial[a] == 1 for a in range(2)]
    return images_in_unit_axis(attrs, shapes, trivial, rank=5)


def _stage(name, result_avals, rule, batch_major, target=None, **kwargs):
    return ffi_primitive(f"jaxdnn_conv_{name}", f"jaxdnn_conv_{target or name}_v4",
                         result_avals=result_avals, sharding_rule=rule, scratch_results=1,
                         batch_rule=functools.partial(_batch_rule, batch_major=batch_major),
                         cpu_view=_images_in_unit_axis, **kwargs)


# `...` is N: a batch-sharded x or dy runs per shard; the filter is replicated and its gradient is
# summed over the shards. Every other axis has its own factor (their sizes differ between operands).
_fprop_stage = _stage("fprop", _fprop_avals, "... d h w c, t u v i k -> ... p q r o", (0,))
_dgrad_stage = _stage("dgrad", _dgrad_avals, "... p q r k, t u v i o -> ... d h w c", (0,))
# wgrad's host attribute float32_sums (1: dw in float32 for 16-bit operands, the sums unrounded)
# chooses its result's dtype, which tells the kernel.
_wgrad_stage = _stage("wgrad", _wgrad_avals, "... d h w c, ... p q r k -> t u v i o", (),
                      reduced_results=(0,), host_attrs=("float32_sums",))
# The fused forward, one primitive per arity: without / with the residual operand.
_fused_stage = {
    residual: _stage("fprop_fused" + ("_residual" if residual else ""), _fused_avals,
                     "... d h w c, t u v i k, o" + (", ... p q r o" if residual else "") + " -> ... p q r o",
                     (0, 3), target="fprop_fused")
    for residual in (False, True)}


# --- three bilinear stages, each differentiated by the other two ---------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fprop(x, w, conv):
    def direct(x, w):
        return _bind_tuned(_fprop_stage, "fprop", (x, w), x.shape[-1], w.shape[-1], conv.attrs())
    if rewrite := _rewrite(x.dtype, conv, x.shape, w.shape):
        def run(x, w):
            return rewrite.join_outputs([fprop(*ops) for ops in zip(rewrite.inputs(x), rewrite.filters(w),
                                                                     rewrite.convs)])
        return _gpu_only(run, direct, x, w)
    return direct(x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dgrad(dy, w, conv):
    channels = w.shape[3] * conv.groups
    x_shape = (dy.shape[0],) + conv.in_spatial + (channels,)

    def direct(dy, w):
        return _bind_tuned(_dgrad_stage, "dgrad", (dy, w), channels, w.shape[-1], conv.attrs())
    if rewrite := _rewrite(dy.dtype, conv, x_shape, w.shape):
        def run(dy, w):
            return rewrite.join_inputs([_dgrad(*ops) for ops in zip(rewrite.outputs(dy), rewrite.filters(w),
                                                                     rewrite.convs)])
        return _gpu_only(run, direct, dy, w)
    if _dgrad_by_blocks(dy.dtype, channels, conv):
        def by_blocks(dy, w):
            ws, unit = few_channels.filter_blocks(w, conv)
            to_blocks = functools.partial(few_channels.input_blocks, geometry=conv)
            return transpose_linear(to_blocks, x_shape, _dgrad(dy, ws, unit))
        # Where the windows are not whole multiples of the strides, the blocks multiply zeros too
        # (1.78x the products of a 3x3/2 layer's), which the CPU's own strided dgrad skips (ResNet's
        # 56^2 128 -> 128 3x3/2, bf16 N 2, 2-core development machine: 5.4 ms by blocks, 3.6 direct);
        # other windows (a transposed convolution's 2x2/2, 4x4/2) are one GEMM by blocks, faster there.
        if all(k % s == 0 for k, s in zip(conv.window, conv.strides)):
            return by_blocks(dy, w)
        return _gpu_only(by_blocks, direct, dy, w)
    if _tf32_rewrites(dy.dtype, channels, conv, (dy, w)):
        if conv.strides == (1, 1, 1):
            return _dgrad_as_fprop(dy, w, conv)
        if _strided_taps_are_single(conv):
            return _dgrad_on_subgrid(dy, w, conv)
    return direct(dy, w)


def _multiplies_on_tensor_cores(dtype, conv):
    """16-bit operands, or float32 ones that TF32 may multiply."""
    return jnp.dtype(dtype).itemsize == 2 or (jnp.dtype(dtype) == jnp.float32 and conv.tf32)


def _rewrite(dtype, conv, x_shape, w_shape):
    """The rewrite (jaxdnn/_conv_regroup.py) that runs a grouped convolution, or one with a depth
    window, as convolutions the tensor cores take, where its products may run there; else None (also
    for the grouped ones that ffi/conv/grouped.cu takes as they are). A GPU's form only: the callers
    run it through `_gpu_only`, the CPU's kernels taking groups and 3-D windows as they are."""
    if not _multiplies_on_tensor_cores(dtype, conv) or _grouped_kernel_takes(dtype, conv, x_shape[0],
                                                                             x_shape[-1], w_shape[-1]):
        return None
    return regroup.rewrite(x_shape, w_shape, conv)


def _gpu_only(run, direct, *operands):
    """run(*operands), a GPU's form of a stage, and direct(*operands), the stage's own kernel, on the
    CPU, unless regroup.BLOCKS_ON_CPU (which the tests set to check the GPU's algebra on the CPU)."""
    if regroup.BLOCKS_ON_CPU:
        return run(*operands)
    return jax.lax.platform_dependent(*operands, cpu=direct, default=run)


def _dgrad_by_blocks(dtype, channels, conv):
    """Whether dgrad runs as the unit-stride dgrad of the space-to-depth form of the convolution
    (_conv_few_channels.space_to_depth), then that form's transpose back to x (one copy of dx in
    XLA): 16-bit operands (or float32 ones as TF32), one group, h/w strides whose windows are at
    least as wide. On the tensor cores a strided dgrad otherwise multiplies dy with zeros inserted
    between its pixels (stride^2 the work, 4x for 3x3/2); the space-to-depth form does
    ceil(k / s)^2 s^2 / k^2 the work (1.78x)."""
    axes = zip(conv.window[1:], conv.strides[1:], conv.rhs_dilation[1:])
    strided = [(k, s, d) for k, s, d in axes if s > 1]
    return (_multiplies_on_tensor_cores(dtype, conv) and conv.groups == 1 and channels % 8 == 0
            and bool(strided) and conv.lhs_dilation == (1, 1, 1) and conv.window[0] == 1
            and conv.strides[0] == 1 and all(k >= s and d == 1 for k, s, d in strided))


def _tf32_rewrites(dtype, channels, conv, operands):
    """Whether a backward stage runs as other products (see the module docstring): float32 with TF32
    allowed, one group, no lhs dilation, not depthwise, no empty operand (the stages' own kernels
    write the zeros of an empty sum)."""
    return (jnp.dtype(dtype) == jnp.float32 and conv.tf32 and conv.groups == 1 and channels > 1
            and conv.lhs_dilation == (1, 1, 1) and all(math.prod(a.shape) > 0 for a in operands))


def _flipped_filter(w):
    """w [T, U, V, C, K] flipped on every window axis (tap t becomes T - 1 - t), its channels and
    filters swapped: [T, U, V, K, C], the filter that runs a convolution from its output side."""
    return jnp.flip(w, (0, 1, 2)).swapaxes(3, 4)


def _from_output_side(conv, **changes):
    """conv run from its output side with the flipped filter: input and output extents swapped, low
    padding (T - 1) * dilation - pad on each axis (and `changes`)."""
    pads = tuple((t - 1) * d - lo for t, d, lo in zip(conv.window, conv.rhs_dilation, conv.pads))
    return dataclasses.replace(conv, in_spatial=conv.out_spatial, out_spatial=conv.in_spatial, pads=pads,
                               **changes)


def _dgrad_as_fprop(dy, w, conv):
    """dgrad with unit strides as a forward: dx[i] = sum over taps t of dy[i + pad - t * dilation]
    w[t], which is dy convolved with the flipped filter under the flipped padding; its output is x's
    extent. A padding outside what the tensor-core kernels take sends it to the baseline forward
    (exact)."""
    return fprop(dy, _flipped_filter(w), _from_output_side(conv))


def runs_as_dgrad(conv):
    """Whether a convolution with lhs dilation (a transposed one) runs as `transposed_by_dgrad`: unit
    strides, one group."""
    return conv.lhs_dilation != (1, 1, 1) and conv.strides == (1, 1, 1) and conv.groups == 1


def transposed_by_dgrad(x, w, conv):
    """A transposed convolution (lhs dilation s, unit strides) as the dgrad of the strided one it
    transposes: y[o] = sum over taps t of x~[o + t * dilation - pad] w[t], x~ being x with s - 1 zeros
    between its pixels, is the dgrad with the flipped filter (`_flipped_filter`) of the convolution
    of stride s, the same dilation and the flipped padding from a y-sized input to an x-sized output.
    The dgrad's kernels (the space-to-depth form on the tensor cores where the window spans the
    stride) then run it, not the baseline forward over the zero-dilated input; its VJP is that
    convolution's forward and wgrad."""
    strided = _from_output_side(conv, strides=conv.lhs_dilation, lhs_dilation=(1, 1, 1))
    return _dgrad(x, _flipped_filter(w), strided)


def _strided_taps_are_single(conv):
    """Every strided axis has a 1-wide window and no low padding (a strided 1x1 convolution)."""
    return all(s == 1 or (t == 1 and lo == 0) for s, t, lo in zip(conv.strides, conv.window, conv.pads))


def _dgrad_on_subgrid(dy, w, conv):
    """dgrad of a convolution whose strided axes have 1-wide windows at offset 0: it reads x only on
    the subgrid of every stride-th pixel, so dx is the unit-stride dgrad on that subgrid (ceil(D / s)
    pixels an axis) with stride - 1 zeros inserted between its pixels (XLA's interior padding)."""
    sub_spatial = tuple(-(-i // s) for i, s in zip(conv.in_spatial, conv.strides))
    sub = dataclasses.replace(conv, in_spatial=sub_spatial, strides=(1, 1, 1))
    dx = _dgrad(dy, w, sub)
    spread = [(0, i - ((n - 1) * s + 1), s - 1)
              for i, n, s in zip(conv.in_spatial, sub_spatial, conv.strides)]
    return jax.lax.pad(dx, jnp.zeros((), dx.dtype), [(0, 0, 0)] + spread + [(0, 0, 0)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _wgrad(x, dy, conv):
    return _wgrad_value(x, dy, conv)


def _wgrad_value(x, dy, conv, float32_sums=False):
    """wgrad on the kernels: the stage, through the grouped rewrite where it applies, float32 at TF32
    as other products (the module docstring). float32_sums: 16-bit operands give a float32 dw."""
    w_shape = conv.window + (x.shape[-1] // conv.groups, dy.shape[-1])

    def direct(x, dy):
        attrs = dict(conv.attrs(), float32_sums=np.int64(float32_sums))
        return _bind_tuned(_wgrad_stage, "wgrad", (x, dy), x.shape[-1], dy.shape[-1], attrs)
    if rewrite := _rewrite(x.dtype, conv, x.shape, w_shape):
        def run(x, dy):
            return rewrite.join_filters([_wgrad_value(*ops, float32_sums) for ops in zip(
                rewrite.inputs(x), rewrite.outputs(dy), rewrite.convs)])
        return _gpu_only(run, direct, x, dy)
    if _tf32_rewrites(x.dtype, x.shape[-1], conv, (x, dy)):
        # Other products on a GPU only: the CPU's own float32 stage is exact, and faster than both.
        in_parts = _wgrad_in_parts(x.shape[-1], dy.shape[-1], conv)
        rewritten = functools.partial(_wgrad_in_bfloat16_parts if in_parts else _wgrad_by_gemm, conv=conv)
        return jax.lax.platform_dependent(x, dy, cpu=direct, default=rewritten)
    return direct(x, dy)


def _wgrad_in_parts(channels, filters, conv):
    """Whether a float32 wgrad at TF32 runs as `_wgrad_in_bfloat16_parts` on a GPU: a window of
    several taps and channel counts the tensor-core kernels take, at least 32 channels (with fewer
    the 16-bit wgrad's taps are too narrow for its tiles: the stem's space-to-depth form, 16 channels,
    ran fwd+bwd in 7.0 ms against the GEMM's 4.8 on an H200)."""
    return math.prod(conv.window) > 1 and channels >= 32 and channels % 8 == 0 and filters % 8 == 0


def _bfloat16_parts(a):
    """float32 a as hi + lo, both bfloat16: hi = a rounded to bfloat16's 8 bits (to nearest even),
    lo = a - hi rounded (a - hi - lo is within 2^-17 |a|). hi is rounded on a's bits: as
    a.astype(bfloat16).astype(float32), XLA's GPU compiler may drop the rounding (excess precision is
    allowed), which makes lo zero. A finite |a| that rounds past bfloat16's largest (3.39e38) gives an
    infinite hi and lo."""
    bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
    half = jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))
    hi = jax.lax.bitcast_convert_type((bits + half) & jnp.uint32(0xFFFF0000), jnp.float32)
    return hi.astype(jnp.bfloat16), (a - hi).astype(jnp.bfloat16)


def _wgrad_in_bfloat16_parts(x, dy, conv):
    """float32 wgrad as x_hi dy_lo + x_lo dy_hi + x_hi dy_hi: three 16-bit wgrads with float32 dw, on
    the tensor cores with operands of any major order, where TF32 takes K-major ones only. Each
    product is within about 2^-16 of x dy (the dropped x_lo dy_lo and the parts' rounding); a
    float32 inf in x or dy makes NaN (its lo part is inf - inf). Each wgrad has the layer's own shape
    (its heuristics' kernels: on an H200 the 56^2 64->64 layer's halo wgrad ran the three in 0.29 ms,
    where one of dy's parts side by side, 128 filters on the implicit GEMM, and one of 64 ran 0.55),
    but for fewer than 64 filters, which fill half a wgrad tile: there dy's parts side by side, one
    wgrad of 2K filters (the 3-D U-Net's 32: fwd+bwd 1.74 -> 1.45 ms)."""
    x_hi, x_lo = _bfloat16_parts(x)
    dy_hi, dy_lo = _bfloat16_parts(dy)
    def product(x, dy):
        return _wgrad_value(x, dy, conv, float32_sums=True)
    filters = dy.shape[-1]
    if filters < 64:
        with_hi = product(x_hi, jnp.concatenate([dy_hi, dy_lo], axis=-1))
        return (with_hi[..., filters:] + product(x_lo, dy_hi)) + with_hi[..., :filters]
    return (product(x_hi, dy_lo) + product(x_lo, dy_hi)) + product(x_hi, dy_hi)


def _wgrad_by_gemm(x, dy, conv):
    """dw = patches(x)^T . dy over every output pixel, on dense's GEMM with TF32 (its rows split into
    slices when the filter has few output tiles): the patches are XLA's im2col of x (each output
    pixel's window, taps * C values; for a pointwise convolution x itself), built for the call."""
    patches = few_channels.patches(x, conv)
    rows = math.prod(patches.shape[:-1])
    dw = weight_gradient(patches.reshape(1, rows, -1), dy.reshape(1, rows, -1), tf32=1)[0]
    channels = x.shape[-1]
    return dw[:math.prod(conv.window) * channels].reshape(conv.window + (channels, dy.shape[-1]))


def _fprop_bwd(conv, residuals, dy):
    x, w = residuals
    return _dgrad(dy, w, conv), _wgrad(x, dy, conv)


def _dgrad_bwd(conv, residuals, ddx):
    dy, w = residuals  # dgrad(dy, w) = fprop's transpose in x: <ddx, dgrad(dy, w)> = <fprop(ddx, w), dy>
    return fprop(ddx, w, conv), _wgrad(ddx, dy, conv)


def _wgrad_bwd(conv, residuals, ddw):
    x, dy = residuals  # <ddw, wgrad(x, dy)> = <fprop(x, ddw), dy>
    return _dgrad(dy, ddw, conv), fprop(x, ddw, conv)


fprop.defvjp(lambda x, w, conv: (fprop(x, w, conv), (x, w)), _fprop_bwd)
_dgrad.defvjp(lambda dy, w, conv: (_dgrad(dy, w, conv), (dy, w)), _dgrad_bwd)
_wgrad.defvjp(lambda x, dy, conv: (_wgrad(x, dy, conv), (x, dy)), _wgrad_bwd)


# --- the fused forward: act(fprop(x, w) + bias + residual) ----------------------------------------

@dataclasses.dataclass(frozen=True)
class Epilogue:
    """The fused forward's epilogue; hashable, a static argument."""
    kind: str       # a key of jaxdnn.activation.KINDS ("identity" for none)
    param: float    # the activation's parameter
    residual: bool  # whether a residual is added


def _fused_call(x, w, bias, residual, conv, kind, param):
    ops = (x, w, bias) + (() if residual is None else (residual,))
    attrs = dict(conv.attrs(), **epilogue_attrs(kind, param))
    return _bind_tuned(_fused_stage[residual is not None], "fused", ops, x.shape[-1], w.shape[-1], attrs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def fused(x, w, bias, residual, conv, epilogue):
    """act(conv(x, w) + bias + residual) in one kernel; bias [K] and residual (y's shape; None when
    not `epilogue.residual`) in x's dtype.

    Differentiation: the training forward writes z = conv + bias + residual from the same kernel
    (identity epilogue) and applies the activation with jaxdnn's activation kernel, keeping z for
    the backward: dz = act'(z) dy, dx = dgrad(dz, w), dw = wgrad(x, dz), dbias = sum of dz (with dz,
    from the activation's backward kernel), dresidual = dz. (So under differentiation y is act of z
    rounded to x's dtype, where the fused kernel applies act to the float32 sum: the two differ by
    that rounding.)"""
    def direct(x, w, bias, *residual):
        return _fused_call(x, w, bias, *(residual or (None,)), conv, epilogue.kind, epilogue.param)
    operands = (x, w, bias) + (() if residual is None else (residual,))
    if rewrite := _rewrite(x.dtype, conv, x.shape, w.shape):
        def run(x, w, bias, *residual):
            residuals = rewrite.outputs(*residual) if residual else [None] * len(rewrite.convs)
            return rewrite.join_outputs([fused(*ops, epilogue) for ops in zip(
                rewrite.inputs(x), rewrite.filters(w), rewrite.biases(bias), residuals, rewrite.convs)])
        return _gpu_only(run, direct, *operands)
    return direct(*operands)


def _fused_fwd(x, w, bias, residual, conv, epilogue):
    # z through `fused` itself (identity epilogue): differentiable, for the higher orders.
    z = fused(x, w, bias, residual, conv, dataclasses.replace(epilogue, kind="identity", param=0.0))
    y = z if epilogue.kind == "identity" else _activation(z, epilogue.kind, epilogue.param)
    return y, (x, w, z)


def _fused_bwd(conv, epilogue, residuals, dy):
    x, w, z = residuals
    if epilogue.kind == "identity":
        dz, dbias = dy, jnp.sum(dy, axis=tuple(range(dy.ndim - 1)), dtype=jnp.float32)
    else:
        dz, dbias = backward_with_bias_grad(dy, z, epilogue.kind, epilogue.param)  # one pass
    return _dgrad(dz, w, conv), _wgrad(x, dz, conv), dbias.astype(dz.dtype), dz if epilogue.residual else None


fused.defvjp(_fused_fwd, _fused_bwd)


def _fused_of(conv, attrs, x, w, bias, residual=None):
    """fused(...) with the epilogue a fused stage's attributes hold."""
    epilogue = Epilogue(KIND_NAMES[int(attrs["activation"])], float(attrs["activation_param"]),
                        residual is not None)
    return fused(x, w, bias, residual, conv, epilogue)


# Each stage primitive's function of (conv, attrs, *operands), for _batch_rule.
_STAGE_FUNCTIONS = {
    _fprop_stage.name: lambda conv, attrs, x, w: fprop(x, w, conv),
    _dgrad_stage.name: lambda conv, attrs, dy, w: _dgrad(dy, w, conv),
    _wgrad_stage.name: lambda conv, attrs, x, dy: _wgrad_value(x, dy, conv, bool(int(attrs["float32_sums"]))),
    **{stage.name: _fused_of for stage in _fused_stage.values()},
}
# The stages whose only operand on the input side is x (operand 0): copies on a shared x can widen them.
_WIDENED_STAGES = {_fprop_stage.name, _wgrad_stage.name, *(stage.name for stage in _fused_stage.values())}
