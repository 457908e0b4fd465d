// CUDA activations: a grid-stride elementwise kernel per (activation, dtype) with 16-byte accesses;
// the last n % 8 (or % 4) elements are handled one by one by the first threads. The backward with
// the bias gradient runs over rows of C instead (a block per tile of columns and chunk of rows).
#include <algorithm>
#include <type_traits>

#include "activation/activation.h"
#include "activation/activation_common.h"
#include "common/cuda_common.cuh"

namespace jaxdnn {
namespace {

constexpr int kBlock = 256;
constexpr int64_t kMaxBlocks = 1 << 16;

template <typename T, Activation kAct>
__global__ void ActivationFwdKernel(const T* __restrict__ x, T* __restrict__ y, int64_t n, float param) {
  constexpr int kVec = kVec16<T>;
  using Vec = Pack<T, kVec>;
  const int64_t packs = n / kVec;
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = start; i < packs; i += stride) {
    const Vec v = reinterpret_cast<const Vec*>(x)[i];
    Vec out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) out.v[k] = FromFloat<T>(Activate<kAct>(ToFloat(v.v[k]), param));
    reinterpret_cast<Vec*>(y)[i] = out;
  }
  const int64_t tail = packs * kVec + start;
  if (tail < n) y[tail] = FromFloat<T>(Activate<kAct>(ToFloat(x[tail]), param));
}

template <typename T, Activation kAct>
__global__ void ActivationBwdKernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx,
                                    int64_t n, float param) {
  constexpr int kVec = kVec16<T>;
  using Vec = Pack<T, kVec>;
  const int64_t packs = n / kVec;
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = start; i < packs; i += stride) {
    const Vec g = reinterpret_cast<const Vec*>(dy)[i], v = reinterpret_cast<const Vec*>(x)[i];
    Vec out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      out.v[k] = FromFloat<T>(ToFloat(g.v[k]) * ActivateGrad<kAct>(ToFloat(v.v[k]), param));
    }
    reinterpret_cast<Vec*>(dx)[i] = out;
  }
  const int64_t tail = packs * kVec + start;
  if (tail < n) dx[tail] = FromFloat<T>(ToFloat(dy[tail]) * ActivateGrad<kAct>(ToFloat(x[tail]), param));
}

// dx = dy f'(x) over rows of C (kV of them a pack: kV divides C), and the column sums of dx's
// rounded values over chunk blockIdx.y of the rows into partials[blockIdx.y]. A block takes
// tile_packs packs of columns (blockIdx.x) and its threads' row lanes stride over the chunk's rows;
// the lanes' sums are then added in lane order, so the result does not depend on timing.
template <typename T, int kV, Activation kAct>
__global__ void __launch_bounds__(kBlock)
    ActivationBwdBiasKernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx,
                            float* __restrict__ partials, int64_t rows, int64_t cols, int tile_packs, float param) {
  using Vec = Pack<T, kV>;
  __shared__ float lane_sums[kBlock * kV];
  const int64_t packs = cols / kV;
  const int lane = threadIdx.x % tile_packs, row_lane = threadIdx.x / tile_packs, row_lanes = kBlock / tile_packs;
  const int64_t pack = int64_t(blockIdx.x) * tile_packs + lane;
  const bool active = row_lane < row_lanes && pack < packs;
  const int64_t chunk = blockIdx.y, chunks = gridDim.y;
  const int64_t row_end = rows * (chunk + 1) / chunks;
  float sum[kV] = {};
  if (active) {
    for (int64_t r = rows * chunk / chunks + row_lane; r < row_end; r += row_lanes) {
      const int64_t i = r * packs + pack;
      const Vec g = reinterpret_cast<const Vec*>(dy)[i], v = reinterpret_cast<const Vec*>(x)[i];
      Vec out;
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        out.v[k] = FromFloat<T>(ToFloat(g.v[k]) * ActivateGrad<kAct>(ToFloat(v.v[k]), param));
        sum[k] += ToFloat(out.v[k]);
      }
      reinterpret_cast<Vec*>(dx)[i] = out;
    }
  }
  if (row_lane < row_lanes) {
#pragma unroll
    for (int k = 0; k < kV; ++k) lane_sums[threadIdx.x * kV + k] = sum[k];
  }
  __syncthreads();
  if (row_lane == 0 && pack < packs) {
    for (int l = 1; l < row_lanes; ++l) {
#pragma unroll
      for (int k = 0; k < kV; ++k) sum[k] += lane_sums[(l * tile_packs + lane) * kV + k];
    }
#pragma unroll
    for (int k = 0; k < kV; ++k) partials[chunk * cols + pack * kV + k] = sum[k];
  }
}

// Enough blocks for one pack a thread, at most kMaxBlocks (the kernels stride over the rest).
template <typename T>
int64_t Blocks(int64_t n) {
  return std::max<int64_t>(1, std::min(kMaxBlocks, (n / kVec16<T> + kBlock - 1) / kBlock));
}

ffi::Error ActivationFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                             int64_t kind, float param) {
  int64_t n = 0;
  JAXDNN_RETURN_IF_ERROR(CheckActivation({&x, &*y}, kind, &n));
  if (n == 0) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    DispatchActivation(kind, [&](auto act) {
      ActivationFwdKernel<T, decltype(act)::value><<<Blocks<T>(n), kBlock, 0, stream>>>(
          static_cast<const T*>(x.untyped_data()), static_cast<T*>(y->untyped_data()), n, param);
    });
    return LaunchError("activation forward");
  });
}

ffi::Error ActivationBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                             ffi::Result<ffi::AnyBuffer> dx, int64_t kind, float param) {
  int64_t n = 0;
  JAXDNN_RETURN_IF_ERROR(CheckActivation({&dy, &x, &*dx}, kind, &n));
  if (n == 0) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    DispatchActivation(kind, [&](auto act) {
      ActivationBwdKernel<T, decltype(act)::value><<<Blocks<T>(n), kBlock, 0, stream>>>(
          static_cast<const T*>(dy.untyped_data()), static_cast<const T*>(x.untyped_data()),
          static_cast<T*>(dx->untyped_data()), n, param);
    });
    return LaunchError("activation backward");
  });
}

ffi::Error ActivationBwdBiasImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                                 ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::Buffer<ffi::F32>> partials,
                                 int64_t kind, float param) {
  RowsFeatures shape;
  int64_t chunks = 0;
  JAXDNN_RETURN_IF_ERROR(CheckActivationBias(dy, x, *dx, *partials, kind, &shape, &chunks));
  if (shape.features == 0) return ffi::Error::Success();
  if (chunks > 65535) return InvalidArgument("activation: at most 65535 chunks of rows");
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    // 16-byte packs where they tile the rows, else one value a lane.
    auto launch = [&](auto vec) {
      constexpr int kV = decltype(vec)::value;
      const int64_t packs = shape.features / kV;
      const int tile_packs = int(std::min<int64_t>(packs, kBlock));
      const dim3 grid(unsigned((packs + tile_packs - 1) / tile_packs), unsigned(chunks));
      DispatchActivation(kind, [&](auto act) {
        ActivationBwdBiasKernel<T, kV, decltype(act)::value><<<grid, kBlock, 0, stream>>>(
            static_cast<const T*>(dy.untyped_data()), static_cast<const T*>(x.untyped_data()),
            static_cast<T*>(dx->untyped_data()), partials->typed_data(), shape.rows, shape.features, tile_packs,
            param);
      });
    };
    if (shape.features % kVec16<T> == 0) {
      launch(std::integral_constant<int, kVec16<T>>());
    } else {
      launch(std::integral_constant<int, 1>());
    }
    return LaunchError("activation backward with the bias gradient");
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(ActivationFwdCuda, jaxdnn::ActivationFwdImpl,
                              jaxdnn::BindActivationFwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(ActivationBwdCuda, jaxdnn::ActivationBwdImpl,
                              jaxdnn::BindActivationBwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(ActivationBwdBiasCuda, jaxdnn::ActivationBwdBiasImpl,
                              jaxdnn::BindActivationBwdBias(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
