// CPU activations: one elementwise loop per (activation, dtype); the backward with the bias gradient
// a task per chunk of rows.
#include <algorithm>

#include "activation/activation_common.h"
#include "activation/activation.h"
#include "common/cpu_isa.h"
#include "common/half_cpu.h"
#include "common/parallel_cpu.h"

namespace jaxdnn {
namespace {

// out = f(in), n values, vectorized (CallVectorized).
template <Activation kAct, typename T>
void ActivateArray(const T* in, T* out, int64_t n, float param) {
  CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
    for (int64_t i = 0; i < n; ++i) out[i] = FromFloat<T>(Activate<kAct>(ToFloat(in[i]), param));
  });
}

// dx = dy f'(x), n values, vectorized: f'(x) for a block first, then dy f'(x), which keeps each
// loop small (one loop of both had GCC keep relu's f' a branch around the multiply, mispredicted
// half the time on random signs).
template <Activation kAct, typename T>
void ActivateGradArray(const T* dy, const T* x, T* dx, int64_t n, float param) {
  CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
    constexpr int64_t kBlock = 256;
    float slope[kBlock];
    for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
      const int64_t count = std::min(kBlock, n - i0);
      for (int64_t k = 0; k < count; ++k) slope[k] = ActivateGrad<kAct>(ToFloat(x[i0 + k]), param);
      for (int64_t k = 0; k < count; ++k) dx[i0 + k] = FromFloat<T>(ToFloat(dy[i0 + k]) * slope[k]);
    }
  });
}

// Values a thread's chunk holds at least: far more than a task's scheduling costs.
constexpr int64_t kChunkValues = 32768;

ffi::Error ActivationFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t kind,
                             float param) {
  int64_t n = 0;
  JAXDNN_RETURN_IF_ERROR(CheckActivation({&x, &*y}, kind, &n));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    const T* in = static_cast<const T*>(x.untyped_data());
    T* out = static_cast<T*>(y->untyped_data());
    DispatchActivation(kind, [&](auto act) {
      ParallelChunks(pool, n, kChunkValues, [&](int64_t begin, int64_t end) {
        ActivateArray<decltype(act)::value>(in + begin, out + begin, end - begin, param);
      });
    });
    return ffi::Error::Success();
  });
}

ffi::Error ActivationBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                             ffi::Result<ffi::AnyBuffer> dx, int64_t kind, float param) {
  int64_t n = 0;
  JAXDNN_RETURN_IF_ERROR(CheckActivation({&dy, &x, &*dx}, kind, &n));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    const T* g = static_cast<const T*>(dy.untyped_data());
    const T* in = static_cast<const T*>(x.untyped_data());
    T* out = static_cast<T*>(dx->untyped_data());
    DispatchActivation(kind, [&](auto act) {
      ParallelChunks(pool, n, kChunkValues, [&](int64_t begin, int64_t end) {
        ActivateGradArray<decltype(act)::value>(g + begin, in + begin, out + begin, end - begin, param);
      });
    });
    return ffi::Error::Success();
  });
}

// dx = dy f'(x) over rows of C, and partials[p] = the column sums of dx's rounded values over
// chunk p of the rows, a task a chunk.
ffi::Error ActivationBwdBiasImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                                 ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::Buffer<ffi::F32>> partials,
                                 int64_t kind, float param) {
  RowsFeatures shape;
  int64_t chunks = 0;
  JAXDNN_RETURN_IF_ERROR(CheckActivationBias(dy, x, *dx, *partials, kind, &shape, &chunks));
  const int64_t rows = shape.rows, cols = shape.features;
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    const T* g = static_cast<const T*>(dy.untyped_data());
    const T* in = static_cast<const T*>(x.untyped_data());
    T* out = static_cast<T*>(dx->untyped_data());
    float* sums = partials->typed_data();
    DispatchActivation(kind, [&](auto act) {
      ParallelFor(pool, chunks, [&](int64_t p) {
        float* sum = sums + p * cols;
        std::fill(sum, sum + cols, 0.f);
        const int64_t begin = rows * p / chunks * cols, end = rows * (p + 1) / chunks * cols;
        ActivateGradArray<decltype(act)::value>(g + begin, in + begin, out + begin, end - begin, param);
        for (int64_t row = begin; row < end; row += cols) {
          for (int64_t c = 0; c < cols; ++c) sum[c] += ToFloat(out[row + c]);
        }
      });
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(ActivationFwdCpu, jaxdnn::ActivationFwdImpl,
                              jaxdnn::BindActivationFwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ActivationBwdCpu, jaxdnn::ActivationBwdImpl,
                              jaxdnn::BindActivationBwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ActivationBwdBiasCpu, jaxdnn::ActivationBwdBiasImpl,
                              jaxdnn::BindActivationBwdBias(jaxdnn::BindWithThreadPool()));
