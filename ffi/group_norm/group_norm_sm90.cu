// The on-chip group norm backward, the cluster forward and the cluster backward (see
// group_norm_sm90.h): x (and dy) read from HBM once. The on-chip backward first:
//
// Work is cut into items: an item is one sample's S positions of a slab of whole groups (the
// fewest groups whose channels make a multiple of 16 bytes: one group of 16 bf16 channels for C =
// 512, G = 32). A persistent block (one an SM) takes items in turn. Its producer warp streams each
// item's x into a ring of 8 KiB shared-memory slots (chunks of `rows` positions x the slab, TMA
// boxes), where the item stays, and dy through a second, smaller ring twice; its 8 consumer warps
// make two passes: the first sums d * xhat and d per channel (d = dy * act'), the second, with dy
// read again (from L2: a block's item of dy is at most 136 KiB), writes dx in place of x, stored
// chunk by chunk by TMA. Each x slot goes back to the producer once its store has read it, so the
// next item's x loads while this one's dx is written. HBM traffic: x + dy + dx, where
// group_norm.cu's backward reads x and dy twice.
//
// Consecutive blocks take consecutive slabs of a sample at about the same time, so the boxes'
// 256-byte L2 promotion fetches each position's lines once for the neighbouring blocks. Every sum
// runs in a fixed order: the results have the same bits on every run.
//
// The same design for the forward (x held, three passes: sums, centred squares, y) ran no faster
// than group_norm.cu's two-pass kernels on an H200 (78 us for N 16, 64 x 64, C 512, G 32 bf16, and
// slower with a fused activation); splitting an item's positions between the blocks of a cluster
// (group sums exchanged through distributed shared memory), which let the next item load whole
// during this one, made both directions slower (104-151 us forward). The cluster forward kept
// (below) is not persistent and streams nothing: a launch of one cluster an item, each CTA copying
// its eighth of the item at once by cp.async, two or three CTAs an SM. The cluster backward (below
// it) does the same with x and dy, for the 16-bit slabs too long for the on-chip backward's ring.
#include "group_norm/group_norm_sm90.h"

#include <cuda.h>

#include <algorithm>
#include <climits>
#include <numeric>
#include <type_traits>

#include "common/activation.h"
#include "common/cuda_common.cuh"
#include "common/sm90_async.cuh"

namespace jaxdnn {
namespace {

constexpr int kConsumers = 256;            // the consumer warps' threads
constexpr int kWarps = kConsumers / 32;
constexpr int kThreads = kConsumers + 32;  // and the producer warp
constexpr int kSlotBytes = 8192;           // a chunk's shared memory
constexpr int kXSlots = 17;                // x's ring: 136 KiB, an item at most
constexpr int kDySlots = 8;                // dy's: 64 KiB
constexpr int kMaxSlab = 256;              // channels a slab (a TMA box dimension's limit)
constexpr int kMaxSlabGroups = 16;         // groups a slab (16 bytes of channels at most)
constexpr int kBarrier = 1;                // the consumers' named barrier

struct OnChipPlan {
  int64_t spatial, channels, groups, group_size;  // S, C, G, K
  int64_t slabs;                                  // C / slab
  int64_t items;                                  // N * slabs
  int slab;                                       // channels an item covers
  int slab_groups;                                // groups an item covers
  int rows;                                       // positions a chunk (a TMA box's rows)
  int chunks;                                     // chunks an item: ceil(S / rows) <= kXSlots
  int lanes;                                      // 16-byte vectors a row of the slab
  int row_step;                                   // rows the consumers cover at once: kConsumers / lanes
};

// The plan, or false where an item does not fit x's ring (or no slab is possible).
bool MakePlan(const GroupNormShape& s, int element_bytes, OnChipPlan* p) {
  if (s.batch < 1 || s.spatial < 1 || s.group_size > kMaxSlab) return false;
  int slab_groups = 1;
  while (slab_groups <= kMaxSlabGroups && (slab_groups * s.group_size * element_bytes % 16 != 0 ||
                                           s.groups % slab_groups != 0)) {
    ++slab_groups;
  }
  if (slab_groups > kMaxSlabGroups || slab_groups * s.group_size > kMaxSlab) return false;
  p->spatial = s.spatial;
  p->channels = s.channels;
  p->groups = s.groups;
  p->group_size = s.group_size;
  p->slab_groups = slab_groups;
  p->slab = int(slab_groups * s.group_size);
  p->slabs = s.channels / p->slab;
  p->items = s.batch * p->slabs;
  const int row_bytes = p->slab * element_bytes;
  p->rows = int(std::min<int64_t>({256, kSlotBytes / row_bytes, s.spatial}));
  const int64_t chunks = (s.spatial + p->rows - 1) / p->rows;
  if (chunks > kXSlots) return false;
  p->chunks = int(chunks);
  p->lanes = row_bytes / 16;
  p->row_step = kConsumers / p->lanes;
  return true;
}

// A consumer thread's part of every chunk: the slab's 16-byte vector `lane` (channels ch ..
// ch + kVec of the slab) of rows row0, row0 + row_step, ... (threads past lanes x row_step only
// join the barriers), and the item's group of each of its channels.
template <int kVec>
struct ConsumerPart {
  int ch, row0;
  bool active;
  int group_of[kVec];

  __device__ __forceinline__ explicit ConsumerPart(const OnChipPlan& p) {
    ch = threadIdx.x % p.lanes * kVec;
    row0 = threadIdx.x / p.lanes;
    active = row0 < p.row_step;
#pragma unroll
    for (int k = 0; k < kVec; ++k) group_of[k] = int((ch + k) / p.group_size);
  }

  // Calls fn(offset) with the element offset in a chunk of each of the thread's rows of chunk q
  // (rows past S excluded).
  template <typename Fn>
  __device__ __forceinline__ void ForRows(const OnChipPlan& p, int q, Fn&& fn) const {
    const int64_t left = p.spatial - int64_t(q) * p.rows;
    const int valid = left < p.rows ? int(left) : p.rows;
    if (!active) return;
    for (int r = row0; r < valid; r += p.row_step) fn(r * p.slab + ch);
  }
};

// The consumers' per-thread, per-channel values v[i] summed in a fixed order over the threads
// (channel[i][c] for the slab's channels c) and then over each group's channels with weights
// weight[c] (out[i][j] for the item's groups j). `partial` holds kValues x row_step x slab floats.
// Where a warp holds whole rows, a butterfly of shuffles first sums the rows it holds, so that a
// thread a channel adds kWarps partial sums, not row_step (128 for 32-byte rows) in a chain.
template <int kValues, int kVec, typename Weight>
__device__ __forceinline__ void SumGroups(const float (&v)[kValues][kVec], const ConsumerPart<kVec>& part,
                                          const OnChipPlan& p, const Weight& weight, float* partial,
                                          float (*channel)[kMaxSlab], float (*out)[kMaxSlabGroups]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool whole_rows = 32 % p.lanes == 0;
  float w[kValues][kVec];
#pragma unroll
  for (int i = 0; i < kValues; ++i) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) w[i][k] = v[i][k];
  }
  if (whole_rows) {
    for (int offset = p.lanes; offset < 32; offset *= 2) {
#pragma unroll
      for (int i = 0; i < kValues; ++i) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) w[i][k] += __shfl_xor_sync(0xffffffff, w[i][k], offset);
      }
    }
  }
  const int rows = whole_rows ? kWarps : p.row_step;  // the partial sums a channel
  const int row = whole_rows ? warp : part.row0;
  const int stride = rows * p.slab;
  if (part.active && (!whole_rows || lane < p.lanes)) {
#pragma unroll
    for (int i = 0; i < kValues; ++i) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) partial[i * stride + row * p.slab + part.ch + k] = w[i][k];
    }
  }
  sm90::NamedBarrierSync(kBarrier, kConsumers);
  for (int c = threadIdx.x; c < p.slab; c += kConsumers) {
#pragma unroll
    for (int i = 0; i < kValues; ++i) {
      float sum = 0.f;
      for (int r = 0; r < rows; ++r) sum += partial[i * stride + r * p.slab + c];
      channel[i][c] = sum;
    }
  }
  sm90::NamedBarrierSync(kBarrier, kConsumers);
  for (int j = warp; j < p.slab_groups; j += kWarps) {
#pragma unroll
    for (int i = 0; i < kValues; ++i) {
      float sum = 0.f;
      for (int64_t c = j * p.group_size + lane; c < (j + 1) * p.group_size; c += 32) sum += weight[c] * channel[i][c];
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
      if (lane == 0) out[i][j] = sum;
    }
  }
  sm90::NamedBarrierSync(kBarrier, kConsumers);
}

// A pack of 16 bytes read from (written to) shared memory as one access: member by member, the
// compiler had made 8 two-byte loads of each bf16 pack.
template <typename Vec>
__device__ __forceinline__ Vec LoadPack(const Vec& p) {
  static_assert(sizeof(Vec) == 16, "a 16-byte pack");
  const uint4 words = reinterpret_cast<const uint4&>(p);
  Vec v;
  memcpy(&v, &words, 16);
  return v;
}
template <typename Vec>
__device__ __forceinline__ void StorePack(Vec& p, const Vec& v) {
  uint4 words;
  memcpy(&words, &v, 16);
  reinterpret_cast<uint4&>(p) = words;
}

// The item's sample and first channel.
struct Item {
  int n, c0;
  __device__ __forceinline__ Item(int64_t item, const OnChipPlan& p)
      : n(int(item / p.slabs)), c0(int(item % p.slabs) * p.slab) {}
};

// The producer's load of chunk q of `item` into slot use % kRing of a ring.
template <int kRing, typename T>
__device__ __forceinline__ void LoadChunk(const CUtensorMap* map, uint8_t* ring, uint64_t* full, uint64_t* empty,
                                          int use, const Item& item, int q, const OnChipPlan& p) {
  sm90::WaitEmpty<kRing>(empty, use);
  uint64_t* bar = &full[use % kRing];
  sm90::BarrierArriveExpectTx(bar, p.rows * p.slab * sizeof(T));
  sm90::TmaLoad4d(ring + (use % kRing) * kSlotBytes, map, bar, item.c0, q * p.rows, item.n, 0);
}

// ---------------------------------------------------------------------------------------------
// With xhat = (x - mean) * rstd, d = dy * act'(xhat * scale + bias), g = d * scale:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) per (n, group),
//   dscale = sum(d * xhat), dbias = sum(d) over samples and positions (here per sample, to the
//   workspace as [N, 2, C], summed over the samples by group_norm.cu's SumParts).

template <typename T, bool kAct>
__global__ void __launch_bounds__(kThreads, 1)
    OnChipBwdKernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap dy_map,
                    const __grid_constant__ CUtensorMap dx_map, const OnChipPlan p, const Param<T> scale,
                    const Param<T> bias, const float* __restrict__ mean_in,
                    const float* __restrict__ rstd_in, float* __restrict__ workspace,
                    float* __restrict__ group_sums, int64_t activation, float activation_param) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kVec = kVec16<T>;
  using Vec = Pack<T, kVec>;
  extern __shared__ uint8_t raw_shared[];
  uint8_t* x_ring = sm90::AlignedShared(raw_shared);
  uint8_t* dy_ring = x_ring + kXSlots * kSlotBytes;
  __shared__ uint64_t x_full[kXSlots], x_empty[kXSlots], dy_full[kDySlots], dy_empty[kDySlots];
  __shared__ float partial[2 * kConsumers * kVec], channel[2][kMaxSlab], group_sum[2][kMaxSlabGroups];
  if (threadIdx.x == 0) {
    sm90::TmaPrefetchDescriptor(&x_map);
    sm90::TmaPrefetchDescriptor(&dy_map);
    sm90::TmaPrefetchDescriptor(&dx_map);
    sm90::InitRing<kXSlots>(x_full, x_empty, 1);
    sm90::InitRing<kDySlots>(dy_full, dy_empty, kWarps);  // each consumer warp releases dy
  }
  __syncthreads();
  // Launched early (LaunchEarly): the setup above overlaps the end of the kernel before, whose
  // outputs (the forward's, or dy) it may read, so every thread waits here before its first access.
  WaitForPreviousKernel();
  LetNextKernelLaunch();  // SumParts

  if (threadIdx.x >= kConsumers) {  // the producer warp: x and dy chunk by chunk, then dy again
    if (threadIdx.x == kConsumers) {
      int x_use = 0, dy_use = 0;
      for (int64_t index = blockIdx.x; index < p.items; index += gridDim.x) {
        const Item item(index, p);
        for (int q = 0; q < p.chunks; ++q) {
          LoadChunk<kXSlots, T>(&x_map, x_ring, x_full, x_empty, x_use++, item, q, p);
          LoadChunk<kDySlots, T>(&dy_map, dy_ring, dy_full, dy_empty, dy_use++, item, q, p);
        }
        for (int q = 0; q < p.chunks; ++q) LoadChunk<kDySlots, T>(&dy_map, dy_ring, dy_full, dy_empty, dy_use++, item, q, p);
      }
    }
    return;
  }

  const ConsumerPart<kVec> part(p);
  const float count = float(p.spatial * p.group_size);
  auto x_at = [&](int use, int offset) -> Vec& {
    return *reinterpret_cast<Vec*>(reinterpret_cast<T*>(x_ring + (use % kXSlots) * kSlotBytes) + offset);
  };
  auto dy_at = [&](int use, int offset) -> const Vec& {
    return *reinterpret_cast<const Vec*>(reinterpret_cast<const T*>(dy_ring + (use % kDySlots) * kSlotBytes) + offset);
  };
  // A consumer warp's release of a dy slot, once all its threads have read it.
  auto release_dy = [&](int use) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) sm90::BarrierArrive(&dy_empty[use % kDySlots]);
  };
  int x_first = 0, dy_first = 0;
  for (int64_t index = blockIdx.x; index < p.items; index += gridDim.x, x_first += p.chunks, dy_first += 2 * p.chunks) {
    const Item item(index, p);
    float mean[kVec], rstd[kVec], gamma[kVec], beta[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const int64_t g = int64_t(item.n) * p.groups + item.c0 / p.group_size + part.group_of[k];
      mean[k] = mean_in[g];
      rstd[k] = rstd_in[g];
      gamma[k] = scale[item.c0 + part.ch + k];
      beta[k] = bias[item.c0 + part.ch + k];
    }
    // xhat and d of the thread's channels at `offset` of x's and dy's chunks.
    auto grad_in = [&](int x_use, int dy_use, int offset, float (&xhat)[kVec], float (&d)[kVec]) {
      const Vec xv = LoadPack(x_at(x_use, offset)), dyv = LoadPack(dy_at(dy_use, offset));
      float pre[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        xhat[k] = (ToFloat(xv.v[k]) - mean[k]) * rstd[k];
        d[k] = ToFloat(dyv.v[k]);
        pre[k] = xhat[k] * gamma[k] + beta[k];
      }
      if constexpr (kAct) ActivateGradKindN(activation, pre, d, activation_param);
    };
    // Pass 1: per-channel sums of d * xhat and d, as x and dy arrive.
    float acc[2][kVec] = {};
    for (int q = 0; q < p.chunks; ++q) {
      sm90::WaitFull<kXSlots>(x_full, x_first + q);
      sm90::WaitFull<kDySlots>(dy_full, dy_first + q);
      part.ForRows(p, q, [&](int offset) {
        float xhat[kVec], d[kVec];
        grad_in(x_first + q, dy_first + q, offset, xhat, d);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          acc[0][k] += d[k] * xhat[k];
          acc[1][k] += d[k];
        }
      });
      release_dy(dy_first + q);
    }
    SumGroups(acc, part, p, scale.From(item.c0), partial, channel, group_sum);
    for (int c = threadIdx.x; c < p.slab; c += kConsumers) {
      float* row = workspace + int64_t(item.n) * 2 * p.channels + item.c0 + c;
      row[0] = channel[0][c];
      row[p.channels] = channel[1][c];
    }
    if (threadIdx.x < p.slab_groups) {
      const int64_t g = int64_t(item.n) * p.groups + item.c0 / p.group_size + threadIdx.x;
      group_sums[2 * g] = group_sum[0][threadIdx.x];
      group_sums[2 * g + 1] = group_sum[1][threadIdx.x];
    }
    float mean_g_xhat[kVec], mean_g[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      mean_g_xhat[k] = group_sum[0][part.group_of[k]] / count;
      mean_g[k] = group_sum[1][part.group_of[k]] / count;
    }
    // Pass 2: dx in place of x, with dy again. Thread 0 stores each chunk once every consumer has
    // written it, and hands the previous chunk's slot back once that store has read it (the last
    // one at the item's end).
    for (int q = 0; q < p.chunks; ++q) {
      const int dy_use = dy_first + p.chunks + q;
      sm90::WaitFull<kDySlots>(dy_full, dy_use);
      part.ForRows(p, q, [&](int offset) {
        float xhat[kVec], d[kVec];
        grad_in(x_first + q, dy_use, offset, xhat, d);
        Vec out;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          out.v[k] = FromFloat<T>(rstd[k] * (gamma[k] * d[k] - mean_g[k] - xhat[k] * mean_g_xhat[k]));
        }
        StorePack(x_at(x_first + q, offset), out);
      });
      release_dy(dy_use);
      sm90::FenceProxyAsync();
      sm90::NamedBarrierSync(kBarrier, kConsumers);
      if (threadIdx.x == 0) {
        const int use = x_first + q;
        sm90::TmaStore4d(&dx_map, x_ring + (use % kXSlots) * kSlotBytes, item.c0, q * p.rows, item.n, 0);
        sm90::BulkWaitReads<1>();
        if (q > 0) sm90::BarrierArrive(&x_empty[(use - 1) % kXSlots]);
      }
    }
    if (threadIdx.x == 0) {
      sm90::BulkWaitReads();
      sm90::BarrierArrive(&x_empty[(x_first + p.chunks - 1) % kXSlots]);
    }
  }
  if (threadIdx.x == 0) sm90::BulkWaitAll();
#endif
}

// ---------------------------------------------------------------------------------------------
// The cluster forward (see group_norm_sm90.h): a cluster of kClusterBlocks CTAs holds one item, a
// sample's positions of a slab of 64 channels (a 128-byte row a position), each CTA an eighth of them
// in shared memory, all its copies issued at once (cp.async). The group sums of x and x^2, both
// about each group's first element (as group_norm.cu's two passes), are exchanged through
// distributed shared memory in rank order, once; each CTA then writes its positions of y (with the
// activation). HBM traffic: x and y once each, where group_norm.cu's forward reads x twice.
// Three CTAs an SM (64 KiB each for 4096 positions): with two (the activation's registers) and an
// exchange of the sums and then of the centred squares, the forward took 51 us, 68 with silu, where
// this one takes 49 and 58 (H200, 2026-11-30, N16 64x64 C512 G32 bf16). Persistent clusters, which
// loaded their next item while reducing this one, lost: 70 us with two buffers (one CTA an SM), 49
// with one. Slabs narrower than 64 channels (groups that do not tile them) lost to the two passes
// on Stable Diffusion's levels (8 x 40-channel slabs of 64x64 positions: 27.6 us against 26.7;
// 16x16: 33 against 22), as did one CTA an SM with up to 200 KiB (2 x 128x128 x 320: 37 us against
// 28): the forward takes 64-channel slabs in up to 112 KiB a CTA.

constexpr int kClusterBlocks = 8;      // a portable cluster size
constexpr int kClusterThreads = 256;
constexpr int kMaxClusterSlab = 64;    // a slab's channels: a 128-byte row a position
constexpr int kMaxHeldBytes = 112 * 1024;  // a CTA's rows (and scratch): two CTAs an SM
constexpr size_t kScratchBytes = 2 * kClusterThreads * 8 * sizeof(float);  // BlockChannelSums'

struct ClusterPlan {
  int64_t spatial, channels, groups;  // S, C, G
  int group_size;                     // K, a divisor of the slab
  int slab;                           // W: channels an item covers, a multiple of 8 up to 64
  int slabs;                          // C / W
  float epsilon;
};

// A thread's part of the CTA's rows: 16-byte pack `pack` (channels 8 pack .. + 7 of the slab) of
// rows row0, row0 + row_step, ... below `rows` (none for the threads past packs x row_step).
// kPacks: the packs a row, 8 (64 channels) or 0 (W / 8, read at run time).
template <int kPacks>
struct SlabPart {
  int packs, row_step, pack, row0;
  __device__ __forceinline__ explicit SlabPart(int slab) : packs(kPacks ? kPacks : slab / 8) {
    row_step = kClusterThreads / packs;
    pack = int(threadIdx.x) % packs;
    row0 = int(threadIdx.x) / packs;
  }
  __device__ __forceinline__ int RowsOf(int rows) const { return row0 < row_step ? rows : 0; }
};

// A CTA's share of its cluster's item (a sample's slab): its rank's eighth of sample n's positions,
// channels from slab_channel0; `rows` are the thread's (see SlabPart), `first` its row 0 (its pack)
// in x, y, dy and dx.
struct ClusterShare {
  int rank, rows;
  int64_t n, slab_channel0, channel0, first;

  template <int kPacks>
  __device__ __forceinline__ ClusterShare(const ClusterPlan& p, const SlabPart<kPacks>& part, int slab) {
    rank = int(blockIdx.x % kClusterBlocks);  // the CTA's rank in its (1-D) cluster
    const int64_t item = blockIdx.x / kClusterBlocks;
    n = item / p.slabs;
    slab_channel0 = item % p.slabs * slab;
    const int64_t begin = p.spatial * rank / kClusterBlocks;
    rows = part.RowsOf(int(p.spatial * (rank + 1) / kClusterBlocks - begin));
    channel0 = slab_channel0 + part.pack * 8;
    first = (n * p.spatial + begin) * p.channels + channel0;
  }
};

// The 64-channel slab's per-group sums of `acc` (thread t's 8 channels (t % 8) 8 .. + 7 of the slab),
// over its threads in a fixed order, into out[g] for the slab's 64 / K groups g.
__device__ __forceinline__ void BlockGroupSums(float (&acc)[8], int group_size, float (*warp_part)[kMaxClusterSlab],
                                               float* channel_sum, float* out) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {  // lanes of one pack: lane % 8
    acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], 8);
    acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], 16);
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane < 8) {
#pragma unroll
    for (int k = 0; k < 8; ++k) warp_part[warp][lane * 8 + k] = acc[k];
  }
  __syncthreads();
  if (threadIdx.x < kMaxClusterSlab) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kClusterThreads / 32; ++w) sum += warp_part[w][threadIdx.x];
    channel_sum[threadIdx.x] = sum;
  }
  __syncthreads();
  if (threadIdx.x < kMaxClusterSlab / group_size) {
    float sum = 0.f;
    for (int c = 0; c < group_size; ++c) sum += channel_sum[threadIdx.x * group_size + c];
    out[threadIdx.x] = sum;
  }
}

// Any slab's per-channel sums of two values over the CTA's threads (a[k], b[k] of channel 8 pack + k),
// into channel_sum[0][c] and [1][c]: the threads' values through `scratch` ([2][kClusterThreads][8]
// floats), each channel's added in row order by one thread. (The rows of a warp do not line up with
// the packs of a row, which the 64-channel slab's shuffles need.) Ends with a __syncthreads.
__device__ __forceinline__ void BlockChannelSums(const float (&a)[8], const float (&b)[8], const SlabPart<0>& part,
                                                 int slab, float* scratch, float (*channel_sum)[kMaxClusterSlab]) {
  float4* mine_a = reinterpret_cast<float4*>(scratch) + threadIdx.x * 2;
  float4* mine_b = mine_a + kClusterThreads * 2;
  mine_a[0] = make_float4(a[0], a[1], a[2], a[3]);
  mine_a[1] = make_float4(a[4], a[5], a[6], a[7]);
  mine_b[0] = make_float4(b[0], b[1], b[2], b[3]);
  mine_b[1] = make_float4(b[4], b[5], b[6], b[7]);
  __syncthreads();
  if (threadIdx.x < 2 * slab) {
    const int value = threadIdx.x / slab, c = threadIdx.x % slab;
    const float* column = scratch + value * kClusterThreads * 8 + c;  // thread (row r, pack c / 8): r * slab
    float total = 0.f;
#pragma unroll 4
    for (int r = 0; r < part.row_step; ++r) total += column[r * slab];
    channel_sum[value][c] = total;
  }
  __syncthreads();
}

// The sum over the cluster's CTAs, in rank order, of their `part` (the same shared-memory variable
// in each): the same value, with the same bits, in every CTA.
__device__ __forceinline__ float ClusterTotal(const float* part) {
  const uint32_t local = static_cast<uint32_t>(__cvta_generic_to_shared(part));
  float total = 0.f;
#pragma unroll
  for (int rank = 0; rank < kClusterBlocks; ++rank) {
    uint32_t remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    total += v;
  }
  return total;
}

template <typename T, bool kAct>
__global__ void __launch_bounds__(kClusterThreads, 3)
    ClusterFwdKernel(const T* __restrict__ x, Param<T> scale, Param<T> bias, T* __restrict__ y,
                     float* __restrict__ mean_out, float* __restrict__ rstd_out, ClusterPlan p, int64_t activation,
                     float activation_param) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Vec = Pack<T, 8>;
  extern __shared__ uint4 held_raw[];
  Vec* held = reinterpret_cast<Vec*>(held_raw);  // [rows][packs]: this CTA's positions of the slab
  __shared__ float warp_part[kClusterThreads / 32][kMaxClusterSlab];
  __shared__ float channel_sum[kMaxClusterSlab];
  __shared__ float group_part[2][kMaxClusterSlab];  // read by the cluster: shifted sums, squares
  __shared__ float channel_stats[2][kMaxClusterSlab];  // mean, rstd of each channel's group
  constexpr int slab = kMaxClusterSlab;
  const SlabPart<slab / 8> part(slab);
  const ClusterShare share(p, part, slab);
  const int rank = share.rank, rows = share.rows;
  const int64_t n = share.n, slab_channel0 = share.slab_channel0, channel0 = share.channel0, first = share.first;
  for (int r = part.row0; r < rows; r += part.row_step) {
    CpAsync16(&held[r * part.packs + part.pack], x + first + r * p.channels);
  }
  CpAsyncCommit();

  // The sums are about each group's first element (x at position 0), as group_norm.cu's two passes
  // take them (GroupMoments): one exchange gives both moments.
  const T* x_item = x + n * p.spatial * p.channels + slab_channel0;
  float shift[8], sum[8] = {}, squares[8] = {};
#pragma unroll
  for (int k = 0; k < 8; ++k) shift[k] = ToFloat(x_item[(part.pack * 8 + k) / p.group_size * p.group_size]);
  CpAsyncWait<0>();  // this thread's own copies: each thread reads only the packs it copied
  for (int r = part.row0; r < rows; r += part.row_step) {
    const Vec v = held[r * part.packs + part.pack];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float d = ToFloat(v.v[k]) - shift[k];
      sum[k] += d;
      squares[k] += d * d;
    }
  }
  BlockGroupSums(sum, p.group_size, warp_part, channel_sum, group_part[0]);
  BlockGroupSums(squares, p.group_size, warp_part, channel_sum, group_part[1]);
  sm90::ClusterArrive();
  sm90::ClusterWait();  // every CTA's group_part
  if (threadIdx.x < slab) {
    const int g = threadIdx.x / p.group_size;
    float group_mean, group_rstd;
    GroupMoments(ClusterTotal(&group_part[0][g]), ClusterTotal(&group_part[1][g]), ToFloat(x_item[g * p.group_size]),
                 p.spatial * p.group_size, p.epsilon, &group_mean, &group_rstd);
    channel_stats[0][threadIdx.x] = group_mean;
    channel_stats[1][threadIdx.x] = group_rstd;
    if (rank == 0 && threadIdx.x % p.group_size == 0) {
      const int64_t index = n * p.groups + (slab_channel0 + threadIdx.x) / p.group_size;
      mean_out[index] = group_mean;
      rstd_out[index] = group_rstd;
    }
  }
  sm90::ClusterArrive();  // this CTA's reads of the others' group_part are done (waited for at the end)
  __syncthreads();
  float mean[8], a[8], b[8];  // pre-activation = (x - mean) a + b
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    mean[k] = channel_stats[0][part.pack * 8 + k];
    a[k] = channel_stats[1][part.pack * 8 + k] * scale[channel0 + k];
    b[k] = bias[channel0 + k];
  }
  for (int r = part.row0; r < rows; r += part.row_step) {
    const Vec v = held[r * part.packs + part.pack];
    float pre[8];
    Vec out;
#pragma unroll
    for (int k = 0; k < 8; ++k) pre[k] = (ToFloat(v.v[k]) - mean[k]) * a[k] + b[k];
    if constexpr (kAct) ActivateKindN(activation, pre, activation_param);
#pragma unroll
    for (int k = 0; k < 8; ++k) out.v[k] = FromFloat<T>(pre[k]);
    StoreWords(y + first + r * p.channels, out);
  }
  sm90::ClusterWait();  // no CTA exits while another may still read its group_part
#endif
}

// The cluster backward (see group_norm_sm90.h): the forward's clusters on any slab (SlabChannels),
// each CTA holding its positions of x and dy (all copies issued at once), so that x and dy are read
// from HBM once, for the problems the on-chip backward does not take (a sample's slab too long for
// its ring). With xhat = (x - mean) rstd, d = dy act'(xhat scale + bias), g = d scale:
//   dx = rstd (g - mean(g) - xhat mean(g xhat)) per (n, group);
// the cluster exchanges its CTAs' per-channel sums of d xhat and d once (rank order), which give the
// sample's workspace row (for SumParts: dscale, dbias) and the group sums of g xhat and g.
template <typename T, bool kAct>
__global__ void __launch_bounds__(kClusterThreads, 2)
    ClusterBwdKernel(const T* __restrict__ dy, const T* __restrict__ x, Param<T> scale, Param<T> bias,
                     const float* __restrict__ mean_in, const float* __restrict__ rstd_in, T* __restrict__ dx,
                     float* __restrict__ workspace, float* __restrict__ group_sums, ClusterPlan p,
                     int64_t activation, float activation_param) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Vec = Pack<T, 8>;
  extern __shared__ uint4 held_raw[];
  __shared__ float channel_sum[2][kMaxClusterSlab];    // this CTA's, read by the cluster: d xhat, d
  __shared__ float channel_total[2][kMaxClusterSlab];  // the cluster's
  __shared__ float group_total[2][kMaxClusterSlab];    // g xhat, g
  const SlabPart<0> part(p.slab);
  const int slab = p.slab;
  const ClusterShare share(p, part, slab);
  const int most_rows = int((p.spatial + kClusterBlocks - 1) / kClusterBlocks);
  Vec* held_x = reinterpret_cast<Vec*>(held_raw);  // [rows][packs]: this CTA's positions of the slab
  Vec* held_dy = held_x + most_rows * part.packs;
  float* scratch = reinterpret_cast<float*>(held_dy + most_rows * part.packs);
  for (int r = part.row0; r < share.rows; r += part.row_step) {
    CpAsync16(&held_x[r * part.packs + part.pack], x + share.first + r * p.channels);
    CpAsync16(&held_dy[r * part.packs + part.pack], dy + share.first + r * p.channels);
  }
  CpAsyncCommit();

  const int64_t group0 = share.n * p.groups + share.slab_channel0 / p.group_size;  // the slab's first
  float mean[8], rstd[8], gamma[8], beta[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int64_t g = group0 + (part.pack * 8 + k) / p.group_size;
    mean[k] = mean_in[g];
    rstd[k] = rstd_in[g];
    gamma[k] = scale[share.channel0 + k];
    beta[k] = bias[share.channel0 + k];
  }
  // xhat and d of the thread's channels at held row r.
  auto grad_in = [&](int r, float (&xhat)[8], float (&d)[8]) {
    const Vec xv = held_x[r * part.packs + part.pack], dyv = held_dy[r * part.packs + part.pack];
    float pre[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      xhat[k] = (ToFloat(xv.v[k]) - mean[k]) * rstd[k];
      d[k] = ToFloat(dyv.v[k]);
      pre[k] = xhat[k] * gamma[k] + beta[k];
    }
    if constexpr (kAct) ActivateGradKindN(activation, pre, d, activation_param);
  };
  CpAsyncWait<0>();  // this thread's own copies: each thread reads only the packs it copied
  float d_xhat[8] = {}, d_sum[8] = {};
  for (int r = part.row0; r < share.rows; r += part.row_step) {
    float xhat[8], d[8];
    grad_in(r, xhat, d);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      d_xhat[k] += d[k] * xhat[k];
      d_sum[k] += d[k];
    }
  }
  BlockChannelSums(d_xhat, d_sum, part, slab, scratch, channel_sum);
  sm90::ClusterArrive();
  sm90::ClusterWait();  // every CTA's channel_sum
  if (threadIdx.x < 2 * slab) {
    const int value = threadIdx.x / slab, c = threadIdx.x % slab;
    const float total = ClusterTotal(&channel_sum[value][c]);
    channel_total[value][c] = total;
    if (share.rank == 0) workspace[(share.n * 2 + value) * p.channels + share.slab_channel0 + c] = total;
  }
  sm90::ClusterArrive();  // this CTA's reads of the others' channel_sum are done (waited for at the end)
  __syncthreads();
  const int groups = slab / p.group_size;
  if (threadIdx.x < 2 * groups) {
    const int value = threadIdx.x / groups, g = threadIdx.x % groups;
    float total = 0.f;
    for (int c = g * p.group_size; c < (g + 1) * p.group_size; ++c) {
      total += scale[share.slab_channel0 + c] * channel_total[value][c];
    }
    group_total[value][g] = total;
    if (share.rank == 0) group_sums[2 * (group0 + g) + value] = total;
  }
  __syncthreads();
  const float count = float(p.spatial * p.group_size);
  float mean_g_xhat[8], mean_g[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int g = (part.pack * 8 + k) / p.group_size;
    mean_g_xhat[k] = group_total[0][g] / count;
    mean_g[k] = group_total[1][g] / count;
  }
  for (int r = part.row0; r < share.rows; r += part.row_step) {
    float xhat[8], d[8];
    grad_in(r, xhat, d);
    Vec out;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      out.v[k] = FromFloat<T>(rstd[k] * (gamma[k] * d[k] - mean_g[k] - xhat[k] * mean_g_xhat[k]));
    }
    StoreWords(dx + share.first + r * p.channels, out);
  }
  sm90::ClusterWait();  // no CTA exits while another may still read its channel_sum
#endif
}

// ---------------------------------------------------------------------------------------------
// Host

template <typename T>
CUtensorMapDataType MapType() {
  if constexpr (std::is_same_v<T, float>) return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  if constexpr (std::is_same_v<T, __half>) return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
}

// The map of x, dy or dx as [N][S][C] (coordinates (channel, position, sample, 0)) with boxes of
// the plan's chunks: `rows` positions x a slab, zeros (loads) or nothing (stores) past S.
template <typename T>
CUresult MakeMap(CUtensorMap* map, const T* data, const GroupNormShape& s, const OnChipPlan& p) {
  const cuuint64_t dims[4] = {cuuint64_t(s.channels), cuuint64_t(s.spatial), cuuint64_t(s.batch), 1};
  const cuuint64_t strides[3] = {cuuint64_t(s.channels) * sizeof(T), cuuint64_t(s.spatial * s.channels) * sizeof(T),
                                 cuuint64_t(s.batch * s.spatial * s.channels) * sizeof(T)};
  const cuuint32_t box[4] = {cuuint32_t(p.slab), cuuint32_t(p.rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return cuTensorMapEncodeTiled(map, MapType<T>(), 4, const_cast<T*>(data), dims, strides, box, element_strides,
                                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// Dynamic shared memory: the two rings, and 1024 bytes to align them.
constexpr size_t kDynamicShared = size_t(kXSlots + kDySlots) * kSlotBytes + 1024;

// The cluster kernels' slab: 64 channels where the groups tile them (the forward's only slab, for its
// shuffle reduction), else the widest multiple of 8 channels and of K, up to 64, that divides C (the
// backward's); 0 where none does.
int SlabChannels(const GroupNormShape& s) {
  if (s.channels % kMaxClusterSlab == 0 && kMaxClusterSlab % s.group_size == 0) return kMaxClusterSlab;
  const int64_t unit = std::lcm<int64_t>(s.group_size, 8);
  for (int64_t slab = kMaxClusterSlab / unit * unit; slab >= unit; slab -= unit) {
    if (s.channels % slab == 0) return int(slab);
  }
  return 0;
}

// The cluster kernels' plan for 16-bit x, and their dynamic shared memory: `arrays` arrays (x; x and
// dy) of a CTA's positions of the slab, and BlockChannelSums' scratch where `scratch`; false
// for the problems they do not take.
bool MakeClusterPlan(const GroupNormShape& shape, float epsilon, int arrays, bool scratch, ClusterPlan* plan,
                     size_t* smem) {
  const int slab = SlabChannels(shape);
  if (slab == 0 || shape.batch < 1 || shape.spatial < kClusterBlocks || !Sm90OrLater() ||
      shape.batch * (shape.channels / slab) * kClusterBlocks > INT_MAX) {
    return false;
  }
  const int64_t rows = (shape.spatial + kClusterBlocks - 1) / kClusterBlocks;
  *smem = size_t(arrays * rows * slab * 2) + (scratch ? kScratchBytes : 0);
  *plan = {shape.spatial, shape.channels, shape.groups, int(shape.group_size), slab, int(shape.channels / slab),
           epsilon};
  return *smem <= size_t(kMaxHeldBytes);
}

// Launches `kernel` in clusters of kClusterBlocks CTAs, one a (sample, slab); nothing (and no error)
// where the GPU cannot hold a cluster of them.
template <typename Kernel, typename... Args>
std::optional<ffi::Error> LaunchClusters(Kernel kernel, const ClusterPlan& plan, int64_t batch, size_t smem,
                                         cudaStream_t stream, const char* what, Args... args) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess) {
    cudaGetLastError();
    return std::nullopt;
  }
  const ClusterLaunch launch(kClusterBlocks, dim3(unsigned(batch * plan.slabs * kClusterBlocks)),
                             dim3(kClusterThreads), smem, stream);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch.config) != cudaSuccess || clusters < 1) {
    cudaGetLastError();  // the query's error, if any, is not the call's
    return std::nullopt;
  }
  return CudaError(cudaLaunchKernelEx(&launch.config, kernel, args...), what);
}

}  // namespace

template <typename T>
std::optional<ffi::Error> OnChipBackward(cudaStream_t stream, const GroupNormShape& shape, bool aligned, const T* dy,
                                         const T* x, Param<T> scale, Param<T> bias, const float* mean,
                                         const float* rstd, int64_t activation, float activation_param, T* dx,
                                         float* workspace, float* group_sums) {
  OnChipPlan plan;
  if (!aligned || !MakePlan(shape, sizeof(T), &plan) || !Sm90OrLater()) {
    return std::nullopt;
  }
  CUtensorMap x_map, dy_map, dx_map;
  if (MakeMap(&x_map, x, shape, plan) != CUDA_SUCCESS || MakeMap(&dy_map, dy, shape, plan) != CUDA_SUCCESS ||
      MakeMap(&dx_map, dx, shape, plan) != CUDA_SUCCESS) {
    return ffi::Error(ffi::ErrorCode::kInternal, "jaxdnn: group_norm backward (sm90): cannot encode a TMA descriptor");
  }
  auto launch = [&](auto kernel) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kDynamicShared));
    const int64_t blocks = std::min<int64_t>(plan.items, ResidentBlocks(kernel, kThreads, kDynamicShared));
    return CudaError(LaunchEarly(kernel, dim3(unsigned(blocks)), dim3(kThreads), kDynamicShared, stream, x_map, dy_map,
                                 dx_map, plan, scale, bias, mean, rstd, workspace, group_sums, activation,
                                 activation_param),
                     "group_norm backward (sm90)");
  };
  if (activation != int64_t(Activation::kIdentity)) return launch(OnChipBwdKernel<T, true>);
  return launch(OnChipBwdKernel<T, false>);
}

template <typename T>
std::optional<ffi::Error> ClusterForward(cudaStream_t stream, const GroupNormShape& shape, bool aligned, const T* x,
                                         Param<T> scale, Param<T> bias, float epsilon, int64_t activation,
                                         float activation_param, T* y, float* mean, float* rstd) {
  if constexpr (sizeof(T) != 2) {
    return std::nullopt;
  } else {
    ClusterPlan plan;
    size_t smem;
    // 64-channel slabs alone: the forward's reduction is shuffles over whole 128-byte rows.
    if (!aligned || !MakeClusterPlan(shape, epsilon, 1, false, &plan, &smem) || plan.slab != kMaxClusterSlab) {
      return std::nullopt;
    }
    const auto kernel = activation != int64_t(Activation::kIdentity) ? ClusterFwdKernel<T, true>
                                                                      : ClusterFwdKernel<T, false>;
    return LaunchClusters(kernel, plan, shape.batch, smem, stream, "group_norm forward (cluster)", x, scale, bias, y,
                          mean, rstd, plan, activation, activation_param);
  }
}

template <typename T>
std::optional<ffi::Error> ClusterBackward(cudaStream_t stream, const GroupNormShape& shape, bool aligned, const T* dy,
                                          const T* x, Param<T> scale, Param<T> bias, const float* mean,
                                          const float* rstd, int64_t activation, float activation_param, T* dx,
                                          float* workspace, float* group_sums) {
  if constexpr (sizeof(T) != 2) {
    return std::nullopt;
  } else {
    ClusterPlan plan;
    size_t smem;
    if (!aligned || !MakeClusterPlan(shape, 0.f, 2, true, &plan, &smem)) return std::nullopt;
    const auto kernel = activation != int64_t(Activation::kIdentity) ? ClusterBwdKernel<T, true>
                                                                      : ClusterBwdKernel<T, false>;
    return LaunchClusters(kernel, plan, shape.batch, smem, stream, "group_norm backward (cluster)", dy, x, scale,
                          bias, mean, rstd, dx, workspace, group_sums, plan, activation, activation_param);
  }
}

#define JAXDNN_INSTANTIATE(T)                                                                                  \
  template std::optional<ffi::Error> ClusterForward<T>(cudaStream_t, const GroupNormShape&, bool, const T*,          \
                                                       Param<T>, Param<T>, float, int64_t, float, T*, float*,       \
                                                       float*);                                                      \
  template std::optional<ffi::Error> OnChipBackward<T>(cudaStream_t, const GroupNormShape&, bool, const T*, const T*, \
                                                       Param<T>, Param<T>, const float*, const float*,               \
                                                       int64_t, float, T*, float*, float*);                          \
  template std::optional<ffi::Error> ClusterBackward<T>(cudaStream_t, const GroupNormShape&, bool, const T*,         \
                                                        const T*, Param<T>, Param<T>, const float*, const float*,    \
                                                        int64_t, float, T*, float*, float*);
JAXDNN_INSTANTIATE(float)
JAXDNN_INSTANTIATE(__nv_bfloat16)
JAXDNN_INSTANTIATE(__half)
#undef JAXDNN_INSTANTIATE

}  // namespace jaxdnn
