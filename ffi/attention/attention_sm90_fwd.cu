// Hopper flash-attention forward: o = softmax(logits) v and lse, on wgmma (attention_sm90.cuh says
// what the kernels share).
//
// One CTA per (b, n, tile of 128 queries); heavier tiles (later queries, under a causal mask) start
// first. The producer loads the tile's q once and streams the keys the tile can reach (causal,
// window and length block skipping) through kStages stages of k and v. Each consumer warpgroup owns
// 64 query rows: per key tile it computes s = q k^T (SS wgmma), masks and scales it, updates the
// online softmax (running max and sum in registers, o rescaled), and adds p v (RS wgmma: p stays in
// registers, v's tile is its MN-major operand), the softmax of one tile overlapping the p v of the
// one before. The epilogue divides by the row sums and writes o and lse = max + log(sum) (-inf,
// with o = 0, for a row with no key).
#include <type_traits>

#include "attention/attention_sm90.h"
#include "attention/attention_sm90.cuh"

namespace jaxdnn {
namespace attention_sm90 {
namespace {

template <int kHeadDim>
struct FwdTile {
  static constexpr int kRows = 128;                        // queries a CTA, 64 per consumer warpgroup
  static constexpr int kKeys = kHeadDim == 256 ? 64 : 128;  // keys a stage
  static constexpr int kStages = 2;
  static constexpr int kChunks = kHeadDim / 64;
  static constexpr int kQBytes = kRows * kHeadDim * 2;
  static constexpr int kKVBytes = kKeys * kHeadDim * 2;  // one k or v stage
  static constexpr int kBarrierOffset = kQBytes + 2 * kStages * kKVBytes;
  static constexpr int kSharedBytes = kBarrierOffset + 8 * (1 + 4 * kStages) + 1024;  // + alignment
};

template <typename T, int kHeadDim, bool kGeneral>
__global__ void __launch_bounds__(kThreads, 1)
    AttentionFwdKernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                       const __grid_constant__ CUtensorMap v_map, const AttentionProblem p, T* __restrict__ o,
                       float* __restrict__ lse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tile = FwdTile<kHeadDim>;
  extern __shared__ uint8_t shared_raw[];
  uint8_t* shared = sm90::AlignedShared(shared_raw);
  T* q_s = reinterpret_cast<T*>(shared);                              // [chunk][128 rows][64]
  T* k_s = reinterpret_cast<T*>(shared + Tile::kQBytes);              // [stage][chunk][kKeys][64]
  T* v_s = reinterpret_cast<T*>(shared + Tile::kQBytes + Tile::kStages * Tile::kKVBytes);
  uint64_t* q_full = reinterpret_cast<uint64_t*>(shared + Tile::kBarrierOffset);
  uint64_t* k_full = q_full + 1;
  uint64_t* k_empty = k_full + Tile::kStages;
  uint64_t* v_full = k_empty + Tile::kStages;
  uint64_t* v_empty = v_full + Tile::kStages;
  constexpr int kStageElems = Tile::kKVBytes / 2;

  const auto work = QueryTileWork::Of<Tile::kRows, Tile::kKeys>(p);
  const int t0 = work.t0, first = work.first, key_tiles = work.key_tiles;
  const int64_t n = work.n, b = work.b, kh = work.kh;

  const int warpgroup = threadIdx.x / kWarpgroup;
  if (threadIdx.x == 0) {
    sm90::BarrierInit(q_full, 1);
    for (int s = 0; s < Tile::kStages; ++s) {
      sm90::BarrierInit(&k_full[s], 1);
      sm90::BarrierInit(&v_full[s], 1);
      sm90::BarrierInit(&k_empty[s], 2 * kWarpgroup);
      sm90::BarrierInit(&v_empty[s], 2 * kWarpgroup);
    }
    sm90::BarrierInitFence();
  }
  __syncthreads();

  if (warpgroup == 0) {  // producer
    sm90::RegistersDecrease<kProducerRegisters>();
    if (threadIdx.x != 0) return;
    sm90::TmaPrefetchDescriptor(&k_map);
    sm90::TmaPrefetchDescriptor(&v_map);
    sm90::BarrierArriveExpectTx(q_full, Tile::kQBytes);
    for (int c = 0; c < Tile::kChunks; ++c) {
      sm90::TmaLoad4d(q_s + c * Tile::kRows * 64, &q_map, q_full, 64 * c, int(n), t0, int(b));
    }
    for (int j = 0; j < key_tiles; ++j) {
      const int stage = j % Tile::kStages;
      const uint32_t phase = (j / Tile::kStages) & 1;
      const int s0 = first + j * Tile::kKeys;
      sm90::BarrierWait(&k_empty[stage], phase ^ 1);
      sm90::BarrierArriveExpectTx(&k_full[stage], Tile::kKVBytes);
      for (int c = 0; c < Tile::kChunks; ++c) {
        sm90::TmaLoad4d(k_s + stage * kStageElems + c * Tile::kKeys * 64, &k_map, &k_full[stage], 64 * c, int(kh), s0,
                        int(b));
      }
      sm90::BarrierWait(&v_empty[stage], phase ^ 1);
      sm90::BarrierArriveExpectTx(&v_full[stage], Tile::kKVBytes);
      for (int c = 0; c < Tile::kChunks; ++c) {
        sm90::TmaLoad4d(v_s + stage * kStageElems + c * Tile::kKeys * 64, &v_map, &v_full[stage], 64 * c, int(kh), s0,
                        int(b));
      }
    }
    return;
  }

  // Consumers. Tile j's softmax runs while the tensor cores add the previous tile's p v: per
  // iteration, s_j = q k_j^T and o += p_{j-1} v_{j-1} are issued together, the softmax of s_j waits
  // only for the first, and o is rescaled (to tile j's max) once the second is done. The two
  // warpgroups also take turns to issue (named barriers 2 and 3), so that one's softmax runs while
  // the other's products occupy the tensor cores (head sizes up to 128).
  sm90::RegistersIncrease<kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const Fragment f(threadIdx.x % kWarpgroup);
  const int tw = t0 + 64 * consumer;  // the warpgroup's first query
  const IndexRules rules(p, b);
  const float scale_log2 = p.scale * kLog2e;

  float o_acc[kHeadDim / 2];
  Zero(o_acc);
  float row_max[2] = {-INFINITY, -INFINITY};  // running max of the log2-scaled logits
  float row_sum[2] = {0.f, 0.f};              // this thread's part of the running sum
  float s_acc[Tile::kKeys / 2];
  uint32_t p_frag[Tile::kKeys / 16][4];

  auto stage_of = [](int j) { return j % Tile::kStages; };
  auto phase_of = [](int j) { return uint32_t(j / Tile::kStages) & 1; };
  // s = q k_j^T: 64 x kKeys, reduced over the head's 64-column chunks, 16 columns a step (one group).
  auto issue_s = [&](int j) {
    const T* k_stage = k_s + stage_of(j) * kStageElems;
    sm90::BarrierWait(&k_full[stage_of(j)], phase_of(j));
    sm90::WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const int chunk = kk / 4, step = kk % 4;
      const uint64_t a = sm90::DescriptorKMajor(q_s + chunk * Tile::kRows * 64 + consumer * 64 * 64 + step * 16);
      const uint64_t bk = sm90::DescriptorKMajor(k_stage + chunk * Tile::kKeys * 64 + step * 16);
      sm90::Wgmma<Tile::kKeys, T>::template SS<0>(s_acc, a, bk, kk > 0);
    }
    sm90::WgmmaCommit();
  };
  // o += p v_j: v's tile is the MN-major B operand (its rows are the reduction axis) (one group).
  auto issue_pv = [&](int j) {
    const T* v_stage = v_s + stage_of(j) * kStageElems;
    sm90::BarrierWait(&v_full[stage_of(j)], phase_of(j));
    sm90::WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < Tile::kKeys / 16; ++kk) {
      const uint64_t bv = sm90::DescriptorMNMajor(v_stage + kk * 16 * 64, Tile::kKeys * 128);
      sm90::Wgmma<kHeadDim, T>::template RS<1>(o_acc, p_frag[kk], bv, 1);
    }
    sm90::WgmmaCommit();
  };
  // Tile j's logits in log2 units (-inf where dropped), the new running max, and p in s_acc
  // (dropped by dropout, the sums undropped); returns through `factor` the rescaling of o. A row's
  // max and sum over the thread's kKeys / 4 elements of it are taken as 4 interleaved partials
  // (short dependency chains: two consumer warps a scheduler cannot hide a 32-long one).
  auto softmax = [&](int j, float (&factor)[2]) {
    const int s0 = first + j * Tile::kKeys;
    const bool whole = !kGeneral && rules.Whole(tw, tw + 64, s0, s0 + Tile::kKeys);
    float partial[2][4];  // [row][partial]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int k = 0; k < 4; ++k) partial[h][k] = -INFINITY;
    }
    // One loop per kind of tile (a uniform branch), so a whole tile runs no index tests.
    auto logits = [&](auto masked) {
#pragma unroll
      for (int i = 0; i < Tile::kKeys / 2; ++i) {
        const int t = tw + f.Row(i), s = s0 + f.Col(i);
        float x;
        if constexpr (kGeneral) {
          x = p.Attends(b, n, t, s) ? p.Logit(s_acc[i], b, n, t, s) * kLog2e : -INFINITY;
        } else {
          x = !decltype(masked)::value || rules.Attends(t, s) ? s_acc[i] * scale_log2 : -INFINITY;
        }
        s_acc[i] = x;
        float& m = partial[Fragment::Half(i)][(i >> 2) % 2 * 2 + (i & 1)];
        m = fmaxf(m, x);
      }
    };
    if (whole) {
      logits(std::false_type{});
    } else {
      logits(std::true_type{});
    }
    float base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float tile_max = fmaxf(fmaxf(partial[h][0], partial[h][1]), fmaxf(partial[h][2], partial[h][3]));
      const float new_max = fmaxf(row_max[h], QuadMax(tile_max));
      base[h] = new_max == -INFINITY ? 0.f : new_max;  // a row with no key yet keeps p = 0
      factor[h] = exp2f(row_max[h] - base[h]);
      row_max[h] = new_max;
#pragma unroll
      for (int k = 0; k < 4; ++k) partial[h][k] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < Tile::kKeys / 2; ++i) {
      float prob = exp2f(s_acc[i] - base[Fragment::Half(i)]);
      partial[Fragment::Half(i)][(i >> 2) % 2 * 2 + (i & 1)] += prob;  // the normalizer is undropped
      if constexpr (kGeneral) prob *= DropoutScale(p, b, n, tw + f.Row(i), s0 + f.Col(i));
      s_acc[i] = prob;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_sum[h] = row_sum[h] * factor[h] + ((partial[h][0] + partial[h][1]) + (partial[h][2] + partial[h][3]));
    }
  };

  // Turns: warpgroup w waits at barrier 2 + w before issuing and then lets the other one go; the
  // second starts by letting the first go, and skips its last hand-over (nobody waits for it).
  // Head size 256 is bound by the products (and short of registers for this): no turns. (H200,
  // S 4096: turns made H 128 3% faster, H 64 within 1.5% either way.)
  constexpr bool kTurns = kHeadDim <= 128;
  const int issues = key_tiles + 1;
  int issued = 0;
  auto take_turn = [&]() {
    if constexpr (kTurns) sm90::NamedBarrierSync(2 + consumer, 2 * kWarpgroup);
  };
  auto pass_turn = [&]() {
    if constexpr (kTurns) {
      if (++issued < issues || consumer == 0) sm90::NamedBarrierArrive(3 - consumer, 2 * kWarpgroup);
    }
  };

  sm90::BarrierWait(q_full, 0);
  if (key_tiles > 0) {
    float factor[2];
    if (kTurns && consumer == 1) sm90::NamedBarrierArrive(2, 2 * kWarpgroup);
    take_turn();
    issue_s(0);
    pass_turn();
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(s_acc);
    sm90::BarrierArrive(&k_empty[stage_of(0)]);
    softmax(0, factor);  // o is still 0: no rescaling
    ToOperand<T>(s_acc, p_frag);
    for (int j = 1; j < key_tiles; ++j) {
      take_turn();
      issue_s(j);
      issue_pv(j - 1);
      pass_turn();
      sm90::WgmmaWait<1>();  // s_j is done (groups complete in order), p_{j-1} v_{j-1} may not be
      sm90::FenceRegisters(s_acc);
      sm90::BarrierArrive(&k_empty[stage_of(j)]);
      softmax(j, factor);
      sm90::WgmmaWait<0>();
      sm90::FenceRegisters(o_acc);
      sm90::FenceRegisters(p_frag);  // read by the wgmma until here: not reused before
      sm90::BarrierArrive(&v_empty[stage_of(j - 1)]);
#pragma unroll
      for (int i = 0; i < kHeadDim / 2; ++i) o_acc[i] *= factor[Fragment::Half(i)];
      ToOperand<T>(s_acc, p_frag);
    }
    take_turn();
    issue_pv(key_tiles - 1);
    pass_turn();
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(o_acc);
    sm90::BarrierArrive(&v_empty[stage_of(key_tiles - 1)]);
  }

  // o = acc / sum and lse, for the rows in the tensor; 0 and -inf for a row with no key (or past
  // its sequence length).
  const int q_limit = int(p.QueryLimit(b));
  float inv_sum[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = QuadSum(row_sum[h]);
    const int t = tw + f.row + 8 * h;
    const bool live = sum > 0.f && t < q_limit;
    inv_sum[h] = live ? 1.f / sum : 0.f;
    if (f.col == 0 && t < p.q_len) lse[p.StatIndex(b, n, t)] = live ? (row_max[h] + log2f(sum)) * kLn2 : -INFINITY;
  }
  const int64_t row_stride = p.heads * p.head_dim;
  StoreTile<T>(o_acc, f, inv_sum, o + p.QueryRow(b, tw, n), row_stride, int(p.q_len) - tw, int(p.head_dim));
#endif
}

template <typename T, int kHeadDim, bool kGeneral>
ffi::Error Launch(cudaStream_t stream, const AttentionProblem& p, const CUtensorMap& q_map, const CUtensorMap& k_map,
                  const CUtensorMap& v_map, void* o, float* lse) {
  using Tile = FwdTile<kHeadDim>;
  auto kernel = AttentionFwdKernel<T, kHeadDim, kGeneral>;
  JAXDNN_RETURN_IF_ERROR(CudaError(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSharedBytes),
      "attention forward (sm90): shared memory"));
  const int64_t blocks = (p.q_len + Tile::kRows - 1) / Tile::kRows * p.heads * p.batch;
  kernel<<<static_cast<unsigned>(blocks), kThreads, Tile::kSharedBytes, stream>>>(q_map, k_map, v_map, p,
                                                                                   static_cast<T*>(o), lse);
  return LaunchError("attention forward (sm90)");
}

template <typename T>
ffi::Error Dispatch(cudaStream_t stream, const AttentionProblem& p, const CUtensorMap& q_map,
                    const CUtensorMap& k_map, const CUtensorMap& v_map, void* o, float* lse) {
  const bool general = NeedsGeneralRules(p);
  switch (PaddedHeadDim(p.head_dim)) {
    case 64:
      return general ? Launch<T, 64, true>(stream, p, q_map, k_map, v_map, o, lse)
                     : Launch<T, 64, false>(stream, p, q_map, k_map, v_map, o, lse);
    case 128:
      return general ? Launch<T, 128, true>(stream, p, q_map, k_map, v_map, o, lse)
                     : Launch<T, 128, false>(stream, p, q_map, k_map, v_map, o, lse);
    default:
      return general ? Launch<T, 256, true>(stream, p, q_map, k_map, v_map, o, lse)
                     : Launch<T, 256, false>(stream, p, q_map, k_map, v_map, o, lse);
  }
}

}  // namespace

bool Sm90Takes(const AttentionProblem& p, ffi::DataType dtype) {
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) return false;
  // TMA needs rows of a multiple of 16 bytes, and every extent >= 1.
  if (p.batch < 1 || p.q_len < 1 || p.kv_len < 1 || p.heads < 1 || p.head_dim % 8 != 0 || p.head_dim > 256) {
    return false;
  }
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    return false;
  }
  return major == 9;
}

ffi::Error AttentionFwdSm90(cudaStream_t stream, const AttentionProblem& p, ffi::DataType dtype, const void* q,
                            const void* k, const void* v, void* o, float* lse) {
  const bool bf16 = dtype == ffi::DataType::BF16;
  const CUtensorMapDataType type = bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  CUtensorMap q_map, k_map, v_map;
  if (MakeTileMap(&q_map, q, type, p.batch, p.q_len, p.heads, p.head_dim, FwdTile<64>::kRows) != CUDA_SUCCESS ||
      MakeTileMap(&k_map, k, type, p.batch, p.kv_len, p.kv_heads, p.head_dim,
                  PaddedHeadDim(p.head_dim) == 256 ? FwdTile<256>::kKeys : FwdTile<64>::kKeys) != CUDA_SUCCESS ||
      MakeTileMap(&v_map, v, type, p.batch, p.kv_len, p.kv_heads, p.head_dim,
                  PaddedHeadDim(p.head_dim) == 256 ? FwdTile<256>::kKeys : FwdTile<64>::kKeys) != CUDA_SUCCESS) {
    return ffi::Error(ffi::ErrorCode::kInternal, "jaxdnn: attention forward (sm90): cannot encode a TMA descriptor");
  }
  return bf16 ? Dispatch<__nv_bfloat16>(stream, p, q_map, k_map, v_map, o, lse)
              : Dispatch<__half>(stream, p, q_map, k_map, v_map, o, lse);
}

}  // namespace attention_sm90
}  // namespace jaxdnn
