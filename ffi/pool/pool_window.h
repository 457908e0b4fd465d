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
// Inlined into the CPU kernels' vectorized variants (common/cpu_isa.h's CallVectorized): a call left
// out of line runs the baseline's scalar code.
#define JAXDNN_POOL_HD JAXDNN_ALWAYS_INLINE inline
#define JAXDNN_POOL_FN JAXDNN_ALWAYS_INLINE inline
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
  StoreWords(p, lanes);
#else
  std::memcpy(p, &lanes, sizeof(lanes));
#endif
}

// Window shapes known at compile time. The common 2-D poolings (3x3 stride 2 and 2x2 stride 2,
// depth 1) get their own instantiations: the forward's window loops have constant trip counts, so
// unrolled, a thread issues all of a window's loads before it uses the first; the backward runs a
// thread per block of S x S input pixels (PoolBwdBlock). RuntimeWindow reads every extent from the
// geometry.
struct RuntimeWindow {
  static constexpr int kSize = 0, kStride = 0;
};
template <int K, int S>
struct SquareWindow {
  static constexpr int kSize = K, kStride = S;
};

// Calls fn(W{}) with the policy that serves g: a SquareWindow when g's window and stride are one
// and no axis is empty (its loads are clamped into the arrays, see LoadAt).
template <typename Fn>
auto DispatchWindow(const PoolGeometry& g, Fn&& fn) {
  bool square = g.window[0] == 1 && g.window[1] == g.window[2] && g.stride[1] == g.stride[2];
  for (int a = 0; a < 3; ++a) square = square && g.in[a] > 0 && g.out[a] > 0;
  if (square && g.window[1] == 3 && g.stride[1] == 2) return fn(SquareWindow<3, 2>{});
  if (square && g.window[1] == 2 && g.stride[1] == 2) return fn(SquareWindow<2, 2>{});
  return fn(RuntimeWindow{});
}

// The window's extent along axis a (0: depth).
template <typename W>
JAXDNN_POOL_HD int WindowExtent(const PoolGeometry& g, int a) {
  if constexpr (W::kSize > 0) {
    return a == 0 ? 1 : W::kSize;
  } else {
    return g.window[a];
  }
}

// Where along an axis of `size` a load for coordinate i goes: i itself (the caller loads only inside),
// or for a SquareWindow i clamped into [0, size), so that the unrolled loads need no branch and all
// issue at once; the caller discards what a load outside the window's real extent reads.
template <typename W>
JAXDNN_POOL_HD int LoadAt(int i, int size) {
  if constexpr (W::kSize > 0) {
    return i < 0 ? 0 : (i < size ? i : size - 1);
  } else {
    return i;
  }
}

// Calls visit(k, inside, at) for each element of output pixel (n, o)'s window, in row-major order:
// k is its offset in the window, `inside` whether it lies in x (not in the padding), and `at` the
// offset of its channel c in x where a load may read (LoadAt: for a RuntimeWindow, valid only
// inside; for a SquareWindow, always valid, so the unrolled loads need no branch).
template <typename W, typename Visit>
JAXDNN_POOL_FN void ForEachWindowElement(const PoolGeometry& g, int64_t n, const int o[3], int64_t c,
                                         Visit&& visit) {
  const int d0 = o[0] * g.stride[0] - g.pad[0], h0 = o[1] * g.stride[1] - g.pad[1],
            w0 = o[2] * g.stride[2] - g.pad[2];
  const int extent_d = WindowExtent<W>(g, 0), extent_h = WindowExtent<W>(g, 1), extent_w = WindowExtent<W>(g, 2);
JAXDNN_POOL_UNROLL
  for (int kd = 0; kd < extent_d; ++kd) {
    const int d = d0 + kd;
    const bool d_inside = 0 <= d && d < g.in[0];
JAXDNN_POOL_UNROLL
    for (int kh = 0; kh < extent_h; ++kh) {
      const int h = h0 + kh;
      const bool dh_inside = d_inside && 0 <= h && h < g.in[1];
JAXDNN_POOL_UNROLL
      for (int kw = 0; kw < extent_w; ++kw) {
        const int w = w0 + kw;
        visit((kd * extent_h + kh) * extent_w + kw, dh_inside && 0 <= w && w < g.in[2],
              g.InOffset(n, LoadAt<W>(d, g.in[0]), LoadAt<W>(h, g.in[1]), LoadAt<W>(w, g.in[2])) + c);
      }
    }
  }
}

#ifdef __CUDACC__
// 16-bit floats as pairs of lanes in 32-bit words: the pair type (bf16x2, half2) and the bit
// patterns of -inf and of the quiet NaN in both halves.
template <typename T>
struct LanePairs;
template <>
struct LanePairs<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  static constexpr unsigned kNegInf = 0xFF80FF80u, kNaN = 0x7FC07FC0u;
};
template <>
struct LanePairs<__half> {
  using Pair = __half2;
  static constexpr unsigned kNegInf = 0xFC00FC00u, kNaN = 0x7E007E00u;
};

// Per 16-bit half: 0xFFFF where a >= b (false when either is NaN).
template <typename T>
__device__ __forceinline__ unsigned PairGreaterEqual(unsigned a, unsigned b) {
  using Pair = typename LanePairs<T>::Pair;
  return __hge2_mask(*reinterpret_cast<const Pair*>(&a), *reinterpret_cast<const Pair*>(&b));
}

// Per 16-bit half: 0xFFFF where a is NaN.
template <typename T>
__device__ __forceinline__ unsigned PairIsNaN(unsigned a) {
  using Pair = typename LanePairs<T>::Pair;
  return __hneu2_mask(*reinterpret_cast<const Pair*>(&a), *reinterpret_cast<const Pair*>(&a));
}

// MaxPoolPixelFloat (below) for a SquareWindow of 16-bit floats, two lanes per instruction: one packed
// compare gives the mask of the lanes whose best stays (best >= v), and bitwise selects move the
// values, the window offsets (16 bits a lane) and the NaN flags, so a window element costs a few
// instructions per pair of lanes instead of a conversion, two compares and selects per lane (the
// float version of the training forward was bound by its instructions, not by memory). The same
// rule on the same values: the results are identical.
template <int V, typename W, typename T, typename Idx>
__device__ __forceinline__ void MaxPoolPixelPairs(const PoolGeometry& g, const T* __restrict__ x, T* __restrict__ y,
                                                  Idx* __restrict__ argmax, int64_t n, const int o[3], int64_t c) {
  using P = LanePairs<T>;
  constexpr int kWords = V / 2;
  unsigned best[kWords], arg[kWords], nan[kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    best[i] = P::kNegInf;
    arg[i] = 0;
    nan[i] = 0;
  }
  ForEachWindowElement<W>(g, n, o, c, [&](int k, bool inside, int64_t at) {
    const Lanes<T, V> in = LoadLanes<V>(x + at);  // a SquareWindow's loads are always valid
    unsigned words[kWords];
    memcpy(words, &in, sizeof(words));
    const unsigned k2 = unsigned(k) * 0x10001u;  // the offset in both halves
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      const unsigned v = inside ? words[i] : P::kNegInf;
      const unsigned keep = PairGreaterEqual<T>(best[i], v);
      best[i] = (best[i] & keep) | (v & ~keep);
      arg[i] = (arg[i] & keep) | (k2 & ~keep);
      nan[i] |= PairIsNaN<T>(v);
    }
  });
  unsigned out[kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i) out[i] = (best[i] & ~nan[i]) | (P::kNaN & nan[i]);
  Lanes<T, V> lanes;
  memcpy(&lanes, out, sizeof(out));
  const int64_t offset = g.OutOffset(n, o[0], o[1], o[2]) + c;
  StoreLanes<V>(y + offset, lanes);
  if (argmax != nullptr) {
    Lanes<Idx, V> chosen;
#pragma unroll
    for (int l = 0; l < V; ++l) chosen.v[l] = Idx((arg[l / 2] >> (16 * (l % 2))) & 0xFFFFu);
    StoreLanes<V>(argmax + offset, chosen);
  }
}
#endif

// Max pool of output pixel (n, o) for channels [c, c + V): writes y and, unless `argmax` is null,
// the window offset (row-major over the window) of the element chosen for the gradient.
// The window is visited in row-major order with padding as -inf candidates, and a candidate replaces
// the best so far when !(best >= v): the rule of XLA's select_and_scatter(ge), which JAX's gradient
// of max pooling uses, so ties (and NaNs) send the gradient where JAX sends it. y is NaN when the
// window holds a NaN, as lax.max propagates it.
template <int V, typename W, typename T, typename Idx>
JAXDNN_POOL_FN void MaxPoolPixelFloat(const PoolGeometry& g, const T* __restrict__ x, T* __restrict__ y,
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
  ForEachWindowElement<W>(g, n, o, c, [&](int k, bool inside, int64_t at) {
    float v[V];
JAXDNN_POOL_UNROLL
    for (int l = 0; l < V; ++l) v[l] = -INFINITY;  // padding
    if (W::kSize > 0 || inside) {
      const Lanes<T, V> in = LoadLanes<V>(x + at);
JAXDNN_POOL_UNROLL
      for (int l = 0; l < V; ++l) v[l] = inside ? ToFloat(in.v[l]) : v[l];
    }
JAXDNN_POOL_UNROLL
    for (int l = 0; l < V; ++l) {
      const bool take = !(best[l] >= v[l]);  // selects, not branches: the lanes vectorize
      nan[l] = nan[l] | (v[l] != v[l]);
      best[l] = take ? v[l] : best[l];
      arg[l] = take ? k : arg[l];
    }
  });
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

// MaxPoolPixel: the packed 16-bit version where it applies (CUDA), else the float one.
template <int V, typename W = RuntimeWindow, typename T, typename Idx>
JAXDNN_POOL_FN void MaxPoolPixel(const PoolGeometry& g, const T* __restrict__ x, T* __restrict__ y,
                                 Idx* __restrict__ argmax, int64_t n, const int o[3], int64_t c) {
#ifdef __CUDACC__
  if constexpr (sizeof(T) == 2 && V % 2 == 0 && W::kSize > 0) {
    MaxPoolPixelPairs<V, W>(g, x, y, argmax, n, o, c);
  } else
#endif
  {
    MaxPoolPixelFloat<V, W>(g, x, y, argmax, n, o, c);
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
        for (int l = 0; l < V; ++l) sum[l] += int(chosen.v[l]) == k ? ToFloat(grad.v[l]) : 0.f;  // a select
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
template <int V, typename W = RuntimeWindow, typename T>
JAXDNN_POOL_FN void AvgPoolPixel(const PoolGeometry& g, const T* __restrict__ x, T* __restrict__ y,
                                 bool count_include_pad, int64_t n, const int o[3], int64_t c) {
  float sum[V];
JAXDNN_POOL_UNROLL
  for (int l = 0; l < V; ++l) sum[l] = 0.f;
  ForEachWindowElement<W>(g, n, o, c, [&](int, bool inside, int64_t at) {
    if (!(W::kSize > 0 || inside)) return;  // padding adds nothing
    const Lanes<T, V> in = LoadLanes<V>(x + at);
JAXDNN_POOL_UNROLL
    for (int l = 0; l < V; ++l) sum[l] = inside ? sum[l] + ToFloat(in.v[l]) : sum[l];
  });
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

// The input pixels of a SquareWindow<K, S> backward come in S x S blocks: block (m_h, m_w) holds the
// pixels whose padded coordinates are [S m_h, S m_h + S) x [S m_w, S m_w + S). Every pixel of a
// block is covered only by windows m - F .. m along each axis (F = (K - 1) / S), so one thread per
// block loads those (F + 1)^2 windows' dy (and argmax) once for all S^2 pixels, where a thread per
// pixel loaded its own: a quarter of the loads for 3x3 stride 2. The grid of blocks: depth x blocks
// along h x blocks along w, from block `first` on.
struct BlockGrid {
  int first[2];
  int sizes[3];
};

template <typename W>
JAXDNN_POOL_HD BlockGrid MakeBlockGrid(const PoolGeometry& g) {
  BlockGrid b;
  b.sizes[0] = g.in[0];
  for (int a = 1; a < 3; ++a) {
    b.first[a - 1] = g.pad[a] / W::kStride;
    b.sizes[a] = (g.in[a] - 1 + g.pad[a]) / W::kStride - b.first[a - 1] + 1;
  }
  return b;
}

// The backward of a SquareWindow pooling, max (argmax non-null: the sum of the dy of the windows
// whose argmax is the pixel) or average (argmax null: the sum of dy / divisor of the covering
// windows), for the block m of input pixels at depth d and channels [c, c + V). The windows are
// summed in the order of the per-pixel functions (ascending), so both give the same bits.
template <int V, typename W, typename T, typename Idx>
JAXDNN_POOL_FN void PoolBwdBlock(const PoolGeometry& g, const T* __restrict__ dy, const Idx* __restrict__ argmax,
                                 T* __restrict__ dx, bool count_include_pad, int64_t n, int d, const int m[2],
                                 int64_t c) {
  constexpr int K = W::kSize, S = W::kStride, F = (K - 1) / S;
  int p, p_last;  // the depth window covering d (the window is 1 deep: at most one)
  g.CoveringWindows(0, d, &p, &p_last);
  const bool depth_covered = p <= p_last;
  bool exists[F + 1][F + 1];
  float divisor[F + 1][F + 1];
  Lanes<T, V> grad[F + 1][F + 1];
  Lanes<Idx, V> chosen[F + 1][F + 1];
JAXDNN_POOL_UNROLL
  for (int jh = 0; jh <= F; ++jh) {
JAXDNN_POOL_UNROLL
    for (int jw = 0; jw <= F; ++jw) {
      const int o[3] = {p, m[0] - F + jh, m[1] - F + jw};
      exists[jh][jw] = depth_covered && 0 <= o[1] && o[1] < g.out[1] && 0 <= o[2] && o[2] < g.out[2];
      // Loads from a clamped window, discarded where it does not exist: no branch, all in flight at once.
      const int64_t offset =
          g.OutOffset(n, LoadAt<W>(o[0], g.out[0]), LoadAt<W>(o[1], g.out[1]), LoadAt<W>(o[2], g.out[2])) + c;
      grad[jh][jw] = LoadLanes<V>(dy + offset);
      chosen[jh][jw] = argmax != nullptr ? LoadLanes<V>(argmax + offset) : Lanes<Idx, V>{};
      divisor[jh][jw] = argmax != nullptr ? 1.f : float(g.Divisor(o, count_include_pad));  // >= 1 where it exists
    }
  }
JAXDNN_POOL_UNROLL
  for (int th = 0; th < S; ++th) {
JAXDNN_POOL_UNROLL
    for (int tw = 0; tw < S; ++tw) {
      const int h = S * m[0] + th - g.pad[1], w = S * m[1] + tw - g.pad[2];
      if (h < 0 || h >= g.in[1] || w < 0 || w >= g.in[2]) continue;
      float sum[V];
JAXDNN_POOL_UNROLL
      for (int l = 0; l < V; ++l) sum[l] = 0.f;
JAXDNN_POOL_UNROLL
      for (int jh = 0; jh <= F; ++jh) {
JAXDNN_POOL_UNROLL
        for (int jw = 0; jw <= F; ++jw) {
          const int kh = th + S * (F - jh), kw = tw + S * (F - jw);  // the pixel's offset in the window
          if (kh >= K || kw >= K) continue;                         // a compile-time test once unrolled
          const int k = kh * K + kw;
JAXDNN_POOL_UNROLL
          for (int l = 0; l < V; ++l) {
            if (argmax != nullptr) {
              // A select, not a branch, so that the CPU's lanes vectorize: adding 0 to a sum that
              // starts at +0 leaves its bits as they are.
              const bool take = exists[jh][jw] && int(chosen[jh][jw].v[l]) == k;
              sum[l] += take ? ToFloat(grad[jh][jw].v[l]) : 0.f;
            } else if (exists[jh][jw]) {  // the same for every lane
              sum[l] += ToFloat(grad[jh][jw].v[l]) / divisor[jh][jw];
            }
          }
        }
      }
      Lanes<T, V> out;
JAXDNN_POOL_UNROLL
      for (int l = 0; l < V; ++l) out.v[l] = FromFloat<T>(sum[l]);
      StoreLanes<V>(dx + g.InOffset(n, d, h, w) + c, out);
    }
  }
}

}  // namespace jaxdnn
