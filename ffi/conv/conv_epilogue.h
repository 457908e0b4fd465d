// The fused epilogue of the forward convolution, shared by the CPU kernels (host code) and the
// CUDA kernels (device code): y = act(acc + bias[k] + residual[n, p, q, r, k]) on the float32
// accumulator, rounded once to y's dtype. The plain forward is the identity with no operands.
#pragma once

#include <cstdint>

#include "common/activation.h"

#ifdef __CUDACC__
#include "common/cuda_common.cuh"
#define JAXDNN_CONV_EPILOGUE_HD __device__ __forceinline__
#else
#include "common/half_cpu.h"
#define JAXDNN_CONV_EPILOGUE_HD inline
#endif

namespace jaxdnn {

template <typename T>
struct ConvEpilogue {
  const T* bias = nullptr;      // [K], or none
  const T* residual = nullptr;  // [N, P, Q, R, K] (y's layout), or none
  int64_t activation = 0;       // an Activation (common/activation.h); 0 = identity
  float activation_param = 0.0f;

  // y[y_index] (output feature k) from its accumulator.
  JAXDNN_CONV_EPILOGUE_HD float Apply(float acc, int64_t y_index, int64_t k) const {
    if (bias != nullptr) acc += ToFloat(bias[k]);
    if (residual != nullptr) acc += ToFloat(residual[y_index]);
    return activation == 0 ? acc : ActivateKind(activation, acc, activation_param);
  }
};

#ifdef __CUDACC__
// out[index .. index + kVec) = act(acc + bias[k0 ..] + residual[index ..]) for kVec consecutive
// features from k0, rounded once and stored as one aligned access (the depthwise kernels' packs).
template <typename T, int kVec>
__device__ __forceinline__ void StoreOutputPack(const ConvEpilogue<T>& epilogue, float (&acc)[kVec], int64_t index,
                                                int64_t k0, T* out) {
  if (epilogue.bias != nullptr) {
    const Pack<T, kVec> bias = *reinterpret_cast<const Pack<T, kVec>*>(epilogue.bias + k0);
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] += ToFloat(bias.v[e]);
  }
  if (epilogue.residual != nullptr) {
    const Pack<T, kVec> residual = *reinterpret_cast<const Pack<T, kVec>*>(epilogue.residual + index);
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] += ToFloat(residual.v[e]);
  }
  if (epilogue.activation != 0) ActivateKindN(epilogue.activation, acc, epilogue.activation_param);
  Pack<T, kVec> pack;
#pragma unroll
  for (int e = 0; e < kVec; ++e) pack.v[e] = FromFloat<T>(acc[e]);
  StoreWords(out + index, pack);
}
#endif  // __CUDACC__

}  // namespace jaxdnn
