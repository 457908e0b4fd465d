// The halo kernels: every stage of 64-channel 3x3 convolutions (C = K = 64, stride 1, SAME padding: ResNet's)
// and of 64-channel 1x3, 1x5 and 1x7 ones (1-D convolutions along the rows), the wgrad of such layers with 64
// channels on one side and 128 on the other, and the wgrad of pointwise ones with 64 channels on one side, on
// Hopper's tensor cores, from strips of up to 64 pixels of the activations' rows staged in shared memory
// once, with their halo (halo_sm90.cu). CUTLASS's implicit GEMM re-reads each pixel from L2 for each tap;
// here a tap is an offset into the staged rows. Its wgrad has no split-K; here the CTAs split the pixels,
// each keeping its filter gradient block in registers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/ffi_common.h"
#include "conv/conv_geometry.h"

namespace jaxdnn {

// Whether the halo kernels take g with 16-bit operands of `dtype`: a 3x3 (SAME) or 1x3, 1x5, 1x7 window with
// unit strides and dilations, 64 -> 64 channels; for HaloWgrad also 64 -> 128 and 128 -> 64.
bool HaloApplies(const ConvGeometry& g, ffi::DataType dtype);
bool HaloWgradApplies(const ConvGeometry& g, ffi::DataType dtype);

// y [N, D, H, W, K] = act(conv(x, w) + bias + residual) for x [N, D, H, W, C] and w [R, S, C, K]
// (jaxdnn's layout; bias [K] or null, residual y's shape or null); no workspace.
ffi::Error HaloFprop(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* x, const void* w,
                     const void* bias, const void* residual, int64_t activation, float activation_param, void* y);

// dx [N, D, H, W, C] = the gradient of conv(x, w) w.r.t. x, from dy [N, D, H, W, K]; no workspace.
ffi::Error HaloDgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* dy, const void* w,
                     void* dx);

// Partial sums the wgrad launch writes: one per CTA (per slice of the pixels), a constant (not the
// device's SM count), so that their fixed-order sum, hence dw, has the same bits on every device; then
// added in this many groups of consecutive slices, and the groups in order.
constexpr int kHaloWgradSlices = 132;
constexpr int kHaloWgradGroups = 11;

// dw [R, S, C, K] = the gradient of conv(x, w) w.r.t. w, from x [N, D, H, W, C] and dy
// [N, D, H, W, K], dw in `dw_dtype` (the operands' or float32). The workspace holds kHaloWgradSlices
// + kHaloWgradGroups filter gradients in float32 (jaxdnn/_conv_kernels.py's _HALO_WGRAD_PARTIALS).
// With 128 channels on one side, half as many slices, each of two CTAs (a 64-channel half each).
ffi::Error HaloWgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* x, const void* dy,
                     float* workspace, ffi::DataType dw_dtype, void* dw);

// The same for a 1x1 window (a zero-width halo): dw [1, 1, C, K] of a pointwise convolution (unit
// strides, no padding) with 64 channels on one side (C or K) and 64, 128 or 256 on the other, from
// chunks of 64 pixels of x and dy staged once. Same workspace (filter gradients of C K floats).
bool PointwiseWgradApplies(const ConvGeometry& g, ffi::DataType dtype);
ffi::Error PointwiseWgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* x,
                          const void* dy, float* workspace, ffi::DataType dw_dtype, void* dw);

// A pointwise convolution's plain fprop with C = 64 (out = y, in = x) or dgrad with K = 64 (out = dx,
// in = dy), the other side 64, 128 or 256 channels: chunks of 64 pixels streamed through with w [1, 1,
// C, K] resident in shared memory; no workspace, no epilogue.
bool PointwiseProductApplies(const ConvGeometry& g, ffi::DataType dtype, bool dgrad);
ffi::Error PointwiseProduct(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* in,
                            const void* w, bool dgrad, void* out);

}  // namespace jaxdnn
