// A vector of 16 floats of the GCC/Clang vector extension, for the CPU kernels' hot loops: the
// compiler keeps it in registers (as plain float arrays, the AVX-512 build of the convolution's
// matmul kept its sums in memory) and splits it into what the target has (one AVX-512 register,
// two AVX2 ones, four SSE2 ones). Loads and stores are unaligned (the buffers are std::vector's,
// 16-byte aligned).
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/cpu_isa.h"

namespace jaxdnn {

constexpr int kVectorFloats = 16;
using FloatVector = float __attribute__((vector_size(kVectorFloats * sizeof(float))));

JAXDNN_ALWAYS_INLINE inline FloatVector LoadVector(const float* src) {
  FloatVector v;
  __builtin_memcpy(&v, src, sizeof(v));
  return v;
}
JAXDNN_ALWAYS_INLINE inline void StoreVector(const FloatVector& v, float* dst) {
  __builtin_memcpy(dst, &v, sizeof(v));
}

// Row reductions in kVectorFloats partial results, which vectorize (or at least run as independent
// chains) where one running value does not: without reassociation GCC keeps a reduction in order.
// Plain arrays, not FloatVector: GCC compiled FloatVector selects and lane reads element by element
// through the stack. Always inlined, to run in CallVectorized's variants.

// The largest of v[0, n), -inf for none; NaNs are passed over (comparisons with them fail).
JAXDNN_ALWAYS_INLINE inline float MaxOf(const float* v, int64_t n) {
  float part[kVectorFloats];
  for (float& p : part) p = -__builtin_inff();
  int64_t j = 0;
  for (; j + kVectorFloats <= n; j += kVectorFloats) {
    for (int k = 0; k < kVectorFloats; ++k) part[k] = part[k] < v[j + k] ? v[j + k] : part[k];
  }
  for (; j < n; ++j) part[0] = part[0] < v[j] ? v[j] : part[0];
  float max = part[0];
  for (float p : part) max = max < p ? p : max;
  return max;
}

// The sum of term(j) over [0, n): float partial sums over blocks of 1024 values, each block's total
// added in double (float rounding spans 64 values a partial sum). term is inlined (declare a lambda
// JAXDNN_ALWAYS_INLINE).
template <typename Term>
JAXDNN_ALWAYS_INLINE inline double SumOf(int64_t n, Term&& term) {
  double total = 0.0;
  for (int64_t j0 = 0; j0 < n; j0 += 1024) {
    const int64_t end = std::min<int64_t>(n, j0 + 1024);
    float part[kVectorFloats] = {};
    int64_t j = j0;
    for (; j + kVectorFloats <= end; j += kVectorFloats) {
      for (int k = 0; k < kVectorFloats; ++k) part[k] += term(j + k);
    }
    for (; j < end; ++j) part[0] += term(j);
    float block = 0.f;
    for (float p : part) block += p;
    total += block;
  }
  return total;
}

}  // namespace jaxdnn
