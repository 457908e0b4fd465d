// CUDA softmax / log-softmax over the last axis.
//
// Forward: one group of threads per row (see common/row_reduce.cuh). Each thread takes the max of
// its elements and the sum of their exponentials relative to it; one reduction combines the
// (max, sum) pairs of the row (the online-softmax rule), and a second pass over the registers writes
// the output. Streaming rows (unaligned or too long for the registers) re-read x for that pass.
// Backward: one reduction (sum(dy * y), or sum(dy) for log-softmax) and one elementwise pass.
#include <cmath>

#include "common/cuda_common.cuh"
#include "common/row_reduce.cuh"
#include "softmax/softmax.h"
#include "softmax/softmax_common.h"

namespace jaxdnn {
namespace {

constexpr int kWarpRowsBlock = 256;

// A row's running maximum and the sum of exp(x - max) over the elements seen.
struct MaxSum {
  float max, sum;
};

__device__ __forceinline__ MaxSum Combine(MaxSum a, MaxSum b) {
  const float max = fmaxf(a.max, b.max);
  if (max == -INFINITY) return {max, 0.f};  // nothing but -inf so far
  return {max, a.sum * __expf(a.max - max) + b.sum * __expf(b.max - max)};
}

__device__ __forceinline__ MaxSum Add(MaxSum m, float v) {
  if (v <= m.max) return {m.max, m.sum + __expf(v - m.max)};
  return {v, m.sum * __expf(m.max - v) + 1.f};
}

template <bool kLog>
__device__ __forceinline__ float SoftmaxOut(float v, MaxSum row, float inv_sum, float log_sum) {
  return kLog ? v - row.max - log_sum : __expf(v - row.max) * inv_sum;
}

template <typename T, bool kLog>
__global__ void __launch_bounds__(kMaxGroup)
    SoftmaxFwdCached(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int features, int group) {
  constexpr int kVec = kVec16<T>;
  using Vec = Pack<T, kVec>;
  const RowGroup g = MakeRowGroup(group);
  if (group <= 32 && g.row >= rows) return;  // wider groups: the grid has exactly `rows` blocks
  const T* xr = x + g.row * features;
  Vec raw[kRowIters];
  MaxSum m = {-INFINITY, 0.f};
#pragma unroll
  for (int i = 0; i < kRowIters; ++i) {
    const int col = (i * group + g.lane) * kVec;
    if (col < features) raw[i] = *reinterpret_cast<const Vec*>(xr + col);
  }
  float local_max = -INFINITY;
#pragma unroll
  for (int i = 0; i < kRowIters; ++i) {
    if ((i * group + g.lane) * kVec < features) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) local_max = fmaxf(local_max, ToFloat(raw[i].v[k]));
    }
  }
  if (local_max > -INFINITY) {
    m.max = local_max;
#pragma unroll
    for (int i = 0; i < kRowIters; ++i) {
      if ((i * group + g.lane) * kVec < features) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) m.sum += __expf(ToFloat(raw[i].v[k]) - local_max);
      }
    }
  }
  const MaxSum row = GroupReduce(m, group, MaxSum{-INFINITY, 0.f}, Combine);
  const float inv_sum = 1.f / row.sum, log_sum = __logf(row.sum);
  T* yr = y + g.row * features;
#pragma unroll
  for (int i = 0; i < kRowIters; ++i) {
    const int col = (i * group + g.lane) * kVec;
    if (col < features) {
      Vec out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        out.v[k] = FromFloat<T>(SoftmaxOut<kLog>(ToFloat(raw[i].v[k]), row, inv_sum, log_sum));
      }
      *reinterpret_cast<Vec*>(yr + col) = out;
    }
  }
}

// One row per block, any length.
template <typename T, bool kLog>
__global__ void SoftmaxFwdStreaming(const T* __restrict__ x, T* __restrict__ y, int features) {
  const T* xr = x + int64_t(blockIdx.x) * features;
  MaxSum m = {-INFINITY, 0.f};
  for (int j = threadIdx.x; j < features; j += blockDim.x) m = Add(m, ToFloat(xr[j]));
  const MaxSum row = GroupReduce(m, blockDim.x, MaxSum{-INFINITY, 0.f}, Combine);
  const float inv_sum = 1.f / row.sum, log_sum = __logf(row.sum);
  T* yr = y + int64_t(blockIdx.x) * features;
  for (int j = threadIdx.x; j < features; j += blockDim.x) {
    yr[j] = FromFloat<T>(SoftmaxOut<kLog>(ToFloat(xr[j]), row, inv_sum, log_sum));
  }
}

template <bool kLog>
__device__ __forceinline__ float SoftmaxGrad(float dy, float y, float sum) {
  return kLog ? dy - __expf(y) * sum : y * (dy - sum);
}

template <typename T, bool kLog>
__global__ void __launch_bounds__(kMaxGroup) SoftmaxBwdCached(const T* __restrict__ dy,
                                                              const T* __restrict__ y, T* __restrict__ dx,
                                                              int64_t rows, int features, int group) {
  constexpr int kVec = kVec16<T>;
  using Vec = Pack<T, kVec>;
  const RowGroup g = MakeRowGroup(group);
  if (group <= 32 && g.row >= rows) return;
  const int64_t offset = g.row * features;
  Vec dys[kRowIters], ys[kRowIters];
#pragma unroll
  for (int i = 0; i < kRowIters; ++i) {
    const int col = (i * group + g.lane) * kVec;
    if (col < features) {
      dys[i] = *reinterpret_cast<const Vec*>(dy + offset + col);
      ys[i] = *reinterpret_cast<const Vec*>(y + offset + col);
    }
  }
  float sum[1] = {0.f};  // sum(dy * y), or sum(dy) for log-softmax
#pragma unroll
  for (int i = 0; i < kRowIters; ++i) {
    if ((i * group + g.lane) * kVec < features) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) sum[0] += ToFloat(dys[i].v[k]) * (kLog ? 1.f : ToFloat(ys[i].v[k]));
    }
  }
  GroupSum(sum, group);
#pragma unroll
  for (int i = 0; i < kRowIters; ++i) {
    const int col = (i * group + g.lane) * kVec;
    if (col < features) {
      Vec out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        out.v[k] = FromFloat<T>(SoftmaxGrad<kLog>(ToFloat(dys[i].v[k]), ToFloat(ys[i].v[k]), sum[0]));
      }
      *reinterpret_cast<Vec*>(dx + offset + col) = out;
    }
  }
}

template <typename T, bool kLog>
__global__ void SoftmaxBwdStreaming(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                                    int features) {
  const int64_t offset = int64_t(blockIdx.x) * features;
  float sum[1] = {0.f};
  for (int j = threadIdx.x; j < features; j += blockDim.x) {
    sum[0] += ToFloat(dy[offset + j]) * (kLog ? 1.f : ToFloat(y[offset + j]));
  }
  GroupSum(sum, blockDim.x);
  for (int j = threadIdx.x; j < features; j += blockDim.x) {
    dx[offset + j] = FromFloat<T>(SoftmaxGrad<kLog>(ToFloat(dy[offset + j]), ToFloat(y[offset + j]), sum[0]));
  }
}

template <bool kLog>
ffi::Error SoftmaxFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  RowsFeatures shape;
  JAXDNN_RETURN_IF_ERROR(CheckSoftmax({&x, &*y}, &shape));
  if (shape.rows == 0) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const RowPlan plan = MakeRowPlan<T>(shape.features, kWarpRowsBlock);
    const int64_t grid = RowGrid(plan, shape.rows);
    if (grid > 0x7fffffff) return InvalidArgument("softmax: too many rows for one launch");
    const T* xp = static_cast<const T*>(x.untyped_data());
    T* yp = static_cast<T*>(y->untyped_data());
    if (plan.cached) {
      SoftmaxFwdCached<T, kLog><<<grid, plan.block, 0, stream>>>(xp, yp, shape.rows, int(shape.features),
                                                                 plan.group);
    } else {
      SoftmaxFwdStreaming<T, kLog><<<grid, plan.block, 0, stream>>>(xp, yp, int(shape.features));
    }
    return LaunchError("softmax forward");
  });
}

template <bool kLog>
ffi::Error SoftmaxBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer y,
                          ffi::Result<ffi::AnyBuffer> dx) {
  RowsFeatures shape;
  JAXDNN_RETURN_IF_ERROR(CheckSoftmax({&dy, &y, &*dx}, &shape));
  if (shape.rows == 0) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(y.element_type(), "y", [&](auto tag) {
    using T = decltype(tag);
    const RowPlan plan = MakeRowPlan<T>(shape.features, kWarpRowsBlock);
    const int64_t grid = RowGrid(plan, shape.rows);
    if (grid > 0x7fffffff) return InvalidArgument("softmax: too many rows for one launch");
    const T* dyp = static_cast<const T*>(dy.untyped_data());
    const T* yp = static_cast<const T*>(y.untyped_data());
    T* dxp = static_cast<T*>(dx->untyped_data());
    if (plan.cached) {
      SoftmaxBwdCached<T, kLog><<<grid, plan.block, 0, stream>>>(dyp, yp, dxp, shape.rows,
                                                                 int(shape.features), plan.group);
    } else {
      SoftmaxBwdStreaming<T, kLog><<<grid, plan.block, 0, stream>>>(dyp, yp, dxp, int(shape.features));
    }
    return LaunchError("softmax backward");
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

namespace {
auto CudaBind() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxFwdCuda, jaxdnn::SoftmaxFwdImpl<false>, jaxdnn::BindSoftmaxFwd(CudaBind()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxBwdCuda, jaxdnn::SoftmaxBwdImpl<false>, jaxdnn::BindSoftmaxBwd(CudaBind()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LogSoftmaxFwdCuda, jaxdnn::SoftmaxFwdImpl<true>,
                              jaxdnn::BindSoftmaxFwd(CudaBind()), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LogSoftmaxBwdCuda, jaxdnn::SoftmaxBwdImpl<true>,
                              jaxdnn::BindSoftmaxBwd(CudaBind()), {ffi::Traits::kCmdBufferCompatible});
