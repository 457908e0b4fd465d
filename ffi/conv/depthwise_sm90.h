// The square-window (3 x 3, 5 x 5, 7 x 7) depthwise kernels of GPUs with TMA (compute capability 9
// and later): input rows streamed into shared memory by the TMA unit through a ring of stages
// (depthwise_sm90.cu). Called by depthwise.cu's launchers for the problems RowsTake accepts; the other problems and GPUs keep
// depthwise.cu's kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "common/ffi_common.h"
#include "conv/conv_epilogue.h"
#include "conv/conv_geometry.h"

namespace jaxdnn {

// Whether the streaming kernels take g on the current device: 16-bit values (the caller's
// check), a 1 x k x k window (k = 3, 5 or 7) without dilation and with equal H and W strides of 1
// or 2, a trivial depth axis, m == 1, C a multiple of 8, 16-byte aligned operands (nullptr counts as aligned) and
// a GPU of compute capability >= 9.
bool RowsTake(const ConvGeometry& g, std::initializer_list<const void*> operands);

// out = epilogue(the k x k conv of `in` with w), or with the window reversed when `flip` (the
// unit-stride dgrad as a conv of dy on the flipped geometry; see depthwise.cu).
template <typename T>
ffi::Error RowsConv(cudaStream_t stream, const ConvGeometry& g, const T* in, const T* w, bool flip,
                    const ConvEpilogue<T>& epilogue, T* out);

// dw from x and dy: at most `max_slices` float32 partial gradients [slices, k * k, C] in `partial`
// (a function of g alone), or dw itself when one slice. Sets *slices to the count written; the
// caller adds them (cuda_common.cuh's SumSlicesKernel) when more than one.
template <typename T>
ffi::Error RowsWgrad(cudaStream_t stream, const ConvGeometry& g, const T* x, const T* dy, int64_t max_slices,
                     float* partial, T* dw, int64_t* slices);

}  // namespace jaxdnn
