// The CPU's depthwise convolution (groups == C == K: one channel a group, multiplier 1), direct
// rather than through conv_cpu.cc's im2col and matmul, whose one-column products per group would
// fill a 16-wide register tile with one useful value. Any window, stride, dilation and padding; 1-D,
// 2-D and 3-D (conv_geometry.h's grid). Called by conv_cpu.cc for the problems TakesDepthwiseCpu
// accepts.
#pragma once

#include "common/ffi_common.h"
#include "common/half_cpu.h"
#include "conv/conv_epilogue.h"
#include "conv/conv_geometry.h"

namespace jaxdnn {

// Whether the direct kernels take g: one channel a group, as many filters as channels, no lhs
// dilation (a transposed convolution keeps the general path).
bool TakesDepthwiseCpu(const ConvGeometry& g);

// y = epilogue(the depthwise conv of x with w [taps, C]).
template <typename T>
void DepthwiseFpropCpu(ffi::ThreadPool& pool, const ConvGeometry& g, const T* x, const T* w,
                       const ConvEpilogue<T>& epilogue, T* y);

// dx from dy and w.
template <typename T>
void DepthwiseDgradCpu(ffi::ThreadPool& pool, const ConvGeometry& g, const T* dy, const T* w, T* dx);

// dw [taps, C] from x and dy, in D (T, or float32 for 16-bit T), summed in slices that depend on the
// problem alone (the same bits for any number of threads).
template <typename T, typename D>
void DepthwiseWgradCpu(ffi::ThreadPool& pool, const ConvGeometry& g, const T* x, const T* dy, D* dw);

}  // namespace jaxdnn
