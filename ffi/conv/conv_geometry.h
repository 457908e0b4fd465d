// The convolution's index maps, shared by the CPU kernels (host code) and the CUDA kernels (device
// code), so the CPU tests exercise the kernels' own padding, stride and dilation arithmetic.
//
// Layout (see conv.h): x, dx [N, D, H, W, C]; w, dw [T, U, V, Cg, K]; y, dy [N, P, Q, R, K].
// Spatial axis a in {0, 1, 2} = (d, h, w). Output coordinate o and window tap t read position
// j = o * stride + t * rhs_dilation - pad of the lhs-dilated input, which holds x[j / lhs_dilation]
// when j >= 0 is a multiple of lhs_dilation inside it, and zero everywhere else.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define JAXDNN_CONV_HD __host__ __device__ __forceinline__
#else
#define JAXDNN_CONV_HD inline
#endif

namespace jaxdnn {

// Sizes and steps per spatial axis; int64 throughout (the baseline kernels favour safety over speed).
struct ConvGeometry {
  int64_t batch = 0;     // N
  int64_t channels = 0;  // C = groups * Cg
  int64_t filters = 0;   // K = groups * Kg
  int64_t groups = 1;    // G
  int64_t in[3] = {0, 0, 0};      // D H W
  int64_t out[3] = {0, 0, 0};     // P Q R
  int64_t window[3] = {1, 1, 1};  // T U V
  int64_t stride[3] = {1, 1, 1};
  int64_t pad[3] = {0, 0, 0};     // low padding (negative crops)
  int64_t lhs_dilation[3] = {1, 1, 1};
  int64_t rhs_dilation[3] = {1, 1, 1};

  JAXDNN_CONV_HD int64_t GroupChannels() const { return channels / groups; }  // Cg
  JAXDNN_CONV_HD int64_t GroupFilters() const { return filters / groups; }    // Kg
  JAXDNN_CONV_HD int64_t Taps() const { return window[0] * window[1] * window[2]; }
  JAXDNN_CONV_HD int64_t InPixels() const { return batch * in[0] * in[1] * in[2]; }
  JAXDNN_CONV_HD int64_t OutPixels() const { return batch * out[0] * out[1] * out[2]; }

  // A 1x1 window with unit strides, no padding or lhs dilation, one group: a GEMM over the pixels,
  // y[pixels, K] = x[pixels, C] . w[C, K].
  JAXDNN_CONV_HD bool IsPointwise() const {
    for (int a = 0; a < 3; ++a) {
      if (window[a] != 1 || stride[a] != 1 || pad[a] != 0 || lhs_dilation[a] != 1) return false;
    }
    return groups == 1;
  }

  // The input coordinate on axis a that output coordinate o reads through window tap t, or -1
  // where it reads padding or a hole of the lhs dilation.
  JAXDNN_CONV_HD int64_t InputAt(int a, int64_t o, int64_t t) const {
    const int64_t j = o * stride[a] + t * rhs_dilation[a] - pad[a];  // position in x~
    if (j < 0 || j % lhs_dilation[a] != 0) return -1;
    const int64_t i = j / lhs_dilation[a];
    return i < in[a] ? i : -1;
  }

  // The output coordinate on axis a that reads input coordinate i through window tap t, or -1 when
  // none does (the inverse of InputAt: dgrad gathers with it).
  JAXDNN_CONV_HD int64_t OutputAt(int a, int64_t i, int64_t t) const {
    const int64_t j = i * lhs_dilation[a] + pad[a] - t * rhs_dilation[a];  // o * stride
    if (j < 0 || j % stride[a] != 0) return -1;
    const int64_t o = j / stride[a];
    return o < out[a] ? o : -1;
  }

  // The input pixel that output pixel o reads through tap (t0, t1, t2), as an element offset of
  // its channel 0 in x, or -1.
  JAXDNN_CONV_HD int64_t InputOffset(int64_t n, const int64_t o[3], const int64_t t[3]) const {
    const int64_t i0 = InputAt(0, o[0], t[0]), i1 = InputAt(1, o[1], t[1]), i2 = InputAt(2, o[2], t[2]);
    if (i0 < 0 || i1 < 0 || i2 < 0) return -1;
    return (((n * in[0] + i0) * in[1] + i1) * in[2] + i2) * channels;
  }

  // The output pixel that reads input pixel i through tap t, as an element offset of its feature 0
  // in y, or -1.
  JAXDNN_CONV_HD int64_t OutputOffset(int64_t n, const int64_t i[3], const int64_t t[3]) const {
    const int64_t o0 = OutputAt(0, i[0], t[0]), o1 = OutputAt(1, i[1], t[1]), o2 = OutputAt(2, i[2], t[2]);
    if (o0 < 0 || o1 < 0 || o2 < 0) return -1;
    return (((n * out[0] + o0) * out[1] + o1) * out[2] + o2) * filters;
  }
};

// Splits a row-major index over [sizes[0], sizes[1], sizes[2]] (with a leading axis of any size)
// into its three trailing coordinates; returns the leading one.
JAXDNN_CONV_HD int64_t SplitIndex(int64_t index, const int64_t sizes[3], int64_t at[3]) {
  for (int a = 2; a >= 0; --a) {
    const int64_t next = index / sizes[a];
    at[a] = index - next * sizes[a];
    index = next;
  }
  return index;
}

}  // namespace jaxdnn
