// Host-side helpers of the hand-written Hopper conv kernels (halo_sm90.cu, im2col_sm90.cu): their
// tiled TMA descriptors and the device check.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/ffi_common.h"

namespace jaxdnn {

// TMA's element type for 16-bit `dtype` (bfloat16 or float16).
inline CUtensorMapDataType TensorMapType(ffi::DataType dtype) {
  return dtype == ffi::DataType::BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

// The tensor map of an array [outermost][outer][inner][64] of 16-bit values (rows of 128 bytes: a
// pixel's 64 channels, or 64 filters of a filter row) whose box is [1][box_outer][box_inner][64] (the
// 128-byte swizzle; zeros outside the array): coordinates (0, inner, outer, outermost).
inline CUresult MakeChunkedMap(CUtensorMap* map, const void* data, ffi::DataType dtype, int64_t outer, int64_t inner,
                               int box_outer, int box_inner, int64_t outermost = 1) {
  constexpr int kChunk = 64, kChunkBytes = kChunk * 2;
  const cuuint64_t dims[4] = {cuuint64_t(kChunk), cuuint64_t(inner), cuuint64_t(outer), cuuint64_t(outermost)};
  const cuuint64_t strides[3] = {cuuint64_t(kChunkBytes), cuuint64_t(inner) * kChunkBytes,
                                 cuuint64_t(outer) * inner * kChunkBytes};
  const cuuint32_t box[4] = {cuuint32_t(kChunk), cuuint32_t(box_inner), cuuint32_t(box_outer), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return cuTensorMapEncodeTiled(map, TensorMapType(dtype), 4, const_cast<void*>(data), dims, strides, box, element_strides,
                                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// Whether the current device is a Hopper GPU (sm_90: wgmma and TMA).
inline bool IsHopper() {
  int device = 0, major = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major == 9;
}

}  // namespace jaxdnn
