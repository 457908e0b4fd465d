// CPU batch norm: loops in memory order over x as [O, C, I] (the oracle-checked path CI runs);
// the per-channel sums accumulate in double.
#include <optional>
#include <type_traits>
#include <vector>

#include "batch_norm/batch_norm.h"
#include "batch_norm/batch_norm_common.h"
#include "common/cpu_isa.h"
#include "common/half_cpu.h"

namespace jaxdnn {
namespace {

// Calls fn(element offset, channel) for every element of x in memory order. Channels last (I = 1)
// has a loop of its own: there the channel loop is the contiguous one, and it vectorizes. Inlined
// into CallVectorized's variants (common/cpu_isa.h), as fn must be.
template <typename Fn>
JAXDNN_ALWAYS_INLINE inline void ForEachElement(const ChannelShape& s, Fn&& fn) {
  if (s.inner == 1) {
    for (int64_t o = 0; o < s.outer; ++o) {
      for (int64_t c = 0; c < s.channels; ++c) fn(o * s.channels + c, c);
    }
    return;
  }
  for (int64_t o = 0; o < s.outer; ++o) {
    for (int64_t c = 0; c < s.channels; ++c) {
      const int64_t base = (o * s.channels + c) * s.inner;
      for (int64_t i = 0; i < s.inner; ++i) fn(base + i, c);
    }
  }
}

// BatchNormOut and BatchNormGrad (batch_norm_common.h) with the activation a compile-time constant,
// the same values: a switch per element kept the loops from vectorizing (and the CPU kernels run
// every element through them).
template <Activation kAct>
JAXDNN_ALWAYS_INLINE inline float Out(float x, float a, float mean, float bias, float r, float param) {
  return Activate<kAct>(a * (x - mean) + bias + r, param);
}
template <Activation kAct>
JAXDNN_ALWAYS_INLINE inline float Grad(float dy, float x, float a, float mean, float bias, float r, float param) {
  return kAct == Activation::kIdentity ? dy : dy * ActivateGrad<kAct>(a * (x - mean) + bias + r, param);
}

// Calls fn(std::true_type) when p is given, else fn(std::false_type): a loop for each case, without
// the test of an optional operand inside (a load under a condition keeps a loop from vectorizing).
template <typename P, typename Fn>
void IfGiven(const P* p, Fn&& fn) {
  if (p != nullptr) return fn(std::true_type{});
  fn(std::false_type{});
}

ffi::Error StatsImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> shift, ffi::Result<ffi::Buffer<ffi::F32>> s1,
                     ffi::Result<ffi::Buffer<ffi::F32>> s2, ffi::Result<ffi::Buffer<ffi::F32>> workspace) {
  ChannelShape s;
  JAXDNN_RETURN_IF_ERROR(
      CheckBatchNormStage(x, {}, {shift.dimensions(), s1->dimensions(), s2->dimensions()}, 0, &s));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* xs = static_cast<const T*>(x.untyped_data());
    const float* k = shift.typed_data();
    std::vector<double> sum(s.channels, 0.0), sum_sq(s.channels, 0.0);
    ForEachElement(s, [&](int64_t e, int64_t c) {
      const double v = double(ToFloat(xs[e]) - k[c]);
      sum[c] += v;
      sum_sq[c] += v * v;
    });
    for (int64_t c = 0; c < s.channels; ++c) {
      s1->typed_data()[c] = float(sum[c]);
      s2->typed_data()[c] = float(sum_sq[c]);
    }
    return ffi::Error::Success();
  });
}

ffi::Error FwdImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> mean,
                   ffi::Buffer<ffi::F32> bias, std::optional<ffi::AnyBuffer> residual, ffi::Result<ffi::AnyBuffer> y, int64_t act,
                   float param) {
  ChannelShape s;
  JAXDNN_RETURN_IF_ERROR(CheckBatchNormStage(
      x, {&*y, OrNull(residual)}, {a.dimensions(), mean.dimensions(), bias.dimensions()}, act, &s));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* xs = static_cast<const T*>(x.untyped_data());
    const T* rs = DataOrNull<T>(residual);
    T* ys = static_cast<T*>(y->untyped_data());
    const float *as = a.typed_data(), *ms = mean.typed_data(), *bs = bias.typed_data();
    DispatchActivation(act, [&](auto tag) {
      IfGiven(rs, [&](auto has_residual) {
        CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
          ForEachElement(s, [&](int64_t e, int64_t c) JAXDNN_ALWAYS_INLINE {
            const float r = has_residual ? ToFloat(rs[e]) : 0.f;
            ys[e] = FromFloat<T>(Out<decltype(tag)::value>(ToFloat(xs[e]), as[c], ms[c], bs[c], r, param));
          });
        });
      });
    });
    return ffi::Error::Success();
  });
}

// The backward sums (and, when `g_out` is given, g itself) of both sum stages.
ffi::Error BackwardSums(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x, ffi::Buffer<ffi::F32> a,
                        ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> bias, const ffi::AnyBuffer* residual,
                        ffi::AnyBuffer* g_out, ffi::Result<ffi::Buffer<ffi::F32>> sg,
                        ffi::Result<ffi::Buffer<ffi::F32>> sgx, int64_t act, float param) {
  ChannelShape s;
  JAXDNN_RETURN_IF_ERROR(CheckBatchNormStage(
      x, {&dy, residual, g_out},
      {a.dimensions(), mean.dimensions(), bias.dimensions(), sg->dimensions(), sgx->dimensions()}, act, &s));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* gs = static_cast<const T*>(dy.untyped_data());
    const T* xs = static_cast<const T*>(x.untyped_data());
    const T* rs = residual ? static_cast<const T*>(residual->untyped_data()) : nullptr;
    T* go = g_out ? static_cast<T*>(g_out->untyped_data()) : nullptr;
    const float *as = a.typed_data(), *ms = mean.typed_data(), *bs = bias.typed_data();
    std::vector<double> sum(s.channels, 0.0), sum_x(s.channels, 0.0);
    double *sums = sum.data(), *sums_x = sum_x.data();
    DispatchActivation(act, [&](auto tag) {
      IfGiven(rs, [&](auto has_residual) {  // the fused stage has both g_out and the residual
        CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
          ForEachElement(s, [&](int64_t e, int64_t c) JAXDNN_ALWAYS_INLINE {
            const float v = ToFloat(xs[e]);
            const float r = has_residual ? ToFloat(rs[e]) : 0.f;
            const float g = Grad<decltype(tag)::value>(ToFloat(gs[e]), v, as[c], ms[c], bs[c], r, param);
            if (has_residual) go[e] = FromFloat<T>(g);
            sums[c] += g;
            sums_x[c] += double(g) * double(v - ms[c]);
          });
        });
      });
    });
    for (int64_t c = 0; c < s.channels; ++c) {
      sg->typed_data()[c] = float(sum[c]);
      sgx->typed_data()[c] = float(sum_x[c]);
    }
    return ffi::Error::Success();
  });
}

ffi::Error BwdSumsImpl(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> mean,
                       ffi::Buffer<ffi::F32> bias, ffi::Result<ffi::Buffer<ffi::F32>> sg,
                       ffi::Result<ffi::Buffer<ffi::F32>> sgx, ffi::Result<ffi::Buffer<ffi::F32>> workspace,
                       int64_t act, float param) {
  return BackwardSums(dy, x, a, mean, bias, nullptr, nullptr, sg, sgx, act, param);
}

ffi::Error BwdGradImpl(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> mean,
                       ffi::Buffer<ffi::F32> bias, ffi::AnyBuffer residual, ffi::Result<ffi::AnyBuffer> g,
                       ffi::Result<ffi::Buffer<ffi::F32>> sg, ffi::Result<ffi::Buffer<ffi::F32>> sgx,
                       ffi::Result<ffi::Buffer<ffi::F32>> workspace, int64_t act, float param) {
  return BackwardSums(dy, x, a, mean, bias, &residual, &*g, sg, sgx, act, param);
}

ffi::Error BwdDxImpl(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> mean,
                     ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> k1, ffi::Buffer<ffi::F32> k0,
                     ffi::Result<ffi::AnyBuffer> dx, int64_t act, float param) {
  ChannelShape s;
  JAXDNN_RETURN_IF_ERROR(CheckBatchNormStage(
      x, {&dy, &*dx}, {a.dimensions(), mean.dimensions(), bias.dimensions(), k1.dimensions(), k0.dimensions()},
      act, &s));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* gs = static_cast<const T*>(dy.untyped_data());
    const T* xs = static_cast<const T*>(x.untyped_data());
    T* dxs = static_cast<T*>(dx->untyped_data());
    const float *as = a.typed_data(), *ms = mean.typed_data(), *bs = bias.typed_data();
    const float *k1s = k1.typed_data(), *k0s = k0.typed_data();
    DispatchActivation(act, [&](auto tag) {
      CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
        ForEachElement(s, [&](int64_t e, int64_t c) JAXDNN_ALWAYS_INLINE {
          const float v = ToFloat(xs[e]);
          const float g = Grad<decltype(tag)::value>(ToFloat(gs[e]), v, as[c], ms[c], bs[c], 0.f, param);
          dxs[e] = FromFloat<T>(as[c] * g + k1s[c] * (v - ms[c]) + k0s[c]);
        });
      });
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormStatsCpu, jaxdnn::StatsImpl, jaxdnn::BindBatchNormStats(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormFwdCpu, jaxdnn::FwdImpl, jaxdnn::BindBatchNormFwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBwdSumsCpu, jaxdnn::BwdSumsImpl,
                              jaxdnn::BindBatchNormBwdSums(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBwdGradCpu, jaxdnn::BwdGradImpl,
                              jaxdnn::BindBatchNormBwdGrad(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBwdDxCpu, jaxdnn::BwdDxImpl, jaxdnn::BindBatchNormBwdDx(ffi::Ffi::Bind()));
