// Depthwise convolution on CUDA (depthwise.cu): the convolutions of conv.h whose every group has one
// input channel (groups == C, Cg == 1), so output feature k = c * m + j (j < m, the channel
// multiplier m = K / C, usually 1) reads input channel c = k / m alone:
//   y[n, o, k] = sum over taps t of x[n, o * stride + t * rhs_dilation - pad, k / m] * w[t, 0, k]
// on conv.h's layout: x [N, D, H, W, C], w [T, U, V, 1, K], y [N, P, Q, R, K]. A grouped GEMM with
// one input channel per group would do a single multiply-add per loaded value: these kernels are
// memory-bound and run at DRAM speed instead (depthwise.cu says how).
// Plain C++ declarations: conv.cu's handlers call them after MakeConvGeometry has checked the
// shapes. All operands share one dtype (float32, bfloat16, float16); every stage accumulates in
// float32 and its results are deterministic (no atomics).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/ffi_common.h"
#include "conv/conv_geometry.h"

namespace jaxdnn {

// True when g is a depthwise conv this kernel takes: groups == channels (Cg == 1), lhs_dilation 1 on
// every axis.
bool IsDepthwise(const ConvGeometry& g);

// y = act(conv(x, w) + bias + residual); bias [K] or nullptr, residual y's shape or nullptr;
// activation an Activation (common/activation.h), 0 = identity.
ffi::Error DepthwiseFprop(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* x,
                          const void* w, const void* bias, const void* residual, int64_t activation,
                          float activation_param, void* y);

// dx [N, D, H, W, C] = the gradient w.r.t. x for dy [N, P, Q, R, K].
ffi::Error DepthwiseDgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* dy,
                          const void* w, void* dx);

// dw [T, U, V, 1, K] = the gradient w.r.t. w, summed over N and the output pixels. The reduction is
// split into slices (float32 partial gradients in `workspace`, added in a fixed order): as many as
// the workspace holds, up to a bound of g's. The caller sizes it (the wgrad target's last result,
// by jaxdnn/_conv_kernels.py's copy of that bound): a function of g alone, so the result has the
// same bits on every run and every device of a kind (GPUs with TMA take depthwise_sm90.cu's
// kernels, which add in another order than the others).
ffi::Error DepthwiseWgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* x,
                          const void* dy, void* workspace, size_t workspace_bytes, void* dw);

}  // namespace jaxdnn
