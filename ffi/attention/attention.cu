// CUDA attention handlers. bfloat16 and float16 on a Hopper GPU run the flash-attention kernels on
// tensor cores (attention_sm90_fwd.cu, attention_sm90_bwd.cu); everything else (float32, other
// devices) runs the CUDA-core kernels below, which follow the CPU kernels' algorithm
// (attention_cpu.cc) with the per-logit rules of attention_problem.h, in float32, with memory
// linear in T and S.
//
// Forward: one block of 4 warps per (b, n, tile of 16 queries); each warp owns 4 query rows. The
// keys the tile can reach (causal / window / length block skipping) stream through shared memory
// in tiles of 32, one key per lane: a lane computes its key's logit, the warp reduces the tile's
// max and sum (online softmax), and the lanes then own H / 32 output columns each and add p v.
// Traffic per block: q once, and k, v of the reached keys once per query tile (T / 16 re-reads).
// Backward (deterministic, no atomics): delta = rowsum(do o) (a group of lanes a row); dq (and dbias, each
// element written by one block) per (b, n, query tile) streaming keys as the forward; dk and dv per
// (b, kv head, tile of 16 keys), each warp owning 4 keys and the lanes 32 queries of each streamed
// query tile, over every query head of the group, so the group's sum happens in the block.
// Decoding (few query rows, many keys; every dtype and device): one pass, AttentionDecodeBwdKernel.
// Dropout scales each probability by DropoutScale (a hash of the seed and (n, t, s)) where it
// meets v (p v, and dp in the backward), so no mask is stored and the backward regenerates it.
// Head sizes up to 256: accumulators are arrays of kMaxChunks = 8 columns per lane, bounded at
// run time, so one instantiation per dtype and kernel serves every H.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attention/attention.h"
#include "attention/attention_common.h"
#include "attention/attention_problem.h"
#include "attention/attention_sm90.h"
#include "common/cuda_common.cuh"

namespace jaxdnn {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = kAttnQueryTile / kWarps;     // query rows per warp (fwd, dq)
constexpr int kKeysPerWarp = kAttnBwdKeyTile / kWarps;    // keys per warp (dk, dv)
constexpr int kMaxChunks = 8;                             // H <= 256 = 8 * 32 columns per lane
static_assert(kAttnKeyTile == 32 && kAttnBwdQueryTile == 32, "one key / query per lane");

// The decoding backward (AttentionDecodeBwdKernel) takes problems of at most kDecodeMaxRows query
// rows a kv head (G T) and at least kDecodeMinKeys keys, kDecodeKeys keys a block; its dq partials
// are the dq_accum workspace, chunks x q's size. jaxdnn/attention.py (_bwd_avals) sizes the
// workspace so where these hold and B N < 264 (fewer (b, n) rows than two an SM, where the other
// kernels' dq walks are latency-bound), and the handler takes the kernel where the workspace has
// that size.
constexpr int kDecodeMaxRows = 4;
constexpr int64_t kDecodeMinKeys = 1024;
constexpr int64_t kDecodeKeys = 256;
constexpr int kDecodeCols = 8;  // columns a lane of the decoding backward (16-byte vectors)

// Lanes a row takes when each lane loads 16-byte vectors of it: the smallest power of two >= its
// `vectors`, at most a warp (the delta and decoding kernels; H is a multiple of 8, so 16-bit and
// float32 rows are whole vectors).
__host__ __device__ inline int RowLanes(int64_t vectors) {
  int lanes = 1;
  while (lanes < 32 && lanes < vectors) lanes *= 2;
  return lanes;
}

bool DecodeBackwardTakes(const AttentionProblem& p) {
  return p.Group() * p.q_len <= kDecodeMaxRows && p.kv_len >= kDecodeMinKeys;
}

__host__ __device__ int64_t DecodeChunks(const AttentionProblem& p) {
  return (p.kv_len + kDecodeKeys - 1) / kDecodeKeys;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Copies `rows` rows of H values (global rows found by row_offset(r)) into shared memory as float32,
// `stride` floats apart (H + 1 where lanes read different rows at once: no bank conflicts).
template <typename T, typename RowOffset>
__device__ __forceinline__ void LoadTile(const T* __restrict__ x, int rows, int h, int stride, float* tile,
                                         RowOffset row_offset) {
  for (int i = threadIdx.x; i < rows * h; i += kThreads) {
    const int r = i / h, c = i % h;
    tile[r * stride + c] = ToFloat(x[row_offset(r) + c]);
  }
}

// Dot product of a row read by the whole warp (broadcast) and one read per lane.
__device__ __forceinline__ float RowDot(const float* shared_row, const float* lane_row, int h) {
  float sum = 0.f;
  for (int c = 0; c < h; ++c) sum += shared_row[c] * lane_row[c];
  return sum;
}

// Shared memory (floats) of each kernel for head size h.
inline size_t FwdSharedFloats(int h) {
  return kAttnQueryTile * h + kAttnKeyTile * (h + 1) + kAttnKeyTile * h + kWarps * kAttnKeyTile;
}
inline size_t BwdQuerySharedFloats(int h) {
  return 2 * kAttnQueryTile * h + 2 * kAttnKeyTile * (h + 1) + kWarps * kAttnKeyTile;
}
inline size_t BwdKeySharedFloats(int h) {
  return 2 * kAttnBwdKeyTile * h + 2 * kAttnBwdQueryTile * (h + 1) + 2 * kAttnBwdQueryTile +
         2 * kWarps * kAttnBwdQueryTile;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    AttentionFwdKernel(AttentionProblem p, const T* __restrict__ q, const T* __restrict__ k,
                       const T* __restrict__ v, T* __restrict__ o, float* __restrict__ lse) {
  extern __shared__ float smem[];
  const int h = static_cast<int>(p.head_dim);
  float* q_s = smem;                                  // [16][h]
  float* k_s = q_s + kAttnQueryTile * h;              // [32][h + 1]
  float* v_s = k_s + kAttnKeyTile * (h + 1);          // [32][h]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* p_s = v_s + kAttnKeyTile * h + warp * kAttnKeyTile;  // this warp's probabilities [32]

  const int64_t tiles = (p.q_len + kAttnQueryTile - 1) / kAttnQueryTile;
  const int64_t t0 = (blockIdx.x % tiles) * kAttnQueryTile;
  const int64_t n = (blockIdx.x / tiles) % p.heads, b = blockIdx.x / tiles / p.heads;
  const int64_t kh = n / p.Group();
  const int rows = static_cast<int>(p.q_len - t0 < kAttnQueryTile ? p.q_len - t0 : kAttnQueryTile);

  LoadTile(q, rows, h, h, q_s, [&](int r) { return p.QueryRow(b, t0 + r, n); });
  OnlineSoftmax softmax[kRowsPerWarp];
  float acc[kRowsPerWarp][kMaxChunks];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) acc[i][c] = 0.f;
  }
  int64_t lo, hi;
  p.KeyRange(b, t0, t0 + rows, &lo, &hi);
  for (int64_t s0 = lo; s0 < hi; s0 += kAttnKeyTile) {
    const int cols = static_cast<int>(hi - s0 < kAttnKeyTile ? hi - s0 : kAttnKeyTile);
    __syncthreads();  // the previous tile is consumed (and q_s is loaded)
    LoadTile(k, cols, h, h + 1, k_s, [&](int r) { return p.KeyRow(b, s0 + r, kh); });
    LoadTile(v, cols, h, h, v_s, [&](int r) { return p.KeyRow(b, s0 + r, kh); });
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp * kRowsPerWarp + i;
      if (r >= rows) break;
      const int64_t t = t0 + r, s = s0 + lane;
      float logit = -INFINITY;
      if (lane < cols && p.Attends(b, n, t, s)) {
        logit = p.Logit<true>(RowDot(q_s + r * h, k_s + lane * (h + 1), h), b, n, t, s);
      }
      const float factor = softmax[i].Rescale(WarpMax(logit));
      if (softmax[i].max == -INFINITY) continue;  // uniform across the warp
      const float prob = softmax[i].Prob(logit);
      softmax[i].sum += WarpSum(prob);  // the normalizer is undropped
      p_s[lane] = prob * DropoutScale(p, b, n, t, s);
      __syncwarp();
#pragma unroll
      for (int c = 0; c < kMaxChunks; ++c) {
        const int col = c * 32 + lane;
        if (col < h) {
          float sum = acc[i][c] * factor;
          for (int j = 0; j < cols; ++j) sum += p_s[j] * v_s[j * h + col];
          acc[i][c] = sum;
        }
      }
      __syncwarp();  // p_s is read before the next row overwrites it
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    if (r >= rows) break;
    const float inv_sum = softmax[i].InvSum();
    T* out = o + p.QueryRow(b, t0 + r, n);
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) {
      const int col = c * 32 + lane;
      if (col < h) out[col] = FromFloat<T>(acc[i][c] * inv_sum);
    }
    if (lane == 0) lse[p.StatIndex(b, n, t0 + r)] = softmax[i].LogSumExp();
  }
}

// delta[b, n, t] = sum over H of do * o. A warp per row with 2-byte loads left the SM issue-bound, so a group of
// `group` lanes (RowLanes, chosen by the host) takes a row, 32 / group rows a warp, each lane loading 16-byte
// vectors: one a lane for 16-bit H <= 256.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    AttentionDeltaKernel(AttentionProblem p, const T* __restrict__ d_out, const T* __restrict__ o,
                         float* __restrict__ delta, int group) {
  constexpr int kElements = kVec16<T>;
  const int group_lane = threadIdx.x % group;
  const int64_t rows = p.batch * p.q_len * p.heads;
  const int64_t row = int64_t(blockIdx.x) * (kThreads / group) + threadIdx.x / group;  // (b * T + t) * N + n
  // No early return past the last row: every lane of the warp takes part in the shuffles.
  const int loads = row < rows ? static_cast<int>(p.head_dim / kElements) : 0;
  const uint4* d_out_row = reinterpret_cast<const uint4*>(d_out + row * p.head_dim);
  const uint4* o_row = reinterpret_cast<const uint4*>(o + row * p.head_dim);
  float sum = 0.f;
  for (int i = group_lane; i < loads; i += group) {
    const uint4 d_out_raw = d_out_row[i], o_raw = o_row[i];
    const T* d_out_e = reinterpret_cast<const T*>(&d_out_raw);
    const T* o_e = reinterpret_cast<const T*>(&o_raw);
#pragma unroll
    for (int e = 0; e < kElements; ++e) sum += ToFloat(d_out_e[e]) * ToFloat(o_e[e]);
  }
  // Offsets below `group` keep the butterfly inside the (aligned) group.
  for (int offset = group / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (group_lane == 0 && row < rows) {
    const int64_t n = row % p.heads, bt = row / p.heads;
    delta[p.StatIndex(bt / p.q_len, n, bt % p.q_len)] = sum;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    AttentionBwdQueryKernel(AttentionProblem p, const T* __restrict__ d_out, const T* __restrict__ q,
                            const T* __restrict__ k, const T* __restrict__ v, const float* __restrict__ lse,
                            const float* __restrict__ delta, T* __restrict__ dq, float* __restrict__ dbias) {
  extern __shared__ float smem[];
  const int h = static_cast<int>(p.head_dim);
  float* q_s = smem;                                  // [16][h]
  float* do_s = q_s + kAttnQueryTile * h;             // [16][h]
  float* k_s = do_s + kAttnQueryTile * h;             // [32][h + 1]
  float* v_s = k_s + kAttnKeyTile * (h + 1);          // [32][h + 1]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* g_s = v_s + kAttnKeyTile * (h + 1) + warp * kAttnKeyTile;  // d logit -> d dot, per key

  const int64_t tiles = (p.q_len + kAttnQueryTile - 1) / kAttnQueryTile;
  const int64_t t0 = (blockIdx.x % tiles) * kAttnQueryTile;
  const int64_t n = (blockIdx.x / tiles) % p.heads, b = blockIdx.x / tiles / p.heads;
  const int64_t kh = n / p.Group();
  const int rows = static_cast<int>(p.q_len - t0 < kAttnQueryTile ? p.q_len - t0 : kAttnQueryTile);

  LoadTile(q, rows, h, h, q_s, [&](int r) { return p.QueryRow(b, t0 + r, n); });
  LoadTile(d_out, rows, h, h, do_s, [&](int r) { return p.QueryRow(b, t0 + r, n); });
  float acc[kRowsPerWarp][kMaxChunks];
  float row_lse[kRowsPerWarp], row_delta[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    row_lse[i] = r < rows ? lse[p.StatIndex(b, n, t0 + r)] : -INFINITY;
    row_delta[i] = r < rows ? delta[p.StatIndex(b, n, t0 + r)] : 0.f;
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) acc[i][c] = 0.f;
  }
  int64_t lo, hi;
  p.KeyRange(b, t0, t0 + rows, &lo, &hi);
  for (int64_t s0 = lo; s0 < hi; s0 += kAttnKeyTile) {
    const int cols = static_cast<int>(hi - s0 < kAttnKeyTile ? hi - s0 : kAttnKeyTile);
    __syncthreads();
    LoadTile(k, cols, h, h + 1, k_s, [&](int r) { return p.KeyRow(b, s0 + r, kh); });
    LoadTile(v, cols, h, h + 1, v_s, [&](int r) { return p.KeyRow(b, s0 + r, kh); });
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp * kRowsPerWarp + i;
      if (r >= rows) break;
      const int64_t t = t0 + r, s = s0 + lane;
      float ds = 0.f, logit = 0.f;
      if (lane < cols && p.Attends(b, n, t, s)) {
        logit = p.Logit<true>(RowDot(q_s + r * h, k_s + lane * (h + 1), h), b, n, t, s);
        const float prob = ProbFromLse(logit, row_lse[i]);
        const float dp = RowDot(do_s + r * h, v_s + lane * (h + 1), h) * DropoutScale(p, b, n, t, s);
        ds = prob * (dp - row_delta[i]);
      }
      if (dbias != nullptr && lane < cols) dbias[p.StatIndex(b, n, t) * p.kv_len + s] = ds;
      g_s[lane] = ds == 0.f ? 0.f : p.DotGrad(ds, logit, b, n, t, s);
      __syncwarp();
#pragma unroll
      for (int c = 0; c < kMaxChunks; ++c) {
        const int col = c * 32 + lane;
        if (col < h) {
          float sum = acc[i][c];
          for (int j = 0; j < cols; ++j) sum += g_s[j] * k_s[j * (h + 1) + col];
          acc[i][c] = sum;
        }
      }
      __syncwarp();
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    if (r >= rows) break;
    T* out = dq + p.QueryRow(b, t0 + r, n);
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) {
      const int col = c * 32 + lane;
      if (col < h) out[col] = FromFloat<T>(acc[i][c]);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    AttentionBwdKeyKernel(AttentionProblem p, const T* __restrict__ d_out, const T* __restrict__ q,
                          const T* __restrict__ k, const T* __restrict__ v, const float* __restrict__ lse,
                          const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv) {
  extern __shared__ float smem[];
  const int h = static_cast<int>(p.head_dim);
  float* k_s = smem;                                   // [16][h]
  float* v_s = k_s + kAttnBwdKeyTile * h;              // [16][h]
  float* q_s = v_s + kAttnBwdKeyTile * h;              // [32][h + 1]
  float* do_s = q_s + kAttnBwdQueryTile * (h + 1);     // [32][h + 1]
  float* lse_s = do_s + kAttnBwdQueryTile * (h + 1);   // [32]
  float* delta_s = lse_s + kAttnBwdQueryTile;          // [32]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* p_s = delta_s + kAttnBwdQueryTile + warp * 2 * kAttnBwdQueryTile;  // this warp's probabilities
  float* g_s = p_s + kAttnBwdQueryTile;                                       // and d dot, per query

  const int64_t tiles = (p.kv_len + kAttnBwdKeyTile - 1) / kAttnBwdKeyTile;
  const int64_t s0 = (blockIdx.x % tiles) * kAttnBwdKeyTile;
  const int64_t kh = (blockIdx.x / tiles) % p.kv_heads, b = blockIdx.x / tiles / p.kv_heads;
  const int cols = static_cast<int>(p.kv_len - s0 < kAttnBwdKeyTile ? p.kv_len - s0 : kAttnBwdKeyTile);
  const int64_t group = p.Group();

  LoadTile(k, cols, h, h, k_s, [&](int r) { return p.KeyRow(b, s0 + r, kh); });
  LoadTile(v, cols, h, h, v_s, [&](int r) { return p.KeyRow(b, s0 + r, kh); });
  float dk_acc[kKeysPerWarp][kMaxChunks], dv_acc[kKeysPerWarp][kMaxChunks];
#pragma unroll
  for (int i = 0; i < kKeysPerWarp; ++i) {
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) dk_acc[i][c] = dv_acc[i][c] = 0.f;
  }
  int64_t lo, hi;
  p.QueryRange(b, s0, s0 + cols, &lo, &hi);
  for (int64_t n = kh * group; n < (kh + 1) * group; ++n) {
    for (int64_t t0 = lo; t0 < hi; t0 += kAttnBwdQueryTile) {
      const int rows = static_cast<int>(hi - t0 < kAttnBwdQueryTile ? hi - t0 : kAttnBwdQueryTile);
      __syncthreads();
      LoadTile(q, rows, h, h + 1, q_s, [&](int r) { return p.QueryRow(b, t0 + r, n); });
      LoadTile(d_out, rows, h, h + 1, do_s, [&](int r) { return p.QueryRow(b, t0 + r, n); });
      if (threadIdx.x < rows) {
        lse_s[threadIdx.x] = lse[p.StatIndex(b, n, t0 + threadIdx.x)];
        delta_s[threadIdx.x] = delta[p.StatIndex(b, n, t0 + threadIdx.x)];
      }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kKeysPerWarp; ++i) {
        const int c_key = warp * kKeysPerWarp + i;
        if (c_key >= cols) break;
        const int64_t s = s0 + c_key, t = t0 + lane;
        float prob = 0.f, g = 0.f;
        if (lane < rows && p.Attends(b, n, t, s)) {
          const float logit = p.Logit<true>(RowDot(k_s + c_key * h, q_s + lane * (h + 1), h), b, n, t, s);
          prob = ProbFromLse(logit, lse_s[lane]);
          if (prob != 0.f) {
            const float drop = DropoutScale(p, b, n, t, s);
            const float dp = RowDot(v_s + c_key * h, do_s + lane * (h + 1), h) * drop;
            g = p.DotGrad(prob * (dp - delta_s[lane]), logit, b, n, t, s);
            prob *= drop;  // dv takes the dropped probability
          }
        }
        p_s[lane] = prob;
        g_s[lane] = g;
        __syncwarp();
#pragma unroll
        for (int c = 0; c < kMaxChunks; ++c) {
          const int col = c * 32 + lane;
          if (col < h) {
            float dk_sum = dk_acc[i][c], dv_sum = dv_acc[i][c];
            for (int j = 0; j < rows; ++j) {
              dv_sum += p_s[j] * do_s[j * (h + 1) + col];
              dk_sum += g_s[j] * q_s[j * (h + 1) + col];
            }
            dk_acc[i][c] = dk_sum;
            dv_acc[i][c] = dv_sum;
          }
        }
        __syncwarp();
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kKeysPerWarp; ++i) {
    const int c_key = warp * kKeysPerWarp + i;
    if (c_key >= cols) break;
    T* dk_out = dk + p.KeyRow(b, s0 + c_key, kh);
    T* dv_out = dv + p.KeyRow(b, s0 + c_key, kh);
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) {
      const int col = c * 32 + lane;
      if (col < h) {
        dk_out[col] = FromFloat<T>(dk_acc[i][c]);
        dv_out[col] = FromFloat<T>(dv_acc[i][c]);
      }
    }
  }
}

// ---- decoding backward (DecodeBackwardTakes) -------------------------------------------------------
// Few query rows a kv head (G T <= kDecodeMaxRows) against many keys: the dq kernels above and on
// Hopper give each (b, n, query tile) one block that walks every key, a few hundred blocks in one
// long latency-bound walk. Here one pass over k and v does everything: a block per (b, kv head,
// chunk of kDecodeKeys keys), a group of lanes per key (each lane 16-byte vectors of the row, so a
// warp has 32 / width keys' loads in flight), which computes the key's logits with the G T query
// rows (in shared memory), writes its dk and dv rows (each once, the group's rows summed in a fixed
// order) and adds ds k to the lane's dq partial. The warp's groups, then the block's warps, sum
// their partials in a fixed order into workspace[chunk] [B, T, N, H] float32, and SumSlicesKernel
// (cuda_common.cuh) adds the chunks in order: deterministic.

template <typename T>
__global__ void __launch_bounds__(kThreads)
    AttentionDecodeBwdKernel(AttentionProblem p, const T* __restrict__ d_out, const T* __restrict__ q,
                             const T* __restrict__ k, const T* __restrict__ v, const float* __restrict__ lse,
                             const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
                             float* __restrict__ dbias, float* __restrict__ dq_partials) {
  __shared__ float q_s[kDecodeMaxRows][kMaxChunks * 32], do_s[kDecodeMaxRows][kMaxChunks * 32];
  __shared__ float lse_s[kDecodeMaxRows], delta_s[kDecodeMaxRows];
  __shared__ float dq_s[kWarps][kDecodeMaxRows][kMaxChunks * 32];
  const int h = static_cast<int>(p.head_dim);
  const int64_t chunks = DecodeChunks(p);
  const int64_t chunk = blockIdx.x % chunks;
  const int64_t kh = (blockIdx.x / chunks) % p.kv_heads, b = blockIdx.x / chunks / p.kv_heads;
  const int64_t group = p.Group(), n0 = kh * group;
  const int rows = static_cast<int>(group * p.q_len);  // row r: head n0 + r / T, query r % T
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  for (int i = threadIdx.x; i < rows * h; i += kThreads) {
    const int r = i / h, c = i % h;
    const int64_t row = p.QueryRow(b, r % p.q_len, n0 + r / p.q_len) + c;
    q_s[r][c] = ToFloat(q[row]);
    do_s[r][c] = ToFloat(d_out[row]);
  }
  if (threadIdx.x < rows) {
    const int64_t stat = p.StatIndex(b, n0 + threadIdx.x / p.q_len, threadIdx.x % p.q_len);
    lse_s[threadIdx.x] = lse[stat];
    delta_s[threadIdx.x] = delta[stat];
  }
  __syncthreads();

  // A group of `width` lanes per key (a power of two, enough 16-byte vectors for the row), 32 / width
  // keys a warp at a time; lane j of a group owns the columns of vectors j, j + width, ...: at most
  // kDecodeCols columns (H <= 256 in 16-bit types: one vector; float32: up to two).
  constexpr int kVec = kVec16<T>;
  const int vectors = h / kVec;  // H is a multiple of 8
  const int width = RowLanes(vectors);
  const int per_lane = (vectors + width - 1) / width;  // vectors a lane (1 or 2)
  const int group_lane = lane % width, key_in_warp = lane / width, keys_per_warp = 32 / width;

  float dq_acc[kDecodeMaxRows][kDecodeCols];
#pragma unroll
  for (int r = 0; r < kDecodeMaxRows; ++r) {
#pragma unroll
    for (int c = 0; c < kDecodeCols; ++c) dq_acc[r][c] = 0.f;
  }
  // Column of the lane's element e (vector e / kVec), or -1 past H.
  auto column = [&](int e) {
    const int vec = (e / kVec) * width + group_lane;
    return e / kVec < per_lane && vec < vectors ? vec * kVec + e % kVec : -1;
  };
  const int64_t s_begin = chunk * kDecodeKeys;
  const int64_t s_end = s_begin + kDecodeKeys < p.kv_len ? s_begin + kDecodeKeys : p.kv_len;
  // Every lane runs every round (the group sums are shuffles); a lane past the chunk's keys has no key.
  for (int64_t s0 = s_begin + warp * keys_per_warp; s0 < s_end; s0 += kWarps * keys_per_warp) {
    const int64_t s = s0 + key_in_warp;
    const bool has_key = s < s_end;
    const T* k_row = k + p.KeyRow(b, has_key ? s : s0, kh);
    const T* v_row = v + p.KeyRow(b, has_key ? s : s0, kh);
    float k_reg[kDecodeCols], v_reg[kDecodeCols];
#pragma unroll
    for (int e0 = 0; e0 < kDecodeCols; e0 += kVec) {
      const int col = column(e0);
      uint4 k_raw = {0, 0, 0, 0}, v_raw = {0, 0, 0, 0};
      if (has_key && col >= 0) {
        k_raw = *reinterpret_cast<const uint4*>(k_row + col);
        v_raw = *reinterpret_cast<const uint4*>(v_row + col);
      }
      const T* k_e = reinterpret_cast<const T*>(&k_raw);
      const T* v_e = reinterpret_cast<const T*>(&v_raw);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        k_reg[e0 + e] = ToFloat(k_e[e]);
        v_reg[e0 + e] = ToFloat(v_e[e]);
      }
    }
    float g[kDecodeMaxRows], prob[kDecodeMaxRows];  // d dot, and the dropped probability, per row
#pragma unroll
    for (int r = 0; r < kDecodeMaxRows; ++r) {
      g[r] = prob[r] = 0.f;
      if (r >= rows) continue;
      float qk = 0.f, dov = 0.f;
#pragma unroll
      for (int e = 0; e < kDecodeCols; ++e) {
        const int col = column(e);
        if (col >= 0) {
          qk += q_s[r][col] * k_reg[e];
          dov += do_s[r][col] * v_reg[e];
        }
      }
      for (int offset = width / 2; offset > 0; offset /= 2) {  // the group's sums, in a fixed order
        qk += __shfl_xor_sync(0xffffffffu, qk, offset);
        dov += __shfl_xor_sync(0xffffffffu, dov, offset);
      }
      if (!has_key) continue;
      const int64_t n = n0 + r / p.q_len, t = r % p.q_len;
      float ds = 0.f, logit = 0.f;
      if (p.Attends(b, n, t, s)) {
        logit = p.Logit<true>(qk, b, n, t, s);
        const float pr = ProbFromLse(logit, lse_s[r]);
        const float drop = DropoutScale(p, b, n, t, s);
        ds = pr * (dov * drop - delta_s[r]);
        prob[r] = pr * drop;
      }
      if (dbias != nullptr && group_lane == 0) dbias[p.StatIndex(b, n, t) * p.kv_len + s] = ds;
      g[r] = ds == 0.f ? 0.f : p.DotGrad(ds, logit, b, n, t, s);
    }
    T* dk_row = dk + p.KeyRow(b, has_key ? s : s0, kh);
    T* dv_row = dv + p.KeyRow(b, has_key ? s : s0, kh);
#pragma unroll
    for (int e0 = 0; e0 < kDecodeCols; e0 += kVec) {
      const int col = column(e0);
      alignas(16) T dk_e[kVec], dv_e[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        float dk_sum = 0.f, dv_sum = 0.f;
#pragma unroll
        for (int r = 0; r < kDecodeMaxRows; ++r) {
          if (r >= rows || col < 0) continue;
          dk_sum += g[r] * q_s[r][col + e];
          dv_sum += prob[r] * do_s[r][col + e];
          dq_acc[r][e0 + e] += g[r] * k_reg[e0 + e];
        }
        dk_e[e] = FromFloat<T>(dk_sum);
        dv_e[e] = FromFloat<T>(dv_sum);
      }
      if (has_key && col >= 0) {
        *reinterpret_cast<uint4*>(dk_row + col) = *reinterpret_cast<const uint4*>(dk_e);
        *reinterpret_cast<uint4*>(dv_row + col) = *reinterpret_cast<const uint4*>(dv_e);
      }
    }
  }

  // The warp's groups' partials summed (a fixed butterfly), then written by group 0.
#pragma unroll
  for (int r = 0; r < kDecodeMaxRows; ++r) {
#pragma unroll
    for (int e = 0; e < kDecodeCols; ++e) {
      for (int offset = width; offset < 32; offset *= 2) {
        dq_acc[r][e] += __shfl_xor_sync(0xffffffffu, dq_acc[r][e], offset);
      }
      const int col = column(e);
      if (key_in_warp == 0 && r < rows && col >= 0) dq_s[warp][r][col] = dq_acc[r][e];
    }
  }
  __syncthreads();
  float* out = dq_partials + chunk * p.batch * p.q_len * p.heads * p.head_dim;
  for (int i = threadIdx.x; i < rows * h; i += kThreads) {
    const int r = i / h, c = i % h;
    float sum = 0.f;
    for (int w = 0; w < kWarps; ++w) sum += dq_s[w][r][c];
    out[p.QueryRow(b, r % p.q_len, n0 + r / p.q_len) + c] = sum;
  }
}

// Launches `kernel` on `blocks` blocks with `floats` floats of dynamic shared memory (opting in
// beyond 48 KiB); no launch for an empty grid.
template <typename Kernel, typename... Args>
ffi::Error Launch(const char* name, Kernel kernel, int64_t blocks, size_t floats, cudaStream_t stream,
                  Args... args) {
  if (blocks == 0) return ffi::Error::Success();
  if (blocks > 0x7fffffff) return InvalidArgument(std::string("attention: too many blocks for ") + name);
  const size_t bytes = floats * sizeof(float);
  JAXDNN_RETURN_IF_ERROR(CudaError(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)), name));
  kernel<<<static_cast<unsigned>(blocks), kThreads, bytes, stream>>>(args...);
  return LaunchError(name);
}

ffi::Error CheckHeadDim(const AttentionProblem& p) {
  if (p.head_dim > kMaxChunks * 32) {
    return InvalidArgument("attention: the CUDA kernels take head sizes up to 256, got " +
                           std::to_string(p.head_dim));
  }
  return ffi::Error::Success();
}

template <typename T>
ffi::Error AttentionFwdTyped(cudaStream_t stream, const AttentionProblem& p, const ffi::AnyBuffer& q,
                             const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, ffi::AnyBuffer& o, float* lse) {
  const int64_t blocks = (p.q_len + kAttnQueryTile - 1) / kAttnQueryTile * p.heads * p.batch;
  return Launch("AttentionFwdKernel", AttentionFwdKernel<T>, blocks, FwdSharedFloats(int(p.head_dim)), stream, p,
                static_cast<const T*>(q.untyped_data()), static_cast<const T*>(k.untyped_data()),
                static_cast<const T*>(v.untyped_data()), static_cast<T*>(o.untyped_data()), lse);
}

// The backward's workspace results, and whether the Hopper kernels run.
struct BwdWorkspace {
  float* delta;     // [B, N, T]
  bool sm90;
  bool decode;      // AttentionDecodeBwdKernel
  float* dq_accum;  // attention_sm90.h, or the decoding kernel's dq partials
  int* semaphores;  // attention_sm90.h; null: unordered adds
};

template <typename T>
ffi::Error AttentionBwdTyped(cudaStream_t stream, const AttentionProblem& p, ffi::DataType dtype, const T* d_out,
                             const T* q, const T* k, const T* v, const T* o, const float* lse, T* dq, T* dk, T* dv,
                             float* dbias, const BwdWorkspace& workspace) {
  float* delta = workspace.delta;
  const int64_t rows = p.batch * p.q_len * p.heads;
  const int group = RowLanes(p.head_dim / kVec16<T>);
  const int64_t rows_per_block = kThreads / group;
  JAXDNN_RETURN_IF_ERROR(Launch("AttentionDeltaKernel", AttentionDeltaKernel<T>,
                                (rows + rows_per_block - 1) / rows_per_block, 0, stream, p, d_out, o, delta, group));
  if (workspace.decode) {
    const int64_t chunks = DecodeChunks(p);
    JAXDNN_RETURN_IF_ERROR(Launch("AttentionDecodeBwdKernel", AttentionDecodeBwdKernel<T>,
                                  chunks * p.kv_heads * p.batch, 0, stream, p, d_out, q, k, v, lse,
                                  static_cast<const float*>(delta), dk, dv, dbias, workspace.dq_accum));
    const int64_t elements = p.batch * p.q_len * p.heads * p.head_dim;
    return Launch("decoding dq: sum of chunks", SumSlicesKernel<T>,
                  std::min<int64_t>((elements + kThreads - 1) / kThreads, 4096), 0, stream,
                  static_cast<const float*>(workspace.dq_accum), chunks, elements, dq);
  }
  if (workspace.sm90) {
    return attention_sm90::AttentionBwdSm90(stream, p, dtype, d_out, q, k, v, lse, delta, dq, dk, dv, dbias,
                                            workspace.dq_accum, workspace.semaphores);
  }
  const int64_t query_blocks = (p.q_len + kAttnQueryTile - 1) / kAttnQueryTile * p.heads * p.batch;
  JAXDNN_RETURN_IF_ERROR(Launch("AttentionBwdQueryKernel", AttentionBwdQueryKernel<T>, query_blocks,
                                BwdQuerySharedFloats(int(p.head_dim)), stream, p, d_out, q, k, v, lse,
                                static_cast<const float*>(delta), dq, dbias));
  const int64_t key_blocks = (p.kv_len + kAttnBwdKeyTile - 1) / kAttnBwdKeyTile * p.kv_heads * p.batch;
  return Launch("AttentionBwdKeyKernel", AttentionBwdKeyKernel<T>, key_blocks, BwdKeySharedFloats(int(p.head_dim)),
                stream, p, d_out, q, k, v, lse, static_cast<const float*>(delta), dk, dv);
}

ffi::Error AttentionFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_lens,
                            ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_seg,
                            ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::U32> dropout_seed,
                            ffi::Result<ffi::AnyBuffer> o,
                            ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale, float soft_cap,
                            int64_t causal, int64_t window_left, int64_t window_right, int64_t present,
                            int64_t dropout_keep, int64_t dropout_heads) {
  AttentionProblem p;
  JAXDNN_RETURN_IF_ERROR(MakeAttentionProblem(
      {&q, &k, &v, &bias, &mask, &q_lens, &kv_lens, &q_seg, &kv_seg, &dropout_seed, scale, soft_cap, causal,
       window_left, window_right, present, dropout_keep, dropout_heads}, &p));
  JAXDNN_RETURN_IF_ERROR(CheckHeadDim(p));
  JAXDNN_RETURN_IF_ERROR(ExpectLike("o", *o, q));
  JAXDNN_RETURN_IF_ERROR(ExpectStat("lse", lse->dimensions(), p));
  if (ElementCount(q.dimensions()) == 0) return ffi::Error::Success();
  if (attention_sm90::Sm90Takes(p, q.element_type())) {
    return attention_sm90::AttentionFwdSm90(stream, p, q.element_type(), q.untyped_data(), k.untyped_data(),
                                            v.untyped_data(), o->untyped_data(), lse->typed_data());
  }
  return DispatchFloat<float, __nv_bfloat16, __half>(q.element_type(), "q", [&](auto tag) {
    return AttentionFwdTyped<decltype(tag)>(stream, p, q, k, v, *o, lse->typed_data());
  });
}

ffi::Error AttentionBwdImpl(cudaStream_t stream, ffi::AnyBuffer d_out, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse,
                            ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_lens,
                            ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_seg,
                            ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::U32> dropout_seed,
                            ffi::Result<ffi::AnyBuffer> dq,
                            ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                            ffi::Result<ffi::Buffer<ffi::F32>> dbias, ffi::Result<ffi::Buffer<ffi::F32>> delta,
                            ffi::Result<ffi::Buffer<ffi::F32>> dq_accum, ffi::Result<ffi::Buffer<ffi::S32>> semaphores,
                            float scale, float soft_cap, int64_t causal, int64_t window_left,
                            int64_t window_right, int64_t present, int64_t dropout_keep, int64_t dropout_heads,
                            int64_t bias_grad) {
  AttentionProblem p;
  JAXDNN_RETURN_IF_ERROR(MakeAttentionProblem(
      {&q, &k, &v, &bias, &mask, &q_lens, &kv_lens, &q_seg, &kv_seg, &dropout_seed, scale, soft_cap, causal,
       window_left, window_right, present, dropout_keep, dropout_heads}, &p));
  JAXDNN_RETURN_IF_ERROR(CheckHeadDim(p));
  JAXDNN_RETURN_IF_ERROR(CheckAttentionBwd(p, d_out, q, k, o, lse.dimensions(), *dq, *dk, *dv, dbias->dimensions(),
                                           delta->dimensions(), bias_grad));
  // dbias entries of keys a query tile never reaches stay 0.
  if (dbias->element_count() > 0) {
    JAXDNN_RETURN_IF_ERROR(
        CudaError(cudaMemsetAsync(dbias->typed_data(), 0, dbias->size_bytes(), stream), "cudaMemsetAsync"));
  }
  const bool sm90 = attention_sm90::Sm90Takes(p, q.element_type());
  // The decoding kernel where the workspace was sized for it (not under a symbolic T or S).
  const bool decode = DecodeBackwardTakes(p) &&
                      dq_accum->element_count() == DecodeChunks(p) * ElementCount(q.dimensions());
  // The fused kernel's workspaces: dq_accum, and semaphores ordering its adds, or none (unordered).
  if (!decode && sm90 && attention_sm90::FusedBackwardTakes(p) &&
      (dq_accum->element_count() != ElementCount(q.dimensions()) ||
       (semaphores->element_count() != 0 &&
        semaphores->element_count() != attention_sm90::FusedBackwardSemaphores(p)))) {
    return InvalidArgument("attention: the backward's dq_accum workspace has " +
                           std::to_string(dq_accum->element_count()) + " elements and semaphores " +
                           std::to_string(semaphores->element_count()) + ", expected q's " +
                           std::to_string(ElementCount(q.dimensions())) + " and 0 or " +
                           std::to_string(attention_sm90::FusedBackwardSemaphores(p)));
  }
  return DispatchFloat<float, __nv_bfloat16, __half>(q.element_type(), "q", [&](auto tag) {
    using T = decltype(tag);
    auto in = [](const ffi::AnyBuffer& x) { return static_cast<const T*>(x.untyped_data()); };
    auto out = [](ffi::Result<ffi::AnyBuffer>& x) { return static_cast<T*>(x->untyped_data()); };
    const BwdWorkspace workspace{delta->typed_data(), sm90, decode, dq_accum->typed_data(),
                                 semaphores->element_count() > 0 ? semaphores->typed_data() : nullptr};
    return AttentionBwdTyped<T>(stream, p, q.element_type(), in(d_out), in(q), in(k), in(v), in(o),
                                lse.typed_data(), out(dq), out(dk), out(dv),
                                bias_grad != 0 ? dbias->typed_data() : nullptr, workspace);
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionFwdCuda, jaxdnn::AttentionFwdImpl,
                              jaxdnn::BindAttentionFwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionBwdCuda, jaxdnn::AttentionBwdImpl,
                              jaxdnn::BindAttentionBwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
