// The CPU kernels' matrix products: operand blocks packed into float strips, and a micro-kernel that
// keeps a kRows x (kStrips * 16) tile of sums in vector registers over the depth (each value of A
// loaded feeds a whole tile row). Shared by dense's GEMM and attention's tiles; the register tile of
// each build comes from CallForIsa's tag (kRows x kStrips: 8 x 2 for AVX-512, where 16 of the 32
// registers hold sums; 4 to 6 x 1 for AVX2/FMA; 2 x 1 for the baseline).
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/cpu_isa.h"
#include "common/half_cpu.h"
#include "common/vector_cpu.h"

namespace jaxdnn {

constexpr int kStripCols = kVectorFloats;  // columns of a register tile's strip (one FloatVector)

// out[0, kCount) = src[0, valid) as float, then zeros (src is read only below `valid`).
template <int kCount, typename T>
JAXDNN_ALWAYS_INLINE inline void CopyPadded(const T* src, int64_t valid, float* out) {
  if (valid == kCount) {
    for (int i = 0; i < kCount; ++i) out[i] = ToFloat(src[i]);
  } else {
    for (int i = 0; i < kCount; ++i) out[i] = i < valid ? ToFloat(src[std::min<int64_t>(i, valid - 1)]) : 0.f;
  }
}

// A [depth, width] block of a matrix, its element (p, i) at src[p * p_stride + i * i_stride] (one
// of the strides is 1), packed as strips of kWidth: out[strip][p][kWidth] in float, positions past
// `width` zeros (their sums are never read).
template <int kWidth, typename T>
JAXDNN_ALWAYS_INLINE inline void PackStrips(const T* src, int64_t p_stride, int64_t i_stride, int64_t depth,
                                            int64_t width, float* out) {
  for (int64_t strip = 0; strip < width; strip += kWidth, out += depth * kWidth) {
    const int64_t n = std::min<int64_t>(kWidth, width - strip);
    const T* first = src + strip * i_stride;
    if (i_stride == 1) {  // a strip's values of one depth are contiguous
      for (int64_t p = 0; p < depth; ++p) CopyPadded<kWidth>(first + p * p_stride, n, out + p * kWidth);
      continue;
    }
    for (int i = 0; i < kWidth; ++i) {  // p_stride is 1: a position's depth values are contiguous
      const T* line = first + std::min<int64_t>(i, n - 1) * i_stride;
      for (int64_t p = 0; p < depth; ++p) out[p * kWidth + i] = i < n ? ToFloat(line[p]) : 0.f;
    }
  }
}

// acc[kRows, kStrips * 16] (leading dimension ld) = (first ? 0 : acc) + a_strip . b_strip over
// `depth`, a_strip [depth][kRows] and b_strip [depth][kStrips * 16] (PackStrips' strips), each sum
// in order over the depth, kept in registers throughout.
template <int kRows, int kStrips>
JAXDNN_ALWAYS_INLINE inline void MicroKernel(const float* a_strip, const float* b_strip, int64_t depth, float* acc,
                                             int64_t ld, bool first) {
  FloatVector sum[kRows][kStrips];
  for (int i = 0; i < kRows; ++i) {
    for (int s = 0; s < kStrips; ++s) sum[i][s] = first ? FloatVector{} : LoadVector(acc + i * ld + s * kStripCols);
  }
  for (int64_t p = 0; p < depth; ++p) {
    FloatVector b[kStrips];
    for (int s = 0; s < kStrips; ++s) b[s] = LoadVector(b_strip + (p * kStrips + s) * kStripCols);
#pragma GCC unroll 16
    for (int i = 0; i < kRows; ++i) {
      const float a = a_strip[p * kRows + i];
      for (int s = 0; s < kStrips; ++s) sum[i][s] += a * b[s];
    }
  }
  for (int i = 0; i < kRows; ++i) {
    for (int s = 0; s < kStrips; ++s) StoreVector(sum[i][s], acc + i * ld + s * kStripCols);
  }
}

// acc[rows_padded, cols_padded] (leading dimension ld) = (first ? 0 : acc) + A . B for A packed as
// strips of kRows rows over `depth` and B as strips of kStrips * 16 columns (PackStrips), rows and
// columns rounded up to whole strips.
template <int kRows, int kStrips>
JAXDNN_ALWAYS_INLINE inline void StripProducts(const float* a, int64_t rows, const float* b, int64_t cols,
                                               int64_t depth, float* acc, int64_t ld, bool first) {
  constexpr int kCols = kStrips * kStripCols;
  for (int64_t j = 0; j < cols; j += kCols) {
    for (int64_t i = 0; i < rows; i += kRows) {
      MicroKernel<kRows, kStrips>(a + i * depth, b + j * depth, depth, acc + i * ld + j, ld, first);
    }
  }
}

// Rounds n up to a multiple of `to`.
constexpr int64_t RoundUp(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

}  // namespace jaxdnn
