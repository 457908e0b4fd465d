// CUDA GroupNorm, channels last: x is [N, S, C], each sample's S positions split into P chunks.
//
// The streaming kernels share one tiling. A block owns (sample n, chunk p, tile of channels); its
// threads form `rows` x `lanes`: lane l owns one vector of channels (16 bytes, or one element when
// C or a pointer is not aligned for that) of every position, and the rows stride over the chunk's
// positions. So each thread keeps per-channel sums in registers, every warp reads whole 16-byte
// vectors of consecutive channels (for C = 512 bf16: 64 lanes x 4 rows, each block row one 1 KiB
// pixel), and no thread needs to know where groups start.
//
// Forward (3 launches): FwdChannelSums reads x once and writes per-(n, p) channel sums of x - shift
// and (x - shift)^2 to the workspace [N, P, 2, C]; ReduceGroups (a block per (n, g)) sums them over
// the chunks and the group's channels in a fixed order and writes mean/rstd; Normalize reads x again
// and writes y. HBM traffic: x twice + y, plus the workspace (2 * 4 * C bytes per (n, p)).
// Backward: where a sample's slab of groups fits in shared memory on a GPU with TMA, the on-chip
// kernel of group_norm_sm90.cu (x and dy read once; it leaves per-sample channel sums for SumParts);
// else, for 16-bit x whose slab's positions fit in a cluster's shared memory, its cluster backward
// (the same, x and dy held by 8 CTAs). Otherwise 4 launches: BwdChannelSums reads x and dy and writes
// per-(n, p) channel sums of d * xhat and d (d = dy * act'); ReduceGroups turns them into the
// per-(n, g) sums of g * xhat and g (g = d * scale) that dx needs; SumParts reduces them over (n, p)
// into dscale/dbias; Dx reads x and dy again and writes dx. Traffic: x and dy twice + dx. All
// reductions run in a fixed order, so every result has the same bits on every run. ReduceGroups,
// Normalize, SumParts and the on-chip backward are launched early (LaunchEarly: their launch overlaps
// the end of the kernel before them; Normalize issues its first loads of x before it waits for the
// statistics). scale and bias are float32 or x's dtype (Param), and dscale and dbias are stored in
// theirs.
//
// Normalize and Dx visit the blocks in reverse order: what the sums pass read last (its last wave's
// blocks) is the part of x (and dy) still in L2 when the second pass starts. The forward's grids run
// in one wave, where a block's chunk is what it reads in order, so Normalize also walks each chunk
// backwards, from the positions FwdChannelSums read last. (Dx's grid takes two waves; walking its
// chunks backwards too made the two-pass backward slower.)
#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "common/cuda_common.cuh"
#include "common/row_reduce.cuh"
#include "group_norm/group_norm.h"
#include "group_norm/group_norm_common.h"
#include "group_norm/group_norm_sm90.h"

namespace jaxdnn {
namespace {

constexpr int kThreads = 256;  // threads a block (at most) in every kernel
constexpr int64_t kTargetBlocks = 512;  // the streaming grids' size, as the chunk count aims for
constexpr int kMinLanes = 8;            // a block row's vectors at least: 128 contiguous bytes

// How the streaming kernels' blocks cover [N, S, C] (see the top of the file).
struct Tiling {
  GroupNormShape shape;
  int vec;        // channels a lane loads at once: kVec16<T>, or 1
  int lanes;      // vectors across the channels a block
  int rows;       // positions in flight a block
  int64_t tiles;  // blocks across the channels
};

// One tile of channels where the samples' chunks make kTargetBlocks blocks; where they are fewer
// (few positions: the chunks keep at least 16), the channels split into tiles until they do (down to
// kMinLanes lanes), so that small problems still fill the GPU. N8 16x16 C1280 bf16 (16 chunks): 512
// blocks of 40 lanes x 6 rows, where one tile gave 128 blocks of 160 threads, one row each; the
// forward took 16-17 us, 18-19 with silu, against 22 and 28-29 (H200, 2026-11-30).
template <typename T>
Tiling MakeTiling(const GroupNormShape& shape, bool aligned) {
  Tiling t;
  t.shape = shape;
  t.vec = aligned && shape.channels % kVec16<T> == 0 ? kVec16<T> : 1;
  const int64_t vectors = shape.channels / t.vec;
  const int64_t items = std::max<int64_t>(1, shape.batch * shape.chunks);
  const int64_t want_tiles = (kTargetBlocks + items - 1) / items;
  const int64_t widest = std::min<int64_t>(vectors, kThreads);
  const int64_t lanes = std::min(widest, (vectors + want_tiles - 1) / want_tiles);
  t.lanes = int(std::max(lanes, std::min<int64_t>(widest, kMinLanes)));
  t.rows = kThreads / t.lanes;
  t.tiles = (vectors + t.lanes - 1) / t.lanes;
  return t;
}

// This thread's part of the work: sample, chunk, first channel, and its `count` positions first,
// first + step, ... (step = +-rows). `active` is false for lanes past the last channel.
struct ThreadPart {
  int64_t n, chunk, channel, first, count, step;
  bool active;
};

// `reverse` walks the chunk from its last position down (see the top of the file).
__device__ __forceinline__ ThreadPart PartOf(int64_t block, const Tiling& t, bool reverse) {
  const GroupNormShape& s = t.shape;
  ThreadPart part;
  const int64_t tile = block % t.tiles;
  block /= t.tiles;
  part.chunk = block % s.chunks;
  part.n = block / s.chunks;
  const int lane = threadIdx.x % t.lanes, row = threadIdx.x / t.lanes;
  part.channel = (tile * t.lanes + lane) * t.vec;
  part.active = part.channel < s.channels;
  const int64_t begin = ChunkBegin(s, part.chunk), end = ChunkBegin(s, part.chunk + 1);
  part.count = end - begin > row ? (end - begin - row + t.rows - 1) / t.rows : 0;
  part.first = reverse ? end - 1 - row : begin + row;
  part.step = reverse ? -t.rows : t.rows;
  return part;
}

// Visits the thread's positions r in batches of kBatch: every load of a batch (load(r) returns the
// position's data) is issued before the first is used (fn(r, data)), so kBatch loads per thread (and
// tensor) are in flight. Loading and using one position at a time left one load in flight (the
// bound check between positions kept the compiler from hoisting the next one), and the sums pass ran
// at 1.8 TB/s on an H100. The kernels that read x and dy take batches of 2: with 4 their registers
// had cut the blocks an SM to one.
template <int kBatch, typename Load, typename Fn>
__device__ __forceinline__ void ForPositions(const ThreadPart& part, Load load, Fn fn) {
  using Data = decltype(load(part.first));
  for (int64_t i = 0; i < part.count; i += kBatch) {
    Data data[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (i + u < part.count) data[u] = load(part.first + (i + u) * part.step);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (i + u < part.count) fn(part.first + (i + u) * part.step, data[u]);
    }
  }
}

// The forward's kernels stream x through shared memory instead (ForPositionsStaged), where its
// 16-byte packs are loaded with cp.async kStages - 1 positions ahead of use: the loads in flight
// hold no registers, so 4 blocks an SM fit, the ~512-block grids run in one wave, and a block keeps
// 7 positions' loads in flight. (With ForPositions, FwdChannelSums and Normalize held 92-94
// registers: 2 blocks an SM, two waves, and the sums pass read x at 2.2 TB/s on an H200.)
constexpr int kStages = 8;

template <typename T>
using Vec16 = Pack<T, kVec16<T>>;

// Calls fn(r, pack) for the thread's positions r in order, with the 16-byte pack of x at
// x + r * stride, staged through this thread's own slots of `slots` [kStages][kThreads] (no block
// barrier needed); ready() once the first positions' copies are in flight, before the first fn.
template <typename T, typename Fn, typename Ready>
__device__ __forceinline__ void ForPositionsStaged(const ThreadPart& part, const T* x, int64_t stride, Fn fn,
                                                   Ready ready) {
  __shared__ Vec16<T> slots[kStages][kThreads];
  // The thread's i-th position is part.first + i * part.step.
  StreamThroughSlots<kStages>(
      0, 1, part.count,
      [&](int stage, int64_t i) { CpAsync16(&slots[stage][threadIdx.x], x + (part.first + i * part.step) * stride); },
      [&](int stage, int64_t i) {
        const Vec16<T> pack = slots[stage][threadIdx.x];
        fn(part.first + i * part.step, pack);
      },
      ready);
}

// x and dy at one position (the backward kernels read both).
template <typename T, int kVec>
struct XDy {
  Pack<T, kVec> x, dy;
};

template <typename T, int kVec>
__device__ __forceinline__ XDy<T, kVec> LoadXDy(const T* x, const T* dy, int64_t offset) {
  return {*reinterpret_cast<const Pack<T, kVec>*>(x + offset), *reinterpret_cast<const Pack<T, kVec>*>(dy + offset)};
}

// The block's two per-channel sums summed over its rows (in row order) and stored to
// `out` [2, C], the workspace entry of (n, p). Every block calls it, so every entry is written.
template <int kVec>
__device__ __forceinline__ void StoreChannelSums(float (&first)[kVec], float (&second)[kVec],
                                                 float* out, const ThreadPart& part, const Tiling& t) {
  __shared__ float partial[2][kThreads * kVec];
  if (t.rows > 1) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      partial[0][threadIdx.x * kVec + k] = first[k];
      partial[1][threadIdx.x * kVec + k] = second[k];
    }
    __syncthreads();
    if (threadIdx.x < t.lanes) {
      for (int r = 1; r < t.rows; ++r) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          first[k] += partial[0][(r * t.lanes + threadIdx.x) * kVec + k];
          second[k] += partial[1][(r * t.lanes + threadIdx.x) * kVec + k];
        }
      }
    }
  }
  if (threadIdx.x < t.lanes && part.active) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      out[part.channel + k] = first[k];
      out[t.shape.channels + part.channel + k] = second[k];
    }
  }
}

// Per-channel statistics of a thread's channels: mean, rstd, and the group's index.
template <int kVec>
struct ChannelStats {
  float mean[kVec], rstd[kVec];
  int64_t group[kVec];

  __device__ __forceinline__ ChannelStats(const float* mean_in, const float* rstd_in,
                                          const ThreadPart& part, const GroupNormShape& s) {
    // One 64-bit division (a subroutine call on the GPU, whose calling convention had made the
    // kernels spill) for the first channel's group; the pack's next channels step from it.
    int64_t g = part.channel / s.group_size, offset = part.channel - g * s.group_size;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      group[k] = part.n * s.groups + g;
      mean[k] = mean_in[group[k]];
      rstd[k] = rstd_in[group[k]];
      if (++offset == s.group_size) {
        offset = 0;
        ++g;
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Forward

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads, 4) FwdChannelSums(const T* __restrict__ x,
                                                              float* __restrict__ workspace, Tiling t) {
  using Vec = Pack<T, kVec>;
  LetNextKernelLaunch();
  const GroupNormShape& s = t.shape;
  const ThreadPart part = PartOf(blockIdx.x, t, false);
  const T* xn = x + part.n * s.spatial * s.channels;
  float sum[kVec] = {}, squares[kVec] = {};
  if (part.active && part.count > 0) {
    float shift[kVec];  // each group's first element (see GroupMoments)
#pragma unroll
    for (int k = 0; k < kVec; ++k) shift[k] = ToFloat(xn[(part.channel + k) / s.group_size * s.group_size]);
    auto add = [&](int64_t, const Vec& v) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float d = ToFloat(v.v[k]) - shift[k];
        sum[k] += d;
        squares[k] += d * d;
      }
    };
    if constexpr (sizeof(Vec) == 16) {
      ForPositionsStaged(part, xn + part.channel, s.channels, add, [] {});
    } else {
      auto load = [&](int64_t r) { return *reinterpret_cast<const Vec*>(xn + r * s.channels + part.channel); };
      ForPositions<4>(part, load, add);
    }
  }
  StoreChannelSums(sum, squares, workspace + (part.n * s.chunks + part.chunk) * 2 * s.channels, part, t);
}

// Normalize, BwdChannelSums and Dx come in two instantiations: kAct, which applies the activation a
// pack at a time (one switch on its kind for the kVec values, so their evaluations overlap), and the
// identity's, which carries no activation code (its registers had made the identity kernels spill).
template <typename T, int kVec, bool kAct>
__global__ void __launch_bounds__(kThreads, 4) Normalize(const T* __restrict__ x, Param<T> scale, Param<T> bias,
                                                         const float* __restrict__ mean,
                                                         const float* __restrict__ rstd, T* __restrict__ y,
                                                         Tiling t, int64_t activation, float activation_param) {
  using Vec = Pack<T, kVec>;
  const GroupNormShape& s = t.shape;
  const ThreadPart part = PartOf(int64_t(gridDim.x) - 1 - blockIdx.x, t, true);
  if (!part.active) return;
  float shift[kVec], a[kVec], b[kVec];  // pre-activation = (x - shift) * a + b, shift the group's mean
  // x is an input of the call, complete before the sums pass began: its first copies are issued
  // before the wait for the statistics (ForPositionsStaged), which hides their latency.
  auto load_statistics = [&] {
    WaitForPreviousKernel();  // mean and rstd
    LetNextKernelLaunch();    // e.g. the on-chip backward, launched early
    const ChannelStats<kVec> stats(mean, rstd, part, s);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      shift[k] = stats.mean[k];
      a[k] = stats.rstd[k] * scale[part.channel + k];
      b[k] = bias[part.channel + k];
    }
  };
  const int64_t base = part.n * s.spatial * s.channels + part.channel;
  auto normalize = [&](int64_t r, const Vec& v) {
    float pre[kVec];
    Vec out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      pre[k] = (ToFloat(v.v[k]) - shift[k]) * a[k] + b[k];
      if constexpr (!kAct) out.v[k] = FromFloat<T>(pre[k]);
    }
    if constexpr (kAct) {
      ActivateKindN(activation, pre, activation_param);
#pragma unroll
      for (int k = 0; k < kVec; ++k) out.v[k] = FromFloat<T>(pre[k]);
    }
    *reinterpret_cast<Vec*>(y + base + r * s.channels) = out;
  };
  if constexpr (sizeof(Vec) == 16) {
    ForPositionsStaged(part, x + base, s.channels, normalize, load_statistics);
  } else {
    load_statistics();
    ForPositions<4>(part, [&](int64_t r) { return *reinterpret_cast<const Vec*>(x + base + r * s.channels); },
                    normalize);
  }
}

// A block per (n, g): sums weight[c] * workspace[n, p, i, c] over the chunks p and the group's
// channels c, for i = 0, 1 (weight: scale in the backward, 1 in the forward), in a fixed order.
// Forward (group_sums null): the sums are the shifted sums, turned into mean and rstd. Backward:
// stored to group_sums[n, g, i].
template <typename T>
__global__ void __launch_bounds__(kThreads) ReduceGroups(const T* __restrict__ x,
                                                         const float* __restrict__ workspace,
                                                         Param<T> weight,
                                                         GroupNormShape s, float epsilon,
                                                         float* __restrict__ mean,
                                                         float* __restrict__ rstd,
                                                         float* __restrict__ group_sums) {
  // Before its own wait (see LetNextKernelLaunch): what the kernel after it (Normalize, SumParts)
  // reads before its wait is an input of the call (Normalize's first loads of x), not the sums pass's.
  LetNextKernelLaunch();
  WaitForPreviousKernel();  // the workspace
  const int64_t n = blockIdx.x / s.groups, g = blockIdx.x % s.groups;
  const float* sums = workspace + n * s.chunks * 2 * s.channels + g * s.group_size;
  float acc[2] = {0.f, 0.f};
  // Thread i takes entries (chunk, k) = i, i + blockDim.x, ... of the flattened [P, K]; the
  // position advances by (step_chunks, step_k) without a 64-bit division per entry.
  const int64_t step_chunks = blockDim.x / s.group_size, step_k = blockDim.x % s.group_size;
  int64_t chunk = threadIdx.x / s.group_size, k = threadIdx.x % s.group_size;
  while (chunk < s.chunks) {
    const float w = weight.data ? weight[g * s.group_size + k] : 1.f;
    acc[0] += w * sums[chunk * 2 * s.channels + k];
    acc[1] += w * sums[chunk * 2 * s.channels + s.channels + k];
    chunk += step_chunks;
    k += step_k;
    if (k >= s.group_size) {
      k -= s.group_size;
      ++chunk;
    }
  }
  GroupSum(acc, blockDim.x);
  if (threadIdx.x != 0) return;
  const int64_t index = n * s.groups + g;
  if (group_sums != nullptr) {
    group_sums[2 * index] = acc[0];
    group_sums[2 * index + 1] = acc[1];
  } else {
    const float shift = s.spatial > 0 ? ToFloat(x[n * s.spatial * s.channels + g * s.group_size]) : 0.f;
    GroupMoments(acc[0], acc[1], shift, s.spatial * s.group_size, epsilon, &mean[index], &rstd[index]);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward. With xhat = (x - mean) * rstd, d = dy * act'(xhat * scale + bias), g = d * scale:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) per (n, group),
//   dscale = sum(d * xhat), dbias = sum(d) over samples and positions.

template <int kVec>
struct ChannelAffine {
  float scale[kVec], bias[kVec];

  template <typename T>
  __device__ __forceinline__ ChannelAffine(const Param<T>& scale_in, const Param<T>& bias_in, int64_t c) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      scale[k] = scale_in[c + k];
      bias[k] = bias_in[c + k];
    }
  }
};

// The pack's xhat and d = dy * act'(xhat * scale + bias), recomputing the pre-activation (d = dy
// without kAct).
template <bool kAct, typename T, int kVec>
__device__ __forceinline__ void GradIn(const Pack<T, kVec>& xv, const Pack<T, kVec>& dyv,
                                       const ChannelStats<kVec>& stats, const ChannelAffine<kVec>& affine,
                                       int64_t activation, float param, float (&xhat)[kVec], float (&d)[kVec]) {
  float pre[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    xhat[k] = (ToFloat(xv.v[k]) - stats.mean[k]) * stats.rstd[k];
    d[k] = ToFloat(dyv.v[k]);
    pre[k] = xhat[k] * affine.scale[k] + affine.bias[k];
  }
  if constexpr (kAct) ActivateGradKindN(activation, pre, d, param);
}

template <typename T, int kVec, bool kAct>
__global__ void __launch_bounds__(kThreads, 2) BwdChannelSums(
    const T* __restrict__ dy, const T* __restrict__ x, Param<T> scale, Param<T> bias,
    const float* __restrict__ mean, const float* __restrict__ rstd,
    float* __restrict__ workspace, Tiling t, int64_t activation, float activation_param) {
  using Vec = Pack<T, kVec>;
  const GroupNormShape& s = t.shape;
  const ThreadPart part = PartOf(blockIdx.x, t, false);
  float d_xhat[kVec] = {}, d_sum[kVec] = {};
  if (part.active) {
    const ChannelStats<kVec> stats(mean, rstd, part, s);
    const ChannelAffine<kVec> affine(scale, bias, part.channel);
    const int64_t base = part.n * s.spatial * s.channels + part.channel;
    auto load = [&](int64_t r) { return LoadXDy<T, kVec>(x, dy, base + r * s.channels); };
    ForPositions<2>(part, load, [&](int64_t, const XDy<T, kVec>& v) {
      float xhat[kVec], d[kVec];
      GradIn<kAct>(v.x, v.dy, stats, affine, activation, activation_param, xhat, d);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        d_xhat[k] += d[k] * xhat[k];
        d_sum[k] += d[k];
      }
    });
  }
  StoreChannelSums(d_xhat, d_sum, workspace + (part.n * s.chunks + part.chunk) * 2 * s.channels, part, t);
}

template <typename T, int kVec, bool kAct>
__global__ void __launch_bounds__(kThreads, 2) Dx(
    const T* __restrict__ dy, const T* __restrict__ x, Param<T> scale, Param<T> bias,
    const float* __restrict__ mean, const float* __restrict__ rstd,
    const float* __restrict__ group_sums, T* __restrict__ dx, Tiling t, int64_t activation,
    float activation_param) {
  using Vec = Pack<T, kVec>;
  const GroupNormShape& s = t.shape;
  const ThreadPart part = PartOf(int64_t(gridDim.x) - 1 - blockIdx.x, t, false);
  if (!part.active || part.count == 0) return;
  const ChannelStats<kVec> stats(mean, rstd, part, s);
  const ChannelAffine<kVec> affine(scale, bias, part.channel);
  const float count = float(s.spatial * s.group_size);  // > 0: this thread has positions
  float mean_g[kVec], mean_g_xhat[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    mean_g_xhat[k] = group_sums[2 * stats.group[k]] / count;
    mean_g[k] = group_sums[2 * stats.group[k] + 1] / count;
  }
  const int64_t base = part.n * s.spatial * s.channels + part.channel;
  auto load = [&](int64_t r) { return LoadXDy<T, kVec>(x, dy, base + r * s.channels); };
  ForPositions<2>(part, load, [&](int64_t r, const XDy<T, kVec>& v) {
    float xhat[kVec], d[kVec];
    GradIn<kAct>(v.x, v.dy, stats, affine, activation, activation_param, xhat, d);
    Vec out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float g = affine.scale[k] * d[k];
      out.v[k] = FromFloat<T>(stats.rstd[k] * (g - mean_g[k] - xhat[k] * mean_g_xhat[k]));
    }
    *reinterpret_cast<Vec*>(dx + base + r * s.channels) = out;
  });
}

// dscale[c] and dbias[c]: the workspace [N * P, 2 * C] summed over its N * P rows in a fixed order.
// Threads (x, y): x the column within a 32-wide tile, y strides over the rows.
// dscale and dbias are stored in float32 or in T (`f32` false).
template <typename T>
__global__ void SumParts(const float* __restrict__ workspace, int64_t parts, int64_t channels, void* dscale,
                         void* dbias, bool f32) {
  __shared__ float tile[32][33];
  WaitForPreviousKernel();  // the workspace
  const int64_t width = 2 * channels;
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float sum = 0.f;
  if (col < width) {
    for (int64_t p = threadIdx.y; p < parts; p += 32) sum += workspace[p * width + col];
  }
  tile[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < width) {
    float total = 0.f;
    for (int k = 0; k < 32; ++k) total += tile[k][threadIdx.x];
    void* out = col < channels ? dscale : dbias;
    const int64_t c = col < channels ? col : col - channels;
    if (f32) {
      static_cast<float*>(out)[c] = total;
    } else {
      static_cast<T*>(out)[c] = FromFloat<T>(total);
    }
  }
}

template <typename T>
ffi::Error LaunchSumParts(cudaStream_t stream, const float* workspace, int64_t parts, int64_t channels,
                          ffi::Result<ffi::AnyBuffer>& dscale, ffi::Result<ffi::AnyBuffer>& dbias) {
  return CudaError(LaunchEarly(SumParts<T>, dim3((2 * channels + 31) / 32), dim3(32, 32), 0, stream, workspace, parts,
                               channels, dscale->untyped_data(), dbias->untyped_data(),
                               dscale->element_type() == ffi::DataType::F32),
                   "group_norm backward dscale/dbias");
}

// ---------------------------------------------------------------------------------------------
// Handlers

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Calls fn(std::integral_constant<int, vec>) for the tiling's vector width (two instantiations).
template <typename T, typename Fn>
ffi::Error WithVec(int vec, Fn&& fn) {
  if (vec == kVec16<T>) return fn(std::integral_constant<int, kVec16<T>>{});
  return fn(std::integral_constant<int, 1>{});
}

// Calls fn(std::integral_constant<bool, activation is not the identity>).
template <typename Fn>
ffi::Error WithActivation(int64_t activation, Fn&& fn) {
  if (activation != int64_t(Activation::kIdentity)) return fn(std::true_type{});
  return fn(std::false_type{});
}

// The streaming kernels' grid (one block per (n, p, tile)) and ReduceGroups' (one per (n, g)).
ffi::Error Grids(const Tiling& t, int64_t* streaming, int64_t* groups) {
  *streaming = t.shape.batch * t.shape.chunks * t.tiles;
  *groups = t.shape.batch * t.shape.groups;
  if (*streaming > INT_MAX || *groups > INT_MAX) {
    return InvalidArgument("group_norm: too many samples, chunks or groups for one launch");
  }
  return ffi::Error::Success();
}

ffi::Error GroupNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                            ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::Buffer<ffi::F32>> mean,
                            ffi::Result<ffi::Buffer<ffi::F32>> rstd,
                            ffi::Result<ffi::Buffer<ffi::F32>> workspace, float epsilon,
                            int64_t num_groups, int64_t activation, float activation_param) {
  GroupNormShape shape;
  JAXDNN_RETURN_IF_ERROR(CheckGroupNormFwd(x, scale, bias, *y, *mean, *rstd, *workspace, num_groups,
                                           activation, &shape));
  if (shape.batch == 0) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    T* yp = static_cast<T*>(y->untyped_data());
    if (auto status = ClusterForward<T>(stream, shape, Aligned16(xp) && Aligned16(yp), xp, ParamOf<T>(scale),
                                        ParamOf<T>(bias), epsilon, activation, activation_param, yp,
                                        mean->typed_data(), rstd->typed_data())) {
      return std::move(*status);
    }
    const Tiling t = MakeTiling<T>(shape, Aligned16(xp) && Aligned16(yp));
    int64_t blocks, group_blocks;
    JAXDNN_RETURN_IF_ERROR(Grids(t, &blocks, &group_blocks));
    const int threads = t.lanes * t.rows;
    float* ws = workspace->typed_data();
    return WithVec<T>(t.vec, [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      FwdChannelSums<T, kVec><<<blocks, threads, 0, stream>>>(xp, ws, t);
      JAXDNN_RETURN_IF_ERROR(LaunchError("group_norm forward sums"));
      JAXDNN_RETURN_IF_ERROR(CudaError(
          LaunchEarly(ReduceGroups<T>, dim3(group_blocks), dim3(kThreads), 0, stream, xp, ws,
                      Param<T>{nullptr, true}, shape, epsilon, mean->typed_data(), rstd->typed_data(), nullptr),
          "group_norm forward statistics"));
      return WithActivation(activation, [&](auto has_act) {
        return CudaError(LaunchEarly(Normalize<T, kVec, decltype(has_act)::value>, dim3(blocks), dim3(threads), 0,
                                     stream, xp, ParamOf<T>(scale), ParamOf<T>(bias), mean->typed_data(),
                                     rstd->typed_data(), yp, t, activation, activation_param),
                         "group_norm forward normalize");
      });
    });
  });
}

ffi::Error GroupNormBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                            ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::Buffer<ffi::F32> mean,
                            ffi::Buffer<ffi::F32> rstd, ffi::Result<ffi::AnyBuffer> dx,
                            ffi::Result<ffi::AnyBuffer> dscale, ffi::Result<ffi::AnyBuffer> dbias,
                            ffi::Result<ffi::Buffer<ffi::F32>> workspace,
                            ffi::Result<ffi::Buffer<ffi::F32>> group_sums, int64_t num_groups,
                            int64_t activation, float activation_param) {
  GroupNormShape shape;
  JAXDNN_RETURN_IF_ERROR(CheckGroupNormBwd(dy, x, scale, bias, mean, rstd, *dx, *dscale, *dbias,
                                           *workspace, *group_sums, num_groups, activation, &shape));
  if (shape.batch == 0 || shape.spatial == 0) {  // sums over no positions; dx is empty
    JAXDNN_RETURN_IF_ERROR(
        CudaError(cudaMemsetAsync(dscale->untyped_data(), 0, dscale->size_bytes(), stream), "memset"));
    return CudaError(cudaMemsetAsync(dbias->untyped_data(), 0, dbias->size_bytes(), stream), "memset");
  }
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* dyp = static_cast<const T*>(dy.untyped_data());
    const T* xp = static_cast<const T*>(x.untyped_data());
    T* dxp = static_cast<T*>(dx->untyped_data());
    float* ws = workspace->typed_data();
    float* sums = group_sums->typed_data();
    const bool aligned = Aligned16(dyp) && Aligned16(xp) && Aligned16(dxp);
    const Param<T> scale_p = ParamOf<T>(scale), bias_p = ParamOf<T>(bias);
    std::optional<ffi::Error> status = OnChipBackward<T>(stream, shape, aligned, dyp, xp, scale_p, bias_p,
                                                         mean.typed_data(), rstd.typed_data(), activation,
                                                         activation_param, dxp, ws, sums);
    if (!status) {
      status = ClusterBackward<T>(stream, shape, aligned, dyp, xp, scale_p, bias_p, mean.typed_data(),
                                  rstd.typed_data(), activation, activation_param, dxp, ws, sums);
    }
    if (status) {
      JAXDNN_RETURN_IF_ERROR(std::move(*status));
      return LaunchSumParts<T>(stream, ws, shape.batch, shape.channels, dscale, dbias);
    }
    const Tiling t = MakeTiling<T>(shape, aligned);
    int64_t blocks, group_blocks;
    JAXDNN_RETURN_IF_ERROR(Grids(t, &blocks, &group_blocks));
    const int threads = t.lanes * t.rows;
    return WithVec<T>(t.vec, [&](auto vec) {
      return WithActivation(activation, [&](auto has_act) {
        constexpr int kVec = decltype(vec)::value;
        constexpr bool kAct = decltype(has_act)::value;
        BwdChannelSums<T, kVec, kAct><<<blocks, threads, 0, stream>>>(
            dyp, xp, scale_p, bias_p, mean.typed_data(), rstd.typed_data(), ws, t,
            activation, activation_param);
        JAXDNN_RETURN_IF_ERROR(LaunchError("group_norm backward sums"));
        JAXDNN_RETURN_IF_ERROR(CudaError(LaunchEarly(ReduceGroups<T>, dim3(group_blocks), dim3(kThreads), 0, stream, xp,
                                                     ws, scale_p, shape, 0.f, nullptr, nullptr, sums),
                                         "group_norm backward group sums"));
        JAXDNN_RETURN_IF_ERROR(
            LaunchSumParts<T>(stream, ws, shape.batch * shape.chunks, shape.channels, dscale, dbias));
        Dx<T, kVec, kAct><<<blocks, threads, 0, stream>>>(dyp, xp, scale_p, bias_p,
                                                          mean.typed_data(), rstd.typed_data(), sums, dxp, t,
                                                          activation, activation_param);
        return LaunchError("group_norm backward dx");
      });
    });
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupNormFwdCuda, jaxdnn::GroupNormFwdImpl,
                              jaxdnn::BindGroupNormFwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupNormBwdCuda, jaxdnn::GroupNormBwdImpl,
                              jaxdnn::BindGroupNormBwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
