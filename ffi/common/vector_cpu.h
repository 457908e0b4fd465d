// A vector of 16 floats of the GCC/Clang vector extension, for the CPU kernels' hot loops: the
// compiler keeps it in registers (as plain float arrays, the AVX-512 build of the convolution's
// matmul kept its sums in memory) and splits it into what the target has (one AVX-512 register,
// two AVX2 ones, four SSE2 ones). Loads and stores are unaligned (the buffers are std::vector's,
// 16-byte aligned).
#pragma once

namespace jaxdnn {

constexpr int kVectorFloats = 16;
using FloatVector = float __attribute__((vector_size(kVectorFloats * sizeof(float))));

inline __attribute__((always_inline)) FloatVector LoadVector(const float* src) {
  FloatVector v;
  __builtin_memcpy(&v, src, sizeof(v));
  return v;
}
inline __attribute__((always_inline)) void StoreVector(const FloatVector& v, float* dst) {
  __builtin_memcpy(dst, &v, sizeof(v));
}

}  // namespace jaxdnn
