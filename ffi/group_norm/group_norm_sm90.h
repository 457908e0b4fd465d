// The group norm forward and backward of GPUs with TMA and clusters (compute capability >= 9) for
// problems whose items fit in shared memory (group_norm_sm90.cu): x (and dy) are read from HBM once,
// where group_norm.cu's kernels read them twice. group_norm.cu's handlers try them first and keep
// their own kernels for the problems they do not take.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "common/ffi_common.h"
#include "group_norm/group_norm_common.h"

namespace jaxdnn {

// y, mean and rstd as group_norm.cu's forward (with its activation), for 16-bit x where a cluster of
// 8 CTAs holds a sample's positions of a slab of 64 channels (C a multiple of 64, K dividing 64, 8 to
// 7168 positions) on a GPU of compute capability >= 9: x is read once. Returns nothing, launching
// nothing, for the problems it does not take (then the workspace is not written either way it is
// not read). On an H200 (2026-11-30, N16 64x64 C512 G32 bf16) it runs the forward in 0.049 ms, 0.058
// with silu, against the two-pass kernels' 0.067 and 0.068.
template <typename T>
std::optional<ffi::Error> ClusterForward(cudaStream_t stream, const GroupNormShape& shape, bool aligned, const T* x,
                                         Param<T> scale, Param<T> bias, float epsilon, int64_t activation,
                                         float activation_param, T* y, float* mean, float* rstd);

// dx as group_norm.cu's backward, with the group sums of g * xhat and g (g = d * scale) in
// group_sums[N, G, 2] and each sample's per-channel sums of d * xhat and d in the workspace's first
// N * 2 * C floats, as [N, 2, C] (the caller sums them over the samples into dscale and dbias).
// Returns nothing, launching nothing, unless it takes the problem on the current device: at least
// one position, a slab of whole groups (at most 256 channels) whose channels make a multiple of 16
// bytes, a slab's S positions in at most 136 KiB (4352 positions of 16 bf16 channels), `aligned`
// operands (16 bytes), and a GPU of compute capability >= 9.
template <typename T>
std::optional<ffi::Error> OnChipBackward(cudaStream_t stream, const GroupNormShape& shape, bool aligned, const T* dy,
                                         const T* x, Param<T> scale, Param<T> bias, const float* mean,
                                         const float* rstd, int64_t activation, float activation_param, T* dx,
                                         float* workspace, float* group_sums);

// The same as OnChipBackward for 16-bit x, each of a cluster's 8 CTAs holding its eighth of a
// sample's positions of a slab of whole groups, of x and dy (x and dy read once), for the problems
// OnChipBackward does not take whose two arrays and the reduction's scratch fit in 112 KiB a CTA.
// The slab is 64 channels where C is a multiple of 64 and K divides 64, else the widest multiple of 8
// channels and of K up to 64 that divides C (K = 10, 20, 40 of Stable Diffusion's 320, 640, 1280
// channels in 32 groups: 40 channels): up to 4912 positions of a 40-channel slab, 3072 of a
// 64-channel one. Returns nothing, launching nothing, otherwise. On an H200 (2026-11-30, N8 64x64
// C320 G32 bf16 with silu) the forward and backward take 0.083 ms with it, 0.091 with the two-pass
// backward.
template <typename T>
std::optional<ffi::Error> ClusterBackward(cudaStream_t stream, const GroupNormShape& shape, bool aligned, const T* dy,
                                          const T* x, Param<T> scale, Param<T> bias, const float* mean,
                                          const float* rstd, int64_t activation, float activation_param, T* dx,
                                          float* workspace, float* group_sums);

}  // namespace jaxdnn
