// Device helpers of the depthwise kernels (depthwise.cu, depthwise_sm90.cu): packs of channels
// as floats, a 3 x 3 window's taps, and the fused epilogue's store of a pack.
#pragma once

#include <cstdint>

#include "common/activation.h"
#include "common/cuda_common.cuh"
#include "conv/conv_epilogue.h"

namespace jaxdnn {

// The 8 values of a 16-byte vector of 16-bit T as floats.
template <typename T>
__device__ __forceinline__ void Unpack(const uint4& word, float (&out)[8]) {
  const Pack<T, 8> pack = *reinterpret_cast<const Pack<T, 8>*>(&word);
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = ToFloat(pack.v[e]);
}
// bfloat16 is float32's upper half: each value is one shift or one mask of its 32-bit word (the
// generic path extracts each half, then moves it up: two instructions a value).
template <>
__device__ __forceinline__ void Unpack<__nv_bfloat16>(const uint4& word, float (&out)[8]) {
  const uint32_t words[4] = {word.x, word.y, word.z, word.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);
    out[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  }
}

// taps[t] = w[t, c0 .. c0 + 8) of a 3 x 3 window w [9, channels] of 16-bit T as floats, or
// w[8 - t] (the window reversed) when `flip`; zeros when not `active`.
template <typename T>
__device__ __forceinline__ void LoadTaps3x3(const T* w, int64_t channels, int64_t c0, bool flip, bool active,
                                            float (&taps)[9][8]) {
#pragma unroll
  for (int t = 0; t < 9; ++t) {
    const Pack<T, 8> pack = active ? *reinterpret_cast<const Pack<T, 8>*>(w + (flip ? 8 - t : t) * channels + c0)
                                   : Pack<T, 8>{};
#pragma unroll
    for (int e = 0; e < 8; ++e) taps[t][e] = ToFloat(pack.v[e]);
  }
}

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

}  // namespace jaxdnn
