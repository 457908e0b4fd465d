// CUDA softmax / log-softmax over the last axis.
//
// Forward: one group of threads per row (see common/row_reduce.cuh). Each thread takes the max of
// its elements and the sum of their exponentials relative to it; one reduction combines the
// (max, sum) pairs of the row (the online-softmax rule), and a second pass over the registers writes
// the output. Streaming rows (unaligned or too long for the registers) re-read x for that pass,
// with 16-byte accesses when the row is a multiple of them.
// Backward: one reduction (sum(dy * y), or sum(dy) for log-softmax) and one elementwise pass.
#include <cmath>

#include "common/cuda_common.cuh"
#include "common/row_reduce.cuh"
#include "softmax/softmax.h"
#include "softmax/softmax_common.h"

namespace jaxdnn {
namespace {

// A row's running maximum and the sum of exp(x - max) over the elements seen.
struct MaxSum {
  float max, sum;
};

__device__ __forceinline__ MaxSum Combine(MaxSum a, MaxSum b) {
  const float max = fmaxf(a.max, b.max);
  if (max == -INFINITY) return {max, 0.f};  // nothing but -inf so far
  return {max, a.sum * __expf(a.max - max) + b.sum * __expf(b.max - max)};
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

// One row per block, any length: packs of kVec elements (kVec = 1 for rows that are not a multiple
// of a 16-byte vector). The second pass re-reads the row, mostly from L2.
template <typename T, bool kLog, int kVec>
__global__ void SoftmaxFwdStreaming(const T* __restrict__ x, T* __restrict__ y, int features) {
  using Vec = Pack<T, kVec>;
  const Vec* xr = reinterpret_cast<const Vec*>(x + int64_t(blockIdx.x) * features);
  const int packs = features / kVec;
  MaxSum m = {-INFINITY, 0.f};
  for (int j = threadIdx.x; j < packs; j += blockDim.x) {
    const Vec v = xr[j];
    MaxSum pack = {-INFINITY, 0.f};  // the pack's own (max, sum), then one combine
#pragma unroll
    for (int k = 0; k < kVec; ++k) pack.max = fmaxf(pack.max, ToFloat(v.v[k]));
    if (pack.max > -INFINITY) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) pack.sum += __expf(ToFloat(v.v[k]) - pack.max);
    }
    m = Combine(m, pack);
  }
  const MaxSum row = GroupReduce(m, blockDim.x, MaxSum{-INFINITY, 0.f}, Combine);
  const float inv_sum = 1.f / row.sum, log_sum = __logf(row.sum);
  Vec* yr = reinterpret_cast<Vec*>(y + int64_t(blockIdx.x) * features);
  for (int j = threadIdx.x; j < packs; j += blockDim.x) {
    const Vec v = xr[j];
    Vec out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) out.v[k] = FromFloat<T>(SoftmaxOut<kLog>(ToFloat(v.v[k]), row, inv_sum, log_sum));
    yr[j] = out;
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

template <typename T, bool kLog, int kVec>
__global__ void SoftmaxBwdStreaming(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                                    int features) {
  using Vec = Pack<T, kVec>;
  const int64_t offset = int64_t(blockIdx.x) * features;
  const Vec* dyr = reinterpret_cast<const Vec*>(dy + offset);
  const Vec* yr = reinterpret_cast<const Vec*>(y + offset);
  const int packs = features / kVec;
  float sum[1] = {0.f};
  for (int j = threadIdx.x; j < packs; j += blockDim.x) {
    const Vec g = dyr[j], out = yr[j];
#pragma unroll
    for (int k = 0; k < kVec; ++k) sum[0] += ToFloat(g.v[k]) * (kLog ? 1.f : ToFloat(out.v[k]));
  }
  GroupSum(sum, blockDim.x);
  Vec* dxr = reinterpret_cast<Vec*>(dx + offset);
  for (int j = threadIdx.x; j < packs; j += blockDim.x) {
    const Vec g = dyr[j], out = yr[j];
    Vec result;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      result.v[k] = FromFloat<T>(SoftmaxGrad<kLog>(ToFloat(g.v[k]), ToFloat(out.v[k]), sum[0]));
    }
    dxr[j] = result;
  }
}

template <bool kLog>
ffi::Error SoftmaxFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  RowsFeatures shape;
  JAXDNN_RETURN_IF_ERROR(CheckSoftmax({&x, &*y}, &shape));
  if (shape.rows == 0) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const RowPlan plan = MakeRowPlan<T>(shape.features);
    const int64_t grid = RowGrid(plan, shape.rows);
    if (grid > 0x7fffffff) return InvalidArgument("softmax: too many rows for one launch");
    const T* xp = static_cast<const T*>(x.untyped_data());
    T* yp = static_cast<T*>(y->untyped_data());
    if (plan.cached) {
      SoftmaxFwdCached<T, kLog><<<grid, plan.block, 0, stream>>>(xp, yp, shape.rows, int(shape.features),
                                                                 plan.group);
    } else if (shape.features % kVec16<T> == 0) {
      SoftmaxFwdStreaming<T, kLog, kVec16<T>><<<grid, plan.block, 0, stream>>>(xp, yp, int(shape.features));
    } else {
      SoftmaxFwdStreaming<T, kLog, 1><<<grid, plan.block, 0, stream>>>(xp, yp, int(shape.features));
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
    const RowPlan plan = MakeRowPlan<T>(shape.features);
    const int64_t grid = RowGrid(plan, shape.rows);
    if (grid > 0x7fffffff) return InvalidArgument("softmax: too many rows for one launch");
    const T* dyp = static_cast<const T*>(dy.untyped_data());
    const T* yp = static_cast<const T*>(y.untyped_data());
    T* dxp = static_cast<T*>(dx->untyped_data());
    if (plan.cached) {
      SoftmaxBwdCached<T, kLog><<<grid, plan.block, 0, stream>>>(dyp, yp, dxp, shape.rows,
                                                                 int(shape.features), plan.group);
    } else if (shape.features % kVec16<T> == 0) {
      SoftmaxBwdStreaming<T, kLog, kVec16<T>><<<grid, plan.block, 0, stream>>>(dyp, yp, dxp,
                                                                            int(shape.features));
    } else {
      SoftmaxBwdStreaming<T, kLog, 1><<<grid, plan.block, 0, stream>>>(dyp, yp, dxp, int(shape.features));
    }
    return LaunchError("softmax backward");
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxFwdCuda, jaxdnn::SoftmaxFwdImpl<false>,
                              jaxdnn::BindSoftmaxFwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxBwdCuda, jaxdnn::SoftmaxBwdImpl<false>,
                              jaxdnn::BindSoftmaxBwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LogSoftmaxFwdCuda, jaxdnn::SoftmaxFwdImpl<true>,
                              jaxdnn::BindSoftmaxFwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LogSoftmaxBwdCuda, jaxdnn::SoftmaxBwdImpl<true>,
                              jaxdnn::BindSoftmaxBwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
