// Grouped convolution on the tensor cores (grouped.cu): the convolutions of conv.h with 1 < G < C
// feature groups of as many filters as channels, Cg == Kg in {16, 32} (ResNeXt's grouped layers but
// the first two stages'), bf16 or f16 operands, unit strides, no lhs dilation, and a window on H and
// W alone (depth window 1, no depth padding: the depth folds into the batch) whose reach
// ((window - 1) * dilation) is at most 8 on each axis and with taps * Cg <= 640; any padding. Each
// group's product runs on its own (mma.sync tiles of the group's channels and filters): no zeros
// multiplied, where the blocks of jaxdnn/_conv_regroup.py (the path of the other grouped
// convolutions on a GPU) multiply block-diagonal filters, 8x the products for 16 channels a group.
// (64-channel groups ran slower here than as blocks, which multiply 2x there on the wgmma kernels.)
// float32 sums; deterministic (no atomics).
// Plain C++ declarations: conv.cu's handlers call them after MakeConvGeometry has checked the shapes.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <optional>

#include "common/ffi_common.h"
#include "conv/conv_geometry.h"

namespace jaxdnn {

// True when these kernels take g with operands of `dtype` (the conditions above). jaxdnn/_conv_kernels.py's
// _grouped_kernel_takes has a copy: the problems it sends here rather than to the blocks.
bool GroupedApplies(const ConvGeometry& g, ffi::DataType dtype);

// y = act(conv(x, w) + bias + residual); bias [K] or nullptr, residual y's shape or nullptr;
// activation an Activation (common/activation.h), 0 = identity.
ffi::Error GroupedFprop(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* x,
                        const void* w, const void* bias, const void* residual, int64_t activation,
                        float activation_param, void* y);

// dx from dy, as the forward of dy with the filter flipped and each group's channels and filters
// swapped (written into `workspace`, T*U*V*Cg*K elements of dy's dtype); nullopt when the workspace
// is smaller.
std::optional<ffi::Error> GroupedDgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype,
                                       const void* dy, const void* w, void* workspace, size_t workspace_bytes,
                                       void* dx);

// The wgrad's slices of the output pixels, a function of g alone (the same bits on every device):
// about one wave of blocks. Each slice's float32 partial dw goes to the workspace, then they are
// added in order. jaxdnn/_conv_kernels.py's _grouped_wgrad_slices has a copy (it sizes the workspace).
int64_t GroupedWgradSlices(const ConvGeometry& g);

// dw [T, U, V, Cg, K] (dw_dtype: x's, or float32) from x and dy, in as many slices as the
// workspace holds, up to GroupedWgradSlices(g); nullopt when it holds none.
std::optional<ffi::Error> GroupedWgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype,
                                       const void* x, const void* dy, ffi::DataType dw_dtype, void* workspace,
                                       size_t workspace_bytes, void* dw);

}  // namespace jaxdnn
