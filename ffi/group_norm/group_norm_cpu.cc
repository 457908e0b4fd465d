// CPU GroupNorm: the CUDA kernels' decomposition (per-chunk channel sums in the workspace, then
// per-group reductions over the chunks, then an elementwise pass), with contiguous loops over the
// channels. The oracle-checked path CI runs. The sums and the elementwise passes take the (sample,
// chunk) items on XLA's intra-op threads: each item's sums have a workspace slot of their own and
// are added over the chunks in order afterwards, so the results do not depend on the threads.
#include <algorithm>
#include <vector>

#include "common/activation.h"
#include "common/cpu_isa.h"
#include "common/half_cpu.h"
#include "common/parallel_cpu.h"
#include "group_norm/group_norm.h"
#include "group_norm/group_norm_common.h"

namespace jaxdnn {
namespace {

// Channel c's value of a per-group array (K channels a group).
inline float OfGroup(const float* per_group, int64_t c, int64_t group_size) {
  return per_group[c / group_size];
}

// sum over the chunks and the group's channels of weight[c] * workspace[n, p, s, c] (weight null: 1).
float GroupSum(const float* sample_ws, const GroupNormShape& shape, int64_t group, int s,
               const float* weight) {
  float total = 0.f;
  for (int64_t p = 0; p < shape.chunks; ++p) {
    const float* sums = sample_ws + (p * 2 + s) * shape.channels + group * shape.group_size;
    for (int64_t k = 0; k < shape.group_size; ++k) {
      total += weight ? weight[group * shape.group_size + k] * sums[k] : sums[k];
    }
  }
  return total;
}

// fn(n, p) for every chunk p of every sample n, as items on the intra-op threads.
template <typename Fn>
void ForChunks(ffi::ThreadPool& pool, const GroupNormShape& shape, const Fn& fn) {
  ParallelFor(pool, shape.batch * shape.chunks,
              [&](int64_t item) { fn(item / shape.chunks, item % shape.chunks); });
}

// Every per-position loop runs in CallVectorized's variant (common/cpu_isa.h), with the activation
// a compile-time constant and the per-group values spread over the channels first (an integer
// division by the group size in a loop keeps it scalar): arrays [N, C].
template <typename T, Activation kAct>
void GroupNormFwd(ffi::ThreadPool& pool, const T* x, const float* scale, const float* bias, T* y, float* mean,
                  float* rstd, float* workspace, const GroupNormShape& shape, float epsilon, float param) {
  const int64_t c_count = shape.channels, k_size = shape.group_size, sample = shape.spatial * c_count;
  std::vector<float> shift(shape.batch * c_count), m(shape.batch * c_count), a(shape.batch * c_count);
  // Each group's shift is its first element (see GroupMoments).
  for (int64_t n = 0; n < shape.batch; ++n) {
    for (int64_t c = 0; c < c_count; ++c) {
      shift[n * c_count + c] = shape.spatial > 0 ? ToFloat(x[n * sample + (c / k_size) * k_size]) : 0.f;
    }
  }
  ForChunks(pool, shape, [&](int64_t n, int64_t p) {
    const T* xn = x + n * sample;
    const float* shift_n = &shift[n * c_count];
    float* sums = workspace + (n * shape.chunks + p) * 2 * c_count;
    float* squares = sums + c_count;
    CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
      for (int64_t c = 0; c < c_count; ++c) sums[c] = squares[c] = 0.f;
      for (int64_t s = ChunkBegin(shape, p); s < ChunkBegin(shape, p + 1); ++s) {
        const T* row = xn + s * c_count;
        for (int64_t c = 0; c < c_count; ++c) {
          const float v = ToFloat(row[c]) - shift_n[c];
          sums[c] += v;
          squares[c] += v * v;
        }
      }
    });
  });
  for (int64_t n = 0; n < shape.batch; ++n) {
    const float* ws = workspace + n * shape.chunks * 2 * c_count;
    float* mean_n = mean + n * shape.groups;
    float* rstd_n = rstd + n * shape.groups;
    for (int64_t g = 0; g < shape.groups; ++g) {
      GroupMoments(GroupSum(ws, shape, g, 0, nullptr), GroupSum(ws, shape, g, 1, nullptr),
                   shift[n * c_count + g * k_size], shape.spatial * k_size, epsilon, &mean_n[g], &rstd_n[g]);
    }
    // y = act((x - mean) * a + bias) with a = rstd * scale, per channel.
    for (int64_t c = 0; c < c_count; ++c) {
      m[n * c_count + c] = OfGroup(mean_n, c, k_size);
      a[n * c_count + c] = OfGroup(rstd_n, c, k_size) * scale[c];
    }
  }
  ForChunks(pool, shape, [&](int64_t n, int64_t p) {
    const T* xn = x + n * sample;
    T* yn = y + n * sample;
    const float *m_n = &m[n * c_count], *a_n = &a[n * c_count];
    CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
      for (int64_t s = ChunkBegin(shape, p); s < ChunkBegin(shape, p + 1); ++s) {
        for (int64_t c = 0; c < c_count; ++c) {
          const float pre = (ToFloat(xn[s * c_count + c]) - m_n[c]) * a_n[c] + bias[c];
          yn[s * c_count + c] = FromFloat<T>(Activate<kAct>(pre, param));
        }
      }
    });
  });
}

// With xhat = (x - mean) * rstd, d = dy * act'(xhat * scale + bias) and g = d * scale, per group:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),
// and dscale = sum(d * xhat), dbias = sum(d) over samples and positions.
template <typename T, Activation kAct>
void GroupNormBwd(ffi::ThreadPool& pool, const T* dy, const T* x, const float* scale, const float* bias,
                  const float* mean, const float* rstd, T* dx, float* dscale, float* dbias,
                  float* workspace, float* group_sums, const GroupNormShape& shape, float param) {
  const int64_t c_count = shape.channels, k_size = shape.group_size, sample = shape.spatial * c_count;
  const int64_t n_c = shape.batch * c_count;  // the [N, C] arrays' size
  std::vector<float> mean_c(n_c), rstd_c(n_c), mean_g_c(n_c), mean_g_xhat_c(n_c);
  for (int64_t n = 0; n < shape.batch; ++n) {
    for (int64_t c = 0; c < c_count; ++c) {
      mean_c[n * c_count + c] = OfGroup(mean + n * shape.groups, c, k_size);
      rstd_c[n * c_count + c] = OfGroup(rstd + n * shape.groups, c, k_size);
    }
  }
  // d = dy * act'(xhat * scale + bias) of sample n's channel c at element `e` of the sample; its xhat
  // to *xhat.
  auto position = [&](int64_t n, int64_t e, int64_t c, float* xhat) JAXDNN_ALWAYS_INLINE {
    *xhat = (ToFloat(x[n * sample + e]) - mean_c[n * c_count + c]) * rstd_c[n * c_count + c];
    const float d = ToFloat(dy[n * sample + e]);
    return kAct == Activation::kIdentity ? d : d * ActivateGrad<kAct>(*xhat * scale[c] + bias[c], param);
  };
  ForChunks(pool, shape, [&](int64_t n, int64_t p) {
    float* d_xhat = workspace + (n * shape.chunks + p) * 2 * c_count;
    float* d_sum = d_xhat + c_count;
    CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
      for (int64_t c = 0; c < c_count; ++c) d_xhat[c] = d_sum[c] = 0.f;
      for (int64_t s = ChunkBegin(shape, p); s < ChunkBegin(shape, p + 1); ++s) {
        for (int64_t c = 0; c < c_count; ++c) {
          float xhat;
          const float d = position(n, s * c_count + c, c, &xhat);
          d_xhat[c] += d * xhat;
          d_sum[c] += d;
        }
      }
    });
  });
  const float count = float(shape.spatial * k_size);
  std::vector<float> mean_g(shape.groups), mean_g_xhat(shape.groups);
  for (int64_t n = 0; n < shape.batch; ++n) {
    const float* ws = workspace + n * shape.chunks * 2 * c_count;
    float* sums_n = group_sums + n * shape.groups * 2;
    for (int64_t g = 0; g < shape.groups; ++g) {
      sums_n[2 * g] = GroupSum(ws, shape, g, 0, scale);      // sum(g * xhat)
      sums_n[2 * g + 1] = GroupSum(ws, shape, g, 1, scale);  // sum(g)
      mean_g_xhat[g] = sums_n[2 * g] / count;
      mean_g[g] = sums_n[2 * g + 1] / count;
    }
    for (int64_t c = 0; c < c_count; ++c) {
      mean_g_c[n * c_count + c] = OfGroup(mean_g.data(), c, k_size);
      mean_g_xhat_c[n * c_count + c] = OfGroup(mean_g_xhat.data(), c, k_size);
    }
  }
  ForChunks(pool, shape, [&](int64_t n, int64_t p) {
    const float *rstd_n = &rstd_c[n * c_count], *mean_g_n = &mean_g_c[n * c_count];
    const float* mean_g_xhat_n = &mean_g_xhat_c[n * c_count];
    T* dx_n = dx + n * sample;
    CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
      for (int64_t s = ChunkBegin(shape, p); s < ChunkBegin(shape, p + 1); ++s) {
        for (int64_t c = 0; c < c_count; ++c) {
          float xhat;
          const float g = position(n, s * c_count + c, c, &xhat) * scale[c];
          dx_n[s * c_count + c] = FromFloat<T>(rstd_n[c] * (g - mean_g_n[c] - xhat * mean_g_xhat_n[c]));
        }
      }
    });
  });
  // dscale and dbias: the workspace summed over samples and chunks, in double.
  std::vector<double> dscale_acc(c_count, 0.0), dbias_acc(c_count, 0.0);
  for (int64_t part = 0; part < shape.batch * shape.chunks; ++part) {
    const float* sums = workspace + part * 2 * c_count;
    for (int64_t c = 0; c < c_count; ++c) {
      dscale_acc[c] += sums[c];
      dbias_acc[c] += sums[c_count + c];
    }
  }
  for (int64_t c = 0; c < c_count; ++c) {
    dscale[c] = float(dscale_acc[c]);
    dbias[c] = float(dbias_acc[c]);
  }
}

// A parameter (float32 or x's dtype T) as floats.
template <typename T>
std::vector<float> ParamFloats(const ffi::AnyBuffer& param) {
  const size_t size = param.element_count();
  std::vector<float> out(size);
  if (param.element_type() == ffi::DataType::F32) {
    const float* p = static_cast<const float*>(param.untyped_data());
    out.assign(p, p + size);
  } else {
    const T* p = static_cast<const T*>(param.untyped_data());
    for (size_t i = 0; i < size; ++i) out[i] = ToFloat(p[i]);
  }
  return out;
}

// Stores `values` to a parameter's gradient (float32 or x's dtype T).
template <typename T>
void StoreParam(const std::vector<float>& values, ffi::Result<ffi::AnyBuffer>& out) {
  if (out->element_type() == ffi::DataType::F32) {
    std::copy(values.begin(), values.end(), static_cast<float*>(out->untyped_data()));
  } else {
    T* p = static_cast<T*>(out->untyped_data());
    for (size_t i = 0; i < values.size(); ++i) p[i] = FromFloat<T>(values[i]);
  }
}

ffi::Error GroupNormFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::F32>> mean,
                            ffi::Result<ffi::Buffer<ffi::F32>> rstd,
                            ffi::Result<ffi::Buffer<ffi::F32>> workspace, float epsilon,
                            int64_t num_groups, int64_t activation, float activation_param) {
  GroupNormShape shape;
  JAXDNN_RETURN_IF_ERROR(CheckGroupNormFwd(x, scale, bias, *y, *mean, *rstd, *workspace, num_groups,
                                           activation, &shape));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const std::vector<float> scale_f = ParamFloats<T>(scale), bias_f = ParamFloats<T>(bias);
    DispatchActivation(activation, [&](auto act) {
      GroupNormFwd<T, decltype(act)::value>(pool, static_cast<const T*>(x.untyped_data()), scale_f.data(),
                                            bias_f.data(), static_cast<T*>(y->untyped_data()), mean->typed_data(),
                                            rstd->typed_data(), workspace->typed_data(), shape, epsilon,
                                            activation_param);
    });
    return ffi::Error::Success();
  });
}

ffi::Error GroupNormBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                            ffi::AnyBuffer bias, ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> rstd,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dscale,
                            ffi::Result<ffi::AnyBuffer> dbias,
                            ffi::Result<ffi::Buffer<ffi::F32>> workspace,
                            ffi::Result<ffi::Buffer<ffi::F32>> group_sums, int64_t num_groups,
                            int64_t activation, float activation_param) {
  GroupNormShape shape;
  JAXDNN_RETURN_IF_ERROR(CheckGroupNormBwd(dy, x, scale, bias, mean, rstd, *dx, *dscale, *dbias,
                                           *workspace, *group_sums, num_groups, activation, &shape));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    std::vector<float> dscale_f(shape.channels), dbias_f(shape.channels);
    const std::vector<float> scale_f = ParamFloats<T>(scale), bias_f = ParamFloats<T>(bias);
    DispatchActivation(activation, [&](auto act) {
      GroupNormBwd<T, decltype(act)::value>(pool, static_cast<const T*>(dy.untyped_data()),
                                            static_cast<const T*>(x.untyped_data()), scale_f.data(), bias_f.data(),
                                            mean.typed_data(), rstd.typed_data(), static_cast<T*>(dx->untyped_data()),
                                            dscale_f.data(), dbias_f.data(), workspace->typed_data(),
                                            group_sums->typed_data(), shape, activation_param);
    });
    StoreParam<T>(dscale_f, dscale);
    StoreParam<T>(dbias_f, dbias);
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupNormFwdCpu, jaxdnn::GroupNormFwdImpl,
                              jaxdnn::BindGroupNormFwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupNormBwdCpu, jaxdnn::GroupNormBwdImpl,
                              jaxdnn::BindGroupNormBwd(jaxdnn::BindWithThreadPool()));
