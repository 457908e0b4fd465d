// The halo kernels (see halo_sm90.h) on Hopper's tensor cores (wgmma, TMA).
//
// The work comes in units: strips of up to 64 pixels of an image row R = (n, d, h) (a row of at most 64
// pixels is one strip), ordered by image, then strip, then row, so that the units before and after a unit are
// the same strip of rows R - 1 and R + 1. A CTA takes a contiguous range [first, end) of the units and walks
// it in order. TMA stages every unit of the activations once, through a ring of shared-memory stages, with
// its halo: stage e holds unit first - 1 + e (3x3 windows; first + e for one row of S = 3, 5 or 7 taps) from
// one pixel (S / 2) before the strip to past its end (staged pixel p is the strip's pixel p - 1; pixels
// outside the row, and rows outside the array, zero), so output unit first + i finds the strips of
// rows R - 1, R, R + 1 of its taps in stages i, i + 1, i + 2. A tap (r, s) is then stage i + r read from its
// pixel s: a wgmma descriptor whose start is moved s 128-byte pixels into the stage (the 128-byte swizzle is a
// function of the shared-memory address, so a descriptor starting on any pixel reads what TMA wrote there). A
// row R + r - 1 of another image (h + r - 1 outside [0, H)) contributes nothing. Products are 64 x 64 wgmma
// tiles, float32 sums in registers.
//
// - fprop: consumer warpgroups take pairs of output units: y[unit] (64 pixels x 64 filters) = the sum
//   over the taps of x's shifted strip (K-major A; a zero row for taps outside the image) times
//   w[r, s] (B [C, K], resident in shared memory), then the epilogue (bias, residual, activation)
//   into a shared-memory tile and a TMA store of the unit's pixels inside the row.
// - dgrad: the same over dy with w's taps flipped and read K-major (dx[R, q, c] = sum over (r, s, k)
//   of dy[R + r - 1, q + s - 1, k] w[2 - r, 2 - s, c, k]).
// - wgrad: a stage also holds dy's unit first + e - 2 (first + e for one row; pixels past W zero), and
//   consumer warpgroup r (0..2) owns the taps (r, s), s = 0..2 (for one row: the taps s = r + 3 u), over every
//   unit: dW[k, r, s, c] += sum over pixels q of dy[R, q, k] x[R + r - 1, q + s - 1, c], dy^T as A
//   and the shifted x strip as B (both MN-major, the pixels the reduction axis; rows of another image
//   skipped). Its sums stay in registers (3 x 32 a thread) until the CTA's last unit, then go to the
//   CTA's partial sum; two more kernels add the partial sums in a fixed order. With 128 channels on
//   one side, a second CTA of each slice takes the other 64.
// - pointwise (a 1x1 window: a zero-width halo): the same machinery over chunks of 64 pixels for the
//   wgrad and the plain fprop/dgrad of 1x1 layers with 64 channels on one side (see below).
//
// ptxas serializes wgmma (C7510/C7515/C7520) under a branch it cannot prove warp-uniform and after
// ordinary writes to their accumulators: the warpgroup index comes from sm90::WarpgroupIndex, and
// first products overwrite their accumulators rather than adding to zeros.
#include <cuda.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <string>
#include <type_traits>

#include "common/cuda_common.cuh"
#include "common/sm90_async.cuh"
#include "conv/conv_epilogue.h"
#include "conv/halo_sm90.h"
#include "conv/sm90_maps.h"

namespace jaxdnn {
namespace {

constexpr int kChannels = 64;                           // C = K
constexpr int kPixelBytes = kChannels * 2;              // a pixel's channels: one 128-byte swizzled row
constexpr int kRowPixels = 64;                          // a product's pixels: rows padded to 4 steps of 16
constexpr int kHaloPixels = 72;                         // a staged row: pixels -1 .. 70 (products read to 64)
constexpr int kHaloBytes = kHaloPixels * kPixelBytes;   // 9 KB
constexpr int kRowBytes = kRowPixels * kPixelBytes;     // 8 KB
constexpr int kTapBytes = kChannels * kPixelBytes;      // one tap of the filter, [C, K]: 8 KB
constexpr int kFilterBytes = 9 * kTapBytes;
constexpr int kWarpgroup = 128;
static_assert(kHaloWgradSlices % (2 * kHaloWgradGroups) == 0, "groups of equal size, also of half the slices");

// The units the CTAs take: strips of up to 64 output pixels of an image row (a row of at most 64 pixels
// is one strip), in the order (image n d, strip, row h), so that the units before and after a unit are
// the strips above and below it (those of the neighbouring image rows, where h allows).
struct Rows {
  int height;  // H
  int strips;  // a row's strips: ceil(W / 64)
  int count;   // the units: N D strips H
};

// Where unit u lies: its image row (n d h) of the [N D H][W] pixels, its strip's first pixel, and h.
// The units just outside [0, count) that the rings load map to rows outside the array (TMA's zeros).
struct Unit {
  int row, pixel, h;
  __device__ Unit(const Rows& rows, int u) {
    const int column = u / rows.height;
    h = u % rows.height;
    row = column / rows.strips * rows.height + h;
    pixel = column % rows.strips * kRowPixels;
  }
  // Unit u + 1 (the producers walk their units so: no division a load).
  __device__ void Next(const Rows& rows) {
    ++row;
    if (++h < rows.height) return;
    h = 0;
    row -= rows.height;  // the strip to the right, from the image's first row
    pixel += kRowPixels;
    if (pixel < rows.strips * kRowPixels) return;
    pixel = 0;
    row += rows.height;  // the next image
  }
};

// This CTA's rows [first, first + count) of `total`, for `ctas` CTAs.
struct Range {
  int first, count;
  __device__ Range(int total, int cta, int ctas)
      : first(int(int64_t(total) * cta / ctas)), count(int(int64_t(total) * (cta + 1) / ctas) - first) {}
};

// --- fprop and dgrad -----------------------------------------------------------------------------

// Consumer warpgroups take groups of kFpropRows consecutive output rows in turn: as many
// accumulators whose wgmma chains interleave (one 64 x 64 chain alone leaves the tensor cores
// waiting on its latency), with enough warpgroups that one's epilogue overlaps the others' products.
// (Three rows in each of two warpgroups ran 5% slower.)
constexpr int kFpropRows = 2;
constexpr int kFpropConsumers = 3;
constexpr int kFpropThreads = kFpropConsumers * kWarpgroup + 32;  // and one producer warp
constexpr int kFpropStages = 12;  // 6 rows in products read 8 stages; the rest are loads ahead
// w, the stages, the zero row, a result tile per consumer warpgroup, the barriers, alignment
constexpr int kFpropShared = kFilterBytes + (kFpropStages + 1) * kHaloBytes + kFpropConsumers * kRowBytes +
                             (2 * kFpropStages + 1) * 8 + 1024;

// The epilogue of one output unit held in a warpgroup's accumulator (pixel q, feature k of element
// j as sm90::Wgmma lays it out): act(acc + bias + residual), rounded once, into the warpgroup's
// [64 pixels][64 features] tile as TMA's 128-byte swizzle lays it out (a TMA store takes the unit's
// pixels inside the row from there: stores of each thread's pairs ran at a third of its rate). The
// unit starts at pixel `start` of y; `inside` of its pixels lie inside the row.
template <typename T>
__device__ __forceinline__ void StageRow(const float (&acc)[32], const float (&bias)[16], const T* residual,
                                         int64_t activation, float activation_param, int64_t start, int inside,
                                         int pixel, int col, uint8_t* tile) {
  float v[32];
#pragma unroll
  for (int j = 0; j < 32; ++j) v[j] = acc[j] + bias[(j >> 2) * 2 + (j & 1)];
  if (residual != nullptr) {
    uint32_t pairs[16];
#pragma unroll
    for (int j = 0; j < 32; j += 2) {
      const int q = pixel + 8 * ((j >> 1) & 1), k = col + 8 * (j >> 2);
      pairs[j / 2] = q < inside ? *reinterpret_cast<const uint32_t*>(residual + (start + q) * kChannels + k) : 0u;
    }
#pragma unroll
    for (int j = 0; j < 32; j += 2) {
      const T* two = reinterpret_cast<const T*>(&pairs[j / 2]);
      v[j] += ToFloat(two[0]);
      v[j + 1] += ToFloat(two[1]);
    }
  }
  if (activation != 0) ActivateKindN<32>(activation, v, activation_param);
#pragma unroll
  for (int j = 0; j < 32; j += 2) {
    const int q = pixel + 8 * ((j >> 1) & 1), k = col + 8 * (j >> 2);
    *reinterpret_cast<uint32_t*>(tile + q * kPixelBytes + ((k / 8) ^ (q % 8)) * 16 + k % 8 * 2) =
        sm90::PackPair<T>(v[j], v[j + 1]);
  }
}

// out for the units of this CTA: fprop (kDgrad false) y = epilogue(conv(x, w)) from in = x; dgrad dx
// from in = dy (no epilogue operands). A window of kTapRows rows by kTapCols columns (3 x 3, or one row
// of 3, 5 or 7); w [kTapRows, kTapCols, C, K] stays in shared memory throughout. Stage e holds unit
// first - kTapRows / 2 + e, from kTapCols / 2 pixels before its strip, so that output unit i finds its
// tap row r in stage i + r and the tap (r, s) of its pixel q at the stage's pixel q + s.
template <typename T, bool kDgrad, int kTapRows, int kTapCols>
__global__ void __launch_bounds__(kFpropThreads, 1)
    HaloFpropKernel(const __grid_constant__ CUtensorMap in_map, const __grid_constant__ CUtensorMap w_map,
                    const __grid_constant__ CUtensorMap out_map, Rows rows, int width, ConvEpilogue<T> epilogue) {
  constexpr int kTaps = kTapRows * kTapCols, kHalo = kTapRows / 2, kPad = kTapCols / 2;
  static_assert(kTaps * kTapBytes <= kFilterBytes && kRowPixels + 2 * kPad <= kHaloPixels, "window too wide");
  extern __shared__ uint8_t shared_raw[];
  uint8_t* filter = sm90::AlignedShared(shared_raw);
  uint8_t* stages = filter + kFilterBytes;
  uint8_t* zeros = stages + kFpropStages * kHaloBytes;  // the row of taps outside the image
  uint8_t* tiles = zeros + kHaloBytes;  // a result tile per consumer warpgroup
  uint64_t* full = reinterpret_cast<uint64_t*>(tiles + kFpropConsumers * kRowBytes);
  uint64_t* empty = full + kFpropStages;
  uint64_t* filter_full = empty + kFpropStages;
  const Range range(rows.count, blockIdx.x, gridDim.x);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) sm90::InitRing<kFpropStages>(full, empty, kTapRows, filter_full);  // one use a tap row
  for (int i = threadIdx.x; i < kHaloBytes / 16; i += blockDim.x) reinterpret_cast<uint4*>(zeros)[i] = uint4{};
  sm90::FenceProxyAsync();
  __syncthreads();
  if (range.count == 0) return;

  if (warp == kFpropConsumers * 4) {  // the producer
    if (threadIdx.x % 32 == 0) {
      sm90::BarrierArriveExpectTx(filter_full, kTaps * kTapBytes);
      for (int j = 0; j < kTaps; ++j) sm90::TmaLoad4d(filter + j * kTapBytes, &w_map, filter_full, 0, j * 64, 0, 0);
      // a last group of fewer units waits for them all
      Unit unit(rows, range.first - kHalo);
      for (int e = 0; e < range.count + kFpropRows + kTapRows - 2; ++e, unit.Next(rows)) {
        sm90::WaitEmpty<kFpropStages>(empty, e);
        uint64_t* bar = &full[e % kFpropStages];
        sm90::BarrierArriveExpectTx(bar, kHaloBytes);
        sm90::TmaLoad4d(stages + e % kFpropStages * kHaloBytes, &in_map, bar, 0, unit.pixel - kPad, unit.row, 0);
      }
    }
    return;
  }

  const int lane = threadIdx.x % 32, pixel = 16 * (warp % 4) + lane / 4, col = 2 * (lane % 4);
  float bias[16];  // this thread's features' bias, for every unit
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    bias[j] = epilogue.bias != nullptr ? ToFloat(epilogue.bias[col + 8 * (j / 2) + j % 2]) : 0.f;
  }
  const int group = sm90::WarpgroupIndex();
  const bool issues = threadIdx.x % kWarpgroup == 0;  // the warpgroup's thread that issues its stores
  uint8_t* tile = tiles + group * kRowBytes;
  sm90::BarrierWait(filter_full, 0);
  for (int i = kFpropRows * group; i < range.count; i += kFpropRows * kFpropConsumers) {
    const int units_here = min(kFpropRows, range.count - i);
#pragma unroll
    for (int e = 0; e < kFpropRows + kTapRows - 1; ++e) sm90::WaitFull<kFpropStages>(full, i + e);
    float acc[kFpropRows][32];  // set by the first product (accumulate off)
    const int h = (range.first + i) % rows.height;
    bool valid[kFpropRows][kTapRows];  // unit t exists and its tap row r lies in its image; else zeros
#pragma unroll
    for (int t = 0; t < kFpropRows; ++t) {
      const int ht = (h + t) % rows.height;  // the second unit may start the next strip or image
#pragma unroll
      for (int r = 0; r < kTapRows; ++r) {
        valid[t][r] = t < units_here && ht + r - kHalo >= 0 && ht + r - kHalo < rows.height;
      }
    }
    sm90::WgmmaFence();
#pragma unroll
    for (int r = 0; r < kTapRows; ++r) {
#pragma unroll
      for (int s = 0; s < kTapCols; ++s) {
        const uint8_t* tap = filter + (kDgrad ? kTaps - 1 - kTapCols * r - s : kTapCols * r + s) * kTapBytes;
#pragma unroll
        for (int step = 0; step < kRowPixels / 16; ++step) {
          const uint64_t b = kDgrad ? sm90::DescriptorKMajor(tap + step * 32)  // B [C, K]: K the reduction
                                    : sm90::DescriptorMNMajor(tap + step * 16 * kPixelBytes, 0);  // C the reduction
#pragma unroll
          for (int t = 0; t < kFpropRows; ++t) {  // no branch around the wgmma: ptxas would serialize them
            const uint8_t* row = valid[t][r] ? stages + (i + t + r) % kFpropStages * kHaloBytes : zeros;
            const uint64_t a = sm90::DescriptorKMajor(row + s * kPixelBytes + step * 32);
            sm90::Wgmma<64, T>::template SS<kDgrad ? 0 : 1>(acc[t], a, b, r + s + step > 0);
          }
        }
      }
    }
    sm90::WgmmaCommit();
#pragma unroll
    for (int t = 0; t < kFpropRows; ++t) sm90::FenceRegisters(acc[t]);
    sm90::WgmmaWait<0>();
#pragma unroll
    for (int t = 0; t < kFpropRows; ++t) sm90::FenceRegisters(acc[t]);
    // Stage e is read by units e - kTapRows + 1 .. e; with three tap rows, unit 0 also stands in for
    // units -2 and -1.
    if (threadIdx.x % kWarpgroup == 0) {
      for (int t = 0; t < units_here; ++t) {
        for (int r = 0; r < kTapRows; ++r) sm90::BarrierArrive(&empty[(i + t + r) % kFpropStages]);
      }
      if (kTapRows == 3 && i == 0) {
        sm90::BarrierArrive(&empty[0]);
        sm90::BarrierArrive(&empty[0]);
        sm90::BarrierArrive(&empty[1]);
      }
    }
#pragma unroll
    for (int t = 0; t < kFpropRows; ++t) {
      if (t < units_here) {
        const Unit unit(rows, range.first + i + t);
        if (issues) sm90::BulkWaitReads();  // the tile's previous store has read it
        sm90::NamedBarrierSync(1 + group, kWarpgroup);
        StageRow(acc[t], bias, epilogue.residual, epilogue.activation, epilogue.activation_param,
                 int64_t(unit.row) * width + unit.pixel, width - unit.pixel, pixel, col, tile);
        sm90::FenceProxyAsync();
        sm90::NamedBarrierSync(1 + group, kWarpgroup);
        if (issues) sm90::TmaStore4d(&out_map, tile, 0, unit.pixel, unit.row, 0);
      }
    }
  }
  if (issues) sm90::BulkWaitAll();
}

// --- wgrad ---------------------------------------------------------------------------------------

constexpr int kWgradStageBytes = kHaloBytes + kRowBytes;  // x's row and dy's: 17 KB, 1024-byte aligned parts
constexpr int kWgradStages = 8;                                // the producer runs up to 5 rows ahead
constexpr int kWgradConsumers = 3;                        // warpgroups: one per tap row r
constexpr int kWgradThreads = kWgradConsumers * kWarpgroup + 32;  // and one producer warp
// the stages, a row of zeros, the barriers, alignment
constexpr int kWgradShared = kWgradStages * kWgradStageBytes + kHaloBytes + 2 * kWgradStages * 8 + 1024;

// partial[blockIdx.y] [K, kTapRows, 3, C] for slice blockIdx.y of the units: the 64 x 64 block of its
// filters and channels in 64-channel chunk blockIdx.x of the wide side (K or C, when it has 128: the
// two CTAs of a slice are neighbours, so that x or dy, which both read, comes from L2 the second
// time). Stage e holds x's unit first - halo + e (from kTapCols / 2 pixels before its strip) and dy's
// unit first - 2 halo + e (halo = kTapRows / 2), so unit i finds its dy in stage i + 2 halo and x for
// its tap row r in stage i + r. With 3 tap rows, warpgroup r owns the taps (r, 0..2); with 1,
// warpgroup g owns the taps (0, g + 3 u) for u < kCols (a chain of 4 kCols products a unit: the loads
// set the pace), where a 5-tap window's warpgroup 2 multiplies a sixth tap whose sums it drops.
template <typename T, int kTapRows, int kTapCols>
__global__ void __launch_bounds__(kWgradThreads, 1)
    HaloWgradKernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap dy_map, Rows rows,
                    int channels, int filters, float* __restrict__ partial) {
  constexpr int kHalo = kTapRows / 2, kPad = kTapCols / 2;
  constexpr int kCols = kTapRows == 3 ? 3 : (kTapCols + 2) / 3;  // the taps a warpgroup owns
  static_assert(kTapRows == 1 || kTapCols == 3, "3 x 3, or one row of taps");
  static_assert(kRowPixels + 3 * kCols - 1 <= kHaloPixels, "a warpgroup's last tap reads past the stage");
  extern __shared__ uint8_t shared_raw[];
  uint8_t* stages = sm90::AlignedShared(shared_raw);
  uint8_t* zeros = stages + kWgradStages * kWgradStageBytes;  // x's row for tap rows outside the image
  uint64_t* full = reinterpret_cast<uint64_t*>(zeros + kHaloBytes);
  uint64_t* empty = full + kWgradStages;
  for (int i = threadIdx.x; i < kHaloBytes / 16; i += blockDim.x) reinterpret_cast<uint4*>(zeros)[i] = uint4{};
  sm90::FenceProxyAsync();
  const Range range(rows.count, blockIdx.y, gridDim.y);
  const int x_chunk = channels > kChannels ? blockIdx.x : 0, dy_chunk = filters > kChannels ? blockIdx.x : 0;
  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) sm90::InitRing<kWgradStages>(full, empty, kWgradConsumers);
  __syncthreads();

  if (warp == kWgradConsumers * 4) {  // the producer
    if (threadIdx.x % 32 == 0) {
      Unit x_unit(rows, range.first - kHalo), dy_unit(rows, range.first);
      for (int e = 0; e < range.count + 2 * kHalo * (range.count > 0); ++e) {
        sm90::WaitEmpty<kWgradStages>(empty, e);
        uint8_t* at = stages + e % kWgradStages * kWgradStageBytes;
        uint64_t* bar = &full[e % kWgradStages];
        const bool with_dy = e >= 2 * kHalo;
        sm90::BarrierArriveExpectTx(bar, kHaloBytes + (with_dy ? kRowBytes : 0));
        sm90::TmaLoad4d(at, &x_map, bar, 0, x_chunk, x_unit.pixel - kPad, x_unit.row);
        x_unit.Next(rows);
        if (with_dy) {
          sm90::TmaLoad4d(at + kHaloBytes, &dy_map, bar, 0, dy_chunk, dy_unit.pixel, dy_unit.row);
          dy_unit.Next(rows);
        }
      }
    }
    return;
  }

  const int group = sm90::WarpgroupIndex();
  // The column of the warpgroup's u-th tap: u (3 x 3), or group + 3 u (one row of taps).
  const int r = kTapRows == 3 ? group : 0, first_col = kTapRows == 3 ? 0 : group, col_step = kTapRows == 3 ? 1 : 3;
  float acc[kCols][32];
#pragma unroll
  for (int s = 0; s < kCols; ++s) {
#pragma unroll
    for (int j = 0; j < 32; ++j) acc[s][j] = 0.f;
  }
  for (int i = 0; i < range.count; ++i) {
    if (i == 0) {
      for (int e = 0; e < 2 * kHalo; ++e) sm90::WaitFull<kWgradStages>(full, e);
    }
    sm90::WaitFull<kWgradStages>(full, i + 2 * kHalo);
    // A tap row outside the image multiplies zeros: no branch around the wgmma, which made ptxas
    // serialize them (C7519): 2% of the time of the 3x3 56^2 64 -> 64 layer, 4% of the 112^2 64 -> 128 one.
    const int h = (range.first + i) % rows.height + r - kHalo;
    const uint8_t* x_row = h >= 0 && h < rows.height ? stages + (i + r) % kWgradStages * kWgradStageBytes : zeros;
    const uint8_t* dy_row = stages + (i + 2 * kHalo) % kWgradStages * kWgradStageBytes + kHaloBytes;
    sm90::WgmmaFence();
#pragma unroll
    for (int step = 0; step < kRowPixels / 16; ++step) {  // whole units: pixels past the row are zeros
      const uint64_t a = sm90::DescriptorMNMajor(dy_row + step * 16 * kPixelBytes, 0);
#pragma unroll
      for (int s = 0; s < kCols; ++s) {
        const uint64_t b = sm90::DescriptorMNMajor(x_row + (step * 16 + first_col + col_step * s) * kPixelBytes, 0);
        sm90::Wgmma<64, T>::template SS<1, 1>(acc[s], a, b, 1);
      }
    }
    sm90::WgmmaCommit();
#pragma unroll
    for (int s = 0; s < kCols; ++s) sm90::FenceRegisters(acc[s]);
    sm90::WgmmaWait<1>();  // unit i - 1's products are done: its stage may be refilled
    if (i >= 1 && threadIdx.x % kWarpgroup == 0) sm90::BarrierArrive(&empty[(i - 1) % kWgradStages]);
  }
  sm90::WgmmaWait<0>();
#pragma unroll
  for (int s = 0; s < kCols; ++s) sm90::FenceRegisters(acc[s]);

  // The accumulator's rows are filters k, its columns channels c. Pairs of them stored as 8-byte words
  // (StoreWords): with C and K at run time the float2 stores had compiled to two 4-byte ones each, and
  // the wgrad of the 3x3 56^2 64 -> 64 layer took 0.075 ms against 0.065-0.068 with constant sizes.
  constexpr int kTaps = kTapRows * kTapCols;
  float* at = partial + int64_t(blockIdx.y) * kTaps * channels * filters;
  const int lane = threadIdx.x % 32, row = 16 * (warp % 4) + lane / 4, col = 2 * (lane % 4);
#pragma unroll
  for (int s = 0; s < kCols; ++s) {
    const int tap_col = first_col + col_step * s, tap = r * kTapCols + tap_col;
    if (tap_col >= kTapCols) continue;  // a tap past the window (5 taps: warpgroup 2's second)
#pragma unroll
    for (int j = 0; j < 32; j += 2) {
      const int k = dy_chunk * kChannels + row + 8 * ((j >> 1) & 1), c = x_chunk * kChannels + col + 8 * (j >> 2);
      StoreWords(at + (k * kTaps + tap) * channels + c, make_float2(acc[s][j], acc[s][j + 1]));
    }
  }
}

// --- pointwise wgrad ------------------------------------------------------------------------------

// A 1x1 convolution's dW [K, C] (as a partial sum) with 64 channels on one side, the narrow one (x's
// C or dy's K: the products' M) and 64, 128 or 256 on the other, the wide one (kWide chunks of 64:
// N): the halo wgrad with a zero-width halo. A CTA takes a range of 64-pixel chunks; a stage holds
// one chunk of the narrow operand and of the wide one ([64 pixels][64 channels] boxes, the wide
// one's side by side); the two consumer warpgroups take alternate chunks, each adding the chunk's
// narrow^T wide (both MN-major, the pixels the reduction axis) into its own 64 x 64 kWide sums,
// which meet in shared memory at the end.
constexpr int kPointwiseStages = 4;
constexpr int kPointwiseConsumers = 2;
constexpr int kPointwiseThreads = kPointwiseConsumers * kWarpgroup + 32;  // and one producer warp
constexpr int kChunkBytes = kRowPixels * kPixelBytes;                        // [64 pixels][64 channels]

template <int kWide>
constexpr int PointwiseShared() {
  return kPointwiseStages * (1 + kWide) * kChunkBytes + 2 * kPointwiseStages * 8 + 1024;
}

struct Pointwise {
  int chunks;          // 64-pixel chunks of the N D H W pixels (the last one zero-filled past the end)
  int channels;        // C
  bool narrow_is_x;    // x has the 64 channels (C = 64, K = 64 kWide), else dy (K = 64)
};

template <typename T, int kWide>
__global__ void __launch_bounds__(kPointwiseThreads, 1)
    PointwiseWgradKernel(const __grid_constant__ CUtensorMap narrow_map, const __grid_constant__ CUtensorMap wide_map,
                         Pointwise p, float* __restrict__ partial) {
  constexpr int kStageBytes = (1 + kWide) * kChunkBytes;
  extern __shared__ uint8_t shared_raw[];
  uint8_t* stages = sm90::AlignedShared(shared_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(stages + kPointwiseStages * kStageBytes);
  uint64_t* empty = full + kPointwiseStages;
  const Range range(p.chunks, blockIdx.x, gridDim.x);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) sm90::InitRing<kPointwiseStages>(full, empty, 1);  // a chunk is one warpgroup's
  __syncthreads();

  if (warp == kPointwiseConsumers * 4) {  // the producer
    if (threadIdx.x % 32 == 0) {
      for (int e = 0; e < range.count; ++e) {
        sm90::WaitEmpty<kPointwiseStages>(empty, e);
        uint8_t* at = stages + e % kPointwiseStages * kStageBytes;
        uint64_t* bar = &full[e % kPointwiseStages];
        const int pixel = (range.first + e) * kRowPixels;
        sm90::BarrierArriveExpectTx(bar, kStageBytes);
        sm90::TmaLoad4d(at, &narrow_map, bar, 0, 0, pixel, 0);
        for (int j = 0; j < kWide; ++j) sm90::TmaLoad4d(at + (1 + j) * kChunkBytes, &wide_map, bar, 0, j, pixel, 0);
      }
    }
    return;
  }

  const int group = sm90::WarpgroupIndex();
  float acc[32 * kWide];  // set by the first chunk's first product (zeroing them would serialize the wgmma)
  for (int i = group; i < range.count; i += kPointwiseConsumers) {
    sm90::WaitFull<kPointwiseStages>(full, i);
    const uint8_t* narrow = stages + i % kPointwiseStages * kStageBytes;
    sm90::WgmmaFence();
#pragma unroll
    for (int step = 0; step < kRowPixels / 16; ++step) {
      const uint64_t a = sm90::DescriptorMNMajor(narrow + step * 16 * kPixelBytes, 0);
      const uint64_t b = sm90::DescriptorMNMajor(narrow + kChunkBytes + step * 16 * kPixelBytes, kChunkBytes);
      sm90::Wgmma<64 * kWide, T>::template SS<1, 1>(acc, a, b, i != group || step > 0);
    }
    sm90::WgmmaCommit();
    sm90::FenceRegisters(acc);
    sm90::WgmmaWait<1>();  // this warpgroup's previous chunk is done: its stage may be refilled
    if (i >= kPointwiseConsumers && threadIdx.x % kWarpgroup == 0) {
      sm90::BarrierArrive(&empty[(i - kPointwiseConsumers) % kPointwiseStages]);
    }
  }
  sm90::WgmmaWait<0>();
  sm90::FenceRegisters(acc);
  if (group >= range.count) {  // no chunk
#pragma unroll
    for (int j = 0; j < 32 * kWide; ++j) acc[j] = 0.f;
  }

  // Warpgroup 1's sums go through shared memory (the stages, every load consumed) to warpgroup 0,
  // which writes the CTA's partial sum [K, C]: rows of the accumulator are the narrow side.
  const int thread = threadIdx.x % kWarpgroup;
  float* exchange = reinterpret_cast<float*>(stages);
  sm90::NamedBarrierSync(1, kPointwiseConsumers * kWarpgroup);
  if (group == 1) {
#pragma unroll
    for (int j = 0; j < 32 * kWide; ++j) exchange[j * kWarpgroup + thread] = acc[j];
  }
  sm90::NamedBarrierSync(1, kPointwiseConsumers * kWarpgroup);
  if (group != 0) return;
  float* at = partial + int64_t(blockIdx.x) * kChannels * 64 * kWide;
  const int lane = threadIdx.x % 32, row = 16 * (warp % 4) + lane / 4, col = 2 * (lane % 4);
#pragma unroll
  for (int j = 0; j < 32 * kWide; j += 2) {  // the elements (m, n) and (m, n + 1)
    const int m = row + 8 * ((j >> 1) & 1), n = col + 8 * (j >> 2);
    const float2 sum = make_float2(acc[j] + exchange[j * kWarpgroup + thread],
                                   acc[j + 1] + exchange[(j + 1) * kWarpgroup + thread]);
    if (p.narrow_is_x) {  // [k, c]: k = n, c = m
      at[n * kChannels + m] = sum.x;
      at[(n + 1) * kChannels + m] = sum.y;
    } else {  // k = m, c = n: one 8-byte word (two 4-byte stores fill half a sector each)
      StoreWords(at + m * p.channels + n, sum);
    }
  }
}

// A 1x1 convolution's plain fprop (x with C = 64: y [P, N] = x [P, 64] w, N = K) or dgrad (dy with K =
// 64: dx [P, N] = dy [P, 64] w^T, N = C), N = 64, 128 or 256: a GEMM of reduction 64, as memory-bound as
// its copy. The CTAs stream their range of 64-pixel chunks through a ring of stages with w resident
// in shared memory ([64][N], in 64-column chunks: B MN-major for fprop; [N][64]: K-major for dgrad);
// the two consumer warpgroups take alternate chunks: four m64nNk16 products, then the chunk's
// results, rounded, into the warpgroup's shared-memory tile (as TMA swizzles it) and from there to
// out by TMA stores (whole lines: stores of each thread's pairs ran at a third of the rate), while the
// other warpgroup multiplies.
template <int kWide>
constexpr int PointwiseProductShared() {
  return (kWide * (1 + kPointwiseConsumers) + kPointwiseStages) * kChunkBytes + (2 * kPointwiseStages + 1) * 8 + 1024;
}

template <typename T, int kWide, bool kDgrad>
__global__ void __launch_bounds__(kPointwiseThreads, 1)
    PointwiseProductKernel(const __grid_constant__ CUtensorMap in_map, const __grid_constant__ CUtensorMap w_map,
                           const __grid_constant__ CUtensorMap out_map, int pixels) {
  constexpr int kN = 64 * kWide;
  extern __shared__ uint8_t shared_raw[];
  uint8_t* filter = sm90::AlignedShared(shared_raw);
  uint8_t* results = filter + kWide * kChunkBytes;  // a [64 pixels][N] tile per consumer warpgroup
  uint8_t* stages = results + kPointwiseConsumers * kWide * kChunkBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(stages + kPointwiseStages * kChunkBytes);
  uint64_t* empty = full + kPointwiseStages;
  uint64_t* filter_full = empty + kPointwiseStages;
  const Range range((pixels + kRowPixels - 1) / kRowPixels, blockIdx.x, gridDim.x);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) sm90::InitRing<kPointwiseStages>(full, empty, 1, filter_full);  // a chunk is one warpgroup's
  __syncthreads();
  if (range.count == 0) return;

  if (warp == kPointwiseConsumers * 4) {  // the producer
    if (threadIdx.x % 32 == 0) {
      sm90::BarrierArriveExpectTx(filter_full, kWide * kChunkBytes);
      for (int j = 0; j < kWide; ++j) {  // fprop: w's columns [64 j, + 64); dgrad: its rows
        sm90::TmaLoad4d(filter + j * kChunkBytes, &w_map, filter_full, 0, kDgrad ? 0 : j, kDgrad ? 64 * j : 0, 0);
      }
      for (int e = 0; e < range.count; ++e) {
        sm90::WaitEmpty<kPointwiseStages>(empty, e);
        uint64_t* bar = &full[e % kPointwiseStages];
        sm90::BarrierArriveExpectTx(bar, kChunkBytes);
        sm90::TmaLoad4d(stages + e % kPointwiseStages * kChunkBytes, &in_map, bar, 0, 0,
                        (range.first + e) * kRowPixels, 0);
      }
    }
    return;
  }

  const int lane = threadIdx.x % 32, row = 16 * (warp % 4) + lane / 4, col = 2 * (lane % 4);
  const int group = sm90::WarpgroupIndex();
  const bool issues = threadIdx.x % kWarpgroup == 0;  // the warpgroup's thread that issues its stores
  uint8_t* tile = results + group * kWide * kChunkBytes;
  sm90::BarrierWait(filter_full, 0);
  for (int i = group; i < range.count; i += kPointwiseConsumers) {
    sm90::WaitFull<kPointwiseStages>(full, i);
    const uint8_t* in = stages + i % kPointwiseStages * kChunkBytes;
    float acc[32 * kWide];  // set by the first product
    sm90::WgmmaFence();
#pragma unroll
    for (int step = 0; step < kChannels / 16; ++step) {
      const uint64_t a = sm90::DescriptorKMajor(in + step * 32);
      const uint64_t b = kDgrad ? sm90::DescriptorKMajor(filter + step * 32)
                                : sm90::DescriptorMNMajor(filter + step * 16 * kPixelBytes, kChunkBytes);
      sm90::Wgmma<kN, T>::template SS<kDgrad ? 0 : 1>(acc, a, b, step > 0);
    }
    sm90::WgmmaCommit();
    sm90::FenceRegisters(acc);
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(acc);
    if (issues) {
      sm90::BarrierArrive(&empty[i % kPointwiseStages]);
      sm90::BulkWaitReads();  // the tile's previous stores have read it
    }
    sm90::NamedBarrierSync(1 + group, kWarpgroup);
#pragma unroll
    for (int j = 0; j < 32 * kWide; j += 2) {  // pixel r, channel c of 64-channel chunk c / 64, swizzled
      const int r = row + 8 * ((j >> 1) & 1), c = col + 8 * (j >> 2);
      const int at = c / 64 * kChunkBytes + r * kPixelBytes + ((c % 64 / 8) ^ (r % 8)) * 16 + c % 8 * 2;
      *reinterpret_cast<uint32_t*>(tile + at) = sm90::PackPair<T>(acc[j], acc[j + 1]);
    }
    sm90::FenceProxyAsync();
    sm90::NamedBarrierSync(1 + group, kWarpgroup);
    if (issues) {
      for (int j = 0; j < kWide; ++j) {
        sm90::TmaStore4d(&out_map, tile + j * kChunkBytes, 0, j, (range.first + i) * kRowPixels, 0);
      }
    }
  }
  if (issues) sm90::BulkWaitAll();
}

// --- the partial sums' total -------------------------------------------------------------------------

// sums[g] = the partial sums (of `vectors` float4 each) of slices [kGroupSlices g, kGroupSlices (g +
// 1)) added in order (deterministic), four values a thread, all of a group's loads in flight at once.
template <int kGroupSlices>
__global__ void __launch_bounds__(256)
    SumGroupsKernel(const float4* __restrict__ partial, int vectors, float4* __restrict__ sums) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x, group = blockIdx.y;
  if (i >= vectors) return;
  float4 v[kGroupSlices];
#pragma unroll
  for (int s = 0; s < kGroupSlices; ++s) v[s] = partial[int64_t(group * kGroupSlices + s) * vectors + i];
  float4 sum = v[0];
#pragma unroll
  for (int s = 1; s < kGroupSlices; ++s) {
    sum = make_float4(sum.x + v[s].x, sum.y + v[s].y, sum.z + v[s].z, sum.w + v[s].w);
  }
  sums[int64_t(group) * vectors + i] = sum;
}

// dw [taps, C, K] = the group sums [kHaloWgradGroups][K, taps, C] added in order, rounded once: a
// thread an element of dw (its writes coalesced), all of its loads in flight at once.
template <typename T>
__global__ void __launch_bounds__(256)
    SumToFilterKernel(const float* __restrict__ sums, int taps, int channels, int filters, T* __restrict__ dw) {
  const int count = taps * channels * filters;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;  // (tap * C + c) * K + k
  if (i >= count) return;
  const int k = i % filters, c = i / filters % channels, tap = i / (filters * channels);
  float v[kHaloWgradGroups];
#pragma unroll
  for (int g = 0; g < kHaloWgradGroups; ++g) v[g] = sums[g * count + (k * taps + tap) * channels + c];
  float sum = v[0];
#pragma unroll
  for (int g = 1; g < kHaloWgradGroups; ++g) sum += v[g];
  dw[i] = FromFloat<T>(sum);
}

// The partial sums of `workspace` (`slices` of `count` floats: kHaloWgradSlices, or half as many)
// added into dw [taps, C, K] of `dw_dtype`.
ffi::Error SumPartials(cudaStream_t stream, float* workspace, int slices, int taps, int channels, int filters,
                       ffi::DataType dw_dtype, void* dw) {
  const int count = taps * channels * filters;
  float* sums = workspace + int64_t(slices) * count;
  const auto sum_groups = slices == kHaloWgradSlices ? SumGroupsKernel<kHaloWgradSlices / kHaloWgradGroups>
                                                     : SumGroupsKernel<kHaloWgradSlices / kHaloWgradGroups / 2>;
  sum_groups<<<dim3((count / 4 + 255) / 256, kHaloWgradGroups), 256, 0, stream>>>(
      reinterpret_cast<const float4*>(workspace), count / 4, reinterpret_cast<float4*>(sums));
  return DispatchFloat<float, __nv_bfloat16, __half>(dw_dtype, "dw", [&](auto type_tag) {
    using D = decltype(type_tag);
    SumToFilterKernel<<<(count + 255) / 256, 256, 0, stream>>>(sums, taps, channels, filters, static_cast<D*>(dw));
    return LaunchError("conv wgrad (halo) slice sums");
  });
}

// --- launchers -----------------------------------------------------------------------------------

// Image rows [rows][width pixels][64 channels], a box `box_pixels` pixels of one row.
CUresult MakeRowMap(CUtensorMap* map, const void* data, ffi::DataType dtype, int rows, int width, int box_pixels) {
  return MakeChunkedMap(map, data, dtype, rows, width, 1, box_pixels);
}

// Image rows [rows][width pixels][chunks x 64 channels], a box `box_pixels` pixels of one row's one
// 64-channel chunk: coordinates (0, chunk, pixel, row).
CUresult MakeRowChunkMap(CUtensorMap* map, const void* data, ffi::DataType dtype, int rows, int width, int chunks,
                         int box_pixels) {
  return MakeChunkedMap(map, data, dtype, width, chunks, box_pixels, 1, rows);
}

// Pixels [pixels][chunks x 64 channels], a box of 64 pixels of one 64-channel chunk.
CUresult MakeChunkMap(CUtensorMap* map, const void* data, ffi::DataType dtype, int pixels, int chunks) {
  return MakeChunkedMap(map, data, dtype, pixels, chunks, kRowPixels, 1);
}

ffi::Error MapError(const char* stage) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jaxdnn: conv ") + stage + " (halo): cannot encode a TMA descriptor");
}

// Whether the pointwise kernels take g with 16-bit operands of `dtype`: a 1x1 window with unit
// strides and no padding, `narrow` = 64 channels on one side and `wide` = 64, 128 or 256 on the other.
bool PointwiseTakes(const ConvGeometry& g, ffi::DataType dtype, int64_t narrow, int64_t wide) {
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) return false;
  if (g.groups != 1 || narrow != kChannels || (wide != 64 && wide != 128 && wide != 256)) return false;
  for (int a = 0; a < 3; ++a) {
    if (g.window[a] != 1 || g.stride[a] != 1 || g.pad[a] != 0 || g.lhs_dilation[a] != 1) return false;
  }
  return g.InPixels() > 0 && g.InPixels() < INT_MAX - kRowPixels && IsHopper();
}

// f(std::integral_constant<int, wide>{}) for a pointwise kernel's width in 64-channel chunks (1, 2 or 4).
template <typename F>
ffi::Error WithWidth(int wide, F f) {
  if (wide == 1) return f(std::integral_constant<int, 1>{});
  if (wide == 2) return f(std::integral_constant<int, 2>{});
  return f(std::integral_constant<int, 4>{});
}

// The image rows N D H.
int ImageRows(const ConvGeometry& g) { return int(g.batch * g.in[0] * g.in[1]); }

Rows RowsOf(const ConvGeometry& g) {
  const int strips = int((g.in[2] + kRowPixels - 1) / kRowPixels);
  return Rows{int(g.in[1]), strips, ImageRows(g) * strips};
}

// f(std::integral_constant<int, tap rows>{}, std::integral_constant<int, tap columns>{}) for g's
// window (HaloWindow): 3 x 3, or 1 x 3, 1 x 5 or 1 x 7.
template <typename F>
ffi::Error WithWindow(const ConvGeometry& g, F f) {
  using std::integral_constant;
  if (g.window[1] == 3) return f(integral_constant<int, 3>{}, integral_constant<int, 3>{});
  if (g.window[2] == 5) return f(integral_constant<int, 1>{}, integral_constant<int, 5>{});
  if (g.window[2] == 7) return f(integral_constant<int, 1>{}, integral_constant<int, 7>{});
  return f(integral_constant<int, 1>{}, integral_constant<int, 3>{});
}

template <bool kDgrad>
ffi::Error LaunchFprop(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* in, const void* w,
                       const void* bias, const void* residual, int64_t activation, float activation_param, void* out) {
  const char* stage = kDgrad ? "dgrad" : "fprop";
  const Rows rows = RowsOf(g);
  const int width = int(g.in[2]);
  CUtensorMap in_map, w_map, out_map;  // w [taps, C, K] as rows of K, a tap (64 rows) a box
  if (MakeRowMap(&in_map, in, dtype, ImageRows(g), width, kHaloPixels) != CUDA_SUCCESS ||
      MakeRowMap(&w_map, w, dtype, 1, g.Taps() * kChannels, kChannels) != CUDA_SUCCESS ||
      MakeRowMap(&out_map, out, dtype, ImageRows(g), width, kRowPixels) != CUDA_SUCCESS) {
    return MapError(stage);
  }
  auto launch = [&](auto tag, auto tap_rows, auto tap_cols) {
    using T = decltype(tag);
    const auto kernel = HaloFpropKernel<T, kDgrad, decltype(tap_rows)::value, decltype(tap_cols)::value>;
    JAXDNN_RETURN_IF_ERROR(
        CudaError(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kFpropShared), stage));
    const ConvEpilogue<T> epilogue{static_cast<const T*>(bias), static_cast<const T*>(residual), activation,
                                   activation_param};
    const int ctas = std::min(ResidentBlocks(kernel, kFpropThreads, kFpropShared), rows.count);
    kernel<<<ctas, kFpropThreads, kFpropShared, stream>>>(in_map, w_map, out_map, rows, width, epilogue);
    return LaunchError(stage);
  };
  return WithWindow(g, [&](auto rows, auto cols) {
    return dtype == ffi::DataType::BF16 ? launch(__nv_bfloat16{}, rows, cols) : launch(__half{}, rows, cols);
  });
}

// Whether g's window and sizes suit the halo kernels (any channels): a 3x3 window with SAME padding, or
// one row of 3, 5 or 7 taps (a 1-D window along the rows, SAME), unit strides and dilations, units that
// int counts.
bool HaloWindow(const ConvGeometry& g) {
  const int64_t cols = g.window[1] == 1 ? g.window[2] : 3;
  if (cols != 3 && cols != 5 && cols != 7) return false;
  const int64_t window[3] = {1, g.window[1] == 1 ? 1 : 3, cols}, pad[3] = {0, window[1] / 2, cols / 2};
  for (int a = 0; a < 3; ++a) {
    if (g.window[a] != window[a] || g.stride[a] != 1 || g.pad[a] != pad[a] || g.lhs_dilation[a] != 1 ||
        g.rhs_dilation[a] != 1 || g.in[a] != g.out[a]) {
      return false;
    }
  }
  const int64_t strips = (g.in[2] + kRowPixels - 1) / kRowPixels;
  return g.OutPixels() > 0 && g.in[2] < INT_MAX - 2 * kRowPixels &&
         g.batch * g.in[0] * g.in[1] * strips < INT_MAX - 2 * kRowPixels;
}

bool SixteenBit(ffi::DataType dtype) { return dtype == ffi::DataType::BF16 || dtype == ffi::DataType::F16; }

}  // namespace

bool HaloApplies(const ConvGeometry& g, ffi::DataType dtype) {
  return SixteenBit(dtype) && g.groups == 1 && g.channels == kChannels && g.filters == kChannels && HaloWindow(g) &&
         IsHopper();
}

bool HaloWgradApplies(const ConvGeometry& g, ffi::DataType dtype) {
  const int64_t narrow = std::min(g.channels, g.filters), wide = std::max(g.channels, g.filters);
  return SixteenBit(dtype) && g.groups == 1 && narrow == kChannels && (wide == 64 || wide == 128) &&
         HaloWindow(g) && IsHopper();
}

ffi::Error HaloFprop(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* x, const void* w,
                     const void* bias, const void* residual, int64_t activation, float activation_param, void* y) {
  return LaunchFprop<false>(stream, g, dtype, x, w, bias, residual, activation, activation_param, y);
}

ffi::Error HaloDgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* dy, const void* w,
                     void* dx) {
  return LaunchFprop<true>(stream, g, dtype, dy, w, nullptr, nullptr, 0, 0.f, dx);
}

ffi::Error HaloWgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* x, const void* dy,
                     float* workspace, ffi::DataType dw_dtype, void* dw) {
  const Rows rows = RowsOf(g);
  const int width = int(g.in[2]);
  const int channels = int(g.channels), filters = int(g.filters);
  CUtensorMap x_map, dy_map;
  if (MakeRowChunkMap(&x_map, x, dtype, ImageRows(g), width, channels / kChannels, kHaloPixels) != CUDA_SUCCESS ||
      MakeRowChunkMap(&dy_map, dy, dtype, ImageRows(g), width, filters / kChannels, kRowPixels) != CUDA_SUCCESS) {
    return MapError("wgrad");
  }
  // a CTA a 64-channel chunk of the wide side and a slice of the units: one wave of kHaloWgradSlices
  // CTAs (two waves of CTAs of half the units, and x read twice from memory, took 0.107 ms against
  // 0.080: 3x3 64 -> 128 over 112^2, N 16, H200)
  const int chunks = std::max(channels, filters) / kChannels, slices = kHaloWgradSlices / chunks;
  const dim3 grid(chunks, slices);
  auto launch = [&](auto tag, auto tap_rows, auto tap_cols) {
    using T = decltype(tag);
    const auto kernel = HaloWgradKernel<T, decltype(tap_rows)::value, decltype(tap_cols)::value>;
    JAXDNN_RETURN_IF_ERROR(CudaError(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kWgradShared), "conv wgrad (halo)"));
    kernel<<<grid, kWgradThreads, kWgradShared, stream>>>(x_map, dy_map, rows, channels, filters, workspace);
    JAXDNN_RETURN_IF_ERROR(LaunchError("conv wgrad (halo)"));
    return SumPartials(stream, workspace, slices, int(g.Taps()), channels, filters, dw_dtype, dw);
  };
  return WithWindow(g, [&](auto rows, auto cols) {
    return dtype == ffi::DataType::BF16 ? launch(__nv_bfloat16{}, rows, cols) : launch(__half{}, rows, cols);
  });
}

bool PointwiseWgradApplies(const ConvGeometry& g, ffi::DataType dtype) {
  return PointwiseTakes(g, dtype, std::min(g.channels, g.filters), std::max(g.channels, g.filters));
}

ffi::Error PointwiseWgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* x,
                          const void* dy, float* workspace, ffi::DataType dw_dtype, void* dw) {
  const int pixels = int(g.InPixels()), channels = int(g.channels), filters = int(g.filters);
  const bool narrow_is_x = channels == kChannels;
  const int wide = (narrow_is_x ? filters : channels) / kChannels;
  CUtensorMap narrow_map, wide_map;
  if (MakeChunkMap(&narrow_map, narrow_is_x ? x : dy, dtype, pixels, 1) != CUDA_SUCCESS ||
      MakeChunkMap(&wide_map, narrow_is_x ? dy : x, dtype, pixels, wide) != CUDA_SUCCESS) {
    return MapError("wgrad");
  }
  const Pointwise p{(pixels + kRowPixels - 1) / kRowPixels, channels, narrow_is_x};
  auto launch = [&](auto tag, auto wide_tag) -> ffi::Error {
    using T = decltype(tag);
    constexpr int kWide = decltype(wide_tag)::value;
    constexpr int kShared = PointwiseShared<kWide>();
    const auto kernel = PointwiseWgradKernel<T, kWide>;
    JAXDNN_RETURN_IF_ERROR(CudaError(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kShared),
                                     "conv wgrad (pointwise)"));
    kernel<<<kHaloWgradSlices, kPointwiseThreads, kShared, stream>>>(narrow_map, wide_map, p, workspace);
    JAXDNN_RETURN_IF_ERROR(LaunchError("conv wgrad (pointwise)"));
    return SumPartials(stream, workspace, kHaloWgradSlices, 1, channels, filters, dw_dtype, dw);
  };
  auto by_width = [&](auto tag) { return WithWidth(wide, [&](auto wide_tag) { return launch(tag, wide_tag); }); };
  return dtype == ffi::DataType::BF16 ? by_width(__nv_bfloat16{}) : by_width(__half{});
}

bool PointwiseProductApplies(const ConvGeometry& g, ffi::DataType dtype, bool dgrad) {
  return dgrad ? PointwiseTakes(g, dtype, g.filters, g.channels) : PointwiseTakes(g, dtype, g.channels, g.filters);
}

ffi::Error PointwiseProduct(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* in,
                            const void* w, bool dgrad, void* out) {
  const int pixels = int(g.InPixels());
  const int wide = int(dgrad ? g.channels : g.filters) / kChannels;
  CUtensorMap in_map, w_map, out_map;  // w [C, K]: fprop's [64][N] in chunks of 64 columns, dgrad's [N][64]
  if (MakeChunkMap(&in_map, in, dtype, pixels, 1) != CUDA_SUCCESS ||
      MakeChunkMap(&w_map, w, dtype, dgrad ? 64 * wide : kChannels, dgrad ? 1 : wide) != CUDA_SUCCESS ||
      MakeChunkMap(&out_map, out, dtype, pixels, wide) != CUDA_SUCCESS) {
    return MapError(dgrad ? "dgrad" : "fprop");
  }
  auto launch = [&](auto tag, auto wide_tag, auto dgrad_tag) -> ffi::Error {
    using T = decltype(tag);
    constexpr int kWide = decltype(wide_tag)::value;
    constexpr int kShared = PointwiseProductShared<kWide>();
    const auto kernel = PointwiseProductKernel<T, kWide, decltype(dgrad_tag)::value>;
    JAXDNN_RETURN_IF_ERROR(CudaError(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kShared),
                                     "conv pointwise product"));
    const int ctas = std::min(ResidentBlocks(kernel, kPointwiseThreads, kShared), (pixels + kRowPixels - 1) / kRowPixels);
    kernel<<<ctas, kPointwiseThreads, kShared, stream>>>(in_map, w_map, out_map, pixels);
    return LaunchError("conv pointwise product");
  };
  auto by_width = [&](auto tag) {
    return WithWidth(wide, [&](auto wide_tag) {
      return dgrad ? launch(tag, wide_tag, std::true_type{}) : launch(tag, wide_tag, std::false_type{});
    });
  };
  return dtype == ffi::DataType::BF16 ? by_width(__nv_bfloat16{}) : by_width(__half{});
}

}  // namespace jaxdnn
