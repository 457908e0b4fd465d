// CPU LayerNorm / RMSNorm: one row at a time in float32 with vectorized inner loops (the
// oracle-checked path CI runs), chunks of rows over XLA's intra-op threads; the sums over rows
// (dscale, dbias) accumulate in double, per slice of rows, the slices added in order.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/activation.h"
#include "common/cpu_isa.h"
#include "common/half_cpu.h"
#include "common/parallel_cpu.h"
#include "norm/norm.h"
#include "norm/norm_common.h"

namespace jaxdnn {
namespace {

// Row sums with 8 independent accumulators: the compiler vectorizes them, and the error grows like
// that of a pairwise sum of 8 chains rather than of one long chain.
constexpr int kLanes = 8;

template <typename F>
JAXDNN_ALWAYS_INLINE inline float SumOver(int64_t n, F&& term) {
  float partial[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) partial[l] += term(j + l);
  }
  for (; j < n; ++j) partial[0] += term(j);
  float total = 0.f;
  for (int l = 0; l < kLanes; ++l) total += partial[l];
  return total;
}

template <typename T>
JAXDNN_ALWAYS_INLINE inline void LoadRow(const T* src, int64_t n, float* dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = ToFloat(src[j]);
}

// The backward's slices of rows (of RowsPerChunk at least): a count fixed by the shape (at most
// kMaxSlices), not by the threads, so that dscale and dbias, added slice by slice in order, have the
// same bits on every machine.
constexpr int64_t kMaxSlices = 16;
int64_t Slices(RowsFeatures shape) {
  return std::clamp<int64_t>(shape.rows / RowsPerChunk(shape), 1, kMaxSlices);
}

// kRms: y = x * rstd * scale, rstd = 1/sqrt(mean(x^2) + eps); otherwise
// y = act((x - mean) * rstd * scale + bias), rstd = 1/sqrt(var(x) + eps), the variance in two
// passes. Every loop in CallVectorized's variant (common/cpu_isa.h), the activation a compile-time
// constant.
// Rows [begin, end).
template <typename T, bool kRms, Activation kAct>
void NormFwd(const T* x, const float* scale, const float* bias, T* y, float* mean_out,
             float* rstd_out, RowsFeatures shape, int64_t begin, int64_t end, float epsilon, float param) {
  const int64_t d = shape.features;
  std::vector<float> row(d), out(d);
  const float* v = row.data();
  CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
    for (int64_t r = begin; r < end; ++r) {
      LoadRow(x + r * d, d, row.data());
      const float mean = kRms ? 0.f : SumOver(d, [&](int64_t j) JAXDNN_ALWAYS_INLINE { return v[j]; }) / d;
      const float var =
          SumOver(d, [&](int64_t j) JAXDNN_ALWAYS_INLINE { return (v[j] - mean) * (v[j] - mean); }) / d;
      const float rstd = 1.f / std::sqrt(var + epsilon);
      for (int64_t j = 0; j < d; ++j) {
        out[j] = Activate<kAct>((v[j] - mean) * rstd * scale[j] + (kRms ? 0.f : bias[j]), param);
      }
      T* yr = y + r * d;
      for (int64_t j = 0; j < d; ++j) yr[j] = FromFloat<T>(out[j]);
      if (!kRms) mean_out[r] = mean;
      rstd_out[r] = rstd;
    }
  });
}

// With xhat = (x - mean) * rstd and g = scale * dy:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMSNorm drops the mean(g) term)
//   dscale = sum_rows(dy * xhat), dbias = sum_rows(dy), accumulated in double over rows [begin, end)
//   into dscale_acc and dbias_acc (zeroed here).
// With an activation, dy is first the gradient reaching the affine output, dy * act'(pre).
template <typename T, bool kRms, Activation kAct>
void NormBwd(const T* dy, const T* x, const float* scale, const float* bias, const float* mean_in,
             const float* rstd_in, T* dx, double* dscale_acc, double* dbias_acc, RowsFeatures shape, int64_t begin,
             int64_t end, float param) {
  const int64_t d = shape.features;
  std::vector<float> xhat(d), dyf(d);
  std::fill(dscale_acc, dscale_acc + d, 0.0);
  std::fill(dbias_acc, dbias_acc + d, 0.0);
  float* xh = xhat.data();
  float* dv = dyf.data();
  CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
    for (int64_t r = begin; r < end; ++r) {
      const float mean = kRms ? 0.f : mean_in[r];
      const float rstd = rstd_in[r];
      LoadRow(x + r * d, d, xh);
      LoadRow(dy + r * d, d, dv);
      for (int64_t j = 0; j < d; ++j) xh[j] = (xh[j] - mean) * rstd;
      if (kAct != Activation::kIdentity) {
        for (int64_t j = 0; j < d; ++j) dv[j] *= ActivateGrad<kAct>(xh[j] * scale[j] + bias[j], param);
      }
      const float mean_g =
          kRms ? 0.f : SumOver(d, [&](int64_t j) JAXDNN_ALWAYS_INLINE { return scale[j] * dv[j]; }) / d;
      const float mean_g_xhat =
          SumOver(d, [&](int64_t j) JAXDNN_ALWAYS_INLINE { return scale[j] * dv[j] * xh[j]; }) / d;
      T* dxr = dx + r * d;
      for (int64_t j = 0; j < d; ++j) {
        dxr[j] = FromFloat<T>(rstd * (scale[j] * dv[j] - mean_g - xh[j] * mean_g_xhat));
      }
      for (int64_t j = 0; j < d; ++j) dscale_acc[j] += double(dv[j]) * xh[j];
      if (!kRms) {
        for (int64_t j = 0; j < d; ++j) dbias_acc[j] += dv[j];
      }
    }
  });
}

// DispatchActivation for layer norm; RMSNorm has no activation (its kind is 0), so no instances.
template <bool kRms, typename Fn>
void ForActivation(int64_t kind, Fn&& fn) {
  if constexpr (kRms) {
    fn(ActivationTag<Activation::kIdentity>{});
  } else {
    DispatchActivation(kind, fn);
  }
}

template <bool kRms>
ffi::Error NormFwdCpu(ffi::ThreadPool& pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32>* bias,
                      ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::F32>>* mean,
                      ffi::Result<ffi::Buffer<ffi::F32>> rstd, float epsilon, NormActivation act) {
  RowsFeatures shape;
  JAXDNN_RETURN_IF_ERROR(CheckNormFwd(x, scale, bias, *y, mean, *rstd, &shape));
  JAXDNN_RETURN_IF_ERROR(CheckNormActivation(act));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    ForActivation<kRms>(act.kind, [&](auto tag) {
      ParallelChunks(pool, shape.rows, RowsPerChunk(shape), [&](int64_t begin, int64_t end) {
        NormFwd<T, kRms, decltype(tag)::value>(static_cast<const T*>(x.untyped_data()), scale.typed_data(),
                                               kRms ? nullptr : bias->typed_data(), static_cast<T*>(y->untyped_data()),
                                               kRms ? nullptr : (*mean)->typed_data(), rstd->typed_data(), shape, begin,
                                               end, epsilon, act.param);
      });
    });
    return ffi::Error::Success();
  });
}

template <bool kRms>
ffi::Error NormBwdCpu(ffi::ThreadPool& pool, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                      ffi::Buffer<ffi::F32>* bias, ffi::Buffer<ffi::F32>* mean, ffi::Buffer<ffi::F32> rstd,
                      ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::Buffer<ffi::F32>> dscale,
                      ffi::Result<ffi::Buffer<ffi::F32>>* dbias,
                      ffi::Result<ffi::Buffer<ffi::F32>> workspace, NormActivation act) {
  RowsFeatures shape;
  int64_t partials = 0;  // the CPU kernel accumulates in place and needs no workspace
  JAXDNN_RETURN_IF_ERROR(
      CheckNormBwd(dy, x, scale, mean, rstd, *dx, *dscale, dbias, *workspace, &shape, &partials));
  JAXDNN_RETURN_IF_ERROR(CheckNormActivation(act));
  if (bias != nullptr) JAXDNN_RETURN_IF_ERROR(ExpectElements("bias", bias->dimensions(), shape.features));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const int64_t d = shape.features, slices = Slices(shape);
    std::vector<double> sums(2 * slices * d);  // per slice: dscale's sums, then dbias's
    ForActivation<kRms>(act.kind, [&](auto tag) {
      ParallelFor(pool, slices, [&](int64_t i) {
        NormBwd<T, kRms, decltype(tag)::value>(static_cast<const T*>(dy.untyped_data()),
                                               static_cast<const T*>(x.untyped_data()), scale.typed_data(),
                                               kRms ? nullptr : bias->typed_data(), kRms ? nullptr : mean->typed_data(),
                                               rstd.typed_data(), static_cast<T*>(dx->untyped_data()),
                                               &sums[2 * i * d], &sums[(2 * i + 1) * d], shape,
                                               shape.rows * i / slices, shape.rows * (i + 1) / slices, act.param);
      });
    });
    for (int64_t j = 0; j < d; ++j) {
      double dscale_sum = 0.0, dbias_sum = 0.0;
      for (int64_t i = 0; i < slices; ++i) {
        dscale_sum += sums[2 * i * d + j];
        dbias_sum += sums[(2 * i + 1) * d + j];
      }
      dscale->typed_data()[j] = float(dscale_sum);
      if (!kRms) (*dbias)->typed_data()[j] = float(dbias_sum);
    }
    return ffi::Error::Success();
  });
}

ffi::Error LayerNormFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::F32> bias,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::F32>> mean,
                            ffi::Result<ffi::Buffer<ffi::F32>> rstd, float epsilon, int64_t activation,
                            float activation_param) {
  return NormFwdCpu<false>(pool, x, scale, &bias, y, &mean, rstd, epsilon, {activation, activation_param});
}

ffi::Error RmsNormFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                          ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::Buffer<ffi::F32>> rstd, float epsilon) {
  return NormFwdCpu<true>(pool, x, scale, nullptr, y, nullptr, rstd, epsilon, {});
}

ffi::Error LayerNormBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> rstd,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::Buffer<ffi::F32>> dscale,
                            ffi::Result<ffi::Buffer<ffi::F32>> dbias,
                            ffi::Result<ffi::Buffer<ffi::F32>> workspace, int64_t activation,
                            float activation_param) {
  return NormBwdCpu<false>(pool, dy, x, scale, &bias, &mean, rstd, dx, dscale, &dbias, workspace,
                           {activation, activation_param});
}

ffi::Error RmsNormBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                          ffi::Buffer<ffi::F32> rstd, ffi::Result<ffi::AnyBuffer> dx,
                          ffi::Result<ffi::Buffer<ffi::F32>> dscale,
                          ffi::Result<ffi::Buffer<ffi::F32>> workspace) {
  return NormBwdCpu<true>(pool, dy, x, scale, nullptr, nullptr, rstd, dx, dscale, nullptr, workspace, {});
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormFwdCpu, jaxdnn::LayerNormFwdImpl,
                              jaxdnn::BindLayerNormFwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormFwdCpu, jaxdnn::RmsNormFwdImpl,
                              jaxdnn::BindRmsNormFwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormBwdCpu, jaxdnn::LayerNormBwdImpl,
                              jaxdnn::BindLayerNormBwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormBwdCpu, jaxdnn::RmsNormBwdImpl,
                              jaxdnn::BindRmsNormBwd(jaxdnn::BindWithThreadPool()));
