// The filter gradient of ResNet's 64-channel 3x3 convolutions (C = K = 64, stride 1, SAME padding,
// rows of at most 64 pixels) from rows of x and dy staged once, x with its halo (wgrad_halo.cu):
// CUTLASS's implicit-GEMM wgrad re-reads x from L2 for each of the 9 taps.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/ffi_common.h"
#include "conv/conv_geometry.h"

namespace jaxdnn {

// Partial sums a launch writes: one per CTA, a constant (not the device's SM count), so that their
// fixed-order sum, hence dw, has the same bits on every device; then added in this many groups of
// consecutive slices. The workspace holds kHaloWgradSlices + kHaloWgradGroups filter gradients
// [K, 3, 3, C] in float32 (jaxdnn/_conv_kernels.py's _HALO_WGRAD_PARTIALS).
constexpr int kHaloWgradSlices = 132;
constexpr int kHaloWgradGroups = 11;

// Whether the halo kernel takes g with 16-bit operands of `dtype` (on Hopper).
bool HaloWgradApplies(const ConvGeometry& g, ffi::DataType dtype);

// workspace[kHaloWgradSlices + j] [K, R, S, C] (float32), j < kHaloWgradGroups: the filter gradient
// of x [N, D, H, W, C] and dy [N, D, H, W, K] as kHaloWgradGroups partial sums, to be added in order.
ffi::Error HaloWgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* x, const void* dy,
                     float* workspace);

}  // namespace jaxdnn
