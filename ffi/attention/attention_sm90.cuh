// What the Hopper flash-attention kernels (attention_sm90_fwd.cu, attention_sm90_bwd.cu) share:
// the per-logit rules in the two forms the kernels take them, the position of a thread's
// accumulator elements, quad reductions, and the TMA tensor maps of q/k/v/do.
//
// Every kernel has one producer warpgroup (a thread issuing TMA tile loads into a ring of
// shared-memory stages, each stage guarded by a "full" and an "empty" mbarrier) and two consumer
// warpgroups issuing wgmma on the tiles (64 rows of the product each) with the softmax between
// the products in registers. Operand tiles are 64-column chunks of 128-byte rows, swizzled by TMA
// (common/sm90_async.cuh); head sizes that are not a multiple of 64 run on the next one, the
// columns past H zero-filled by TMA and never stored.
#pragma once

#include <cuda.h>

#include <cmath>
#include <cstdint>

#include "attention/attention_problem.h"
#include "common/cuda_common.cuh"
#include "common/sm90_async.cuh"

namespace jaxdnn {
namespace attention_sm90 {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kWarpgroup = 128;
constexpr int kThreads = 3 * kWarpgroup;  // producer + two consumers
// Registers a thread after reallocation: the producer gives its share to the consumers
// (128 * 24 + 256 * 240 <= 64K).
constexpr int kProducerRegisters = 24;
constexpr int kConsumerRegisters = 240;

// The head size a kernel is built for: H rounded up to 64, 128 or 256.
inline int PaddedHeadDim(int64_t h) { return h <= 64 ? 64 : h <= 128 ? 128 : 256; }

// Bias, mask, segment ids, soft cap and dropout make a logit's rules per element (AttentionProblem's
// Attends, Logit, DotGrad and DropoutScale, with their global-memory reads); without them the logit
// is scale q.k and the rules are index comparisons (IndexRules), skipped on the tiles they do not cut.
inline bool NeedsGeneralRules(const AttentionProblem& p) {
  return p.bias != nullptr || p.mask != nullptr || p.q_seg != nullptr || p.soft_cap > 0.f ||
         p.dropout_seed != nullptr;
}

// The causal / window / key-length rules of one batch element, in 32-bit indices.
struct IndexRules {
  int key_limit;    // keys s >= key_limit do not take part
  bool causal;      // s <= t
  int left, right;  // t - left <= s <= t + right; -1: unbounded

  __device__ IndexRules(const AttentionProblem& p, int64_t b)
      : key_limit(int(p.KeyLimit(b))), causal(p.causal), left(int(p.window_left)), right(int(p.window_right)) {}

  // Bitwise, not short-circuit: a predicate, not a branch per element.
  __device__ bool Attends(int t, int s) const {
    return (s < key_limit) & (!causal | (s <= t)) & ((left < 0) | (s >= t - left)) & ((right < 0) | (s <= t + right));
  }
  // Whether every query of [t0, t1) attends every key of [s0, s1): the tile needs no per-element test.
  __device__ bool Whole(int t0, int t1, int s0, int s1) const {
    return s1 <= key_limit && (!causal || s1 - 1 <= t0) && (right < 0 || s1 - 1 <= t0 + right) &&
           (left < 0 || s0 >= t1 - 1 - left);
  }
};

// Row t's lse in log2 units for the backward's p = exp2(logit log2(e) - it): +inf for a row past T
// or with no key (lse -inf), so that its p is 0.
__device__ __forceinline__ float RowLse2(const AttentionProblem& p, const float* lse, int64_t b, int64_t n, int t) {
  const float l = t < p.q_len ? lse[p.StatIndex(b, n, t)] : -INFINITY;
  return l == -INFINITY ? INFINITY : l * kLog2e;
}

// The rows and columns of a thread's accumulator elements in its warpgroup's 64 x N tile (the layout
// of sm90::Wgmma): element i is at row Row(i), column Col(i).
struct Fragment {
  int row;  // the first of the thread's two rows (the second is row + 8)
  int col;  // the thread's first column in each group of 8
  __device__ explicit Fragment(int thread) : row(16 * (thread / 32) + thread % 32 / 4), col(2 * (thread % 4)) {}
  static __device__ __forceinline__ int Half(int i) { return (i >> 1) & 1; }
  __device__ __forceinline__ int Row(int i) const { return row + 8 * Half(i); }
  __device__ __forceinline__ int Col(int i) const { return col + 8 * (i >> 2) + (i & 1); }
};

// The work of a query-tile CTA (the forward, dq): its tile of kRows queries (blockIdx.x runs over
// the tiles of a head fastest, later and, under a causal mask, heavier tiles first), head n, batch
// element b, kv head, and the key tiles it streams: [first, first + key_tiles kKeys), the keys its
// queries can reach (causal, window and length block skipping) aligned to kKeys.
struct QueryTileWork {
  int t0, rows;
  int64_t n, b, kh;
  int first, key_tiles;

  template <int kRows, int kKeys>
  static __device__ QueryTileWork Of(const AttentionProblem& p) {
    QueryTileWork w;
    const int tiles = int((p.q_len + kRows - 1) / kRows);
    w.t0 = (tiles - 1 - int(blockIdx.x % tiles)) * kRows;
    w.rows = int(p.q_len - w.t0 < kRows ? p.q_len - w.t0 : kRows);
    w.n = (blockIdx.x / tiles) % p.heads;
    w.b = blockIdx.x / tiles / p.heads;
    w.kh = w.n / p.Group();
    int64_t lo, hi;
    p.KeyRange(w.b, w.t0, w.t0 + w.rows, &lo, &hi);
    w.first = lo < hi ? int(lo - lo % kKeys) : 0;
    w.key_tiles = lo < hi ? int((hi - w.first + kKeys - 1) / kKeys) : 0;
    return w;
  }
};

// Reductions over the 4 threads that hold one row (lanes 4r .. 4r + 3).
__device__ __forceinline__ float QuadMax(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float QuadSum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Accumulator elements [8 kk, 8 kk + 8) as the A fragment of the k-slice kk of the next product (the
// accumulator's columns 16 kk .. 16 kk + 15 are that slice's reduction axis).
template <typename T, int kCount>
__device__ __forceinline__ void ToOperand(const float (&acc)[kCount], uint32_t (&frag)[kCount / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < kCount / 8; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) frag[kk][r] = sm90::PackPair<T>(acc[8 * kk + 2 * r], acc[8 * kk + 2 * r + 1]);
  }
}

template <int kCount>
__device__ __forceinline__ void Zero(float (&acc)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) acc[i] = 0.f;
}

// Writes the thread's elements of a 64 x kCols accumulator tile, times row_scale[half], as 16-bit
// pairs to rows [0, rows) and columns [0, cols) of a row-major array (row r at out + r * stride).
template <typename T, int kCount>
__device__ __forceinline__ void StoreTile(const float (&acc)[kCount], const Fragment& f, const float (&row_scale)[2],
                                          T* out, int64_t stride, int rows, int cols) {
#pragma unroll
  for (int i = 0; i < kCount; i += 2) {
    const int r = f.Row(i), c = f.Col(i);
    if (r < rows && c < cols) {
      const float scale = row_scale[Fragment::Half(i)];
      *reinterpret_cast<uint32_t*>(out + r * stride + c) = sm90::PackPair<T>(acc[i] * scale, acc[i + 1] * scale);
    }
  }
}

// The tensor map of a [B, L, heads, H] array of 16-bit values (q, o, do: L = T; k, v: L = S) or
// float32 ones (the backward's dq_accum) whose box is one 128-byte chunk of columns (64 16-bit
// values or 32 floats) of `rows` consecutive positions of one head: coordinates (column, head,
// position, batch). Columns past H and positions past L read as zeros (and are not written).
inline CUresult MakeTileMap(CUtensorMap* map, const void* data, CUtensorMapDataType type, int64_t batch, int64_t len,
                            int64_t heads, int64_t head_dim, int rows) {
  const int64_t bytes = type == CU_TENSOR_MAP_DATA_TYPE_FLOAT32 ? 4 : 2;
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(heads), cuuint64_t(len), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {cuuint64_t(head_dim * bytes), cuuint64_t(heads * head_dim * bytes),
                                 cuuint64_t(len * heads * head_dim * bytes)};
  const cuuint32_t box[4] = {cuuint32_t(128 / bytes), 1, cuuint32_t(rows), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return cuTensorMapEncodeTiled(map, type, 4, const_cast<void*>(data), dims, strides, box, element_strides,
                                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

}  // namespace attention_sm90
}  // namespace jaxdnn
