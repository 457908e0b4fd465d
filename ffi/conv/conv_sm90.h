// The Hopper tensor-core convolutions (CUTLASS's implicit-GEMM kernels: TMA im2col loads feeding
// wgmma). Plain C++ (no CUTLASS). The kernels take 2-D problems in CUTLASS's layouts: activations
// [N, H, W, C], outputs [N, P, Q, K] and filters [K, R, S, C] (channels innermost); conv_sm90.cu
// moves jaxdnn's [R, S, C, K] filters to and from that layout.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "common/ffi_common.h"
#include "conv/conv_geometry.h"

namespace jaxdnn {

struct ConvSm90Problem {
  int n, h, w, c;  // the activation x (dx)
  int k, r, s;     // the filter
  int p, q;        // the output y (dy)
  int pad_lo[2], pad_hi[2], stride[2], dilation[2];  // (h, w)
  int64_t algorithm;  // the tile asked for: a ConvAlgorithm (conv.h); others get the heuristic's
};

// The CUTLASS kernels (conv_sm90_{fprop,dgrad,wgrad}.cu). Each returns the launch's status, or
// nothing when it cannot take the problem after all (its TMA im2col limits on padding and window
// offsets, or a dtype it lacks): the caller then runs another kernel.
// y = act(conv(x, w) + bias + residual): bias [K] or null, residual y's shape or null; bfloat16,
// float16, or float32 multiplied as TF32.
std::optional<ffi::Error> ConvSm90Fprop(const ConvSm90Problem& p, ffi::DataType dtype, const void* x,
                                        const void* w, const void* bias, const void* residual, int activation,
                                        float activation_param, void* y, cudaStream_t stream);
// dx = the transpose of fprop (unit strides) in x, applied to dy.
std::optional<ffi::Error> ConvSm90Dgrad(const ConvSm90Problem& p, ffi::DataType dtype, const void* dy,
                                        const void* w, void* dx, cudaStream_t stream);
// The gradient w.r.t. the filter in `slices` float32 partial sums, in one launch: partial[s]
// [K, R, S, C] sums images [n * s / slices, n * (s + 1) / slices) over their output pixels (CUTLASS's
// Hopper conv has no split-K). 1 <= slices <= min(n, kWgradMaxSlices); jaxdnn/_conv_kernels.py's
// _MAX_WGRAD_SLICES is the same bound.
constexpr int kWgradMaxSlices = 16;
std::optional<ffi::Error> ConvSm90Wgrad(const ConvSm90Problem& p, ffi::DataType dtype, const void* x,
                                        const void* dy, float* partial, int slices, cudaStream_t stream);

// The stages as conv.cu's handlers run them (conv_sm90.cu), on jaxdnn's layouts (conv.h) and with
// the targets' workspace. They take 2-D problems with 16-bit operands (the forward also float32 ones
// when `tf32`, multiplied as TF32), one group, no lhs dilation, non-negative padding, C and K
// multiples of 8 (TMA's 16-byte rows; channels padded to 8 otherwise) and sizes within int32; the
// depth axis must be trivial (window 1, stride 1, no padding) and is folded into N. Each returns the
// launch's status, or nothing when g (or a workspace too small for it) needs another kernel.
// `algorithm` (a ConvAlgorithm) picks the tile where it names one the stage has.
// Workspace (bytes): fprop the filter; dgrad the filter plus, for strides > 1, dy with zeros
// inserted between its pixels; wgrad float32 partial filter gradients, one per slice of the images.
std::optional<ffi::Error> TensorCoreFprop(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype,
                                          const void* x, const void* w, const void* bias, const void* residual,
                                          int64_t activation, float activation_param, void* y, void* workspace,
                                          size_t workspace_bytes, int64_t algorithm, bool tf32);
std::optional<ffi::Error> TensorCoreDgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype,
                                          const void* dy, const void* w, void* dx, void* workspace,
                                          size_t workspace_bytes, int64_t algorithm);
// wgrad's dw is `dw_dtype`: the operands' dtype, or float32 (the sums unrounded).
std::optional<ffi::Error> TensorCoreWgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype,
                                          const void* x, const void* dy, ffi::DataType dw_dtype, void* dw,
                                          void* workspace, size_t workspace_bytes, int64_t algorithm);

}  // namespace jaxdnn
