// Hopper flash-attention backward on wgmma, deterministic (no atomics): two kernels after
// delta = rowsum(do o) (attention.cu).
//
// dq: one CTA per (b, n, tile of 128 queries), the forward's structure. Per key tile:
//   s = q k^T and dp = do v^T (SS wgmma), p = exp(logit - lse), ds = p (dp - delta) (times the
//   logit's derivative: scale, and the soft cap's), dq += ds k (RS: ds from registers, k's tile as
//   the MN-major operand). With a differentiated bias, ds is also dbias (each element written once).
// dk, dv: one CTA per (b, kv head, tile of keys). Its k and v tiles stay in shared memory while the
//   queries of every head of the group stream through stages (q, do, and the rows' lse and delta).
//   Per query tile, transposed so that the keys are the rows: s^T = k q^T and dp^T = v do^T (SS),
//   p^T and ds^T as above, dv += p^T do and dk += ds^T q (RS: q and do tiles as MN-major operands).
//   The group's query heads are summed in the CTA, in a fixed order.
// Head size 256 keeps dk and dv (128 floats a thread each for 64 keys) within the registers by
// splitting the head's columns between the two consumer warpgroups, which then both compute s^T and
// dp^T of the same 64 keys.
#include "attention/attention_sm90.h"
#include "attention/attention_sm90.cuh"

namespace jaxdnn {
namespace attention_sm90 {
namespace {

// ---- dq -------------------------------------------------------------------------------------------

template <int kHeadDim>
struct DqTile {
  static constexpr int kRows = 128;                       // queries a CTA, 64 per consumer warpgroup
  static constexpr int kKeys = kHeadDim == 256 ? 32 : 64;  // keys a stage
  static constexpr int kStages = 2;
  static constexpr int kChunks = kHeadDim / 64;
  static constexpr int kQBytes = kRows * kHeadDim * 2;     // q, and do
  static constexpr int kKVBytes = kKeys * kHeadDim * 2;    // one k or v stage
  static constexpr int kBarrierOffset = 2 * kQBytes + 2 * kStages * kKVBytes;
  static constexpr int kSharedBytes = kBarrierOffset + 8 * (1 + 2 * kStages) + 1024;
};

template <typename T, int kHeadDim, bool kGeneral>
__global__ void __launch_bounds__(kThreads, 1)
    AttentionDqKernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap do_map,
                      const __grid_constant__ CUtensorMap k_map, const __grid_constant__ CUtensorMap v_map,
                      const AttentionProblem p, const float* __restrict__ lse, const float* __restrict__ delta,
                      T* __restrict__ dq, float* __restrict__ dbias) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tile = DqTile<kHeadDim>;
  extern __shared__ uint8_t shared_raw[];
  uint8_t* shared = AlignedShared(shared_raw);
  T* q_s = reinterpret_cast<T*>(shared);                        // [chunk][128][64]
  T* do_s = reinterpret_cast<T*>(shared + Tile::kQBytes);       // [chunk][128][64]
  T* k_s = reinterpret_cast<T*>(shared + 2 * Tile::kQBytes);    // [stage][chunk][kKeys][64]
  T* v_s = k_s + Tile::kStages * Tile::kKVBytes / 2;
  uint64_t* q_full = reinterpret_cast<uint64_t*>(shared + Tile::kBarrierOffset);
  uint64_t* kv_full = q_full + 1;
  uint64_t* kv_empty = kv_full + Tile::kStages;
  constexpr int kStageElems = Tile::kKVBytes / 2;

  const int tiles = int((p.q_len + Tile::kRows - 1) / Tile::kRows);
  const int tile = tiles - 1 - int(blockIdx.x % tiles);
  const int64_t n = (blockIdx.x / tiles) % p.heads, b = blockIdx.x / tiles / p.heads;
  const int64_t kh = n / p.Group();
  const int t0 = tile * Tile::kRows;
  const int rows = int(p.q_len - t0 < Tile::kRows ? p.q_len - t0 : Tile::kRows);
  int64_t lo, hi;
  p.KeyRange(b, t0, t0 + rows, &lo, &hi);
  const int first = lo < hi ? int(lo - lo % Tile::kKeys) : 0;
  const int key_tiles = lo < hi ? int((hi - first + Tile::kKeys - 1) / Tile::kKeys) : 0;

  const int warpgroup = threadIdx.x / kWarpgroup;
  if (threadIdx.x == 0) {
    sm90::BarrierInit(q_full, 1);
    for (int s = 0; s < Tile::kStages; ++s) {
      sm90::BarrierInit(&kv_full[s], 1);
      sm90::BarrierInit(&kv_empty[s], 2 * kWarpgroup);
    }
    sm90::BarrierInitFence();
  }
  __syncthreads();

  if (warpgroup == 0) {  // producer
    sm90::RegistersDecrease<kProducerRegisters>();
    if (threadIdx.x != 0) return;
    sm90::BarrierArriveExpectTx(q_full, 2 * Tile::kQBytes);
    for (int c = 0; c < Tile::kChunks; ++c) {
      sm90::TmaLoad4d(q_s + c * Tile::kRows * 64, &q_map, q_full, 64 * c, int(n), t0, int(b));
      sm90::TmaLoad4d(do_s + c * Tile::kRows * 64, &do_map, q_full, 64 * c, int(n), t0, int(b));
    }
    for (int j = 0; j < key_tiles; ++j) {
      const int stage = j % Tile::kStages;
      const int s0 = first + j * Tile::kKeys;
      sm90::BarrierWait(&kv_empty[stage], ((j / Tile::kStages) & 1) ^ 1);
      sm90::BarrierArriveExpectTx(&kv_full[stage], 2 * Tile::kKVBytes);
      for (int c = 0; c < Tile::kChunks; ++c) {
        const int offset = stage * kStageElems + c * Tile::kKeys * 64;
        sm90::TmaLoad4d(k_s + offset, &k_map, &kv_full[stage], 64 * c, int(kh), s0, int(b));
        sm90::TmaLoad4d(v_s + offset, &v_map, &kv_full[stage], 64 * c, int(kh), s0, int(b));
      }
    }
    return;
  }

  sm90::RegistersIncrease<kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const Fragment f(threadIdx.x % kWarpgroup);
  const int tw = t0 + 64 * consumer;
  const IndexRules rules(p, b);
  const float scale_log2 = p.scale * kLog2e;
  // Per row: lse in log2 units (+inf for a row with no key or past T: p = 0), delta.
  float row_lse[2], row_delta[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int t = tw + f.row + 8 * h;
    const float l = t < p.q_len ? lse[p.StatIndex(b, n, t)] : -INFINITY;
    row_lse[h] = l == -INFINITY ? INFINITY : l * kLog2e;
    row_delta[h] = t < p.q_len ? delta[p.StatIndex(b, n, t)] : 0.f;
  }

  float dq_acc[kHeadDim / 2];
  Zero(dq_acc);
  sm90::BarrierWait(q_full, 0);
  for (int j = 0; j < key_tiles; ++j) {
    const int stage = j % Tile::kStages;
    const int s0 = first + j * Tile::kKeys;
    const T* k_stage = k_s + stage * kStageElems;
    const T* v_stage = v_s + stage * kStageElems;

    float s_acc[Tile::kKeys / 2], dp_acc[Tile::kKeys / 2];
    sm90::BarrierWait(&kv_full[stage], (j / Tile::kStages) & 1);
    sm90::WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const int chunk = kk / 4, step = kk % 4;
      const int a_offset = chunk * Tile::kRows * 64 + consumer * 64 * 64 + step * 16;
      const int b_offset = chunk * Tile::kKeys * 64 + step * 16;
      sm90::Wgmma<Tile::kKeys, T>::template SS<0>(s_acc, sm90::DescriptorKMajor(q_s + a_offset),
                                                  sm90::DescriptorKMajor(k_stage + b_offset), kk > 0);
      sm90::Wgmma<Tile::kKeys, T>::template SS<0>(dp_acc, sm90::DescriptorKMajor(do_s + a_offset),
                                                  sm90::DescriptorKMajor(v_stage + b_offset), kk > 0);
    }
    sm90::WgmmaCommit();
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(s_acc);
    sm90::FenceRegisters(dp_acc);

    const bool whole = !kGeneral && rules.Whole(tw, tw + 64, s0, s0 + Tile::kKeys);
#pragma unroll
    for (int i = 0; i < Tile::kKeys / 2; ++i) {
      const int t = tw + f.Row(i), s = s0 + f.Col(i);
      const int h = Fragment::Half(i);
      float grad = 0.f;  // d loss / d (q.k)
      if constexpr (kGeneral) {
        if (p.Attends(b, n, t, s)) {
          const float logit = p.Logit(s_acc[i], b, n, t, s);
          const float prob = exp2f(logit * kLog2e - row_lse[h]);
          const float ds = prob * (dp_acc[i] * DropoutScale(p, b, n, t, s) - row_delta[h]);
          if (dbias != nullptr) dbias[p.StatIndex(b, n, t) * p.kv_len + s] = ds;
          grad = ds == 0.f ? 0.f : p.DotGrad(ds, logit, b, n, t, s);
        }
      } else if (whole || rules.Attends(t, s)) {
        const float prob = exp2f(s_acc[i] * scale_log2 - row_lse[h]);
        grad = prob * (dp_acc[i] - row_delta[h]) * p.scale;
      }
      s_acc[i] = grad;
    }
    uint32_t ds_frag[Tile::kKeys / 16][4];
    ToOperand<T>(s_acc, ds_frag);

    // dq += ds k: k's tile as the MN-major B operand.
    sm90::WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < Tile::kKeys / 16; ++kk) {
      const uint64_t bk = sm90::DescriptorMNMajor(k_stage + kk * 16 * 64, Tile::kKeys * 128);
      sm90::Wgmma<kHeadDim, T>::template RS<1>(dq_acc, ds_frag[kk], bk, 1);
    }
    sm90::WgmmaCommit();
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(dq_acc);
    sm90::BarrierArrive(&kv_empty[stage]);
  }

  const float one[2] = {1.f, 1.f};
  StoreTile<T>(dq_acc, f, one, dq + p.QueryRow(b, tw, n), p.heads * p.head_dim, int(p.q_len) - tw,
               int(p.head_dim));
#endif
}

// ---- dk, dv ---------------------------------------------------------------------------------------

template <int kHeadDim>
struct DkvTile {
  static constexpr bool kSplitColumns = kHeadDim == 256;     // both warpgroups on the same keys
  static constexpr int kKeys = kSplitColumns ? 64 : 128;     // keys a CTA
  static constexpr int kCols = kSplitColumns ? 128 : kHeadDim;  // dk / dv columns a warpgroup
  static constexpr int kRows = 64;                           // queries a stage
  static constexpr int kStages = 2;
  static constexpr int kChunks = kHeadDim / 64;
  static constexpr int kKVBytes = kKeys * kHeadDim * 2;      // k, and v
  static constexpr int kQBytes = kRows * kHeadDim * 2;       // one q or do stage
  static constexpr int kStatOffset = 2 * kKVBytes + 2 * kStages * kQBytes;
  static constexpr int kBarrierOffset = kStatOffset + 2 * kStages * kRows * 4;  // lse, delta stages
  static constexpr int kSharedBytes = kBarrierOffset + 8 * (1 + 2 * kStages) + 1024;
};

template <typename T, int kHeadDim, bool kGeneral>
__global__ void __launch_bounds__(kThreads, 1)
    AttentionDkvKernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap do_map,
                       const __grid_constant__ CUtensorMap k_map, const __grid_constant__ CUtensorMap v_map,
                       const AttentionProblem p, const float* __restrict__ lse, const float* __restrict__ delta,
                       T* __restrict__ dk, T* __restrict__ dv) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tile = DkvTile<kHeadDim>;
  extern __shared__ uint8_t shared_raw[];
  uint8_t* shared = AlignedShared(shared_raw);
  T* k_s = reinterpret_cast<T*>(shared);                             // [chunk][kKeys][64]
  T* v_s = reinterpret_cast<T*>(shared + Tile::kKVBytes);            // [chunk][kKeys][64]
  T* q_s = reinterpret_cast<T*>(shared + 2 * Tile::kKVBytes);        // [stage][chunk][64][64]
  T* do_s = q_s + Tile::kStages * Tile::kQBytes / 2;
  float* lse_s = reinterpret_cast<float*>(shared + Tile::kStatOffset);  // [stage][64], log2 units
  float* delta_s = lse_s + Tile::kStages * Tile::kRows;
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(shared + Tile::kBarrierOffset);
  uint64_t* full = kv_full + 1;
  uint64_t* empty = full + Tile::kStages;
  constexpr int kStageElems = Tile::kQBytes / 2;

  const int tiles = int((p.kv_len + Tile::kKeys - 1) / Tile::kKeys);
  const int s0 = int(blockIdx.x % tiles) * Tile::kKeys;
  const int64_t kh = (blockIdx.x / tiles) % p.kv_heads, b = blockIdx.x / tiles / p.kv_heads;
  const int64_t group = p.Group();
  const int keys = int(p.kv_len - s0 < Tile::kKeys ? p.kv_len - s0 : Tile::kKeys);
  int64_t lo, hi;
  p.QueryRange(b, s0, s0 + keys, &lo, &hi);
  const int first = lo < hi ? int(lo - lo % Tile::kRows) : 0;
  const int query_tiles = lo < hi ? int((hi - first + Tile::kRows - 1) / Tile::kRows) : 0;
  const int steps = int(group) * query_tiles;  // (head of the group, query tile), head-major

  const int warpgroup = threadIdx.x / kWarpgroup;
  if (threadIdx.x == 0) {
    sm90::BarrierInit(kv_full, 1);
    for (int s = 0; s < Tile::kStages; ++s) {
      sm90::BarrierInit(&full[s], 1);
      sm90::BarrierInit(&empty[s], 2 * kWarpgroup);
    }
    sm90::BarrierInitFence();
  }
  __syncthreads();

  if (warpgroup == 0) {  // producer: warp 0 (its lanes copy lse and delta, lane 0 issues TMA)
    sm90::RegistersDecrease<kProducerRegisters>();
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    if (lane == 0) {
      sm90::BarrierArriveExpectTx(kv_full, 2 * Tile::kKVBytes);
      for (int c = 0; c < Tile::kChunks; ++c) {
        sm90::TmaLoad4d(k_s + c * Tile::kKeys * 64, &k_map, kv_full, 64 * c, int(kh), s0, int(b));
        sm90::TmaLoad4d(v_s + c * Tile::kKeys * 64, &v_map, kv_full, 64 * c, int(kh), s0, int(b));
      }
    }
    for (int j = 0; j < steps; ++j) {
      const int stage = j % Tile::kStages;
      const int64_t n = kh * group + j / query_tiles;
      const int t0 = first + (j % query_tiles) * Tile::kRows;
      sm90::BarrierWait(&empty[stage], ((j / Tile::kStages) & 1) ^ 1);
      for (int r = lane; r < Tile::kRows; r += 32) {
        const int t = t0 + r;
        const float l = t < p.q_len ? lse[p.StatIndex(b, n, t)] : -INFINITY;
        lse_s[stage * Tile::kRows + r] = l == -INFINITY ? INFINITY : l * kLog2e;
        delta_s[stage * Tile::kRows + r] = t < p.q_len ? delta[p.StatIndex(b, n, t)] : 0.f;
      }
      __syncwarp();  // the lanes' shared-memory writes happen before lane 0's arrival releases them
      if (lane == 0) {
        sm90::BarrierArriveExpectTx(&full[stage], 2 * Tile::kQBytes);
        for (int c = 0; c < Tile::kChunks; ++c) {
          const int offset = stage * kStageElems + c * Tile::kRows * 64;
          sm90::TmaLoad4d(q_s + offset, &q_map, &full[stage], 64 * c, int(n), t0, int(b));
          sm90::TmaLoad4d(do_s + offset, &do_map, &full[stage], 64 * c, int(n), t0, int(b));
        }
      }
    }
    return;
  }

  sm90::RegistersIncrease<kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const Fragment f(threadIdx.x % kWarpgroup);
  const int key_row = Tile::kSplitColumns ? 0 : 64 * consumer;  // the warpgroup's keys in the tile
  const int col0 = Tile::kSplitColumns ? 128 * consumer : 0;     // its dk / dv columns
  const int sw = s0 + key_row;
  const IndexRules rules(p, b);
  const float scale_log2 = p.scale * kLog2e;

  float dk_acc[Tile::kCols / 2], dv_acc[Tile::kCols / 2];
  Zero(dk_acc);
  Zero(dv_acc);
  sm90::BarrierWait(kv_full, 0);
  for (int j = 0; j < steps; ++j) {
    const int stage = j % Tile::kStages;
    const int64_t n = kh * group + j / query_tiles;
    const int t0 = first + (j % query_tiles) * Tile::kRows;
    const T* q_stage = q_s + stage * kStageElems;
    const T* do_stage = do_s + stage * kStageElems;
    const float* stage_lse = lse_s + stage * Tile::kRows;
    const float* stage_delta = delta_s + stage * Tile::kRows;

    // s^T = k q^T and dp^T = v do^T: 64 keys x 64 queries.
    float st_acc[Tile::kRows / 2], dpt_acc[Tile::kRows / 2];
    sm90::BarrierWait(&full[stage], (j / Tile::kStages) & 1);
    sm90::WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const int chunk = kk / 4, step = kk % 4;
      const int a_offset = chunk * Tile::kKeys * 64 + key_row * 64 + step * 16;
      const int b_offset = chunk * Tile::kRows * 64 + step * 16;
      sm90::Wgmma<Tile::kRows, T>::template SS<0>(st_acc, sm90::DescriptorKMajor(k_s + a_offset),
                                                  sm90::DescriptorKMajor(q_stage + b_offset), kk > 0);
      sm90::Wgmma<Tile::kRows, T>::template SS<0>(dpt_acc, sm90::DescriptorKMajor(v_s + a_offset),
                                                  sm90::DescriptorKMajor(do_stage + b_offset), kk > 0);
    }
    sm90::WgmmaCommit();
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(st_acc);
    sm90::FenceRegisters(dpt_acc);

    // p^T (dropped, for dv) into st_acc and the gradient of q.k into dpt_acc.
    const bool whole = !kGeneral && rules.Whole(t0, t0 + Tile::kRows, sw, sw + 64);
#pragma unroll
    for (int i = 0; i < Tile::kRows / 2; ++i) {
      const int s = sw + f.Row(i), r = f.Col(i), t = t0 + r;
      float prob = 0.f, grad = 0.f;
      if constexpr (kGeneral) {
        if (p.Attends(b, n, t, s)) {
          const float logit = p.Logit(st_acc[i], b, n, t, s);
          prob = exp2f(logit * kLog2e - stage_lse[r]);
          const float drop = DropoutScale(p, b, n, t, s);
          const float ds = prob * (dpt_acc[i] * drop - stage_delta[r]);
          grad = ds == 0.f ? 0.f : p.DotGrad(ds, logit, b, n, t, s);
          prob *= drop;
        }
      } else if (whole || rules.Attends(t, s)) {
        prob = exp2f(st_acc[i] * scale_log2 - stage_lse[r]);
        grad = prob * (dpt_acc[i] - stage_delta[r]) * p.scale;
      }
      st_acc[i] = prob;
      dpt_acc[i] = grad;
    }
    uint32_t p_frag[Tile::kRows / 16][4], ds_frag[Tile::kRows / 16][4];
    ToOperand<T>(st_acc, p_frag);
    ToOperand<T>(dpt_acc, ds_frag);

    // dv += p^T do, dk += ds^T q: the do and q tiles as MN-major B operands (their rows, the
    // queries, are the reduction axis), from the warpgroup's first column chunk.
    sm90::WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < Tile::kRows / 16; ++kk) {
      const int offset = (col0 / 64) * Tile::kRows * 64 + kk * 16 * 64;
      sm90::Wgmma<Tile::kCols, T>::template RS<1>(
          dv_acc, p_frag[kk], sm90::DescriptorMNMajor(do_stage + offset, Tile::kRows * 128), 1);
      sm90::Wgmma<Tile::kCols, T>::template RS<1>(
          dk_acc, ds_frag[kk], sm90::DescriptorMNMajor(q_stage + offset, Tile::kRows * 128), 1);
    }
    sm90::WgmmaCommit();
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(dv_acc);
    sm90::FenceRegisters(dk_acc);
    sm90::BarrierArrive(&empty[stage]);
  }

  const float one[2] = {1.f, 1.f};
  const int64_t row_stride = p.kv_heads * p.head_dim;
  const int key_rows = int(p.kv_len) - sw, cols = int(p.head_dim) - col0;
  StoreTile<T>(dk_acc, f, one, dk + p.KeyRow(b, sw, kh) + col0, row_stride, key_rows, cols);
  StoreTile<T>(dv_acc, f, one, dv + p.KeyRow(b, sw, kh) + col0, row_stride, key_rows, cols);
#endif
}

// ---- launch ---------------------------------------------------------------------------------------

struct BwdMaps {
  CUtensorMap q, d_out, k, v;  // q and do with the dq kernel's row box; k and v with its key box
  CUtensorMap q_rows, d_out_rows, k_keys, v_keys;  // the dk/dv kernel's boxes
};

template <typename Kernel>
ffi::Error PrepareLaunch(Kernel kernel, int shared_bytes) {
  return CudaError(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes),
                   "attention backward (sm90): shared memory");
}

template <typename T, int kHeadDim, bool kGeneral>
ffi::Error Launch(cudaStream_t stream, const AttentionProblem& p, const BwdMaps& maps, const float* lse,
                  const float* delta, void* dq, void* dk, void* dv, float* dbias) {
  using Dq = DqTile<kHeadDim>;
  using Dkv = DkvTile<kHeadDim>;
  auto dq_kernel = AttentionDqKernel<T, kHeadDim, kGeneral>;
  JAXDNN_RETURN_IF_ERROR(PrepareLaunch(dq_kernel, Dq::kSharedBytes));
  const int64_t dq_blocks = (p.q_len + Dq::kRows - 1) / Dq::kRows * p.heads * p.batch;
  dq_kernel<<<static_cast<unsigned>(dq_blocks), kThreads, Dq::kSharedBytes, stream>>>(
      maps.q, maps.d_out, maps.k, maps.v, p, lse, delta, static_cast<T*>(dq), dbias);
  JAXDNN_RETURN_IF_ERROR(LaunchError("attention dq (sm90)"));
  auto dkv_kernel = AttentionDkvKernel<T, kHeadDim, kGeneral>;
  JAXDNN_RETURN_IF_ERROR(PrepareLaunch(dkv_kernel, Dkv::kSharedBytes));
  const int64_t dkv_blocks = (p.kv_len + Dkv::kKeys - 1) / Dkv::kKeys * p.kv_heads * p.batch;
  dkv_kernel<<<static_cast<unsigned>(dkv_blocks), kThreads, Dkv::kSharedBytes, stream>>>(
      maps.q_rows, maps.d_out_rows, maps.k_keys, maps.v_keys, p, lse, delta, static_cast<T*>(dk),
      static_cast<T*>(dv));
  return LaunchError("attention dk/dv (sm90)");
}

template <typename T, int kHeadDim>
ffi::Error DispatchRules(cudaStream_t stream, const AttentionProblem& p, const BwdMaps& maps, const float* lse,
                         const float* delta, void* dq, void* dk, void* dv, float* dbias) {
  return NeedsGeneralRules(p) ? Launch<T, kHeadDim, true>(stream, p, maps, lse, delta, dq, dk, dv, dbias)
                              : Launch<T, kHeadDim, false>(stream, p, maps, lse, delta, dq, dk, dv, dbias);
}

template <typename T>
ffi::Error Dispatch(cudaStream_t stream, const AttentionProblem& p, const BwdMaps& maps, const float* lse,
                    const float* delta, void* dq, void* dk, void* dv, float* dbias) {
  switch (PaddedHeadDim(p.head_dim)) {
    case 64: return DispatchRules<T, 64>(stream, p, maps, lse, delta, dq, dk, dv, dbias);
    case 128: return DispatchRules<T, 128>(stream, p, maps, lse, delta, dq, dk, dv, dbias);
    default: return DispatchRules<T, 256>(stream, p, maps, lse, delta, dq, dk, dv, dbias);
  }
}

// The tile boxes of the kernels for this head size.
template <int kHeadDim>
bool MakeMaps(const AttentionProblem& p, CUtensorMapDataType type, const void* d_out, const void* q, const void* k,
              const void* v, BwdMaps* maps) {
  using Dq = DqTile<kHeadDim>;
  using Dkv = DkvTile<kHeadDim>;
  auto rows = [&](CUtensorMap* map, const void* x, int box) {
    return MakeTileMap(map, x, type, p.batch, p.q_len, p.heads, p.head_dim, box) == CUDA_SUCCESS;
  };
  auto keys = [&](CUtensorMap* map, const void* x, int box) {
    return MakeTileMap(map, x, type, p.batch, p.kv_len, p.kv_heads, p.head_dim, box) == CUDA_SUCCESS;
  };
  return rows(&maps->q, q, Dq::kRows) && rows(&maps->d_out, d_out, Dq::kRows) && keys(&maps->k, k, Dq::kKeys) &&
         keys(&maps->v, v, Dq::kKeys) && rows(&maps->q_rows, q, Dkv::kRows) &&
         rows(&maps->d_out_rows, d_out, Dkv::kRows) && keys(&maps->k_keys, k, Dkv::kKeys) &&
         keys(&maps->v_keys, v, Dkv::kKeys);
}

}  // namespace

ffi::Error AttentionBwdSm90(cudaStream_t stream, const AttentionProblem& p, ffi::DataType dtype, const void* d_out,
                            const void* q, const void* k, const void* v, const float* lse, const float* delta,
                            void* dq, void* dk, void* dv, float* dbias) {
  const bool bf16 = dtype == ffi::DataType::BF16;
  const CUtensorMapDataType type = bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  BwdMaps maps;
  const int h = PaddedHeadDim(p.head_dim);
  const bool encoded = h == 64    ? MakeMaps<64>(p, type, d_out, q, k, v, &maps)
                       : h == 128 ? MakeMaps<128>(p, type, d_out, q, k, v, &maps)
                                  : MakeMaps<256>(p, type, d_out, q, k, v, &maps);
  if (!encoded) {
    return ffi::Error(ffi::ErrorCode::kInternal, "jaxdnn: attention backward (sm90): cannot encode a TMA descriptor");
  }
  return bf16 ? Dispatch<__nv_bfloat16>(stream, p, maps, lse, delta, dq, dk, dv, dbias)
              : Dispatch<__half>(stream, p, maps, lse, delta, dq, dk, dv, dbias);
}

}  // namespace attention_sm90
}  // namespace jaxdnn
