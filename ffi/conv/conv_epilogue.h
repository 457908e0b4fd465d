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

}  // namespace jaxdnn
