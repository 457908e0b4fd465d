// bfloat16 / float16 storage types for the CPU kernels, with round-to-nearest-even conversions.
// The FFI hands both over as raw 16-bit words; these tags keep the two apart in templates.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace jaxdnn {

struct Bf16 { uint16_t bits; };
struct Half { uint16_t bits; };

inline uint32_t FloatBits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float BitsFloat(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float ToFloat(float v) { return v; }
inline float ToFloat(Bf16 v) { return BitsFloat(uint32_t(v.bits) << 16); }
inline float ToFloat(Half v) {
  uint32_t sign = uint32_t(v.bits & 0x8000) << 16;
  uint32_t exponent = (v.bits >> 10) & 0x1f;
  uint32_t mantissa = v.bits & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    float magnitude = std::ldexp(float(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return BitsFloat(sign | 0x7f800000u | (mantissa << 13));  // inf / nan
  return BitsFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

template <typename T> T FromFloat(float v);
template <> inline float FromFloat<float>(float v) { return v; }
template <> inline Bf16 FromFloat<Bf16>(float v) {
  uint32_t u = FloatBits(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{uint16_t((u >> 16) | 0x40)};  // quiet nan
  u += 0x7fffu + ((u >> 16) & 1u);
  return Bf16{uint16_t(u >> 16)};
}
template <> inline Half FromFloat<Half>(float v) {
  uint32_t u = FloatBits(v);
  uint16_t sign = uint16_t((u >> 16) & 0x8000);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return Half{uint16_t(sign | 0x7e00)};  // nan
  if (u >= 0x477ff000u) return Half{uint16_t(sign | 0x7c00)};  // rounds to inf
  if (u < 0x38800000u) {  // result is subnormal or zero: round v * 2^24 to an integer
    return Half{uint16_t(sign | uint16_t(std::nearbyint(BitsFloat(u) * 16777216.0f)))};
  }
  u += 0xc8000fffu + ((u >> 13) & 1u);  // rebias the exponent (127 -> 15) and round to nearest even
  return Half{uint16_t(sign | (u >> 13))};
}

}  // namespace jaxdnn
