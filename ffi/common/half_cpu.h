// bfloat16 / float16 storage types for the CPU kernels, with round-to-nearest-even conversions.
// The FFI hands both over as raw 16-bit words; these tags keep the two apart in templates.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/cpu_isa.h"

namespace jaxdnn {

struct Bf16 { uint16_t bits; };
struct Half { uint16_t bits; };

JAXDNN_ALWAYS_INLINE inline uint32_t FloatBits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
JAXDNN_ALWAYS_INLINE inline float BitsFloat(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

JAXDNN_ALWAYS_INLINE inline float ToFloat(float v) { return v; }
JAXDNN_ALWAYS_INLINE inline float ToFloat(Bf16 v) { return BitsFloat(uint32_t(v.bits) << 16); }
// The conversions of Half compute every case and select one (no branches), so that the loops
// over arrays of it vectorize.
JAXDNN_ALWAYS_INLINE inline float ToFloat(Half v) {
  const uint32_t sign = uint32_t(v.bits & 0x8000) << 16;
  const uint32_t exponent = (v.bits >> 10) & 0x1f;
  const uint32_t mantissa = v.bits & 0x3ff;
  const uint32_t subnormal = sign | FloatBits(float(mantissa) * 0x1p-24f);  // zero too; exact
  const uint32_t special = sign | 0x7f800000u | (mantissa << 13);          // inf / nan
  const uint32_t normal = sign | ((exponent + 112) << 23) | (mantissa << 13);
  return BitsFloat(exponent == 0 ? subnormal : (exponent == 31 ? special : normal));
}

template <typename T> T FromFloat(float v);
template <> JAXDNN_ALWAYS_INLINE inline float FromFloat<float>(float v) { return v; }
template <> JAXDNN_ALWAYS_INLINE inline Bf16 FromFloat<Bf16>(float v) {
  uint32_t u = FloatBits(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{uint16_t((u >> 16) | 0x40)};  // quiet nan
  u += 0x7fffu + ((u >> 16) & 1u);
  return Bf16{uint16_t(u >> 16)};
}
template <> JAXDNN_ALWAYS_INLINE inline Half FromFloat<Half>(float v) {
  uint32_t u = FloatBits(v);
  const uint32_t sign = (u >> 16) & 0x8000;
  u &= 0x7fffffffu;
  // A result in the subnormal range or zero: v * 2^24 rounded to an integer (to nearest even: the
  // sum with 1.5 * 2^23 has no fraction bits; v * 2^24 < 1024 there).
  const float scaled = BitsFloat(u < 0x38800000u ? u : 0u) * 0x1p24f;
  const uint32_t subnormal = uint32_t(int32_t((scaled + 0x1.8p23f) - 0x1.8p23f));
  // Normal: rebias the exponent (127 -> 15) and round to nearest even.
  const uint32_t normal = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;
  const uint32_t magnitude = u > 0x7f800000u    ? 0x7e00u                    // nan
                             : u >= 0x477ff000u ? 0x7c00u                    // rounds to inf
                             : u < 0x38800000u  ? subnormal : normal;
  return Half{uint16_t(sign | magnitude)};
}

}  // namespace jaxdnn
