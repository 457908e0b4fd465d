// Row-wise kernels: a row is handled by a group of `group` threads (a power of two from 32 to
// kMaxGroup): a warp for short rows, the whole block for long ones. Shared by every family whose
// kernels reduce along rows (norms, softmax, ...).
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/cuda_common.cuh"

namespace jaxdnn {

constexpr int kMaxGroup = 1024;  // threads per row at most

struct RowGroup {
  int64_t row;  // this group's row (one row per group and launch)
  int lane;     // thread index within the group
  int index;    // group index within the block
  int count;    // groups per block
};

__device__ __forceinline__ RowGroup MakeRowGroup(int group) {
  RowGroup g;
  g.lane = threadIdx.x % group;
  g.index = threadIdx.x / group;
  g.count = blockDim.x / group;
  g.row = int64_t(blockIdx.x) * g.count + g.index;
  return g;
}

// `value` exchanged with the lane `offset` away (xor), field by field (V holds 4-byte fields only).
template <typename V>
__device__ __forceinline__ V ShuffleXor(V value, int offset) {
  static_assert(sizeof(V) % 4 == 0, "V must consist of 4-byte fields");
  constexpr int kWords = sizeof(V) / 4;
  int words[kWords];
  memcpy(words, &value, sizeof(V));
#pragma unroll
  for (int i = 0; i < kWords; ++i) words[i] = __shfl_xor_sync(0xffffffffu, words[i], offset);
  memcpy(&value, words, sizeof(V));
  return value;
}

template <typename V, typename Op>
__device__ __forceinline__ V WarpReduce(V value, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value = op(value, ShuffleXor(value, offset));
  return value;
}

// Reduces `value` over the `group` threads of a row with the associative `op`; every thread of the
// group gets the result. Groups wider than a warp span the whole block (one row per block), so the
// block barriers are uniform: the warps' results are combined in a tree in warp 0. `identity` is
// op's neutral element.
template <typename V, typename Op>
__device__ __forceinline__ V GroupReduce(V value, int group, V identity, Op op) {
  __shared__ V partial[kMaxGroup / 32];
  value = WarpReduce(value, op);
  if (group <= 32) return value;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = WarpReduce(lane < group / 32 ? partial[lane] : identity, op);
    if (lane == 0) partial[0] = value;
  }
  __syncthreads();
  value = partial[0];
  __syncthreads();  // `partial` is reused by the next reduction
  return value;
}

// kN float sums over a row's group.
template <int kN>
struct Sums {
  float v[kN];
};

template <int kN>
__device__ __forceinline__ void GroupSum(float (&v)[kN], int group) {
  Sums<kN> s;
#pragma unroll
  for (int i = 0; i < kN; ++i) s.v[i] = v[i];
  s = GroupReduce(s, group, Sums<kN>{}, [](Sums<kN> a, const Sums<kN>& b) {
#pragma unroll
    for (int i = 0; i < kN; ++i) a.v[i] += b.v[i];
    return a;
  });
#pragma unroll
  for (int i = 0; i < kN; ++i) v[i] = s.v[i];
}

}  // namespace jaxdnn

namespace jaxdnn {

constexpr int kRowIters = 4;          // 16-byte vectors a thread holds in the register-cached kernels
constexpr int kWarpRowsBlock = 256;   // block size when a warp handles a row

// How a row-wise kernel covers rows of `features` elements of T. Register-cached: rows that are a
// multiple of a 16-byte vector and fit in kRowIters vectors a thread; a warp per row when that is
// enough (`warp_rows_block` threads a block), else the smallest power-of-two group that covers the
// row, one row per block. Otherwise streaming: one row per block, any length, re-read per pass.
struct RowPlan {
  bool cached;
  int group;  // threads per row
  int block;  // threads per block
};

template <typename T>
RowPlan MakeRowPlan(int64_t features, int warp_rows_block = kWarpRowsBlock) {
  constexpr int kVec = kVec16<T>;
  RowPlan plan;
  plan.cached = features % kVec == 0 && features <= int64_t(kMaxGroup) * kVec * kRowIters;
  if (plan.cached) {
    plan.group = 32;
    while (int64_t(plan.group) * kVec * kRowIters < features) plan.group *= 2;
    plan.block = plan.group > 32 ? plan.group : warp_rows_block;
  } else {
    plan.group = plan.block = int(std::min<int64_t>(kMaxGroup, (features + 31) / 32 * 32));
  }
  return plan;
}

// Blocks that give every row its group, one row per group.
inline int64_t RowGrid(const RowPlan& plan, int64_t rows) {
  const int64_t rows_per_block = plan.block / plan.group;
  return (rows + rows_per_block - 1) / rows_per_block;
}

}  // namespace jaxdnn
