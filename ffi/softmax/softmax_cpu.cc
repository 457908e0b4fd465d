// CPU softmax / log-softmax: one row at a time in float32, chunks of rows over XLA's thread pool.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/activation.h"
#include "common/cpu_isa.h"
#include "common/half_cpu.h"
#include "common/parallel_cpu.h"
#include "common/vector_cpu.h"
#include "softmax/softmax.h"
#include "softmax/softmax_common.h"

namespace jaxdnn {
namespace {

// Each row in float32: the exps by the vectorized Exp (common/activation.h), the max and the
// sums in vector lanes (common/vector_cpu.h), every loop in CallVectorized's variant.
template <typename T, bool kLog>
void SoftmaxFwd(const T* x, T* y, RowsFeatures shape) {
  const int64_t d = shape.features;
  std::vector<float> row(d), exps(d);
  CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
    for (int64_t r = 0; r < shape.rows; ++r) {
      const T* xr = x + r * d;
      T* yr = y + r * d;
      for (int64_t j = 0; j < d; ++j) row[j] = ToFloat(xr[j]);
      const float max = MaxOf(row.data(), d);
      for (int64_t j = 0; j < d; ++j) exps[j] = Exp(row[j] - max);
      const double sum = SumOf(d, [&](int64_t j) JAXDNN_ALWAYS_INLINE { return exps[j]; });
      if (kLog) {
        const float shift = max + float(std::log(sum));
        for (int64_t j = 0; j < d; ++j) yr[j] = FromFloat<T>(row[j] - shift);
      } else {
        const float inv_sum = float(1.0 / sum);
        for (int64_t j = 0; j < d; ++j) yr[j] = FromFloat<T>(exps[j] * inv_sum);
      }
    }
  });
}

// dx = y (dy - sum(dy y)) for softmax, dy - exp(y) sum(dy) for log-softmax.
template <typename T, bool kLog>
void SoftmaxBwd(const T* dy, const T* y, T* dx, RowsFeatures shape) {
  const int64_t d = shape.features;
  std::vector<float> grad(d), out(d);
  CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
    for (int64_t r = 0; r < shape.rows; ++r) {
      for (int64_t j = 0; j < d; ++j) grad[j] = ToFloat(dy[r * d + j]);
      for (int64_t j = 0; j < d; ++j) out[j] = ToFloat(y[r * d + j]);
      const float s =
          float(SumOf(d, [&](int64_t j) JAXDNN_ALWAYS_INLINE { return kLog ? grad[j] : grad[j] * out[j]; }));
      T* dxr = dx + r * d;
      if (kLog) {
        for (int64_t j = 0; j < d; ++j) dxr[j] = FromFloat<T>(grad[j] - Exp(out[j]) * s);
      } else {
        for (int64_t j = 0; j < d; ++j) dxr[j] = FromFloat<T>(out[j] * (grad[j] - s));
      }
    }
  });
}

// Calls fn(first value, shape of the rows) for chunks of rows spread over the pool (RowsPerChunk).
template <typename Fn>
void ForRowChunks(ffi::ThreadPool& pool, RowsFeatures shape, const Fn& fn) {
  ParallelChunks(pool, shape.rows, RowsPerChunk(shape), [&](int64_t begin, int64_t end) {
    fn(begin * shape.features, RowsFeatures{end - begin, shape.features});
  });
}

template <bool kLog>
ffi::Error SoftmaxFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  RowsFeatures shape;
  JAXDNN_RETURN_IF_ERROR(CheckSoftmax({&x, &*y}, &shape));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.untyped_data());
    T* out = static_cast<T*>(y->untyped_data());
    ForRowChunks(pool, shape, [&](int64_t offset, RowsFeatures rows) {
      SoftmaxFwd<T, kLog>(in + offset, out + offset, rows);
    });
    return ffi::Error::Success();
  });
}

template <bool kLog>
ffi::Error SoftmaxBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer y, ffi::Result<ffi::AnyBuffer> dx) {
  RowsFeatures shape;
  JAXDNN_RETURN_IF_ERROR(CheckSoftmax({&dy, &y, &*dx}, &shape));
  return DispatchFloat<float, Bf16, Half>(y.element_type(), "y", [&](auto tag) {
    using T = decltype(tag);
    const T* g = static_cast<const T*>(dy.untyped_data());
    const T* out = static_cast<const T*>(y.untyped_data());
    T* grad = static_cast<T*>(dx->untyped_data());
    ForRowChunks(pool, shape, [&](int64_t offset, RowsFeatures rows) {
      SoftmaxBwd<T, kLog>(g + offset, out + offset, grad + offset, rows);
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxFwdCpu, jaxdnn::SoftmaxFwdImpl<false>,
                              jaxdnn::BindSoftmaxFwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxBwdCpu, jaxdnn::SoftmaxBwdImpl<false>,
                              jaxdnn::BindSoftmaxBwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(LogSoftmaxFwdCpu, jaxdnn::SoftmaxFwdImpl<true>,
                              jaxdnn::BindSoftmaxFwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(LogSoftmaxBwdCpu, jaxdnn::SoftmaxBwdImpl<true>,
                              jaxdnn::BindSoftmaxBwd(jaxdnn::BindWithThreadPool()));
