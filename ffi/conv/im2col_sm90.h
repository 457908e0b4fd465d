// The im2col kernels: the forward (with the fused epilogue) and the unit-stride backward-data
// convolution of 16-bit 2-D layers with a multiple of 64 input and output channels, as
// implicit GEMMs on Hopper's tensor cores written on sm90_async.cuh (im2col_sm90.cu). TMA's im2col
// mode gathers each tap's window pixels; two consumer warpgroups share a CTA's tile (CUTLASS's
// Hopper convolution runs one).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/ffi_common.h"
#include "conv/conv_geometry.h"

namespace jaxdnn {

// Output features a CTA tile of the im2col kernels spans: 128 (tiles of 256 positions, or of 128
// where that leaves fewer SMs idle in the last round), 256 (tiles of 128) or 64 (tiles of 256).
bool Im2colApplies(const ConvGeometry& g, ffi::DataType dtype, bool dgrad, int tile_features);

// The heuristic's tile for a problem the im2col kernels take (0 where they take none): 256 features
// unless a tile of 128 features (of 256 or 128 positions, whichever the same heuristic picks when
// it runs) costs at least 10% less, counting the rounds of tiles on the GPU's SMs (the last round
// runs whole however few tiles it has). Between tiles of the same outputs 256 features ran faster
// on an H200 (14x14 256 -> 256, 196 tiles either way: 0.0565 against 0.0586 ms; 7x7 512 -> 512:
// 0.0502 against 0.0533). Output channels that no tile of 128 features divides (an odd multiple of
// 64) take the tile of 64 where the window has more than one tap: VGG-16 conv2_1's dgrad (128 -> 64
// channels, 112x112) ran in 0.142 ms on it against 0.171 on CUTLASS's best tile (H200, autotuning's
// times, 2026-11-30).
int Im2colAutoTile(const ConvGeometry& g, ffi::DataType dtype, bool dgrad);

// y [N, D, H, W, K] = act(conv(x, w) + bias + residual) for x [N, D, H, W, C] and w [R, S, C, K]
// (jaxdnn's layout; bias [K] or null, residual y's shape or null); no workspace.
ffi::Error Im2colFprop(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, int tile_features,
                       const void* x, const void* w, const void* bias, const void* residual, int64_t activation,
                       float activation_param, void* y);

// dx [N, D, H, W, C] = the gradient of conv(x, w) w.r.t. x, from dy [N, D, P, Q, K] (unit strides);
// no workspace.
ffi::Error Im2colDgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, int tile_features,
                       const void* dy, const void* w, void* dx);

}  // namespace jaxdnn
