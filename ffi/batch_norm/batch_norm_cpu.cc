// CPU batch norm: loops in memory order over x as [O, C, I] (the oracle-checked path CI runs), over
// XLA's intra-op threads: the elementwise passes in chunks of outer rows, the per-channel sums (in
// double) in blocks of outer rows whose number depends on the shape alone, the blocks' partial sums
// added in order, so that the results do not depend on the threads.
#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "batch_norm/batch_norm.h"
#include "batch_norm/batch_norm_common.h"
#include "common/cpu_isa.h"
#include "common/half_cpu.h"
#include "common/parallel_cpu.h"

namespace jaxdnn {
namespace {

// Calls fn(element offset, channel) for every element of outer rows [o0, o1) of x in memory order.
// Channels last (I = 1) has a loop of its own: there the channel loop is the contiguous one, and it
// vectorizes. Inlined into CallVectorized's variants (common/cpu_isa.h), as fn must be.
template <typename Fn>
JAXDNN_ALWAYS_INLINE inline void ForEachElement(const ChannelShape& s, int64_t o0, int64_t o1, Fn&& fn) {
  if (s.inner == 1) {
    for (int64_t o = o0; o < o1; ++o) {
      for (int64_t c = 0; c < s.channels; ++c) fn(o * s.channels + c, c);
    }
    return;
  }
  for (int64_t o = o0; o < o1; ++o) {
    for (int64_t c = 0; c < s.channels; ++c) {
      const int64_t base = (o * s.channels + c) * s.inner;
      for (int64_t i = 0; i < s.inner; ++i) fn(base + i, c);
    }
  }
}

// Elements a chunk or block of outer rows takes at least: smaller ones cost more in scheduling than
// they save.
constexpr int64_t kMinElements = 8192;
// Blocks of the sums at most: each holds its partial sums, two doubles a channel.
constexpr int64_t kMaxSumBlocks = 64;

// fn(o0, o1) over chunks of x's outer rows on the intra-op threads (elementwise passes).
template <typename Fn>
void ForOuterChunks(ffi::ThreadPool& pool, const ChannelShape& s, const Fn& fn) {
  const int64_t row = std::max<int64_t>(1, s.channels * s.inner);
  ParallelChunks(pool, s.outer, std::max<int64_t>(1, kMinElements / row), fn);
}

// Per-channel double sums a[C] and b[C] of x's elements: fn(o0, o1, a_part, b_part) adds those of
// outer rows [o0, o1) into zeroed partial sums; the blocks of rows run on the intra-op threads and
// their partial sums are added in block order.
template <typename Fn>
void ChannelSums(ffi::ThreadPool& pool, const ChannelShape& s, const Fn& fn, double* a, double* b) {
  const int64_t row = std::max<int64_t>(1, s.channels * s.inner);
  const int64_t per_block = std::max((s.outer + kMaxSumBlocks - 1) / kMaxSumBlocks, (kMinElements + row - 1) / row);
  const int64_t blocks = std::max<int64_t>(1, (s.outer + per_block - 1) / per_block);
  std::vector<double> parts(2 * blocks * s.channels, 0.0);
  ParallelFor(pool, blocks, [&](int64_t block) {
    double* part = &parts[2 * block * s.channels];
    fn(block * per_block, std::min(s.outer, (block + 1) * per_block), part, part + s.channels);
  });
  std::fill_n(a, s.channels, 0.0);
  std::fill_n(b, s.channels, 0.0);
  for (int64_t block = 0; block < blocks; ++block) {
    const double* part = &parts[2 * block * s.channels];
    for (int64_t c = 0; c < s.channels; ++c) {
      a[c] += part[c];
      b[c] += part[s.channels + c];
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

ffi::Error StatsImpl(ffi::ThreadPool pool,
                     ffi::AnyBuffer x, ffi::Buffer<ffi::F32> shift, ffi::Result<ffi::Buffer<ffi::F32>> s1,
                     ffi::Result<ffi::Buffer<ffi::F32>> s2, ffi::Result<ffi::Buffer<ffi::F32>> workspace) {
  ChannelShape s;
  JAXDNN_RETURN_IF_ERROR(
      CheckBatchNormStage(x, {}, {shift.dimensions(), s1->dimensions(), s2->dimensions()}, 0, &s));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* xs = static_cast<const T*>(x.untyped_data());
    const float* k = shift.typed_data();
    std::vector<double> sum(s.channels), sum_sq(s.channels);
    ChannelSums(pool, s, [&](int64_t o0, int64_t o1, double* part_sum, double* part_sq) {
      CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
        ForEachElement(s, o0, o1, [&](int64_t e, int64_t c) JAXDNN_ALWAYS_INLINE {
          const double v = double(ToFloat(xs[e]) - k[c]);
          part_sum[c] += v;
          part_sq[c] += v * v;
        });
      });
    }, sum.data(), sum_sq.data());
    for (int64_t c = 0; c < s.channels; ++c) {
      s1->typed_data()[c] = float(sum[c]);
      s2->typed_data()[c] = float(sum_sq[c]);
    }
    return ffi::Error::Success();
  });
}

ffi::Error FwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> mean,
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
        ForOuterChunks(pool, s, [&](int64_t o0, int64_t o1) {
          CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
            ForEachElement(s, o0, o1, [&](int64_t e, int64_t c) JAXDNN_ALWAYS_INLINE {
              const float r = has_residual ? ToFloat(rs[e]) : 0.f;
              ys[e] = FromFloat<T>(Out<decltype(tag)::value>(ToFloat(xs[e]), as[c], ms[c], bs[c], r, param));
            });
          });
        });
      });
    });
    return ffi::Error::Success();
  });
}

// The backward sums (and, when `g_out` is given, g itself) of both sum stages.
ffi::Error BackwardSums(ffi::ThreadPool& pool,
                        const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x, ffi::Buffer<ffi::F32> a,
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
    std::vector<double> sum(s.channels), sum_x(s.channels);
    DispatchActivation(act, [&](auto tag) {
      IfGiven(rs, [&](auto has_residual) {  // the fused stage has both g_out and the residual
        ChannelSums(pool, s, [&](int64_t o0, int64_t o1, double* sums, double* sums_x) {
          CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
            ForEachElement(s, o0, o1, [&](int64_t e, int64_t c) JAXDNN_ALWAYS_INLINE {
              const float v = ToFloat(xs[e]);
              const float r = has_residual ? ToFloat(rs[e]) : 0.f;
              const float g = Grad<decltype(tag)::value>(ToFloat(gs[e]), v, as[c], ms[c], bs[c], r, param);
              if (has_residual) go[e] = FromFloat<T>(g);
              sums[c] += g;
              sums_x[c] += double(g) * double(v - ms[c]);
            });
          });
        }, sum.data(), sum_x.data());
      });
    });
    for (int64_t c = 0; c < s.channels; ++c) {
      sg->typed_data()[c] = float(sum[c]);
      sgx->typed_data()[c] = float(sum_x[c]);
    }
    return ffi::Error::Success();
  });
}

ffi::Error BwdSumsImpl(ffi::ThreadPool pool,
                       ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> mean,
                       ffi::Buffer<ffi::F32> bias, ffi::Result<ffi::Buffer<ffi::F32>> sg,
                       ffi::Result<ffi::Buffer<ffi::F32>> sgx, ffi::Result<ffi::Buffer<ffi::F32>> workspace,
                       int64_t act, float param) {
  return BackwardSums(pool, dy, x, a, mean, bias, nullptr, nullptr, sg, sgx, act, param);
}

ffi::Error BwdGradImpl(ffi::ThreadPool pool,
                       ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> mean,
                       ffi::Buffer<ffi::F32> bias, ffi::AnyBuffer residual, ffi::Result<ffi::AnyBuffer> g,
                       ffi::Result<ffi::Buffer<ffi::F32>> sg, ffi::Result<ffi::Buffer<ffi::F32>> sgx,
                       ffi::Result<ffi::Buffer<ffi::F32>> workspace, int64_t act, float param) {
  return BackwardSums(pool, dy, x, a, mean, bias, &residual, &*g, sg, sgx, act, param);
}

ffi::Error BwdDxImpl(ffi::ThreadPool pool,
                     ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> mean,
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
      ForOuterChunks(pool, s, [&](int64_t o0, int64_t o1) {
        CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
          ForEachElement(s, o0, o1, [&](int64_t e, int64_t c) JAXDNN_ALWAYS_INLINE {
            const float v = ToFloat(xs[e]);
            const float g = Grad<decltype(tag)::value>(ToFloat(gs[e]), v, as[c], ms[c], bs[c], 0.f, param);
            dxs[e] = FromFloat<T>(as[c] * g + k1s[c] * (v - ms[c]) + k0s[c]);
          });
        });
      });
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormStatsCpu, jaxdnn::StatsImpl,
                              jaxdnn::BindBatchNormStats(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormFwdCpu, jaxdnn::FwdImpl,
                              jaxdnn::BindBatchNormFwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBwdSumsCpu, jaxdnn::BwdSumsImpl,
                              jaxdnn::BindBatchNormBwdSums(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBwdGradCpu, jaxdnn::BwdGradImpl,
                              jaxdnn::BindBatchNormBwdGrad(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBwdDxCpu, jaxdnn::BwdDxImpl,
                              jaxdnn::BindBatchNormBwdDx(jaxdnn::BindWithThreadPool()));
