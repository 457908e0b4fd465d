// CPU softmax / log-softmax: one row at a time in float32.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/half_cpu.h"
#include "softmax/softmax.h"
#include "softmax/softmax_common.h"

namespace jaxdnn {
namespace {

template <typename T, bool kLog>
void SoftmaxFwd(const T* x, T* y, RowsFeatures shape) {
  const int64_t d = shape.features;
  std::vector<float> row(d), exps(d);
  for (int64_t r = 0; r < shape.rows; ++r) {
    float max = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < d; ++j) {
      row[j] = ToFloat(x[r * d + j]);
      max = std::max(max, row[j]);
    }
    double sum = 0.0;
    for (int64_t j = 0; j < d; ++j) {
      exps[j] = std::exp(row[j] - max);
      sum += exps[j];
    }
    const float log_sum = float(std::log(sum)), inv_sum = float(1.0 / sum);
    for (int64_t j = 0; j < d; ++j) {
      y[r * d + j] = FromFloat<T>(kLog ? row[j] - max - log_sum : exps[j] * inv_sum);
    }
  }
}

template <typename T, bool kLog>
void SoftmaxBwd(const T* dy, const T* y, T* dx, RowsFeatures shape) {
  const int64_t d = shape.features;
  for (int64_t r = 0; r < shape.rows; ++r) {
    const T* dyr = dy + r * d;
    const T* yr = y + r * d;
    double sum = 0.0;  // sum(dy * y) for softmax, sum(dy) for log-softmax
    for (int64_t j = 0; j < d; ++j) sum += double(ToFloat(dyr[j])) * (kLog ? 1.f : ToFloat(yr[j]));
    const float s = float(sum);
    for (int64_t j = 0; j < d; ++j) {
      const float g = ToFloat(dyr[j]), out = ToFloat(yr[j]);
      dx[r * d + j] = FromFloat<T>(kLog ? g - std::exp(out) * s : out * (g - s));
    }
  }
}

template <bool kLog>
ffi::Error SoftmaxFwdImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  RowsFeatures shape;
  JAXDNN_RETURN_IF_ERROR(CheckSoftmax({&x, &*y}, &shape));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    SoftmaxFwd<T, kLog>(static_cast<const T*>(x.untyped_data()), static_cast<T*>(y->untyped_data()),
                        shape);
    return ffi::Error::Success();
  });
}

template <bool kLog>
ffi::Error SoftmaxBwdImpl(ffi::AnyBuffer dy, ffi::AnyBuffer y, ffi::Result<ffi::AnyBuffer> dx) {
  RowsFeatures shape;
  JAXDNN_RETURN_IF_ERROR(CheckSoftmax({&dy, &y, &*dx}, &shape));
  return DispatchFloat<float, Bf16, Half>(y.element_type(), "y", [&](auto tag) {
    using T = decltype(tag);
    SoftmaxBwd<T, kLog>(static_cast<const T*>(dy.untyped_data()), static_cast<const T*>(y.untyped_data()),
                        static_cast<T*>(dx->untyped_data()), shape);
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxFwdCpu, jaxdnn::SoftmaxFwdImpl<false>,
                              jaxdnn::BindSoftmaxFwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxBwdCpu, jaxdnn::SoftmaxBwdImpl<false>,
                              jaxdnn::BindSoftmaxBwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(LogSoftmaxFwdCpu, jaxdnn::SoftmaxFwdImpl<true>,
                              jaxdnn::BindSoftmaxFwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(LogSoftmaxBwdCpu, jaxdnn::SoftmaxBwdImpl<true>,
                              jaxdnn::BindSoftmaxBwd(ffi::Ffi::Bind()));
