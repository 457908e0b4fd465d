// CUDA activations: a grid-stride elementwise kernel per (activation, dtype) with 16-byte accesses;
// the last n % 8 (or % 4) elements are handled one by one by the first threads.
#include <algorithm>

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

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(ActivationFwdCuda, jaxdnn::ActivationFwdImpl,
                              jaxdnn::BindActivationFwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(ActivationBwdCuda, jaxdnn::ActivationBwdImpl,
                              jaxdnn::BindActivationBwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
