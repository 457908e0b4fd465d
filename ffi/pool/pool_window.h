// The pooling algorithm for one pixel and a group of V adjacent channels, shared by the CPU kernels
// (compiled as host code) and the CUDA kernels (as device code), so the CPU tests exercise the
// kernels' own index arithmetic, tie-breaking and accumulation order.
//
// Layout: x and dx are [N, D, H, W, C], y, dy and argmax [N, P, Q, R, C], channels contiguous.
// The forward visits each output's window; the backward is a gather: each input element visits the
// (few) windows that cover it and sums their dy, so no two threads ever write the same element.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#include "common/cuda_common.cuh"
#define JAXDNN_POOL_HD __host__ __device__ __forceinline__
#define JAXDNN_POOL_FN __device__ __forceinline__
#define JAXDNN_POOL_UNROLL _Pragma("unroll")
#else
#include <cstring>

#include "common/half_cpu.h"
#define JAXDNN_POOL_HD inline
#define JAXDNN_POOL_FN inline
#define JAXDNN_POOL_UNROLL _Pragma("GCC unroll 16")
#endif

namespace jaxdnn {

// Sizes per spatial axis (d, h, w); all fit int (checked when the geometry is made).
struct PoolGeometry {
  int64_t batch = 0;     // N: every leading axis folded
  int64_t channels = 0;  // C
  int in[3] = {0, 0, 0};      // D H W
  int out[3] = {0, 0, 0};     // P Q R
  int window[3] = {1, 1, 1};
  int stride[3] = {1, 1, 1};
  int pad[3] = {0, 0, 0};     // low padding: window o starts at o * stride - pad

  JAXDNN_POOL_HD int WindowVolume() const { return window[0] * window[1] * window[2]; }
  JAXDNN_POOL_HD int64_t InPixels() const { return batch * in[0] * in[1] * int64_t(in[2]); }
  JAXDNN_POOL_HD int64_t OutPixels() const { return batch * out[0] * out[1] * int64_t(out[2]); }
  JAXDNN_POOL_HD int64_t InOffset(int64_t n, int d, int h, int w) const {
    return (((n * in[0] + d) * in[1] + h) * int64_t(in[2]) + w) * channels;
  }
  JAXDNN_POOL_HD int64_t OutOffset(int64_t n, int p, int q, int r) const {
    return (((n * out[0] + p) * out[1] + q) * int64_t(out[2]) + r) * channels;
  }

  // The windows along axis `a` that cover input coordinate i: [*first, *last] (empty if first > last).
  JAXDNN_POOL_HD void CoveringWindows(int a, int i, int* first, int* last) const {
    const int reach = i + pad[a];  // i in the padded input; window o covers [o * stride, o * stride + window)
    *first = reach < window[a] ? 0 : (reach - window[a]) / stride[a] + 1;
    *last = reach / stride[a] < out[a] - 1 ? reach / stride[a] : out[a] - 1;
  }

  // The average's divisor for output o: the window volume, or its elements inside the input.
  JAXDNN_POOL_HD int Divisor(const int o[3], bool count_include_pad) const {
    if (count_include_pad) return WindowVolume();
    int count = 1;
    JAXDNN_POOL_UNROLL
    for (int a = 0; a < 3; ++a) {
      const int start = o[a] * stride[a] - pad[a];
      const int lo = start > 0 ? start : 0;
      const int hi = start + window[a] < in[a] ? start + window[a] : in[a];
      count *= hi > lo ? hi - lo : 0;
    }
    return count;
  }
};

// V values of T moved as one access (16 bytes for the CUDA vector path; V = 1 is the scalar path).
template <typename T, int V>
struct alignas(sizeof(T) * V) Lanes {
  T v[V];
};

template <int V, typename T>
JAXDNN_POOL_FN Lanes<T, V> LoadLanes(const T* p) {
#ifdef __CUDACC__
  return *reinterpret_cast<const Lanes<T, V>*>(p);  // the launcher checked the alignment
#else
  Lanes<T, V> lanes;
  std::memcpy(&lanes, p, sizeof(lanes));
  return lanes;
#endif
}

template <int V, typename T>
JAXDNN_POOL_FN void StoreLanes(T* p, const Lanes<T, V>& lanes) {
#ifdef __CUDACC__
  *reinterpret_cast<Lanes<T, V>*>(p) = lanes;
#else
  std::memcpy(p, &lanes, sizeof(lanes));
#endif
}

// Max pool of output pixel (n, o) for channels [c, c + V): writes y and, unless `argmax` is null,
// the window offset (row-major over the window) of the element chosen for the gradient.
// The window is visited in row-major order with padding as -inf candidates, and a candidate replaces
// the best so far when !(best >= v): the rule of XLA's select_and_scatter(ge), which JAX's gradient
// of max pooling uses, so ties (and NaNs) send the gradient where JAX sends it. y is NaN when the
// window holds a NaN, as lax.max propagates it.
template <int V, typename T, typename Idx>
JAXDNN_POOL_FN void MaxPoolPixel(const PoolGeometry& g, const T* __restrict__ x, T* __restrict__ y,
                                 Idx* __restrict__ argmax, int64_t n, const int o[3], int64_t c) {
  float best[V];
  int arg[V];
  bool nan[V];
JAXDNN_POOL_UNROLL
  for (int l = 0; l < V; ++l) {
    best[l] = -INFINITY;
    arg[l] = 0;
    nan[l] = false;
  }
  const int d0 = o[0] * g.stride[0] - g.pad[0], h0 = o[1] * g.stride[1] - g.pad[1],
            w0 = o[2] * g.stride[2] - g.pad[2];
  int k = 0;
  for (int kd = 0; kd < g.window[0]; ++kd) {
    const int d = d0 + kd;
    const bool d_inside = 0 <= d && d < g.in[0];
    for (int kh = 0; kh < g.window[1]; ++kh) {
      const int h = h0 + kh;
      const bool dh_inside = d_inside && 0 <= h && h < g.in[1];
      for (int kw = 0; kw < g.window[2]; ++kw, ++k) {
        const int w = w0 + kw;
        float v[V];
        if (dh_inside && 0 <= w && w < g.in[2]) {
          const Lanes<T, V> in = LoadLanes<V>(x + g.InOffset(n, d, h, w) + c);
JAXDNN_POOL_UNROLL
          for (int l = 0; l < V; ++l) v[l] = ToFloat(in.v[l]);
        } else {
JAXDNN_POOL_UNROLL
          for (int l = 0; l < V; ++l) v[l] = -INFINITY;
        }
JAXDNN_POOL_UNROLL
        for (int l = 0; l < V; ++l) {
          const bool take = !(best[l] >= v[l]);  // selects, not branches: the lanes vectorize
          nan[l] = nan[l] | (v[l] != v[l]);
          best[l] = take ? v[l] : best[l];
          arg[l] = take ? k : arg[l];
        }
      }
    }
  }
  const int64_t offset = g.OutOffset(n, o[0], o[1], o[2]) + c;
  Lanes<T, V> out;
JAXDNN_POOL_UNROLL
  for (int l = 0; l < V; ++l) out.v[l] = FromFloat<T>(nan[l] ? NAN : best[l]);
  StoreLanes<V>(y + offset, out);
  if (argmax != nullptr) {
    Lanes<Idx, V> chosen;
JAXDNN_POOL_UNROLL
    for (int l = 0; l < V; ++l) chosen.v[l] = Idx(arg[l]);
    StoreLanes<V>(argmax + offset, chosen);
  }
}

// Max pool backward of input pixel (n, i) for channels [c, c + V): dx = the sum of the dy of the
// covering windows whose argmax is this element's offset in them.
template <int V, typename T, typename Idx>
JAXDNN_POOL_FN void MaxPoolBwdPixel(const PoolGeometry& g, const T* __restrict__ dy,
                                    const Idx* __restrict__ argmax, T* __restrict__ dx, int64_t n,
                                    const int i[3], int64_t c) {
  float sum[V];
JAXDNN_POOL_UNROLL
  for (int l = 0; l < V; ++l) sum[l] = 0.f;
  int first[3], last[3];
  JAXDNN_POOL_UNROLL
  for (int a = 0; a < 3; ++a) g.CoveringWindows(a, i[a], &first[a], &last[a]);
  for (int p = first[0]; p <= last[0]; ++p) {
    const int kd = i[0] + g.pad[0] - p * g.stride[0];
    for (int q = first[1]; q <= last[1]; ++q) {
      const int kdh = kd * g.window[1] + i[1] + g.pad[1] - q * g.stride[1];
      for (int r = first[2]; r <= last[2]; ++r) {
        const int k = kdh * g.window[2] + i[2] + g.pad[2] - r * g.stride[2];
        const int64_t offset = g.OutOffset(n, p, q, r) + c;
        const Lanes<Idx, V> chosen = LoadLanes<V>(argmax + offset);
        const Lanes<T, V> grad = LoadLanes<V>(dy + offset);
JAXDNN_POOL_UNROLL
        for (int l = 0; l < V; ++l) {
          if (int(chosen.v[l]) == k) sum[l] += ToFloat(grad.v[l]);
        }
      }
    }
  }
  Lanes<T, V> out;
JAXDNN_POOL_UNROLL
  for (int l = 0; l < V; ++l) out.v[l] = FromFloat<T>(sum[l]);
  StoreLanes<V>(dx + g.InOffset(n, i[0], i[1], i[2]) + c, out);
}

// Average pool of output pixel (n, o) for channels [c, c + V): the sum of the window's elements
// inside x (padding adds zeros) over the divisor.
template <int V, typename T>
JAXDNN_POOL_FN void AvgPoolPixel(const PoolGeometry& g, const T* __restrict__ x, T* __restrict__ y,
                                 bool count_include_pad, int64_t n, const int o[3], int64_t c) {
  float sum[V];
JAXDNN_POOL_UNROLL
  for (int l = 0; l < V; ++l) sum[l] = 0.f;
  int lo[3], hi[3];  // the window clipped to the input
  JAXDNN_POOL_UNROLL
  for (int a = 0; a < 3; ++a) {
    const int start = o[a] * g.stride[a] - g.pad[a];
    lo[a] = start > 0 ? start : 0;
    hi[a] = start + g.window[a] < g.in[a] ? start + g.window[a] : g.in[a];
  }
  for (int d = lo[0]; d < hi[0]; ++d) {
    for (int h = lo[1]; h < hi[1]; ++h) {
      for (int w = lo[2]; w < hi[2]; ++w) {
        const Lanes<T, V> in = LoadLanes<V>(x + g.InOffset(n, d, h, w) + c);
JAXDNN_POOL_UNROLL
        for (int l = 0; l < V; ++l) sum[l] += ToFloat(in.v[l]);
      }
    }
  }
  const float divisor = float(g.Divisor(o, count_include_pad));  // 0 only for all-padding windows: 0/0 = NaN, as flax
  Lanes<T, V> out;
JAXDNN_POOL_UNROLL
  for (int l = 0; l < V; ++l) out.v[l] = FromFloat<T>(sum[l] / divisor);
  StoreLanes<V>(y + g.OutOffset(n, o[0], o[1], o[2]) + c, out);
}

// Average pool backward of input pixel (n, i) for channels [c, c + V): the sum over the covering
// windows of dy / divisor.
template <int V, typename T>
JAXDNN_POOL_FN void AvgPoolBwdPixel(const PoolGeometry& g, const T* __restrict__ dy, T* __restrict__ dx,
                                    bool count_include_pad, int64_t n, const int i[3], int64_t c) {
  float sum[V];
JAXDNN_POOL_UNROLL
  for (int l = 0; l < V; ++l) sum[l] = 0.f;
  int first[3], last[3];
  JAXDNN_POOL_UNROLL
  for (int a = 0; a < 3; ++a) g.CoveringWindows(a, i[a], &first[a], &last[a]);
  int o[3];
  for (o[0] = first[0]; o[0] <= last[0]; ++o[0]) {
    for (o[1] = first[1]; o[1] <= last[1]; ++o[1]) {
      for (o[2] = first[2]; o[2] <= last[2]; ++o[2]) {
        const float divisor = float(g.Divisor(o, count_include_pad));  // >= 1: the window covers i
        const Lanes<T, V> grad = LoadLanes<V>(dy + g.OutOffset(n, o[0], o[1], o[2]) + c);
JAXDNN_POOL_UNROLL
        for (int l = 0; l < V; ++l) sum[l] += ToFloat(grad.v[l]) / divisor;
      }
    }
  }
  Lanes<T, V> out;
JAXDNN_POOL_UNROLL
  for (int l = 0; l < V; ++l) out.v[l] = FromFloat<T>(sum[l]);
  StoreLanes<V>(dx + g.InOffset(n, i[0], i[1], i[2]) + c, out);
}

}  // namespace jaxdnn
