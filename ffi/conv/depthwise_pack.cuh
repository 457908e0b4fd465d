// Device helpers of the depthwise kernels (depthwise.cu, depthwise_sm90.cu): packs of channels
// as floats, a square window's taps, and the fused epilogue's store of a pack.
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

// The 2 values of a 4-byte word of 16-bit T as floats (the wide windows' threads take 2 channels).
template <typename T>
__device__ __forceinline__ void Unpack(uint32_t word, float (&out)[2]) {
  const Pack<T, 2> pack = *reinterpret_cast<const Pack<T, 2>*>(&word);
  out[0] = ToFloat(pack.v[0]);
  out[1] = ToFloat(pack.v[1]);
}
template <>
__device__ __forceinline__ void Unpack<__nv_bfloat16>(uint32_t word, float (&out)[2]) {
  out[0] = __uint_as_float(word << 16);
  out[1] = __uint_as_float(word & 0xFFFF0000u);
}

// taps[t] = w[t, c0 .. c0 + kLanes) of a kWindow x kWindow window w [kWindow^2, channels] of
// 16-bit T as floats, or w[kWindow^2 - 1 - t] (the window reversed) when `flip`; zeros when not
// `active`.
template <typename T, int kWindow, int kLanes>
__device__ __forceinline__ void LoadTaps(const T* w, int64_t channels, int64_t c0, bool flip, bool active,
                                         float (&taps)[kWindow * kWindow][kLanes]) {
  constexpr int kTaps = kWindow * kWindow;
#pragma unroll
  for (int t = 0; t < kTaps; ++t) {
    const Pack<T, kLanes> pack =
        active ? *reinterpret_cast<const Pack<T, kLanes>*>(w + (flip ? kTaps - 1 - t : t) * channels + c0)
               : Pack<T, kLanes>{};
#pragma unroll
    for (int e = 0; e < kLanes; ++e) taps[t][e] = ToFloat(pack.v[e]);
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
