// Depthwise convolution kernels (depthwise.h). Each output value is a short dot product (T*U*V
// taps) of one channel, so the stages are memory-bound: the aim is to move x, y, dy, dx once
// through DRAM at close to copy speed and keep the re-reads that neighbouring windows share in
// registers and L1.
//
// Work split (StripPlan): channels in packs of kVectorWidth = 4 (one 16-byte access of float32, an
// 8-byte one of bf16/f16; a scalar path with packs of one value serves channel counts or pointers
// that do not allow it), consecutive packs on consecutive threads so a warp reads whole runs of a
// pixel's channels; pixels in strips of kStrip consecutive outputs of one row, one strip per thread at a
// time. A block's threads of one pack walk a contiguous range of strips, vertically neighbouring
// strips side by side, so the input rows that 3 output rows share are fetched into L1 once.
//
// Kernels:
// - depthwise_sm90.cu's streaming kernels take the common square windows (3 x 3, 5 x 5, 7 x 7) with
//   16-bit values (forward, unit-stride dgrad and wgrad) on GPUs with TMA; the kernels below serve
//   the rest.
// - DepthwiseTile3x3Kernel: the same window and conditions on GPUs without TMA (forward and
//   unit-stride dgrad): a block copies the input its tile of 8 output rows x up to 64 columns x up
//   to 64 channels reads into shared memory with cp.async, then each thread computes 8 channels of
//   4 vertically adjacent outputs from there (see its comment).
// - Depthwise3x3Kernel: the other 1 x 3 x 3 windows (any padding, H stride and dilation, W stride 1
//   or 2, W dilation 1, m == 1, vector packs). The thread keeps its pack's 9 taps in registers
//   (float32) and loads the (kStrip - 1) * stride + 3 input pixels of each window row once for its
//   whole strip, each feeding up to 3 outputs: 4.5 loads per output pack instead of 9. The fused
//   epilogue (bias, residual, activation) is applied per pack before the one rounding. It also
//   runs dgrad when every stride is 1: that transposed conv is the conv of dy with the flipped
//   window and padding (window - 1) * dilation - pad.
// - DepthwiseFpropKernel / DepthwiseDgradKernel: any window, stride, dilation, padding and
//   multiplier, vector or scalar packs; each tap's pixels are loaded per output (L1 serves the
//   overlap), dgrad gathering through OutputAt as conv_geometry.h defines it.
// - Wgrad (a sum over N * P * Q * R per tap and feature): the strips are split into slices, a
//   function of the geometry alone (WgradSlices) so the result has the same bits on every device.
//   Each thread sums its pack's taps over its strips in registers (Depthwise3x3 window: all 9 taps
//   with the same row reuse as fprop; otherwise DepthwiseWgradKernel, up to kTapBlock taps of one
//   window row per block), the block adds its threads in a fixed order (ReduceWorkers), and with
//   more than one slice SumSlicesKernel (cuda_common.cuh) adds the slices' float32 partials in
//   order. No atomics.
// Indexing is int64 wherever a product of sizes can exceed 2^31.
#include "conv/depthwise.h"

#include <algorithm>
#include <climits>
#include <initializer_list>
#include <cstdint>
#include <string>

#include "common/activation.h"
#include "common/cuda_common.cuh"
#include "conv/conv_epilogue.h"
#include "conv/conv_geometry.h"
#include "conv/depthwise_pack.cuh"
#include "conv/depthwise_sm90.h"

namespace jaxdnn {
namespace {

constexpr int kThreads = 128;   // per block
// Channels per thread on the vector path: 4, one 16-byte access of float32 or an 8-byte one of
// bf16/f16 (a warp still reads whole 32-byte sectors). Eight 16-bit channels (16-byte accesses)
// would double the 3x3 kernels' per-thread state (9 taps and 4 outputs of 8 floats, plus the
// window rows' loads in flight: ~180 registers, 8 warps per SM) for no fewer instructions per value.
constexpr int kVectorWidth = 4;
constexpr int kStrip = 4;       // consecutive outputs of one row per thread
constexpr int kMaxLanes = 32;   // packs per block
constexpr int kTapBlock = 8;    // the generic wgrad's taps per block, of one window row
constexpr int64_t kMaxSumBlocks = 1 << 20;  // SumSlicesKernel's grid; beyond, it strides
// The 3x3 kernels' occupancy: 3 blocks (12 warps) per SM caps them at 168 registers, which they fit
// (its stride-2 wgrad spills a few values per strip); 4 would cap them at 128 and spill heavily.
constexpr int kBlocksPerSm3x3 = 3;
// Wgrad's split: about kWgradBlocks blocks (one wave of the 3x3 kernel on the 132 SMs of an
// H100/H200), a block per kWgradChannels features (a vector block's), each slice at least
// kMinSliceStrips strips long so its reduction stays a small part of its work.
constexpr int64_t kWgradBlocks = kBlocksPerSm3x3 * 132;
constexpr int64_t kWgradChannels = kMaxLanes * kVectorWidth;
constexpr int64_t kMinSliceStrips = 32;
static_assert(kMaxLanes * kVectorWidth <= kThreads, "ReduceWorkers sums one feature per thread");

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// a / b for a, b >= 0, with a 32-bit division when both fit (64-bit division is a long routine).
__device__ __forceinline__ int64_t Quotient(int64_t a, int64_t b) {
  return ((a | b) >> 32) == 0 ? int64_t(uint32_t(a) / uint32_t(b)) : a / b;
}

// The output coordinate on axis a that reads input coordinate i through tap t, or -1: OutputAt of
// conv_geometry.h for lhs_dilation 1, dividing in 32 bits where the values fit.
__device__ __forceinline__ int64_t OutputAt(const ConvGeometry& g, int a, int64_t i, int64_t t) {
  const int64_t j = i + g.pad[a] - t * g.rhs_dilation[a];  // o * stride
  if (j < 0) return -1;
  const int64_t o = Quotient(j, g.stride[a]);
  return o * g.stride[a] == j && o < g.out[a] ? o : -1;
}

// --- work split ------------------------------------------------------------------------------------

// How a kernel's threads share a destination grid [N, depth, height, width] of pixels with `packs`
// packs of channels each. Thread (worker, lane) of block (slice, chunk) takes pack chunk * lanes +
// lane and, of the strips slice * per_slice ... + per_slice, every `workers`-th from its worker's.
// Strips are ordered height fastest, then strip column, depth and n.
struct StripPlan {
  int lanes = 1;             // packs per block, a power of two <= kMaxLanes
  int workers = kThreads;    // kThreads / lanes
  int64_t packs = 0, chunks = 0;  // chunks = ceil(packs / lanes): blocks across the channels
  int64_t depth = 1, height = 1, tiles = 1;  // tiles: strips per row, ceil(width / kStrip)
  int64_t strips = 0;        // N * depth * height * tiles
  int64_t slices = 1, per_slice = 0;  // blocks along the strips, and strips per block
};

// Packs per block: all of a pixel's when they are few (a warp then covers whole pixels), else 8,
// 16 or 32, whichever leaves the fewest lanes idle (ties to the wider, for longer runs).
int PackLanes(int64_t packs) {
  if (packs <= 8) {
    int lanes = 1;
    while (lanes < packs) lanes *= 2;
    return lanes;
  }
  int best = kMaxLanes;
  int64_t best_idle = CeilDiv(packs, kMaxLanes) * kMaxLanes - packs;
  for (int lanes = kMaxLanes / 2; lanes >= 8; lanes /= 2) {
    const int64_t idle = CeilDiv(packs, lanes) * lanes - packs;
    if (idle < best_idle) best = lanes, best_idle = idle;
  }
  return best;
}

// The plan for `packs` packs over the destination grid [batch, grid[0], grid[1], grid[2]], one slice.
StripPlan MakePlan(int64_t packs, int64_t batch, const int64_t grid[3]) {
  StripPlan plan;
  plan.lanes = PackLanes(packs);
  plan.workers = kThreads / plan.lanes;
  plan.packs = packs;
  plan.chunks = CeilDiv(packs, plan.lanes);
  plan.depth = grid[0];
  plan.height = grid[1];
  plan.tiles = CeilDiv(grid[2], kStrip);
  plan.strips = batch * plan.depth * plan.height * plan.tiles;
  plan.per_slice = plan.strips;
  return plan;
}

void SplitStrips(StripPlan& plan, int64_t slices) {
  plan.slices = std::max<int64_t>(1, slices);
  plan.per_slice = CeilDiv(plan.strips, plan.slices);
}

// The strip a worker is on: image n, row (p, q) of the destination grid, strip column `tile`.
struct StripCursor {
  int64_t n, p, q, tile;

  __device__ StripCursor(const StripPlan& plan, int64_t strip) {
    int64_t rest = Quotient(strip, plan.height);
    q = strip - rest * plan.height;
    strip = rest;
    rest = Quotient(strip, plan.tiles);
    tile = strip - rest * plan.tiles;
    n = Quotient(rest, plan.depth);
    p = rest - n * plan.depth;
  }

  // Moves `steps` strips on, dividing only when a coordinate wraps.
  __device__ void Advance(const StripPlan& plan, int64_t steps) {
    q += steps;
    if (q < plan.height) return;
    int64_t carry = Quotient(q, plan.height);
    q -= carry * plan.height;
    tile += carry;
    if (tile < plan.tiles) return;
    carry = Quotient(tile, plan.tiles);
    tile -= carry * plan.tiles;
    p += carry;
    if (p < plan.depth) return;
    carry = Quotient(p, plan.depth);
    p -= carry * plan.depth;
    n += carry;
  }
};

// Calls fn(cursor) for each strip this thread's worker takes in `slice`.
template <typename Fn>
__device__ __forceinline__ void ForEachStrip(const StripPlan& plan, int64_t slice, int worker, Fn&& fn) {
  const int64_t first = slice * plan.per_slice;
  const int64_t end = std::min(first + plan.per_slice, plan.strips);
  if (first + worker >= end) return;
  StripCursor at(plan, first + worker);
  for (int64_t strip = first + worker; strip < end; strip += plan.workers) {
    fn(static_cast<const StripCursor&>(at));
    if (strip + plan.workers < end) at.Advance(plan, plan.workers);
  }
}

// --- packs -------------------------------------------------------------------------------------------

template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> LoadPack(const T* p) {
  return *reinterpret_cast<const Pack<T, kVec>*>(p);
}

template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> ZeroPack() {
  Pack<T, kVec> pack;
#pragma unroll
  for (int e = 0; e < kVec; ++e) pack.v[e] = FromFloat<T>(0.f);
  return pack;
}

template <typename T, int kVec>
__device__ __forceinline__ void ToFloats(const Pack<T, kVec>& pack, float (&out)[kVec]) {
#pragma unroll
  for (int e = 0; e < kVec; ++e) out[e] = ToFloat(pack.v[e]);
}

// Where features k0 .. k0 + kVec - 1 read their input channel k / m: one pack of x when m == 1,
// else a value per feature (channel c0 + offset[e]), whatever the alignment of x.
template <int kVec>
struct InputChannels {
  bool unit;
  int64_t c0;
  int offset[kVec];

  __device__ InputChannels(int64_t k0, int64_t m) : unit(m == 1), c0(k0 / m) {
    const int64_t first = k0 - c0 * m;  // k0 % m
#pragma unroll
    for (int e = 0; e < kVec; ++e) offset[e] = int((first + e) / m);
  }

  // The values of one input pixel (`pixel` points at its channel 0).
  template <typename T>
  __device__ __forceinline__ void Load(const T* pixel, float (&out)[kVec]) const {
    if (unit) {
      ToFloats(LoadPack<T, kVec>(pixel + c0), out);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) out[e] = ToFloat(pixel[c0 + offset[e]]);
    }
  }
};

// The input pixels a strip reads through a 1 x 3 x 3 window with W stride kStride and W dilation 1:
// cols[u][j] = in[n, p * s0 - pad0, q * s1 + u * d1 - pad1, r0 * kStride - pad2 + j, k0 ...] for the
// strip's output row (n, p, q) and first column r0, zeros outside `in`; output r0 + o meets pixel j
// through tap (u, j - o * kStride). Every load is issued before any is used (one round trip per strip).
template <typename T, int kStride>
struct StripWindow {
  static constexpr int kVec = kVectorWidth;
  static constexpr int kCols = (kStrip - 1) * kStride + 3;
  Pack<T, kVec> cols[3][kCols];

  __device__ __forceinline__ StripWindow(const ConvGeometry& g, const T* __restrict__ in, const StripCursor& at,
                                         int64_t k0) {
    const int64_t d = at.p * g.stride[0] - g.pad[0];
    const int64_t col0 = at.tile * kStrip * kStride - g.pad[2];
#pragma unroll
    for (int u = 0; u < 3; ++u) {
      const int64_t h = at.q * g.stride[1] + u * g.rhs_dilation[1] - g.pad[1];
      const bool inside = d >= 0 && d < g.in[0] && h >= 0 && h < g.in[1];
      const T* row = inside ? in + ((at.n * g.in[0] + d) * g.in[1] + h) * g.in[2] * g.channels + k0 : in;
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int64_t col = col0 + j;
        cols[u][j] = inside && col >= 0 && col < g.in[2] ? LoadPack<T, kVec>(row + col * g.channels)
                                                          : ZeroPack<T, kVec>();
      }
    }
  }
};

// --- forward (and unit-stride dgrad) -----------------------------------------------------------------

// out[n, p, q, r, c] = epilogue(sum over u, v < 3 of in[n, p * s0 - pad0, q * s1 + u * d1 - pad1,
// r * kStride + v - pad2, c] * w[u, v, c]), with w[2 - u, 2 - v, c] when `flip`: g's forward for a
// 1 x 3 x 3 window with m == 1 (g.channels == g.filters), W stride kStride and W dilation 1, on
// vector packs.
template <typename T, int kStride>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm3x3)
    Depthwise3x3Kernel(const ConvGeometry g, const StripPlan plan, const T* __restrict__ in,
                       const T* __restrict__ w, bool flip, const ConvEpilogue<T> epilogue, T* __restrict__ out) {
  constexpr int kVec = kVectorWidth;
  const int lane = threadIdx.x % plan.lanes, worker = threadIdx.x / plan.lanes;
  const int64_t chunk = blockIdx.x % plan.chunks, slice = blockIdx.x / plan.chunks;
  const int64_t pack = chunk * plan.lanes + lane;
  if (pack >= plan.packs) return;  // no block-wide synchronization below
  const int64_t channels = g.channels, k0 = pack * kVec;
  float taps[9][kVec];
#pragma unroll
  for (int i = 0; i < 9; ++i) ToFloats(LoadPack<T, kVec>(w + (flip ? 8 - i : i) * channels + k0), taps[i]);

  ForEachStrip(plan, slice, worker, [&](const StripCursor& at) {
    const StripWindow<T, kStride> window(g, in, at, k0);
    float acc[kStrip][kVec] = {};
#pragma unroll
    for (int u = 0; u < 3; ++u) {
#pragma unroll
      for (int j = 0; j < window.kCols; ++j) {
        float value[kVec];
        ToFloats(window.cols[u][j], value);
#pragma unroll
        for (int o = 0; o < kStrip; ++o) {
          const int v = j - o * kStride;
          if (v < 0 || v > 2) continue;
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[o][e] += value[e] * taps[u * 3 + v][e];
        }
      }
    }
    const int64_t r0 = at.tile * kStrip;
    const int64_t row_out = ((at.n * g.out[0] + at.p) * g.out[1] + at.q) * g.out[2];
#pragma unroll
    for (int o = 0; o < kStrip; ++o) {
      if (r0 + o < g.out[2]) StoreOutputPack(epilogue, acc[o], (row_out + r0 + o) * channels + k0, k0, out);
    }
  });
}

// y = epilogue(conv(x, w)) for any depthwise geometry; packs of kVec features (K % kVec == 0).
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    DepthwiseFpropKernel(const ConvGeometry g, const StripPlan plan, const T* __restrict__ x, const T* __restrict__ w,
                         const ConvEpilogue<T> epilogue, T* __restrict__ y) {
  const int lane = threadIdx.x % plan.lanes, worker = threadIdx.x / plan.lanes;
  const int64_t chunk = blockIdx.x % plan.chunks, slice = blockIdx.x / plan.chunks;
  const int64_t pack = chunk * plan.lanes + lane;
  if (pack >= plan.packs) return;
  const int64_t filters = g.filters, k0 = pack * kVec;
  const InputChannels<kVec> source(k0, filters / g.channels);

  ForEachStrip(plan, slice, worker, [&](const StripCursor& at) {
    float acc[kStrip][kVec] = {};
    const int64_t r0 = at.tile * kStrip;
    for (int64_t t = 0; t < g.window[0]; ++t) {
      const int64_t d = at.p * g.stride[0] + t * g.rhs_dilation[0] - g.pad[0];
      if (d < 0 || d >= g.in[0]) continue;
      for (int64_t u = 0; u < g.window[1]; ++u) {
        const int64_t h = at.q * g.stride[1] + u * g.rhs_dilation[1] - g.pad[1];
        if (h < 0 || h >= g.in[1]) continue;
        const T* row = x + ((at.n * g.in[0] + d) * g.in[1] + h) * g.in[2] * g.channels;
        for (int64_t v = 0; v < g.window[2]; ++v) {
          float tap[kVec];
          ToFloats(LoadPack<T, kVec>(w + ((t * g.window[1] + u) * g.window[2] + v) * filters + k0), tap);
          const int64_t col0 = r0 * g.stride[2] + v * g.rhs_dilation[2] - g.pad[2];
#pragma unroll
          for (int o = 0; o < kStrip; ++o) {
            const int64_t col = col0 + o * g.stride[2];
            if (col < 0 || col >= g.in[2]) continue;
            float value[kVec];
            source.Load(row + col * g.channels, value);
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[o][e] += value[e] * tap[e];
          }
        }
      }
    }
    const int64_t row_out = ((at.n * g.out[0] + at.p) * g.out[1] + at.q) * g.out[2];
#pragma unroll
    for (int o = 0; o < kStrip; ++o) {
      if (r0 + o < g.out[2]) StoreOutputPack(epilogue, acc[o], (row_out + r0 + o) * filters + k0, k0, y);
    }
  });
}

// dx[n, i, c] = sum over taps t and j < m of dy[n, o(i, t), c * m + j] * w[t, c * m + j], o(i, t) the
// output pixel that reads i through t (OutputAt), for any depthwise geometry; packs of kVec
// channels (C % kVec == 0; with m > 1 dy and w are read a value at a time).
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    DepthwiseDgradKernel(const ConvGeometry g, const StripPlan plan, const T* __restrict__ dy,
                         const T* __restrict__ w, T* __restrict__ dx) {
  const int lane = threadIdx.x % plan.lanes, worker = threadIdx.x / plan.lanes;
  const int64_t chunk = blockIdx.x % plan.chunks, slice = blockIdx.x / plan.chunks;
  const int64_t pack = chunk * plan.lanes + lane;
  if (pack >= plan.packs) return;
  const int64_t filters = g.filters, m = filters / g.channels, c0 = pack * kVec;

  ForEachStrip(plan, slice, worker, [&](const StripCursor& at) {
    float acc[kStrip][kVec] = {};
    const int64_t i0 = at.tile * kStrip;
    for (int64_t t = 0; t < g.window[0]; ++t) {
      const int64_t od = OutputAt(g, 0, at.p, t);
      if (od < 0) continue;
      for (int64_t u = 0; u < g.window[1]; ++u) {
        const int64_t oh = OutputAt(g, 1, at.q, u);
        if (oh < 0) continue;
        const T* row = dy + ((at.n * g.out[0] + od) * g.out[1] + oh) * g.out[2] * filters;
        for (int64_t v = 0; v < g.window[2]; ++v) {
          const T* w_tap = w + ((t * g.window[1] + u) * g.window[2] + v) * filters;
          float tap[kVec] = {};
          if (m == 1) ToFloats(LoadPack<T, kVec>(w_tap + c0), tap);
#pragma unroll
          for (int o = 0; o < kStrip; ++o) {
            if (i0 + o >= g.in[2]) continue;
            const int64_t ow = OutputAt(g, 2, i0 + o, v);
            if (ow < 0) continue;
            const T* pixel = row + ow * filters;
            if (m == 1) {
              float grad[kVec];
              ToFloats(LoadPack<T, kVec>(pixel + c0), grad);
#pragma unroll
              for (int e = 0; e < kVec; ++e) acc[o][e] += grad[e] * tap[e];
            } else {
#pragma unroll
              for (int e = 0; e < kVec; ++e) {
                for (int64_t k = (c0 + e) * m; k < (c0 + e + 1) * m; ++k) {
                  acc[o][e] += ToFloat(pixel[k]) * ToFloat(w_tap[k]);
                }
              }
            }
          }
        }
      }
    }
    const int64_t row_in = ((at.n * g.in[0] + at.p) * g.in[1] + at.q) * g.in[2];
#pragma unroll
    for (int o = 0; o < kStrip; ++o) {
      if (i0 + o < g.in[2]) StoreOutputPack(ConvEpilogue<T>{}, acc[o], (row_in + i0 + o) * g.channels + c0, c0, dx);
    }
  });
}

// --- wgrad ---------------------------------------------------------------------------------------------

// Adds acc over the block's workers (in worker order) for taps tap0 + i, i < valid_taps, and writes
// the sums of the chunk's features: to partial[slice][tap][k] (float32) when the strips are split in
// slices (SumSlicesKernel adds those), else rounded to dw[tap][k]. Every thread of the block calls it.
template <typename T, int kVec, int kTaps>
__device__ __forceinline__ void ReduceWorkers(const float (&acc)[kTaps][kVec], const StripPlan& plan,
                                              int64_t chunk, int64_t slice, int64_t tap0, int valid_taps,
                                              int64_t taps, int64_t filters, float* __restrict__ partial,
                                              T* __restrict__ dw) {
  __shared__ float sums[kThreads * kVec];  // [workers][lanes * kVec]: thread worker * lanes + lane
  const int width = plan.lanes * kVec;     // the chunk's features, one per thread below
  const int64_t k = chunk * width + threadIdx.x;
#pragma unroll
  for (int i = 0; i < kTaps; ++i) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) sums[threadIdx.x * kVec + e] = acc[i][e];
    __syncthreads();
    if (int(threadIdx.x) < width && i < valid_taps && k < filters) {
      float total = 0.f;
      for (int worker = 0; worker < plan.workers; ++worker) total += sums[worker * width + threadIdx.x];
      const int64_t tap = tap0 + i;
      if (plan.slices > 1) {
        partial[(slice * taps + tap) * filters + k] = total;
      } else {
        dw[tap * filters + k] = FromFloat<T>(total);
      }
    }
    __syncthreads();  // sums is rewritten for the next tap
  }
}

// dw for a 1 x 3 x 3 window with m == 1, W stride kStride and W dilation 1, on vector packs: the
// thread's pack's 9 taps summed in registers over its strips; per window row the strip's input
// pixels are loaded once, each meeting up to 3 of the strip's dy pixels.
template <typename T, int kStride>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm3x3)
    DepthwiseWgrad3x3Kernel(const ConvGeometry g, const StripPlan plan, const T* __restrict__ x,
                            const T* __restrict__ dy, float* __restrict__ partial, T* __restrict__ dw) {
  constexpr int kVec = kVectorWidth;
  const int lane = threadIdx.x % plan.lanes, worker = threadIdx.x / plan.lanes;
  const int64_t chunk = blockIdx.x % plan.chunks, slice = blockIdx.x / plan.chunks;
  const int64_t pack = chunk * plan.lanes + lane;
  const int64_t channels = g.channels, k0 = pack * kVec;
  float acc[9][kVec] = {};
  if (pack < plan.packs) {  // idle lanes still join the reduction
    ForEachStrip(plan, slice, worker, [&](const StripCursor& at) {
      const int64_t r0 = at.tile * kStrip;
      const int64_t row_out = ((at.n * g.out[0] + at.p) * g.out[1] + at.q) * g.out[2];
      Pack<T, kVec> grad[kStrip];
#pragma unroll
      for (int o = 0; o < kStrip; ++o) {
        grad[o] = r0 + o < g.out[2] ? LoadPack<T, kVec>(dy + (row_out + r0 + o) * channels + k0) : ZeroPack<T, kVec>();
      }
      const StripWindow<T, kStride> window(g, x, at, k0);
      float grads[kStrip][kVec];
#pragma unroll
      for (int o = 0; o < kStrip; ++o) ToFloats(grad[o], grads[o]);
#pragma unroll
      for (int u = 0; u < 3; ++u) {
#pragma unroll
        for (int j = 0; j < window.kCols; ++j) {
          float value[kVec];
          ToFloats(window.cols[u][j], value);
#pragma unroll
          for (int o = 0; o < kStrip; ++o) {
            const int v = j - o * kStride;
            // Outputs past the row's end do not exist: skipped, not multiplied by a zero dy (an
            // inf or nan in x must not reach dw through them).
            if (v < 0 || v > 2 || r0 + o >= g.out[2]) continue;
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[u * 3 + v][e] += value[e] * grads[o][e];
          }
        }
      }
    });
  }
  ReduceWorkers<T, kVec, 9>(acc, plan, chunk, slice, 0, 9, 9, g.filters, partial, dw);
}

// dw for any depthwise geometry; packs of kVec features (K % kVec == 0). Block (chunk, tap block,
// slice) sums taps (t, u, v0 .. v0 + kTapBlock) of one window row, so the window's taps need
// ceil(V / kTapBlock) * T * U tap blocks (`tap_blocks`).
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    DepthwiseWgradKernel(const ConvGeometry g, const StripPlan plan, int64_t tap_blocks, const T* __restrict__ x,
                         const T* __restrict__ dy, float* __restrict__ partial, T* __restrict__ dw) {
  const int lane = threadIdx.x % plan.lanes, worker = threadIdx.x / plan.lanes;
  const int64_t chunk = blockIdx.x % plan.chunks, rest = blockIdx.x / plan.chunks;
  const int64_t tap_block = rest % tap_blocks, slice = rest / tap_blocks;
  const int64_t row_blocks = (g.window[2] + kTapBlock - 1) / kTapBlock;  // tap blocks per window row
  const int64_t window_row = tap_block / row_blocks, v0 = (tap_block - window_row * row_blocks) * kTapBlock;
  const int64_t t = window_row / g.window[1], u = window_row - t * g.window[1];
  const int valid_taps = int(std::min<int64_t>(kTapBlock, g.window[2] - v0));
  const int64_t pack = chunk * plan.lanes + lane;
  const int64_t filters = g.filters, k0 = pack * kVec;
  const InputChannels<kVec> source(k0, filters / g.channels);
  float acc[kTapBlock][kVec] = {};
  if (pack < plan.packs) {  // idle lanes still join the reduction
    ForEachStrip(plan, slice, worker, [&](const StripCursor& at) {
      const int64_t d = at.p * g.stride[0] + t * g.rhs_dilation[0] - g.pad[0];
      const int64_t h = at.q * g.stride[1] + u * g.rhs_dilation[1] - g.pad[1];
      if (d < 0 || d >= g.in[0] || h < 0 || h >= g.in[1]) return;
      const int64_t r0 = at.tile * kStrip;
      const int64_t row_out = ((at.n * g.out[0] + at.p) * g.out[1] + at.q) * g.out[2];
      float grad[kStrip][kVec] = {};
#pragma unroll
      for (int o = 0; o < kStrip; ++o) {
        if (r0 + o < g.out[2]) ToFloats(LoadPack<T, kVec>(dy + (row_out + r0 + o) * filters + k0), grad[o]);
      }
      const T* row = x + ((at.n * g.in[0] + d) * g.in[1] + h) * g.in[2] * g.channels;
#pragma unroll
      for (int i = 0; i < kTapBlock; ++i) {
        if (i >= valid_taps) break;
        const int64_t col0 = r0 * g.stride[2] + (v0 + i) * g.rhs_dilation[2] - g.pad[2];
#pragma unroll
        for (int o = 0; o < kStrip; ++o) {
          const int64_t col = col0 + o * g.stride[2];
          if (r0 + o >= g.out[2] || col < 0 || col >= g.in[2]) continue;
          float value[kVec];
          source.Load(row + col * g.channels, value);
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[i][e] += value[e] * grad[o][e];
        }
      }
    });
  }
  ReduceWorkers<T, kVec, kTapBlock>(acc, plan, chunk, slice, window_row * g.window[2] + v0, valid_taps,
                                    g.Taps(), filters, partial, dw);
}

// --- the tiled 3x3 kernel (16-bit, channels a multiple of 8) -------------------------------------------

// A block computes a tile of kTileRows output rows x `cols` output columns x `vectors` 16-byte
// channel vectors (8 channels each) of one image: it first copies the input pixels the tile's
// windows read into shared memory with cp.async (zeros outside x), then each thread computes one
// vector of kTileStrip vertically adjacent outputs from there. The copies hold no registers, so the
// blocks resident on an SM keep many bytes in flight while others compute: a memory-bound kernel
// needs that more than the register-staged Depthwise3x3Kernel's reuse.
constexpr int kTileThreads = 128;
constexpr int kTileRows = 8;      // output rows per block
constexpr int kTileStrip = 4;     // output rows per thread
constexpr int kTileVectors = 8;   // at most 8 vectors (64 channels, 128 bytes) of each pixel per block
static_assert(kTileThreads % (kTileRows / kTileStrip) == 0, "whole strips per block");

struct TilePlan {
  int vectors;            // channel vectors per pixel in a block (a power of two <= kTileVectors)
  int cols;               // output columns per block: kTileThreads / (vectors * strips per column)
  int64_t chunks;         // blocks across the channels: ceil(C / (8 * vectors))
  int64_t row_tiles, col_tiles;
  int64_t images;         // N * D (the trivial depth axis folded into the batch)
};

TilePlan MakeTilePlan(const ConvGeometry& g) {
  TilePlan plan;
  const int64_t vectors = g.channels / 8;
  plan.vectors = kTileVectors;
  while (plan.vectors > 1 && plan.vectors / 2 >= vectors) plan.vectors /= 2;
  plan.cols = kTileThreads / (plan.vectors * (kTileRows / kTileStrip));
  plan.chunks = CeilDiv(vectors, plan.vectors);
  plan.row_tiles = CeilDiv(g.out[1], kTileRows);
  plan.col_tiles = CeilDiv(g.out[2], plan.cols);
  plan.images = g.batch * g.out[0];
  return plan;
}

int TileSpan(int outputs, int stride) { return (outputs - 1) * stride + 3; }

size_t TileSharedBytes(const TilePlan& plan, int stride) {
  return size_t(TileSpan(kTileRows, stride)) * TileSpan(plan.cols, stride) * plan.vectors * 16;
}

// out = epilogue(the 3x3 conv of `in` with stride kStride on both axes): g's forward when `flip` is
// false; with `flip`, the conv with the window reversed (dgrad on the flipped geometry). T is a
// 16-bit type: a 16-byte vector holds 8 channels.
template <typename T, int kStride>
__global__ void __launch_bounds__(kTileThreads, 3)
    DepthwiseTile3x3Kernel(const ConvGeometry g, const TilePlan plan, const T* __restrict__ in,
                           const T* __restrict__ w, bool flip, const ConvEpilogue<T> epilogue, T* __restrict__ out) {
  extern __shared__ uint4 tile[];  // [span rows][span cols][vectors]
  constexpr int kSpanRows = (kTileRows - 1) * kStride + 3;
  const int span_cols = (plan.cols - 1) * kStride + 3;
  int64_t block = blockIdx.x;
  const int64_t chunk = block % plan.chunks;
  block /= plan.chunks;
  const int64_t col_tile = block % plan.col_tiles;
  block /= plan.col_tiles;
  const int64_t row_tile = block % plan.row_tiles;
  const int64_t image = block / plan.row_tiles;
  const int64_t channels = g.channels;
  const int64_t c_base = chunk * plan.vectors * 8;
  const int64_t h0 = row_tile * kTileRows * kStride - g.pad[1];
  const int64_t w0 = col_tile * plan.cols * kStride - g.pad[2];
  const int64_t in_image = image * g.in[1] * g.in[2];

  // The input pixels of the tile's windows, zeros outside x and past the channels.
  const int loads = kSpanRows * span_cols * plan.vectors;
  for (int i = threadIdx.x; i < loads; i += kTileThreads) {
    const int vector = i % plan.vectors, pixel = i / plan.vectors;
    const int64_t h = h0 + pixel / span_cols, col = w0 + pixel % span_cols;
    const int64_t c = c_base + vector * 8;
    if (h >= 0 && h < g.in[1] && col >= 0 && col < g.in[2] && c < channels) {
      CpAsync16(&tile[i], in + (in_image + h * g.in[2] + col) * channels + c);
    } else {
      tile[i] = make_uint4(0, 0, 0, 0);
    }
  }
  CpAsyncCommit();

  const int vector = threadIdx.x % plan.vectors;
  const int col = (threadIdx.x / plan.vectors) % plan.cols;
  const int strip = threadIdx.x / (plan.vectors * plan.cols);
  const int64_t c0 = c_base + vector * 8;
  const bool active = c0 < channels;
  float taps[9][8];
  LoadTaps<T, 3, 8>(w, channels, c0, flip, active, taps);
  CpAsyncWait<0>();
  __syncthreads();
  if (!active) return;

  float acc[kTileStrip][8] = {};
  const int first_row = strip * kTileStrip * kStride;
#pragma unroll
  for (int r = 0; r < (kTileStrip - 1) * kStride + 3; ++r) {
    float value[3][8];
#pragma unroll
    for (int v = 0; v < 3; ++v) {
      Unpack<T>(tile[((first_row + r) * span_cols + col * kStride + v) * plan.vectors + vector], value[v]);
    }
#pragma unroll
    for (int o = 0; o < kTileStrip; ++o) {
      const int u = r - o * kStride;
      if (u < 0 || u > 2) continue;
#pragma unroll
      for (int v = 0; v < 3; ++v) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[o][e] += value[v][e] * taps[u * 3 + v][e];
      }
    }
  }
  const int64_t q = col_tile * plan.cols + col;
  if (q >= g.out[2]) return;
#pragma unroll
  for (int o = 0; o < kTileStrip; ++o) {
    const int64_t p = row_tile * kTileRows + strip * kTileStrip + o;
    if (p < g.out[1]) {
      StoreOutputPack<T, 8>(epilogue, acc[o], ((image * g.out[1] + p) * g.out[2] + q) * channels + c0, c0, out);
    }
  }
}

// --- launchers -----------------------------------------------------------------------------------------

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The window Depthwise3x3Kernel and DepthwiseWgrad3x3Kernel take (their W stride is checked apart).
bool IsWindow3x3(const ConvGeometry& g) {
  return g.window[0] == 1 && g.window[1] == 3 && g.window[2] == 3 && g.rhs_dilation[2] == 1;
}

ffi::Error TooLarge(const char* stage, int64_t blocks) {
  return InvalidArgument(std::string("depthwise ") + stage + ": the problem needs " + std::to_string(blocks) +
                         " blocks, more than a grid holds");
}

// Launches kernel(g, plan, args...) with as many slices as fit on the device at once (one wave: the
// result does not depend on the split, which only forward stages may let vary).
template <typename Kernel, typename... Args>
ffi::Error LaunchOneWave(cudaStream_t stream, const char* stage, Kernel kernel, const ConvGeometry& g,
                         StripPlan plan, const Args&... args) {
  const int64_t resident = ResidentBlocks(kernel, kThreads, 0);
  SplitStrips(plan, std::min(resident / plan.chunks, CeilDiv(plan.strips, plan.workers)));
  const int64_t blocks = plan.chunks * plan.slices;
  if (blocks > INT_MAX) return TooLarge(stage, blocks);
  kernel<<<int(blocks), kThreads, 0, stream>>>(g, plan, args...);
  return LaunchError(stage);
}

// Whether DepthwiseTile3x3Kernel takes g (with m == 1 and 16-bit values checked by the caller):
// channels a multiple of 8, 16-byte aligned operands, a 1 x 3 x 3 window without dilation, equal H
// and W strides of 1 or 2, and a trivial depth axis (folded into the batch).
bool TakesTile3x3(const ConvGeometry& g, std::initializer_list<const void*> operands) {
  for (const void* p : operands) {
    if (!Aligned16(p)) return false;
  }
  return g.channels % 8 == 0 && IsWindow3x3(g) && g.rhs_dilation[1] == 1 &&
         g.stride[1] == g.stride[2] && g.stride[1] <= 2 && g.stride[0] == 1 && g.pad[0] == 0 &&
         g.in[0] == g.out[0];
}

template <typename T>
ffi::Error LaunchTile3x3(cudaStream_t stream, const ConvGeometry& g, const T* in, const T* w, bool flip,
                         const ConvEpilogue<T>& epilogue, T* out) {
  const TilePlan plan = MakeTilePlan(g);
  const int64_t blocks = plan.chunks * plan.col_tiles * plan.row_tiles * plan.images;
  if (blocks > INT_MAX) return TooLarge("3x3 tile", blocks);
  // At most 17 x 17 pixels of 8 vectors (or 17 x 129 of one): 37 KB, within the default 48 KB.
  const size_t shared = TileSharedBytes(plan, g.stride[1]);
  auto kernel = g.stride[1] == 1 ? DepthwiseTile3x3Kernel<T, 1> : DepthwiseTile3x3Kernel<T, 2>;
  kernel<<<int(blocks), kTileThreads, shared, stream>>>(g, plan, in, w, flip, epilogue, out);
  return LaunchError("depthwise 3x3 tile");
}

template <typename T>
ffi::Error LaunchFprop(cudaStream_t stream, const ConvGeometry& g, const T* x, const T* w,
                       const ConvEpilogue<T>& epilogue, T* y) {
  constexpr int kVec = kVectorWidth;
  const int64_t m = g.filters / g.channels;
  const bool vector = g.filters % kVec == 0 && Aligned16(w) && Aligned16(y) && Aligned16(epilogue.bias) &&
                      Aligned16(epilogue.residual) && (m > 1 || Aligned16(x));
  if constexpr (sizeof(T) == 2) {
    if (m == 1 && RowsTake(g, {x, w, y, epilogue.bias, epilogue.residual})) {
      return RowsConv<T>(stream, g, x, w, false, epilogue, y);
    }
    if (m == 1 && TakesTile3x3(g, {x, w, y, epilogue.bias, epilogue.residual})) {
      return LaunchTile3x3<T>(stream, g, x, w, false, epilogue, y);
    }
  }
  if (vector && m == 1 && IsWindow3x3(g) && g.stride[2] <= 2) {
    const StripPlan plan = MakePlan(g.filters / kVec, g.batch, g.out);
    if (g.stride[2] == 1) {
      return LaunchOneWave(stream, "fprop", Depthwise3x3Kernel<T, 1>, g, plan, x, w, false, epilogue, y);
    }
    return LaunchOneWave(stream, "fprop", Depthwise3x3Kernel<T, 2>, g, plan, x, w, false, epilogue, y);
  }
  if (vector) {
    return LaunchOneWave(stream, "fprop", DepthwiseFpropKernel<T, kVec>, g, MakePlan(g.filters / kVec, g.batch, g.out),
                         x, w, epilogue, y);
  }
  return LaunchOneWave(stream, "fprop", DepthwiseFpropKernel<T, 1>, g, MakePlan(g.filters, g.batch, g.out), x, w,
                       epilogue, y);
}

template <typename T>
ffi::Error LaunchDgrad(cudaStream_t stream, const ConvGeometry& g, const T* dy, const T* w, T* dx) {
  constexpr int kVec = kVectorWidth;
  const int64_t m = g.filters / g.channels;
  const bool vector = g.channels % kVec == 0 && Aligned16(dx) && (m > 1 || (Aligned16(dy) && Aligned16(w)));
  const bool unit_strides = g.stride[0] == 1 && g.stride[1] == 1 && g.stride[2] == 1;
  if (vector && m == 1 && unit_strides) {
    // dx[i] = sum over t of dy[i + pad - t * dilation] w[t]: the unit-stride conv of dy with the
    // window flipped and low padding (window - 1) * dilation - pad, from dy's grid to x's.
    ConvGeometry flipped = g;
    for (int a = 0; a < 3; ++a) {
      flipped.in[a] = g.out[a];
      flipped.out[a] = g.in[a];
      flipped.pad[a] = (g.window[a] - 1) * g.rhs_dilation[a] - g.pad[a];
    }
    if constexpr (sizeof(T) == 2) {
      if (RowsTake(flipped, {dy, w, dx})) return RowsConv<T>(stream, flipped, dy, w, true, ConvEpilogue<T>{}, dx);
      if (TakesTile3x3(flipped, {dy, w, dx})) return LaunchTile3x3<T>(stream, flipped, dy, w, true, ConvEpilogue<T>{}, dx);
    }
    if (IsWindow3x3(g)) {
      return LaunchOneWave(stream, "dgrad", Depthwise3x3Kernel<T, 1>, flipped,
                           MakePlan(g.channels / kVec, g.batch, g.in), dy, w, true, ConvEpilogue<T>{}, dx);
    }
  }
  if (vector) {
    return LaunchOneWave(stream, "dgrad", DepthwiseDgradKernel<T, kVec>, g, MakePlan(g.channels / kVec, g.batch, g.in),
                         dy, w, dx);
  }
  return LaunchOneWave(stream, "dgrad", DepthwiseDgradKernel<T, 1>, g, MakePlan(g.channels, g.batch, g.in), dy, w, dx);
}

// The bound on wgrad's number of slices: a function of g alone (see depthwise.h), at least 1;
// jaxdnn/_conv_kernels.py's _depthwise_wgrad_slices is the same formula.
int64_t WgradSlices(const ConvGeometry& g) {
  const int64_t strips = g.batch * g.out[0] * g.out[1] * CeilDiv(g.out[2], kStrip);
  const int64_t by_blocks = kWgradBlocks / CeilDiv(g.filters, kWgradChannels);
  return std::max<int64_t>(1, std::min(by_blocks, strips / kMinSliceStrips));
}

template <typename T>
ffi::Error LaunchWgrad(cudaStream_t stream, const ConvGeometry& g, const T* x, const T* dy, int64_t slices,
                       float* partial, T* dw) {
  constexpr int kVec = kVectorWidth;
  const int64_t m = g.filters / g.channels;
  const bool vector = g.filters % kVec == 0 && Aligned16(dy) && (m > 1 || Aligned16(x));
  StripPlan plan = MakePlan(vector ? g.filters / kVec : g.filters, g.batch, g.out);
  SplitStrips(plan, slices);
  bool rows = false;
  if constexpr (sizeof(T) == 2) rows = RowsTake(g, {x, dy});
  if (rows) {
    JAXDNN_RETURN_IF_ERROR(RowsWgrad<T>(stream, g, x, dy, slices, partial, dw, &slices));
  } else if (vector && m == 1 && IsWindow3x3(g) && g.stride[2] <= 2) {
    const int64_t blocks = plan.chunks * plan.slices;
    if (blocks > INT_MAX) return TooLarge("wgrad", blocks);
    if (g.stride[2] == 1) {
      DepthwiseWgrad3x3Kernel<T, 1><<<int(blocks), kThreads, 0, stream>>>(g, plan, x, dy, partial, dw);
    } else {
      DepthwiseWgrad3x3Kernel<T, 2><<<int(blocks), kThreads, 0, stream>>>(g, plan, x, dy, partial, dw);
    }
  } else {
    const int64_t tap_blocks = g.window[0] * g.window[1] * CeilDiv(g.window[2], kTapBlock);
    const int64_t blocks = plan.chunks * tap_blocks * plan.slices;
    if (blocks > INT_MAX) return TooLarge("wgrad", blocks);
    if (vector) {
      DepthwiseWgradKernel<T, kVec><<<int(blocks), kThreads, 0, stream>>>(g, plan, tap_blocks, x, dy, partial, dw);
    } else {
      DepthwiseWgradKernel<T, 1><<<int(blocks), kThreads, 0, stream>>>(g, plan, tap_blocks, x, dy, partial, dw);
    }
  }
  JAXDNN_RETURN_IF_ERROR(LaunchError("depthwise wgrad"));
  if (slices == 1) return ffi::Error::Success();
  const int64_t count = g.Taps() * g.filters;
  const int64_t blocks = std::min(kMaxSumBlocks, CeilDiv(count, kThreads));
  SumSlicesKernel<T><<<int(blocks), kThreads, 0, stream>>>(partial, slices, count, dw);
  return LaunchError("depthwise wgrad sum");
}

ffi::Error NotDepthwise(const char* stage) {
  return InvalidArgument(std::string("depthwise ") + stage +
                         ": not a depthwise convolution (groups == C, K a multiple of C, no lhs dilation)");
}

}  // namespace

bool IsDepthwise(const ConvGeometry& g) {
  for (int a = 0; a < 3; ++a) {
    if (g.lhs_dilation[a] != 1) return false;
  }
  return g.channels >= 1 && g.groups == g.channels && g.filters >= g.channels && g.filters % g.channels == 0;
}

ffi::Error DepthwiseFprop(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* x,
                          const void* w, const void* bias, const void* residual, int64_t activation,
                          float activation_param, void* y) {
  if (!IsDepthwise(g)) return NotDepthwise("fprop");
  if (activation < 0 || activation >= kNumActivations) {
    return InvalidArgument("depthwise fprop: unknown activation " + std::to_string(activation));
  }
  if (g.OutPixels() * g.filters == 0) return ffi::Error::Success();
  if (y == nullptr || w == nullptr || (g.InPixels() > 0 && x == nullptr)) {
    return InvalidArgument("depthwise fprop: null operand");
  }
  return DispatchFloat<float, __nv_bfloat16, __half>(dtype, "depthwise fprop dtype", [&](auto type_tag) {
    using T = decltype(type_tag);
    ConvEpilogue<T> epilogue;
    epilogue.bias = static_cast<const T*>(bias);
    epilogue.residual = static_cast<const T*>(residual);
    epilogue.activation = activation;
    epilogue.activation_param = activation_param;
    return LaunchFprop<T>(stream, g, static_cast<const T*>(x), static_cast<const T*>(w), epilogue,
                          static_cast<T*>(y));
  });
}

ffi::Error DepthwiseDgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* dy,
                          const void* w, void* dx) {
  if (!IsDepthwise(g)) return NotDepthwise("dgrad");
  if (g.InPixels() * g.channels == 0) return ffi::Error::Success();
  if (dx == nullptr || w == nullptr || (g.OutPixels() > 0 && dy == nullptr)) {
    return InvalidArgument("depthwise dgrad: null operand");
  }
  return DispatchFloat<float, __nv_bfloat16, __half>(dtype, "depthwise dgrad dtype", [&](auto type_tag) {
    using T = decltype(type_tag);
    return LaunchDgrad<T>(stream, g, static_cast<const T*>(dy), static_cast<const T*>(w), static_cast<T*>(dx));
  });
}

ffi::Error DepthwiseWgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* x,
                          const void* dy, void* workspace, size_t workspace_bytes, void* dw) {
  if (!IsDepthwise(g)) return NotDepthwise("wgrad");
  if (g.Taps() * g.filters == 0) return ffi::Error::Success();
  if (dw == nullptr || (g.InPixels() > 0 && x == nullptr) || (g.OutPixels() > 0 && dy == nullptr)) {
    return InvalidArgument("depthwise wgrad: null operand");
  }
  const int64_t partial_bytes = g.Taps() * g.filters * int64_t(sizeof(float));
  const int64_t held = workspace != nullptr ? int64_t(workspace_bytes) / partial_bytes : 0;
  const int64_t slices = std::max<int64_t>(1, std::min(WgradSlices(g), held));
  return DispatchFloat<float, __nv_bfloat16, __half>(dtype, "depthwise wgrad dtype", [&](auto type_tag) {
    using T = decltype(type_tag);
    return LaunchWgrad<T>(stream, g, static_cast<const T*>(x), static_cast<const T*>(dy), slices,
                          static_cast<float*>(workspace), static_cast<T*>(dw));
  });
}

}  // namespace jaxdnn
