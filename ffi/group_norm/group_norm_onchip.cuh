// Single-pass GroupNorm kernels (sm_90 thread-block clusters): each cluster keeps a slab of x (and
// dy) in its CTAs' registers, so HBM sees x once + y once (forward), x + dy once + dx once
// (backward). Included by group_norm.cu only; see its top comment for when these kernels serve.
//
// A cluster owns (sample n, tile of Gt consecutive groups): the slab [S, W] with W = Gt * K
// channels. In each CTA, thread (row, lane) of `rows` x `lanes` owns the 16-byte vector `lane` of
// the tile's channels (so one group: vectors never straddle groups, K being a multiple of a
// vector) at the positions first + j * rows, j < kVecs, where CTA rank r of the cluster covers
// positions [r * rows * kVecs, (r + 1) * rows * kVecs). A warp thus reads 32 / lanes whole
// W-channel pixel slices of consecutive positions at each j.
//
// Reductions, all in a fixed order (bit-reproducible): xor butterflies within the warp (over its
// rows, then over a group's lanes), the warps in order through shared memory, then the cluster's
// CTAs in rank order: each CTA pushes its partials into the others' shared memory (distributed
// shared memory stores), one cluster barrier publishes them, and each CTA adds the same values in
// the same order, so all agree on the same bits (see ClusterSums).
#pragma once

#include <cooperative_groups.h>

#include <climits>
#include <cstdint>

#include "common/cuda_common.cuh"
#include "group_norm/group_norm_common.h"

namespace jaxdnn {
namespace onchip {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;            // threads a CTA
constexpr int kWarps = kThreads / 32;
constexpr int kMaxLanes = 32;            // vectors across a tile, at most (a warp)
constexpr int kMaxCluster = 8;           // the portable cluster size
constexpr int kFwdVecs = 16;             // 16-byte vectors of x a thread holds (64 registers)
constexpr int kBwdVecs = 8;              // ... of x and of dy each in the backward

// The host's choice for one launch (see PlanSlab).
struct SlabPlan {
  GroupNormShape shape;
  int lanes;          // 16-byte vectors across the tile's W channels: a power of two <= 32
  int group_lanes;    // vectors across a group (K / vector): a power of two dividing `lanes`
  int rows;           // kThreads / lanes
  int tile_groups;    // Gt = lanes / group_lanes
  int cluster;        // CTAs a cluster, <= 8
  int64_t tiles;      // G / Gt
};

// Chooses the widest tile (up to 128 bytes of a pixel, for whole DRAM bursts; at least 32, a whole
// sector) whose slab fits in a cluster of at most 8 CTAs holding `vecs` vectors a thread. False:
// the multi-pass kernels serve (no positions, K not a whole number of 16-byte vectors, K or the
// tile not a power-of-two number of vectors, a group wider than 32 vectors, or a slab too large).
template <typename T>
bool PlanSlab(const GroupNormShape& shape, bool aligned, int vecs, SlabPlan* plan) {
  constexpr int kVec = kVec16<T>;
  const int64_t k = shape.group_size;
  if (!aligned || shape.spatial == 0 || k % kVec != 0 || k / kVec > kMaxLanes) return false;
  const int group_lanes = int(k / kVec);
  if ((group_lanes & (group_lanes - 1)) != 0) return false;
  const int widest = group_lanes > 128 / 16 ? group_lanes : 128 / 16;
  for (int lanes = widest; lanes >= group_lanes && lanes >= 2; lanes /= 2) {
    const int tile_groups = lanes / group_lanes;
    if (shape.groups % tile_groups != 0) continue;
    const int rows = kThreads / lanes;
    const int64_t per_cta = int64_t(rows) * vecs;
    const int64_t cluster = (shape.spatial + per_cta - 1) / per_cta;
    if (cluster > kMaxCluster) continue;
    const int64_t tiles = shape.groups / tile_groups;
    if (shape.batch * tiles * cluster > INT_MAX) return false;
    *plan = {shape, lanes, group_lanes, rows, tile_groups, int(cluster), tiles};
    return true;
  }
  return false;
}

// This thread's place: sample, tile, its channel (first of its vector), group (within the sample
// and within the tile); the element offset of its first vector, the stride between its vectors
// (rows positions), and how many of its vectors lie before the end of the positions.
struct SlabPart {
  int64_t n, tile, channel, group, start, stride;
  int lane, tile_group, rank, held;
};

__device__ __forceinline__ SlabPart SlabPartOf(const SlabPlan& p, int vecs, int vec) {
  SlabPart part;
  part.rank = int(cg::this_cluster().block_rank());
  const int64_t owner = blockIdx.x / p.cluster;  // the cluster's index: tiles vary fastest, so
  part.tile = owner % p.tiles;                   // concurrent clusters read whole pixels together
  part.n = owner / p.tiles;
  part.lane = threadIdx.x % p.lanes;
  part.tile_group = part.lane / p.group_lanes;
  part.group = part.tile * p.tile_groups + part.tile_group;
  part.channel = part.group * p.shape.group_size + (part.lane % p.group_lanes) * vec;
  const int64_t first = int64_t(part.rank) * p.rows * vecs + threadIdx.x / p.lanes;
  const int64_t past = p.shape.spatial - first;  // positions from the first on
  part.held = past <= 0 ? 0 : past >= int64_t(vecs) * p.rows ? vecs : int((past + p.rows - 1) / p.rows);
  part.start = (part.n * p.shape.spatial + first) * p.shape.channels + part.channel;
  part.stride = int64_t(p.rows) * p.shape.channels;
  return part;
}

// Hides v's value from the optimizer, so the elementwise pass after the reductions converts the
// packed elements again rather than keeping the float copies of the sums pass live across the
// cluster barriers (twice the registers, and spills).
template <typename V>
__device__ __forceinline__ void Opaque(V& v) {
  static_assert(sizeof(V) % 4 == 0, "V must consist of 4-byte words");
  uint32_t* words = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
  for (int i = 0; i < int(sizeof(V) / 4); ++i) asm volatile("" : "+r"(words[i]));
}

// Sums each of v over the thread's warp rows (xor offsets >= lanes) and then, when `whole_group`,
// over the lanes of its group (offsets < group_lanes). Every thread of a class gets the same bits
// (float addition commutes).
template <int kN>
__device__ __forceinline__ void WarpRowSums(float (&v)[kN], const SlabPlan& p, bool whole_group) {
  for (int offset = 16; offset >= p.lanes; offset /= 2) {
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], offset);
  }
  if (!whole_group) return;
  for (int offset = 1; offset < p.group_lanes; offset *= 2) {
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], offset);
  }
}

// The cluster's per-group totals of the thread's two sums `v` (returned in v). With kChannels, also
// the per-channel sums `first` and `second` (the thread's kVec channels) over the cluster's
// positions, which rank 0 stores to channel_sums[0, c] and channel_sums[C, c]. Every thread of the
// CTA calls it (it has barriers), after ArriveAtStart.
//
// Exchange by pushing: each CTA stores its partials into slot [its rank] of every CTA's (group sums)
// or rank 0's (channel sums) shared memory, one cluster barrier (release / acquire) publishes them,
// and each CTA adds its slots in rank order from local memory. Remote stores do not wait on
// anything, and no CTA touches another's memory after the barrier, so it may exit at once.
template <int kVec, bool kChannels>
__device__ __forceinline__ void ClusterSums(float (&v)[2], const float (&first)[kVec],
                                            const float (&second)[kVec], float* channel_sums,
                                            const SlabPlan& p, const SlabPart& part) {
  constexpr int kGroupValues = kMaxLanes * 2;  // [tile group][2]
  constexpr int kChannelValues = kChannels ? kMaxLanes * kVec * 2 : 1;  // [2 * kVec][lanes]
  __shared__ float warp_groups[kWarps][kGroupValues];
  __shared__ float gathered_groups[kMaxCluster][kGroupValues];
  __shared__ float warp_channels[kWarps][kChannelValues];
  __shared__ float gathered_channels[kChannels ? kMaxCluster : 1][kChannelValues];
  const int warp = threadIdx.x / 32, warp_lane = threadIdx.x % 32;
  WarpRowSums(v, p, true);
  if (warp_lane < p.lanes && part.lane % p.group_lanes == 0) {
    warp_groups[warp][2 * part.tile_group] = v[0];
    warp_groups[warp][2 * part.tile_group + 1] = v[1];
  }
  if constexpr (kChannels) {
    float c[2 * kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      c[k] = first[k];
      c[kVec + k] = second[k];
    }
    WarpRowSums(c, p, false);
    if (warp_lane < p.lanes) {
#pragma unroll
      for (int i = 0; i < 2 * kVec; ++i) warp_channels[warp][i * p.lanes + part.lane] = c[i];
    }
  }
  __syncthreads();
  cg::cluster_group cluster = cg::this_cluster();
  cluster.barrier_wait();  // pairs with ArriveAtStart: every CTA of the cluster runs now
  if (threadIdx.x < 2 * p.tile_groups) {
    float sum = 0.f;
    for (int w = 0; w < kWarps; ++w) sum += warp_groups[w][threadIdx.x];
    for (int r = 0; r < p.cluster; ++r) {
      cluster.map_shared_rank(&gathered_groups[part.rank][threadIdx.x], r)[0] = sum;
    }
  }
  const int channel_values = 2 * kVec * p.lanes;
  if constexpr (kChannels) {
    for (int t = threadIdx.x; t < channel_values; t += kThreads) {
      float sum = 0.f;
      for (int w = 0; w < kWarps; ++w) sum += warp_channels[w][t];
      cluster.map_shared_rank(&gathered_channels[part.rank][t], 0)[0] = sum;
    }
  }
  cluster.sync();
  if constexpr (kChannels) {
    if (part.rank == 0) {
      const int64_t tile_channel = part.tile * p.tile_groups * p.shape.group_size;
      for (int t = threadIdx.x; t < channel_values; t += kThreads) {
        float sum = 0.f;
        for (int r = 0; r < p.cluster; ++r) sum += gathered_channels[r][t];
        // Value t = i * lanes + lane: sum i / kVec of channel i % kVec of vector `lane`.
        const int i = t / p.lanes, lane = t % p.lanes;
        channel_sums[(i / kVec) * p.shape.channels + tile_channel + lane * kVec + i % kVec] = sum;
      }
    }
  }
  v[0] = v[1] = 0.f;
  for (int r = 0; r < p.cluster; ++r) {
    v[0] += gathered_groups[r][2 * part.tile_group];
    v[1] += gathered_groups[r][2 * part.tile_group + 1];
  }
}

// The arrival ClusterSums waits on before its first remote store (shared memory of a CTA may only
// be written once that CTA runs). Called early so the wait costs nothing.
__device__ __forceinline__ void ArriveAtStart() { cg::this_cluster().barrier_arrive(); }

// ---------------------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) FwdOnChip(const T* __restrict__ x,
                                                         const float* __restrict__ scale,
                                                         const float* __restrict__ bias,
                                                         T* __restrict__ y, float* __restrict__ mean,
                                                         float* __restrict__ rstd, SlabPlan p,
                                                         float epsilon, int64_t activation,
                                                         float activation_param) {
  constexpr int kVec = kVec16<T>;
  using Vec = Pack<T, kVec>;
  const GroupNormShape& s = p.shape;
  const SlabPart part = SlabPartOf(p, kFwdVecs, kVec);
  Vec v[kFwdVecs];
#pragma unroll
  for (int j = 0; j < kFwdVecs; ++j) {
    if (j < part.held) v[j] = *reinterpret_cast<const Vec*>(x + part.start + j * part.stride);
  }
  ArriveAtStart();
  // Shifted sums (see GroupMoments); the shift is the group's first element.
  const float shift = ToFloat(x[part.n * s.spatial * s.channels + part.group * s.group_size]);
  float sums[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < kFwdVecs; ++j) {
    if (j >= part.held) continue;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float d = ToFloat(v[j].v[k]) - shift;
      sums[0] += d;
      sums[1] += d * d;
    }
  }
  const float unused[kVec] = {};
  ClusterSums<kVec, false>(sums, unused, unused, nullptr, p, part);
#pragma unroll
  for (int j = 0; j < kFwdVecs; ++j) Opaque(v[j]);
  float group_mean, group_rstd;
  GroupMoments(sums[0], sums[1], shift, s.spatial * s.group_size, epsilon, &group_mean, &group_rstd);
  if (part.rank == 0 && threadIdx.x < p.lanes && part.lane % p.group_lanes == 0) {
    mean[part.n * s.groups + part.group] = group_mean;
    rstd[part.n * s.groups + part.group] = group_rstd;
  }
  float a[kVec], b[kVec];  // pre-activation = (x - mean) * a + b
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    a[k] = group_rstd * scale[part.channel + k];
    b[k] = bias[part.channel + k];
  }
  const bool has_activation = activation != int64_t(Activation::kIdentity);
#pragma unroll
  for (int j = 0; j < kFwdVecs; ++j) {
    if (j >= part.held) continue;
    Vec out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float pre = (ToFloat(v[j].v[k]) - group_mean) * a[k] + b[k];
      out.v[k] = FromFloat<T>(has_activation ? ActivateKind(activation, pre, activation_param) : pre);
    }
    *reinterpret_cast<Vec*>(y + part.start + j * part.stride) = out;
  }
}

// With xhat = (x - mean) * rstd, d = dy * act'(xhat * scale + bias), g = d * scale, per group:
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)). Rank 0 of each cluster stores the cluster's
// per-channel sums of d * xhat and d to workspace[n, 0] (reduced over n into dscale/dbias by
// SumParts) and the group sums of g * xhat and g to group_sums[n, g].
template <typename T>
__global__ void __launch_bounds__(kThreads, 2) BwdOnChip(
    const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ scale,
    const float* __restrict__ bias, const float* __restrict__ mean, const float* __restrict__ rstd,
    T* __restrict__ dx, float* __restrict__ workspace, float* __restrict__ group_sums, SlabPlan p,
    int64_t activation, float activation_param) {
  constexpr int kVec = kVec16<T>;
  using Vec = Pack<T, kVec>;
  const GroupNormShape& s = p.shape;
  const SlabPart part = SlabPartOf(p, kBwdVecs, kVec);
  Vec xv[kBwdVecs], dyv[kBwdVecs];
#pragma unroll
  for (int j = 0; j < kBwdVecs; ++j) {
    if (j < part.held) {
      xv[j] = *reinterpret_cast<const Vec*>(x + part.start + j * part.stride);
      dyv[j] = *reinterpret_cast<const Vec*>(dy + part.start + j * part.stride);
    }
  }
  ArriveAtStart();
  const int64_t stat = part.n * s.groups + part.group;
  const float group_mean = mean[stat], group_rstd = rstd[stat];
  const bool has_activation = activation != int64_t(Activation::kIdentity);
  // dy * act'(pre) at element k of vector j, recomputing the pre-activation from xhat.
  auto d_of = [&](int j, int k, float xhat) {
    const float grad = ToFloat(dyv[j].v[k]);
    if (!has_activation) return grad;
    const int64_t c = part.channel + k;
    return grad * ActivateGradKind(activation, xhat * scale[c] + bias[c], activation_param);
  };
  float d_xhat[kVec] = {}, d_sum[kVec] = {};
#pragma unroll
  for (int j = 0; j < kBwdVecs; ++j) {
    if (j >= part.held) continue;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float xhat = (ToFloat(xv[j].v[k]) - group_mean) * group_rstd;
      const float d = d_of(j, k, xhat);
      d_xhat[k] += d * xhat;
      d_sum[k] += d;
    }
  }
  float sums[2] = {0.f, 0.f};  // this thread's sums of g * xhat and g
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    sums[0] += scale[part.channel + k] * d_xhat[k];
    sums[1] += scale[part.channel + k] * d_sum[k];
  }
  ClusterSums<kVec, true>(sums, d_xhat, d_sum, workspace + part.n * s.chunks * 2 * s.channels, p, part);
#pragma unroll
  for (int j = 0; j < kBwdVecs; ++j) {
    Opaque(xv[j]);
    Opaque(dyv[j]);
  }
  if (part.rank == 0 && threadIdx.x < p.lanes && part.lane % p.group_lanes == 0) {
    group_sums[2 * stat] = sums[0];
    group_sums[2 * stat + 1] = sums[1];
  }
  const float count = float(s.spatial * s.group_size);
  const float mean_g_xhat = sums[0] / count, mean_g = sums[1] / count;
#pragma unroll
  for (int j = 0; j < kBwdVecs; ++j) {
    if (j >= part.held) continue;
    Vec out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float xhat = (ToFloat(xv[j].v[k]) - group_mean) * group_rstd;
      const float g = scale[part.channel + k] * d_of(j, k, xhat);
      out.v[k] = FromFloat<T>(group_rstd * (g - mean_g - xhat * mean_g_xhat));
    }
    *reinterpret_cast<Vec*>(dx + part.start + j * part.stride) = out;
  }
}

// Launches kernel over blocks CTAs in clusters of `cluster`.
template <typename... Params, typename... Args>
ffi::Error LaunchClusters(void (*kernel)(Params...), int64_t blocks, int cluster, cudaStream_t stream,
                          const char* what, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(blocks));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = unsigned(cluster);
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  JAXDNN_RETURN_IF_ERROR(CudaError(cudaLaunchKernelEx(&config, kernel, args...), what));
  return LaunchError(what);
}

}  // namespace onchip
}  // namespace jaxdnn
