// The Hopper tensor-core convolutions (CUTLASS's implicit-GEMM kernels: TMA im2col loads feeding
// wgmma), as the CUDA handlers of conv.cu call them. Plain C++ (no CUTLASS): the kernels live in
// conv_sm90_{fprop,dgrad,wgrad}.cu.
//
// They take 2-D problems in CUTLASS's layouts: activations [N, H, W, C], outputs [N, P, Q, K] and
// filters [K, R, S, C] (channels innermost: conv.cu transposes jaxdnn's [R, S, C, K] filters to and
// from this layout in the targets' workspace result).
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
};

// The tensor-core form of g, when its kernels take g: 16-bit operands, one group, no lhs dilation,
// non-negative padding, C and K multiples of 8 (TMA's 16-byte rows), sizes within int32, and a 2-D
// problem: the depth axis must be trivial (window 1, stride 1, no padding), and is folded into N.
// dgrad also needs unit strides (CUTLASS's Hopper dgrad has no strided form).
enum class ConvStage { kFprop, kDgrad, kWgrad };
bool MakeConvSm90Problem(const ConvGeometry& g, ffi::DataType dtype, ConvStage stage, ConvSm90Problem* p);

// Each returns the launch's status, or nothing when CUTLASS's kernel cannot take the problem after
// all (its TMA im2col limits on padding and window offsets): the caller then runs another kernel.
// y = act(conv(x, w) + bias + residual): bias [K] or null, residual y's shape or null.
std::optional<ffi::Error> ConvSm90Fprop(const ConvSm90Problem& p, ffi::DataType dtype, const void* x,
                                        const void* w, const void* bias, const void* residual, int activation,
                                        float activation_param, void* y, cudaStream_t stream);
// dx = the transpose of fprop in x, applied to dy.
std::optional<ffi::Error> ConvSm90Dgrad(const ConvSm90Problem& p, ffi::DataType dtype, const void* dy,
                                        const void* w, void* dx, cudaStream_t stream);
// dw [K, R, S, C] = the gradient w.r.t. the filter, summed over the images and output pixels.
std::optional<ffi::Error> ConvSm90Wgrad(const ConvSm90Problem& p, ffi::DataType dtype, const void* x,
                                        const void* dy, void* dw, cudaStream_t stream);

}  // namespace jaxdnn
