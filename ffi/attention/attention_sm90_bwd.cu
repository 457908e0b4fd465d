// Hopper flash-attention backward on wgmma, deterministic (no order-dependent atomics), after
// delta = rowsum(do o) (attention.cu). Every kernel has a key-tile or query-tile loop of the
// forward's kind (attention_sm90.cuh).
//
// Head sizes 65-128 (the 128 kernel), one fused kernel: one CTA per (b, kv head, tile of 128 keys)
// keeps its k and v tiles in shared memory while the queries of every head of the group stream
// through stages (q, do, and the rows' lse and delta). Per query tile, transposed so that the keys are the rows:
//   s^T = k q^T and dp^T = v do^T (SS wgmma), p^T = exp(logit - lse), ds^T = p^T (dp^T - delta)
//   (times the logit's derivative: scale, and the soft cap's), dv += p^T do and dk += ds^T q (RS:
//   the q and do tiles as MN-major operands), and this key tile's share of dq, ds k, added to a
//   float32 dq_accum in a fixed order (see AttentionBwdFusedKernel). The group's query heads are
//   summed in the CTA, in a fixed order.
// Head sizes up to 64 (the fused kernel's dq adds, a float32 tile per key tile, cost more there than
// recomputing s and dp for dq: fwd+bwd 13.5 ms against 16.5 at S 4096, H100, 2026-11-25), head size
// 256 (dk and dv alone fill the registers), and problems with few query tiles for their key tiles
// (decoding: the fused kernel's ordered adds would wait in a long chain): two kernels.
//   dq: one CTA per (b, n, tile of 128 queries), the forward's structure; per key tile s = q k^T and
//   dp = do v^T (SS), ds as above, dq += ds k (RS: ds from registers, k's tile as the MN-major
//   operand).
//   dk, dv: the fused kernel's loop without dq; for head size 256 over 64 keys a CTA, the head's
//   columns split between the two consumer warpgroups, which then both compute s^T and dp^T of the
//   same 64 keys.
// With a differentiated bias, ds is also dbias (each element written once).
#include <algorithm>
#include <type_traits>

#include "attention/attention_sm90.h"
#include "attention/attention_sm90.cuh"

namespace jaxdnn {
namespace attention_sm90 {
namespace {

// ---- dq -------------------------------------------------------------------------------------------

template <int kHeadDim>
struct DqTile {
  static constexpr int kRows = 128;                        // queries a CTA, 64 per consumer warpgroup
  static constexpr int kKeys = kHeadDim == 256 ? 32 : 64;  // keys a stage (H 256: dq is 128 floats a thread)
  // A stage is released only after the next step's ds (its dq product runs meanwhile), so the
  // producer needs a third stage to load ahead.
  static constexpr int kStages = 3;
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
  uint8_t* shared = sm90::AlignedShared(shared_raw);
  T* q_s = reinterpret_cast<T*>(shared);                        // [chunk][128][64]
  T* do_s = reinterpret_cast<T*>(shared + Tile::kQBytes);       // [chunk][128][64]
  T* k_s = reinterpret_cast<T*>(shared + 2 * Tile::kQBytes);    // [stage][chunk][kKeys][64]
  T* v_s = k_s + Tile::kStages * Tile::kKVBytes / 2;
  uint64_t* q_full = reinterpret_cast<uint64_t*>(shared + Tile::kBarrierOffset);
  uint64_t* kv_full = q_full + 1;
  uint64_t* kv_empty = kv_full + Tile::kStages;
  constexpr int kStageElems = Tile::kKVBytes / 2;

  const auto work = QueryTileWork::Of<Tile::kRows, Tile::kKeys>(p);
  const int t0 = work.t0, first = work.first, key_tiles = work.key_tiles;
  const int64_t n = work.n, b = work.b, kh = work.kh;

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
  float row_lse[2], row_delta[2];  // the thread's two rows
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int t = tw + f.row + 8 * h;
    row_lse[h] = RowLse2(p, lse, b, n, t);
    row_delta[h] = t < p.q_len ? delta[p.StatIndex(b, n, t)] : 0.f;
  }

  // As the forward's loop: step j's s and dp are issued together with step j - 1's dq product, and
  // step j's ds is computed while the tensor cores run that product.
  float dq_acc[kHeadDim / 2];
  Zero(dq_acc);
  float s_acc[Tile::kKeys / 2], dp_acc[Tile::kKeys / 2];
  uint32_t ds_frag[Tile::kKeys / 16][4];
  // s = q k^T and dp = do v^T of key tile j (one wgmma group, not waited for).
  auto issue_logits = [&](int j) {
    const int stage = j % Tile::kStages;
    const T* k_stage = k_s + stage * kStageElems;
    const T* v_stage = v_s + stage * kStageElems;
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
  };
  // dq += ds k of key tile j: k's tile as the MN-major B operand (one group, not waited for).
  auto issue_dq = [&](int j) {
    const T* k_stage = k_s + (j % Tile::kStages) * kStageElems;
    sm90::WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < Tile::kKeys / 16; ++kk) {
      const uint64_t bk = sm90::DescriptorMNMajor(k_stage + kk * 16 * 64, Tile::kKeys * 128);
      sm90::Wgmma<kHeadDim, T>::template RS<1>(dq_acc, ds_frag[kk], bk, 1);
    }
    sm90::WgmmaCommit();
  };
  // ds of key tile j in place of s (once s and dp are done).
  auto gradients = [&](int j) {
    const int s0 = first + j * Tile::kKeys;
    const bool whole = !kGeneral && rules.Whole(tw, tw + 64, s0, s0 + Tile::kKeys);
    // One loop per kind of tile (a uniform branch), so a whole tile runs no index tests.
    auto loop = [&](auto masked) {
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
        } else {  // branch-free, as KeyMajorGradients
          const float prob = exp2f(s_acc[i] * scale_log2 - row_lse[h]);
          const float g = prob * (dp_acc[i] - row_delta[h]) * p.scale;
          grad = !decltype(masked)::value || rules.Attends(t, s) ? g : 0.f;
        }
        s_acc[i] = grad;
      }
    };
    if (whole) {
      loop(std::false_type{});
    } else {
      loop(std::true_type{});
    }
  };

  sm90::BarrierWait(q_full, 0);
  if (key_tiles > 0) {
    issue_logits(0);
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(s_acc);
    sm90::FenceRegisters(dp_acc);
    gradients(0);
    ToOperand<T>(s_acc, ds_frag);
    for (int j = 1; j < key_tiles; ++j) {
      issue_logits(j);
      issue_dq(j - 1);
      sm90::WgmmaWait<1>();  // s and dp of tile j are done (groups complete in order), dq may not be
      sm90::FenceRegisters(s_acc);
      sm90::FenceRegisters(dp_acc);
      gradients(j);
      sm90::WgmmaWait<0>();
      sm90::FenceRegisters(dq_acc);
      sm90::FenceRegisters(ds_frag);  // read by the wgmma until here: not reused before
      sm90::BarrierArrive(&kv_empty[(j - 1) % Tile::kStages]);
      ToOperand<T>(s_acc, ds_frag);
    }
    issue_dq(key_tiles - 1);
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(dq_acc);
  }

  const float one[2] = {1.f, 1.f};
  StoreTile<T>(dq_acc, f, one, dq + p.QueryRow(b, tw, n), p.heads * p.head_dim, int(p.q_len) - tw,
               int(p.head_dim));
#endif
}

// ---- what the key-tile kernels share ---------------------------------------------------------------

// The number of query tiles (of `rows` queries, aligned to `rows`) that the keys [s0, s0 + kKeys)
// (clipped to S) can reach, and the first one's start: the steps of one head in a key-tile kernel.
// AttentionProblem::QueryRange in 32-bit arithmetic (the dq writer evaluates it for many tiles).
template <int kKeys>
__device__ __forceinline__ int QueryTilesOf(const AttentionProblem& p, int64_t b, int s0, int rows, int* first) {
  const int s_end = s0 + (int(p.kv_len) - s0 < kKeys ? int(p.kv_len) - s0 : kKeys);
  int lo = 0, hi = int(p.QueryLimit(b));
  if (p.causal) lo = max(lo, s0);
  if (p.window_right >= 0) lo = max(lo, s0 - int(p.window_right));
  if (p.window_left >= 0) hi = min(hi, s_end + int(p.window_left));
  *first = lo - lo % rows;
  return lo < hi ? (hi - *first + rows - 1) / rows : 0;
}

// The producer warp of a key-tile kernel: the tile's k and v once (on kv_full), then per step (head
// n of the group, query tile t0) the q and do tiles by TMA and the rows' lse (log2 units; +inf for
// a row without a key or past T: RowLse2) and delta, which the lanes copy, into stage
// `step % kStages` (on full[stage] once empty[stage] is released).
template <typename Tile, typename T>
__device__ __forceinline__ void ProduceQueryTiles(const CUtensorMap& q_map, const CUtensorMap& do_map,
                                                  const CUtensorMap& k_map, const CUtensorMap& v_map,
                                                  const AttentionProblem& p, const float* lse, const float* delta,
                                                  int64_t b, int64_t kh, int s0, int first, int query_tiles, T* k_s,
                                                  T* v_s, T* q_s, T* do_s, float* lse_s, float* delta_s,
                                                  uint64_t* kv_full, uint64_t* full, uint64_t* empty) {
  constexpr int kStageElems = Tile::kQBytes / 2;
  const int lane = threadIdx.x % 32;
  if (lane == 0) {
    sm90::BarrierArriveExpectTx(kv_full, 2 * Tile::kKVBytes);
    for (int c = 0; c < Tile::kChunks; ++c) {
      sm90::TmaLoad4d(k_s + c * Tile::kKeys * 64, &k_map, kv_full, 64 * c, int(kh), s0, int(b));
      sm90::TmaLoad4d(v_s + c * Tile::kKeys * 64, &v_map, kv_full, 64 * c, int(kh), s0, int(b));
    }
  }
  const int steps = int(p.Group()) * query_tiles;
  for (int j = 0; j < steps; ++j) {
    const int stage = j % Tile::kStages;
    const int64_t n = kh * p.Group() + j / query_tiles;
    const int t0 = first + (j % query_tiles) * Tile::kRows;
    sm90::BarrierWait(&empty[stage], ((j / Tile::kStages) & 1) ^ 1);
    for (int r = lane; r < Tile::kRows; r += 32) {
      const int t = t0 + r;
      lse_s[stage * Tile::kRows + r] = RowLse2(p, lse, b, n, t);
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
}

// s^T = k q^T and dp^T = v do^T for one warpgroup's 64 keys (rows of k_s / v_s from key_row) and the
// stage's kRows queries, reduced over the head's columns (one wgmma group, waited for).
template <typename Tile, typename T, int kCount>
__device__ __forceinline__ void KeyMajorLogits(const T* k_s, const T* v_s, const T* q_stage, const T* do_stage,
                                               int key_row, float (&st_acc)[kCount], float (&dpt_acc)[kCount]) {
  sm90::WgmmaFence();
#pragma unroll
  for (int kk = 0; kk < Tile::kChunks * 4; ++kk) {
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
}

// From s^T and dp^T of keys sw.. (rows) x queries t0.. (columns): the A fragments of p^T (dropped:
// dv's operand) and of the gradient of q.k (ds times the logit's derivative: dk's and dq's), each
// pair packed as soon as it is computed (the float tiles and the fragments are not all live at
// once). With dbias (not null), ds itself is written there for every attended pair. The index
// rules compute every element and select the masked ones away; the general rules branch per
// element (their operands are read from global memory).
template <typename T, bool kGeneral, int kCount>
__device__ __forceinline__ void KeyMajorGradients(const float (&st_acc)[kCount], const float (&dpt_acc)[kCount],
                                                  const Fragment& f, const AttentionProblem& p,
                                                  const IndexRules& rules, int64_t b, int64_t n, int t0, int sw,
                                                  const float* stage_lse, const float* stage_delta, float* dbias,
                                                  uint32_t (&p_frag)[kCount / 8][4],
                                                  uint32_t (&ds_frag)[kCount / 8][4]) {
  const float scale_log2 = p.scale * kLog2e;
  if constexpr (kGeneral) {
#pragma unroll
    for (int pair = 0; pair < kCount / 2; ++pair) {
      float prob[2] = {0.f, 0.f}, grad[2] = {0.f, 0.f};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 2 * pair + e;
        const int s = sw + f.Row(i), r = f.Col(i), t = t0 + r;
        if (p.Attends(b, n, t, s)) {
          const float logit = p.Logit(st_acc[i], b, n, t, s);
          prob[e] = exp2f(logit * kLog2e - stage_lse[r]);
          const float drop = DropoutScale(p, b, n, t, s);
          const float ds = prob[e] * (dpt_acc[i] * drop - stage_delta[r]);
          if (dbias != nullptr) dbias[p.StatIndex(b, n, t) * p.kv_len + s] = ds;
          grad[e] = ds == 0.f ? 0.f : p.DotGrad(ds, logit, b, n, t, s);
          prob[e] *= drop;
        }
      }
      p_frag[pair / 4][pair % 4] = sm90::PackPair<T>(prob[0], prob[1]);
      ds_frag[pair / 4][pair % 4] = sm90::PackPair<T>(grad[0], grad[1]);
    }
  } else {
    // Branch-free: every element is computed and the ones outside the rules selected away, so the
    // scheduler can overlap the elements' exp2 latencies (a branch per element serialized them).
    // One loop per kind of tile (a uniform branch), so a whole tile runs no index tests: with them,
    // the H 64 dk/dv kernel's ALU pipe was its busiest (66%, Nsight Compute; ~8 integer and select
    // instructions an element against ~6 floating-point ones).
    auto loop = [&](auto masked) {
      // Elements 4 g .. 4 g + 3 are keys row, row + 8 times queries c, c + 1 (c = col + 8 g).
#pragma unroll
      for (int g = 0; g < kCount / 4; ++g) {
        const int c = f.col + 8 * g;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // key row + 8 h: the pair 2 g + h
          float prob[2], grad[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = 4 * g + 2 * h + e;
            const float pr = exp2f(st_acc[i] * scale_log2 - stage_lse[c + e]);
            const float gr = pr * (dpt_acc[i] - stage_delta[c + e]) * p.scale;
            const bool attend = !decltype(masked)::value || rules.Attends(t0 + c + e, sw + f.row + 8 * h);
            prob[e] = attend ? pr : 0.f;
            grad[e] = attend ? gr : 0.f;
          }
          p_frag[g / 2][2 * (g % 2) + h] = sm90::PackPair<T>(prob[0], prob[1]);
          ds_frag[g / 2][2 * (g % 2) + h] = sm90::PackPair<T>(grad[0], grad[1]);
        }
        if (g % 2 == 1) {
          // A fragment row is done: the loads of later groups stay after it (a window of 8 elements
          // in flight: enough to overlap the exp2s without spills).
          sm90::FenceRegisters(p_frag[g / 2]);
          sm90::FenceRegisters(ds_frag[g / 2]);
        }
      }
    };
    if (rules.Whole(t0, t0 + 2 * kCount, sw, sw + 64)) {  // 2 kCount queries
      loop(std::false_type{});
    } else {
      loop(std::true_type{});
    }
  }
}

// dv += p^T do and dk += ds^T q (one wgmma group, not waited for): the do and q tiles as MN-major B
// operands (their rows, the queries, are the reduction axis), from column chunk col0 / 64.
template <typename Tile, typename T, int kCols, int kFrags>
__device__ __forceinline__ void IssueKeyGradients(const T* q_stage, const T* do_stage, int col0,
                                                  const uint32_t (&p_frag)[kFrags][4],
                                                  const uint32_t (&ds_frag)[kFrags][4], float (&dv_acc)[kCols / 2],
                                                  float (&dk_acc)[kCols / 2]) {
  sm90::WgmmaFence();
#pragma unroll
  for (int kk = 0; kk < kFrags; ++kk) {
    const int offset = (col0 / 64) * Tile::kRows * 64 + kk * 16 * 64;
    sm90::Wgmma<kCols, T>::template RS<1>(dv_acc, p_frag[kk],
                                          sm90::DescriptorMNMajor(do_stage + offset, Tile::kRows * 128), 1);
    sm90::Wgmma<kCols, T>::template RS<1>(dk_acc, ds_frag[kk],
                                          sm90::DescriptorMNMajor(q_stage + offset, Tile::kRows * 128), 1);
  }
  sm90::WgmmaCommit();
}

// ---- dk, dv (beside the dq kernel) ----------------------------------------------------------------

template <int kHeadDim>
struct DkvTile {
  static constexpr bool kSplitColumns = kHeadDim == 256;        // both warpgroups on the same keys
  static constexpr int kKeys = kSplitColumns ? 64 : 128;        // keys a CTA
  static constexpr int kCols = kSplitColumns ? 128 : kHeadDim;  // dk / dv columns a warpgroup
  static constexpr int kRows = kHeadDim == 64 ? 128 : 64;      // queries a stage (H 64: fewer steps)
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
  uint8_t* shared = sm90::AlignedShared(shared_raw);
  T* k_s = reinterpret_cast<T*>(shared);                             // [chunk][kKeys][64]
  T* v_s = reinterpret_cast<T*>(shared + Tile::kKVBytes);            // [chunk][kKeys][64]
  T* q_s = reinterpret_cast<T*>(shared + 2 * Tile::kKVBytes);        // [stage][chunk][kRows][64]
  T* do_s = q_s + Tile::kStages * Tile::kQBytes / 2;
  float* lse_s = reinterpret_cast<float*>(shared + Tile::kStatOffset);  // [stage][kRows], log2 units
  float* delta_s = lse_s + Tile::kStages * Tile::kRows;
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(shared + Tile::kBarrierOffset);
  uint64_t* full = kv_full + 1;
  uint64_t* empty = full + Tile::kStages;

  const int tiles = int((p.kv_len + Tile::kKeys - 1) / Tile::kKeys);
  const int s0 = int(blockIdx.x % tiles) * Tile::kKeys;
  const int64_t kh = (blockIdx.x / tiles) % p.kv_heads, b = blockIdx.x / tiles / p.kv_heads;
  int first;
  const int query_tiles = QueryTilesOf<Tile::kKeys>(p, b, s0, Tile::kRows, &first);
  const int steps = int(p.Group()) * query_tiles;  // (head of the group, query tile), head-major

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
    if (threadIdx.x < 32) {
      ProduceQueryTiles<Tile>(q_map, do_map, k_map, v_map, p, lse, delta, b, kh, s0, first, query_tiles, k_s, v_s,
                              q_s, do_s, lse_s, delta_s, kv_full, full, empty);
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

  float dk_acc[Tile::kCols / 2], dv_acc[Tile::kCols / 2];
  Zero(dk_acc);
  Zero(dv_acc);
  sm90::BarrierWait(kv_full, 0);
  for (int j = 0; j < steps; ++j) {
    const int stage = j % Tile::kStages;
    const int64_t n = kh * p.Group() + j / query_tiles;
    const int t0 = first + (j % query_tiles) * Tile::kRows;
    const T* q_stage = q_s + stage * Tile::kQBytes / 2;
    const T* do_stage = do_s + stage * Tile::kQBytes / 2;

    float st_acc[Tile::kRows / 2], dpt_acc[Tile::kRows / 2];
    sm90::BarrierWait(&full[stage], (j / Tile::kStages) & 1);
    KeyMajorLogits<Tile>(k_s, v_s, q_stage, do_stage, key_row, st_acc, dpt_acc);
    uint32_t p_frag[Tile::kRows / 16][4], ds_frag[Tile::kRows / 16][4];
    KeyMajorGradients<T, kGeneral>(st_acc, dpt_acc, f, p, rules, b, n, t0, sw, lse_s + stage * Tile::kRows,
                                   delta_s + stage * Tile::kRows, nullptr, p_frag, ds_frag);
    IssueKeyGradients<Tile, T, Tile::kCols>(q_stage, do_stage, col0, p_frag, ds_frag, dv_acc, dk_acc);
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

// ---- fused dk, dv and dq (head size 128) --------------------------------------------------------
//
// The dk/dv kernel's loop, plus per step dq's share of this key tile, ds k: the two warpgroups'
// ds^T (their 64 keys each) go to shared memory, and each warpgroup multiplies half of the product
// (split by dq's columns) over all 128 keys. The float32 partial goes to a shared buffer that a
// writer warp of the producer warpgroup adds to dq_accum [B, T, N, H] in global memory with TMA
// tensor reductions (one per 32 columns). The adds are ordered for determinism, in descending
// key-tile order: a semaphore per (b, n, query tile) counts the key tiles that have added theirs,
// and a CTA adds when the count equals the number of key tiles after its own that reach the query
// tile (each CTA computes that with the same QueryTilesOf its peers iterate with). Higher key tiles
// are launched first (lower block index), so a CTA waits only for CTAs the GPU started before it
// and the chain always progresses; and since a key tile's first query tile is, under a causal mask,
// its own diagonal one, each query tile's contributors come one step apart, without waiting on each
// other. Without the semaphores (jaxdnn.config.deterministic off) the writer adds each step as it
// comes: no chain, but dq's rounding depends on the order the adds land (measured 1.02-1.06x faster
// fwd+bwd at S 4096, H 128, on an H100). dq = dq_accum in q's dtype after.

template <int kHeadDim>
struct FusedTile {
  static constexpr int kKeys = 128;                          // keys a CTA, 64 per consumer warpgroup
  static constexpr int kRows = 64;                           // queries a stage
  static constexpr int kDqCols = kHeadDim / 2;               // dq columns a warpgroup
  static constexpr int kStages = 2;
  static constexpr int kChunks = kHeadDim / 64;
  static constexpr int kDqChunks = kHeadDim / 32;            // dq buffer: [32-column chunk][kRows][32] floats
  static constexpr int kKVBytes = kKeys * kHeadDim * 2;
  static constexpr int kQBytes = kRows * kHeadDim * 2;       // one q or do stage
  static constexpr int kDsBytes = kKeys * kRows * 2;         // one ds^T buffer: [key][64 queries]
  static_assert(kRows * 2 == 128, "a ds^T row is one 128-byte swizzled row");
  static constexpr int kQOffset = 2 * kKVBytes;
  static constexpr int kDsOffset = kQOffset + 2 * kStages * kQBytes;
  static constexpr int kDqOffset = kDsOffset + 2 * kDsBytes;
  static constexpr int kStatOffset = kDqOffset + kRows * kHeadDim * 4;
  static constexpr int kBarrierOffset = kStatOffset + 2 * kStages * kRows * 4;
  static constexpr int kSharedBytes = kBarrierOffset + 8 * (7 + 2 * kStages) + 1024;
};
// The writer warp needs more than the 24 registers the producers get elsewhere.
constexpr int kFusedProducerRegisters = 56;
constexpr int kFusedConsumerRegisters = 224;  // 128 * 56 + 256 * 224 = 384 * 168, what the CTA starts with

// Query tiles of 64 (FusedTile::kRows) a (b, n) semaphore row holds.
__host__ __device__ inline int64_t SemaphoreTiles(int64_t q_len) { return (q_len + 63) / 64; }

// The dq buffer's byte offset of (row, column): 32-column chunks of kRows 128-byte rows, swizzled as
// the TMA reads them (the 16-byte unit index XOR the row's index mod 8; also what keeps the
// consumers' 8-byte stores free of bank conflicts).
template <typename Tile>
__device__ __forceinline__ int DqBufferOffset(int row, int col) {
  return (col / 32) * Tile::kRows * 128 + row * 128 + ((((col % 32) / 4) ^ (row % 8)) * 16) + (col % 4) * 4;
}

// The dq writer's step: lane 0 adds the dq buffer to dq_accum's rows of query tile t0 of head n,
// one TMA reduction per chunk (rows past T and columns past H dropped; in its bulk group, not
// waited for).
template <typename Tile>
__device__ __forceinline__ void AddDqTile(const CUtensorMap& dq_map, int64_t b, int64_t n, int t0, const uint8_t* dq_s,
                                          int lane) {
  if (lane == 0) {
#pragma unroll
    for (int c = 0; c < Tile::kDqChunks; ++c) {
      sm90::TmaReduceAdd4d(&dq_map, dq_s + c * Tile::kRows * 128, 32 * c, int(n), t0, int(b));
    }
  }
}

template <typename T, int kHeadDim, bool kGeneral>
__global__ void __launch_bounds__(kThreads, 1)
    AttentionBwdFusedKernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap do_map,
                            const __grid_constant__ CUtensorMap k_map, const __grid_constant__ CUtensorMap v_map,
                            const __grid_constant__ CUtensorMap dq_map, const AttentionProblem p,
                            const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk,
                            T* __restrict__ dv, int* __restrict__ semaphores, float* __restrict__ dbias) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tile = FusedTile<kHeadDim>;
  extern __shared__ uint8_t shared_raw[];
  uint8_t* shared = sm90::AlignedShared(shared_raw);
  T* k_s = reinterpret_cast<T*>(shared);                          // [chunk][128 keys][64]
  T* v_s = reinterpret_cast<T*>(shared + Tile::kKVBytes);
  T* q_s = reinterpret_cast<T*>(shared + Tile::kQOffset);         // [stage][chunk][kRows][64]
  T* do_s = q_s + Tile::kStages * Tile::kQBytes / 2;
  uint8_t* ds_s = shared + Tile::kDsOffset;                        // [2][128 keys][64 queries]
  uint8_t* dq_s = shared + Tile::kDqOffset;  // [chunk][kRows][32] floats, swizzled (DqBufferOffset)
  float* lse_s = reinterpret_cast<float*>(shared + Tile::kStatOffset);
  float* delta_s = lse_s + Tile::kStages * Tile::kRows;
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(shared + Tile::kBarrierOffset);
  uint64_t* full = kv_full + 1;
  uint64_t* empty = full + Tile::kStages;
  uint64_t* dq_full = empty + Tile::kStages;
  uint64_t* dq_empty = dq_full + 1;
  uint64_t* ds_full = dq_empty + 1;  // [2]: both warpgroups' ds^T of a step are in the buffer
  uint64_t* ds_empty = ds_full + 2;  // [2]: both have read it for their dq

  const int tiles = int((p.kv_len + Tile::kKeys - 1) / Tile::kKeys);
  const int key_tile = tiles - 1 - int(blockIdx.x % tiles);  // descending (see above)
  const int s0 = key_tile * Tile::kKeys;
  const int64_t kh = (blockIdx.x / tiles) % p.kv_heads, b = blockIdx.x / tiles / p.kv_heads;
  int first;
  const int query_tiles = QueryTilesOf<Tile::kKeys>(p, b, s0, Tile::kRows, &first);
  const int steps = int(p.Group()) * query_tiles;

  const int warpgroup = threadIdx.x / kWarpgroup;
  if (threadIdx.x == 0) {
    sm90::BarrierInit(kv_full, 1);
    for (int s = 0; s < Tile::kStages; ++s) {
      sm90::BarrierInit(&full[s], 1);
      sm90::BarrierInit(&empty[s], 2 * kWarpgroup);
    }
    sm90::BarrierInit(dq_full, 2 * kWarpgroup);
    sm90::BarrierInit(dq_empty, 1);
    for (int i = 0; i < 2; ++i) {
      sm90::BarrierInit(&ds_full[i], 2 * kWarpgroup);
      sm90::BarrierInit(&ds_empty[i], 2 * kWarpgroup);
    }
    sm90::BarrierInitFence();
  }
  __syncthreads();

  if (warpgroup == 0) {
    sm90::RegistersDecrease<kFusedProducerRegisters>();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp == 0) {
      ProduceQueryTiles<Tile>(q_map, do_map, k_map, v_map, p, lse, delta, b, kh, s0, first, query_tiles, k_s, v_s,
                              q_s, do_s, lse_s, delta_s, kv_full, full, empty);
    } else if (warp == 1 && semaphores != nullptr) {  // the dq writer, adding in key-tile order
      for (int j = 0; j < steps; ++j) {
        const int64_t n = kh * p.Group() + j / query_tiles;
        const int t0 = first + (j % query_tiles) * Tile::kRows;
        // Key tiles after this one that add to the same query tile (the lanes split them).
        int before = 0;
        for (int other = key_tile + 1 + lane; other < tiles; other += 32) {
          int other_first;
          const int count = QueryTilesOf<Tile::kKeys>(p, b, other * Tile::kKeys, Tile::kRows, &other_first);
          before += count > 0 && t0 >= other_first && t0 < other_first + count * Tile::kRows;
        }
        before = __reduce_add_sync(0xffffffffu, before);
        int* semaphore = semaphores + (b * p.heads + n) * SemaphoreTiles(p.q_len) + t0 / 64;
        sm90::BarrierWait(dq_full, j & 1);
        if (lane == 0) {
          while (sm90::LoadAcquire(semaphore) != before) __nanosleep(32);
        }
        __syncwarp();
        sm90::FenceProxyAsyncGlobal();  // the bulk adds come after the acquire
        AddDqTile<Tile>(dq_map, b, n, t0, dq_s, lane);
        sm90::BulkWaitAll();
        sm90::FenceProxyAsyncGlobal();
        __threadfence();  // the adds are visible before the semaphore says so
        __syncwarp();
        if (lane == 0) {
          atomicAdd(semaphore, 1);
          sm90::BarrierArrive(dq_empty);
        }
      }
    } else if (warp == 1) {  // the dq writer, adding as the steps come (not deterministic)
      for (int j = 0; j < steps; ++j) {
        sm90::BarrierWait(dq_full, j & 1);
        AddDqTile<Tile>(dq_map, b, kh * p.Group() + j / query_tiles, first + (j % query_tiles) * Tile::kRows,
                        dq_s, lane);
        sm90::BulkWaitReads();  // only the buffer's reuse waits for the adds
        __syncwarp();
        if (lane == 0) sm90::BarrierArrive(dq_empty);
      }
    }
    return;
  }

  sm90::RegistersIncrease<kFusedConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const Fragment f(threadIdx.x % kWarpgroup);
  const int key_row = 64 * consumer;
  const int sw = s0 + key_row;
  const IndexRules rules(p, b);
  const int dq_col0 = consumer * Tile::kDqCols;  // this warpgroup's share of dq = ds k

  // This warpgroup's share of step jd's ds k: A = ds from buffer jd % 2 (M-major: its rows are the
  // keys), B = k's tile as the MN-major operand, over all 128 keys; issued as one wgmma group, then
  // (FinishDq, which waits for every group) stored to the dq buffer for the writer.
  float dq_acc[Tile::kDqCols / 2];
  auto IssueDq = [&](int jd) {
    const uint8_t* buffer = ds_s + (jd % 2) * Tile::kDsBytes;
    sm90::BarrierWait(&ds_full[jd % 2], (jd / 2) & 1);
    Zero(dq_acc);  // a fresh definition: the registers are not live across the steps
    sm90::WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < Tile::kKeys / 16; ++kk) {
      const uint64_t a = sm90::DescriptorMNMajor(buffer + kk * 16 * 128, Tile::kKeys * 128);
      const uint64_t bk = sm90::DescriptorMNMajor(k_s + (dq_col0 / 64) * Tile::kKeys * 64 + kk * 16 * 64,
                                                  Tile::kKeys * 128);
      sm90::Wgmma<Tile::kDqCols, T>::template SS<1, 1>(dq_acc, a, bk, kk > 0);
    }
    sm90::WgmmaCommit();
  };
  auto FinishDq = [&](int jd) {
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(dq_acc);
    sm90::BarrierArrive(&ds_empty[jd % 2]);
    sm90::BarrierWait(dq_empty, (jd & 1) ^ 1);
#pragma unroll
    for (int i = 0; i < Tile::kDqCols / 2; i += 2) {
      const int row = f.Row(i), col = dq_col0 + f.Col(i);
      *reinterpret_cast<float2*>(dq_s + DqBufferOffset<Tile>(row, col)) = make_float2(dq_acc[i], dq_acc[i + 1]);
    }
    sm90::FenceProxyAsync();  // the writer's TMA reductions read the buffer through the async proxy
    sm90::BarrierArrive(dq_full);
  };

  float dk_acc[kHeadDim / 2], dv_acc[kHeadDim / 2];
  Zero(dk_acc);
  Zero(dv_acc);
  sm90::BarrierWait(kv_full, 0);
  for (int j = 0; j < steps; ++j) {
    const int stage = j % Tile::kStages;
    const int64_t n = kh * p.Group() + j / query_tiles;
    const int t0 = first + (j % query_tiles) * Tile::kRows;
    const T* q_stage = q_s + stage * Tile::kQBytes / 2;
    const T* do_stage = do_s + stage * Tile::kQBytes / 2;

    float st_acc[Tile::kRows / 2], dpt_acc[Tile::kRows / 2];
    sm90::BarrierWait(&full[stage], (j / Tile::kStages) & 1);
    KeyMajorLogits<Tile>(k_s, v_s, q_stage, do_stage, key_row, st_acc, dpt_acc);
    uint32_t p_frag[Tile::kRows / 16][4], ds_frag[Tile::kRows / 16][4];
    KeyMajorGradients<T, kGeneral>(st_acc, dpt_acc, f, p, rules, b, n, t0, sw, lse_s + stage * Tile::kRows,
                                   delta_s + stage * Tile::kRows, dbias, p_frag, ds_frag);
    IssueKeyGradients<Tile, T, kHeadDim>(q_stage, do_stage, 0, p_frag, ds_frag, dv_acc, dk_acc);

    // ds^T into buffer j % 2 (128-byte swizzled rows of 64 queries, one row per key) while the
    // tensor cores run dv and dk, once both warpgroups have read its step j - 2 for their dq.
    // ds_frag[kk][r] holds accumulator elements 8 kk + 2 r and + 1.
    if (j >= 2) sm90::BarrierWait(&ds_empty[j % 2], ((j - 2) / 2) & 1);
#pragma unroll
    for (int kk = 0; kk < Tile::kRows / 16; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = 8 * kk + 2 * r;
        const int key = key_row + f.Row(i), query = f.Col(i);
        const int offset = key * 128 + (((query / 8) ^ (key % 8)) * 16) + (query % 8) * 2;
        *reinterpret_cast<uint32_t*>(ds_s + (j % 2) * Tile::kDsBytes + offset) = ds_frag[kk][r];
      }
    }
    sm90::FenceProxyAsync();
    sm90::BarrierArrive(&ds_full[j % 2]);
    // The dq of the step before, after dv and dk (both warpgroups' ds of it were stored a step ago,
    // so this rarely waits: the warpgroups are no longer held in step by a barrier).
    sm90::WgmmaWait<0>();  // dv and dk
    sm90::FenceRegisters(dv_acc);
    sm90::FenceRegisters(dk_acc);
    sm90::FenceRegisters(p_frag);
    sm90::FenceRegisters(ds_frag);
    sm90::BarrierArrive(&empty[stage]);
    if (j >= 1) {
      IssueDq(j - 1);
      FinishDq(j - 1);
    }
  }
  if (steps > 0) {
    IssueDq(steps - 1);
    FinishDq(steps - 1);
  }

  const float one[2] = {1.f, 1.f};
  const int64_t row_stride = p.kv_heads * p.head_dim;
  StoreTile<T>(dk_acc, f, one, dk + p.KeyRow(b, sw, kh), row_stride, int(p.kv_len) - sw, int(p.head_dim));
  StoreTile<T>(dv_acc, f, one, dv + p.KeyRow(b, sw, kh), row_stride, int(p.kv_len) - sw, int(p.head_dim));
#endif
}

// dq = dq_accum in T, 4 elements a thread.
template <typename T>
__global__ void CastKernel(const float4* __restrict__ in, T* __restrict__ out, int64_t vectors) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vectors; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = in[i];
    uint2 packed = {sm90::PackPair<T>(v.x, v.y), sm90::PackPair<T>(v.z, v.w)};
    reinterpret_cast<uint2*>(out)[i] = packed;
  }
}

// ---- launch ---------------------------------------------------------------------------------------

template <typename Kernel>
ffi::Error PrepareLaunch(Kernel kernel, int shared_bytes) {
  return CudaError(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes),
                   "attention backward (sm90): shared memory");
}

// The tensor maps of q and do (boxes of `rows` queries) and of k and v (boxes of `keys` keys).
struct BwdMaps {
  CUtensorMap q, d_out, k, v;
};

bool MakeMaps(const AttentionProblem& p, CUtensorMapDataType type, const void* d_out, const void* q, const void* k,
              const void* v, int rows, int keys, BwdMaps* maps) {
  auto encode = [&](CUtensorMap* map, const void* x, int64_t len, int64_t heads, int box) {
    return MakeTileMap(map, x, type, p.batch, len, heads, p.head_dim, box) == CUDA_SUCCESS;
  };
  return encode(&maps->q, q, p.q_len, p.heads, rows) && encode(&maps->d_out, d_out, p.q_len, p.heads, rows) &&
         encode(&maps->k, k, p.kv_len, p.kv_heads, keys) && encode(&maps->v, v, p.kv_len, p.kv_heads, keys);
}

ffi::Error EncodeError() {
  return ffi::Error(ffi::ErrorCode::kInternal, "jaxdnn: attention backward (sm90): cannot encode a TMA descriptor");
}

// The dq kernel, then the dk/dv kernel.
template <typename T, int kHeadDim, bool kGeneral>
ffi::Error LaunchSeparate(cudaStream_t stream, const AttentionProblem& p, CUtensorMapDataType type, const void* d_out,
                          const void* q, const void* k, const void* v, const float* lse, const float* delta, void* dq,
                          void* dk, void* dv, float* dbias) {
  using Dq = DqTile<kHeadDim>;
  using Dkv = DkvTile<kHeadDim>;
  BwdMaps dq_maps, dkv_maps;
  if (!MakeMaps(p, type, d_out, q, k, v, Dq::kRows, Dq::kKeys, &dq_maps) ||
      !MakeMaps(p, type, d_out, q, k, v, Dkv::kRows, Dkv::kKeys, &dkv_maps)) {
    return EncodeError();
  }
  auto dq_kernel = AttentionDqKernel<T, kHeadDim, kGeneral>;
  JAXDNN_RETURN_IF_ERROR(PrepareLaunch(dq_kernel, Dq::kSharedBytes));
  const int64_t dq_blocks = (p.q_len + Dq::kRows - 1) / Dq::kRows * p.heads * p.batch;
  dq_kernel<<<static_cast<unsigned>(dq_blocks), kThreads, Dq::kSharedBytes, stream>>>(
      dq_maps.q, dq_maps.d_out, dq_maps.k, dq_maps.v, p, lse, delta, static_cast<T*>(dq), dbias);
  JAXDNN_RETURN_IF_ERROR(LaunchError("attention dq (sm90)"));
  auto dkv_kernel = AttentionDkvKernel<T, kHeadDim, kGeneral>;
  JAXDNN_RETURN_IF_ERROR(PrepareLaunch(dkv_kernel, Dkv::kSharedBytes));
  const int64_t dkv_blocks = (p.kv_len + Dkv::kKeys - 1) / Dkv::kKeys * p.kv_heads * p.batch;
  dkv_kernel<<<static_cast<unsigned>(dkv_blocks), kThreads, Dkv::kSharedBytes, stream>>>(
      dkv_maps.q, dkv_maps.d_out, dkv_maps.k, dkv_maps.v, p, lse, delta, static_cast<T*>(dk), static_cast<T*>(dv));
  return LaunchError("attention dk/dv (sm90)");
}

// Head size 128: the fused kernel between zeroing dq_accum (and the semaphores, if ordered)
// and casting dq_accum to dq.
template <typename T, int kHeadDim, bool kGeneral>
ffi::Error LaunchFused(cudaStream_t stream, const AttentionProblem& p, CUtensorMapDataType type, const void* d_out,
                       const void* q, const void* k, const void* v, const float* lse, const float* delta, void* dq,
                       void* dk, void* dv, float* dbias, float* dq_accum, int* semaphores) {
  using Tile = FusedTile<kHeadDim>;
  BwdMaps maps;
  CUtensorMap dq_map;
  if (!MakeMaps(p, type, d_out, q, k, v, Tile::kRows, Tile::kKeys, &maps) ||
      MakeTileMap(&dq_map, dq_accum, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, p.batch, p.q_len, p.heads, p.head_dim,
                  Tile::kRows) != CUDA_SUCCESS) {
    return EncodeError();
  }
  const int64_t elements = p.batch * p.q_len * p.heads * p.head_dim;
  JAXDNN_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(dq_accum, 0, elements * 4, stream), "attention backward: memset"));
  if (semaphores != nullptr) {
    JAXDNN_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(semaphores, 0, FusedBackwardSemaphores(p) * 4, stream),
                                     "attention backward: memset"));
  }
  auto kernel = AttentionBwdFusedKernel<T, kHeadDim, kGeneral>;
  JAXDNN_RETURN_IF_ERROR(PrepareLaunch(kernel, Tile::kSharedBytes));
  const int64_t blocks = (p.kv_len + Tile::kKeys - 1) / Tile::kKeys * p.kv_heads * p.batch;
  kernel<<<static_cast<unsigned>(blocks), kThreads, Tile::kSharedBytes, stream>>>(
      maps.q, maps.d_out, maps.k, maps.v, dq_map, p, lse, delta, static_cast<T*>(dk), static_cast<T*>(dv),
      semaphores, dbias);
  JAXDNN_RETURN_IF_ERROR(LaunchError("attention backward (sm90)"));
  const int64_t vectors = elements / 4;
  const int cast_blocks = int(std::min<int64_t>((vectors + 255) / 256, 8192));
  CastKernel<T><<<cast_blocks, 256, 0, stream>>>(reinterpret_cast<const float4*>(dq_accum), static_cast<T*>(dq),
                                                  vectors);
  return LaunchError("attention backward (sm90): dq cast");
}

// The fused kernel unless its ordered dq adds would be chain-bound: each query tile's adds come one
// key tile after another, so with few query tiles in all (B N tiles < 2 per SM) and many key tiles
// for each (more than 4) the chains, not the products, would set the time.
template <int kHeadDim>
bool UseFused(const AttentionProblem& p) {
  using Tile = FusedTile<kHeadDim>;
  const int64_t query_tiles = (p.q_len + Tile::kRows - 1) / Tile::kRows;
  const int64_t key_tiles = (p.kv_len + Tile::kKeys - 1) / Tile::kKeys;
  int device = 0, sms = 132;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return p.batch * p.heads * query_tiles >= 2 * sms || key_tiles <= 4 * query_tiles;
}

template <typename T, bool kGeneral>
ffi::Error Dispatch(cudaStream_t stream, const AttentionProblem& p, CUtensorMapDataType type, const void* d_out,
                    const void* q, const void* k, const void* v, const float* lse, const float* delta, void* dq,
                    void* dk, void* dv, float* dbias, float* dq_accum, int* semaphores) {
  switch (PaddedHeadDim(p.head_dim)) {
    case 64:
      return LaunchSeparate<T, 64, kGeneral>(stream, p, type, d_out, q, k, v, lse, delta, dq, dk, dv, dbias);
    case 128:
      if (UseFused<128>(p)) {
        return LaunchFused<T, 128, kGeneral>(stream, p, type, d_out, q, k, v, lse, delta, dq, dk, dv, dbias,
                                             dq_accum, semaphores);
      }
      return LaunchSeparate<T, 128, kGeneral>(stream, p, type, d_out, q, k, v, lse, delta, dq, dk, dv, dbias);
    default:
      return LaunchSeparate<T, 256, kGeneral>(stream, p, type, d_out, q, k, v, lse, delta, dq, dk, dv, dbias);
  }
}

}  // namespace

bool FusedBackwardTakes(const AttentionProblem& p) { return PaddedHeadDim(p.head_dim) == 128; }

int64_t FusedBackwardSemaphores(const AttentionProblem& p) { return p.batch * p.heads * SemaphoreTiles(p.q_len); }

ffi::Error AttentionBwdSm90(cudaStream_t stream, const AttentionProblem& p, ffi::DataType dtype, const void* d_out,
                            const void* q, const void* k, const void* v, const float* lse, const float* delta,
                            void* dq, void* dk, void* dv, float* dbias, float* dq_accum, int* semaphores) {
  const bool bf16 = dtype == ffi::DataType::BF16;
  const CUtensorMapDataType type = bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const bool general = NeedsGeneralRules(p);
  auto dispatch = [&](auto tag) {
    using T = decltype(tag);
    return general ? Dispatch<T, true>(stream, p, type, d_out, q, k, v, lse, delta, dq, dk, dv, dbias, dq_accum,
                                       semaphores)
                   : Dispatch<T, false>(stream, p, type, d_out, q, k, v, lse, delta, dq, dk, dv, dbias, dq_accum,
                                        semaphores);
  };
  return bf16 ? dispatch(__nv_bfloat16{}) : dispatch(__half{});
}

}  // namespace attention_sm90
}  // namespace jaxdnn
