// The halo wgrad (see wgrad_halo.h) on Hopper's tensor cores (wgmma, TMA).
//
// A CTA takes a contiguous range [first, end) of the image rows R = (n, d, h) and walks it in order.
// TMA stages every row of x and of dy once, through a ring of shared-memory stages: stage e holds x
// row first - 1 + e with one zero pixel before it (staged pixel p is x's pixel p - 1; pixels past W,
// and rows outside the array, zero) and dy row first + e - 2 (pixels past W zero). Output row
// R = first + i reads the x rows of stages i, i + 1, i + 2 (rows R - 1, R, R + 1) and the dy row of
// stage i + 2. Consumer warpgroup r (0..2) owns the taps (r, s), s = 0..2:
//   dW[k, r, s, c] += sum over pixels q of dy[R, q, k] x[R + r - 1, q + s - 1, c],
// a 64 x 64 product over the row's pixels (the reduction axis) with dy^T as A and the shifted x row
// as B, both MN-major from shared memory. The shift s is the B descriptor's start moved s 128-byte
// pixels into the staged row: the 128-byte swizzle is a function of the shared-memory address, so
// a descriptor starting on any pixel reads what TMA wrote there. A row R + r - 1 of another image
// (h + r - 1 outside [0, H)) is skipped. The float32 sums stay in registers (3 x 32 a thread) until
// the CTA's last row, then go to the CTA's partial sum; a second kernel adds the partial sums.
#include <cuda.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <type_traits>

#include "common/cuda_common.cuh"
#include "common/sm90_async.cuh"
#include "conv/wgrad_halo.h"

namespace jaxdnn {
namespace {

constexpr int kChannels = 64;                  // C = K
constexpr int kPixelBytes = kChannels * 2;     // one pixel's channels: one 128-byte swizzled row
constexpr int kDyPixels = 64;                  // a dy row, zero-padded to 4 steps of 16 pixels
constexpr int kXPixels = 72;                   // a staged x row: pixels -1 .. 70 (products read up to 64)
constexpr int kXBytes = kXPixels * kPixelBytes;
constexpr int kDyBytes = kDyPixels * kPixelBytes;
constexpr int kStageBytes = kXBytes + kDyBytes;  // 17 KB: every stage and part 1024-byte aligned
constexpr int kStages = 8;                     // the producer runs up to 5 rows ahead
constexpr int kConsumers = 3;                  // warpgroups: one per tap row r
constexpr int kThreads = kConsumers * 128 + 32;  // and one producer warp
constexpr int kSharedBytes = kStages * kStageBytes + 2 * kStages * 8 + 1024;  // + barriers, alignment
constexpr int kFilterCount = kChannels * 9 * kChannels;  // one partial sum [K, 3, 3, C]
constexpr int kGroupSlices = kHaloWgradSlices / kHaloWgradGroups;
static_assert(kGroupSlices * kHaloWgradGroups == kHaloWgradSlices, "groups of equal size");

struct Rows {
  int height, count;  // H, and the rows N D H
};

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    HaloWgradKernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap dy_map, Rows rows,
                    float* __restrict__ partial) {
  extern __shared__ uint8_t shared_raw[];
  uint8_t* shared = sm90::AlignedShared(shared_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(shared + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  const int first = int(int64_t(rows.count) * blockIdx.x / gridDim.x);
  const int count = int(int64_t(rows.count) * (blockIdx.x + 1) / gridDim.x) - first;
  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::BarrierInit(&full[s], 1);
      sm90::BarrierInit(&empty[s], kConsumers);
    }
    sm90::BarrierInitFence();
  }
  __syncthreads();

  if (warp == kConsumers * 4) {  // the producer
    if (threadIdx.x % 32 == 0 && count > 0) {
      for (int e = 0; e < count + 2; ++e) {
        const int stage = e % kStages;
        if (e >= kStages) sm90::BarrierWait(&empty[stage], (e / kStages - 1) & 1);
        uint8_t* at = shared + stage * kStageBytes;
        sm90::BarrierArriveExpectTx(&full[stage], kXBytes + (e >= 2 ? kDyBytes : 0));
        sm90::TmaLoad4d(at, &x_map, &full[stage], 0, -1, first - 1 + e, 0);
        if (e >= 2) sm90::TmaLoad4d(at + kXBytes, &dy_map, &full[stage], 0, 0, first + e - 2, 0);
      }
    }
    return;
  }

  const int r = warp / 4;
  float acc[3][32];
#pragma unroll
  for (int s = 0; s < 3; ++s) {
#pragma unroll
    for (int j = 0; j < 32; ++j) acc[s][j] = 0.f;
  }
  for (int i = 0; i < count; ++i) {
    if (i == 0) {
      sm90::BarrierWait(&full[0], 0);
      sm90::BarrierWait(&full[1], 0);
    }
    const int e = i + 2;
    sm90::BarrierWait(&full[e % kStages], (e / kStages) & 1);
    const int h = (first + i) % rows.height + r - 1;
    if (h >= 0 && h < rows.height) {
      const uint8_t* x_row = shared + (i + r) % kStages * kStageBytes;
      const uint8_t* dy_row = shared + e % kStages * kStageBytes + kXBytes;
      sm90::WgmmaFence();
#pragma unroll
      for (int step = 0; step < kDyPixels / 16; ++step) {  // whole rows: narrower ones multiply zeros
        const uint64_t a = sm90::DescriptorMNMajor(dy_row + step * 16 * kPixelBytes, 0);
#pragma unroll
        for (int s = 0; s < 3; ++s) {
          const uint64_t b = sm90::DescriptorMNMajor(x_row + (step * 16 + s) * kPixelBytes, 0);
          sm90::Wgmma<64, T>::template SS<1, 1>(acc[s], a, b, 1);
        }
      }
    }
    sm90::WgmmaCommit();
#pragma unroll
    for (int s = 0; s < 3; ++s) sm90::FenceRegisters(acc[s]);
    sm90::WgmmaWait<1>();  // row i - 1's products are done: its stage may be refilled
    if (i >= 1 && threadIdx.x % 128 == 0) sm90::BarrierArrive(&empty[(i - 1) % kStages]);
  }
  sm90::WgmmaWait<0>();
#pragma unroll
  for (int s = 0; s < 3; ++s) sm90::FenceRegisters(acc[s]);

  // partial[blockIdx.x] [K, 3, 3, C]; the accumulator's rows are filters k, its columns channels c.
  float* out = partial + int64_t(blockIdx.x) * kFilterCount;
  const int lane = threadIdx.x % 32, row = 16 * (warp % 4) + lane / 4, col = 2 * (lane % 4);
#pragma unroll
  for (int s = 0; s < 3; ++s) {
#pragma unroll
    for (int j = 0; j < 32; j += 2) {
      const int k = row + 8 * ((j >> 1) & 1), c = col + 8 * (j >> 2);
      *reinterpret_cast<float2*>(out + (k * 9 + r * 3 + s) * kChannels + c) = make_float2(acc[s][j], acc[s][j + 1]);
    }
  }
}

// sums[g] = the partial sums of slices [kGroupSlices g, kGroupSlices (g + 1)) added in order
// (deterministic), four values a thread, all of a group's loads in flight at once.
__global__ void __launch_bounds__(256)
    SumGroupsKernel(const float4* __restrict__ partial, float4* __restrict__ sums) {
  constexpr int kVectors = kFilterCount / 4;
  const int i = blockIdx.x * blockDim.x + threadIdx.x, group = blockIdx.y;
  if (i >= kVectors) return;
  float4 v[kGroupSlices];
#pragma unroll
  for (int s = 0; s < kGroupSlices; ++s) v[s] = partial[(group * kGroupSlices + s) * kVectors + i];
  float4 sum = v[0];
#pragma unroll
  for (int s = 1; s < kGroupSlices; ++s) sum = make_float4(sum.x + v[s].x, sum.y + v[s].y, sum.z + v[s].z, sum.w + v[s].w);
  sums[group * kVectors + i] = sum;
}

// The tensor map of an array of `rows` rows of `width` pixels of 64 16-bit channels whose box is
// one row of `box_pixels` pixels (the 128-byte swizzle; zeros outside the array).
CUresult MakeRowMap(CUtensorMap* map, const void* data, CUtensorMapDataType type, int rows, int width,
                    int box_pixels) {
  const cuuint64_t dims[4] = {cuuint64_t(kChannels), cuuint64_t(width), cuuint64_t(rows), 1};
  const cuuint64_t strides[3] = {cuuint64_t(kPixelBytes), cuuint64_t(width) * kPixelBytes,
                                 cuuint64_t(rows) * width * kPixelBytes};
  const cuuint32_t box[4] = {cuuint32_t(kChannels), cuuint32_t(box_pixels), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return cuTensorMapEncodeTiled(map, type, 4, const_cast<void*>(data), dims, strides, box, element_strides,
                                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

}  // namespace

bool HaloWgradApplies(const ConvGeometry& g, ffi::DataType dtype) {
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) return false;
  if (g.groups != 1 || g.channels != kChannels || g.filters != kChannels) return false;
  if (g.window[0] != 1 || g.pad[0] != 0 || g.stride[0] != 1 || g.in[0] != g.out[0]) return false;
  for (int a = 1; a < 3; ++a) {
    if (g.window[a] != 3 || g.stride[a] != 1 || g.pad[a] != 1 || g.lhs_dilation[a] != 1 || g.rhs_dilation[a] != 1 ||
        g.in[a] != g.out[a]) {
      return false;
    }
  }
  return g.in[2] <= kDyPixels && g.OutPixels() > 0 && g.batch * g.in[0] * g.in[1] < INT_MAX;
}

ffi::Error HaloWgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* x, const void* dy,
                     float* workspace) {
  const Rows rows{int(g.in[1]), int(g.batch * g.in[0] * g.in[1])};
  const int width = int(g.in[2]);
  const CUtensorMapDataType type =
      dtype == ffi::DataType::BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  CUtensorMap x_map, dy_map;
  if (MakeRowMap(&x_map, x, type, rows.count, width, kXPixels) != CUDA_SUCCESS ||
      MakeRowMap(&dy_map, dy, type, rows.count, width, kDyPixels) != CUDA_SUCCESS) {
    return ffi::Error(ffi::ErrorCode::kInternal, "jaxdnn: conv wgrad (halo): cannot encode a TMA descriptor");
  }
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    JAXDNN_RETURN_IF_ERROR(CudaError(
        cudaFuncSetAttribute(HaloWgradKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes),
        "conv wgrad (halo)"));
    HaloWgradKernel<T><<<kHaloWgradSlices, kThreads, kSharedBytes, stream>>>(x_map, dy_map, rows, workspace);
    return LaunchError("conv wgrad (halo)");
  };
  JAXDNN_RETURN_IF_ERROR(dtype == ffi::DataType::BF16 ? launch(__nv_bfloat16{}) : launch(__half{}));
  const dim3 grid((kFilterCount / 4 + 255) / 256, kHaloWgradGroups);
  SumGroupsKernel<<<grid, 256, 0, stream>>>(reinterpret_cast<const float4*>(workspace),
                                            reinterpret_cast<float4*>(workspace + kHaloWgradSlices * kFilterCount));
  return LaunchError("conv wgrad (halo) slice sums");
}

}  // namespace jaxdnn
