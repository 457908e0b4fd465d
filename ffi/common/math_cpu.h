// float32 exp, expm1, log1p, erfc and tanh for the CPU kernels' elementwise loops, written without
// branches or calls (every case computed, then selected) so that GCC vectorizes the loops that use
// them; libm's functions are calls, one value at a time. Largest errors against float64's functions
// over dense grids (2e7 points, 2026-11-29): exp 0.98 ulp, expm1 3.3, log1p 2.4, erfc 7.8, tanh
// 1.3; tests/test_activation.py holds the activations built on them to a few ulp elementwise.
// NaN in, NaN out; +-inf give the limits.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/cpu_isa.h"

namespace jaxdnn {
namespace host_math {

JAXDNN_ALWAYS_INLINE inline float AsFloat(int32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
JAXDNN_ALWAYS_INLINE inline int32_t AsInt(float f) {
  int32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}
// min / max that keep a NaN first operand (as the comparisons fail for it).
JAXDNN_ALWAYS_INLINE inline float Min(float x, float bound) { return bound < x ? bound : x; }
JAXDNN_ALWAYS_INLINE inline float Max(float x, float bound) { return x < bound ? bound : x; }

}  // namespace host_math

// exp(x) = 2^n exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 in two parts so
// that n ln 2 is exact), exp(r) a degree-6 polynomial (Cephes' expf). 2^n is two normal powers of
// two, so results in the subnormal range round once more but are not flushed. x is clamped to
// [-104, 89]: exp(-104) rounds to 0 and exp(89) overflows to inf, as exp of anything beyond does.
JAXDNN_ALWAYS_INLINE inline float HostExp(float x) {
  using namespace host_math;
  const float xc = Min(Max(x, -104.f), 89.f);
  // Rounds to the nearest integer in the default rounding mode (1.5 * 2^23: the sum has no
  // fraction bits), exact for |x / ln2| < 2^22.
  const float n = (xc * 1.44269504088896341f + 12582912.f) - 12582912.f;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const int32_t ni = static_cast<int32_t>(n == n ? n : 0.f);  // in [-150, 129]; a NaN's p is NaN
  const int32_t half = ni >> 1;
  return p * AsFloat((half + 127) << 23) * AsFloat((ni - half + 127) << 23);
}

// exp(x) - 1: below 0.35 in magnitude its Taylor polynomial to x^7 (no cancellation), above
// HostExp(x) - 1 (whose cancellation costs at most a factor of 2.4 in relative error there).
JAXDNN_ALWAYS_INLINE inline float HostExpm1(float x) {
  float p = 1.f / 5040.f;
  p = p * x + 1.f / 720.f;
  p = p * x + 1.f / 120.f;
  p = p * x + 1.f / 24.f;
  p = p * x + 1.f / 6.f;
  p = p * x + 0.5f;
  const float small = x + x * x * p;
  const float large = HostExp(x) - 1.f;
  return (x < 0.35f && x > -0.35f) ? small : large;
}

// log(x) for x > 0 normal (log1p's use): x = m 2^e with m in [sqrt(1/2), sqrt(2)), log(m) = f -
// f^2 / 2 + f^3 P(f), f = m - 1 (Cephes' logf); e ln 2 in two parts.
JAXDNN_ALWAYS_INLINE inline float HostLogNormal(float x) {
  using namespace host_math;
  const int32_t bits = AsInt(x);
  int32_t e = ((bits >> 23) & 0xff) - 127;
  float m = AsFloat((bits & 0x007fffff) | 0x3f800000);  // [1, 2)
  const bool upper = m > 1.41421356f;
  m = upper ? 0.5f * m : m;
  e = upper ? e + 1 : e;
  const float f = m - 1.f;
  const float f2 = f * f;
  float p = 7.0376836292e-2f;
  p = p * f - 1.1514610310e-1f;
  p = p * f + 1.1676998740e-1f;
  p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f;
  p = p * f - 1.6668057665e-1f;
  p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f;
  p = p * f + 3.3333331174e-1f;
  const float ef = static_cast<float>(e);
  float y = p * f * f2 + ef * -2.12194440e-4f - 0.5f * f2;
  return f + y + ef * 0.693359375f;
}

// log(1 + x) for x in [0, inf] (softplus' use, x = exp(-|v|)): with w = 1 + x rounded,
// log(w) x / (w - 1) corrects w's rounding (Goldberg's trick); x itself where w rounds to 1.
JAXDNN_ALWAYS_INLINE inline float HostLog1p(float x) {
  const float w = 1.f + x;
  const float d = w - 1.f;
  const float corrected = HostLogNormal(w) * (x / (d == 0.f ? 1.f : d));
  return d == 0.f ? x : (w == __builtin_inff() ? w : corrected);
}

// erfc(x): below 0.5 in magnitude 1 - x P(x^2) (erf's Taylor-like polynomial, fitted on [0, 0.5]);
// above, for a = |x|, t exp(-a^2 + Q(t)) with t = 1 / (1 + a / 2) (Numerical Recipes' erfcc form,
// Q of degree 9 refitted, 4.6e-8 from log(erfc(a) / t) + a^2 in float64 for a <= 10.1) and
// erfc(-a) = 2 - erfc(a). a^2 is split as ah^2 + (a - ah)(a + ah), ah a's 12 leading bits (so that
// ah^2 is exact): the rounding of a^2 alone cost up to 128 ulp near a = 9.
JAXDNN_ALWAYS_INLINE inline float HostErfc(float x) {
  using namespace host_math;
  const float a = Min(x < 0.f ? -x : x, 10.1f);  // erfc(10.1) rounds to 0, as beyond
  const float t = 1.f / (1.f + 0.5f * a);
  float q = 1.436766285e-01f;
  q = q * t - 6.741964291e-01f;
  q = q * t + 1.141695196e+00f;
  q = q * t - 6.771512806e-01f;
  q = q * t - 9.516454781e-02f;
  q = q * t + 8.594853186e-03f;
  q = q * t + 3.234353975e-02f;
  q = q * t + 3.870567422e-01f;
  q = q * t + 9.985917170e-01f;
  q = q * t - 1.265446373e+00f;
  const float ah = AsFloat(AsInt(a) & ~int32_t{0xfff});
  const float tail = t * HostExp(-ah * ah) * HostExp(q - (a - ah) * (a + ah));
  const float s = x * x;
  float p = 4.718030117e-03f;
  p = p * s - 2.675720680e-02f;
  p = p * s + 1.128282323e-01f;
  p = p * s - 3.761260860e-01f;
  p = p * s + 1.128379166e+00f;
  const float center = 1.f - x * p;
  return a < 0.5f ? center : (x < 0.f ? 2.f - tail : tail);
}

// tanh(x): below 0.625 in magnitude x + x^3 P(x^2) (P fitted to (tanh x - x) / x^3, least squares
// on Chebyshev nodes reweighted towards minimax), above 1 - 2 / (exp(2|x|) + 1), exactly 1 past
// exp's overflow; odd, -0 for -0.
JAXDNN_ALWAYS_INLINE inline float HostTanh(float x) {
  const float a = x < 0.f ? -x : x;
  const float s = a * a;
  const float p = (((-0.005704991985f * s + 0.02063909173f) * s - 0.05373971537f) * s + 0.1333144158f) * s -
                  0.3333328068f;
  const float small = a + a * s * p;
  const float large = 1.f - 2.f / (HostExp(2.f * a) + 1.f);
  const float t = a < 0.625f ? small : large;
  return x < 0.f ? -t : (x > 0.f ? t : x);  // x itself for +-0 and NaN
}

}  // namespace jaxdnn
