// Persistent recurrence kernels (see rnn_persistent.h): one cooperative launch per layer, instead of
// the baseline's block per batch row re-reading W_hh from L2 at every step.
//
// Decomposition. The H hidden units are split across P blocks (at most one per SM), `units` each.
// A bidirectional layer's two directions run in one launch of 2P blocks, each direction over half
// of the SMs (the backward with its own barrier counter); where that plan does not fit, one launch
// a direction.
// A block copies the W_hh entries its units need into shared memory once, then loops over time:
// - forward step: every block reads the whole previous h [B, H] (from h_seq, in L2) in chunks of
//   batch rows, awaiting each value's publication (below), multiplies it by its gate rows of W_hh
//   (kGates * units rows), and runs the cell math of rnn_cell.h for its own units, writing this
//   step's h (and c, activations) to global memory;
// - backward step: every block first computes the gate gradients of its own units (pointwise, from
//   the gradient reaching h that it keeps in shared memory) and writes them to global memory, then
//   reads every unit's gate gradients back and multiplies them by its columns of W_hh (W_hh^T
//   restricted to its units) to get the gradient reaching its units of h_prev.
// The backward separates the writes of a step from the reads of them by a grid-wide barrier; the
// forward by the values themselves (published values, below): no block waits for more than the h
// it reads, and no fence or counter round trip lies on the step's path (H200, (512, 16, 512, 512)
// LSTM bf16: forward 2.39 -> 2.10 ms). The backward's gate gradients polled alike ran twice as slow
// (there fwd+bwd 5.7 -> 12.1 ms in a probe build), so the backward keeps the barrier. Staging each
// step's gate gradients in shared memory by cluster multicast (one L2 read a cluster of 2 to 8
// blocks, not one a block) gained nothing there: the step is not bound by the product's L2 reads;
// streamed through a ring of slots at (256, 64, 1024, 1024), where a step's do not fit, it ran 1.9x
// slower (bulk copies and cluster-wide slot releases a chunk of rows cost more than the L2 reads).
// A thread with one (row, unit) pair loads its cell's operands a step ahead into registers (the
// forward keeps c or the GRU's h there too): the cell then waits on no global load (H200, bf16
// fwd+bwd against main's build in one session: (512, 16, 512, 512) LSTM 5.09 -> 4.79 ms, GRU 4.93
// -> 4.54; 2-layer bidirectional (256, 32, 512, 512) LSTM 9.25 -> 8.99).
// A layer of one batch row, or of 2 to 16 rows with small W_hh slices, runs instead on the cluster
// kernels (below; sm_90), whose blocks exchange each step's values through distributed shared
// memory, with no grid barrier. At (512, 16, 512, 512) a bf16 forward on clusters of 16 blocks, W_hh
// in registers and h sent by st.async, was no faster than this kernel (H200, 2026-12-02: 1620 against
// 1636 us a forward), so larger batches stay here.
// The recurrent products are exact float32 sums over CUDA cores (W_hh converted from its dtype on
// the fly), as the baseline and the CPU kernel compute them, in a different summation order; or,
// where the targets' attributes allow reduced products, mma.sync on tensor cores with float32 sums:
// - the forward with W_hh and the multiplied state rounded to TF32 (tf32; cuDNN's default math for
//   float32 RNNs), or, for a bfloat16 W_hh with H a multiple of 64, with bfloat16 copies of the
//   state (bf16_state): the cells publish each h twice, float32 in h_seq and bfloat16 in the
//   exchange rows that the product polls, half the bytes a step (H200, LSTM (512, 16, 512, 512)
//   bf16 forward 1.91 -> 1.74-1.77 ms, on two machines);
// - the backward of a bfloat16 W_hh with its gate gradients rounded to bfloat16 (bf16_gradients:
//   PersistentBwdKernel). A float32 W_hh's backward stays exact: its product per block is a few
//   columns of W_hh (units x batch rows, K = G), where TF32 tiles split over K ran slower than the
//   CUDA cores (H100: LSTM fwd+bwd 1.10-1.14x the time); the tensor-core cluster backward keeps
//   float32 accuracy by splitting each gate gradient in two.
//
// Barrier (backward). A monotone arrival counter in global memory per direction: after a step each
// of the direction's blocks adds one; before the next it waits until the counter reaches (steps
// done) * P. The launch is cooperative, so all blocks are resident and the spin cannot deadlock. No
// workspace operand exists in the targets' ABI, so the counter borrows the first word of the
// direction's part of a result that is written last (dh0, batch row 0): the handler zeroes it, and
// the direction's block 0, which owns that word, writes its final values only after every block of
// the direction has arrived for the last time, i.e. has left its last wait.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/cuda_common.cuh"
#include "common/sm90_async.cuh"
#include "rnn/rnn_persistent.h"

namespace jaxdnn {
namespace {

// Threads a block (a template parameter of the kernels and their block products). The forward runs
// 16 warps: they hide more of its products' and row loads' latency (H100, LSTM (256, 64, 1024, 1024)
// forward 6.50 -> 5.92 ms against 8 warps; 1% slower at B 1). The backward runs 16 warps when its
// blocks hold at least kWideBackward (row, unit) pairs (there fwd+bwd 16.3 -> 13.4 ms), else 8: with
// few pairs a step is short and the extra warps cost more in split sums and synchronization than
// they hide (backward about 19% slower at (100, 1, 256, 256), 3% at (512, 16, 512, 512)). With the
// bf16 gradient ring (Bf16GradProduct) the bar is kWideBf16Backward: at 128 pairs 8 warps were faster
// (H200, bf16 fwd+bwd, 2026-12-01: LSTM (512, 16, 512, 512) 4.39/4.29 -> 4.29/4.20 ms, GRU
// 4.13/4.19 -> 4.08/4.15, bidirectional LSTM 5.00/4.74 -> 4.66/4.54).
constexpr int kNarrow = 256, kWide = 512;
constexpr int64_t kWideBackward = 128, kWideBf16Backward = 256;
// The backward's blocks hold at least kFewestBackwardPairs (row, unit) pairs where H allows (batches
// of 1 to 3): there a step is the barrier's and the gate gradients' L2 round trips, and fewer, wider
// blocks make fewer of them (H200, (100, 1, 256, 256): 8 units a block instead of 2, fwd+bwd
// 0.717-0.738 -> 0.679-0.692 ms for the LSTM and the GRU). With the bf16 gradient ring they hold at
// least kMmaN units, the product's full n tile: every block reads all of a step's gate gradients
// through L2 (the product took 956 us of a no-wait step's 1610 at LSTM (512, 16, 512, 512)), and
// with 4 units a block the tile was half empty, twice the blocks reading them (H200, bf16 fwd+bwd,
// 2026-12-01: LSTM (512, 16, 512, 512) 4.37/4.38 -> 4.09/4.20 ms, GRU 4.29/4.26 -> 4.08/4.15; the
// same 8 units with float32 W_hh, no ring, 4.92/4.86 -> 5.65/5.60: those keep 4).
constexpr int64_t kFewestBackwardPairs = 8;
// One warp's tile of a block product: 4 rows x 8 batch rows, 32 sums, one per lane after the
// reduction across lanes.
constexpr int kTileRows = 4;
constexpr int kTileCols = 8;
constexpr int kMaxChunk = 32;  // batch rows per pass over the shared input buffer

// --- grid barrier -----------------------------------------------------------------------------

__device__ __forceinline__ void GridArrive(unsigned* counter) {
  __syncthreads();  // the block's writes of this step are issued
  // Release at GPU scope: the block's writes (ordered before by the barrier) are visible to any
  // block that acquires the new count.
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
}

__device__ __forceinline__ void GridWait(const unsigned* counter, unsigned target) {
  if (threadIdx.x == 0) {
    unsigned seen;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen < target);
  }
  __syncthreads();  // the acquire orders the whole block's later reads after it
}

// --- published values (forward) -----------------------------------------------------------------
// The forward's h carries its own readiness instead of a grid barrier: the handler fills h_seq with
// kPending words before the launch; each slot is written once, at its step, through Publish, which
// never stores kPending (a NaN with every payload bit set becomes the canonical NaN), and a block
// that reads another's h reloads a word until it is no longer kPending. Every slot a step reads was
// written the step before by the same rule (a row's h_prev exists exactly while step < its length),
// so every wait ends; the cooperative launch keeps all blocks resident. Single words are atomic, so
// a word is either pending or final; relaxed loads through L2 (never a stale L1 line) observe it.
constexpr uint32_t kPending = 0xffffffffu;  // the fill: cudaMemsetAsync with byte 0xff
constexpr int kPendingByte = 0xff;

__device__ __forceinline__ void Publish(float* p, float v) {
  *p = __float_as_uint(v) == kPending ? __uint_as_float(0x7fffffffu) : v;
}

__device__ __forceinline__ bool Pending(float v) { return __float_as_uint(v) == kPending; }

__device__ __forceinline__ bool Pending(const float4& v) {
  // kPending is the largest word: any word pending <=> the largest is.
  return max(max(__float_as_uint(v.x), __float_as_uint(v.y)), max(__float_as_uint(v.z), __float_as_uint(v.w))) ==
         kPending;
}

// A relaxed load at GPU scope: through L2, and never merged with or hoisted out of a polling loop.
__device__ __forceinline__ uint4 LoadRelaxed(const uint4* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ float4 LoadRelaxed(const float4* p) {
  const uint4 v = LoadRelaxed(reinterpret_cast<const uint4*>(p));
  return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
}

__device__ __forceinline__ float LoadRelaxed(const float* p) {
  float v;
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}

// v = *p once no word of it is pending (v holds an earlier load of p).
template <typename T>
__device__ __forceinline__ void AwaitPublished(const T* p, T& v) {
  while (Pending(v)) v = LoadRelaxed(p);
}

// The bfloat16 copy of a published h (Bf16Exchange, forward): pending while every bit is set
// (0xffff, the same fill); a value rounding to that NaN is stored as another NaN.
constexpr uint16_t kPendingBf16 = 0xffffu;

__device__ __forceinline__ void PublishBf16(__nv_bfloat16* p, float v) {
  const __nv_bfloat16 r = __float2bfloat16_rn(v);
  *p = __bfloat16_as_ushort(r) == kPendingBf16 ? __ushort_as_bfloat16(0x7fffu) : r;
}

// A forward cell's h of step row `at`: h_seq's float32 word and, when given, its bfloat16 copy.
__device__ __forceinline__ void PublishH(float* h_seq, const Bf16Exchange& exchange, int64_t at, float h) {
  Publish(h_seq + at, h);
  if (exchange.rows != nullptr) PublishBf16(exchange.rows + at, h);
}

// dst[i * ld + (0, width)] = src(i)[0, width) for i < rows, zeros where src(i) is null: a warp per
// row, 16-byte loads where the row allows. The rows were written by other blocks of this launch, so
// they are read through L2 (__ldcg), never from a possibly stale L1 line; `poll`: they may still be
// being published (AwaitPublished).
template <int kWarps, typename Src>
__device__ void LoadRows(float* dst, int ld, int rows, int width, Src src, bool poll) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = warp; i < rows; i += kWarps) {
    const float* from = src(i);
    float* to = dst + i * ld;
    if (from != nullptr && width % 4 == 0 && reinterpret_cast<uintptr_t>(from) % 16 == 0) {
      for (int k = lane; k < width / 4; k += 32) {
        const float4* p = reinterpret_cast<const float4*>(from) + k;
        float4 v = __ldcg(p);
        if (poll) AwaitPublished(p, v);
        reinterpret_cast<float4*>(to)[k] = v;
      }
    } else {
      for (int k = lane; k < width; k += 32) {
        float v = from != nullptr ? __ldcg(from + k) : 0.f;
        if (poll && from != nullptr) AwaitPublished(from + k, v);
        to[k] = v;
      }
    }
  }
}

// Starts moving a step's own per-unit operands from HBM to L2 before the step's waits, so that the
// cell math after it does not wait on HBM.
__device__ __forceinline__ void PrefetchL2(const float* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// --- block product ----------------------------------------------------------------------------

// One round of WarpTransposeSum: a lane keeps the half of v[0, 2 width) that its lane bit `width`
// selects, adds the partner lane's copy of that half, and leaves it in v[0, width).
template <int kWidth>
__device__ __forceinline__ void TransposeSumRound(float (&v)[32], int lane) {
  const bool upper = lane & kWidth;
#pragma unroll
  for (int i = 0; i < kWidth; ++i) {
    const float send = upper ? v[i] : v[i + kWidth];
    const float keep = upper ? v[i + kWidth] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kWidth);
  }
}

// Sums v[i] over the warp's lanes for all 32 i at once (31 shuffles): lane l returns the sum of v[l].
__device__ __forceinline__ float WarpTransposeSum(float (&v)[32], int lane) {
  TransposeSumRound<16>(v, lane);
  TransposeSumRound<8>(v, lane);
  TransposeSumRound<4>(v, lane);
  TransposeSumRound<2>(v, lane);
  TransposeSumRound<1>(v, lane);
  return v[0];
}

// out[0, kVec) = p[0, kVec) as floats, p aligned to kVec elements. kGlobal: p was written by other
// blocks of this launch and is read through L2 (__ldcg), never from a possibly stale L1 line.
template <int kVec, bool kGlobal = false, typename T>
__device__ __forceinline__ void LoadVec(const T* p, float (&out)[kVec]) {
  struct alignas(kVec * sizeof(T)) Pack {
    T v[kVec];
  };
  Pack pack;
  if constexpr (kGlobal && kVec == 4) {
    static_assert(std::is_same_v<T, float>);
    const float4 v = __ldcg(reinterpret_cast<const float4*>(p));
    pack = Pack{{v.x, v.y, v.z, v.w}};
  } else if constexpr (kGlobal) {
    pack.v[0] = __ldcg(p);
  } else {
    pack = *reinterpret_cast<const Pack*>(p);
  }
#pragma unroll
  for (int c = 0; c < kVec; ++c) out[c] = ToFloat(pack.v[c]);
}

// store(r, c, sum_k w[r * ldw + k] * x_row(c)[k]) for r < rows, c < cols, as exact float32 sums on
// CUDA cores: w in shared memory; x_row(c) a row of K floats in shared memory, or (kGlobal)
// in global memory, written by other blocks of this launch and so read through L2. Warps take tiles
// of kTileR x kTileC (32 sums); when there are fewer tiles than warps, the warps of a tile split K
// and `partial` (kWarps * 32 floats) holds their sums, added in a fixed order (the result is
// deterministic). Lanes stride along k, 4 elements a lane when K is a multiple of 4 (every row of w
// and x is then 4-element aligned: the callers' row strides are multiples of 4 elements, K plus 16
// bytes or FragmentStride, and XLA's buffers are aligned), so the shared-memory reads are
// conflict-free and the global ones coalesced 16-byte loads, unrolled so that a lane has several in
// flight. Ends with the block synchronized.
template <int kTileR, int kTileC, bool kGlobal, int kThreads, typename W, typename XRow, typename Store>
__device__ void BlockMatmul(const W* w, int ldw, XRow x_row, int rows, int cols, int K, Store store,
                            float* partial) {
  static_assert(kTileR * kTileC == 32, "a tile's sums are one per lane");
  constexpr int kWarps = kThreads / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tiles_r = (rows + kTileR - 1) / kTileR;
  const int tiles = tiles_r * ((cols + kTileC - 1) / kTileC);
  const int splits = tiles >= kWarps ? 1 : std::max(1, std::min(kWarps / tiles, (K + 31) / 32));
  // The sum of one tile's (split's) k range, vectorized by kVec.
  auto tile_sum = [&](auto vec, int r0, int c0, int split) {
    constexpr int kVec = decltype(vec)::value;
    int w_off[kTileR];  // rows and columns past the edge repeat the last one
    const float* x_at[kTileC];
#pragma unroll
    for (int i = 0; i < kTileR; ++i) w_off[i] = std::min(r0 + i, rows - 1) * ldw;
#pragma unroll
    for (int j = 0; j < kTileC; ++j) x_at[j] = x_row(std::min(c0 + j, cols - 1));
    float v[32] = {};
#pragma unroll(kGlobal ? (kThreads > kNarrow ? 4 : 8) / kVec : 1)  // 16 warps: half as deep, as many bytes in flight
    for (int k = (split * 32 + lane) * kVec; k < K; k += 32 * kVec * splits) {
      float wv[kTileR][kVec], xv[kTileC][kVec];
#pragma unroll
      for (int i = 0; i < kTileR; ++i) LoadVec<kVec>(w + w_off[i] + k, wv[i]);
#pragma unroll
      for (int j = 0; j < kTileC; ++j) LoadVec<kVec, kGlobal>(x_at[j] + k, xv[j]);
#pragma unroll
      for (int c = 0; c < kVec; ++c) {
#pragma unroll
        for (int i = 0; i < kTileR; ++i) {
#pragma unroll
          for (int j = 0; j < kTileC; ++j) v[i * kTileC + j] = fmaf(wv[i][c], xv[j][c], v[i * kTileC + j]);
        }
      }
    }
    return WarpTransposeSum(v, lane);
  };
  for (int item = warp; item < tiles * splits; item += kWarps) {
    const int tile = item % tiles, split = item / tiles;
    const int r0 = (tile % tiles_r) * kTileR, c0 = (tile / tiles_r) * kTileC;
    const float sum = K % 4 == 0 ? tile_sum(std::integral_constant<int, 4>{}, r0, c0, split)
                                 : tile_sum(std::integral_constant<int, 1>{}, r0, c0, split);
    const int r = r0 + lane / kTileC, c = c0 + lane % kTileC;
    if (splits > 1) {
      partial[item * 32 + lane] = sum;
    } else if (r < rows && c < cols) {
      store(r, c, sum);
    }
  }
  __syncthreads();
  if (splits == 1) return;
  for (int e = threadIdx.x; e < tiles * 32; e += kThreads) {
    const int tile = e / 32, l = e % 32;
    const int r = (tile % tiles_r) * kTileR + l / kTileC, c = (tile / tiles_r) * kTileC + l % kTileC;
    float sum = 0.f;
    for (int sp = 0; sp < splits; ++sp) sum += partial[(sp * tiles + tile) * 32 + l];
    if (r < rows && c < cols) store(r, c, sum);
  }
  __syncthreads();
}

// --- TF32 tensor-core block product -----------------------------------------------------------
// mma.sync m16n8k8 with TF32 operands and float32 sums (Tf32, MmaTf32 and the fragments' layout:
// common/cuda_common.cuh).
constexpr int kMmaM = 16, kMmaN = 8, kMmaK = 8, kMmaTile = kMmaM * kMmaN;
// The product walks k in blocks of 32: a lane loads 8 consecutive elements of each of its rows a
// block (16-byte loads) and feeds them to the block's 4 mmas.
constexpr int kKBlock = 4 * kMmaK;

__host__ __device__ constexpr int64_t KPadded(int64_t K) { return (K + kKBlock - 1) / kKBlock * kKBlock; }

// Row stride (elements) of an operand of element size `bytes` in shared memory for the TF32
// product: at least KPadded(K), and such that the 16-byte loads of the two rows g, g + 1 that share
// a phase of a warp's load hit disjoint banks (float: 32 bytes a lane, rows 16 bytes apart modulo
// 32; 2-byte types: 16 bytes a lane, rows 64 bytes apart modulo 128).
__host__ __device__ constexpr int64_t FragmentStride(int64_t K, int64_t bytes) {
  return bytes == 4 ? KPadded(K) + 4 : KPadded(K) + (KPadded(K) % 64 == 0 ? 32 : 0);
}

// p[0, 8) (shared memory, 16-byte aligned) as TF32 operand bits: floats rounded when kRound, else
// taken as stored (StoredWeight made them TF32 values); bfloat16 and float16 values are TF32 values.
// A bfloat16 is the upper half of its float's bits: one shift or one mask a value (the generic
// conversion took two instructions a value).
template <bool kRound, typename T>
__device__ __forceinline__ void LoadTf32x8(const T* p, uint32_t (&out)[8]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};  // element 2 i in the low half of word i
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = words[i] << 16;
      out[2 * i + 1] = words[i] & 0xffff0000u;
    }
    return;
  }
  struct alignas(16) Pack {
    T v[8];
  };
  const Pack pack = *reinterpret_cast<const Pack*>(p);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float v = ToFloat(pack.v[i]);
    out[i] = kRound && std::is_same_v<T, float> ? Tf32(v) : __float_as_uint(v);
  }
}

// out[m * out_m + n * out_n] = sum_k a_row(m)[k] b_row(n)[k] for m < M, n < N, k < Kp, on TF32
// tensor cores with float32 sums. a_row and b_row point to shared-memory rows of Kp elements (a
// multiple of kKBlock, zero past the data; strides by FragmentStride). The k of a block are taken in
// a permuted order that lets each lane load 8 consecutive elements of its rows: in mma s (0..3) of
// a block, fragment position t holds k = 8 t + 2 s and position t + 4 holds 8 t + 2 s + 1, for both
// operands alike (so each product pairs equal k, and the block's 32 k are each summed once).
// Warps take 16 x 8 tiles; when there are fewer tiles than warps, the warps of a tile split the k
// blocks and `partial` (kWarps * kMmaTile floats) holds their sums, added in a fixed order. A warp
// alternates two accumulators over its mmas. Rows and columns past the edge repeat the last one
// (their sums are dropped). Ends with the block synchronized.
template <int kThreads, bool kRoundA, bool kRoundB, typename ARow, typename BRow>
__device__ void MmaBlockProduct(ARow a_row, BRow b_row, int M, int N, int Kp, float* out, int out_m, int out_n,
                                float* partial) {
  constexpr int kWarps = kThreads / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int tiles_m = (M + kMmaM - 1) / kMmaM;
  const int tiles = tiles_m * ((N + kMmaN - 1) / kMmaN);
  const int blocks = Kp / kKBlock;
  const int splits = tiles >= kWarps ? 1 : std::max(1, std::min(kWarps / tiles, blocks));
  for (int item = warp; item < tiles * splits; item += kWarps) {
    const int tile = item % tiles, split = item / tiles;
    const int m0 = (tile % tiles_m) * kMmaM, n0 = (tile / tiles_m) * kMmaN;
    const auto* a_lo = a_row(std::min(m0 + g, M - 1)) + 8 * t;
    const auto* a_hi = a_row(std::min(m0 + g + 8, M - 1)) + 8 * t;
    const auto* b = b_row(std::min(n0 + g, N - 1)) + 8 * t;
    float acc[2][4] = {};
#pragma unroll 2
    for (int blk = split; blk < blocks; blk += splits) {
      uint32_t lo[8], hi[8], bv[8];
      LoadTf32x8<kRoundA>(a_lo + blk * kKBlock, lo);
      LoadTf32x8<kRoundA>(a_hi + blk * kKBlock, hi);
      LoadTf32x8<kRoundB>(b + blk * kKBlock, bv);
#pragma unroll
      for (int s = 0; s < kKBlock / kMmaK; ++s) {
        const uint32_t af[4] = {lo[2 * s], hi[2 * s], lo[2 * s + 1], hi[2 * s + 1]};
        const uint32_t bf[2] = {bv[2 * s], bv[2 * s + 1]};
        MmaTf32(acc[s & 1], af, bf);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float sum = acc[0][i] + acc[1][i];
      const int m = m0 + g + 8 * (i >> 1), nn = n0 + 2 * t + (i & 1);
      if (splits > 1) {
        partial[item * kMmaTile + lane * 4 + i] = sum;
      } else if (m < M && nn < N) {
        out[m * out_m + nn * out_n] = sum;
      }
    }
  }
  __syncthreads();
  if (splits == 1) return;
  for (int e = threadIdx.x; e < tiles * kMmaTile; e += kThreads) {
    const int tile = e / kMmaTile, l = e % kMmaTile / 4, i = e % 4;
    const int m = (tile % tiles_m) * kMmaM + l / 4 + 8 * (i >> 1);
    const int nn = (tile / tiles_m) * kMmaN + 2 * (l % 4) + (i & 1);
    float sum = 0.f;
    for (int sp = 0; sp < splits; ++sp) sum += partial[(sp * tiles + tile) * kMmaTile + e % kMmaTile];
    if (m < M && nn < N) out[m * out_m + nn * out_n] = sum;
  }
  __syncthreads();
}

// --- tensor-core products of rows read from global memory ---------------------------------------
// The operand formats of the tensor-core products below. A k block gives a lane 32 bytes of each of its rows (the
// global x rows and the shared-memory w rows) as 8 fragment words, and takes 4 mmas: mma s pairs
// words 2s and 2s + 1 of both operands, so each product pairs equal k.
// TF32 (mma.sync m16n8k8): 8 consecutive k a lane, float32 x rounded to TF32, w stored TF32-exact
// (StoredWeight); in mma s, fragment position t holds k = 8 t + 2 s and t + 4 holds 8 t + 2 s + 1.
template <typename W>
struct Tf32Operands {
  using X = float;
  static constexpr int kKBlock = 32;
  __device__ static bool Pending(const uint4& v) {  // kPending is the largest word
    return max(max(v.x, v.y), max(v.z, v.w)) == kPending;
  }
  __device__ static uint32_t FromX(uint32_t word) { return Tf32(__uint_as_float(word)); }
  __device__ static void LoadW(const W* p, uint32_t (&out)[8]) { LoadTf32x8<false>(p, out); }
  __device__ static void Mma(float (&acc)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) { MmaTf32(acc, a, b); }
};
// bfloat16 (mma.sync m16n8k16): 16 consecutive k a lane, [16 t, + 16) of the block; mma s takes
// their pairs 2s (fragment positions 2t, 2t + 1) and 2s + 1 (2t + 8, 2t + 9).
struct Bf16Operands {
  using X = __nv_bfloat16;
  static constexpr int kKBlock = int(kBf16KBlock);
  __device__ static bool Pending(const uint4& v) {  // any half kPendingBf16
    return (__vcmpeq2(v.x, kPending) | __vcmpeq2(v.y, kPending) | __vcmpeq2(v.z, kPending) |
            __vcmpeq2(v.w, kPending)) != 0;
  }
  __device__ static uint32_t FromX(uint32_t word) { return word; }
  __device__ static void LoadW(const __nv_bfloat16* p, uint32_t (&out)[8]) {
    const uint4 lo = reinterpret_cast<const uint4*>(p)[0], hi = reinterpret_cast<const uint4*>(p)[1];
    const uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = words[i];
  }
  __device__ static void Mma(float (&acc)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) { MmaBf16(acc, a, b); }
};

// The backward's product on bf16 tensor cores: store(u, b, sum_k wt[u][k] x_row(b)[k]) for u < units,
// b < rows, with wt (bfloat16, shared memory, row stride ldw) and the x rows (bfloat16, global memory,
// written by other blocks of this launch: read through L2) zero past K up to a multiple of
// kBf16KBlock, Kp. M is the batch rows (16 an m tile), N the units (8 an n tile). In k block kb (64 k)
// lane (g, t) loads 16 consecutive k, [64 kb + 16 t, + 16), of each of its rows (two 16-byte loads a
// row) and mma s (0..3) takes their pairs 2s (fragment positions 2t, 2t + 1) and 2s + 1 (2t + 8,
// 2t + 9), for both operands alike, so each product pairs equal k. Warps take m x n tiles; when there
// are fewer tiles than warps, the warps of a tile split the k blocks and `partial` (kWarps * kMmaTile
// floats) holds their sums, added in a fixed order (the result is deterministic). Rows and units past
// the edge repeat the last one (their sums are dropped). Ends with the block synchronized.
template <int kThreads, typename XRow, typename Store>
__device__ void Bf16GradProduct(const __nv_bfloat16* wt, int ldw, XRow x_row, int units, int rows, int Kp,
                                Store store, float* partial) {
  constexpr int kWarps = kThreads / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int tiles_m = (rows + kMmaM - 1) / kMmaM;
  const int tiles = tiles_m * ((units + kMmaN - 1) / kMmaN);
  const int blocks = Kp / int(kBf16KBlock);
  const int splits = tiles >= kWarps ? 1 : std::max(1, std::min(kWarps / tiles, blocks));
  auto load_x = [](const __nv_bfloat16* p, uint32_t(&out)[8]) {  // through L2
    const uint4 lo = __ldcg(reinterpret_cast<const uint4*>(p)), hi = __ldcg(reinterpret_cast<const uint4*>(p) + 1);
    const uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = words[i];
  };
  for (int item = warp; item < tiles * splits; item += kWarps) {
    const int tile = item % tiles, split = item / tiles;
    const int m0 = (tile % tiles_m) * kMmaM, n0 = (tile / tiles_m) * kMmaN;
    const __nv_bfloat16* a_lo = x_row(std::min(m0 + g, rows - 1)) + 16 * t;
    const __nv_bfloat16* a_hi = x_row(std::min(m0 + g + 8, rows - 1)) + 16 * t;
    const __nv_bfloat16* b = wt + std::min(n0 + g, units - 1) * ldw + 16 * t;
    float acc[2][4] = {};
#pragma unroll 4
    for (int blk = split; blk < blocks; blk += splits) {
      const int k = blk * int(kBf16KBlock);
      uint32_t lo[8], hi[8], bw[8];
      load_x(a_lo + k, lo);
      load_x(a_hi + k, hi);
      Bf16Operands::LoadW(b + k, bw);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint32_t af[4] = {lo[2 * s], hi[2 * s], lo[2 * s + 1], hi[2 * s + 1]};
        const uint32_t bf[2] = {bw[2 * s], bw[2 * s + 1]};
        MmaBf16(acc[s & 1], af, bf);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float sum = acc[0][i] + acc[1][i];
      const int m = m0 + g + 8 * (i >> 1), n = n0 + 2 * t + (i & 1);
      if (splits > 1) {
        partial[item * kMmaTile + lane * 4 + i] = sum;
      } else if (m < rows && n < units) {
        store(n, m, sum);
      }
    }
  }
  __syncthreads();
  if (splits == 1) return;
  for (int e = threadIdx.x; e < tiles * kMmaTile; e += kThreads) {
    const int tile = e / kMmaTile, l = e % kMmaTile / 4, i = e % 4;
    const int m = (tile % tiles_m) * kMmaM + l / 4 + 8 * (i >> 1);
    const int n = (tile / tiles_m) * kMmaN + 2 * (l % 4) + (i & 1);
    float sum = 0.f;
    for (int sp = 0; sp < splits; ++sp) sum += partial[(sp * tiles + tile) * kMmaTile + e % kMmaTile];
    if (m < rows && n < units) store(n, m, sum);
  }
  __syncthreads();
}

// BlockMatmul's product with TF32 operands on tensor cores: w (stored TF32-exact: StoredWeight) and
// x rows zero-padded to KPadded(K). The mma's M (16 a tile) is the rows when they fill a tile or
// outnumber the columns, else the columns.
template <int kThreads, typename W>
__device__ void Tf32BlockMatmul(const W* w, int ldw, const float* x, int ldx, int rows, int cols, int K, float* out,
                                float* partial) {
  auto w_row = [&](int r) { return w + r * ldw; };
  auto x_row = [&](int c) { return x + c * ldx; };
  const int Kp = int(KPadded(K));
  if (rows >= kMmaM || rows >= cols) {
    MmaBlockProduct<kThreads, false, true>(w_row, x_row, rows, cols, Kp, out, 1, rows, partial);
  } else {
    MmaBlockProduct<kThreads, true, false>(x_row, w_row, cols, rows, Kp, out, rows, 1, partial);
  }
}

// GlobalMmaProduct's work split over the warps of a block: `splits` warps a column tile when there
// are fewer tiles than warps, and where this warp's items start and how they advance. Computed once
// a launch (MmaSplitFor): the forward's product runs every step with the same columns, and the
// integer divisions of the split, redone there, were a fifth of the instructions before a step's
// first load of h (H200, Nsight Compute, 2026-12-01).
struct MmaSplit {
  int tiles_n = 0, splits = 1, blocks = 0;
  int tile = 0, split = 0;            // the warp's first item (item = warp = split tiles_n + tile)
  int next_tile = 0, next_split = 0;  // an item kWarps further: kWarps % tiles_n and kWarps / tiles_n
  __device__ void Advance(int& tile_, int& split_) const {
    tile_ += next_tile;
    split_ += next_split;
    if (tile_ >= tiles_n) {
      tile_ -= tiles_n;
      ++split_;
    }
  }
};

// half_the_warps: from 4 tiles up, the splits fill only half the warps. For the bf16 product with two
// m tiles a warp, where the split-sums pass costs more than the idle warps (H200, bf16 fwd+bwd, ms:
// LSTM (256, 64, 1024, 1024) 8.37 -> 8.02 with one split instead of two, (256, 32) 5.26 -> 5.07 with
// two instead of four; GRU (256, 64) 7.34 -> 7.30; 2026-12-01). The TF32 product keeps every warp:
// there it lost, float32 (256, 32) 6.78 -> 6.93.
template <int kWarps, int kBlock>
__device__ MmaSplit MmaSplitFor(int cols, int K, bool half_the_warps = false) {
  MmaSplit m;
  m.tiles_n = (cols + kMmaN - 1) / kMmaN;
  m.blocks = K / kBlock;
  const int fill = half_the_warps && m.tiles_n >= 4 ? kWarps / 2 : kWarps;
  m.splits = m.tiles_n >= fill ? 1 : std::max(1, std::min(fill / m.tiles_n, m.blocks));
  const int warp = threadIdx.x / 32;
  m.tile = warp % m.tiles_n;
  m.split = warp / m.tiles_n;
  m.next_tile = kWarps % m.tiles_n;
  m.next_split = kWarps / m.tiles_n;
  return m;
}

// store(m, n, sum_k w[m * ldw + k] x_row(n)[k]) for m < rows, n < cols, on tensor cores with float32
// sums (Operands: the format above), reading the x rows straight from global memory (through L2:
// other blocks of this launch wrote them): rows of K elements, K a multiple of the k block, 16-byte
// aligned; a null row reads as zeros; `work` = MmaSplitFor<kWarps, Operands::kKBlock>(cols, K, ...),
// the split of the steps' fixed sizes. The forward's product when its rows allow: no staging of x in
// shared memory, so no barrier between the loads and the mmas and no chunking of the batch. A warp
// takes an n tile (8 x rows) against kMTiles = 2 m tiles of w at once (one when at most 16 rows
// remain; every x row crosses L2 once a block per 32 rows of w) and keeps kDepth k blocks of its x
// fragments in flight. When there are fewer n tiles than warps, the warps of a tile may split the k
// blocks (MmaSplitFor says how many) and `partial` (2 kWarps kMmaTile floats) holds their sums, added
// in a fixed order (the result is deterministic). Rows and columns past the edge repeat the last one
// (their sums are dropped). `poll`: the x rows may still be being published; a warp awaits each k
// block's fragments before it uses them, the loads of the later blocks already in flight. Ends with
// the block synchronized. (The backward's bf16 product, Bf16GradProduct, takes its x rows as the mma's M:
// there, with few units a block, this loop ran its steps slower, H200 LSTM (512, 16, 512, 512) bf16
// fwd+bwd 4.31 -> 4.98 ms.)
template <typename Operands, int kThreads, typename W, typename XRow, typename Store>
__device__ void GlobalMmaProduct(const W* w, int ldw, XRow x_row, int rows, int cols, const MmaSplit& work,
                                 Store store, float* partial, bool poll) {
  constexpr int kWarps = kThreads / 32, kMTiles = 2, kDepth = 4, kBlock = Operands::kKBlock, kLane = kBlock / 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int tiles_n = work.tiles_n, blocks = work.blocks, splits = work.splits;
  for (int m0 = 0; m0 < rows; m0 += kMTiles * kMmaM) {
    const int m_tiles = std::min(kMTiles, (rows - m0 + kMmaM - 1) / kMmaM);  // warp-uniform
    const W* a[2 * kMTiles];  // this lane's rows m0 + g + 8 i of w (clamped: sums past the edge are dropped)
#pragma unroll
    for (int i = 0; i < 2 * kMTiles; ++i) a[i] = w + std::min(m0 + g + 8 * i, rows - 1) * ldw + kLane * t;
    for (int item = warp, tile = work.tile, split = work.split; item < tiles_n * splits;
         item += kWarps, work.Advance(tile, split)) {
      const int n0 = tile * kMmaN;
      const typename Operands::X* b = x_row(std::min(n0 + g, cols - 1));
      auto at = [&](int blk) { return reinterpret_cast<const uint4*>(b + blk * kBlock + kLane * t); };
      auto load = [&](int blk, uint4 (&v)[2]) {
        v[0] = b != nullptr ? __ldcg(at(blk)) : make_uint4(0, 0, 0, 0);
        v[1] = b != nullptr ? __ldcg(at(blk) + 1) : make_uint4(0, 0, 0, 0);
      };
      uint4 ring[kDepth][2];
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        if (split + d * splits < blocks) load(split + d * splits, ring[d]);
      }
      float acc[kMTiles][2][4] = {};  // [m tile][chain][fragment]
      for (int base = split; base < blocks; base += kDepth * splits) {
#pragma unroll
        for (int d = 0; d < kDepth; ++d) {
          const int blk = base + d * splits;
          if (blk >= blocks) break;
          if (poll && b != nullptr && (Operands::Pending(ring[d][0]) || Operands::Pending(ring[d][1]))) {
            while (Operands::Pending(ring[d][0])) ring[d][0] = LoadRelaxed(at(blk));
            while (Operands::Pending(ring[d][1])) ring[d][1] = LoadRelaxed(at(blk) + 1);
          }
          const uint32_t words[8] = {ring[d][0].x, ring[d][0].y, ring[d][0].z, ring[d][0].w,
                                     ring[d][1].x, ring[d][1].y, ring[d][1].z, ring[d][1].w};
          uint32_t bv[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) bv[i] = Operands::FromX(words[i]);
          if (blk + kDepth * splits < blocks) load(blk + kDepth * splits, ring[d]);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            if (mt >= m_tiles) break;
            uint32_t lo[8], hi[8];
            Operands::LoadW(a[2 * mt] + blk * kBlock, lo);
            Operands::LoadW(a[2 * mt + 1] + blk * kBlock, hi);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              const uint32_t af[4] = {lo[2 * q], hi[2 * q], lo[2 * q + 1], hi[2 * q + 1]};
              const uint32_t bf[2] = {bv[2 * q], bv[2 * q + 1]};
              Operands::Mma(acc[mt][q & 1], af, bf);
            }
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        if (mt >= m_tiles) break;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float sum = acc[mt][0][i] + acc[mt][1][i];
          const int m = m0 + mt * kMmaM + g + 8 * (i >> 1), n = n0 + 2 * t + (i & 1);
          if (splits > 1) {
            partial[(item * m_tiles + mt) * kMmaTile + lane * 4 + i] = sum;
          } else if (m < rows && n < cols) {
            store(m, n, sum);
          }
        }
      }
    }
    __syncthreads();
    if (splits == 1) continue;
    const int tile_shift = m_tiles == 1 ? 7 : 8;  // log2(m_tiles kMmaTile): shifts, not divisions
    static_assert(kMTiles == 2 && kMmaTile == 128, "the shifts above");
    for (int e = threadIdx.x; e < tiles_n * m_tiles * kMmaTile; e += kThreads) {
      const int tile = e >> tile_shift, mt = (e >> 7) & (m_tiles - 1), l = e % kMmaTile / 4, i = e % 4;
      const int m = m0 + mt * kMmaM + l / 4 + 8 * (i >> 1), n = tile * kMmaN + 2 * (l % 4) + (i & 1);
      float sum = 0.f;
      for (int sp = 0; sp < splits; ++sp) {
        sum += partial[((sp * tiles_n + tile) * m_tiles + mt) * kMmaTile + e % kMmaTile];
      }
      if (m < rows && n < cols) store(m, n, sum);
    }
    __syncthreads();
  }
}

// W_hh's element as its block keeps it in shared memory: rounded to TF32 once for the TF32 product
// (bfloat16 and float16 values are TF32 values already).
template <bool kTf32, typename W>
__device__ __forceinline__ W StoredWeight(W v) {
  if constexpr (kTf32 && std::is_same_v<W, float>) {
    return __uint_as_float(Tf32(v));
  } else {
    return v;
  }
}

// The block product of the kernels: TF32 tensor cores or exact float32 sums.
template <bool kTf32, int kThreads, typename W>
__device__ void Product(const W* w, int ldw, const float* x, int ldx, int rows, int cols, int K, float* out,
                        float* partial) {
  if constexpr (kTf32) {
    Tf32BlockMatmul<kThreads>(w, ldw, x, ldx, rows, cols, K, out, partial);
  } else {
    BlockMatmul<kTileRows, kTileCols, false, kThreads>(
        w, ldw, [&](int c) { return x + c * ldx; }, rows, cols, K,
        [&](int r, int c, float sum) { out[c * rows + r] = sum; }, partial);
  }
}

// --- cells: the per-unit work of each target ----------------------------------------------------
// The cells' b is a (batch row, direction) pair (SeqRow): b.state indexes the [B D, H] view of the
// states, and At(s, b, t) finds its step t in the per-step arrays.
// Forward cells: Step(s, b, j, t, t_prev, rec, stride) runs unit j of pair b at time t (t_prev < 0:
// the first step, from the initial state), given rec[q * stride] = (W_hh h_prev)[q H + j]. It reads
// gates_x and the carried state (the LSTM's c, the GRU's h) from global memory and calls
// Advance(s, b, j, t, gx, gx_stride, carried, rec, stride), the cell math from gates_x gx[q gx_stride]
// and the carried state (updated in place), which returns h (the cluster kernels keep both on chip;
// Carried0 is the carried state's initial value);
// Zero(...) writes the zeros of a step past the row's end; Final(..., t_last) writes the final
// state (t_last < 0: the row has no valid step). h_seq and h0 are where the next step's h comes from
// (or their bfloat16 copies, io.exchange: PublishH).
// Backward cells keep per-(row, unit) state in shared memory, state[0] (the gradient reaching h
// from the next step) and state[stride] (the LSTM's dc, or the GRU's part of dh_prev that bypasses
// W_hh): Init, then a step's Grad(Load(...)) writes the gate gradients (`Exchange()` is the one
// multiplied by W_hh^T), then Final writes the gradients of the initial state. Load reads the step's
// operands (Operands), Grad computes from them, and also leaves the exchanged gradients in
// sent[q * sent_stride], converted to its type, when `sent` is given (the cluster kernels load a step
// ahead and send from there; the persistent kernel fills its bf16 ring).

template <typename Io>
struct Cell;

template <>
struct Cell<LstmFwdIo> {
  static constexpr int kGates = 4;
  LstmFwdIo io;
  __device__ const float* HPrev(const RecurrenceShape& s, const SeqRow& b, int64_t t_prev) const {
    return t_prev < 0 ? io.h0 + b.state * s.hidden : io.h_seq + At(s, b, t_prev) * s.hidden;
  }
  __device__ float Carried0(const RecurrenceShape& s, const SeqRow& b, int64_t j) const {
    return io.c0[b.state * s.hidden + j];
  }
  __device__ float Advance(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t, const float* gx,
                           int64_t gx_stride, float& c, const float* rec, int stride) const {
    const int64_t H = s.hidden, row = At(s, b, t);
    const LstmGates a = LstmActivate(gx[0] + rec[0], gx[gx_stride] + rec[stride], gx[2 * gx_stride] + rec[2 * stride],
                                     gx[3 * gx_stride] + rec[3 * stride]);
    c = a.f * c + a.i * a.g;
    const float h = a.o * Tanh(c);
    io.c_seq[row * H + j] = c;
    PublishH(io.h_seq, io.exchange, row * H + j, h);
    float* act = io.acts + row * 4 * H;
    act[j] = a.i;
    act[H + j] = a.f;
    act[2 * H + j] = a.g;
    act[3 * H + j] = a.o;
    return h;
  }
  __device__ void Step(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t, int64_t t_prev,
                       const float* rec, int stride) const {
    const int64_t H = s.hidden;
    float c = t_prev < 0 ? io.c0[b.state * H + j] : io.c_seq[At(s, b, t_prev) * H + j];
    Advance(s, b, j, t, io.gates_x + At(s, b, t) * 4 * H + j, H, c, rec, stride);
  }
  __device__ void Zero(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t) const {
    const int64_t H = s.hidden, row = At(s, b, t);
    io.h_seq[row * H + j] = 0.f;
    io.c_seq[row * H + j] = 0.f;
    for (int q = 0; q < 4; ++q) io.acts[row * 4 * H + q * H + j] = 0.f;
  }
  __device__ void Final(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t_last) const {
    const int64_t H = s.hidden;
    io.h_n[b.state * H + j] = t_last < 0 ? io.h0[b.state * H + j] : io.h_seq[At(s, b, t_last) * H + j];
    io.c_n[b.state * H + j] = t_last < 0 ? io.c0[b.state * H + j] : io.c_seq[At(s, b, t_last) * H + j];
  }
};

template <>
struct Cell<GruFwdIo> {
  static constexpr int kGates = 3;
  GruFwdIo io;
  __device__ const float* HPrev(const RecurrenceShape& s, const SeqRow& b, int64_t t_prev) const {
    return t_prev < 0 ? io.h0 + b.state * s.hidden : io.h_seq + At(s, b, t_prev) * s.hidden;
  }
  __device__ float Carried0(const RecurrenceShape& s, const SeqRow& b, int64_t j) const {
    return io.h0[b.state * s.hidden + j];
  }
  __device__ float Advance(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t, const float* gx,
                           int64_t gx_stride, float& h, const float* rec, int stride) const {
    const int64_t H = s.hidden, row = At(s, b, t);
    const float* b_hh = io.b_hh + s.Direction(b) * 3 * H;
    const float hp_n = rec[2 * stride] + b_hh[2 * H + j];
    const GruGates a = GruActivate(gx[0], gx[gx_stride], gx[2 * gx_stride], rec[0] + b_hh[j],
                                   rec[stride] + b_hh[H + j], hp_n);
    h = GruOutput(a, h);
    PublishH(io.h_seq, io.exchange, row * H + j, h);
    float* keep = io.saved + row * 4 * H;
    keep[j] = a.r;
    keep[H + j] = a.z;
    keep[2 * H + j] = a.n;
    keep[3 * H + j] = hp_n;
    return h;
  }
  __device__ void Step(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t, int64_t t_prev,
                       const float* rec, int stride) const {
    float h = HPrev(s, b, t_prev)[j];
    Advance(s, b, j, t, io.gates_x + At(s, b, t) * 3 * s.hidden + j, s.hidden, h, rec, stride);
  }
  __device__ void Zero(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t) const {
    const int64_t H = s.hidden, row = At(s, b, t);
    io.h_seq[row * H + j] = 0.f;
    for (int q = 0; q < 4; ++q) io.saved[row * 4 * H + q * H + j] = 0.f;
  }
  __device__ void Final(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t_last) const {
    io.h_n[b.state * s.hidden + j] = HPrev(s, b, t_last)[j];
  }
};

template <>
struct Cell<RnnFwdIo> {
  static constexpr int kGates = 1;
  RnnFwdIo io;
  __device__ const float* HPrev(const RecurrenceShape& s, const SeqRow& b, int64_t t_prev) const {
    return t_prev < 0 ? io.h0 + b.state * s.hidden : io.h_seq + At(s, b, t_prev) * s.hidden;
  }
  __device__ float Carried0(const RecurrenceShape&, const SeqRow&, int64_t) const { return 0.f; }  // none
  __device__ float Advance(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t, const float* gx, int64_t,
                           float&, const float* rec, int) const {
    const float h = RnnActivate(io.act, gx[0] + rec[0]);
    PublishH(io.h_seq, io.exchange, At(s, b, t) * s.hidden + j, h);
    return h;
  }
  __device__ void Step(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t, int64_t, const float* rec,
                       int) const {
    float none = 0.f;
    Advance(s, b, j, t, io.gates_x + At(s, b, t) * s.hidden + j, 1, none, rec, 0);
  }
  __device__ void Zero(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t) const {
    io.h_seq[At(s, b, t) * s.hidden + j] = 0.f;
  }
  __device__ void Final(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t_last) const {
    io.h_n[b.state * s.hidden + j] = HPrev(s, b, t_last)[j];
  }
};

template <>
struct Cell<LstmBwdIo> {
  static constexpr int kGates = 4;
  static constexpr bool kBypass = false;
  LstmBwdIo io;
  __device__ const float* Exchange() const { return io.dgates; }
  __device__ __nv_bfloat16* Ring() const { return io.exchange.rows; }
  __device__ void Init(const RecurrenceShape& s, const SeqRow& b, int64_t j, float* state, int64_t stride) const {
    state[0] = io.dh_n[b.state * s.hidden + j];
    state[stride] = io.dc_n[b.state * s.hidden + j];
  }
  __device__ void Prefetch(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t) const {
    const int64_t H = s.hidden, row = At(s, b, t);
    for (int q = 0; q < 4; ++q) PrefetchL2(io.acts + row * 4 * H + q * H + j);
    PrefetchL2(io.c_seq + row * H + j);
    PrefetchL2(io.dh_seq + row * H + j);
  }
  struct Operands {
    LstmGates a;
    float c, c_prev, dh;
  };
  __device__ Operands Load(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t, int64_t t_prev) const {
    const int64_t H = s.hidden, row = At(s, b, t);
    const float* a = io.acts + row * 4 * H;
    return {LstmGates{a[j], a[H + j], a[2 * H + j], a[3 * H + j]}, io.c_seq[row * H + j],
            t_prev < 0 ? io.c0[b.state * H + j] : io.c_seq[At(s, b, t_prev) * H + j], io.dh_seq[row * H + j]};
  }
  template <typename Sent = float>
  __device__ void Grad(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t, const Operands& o,
                       float* state, int64_t stride, Sent* sent = nullptr, int sent_stride = 0) const {
    const int64_t H = s.hidden, row = At(s, b, t);
    float d_pre[4];
    state[stride] = LstmCellGrad(o.a, o.c, o.c_prev, o.dh + state[0], state[stride], d_pre);
    for (int q = 0; q < 4; ++q) {
      io.dgates[row * 4 * H + q * H + j] = d_pre[q];
      if (sent != nullptr) sent[q * sent_stride] = FromFloat<Sent>(d_pre[q]);
    }
  }
  __device__ void Zero(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t) const {
    for (int q = 0; q < 4; ++q) io.dgates[At(s, b, t) * 4 * s.hidden + q * s.hidden + j] = 0.f;
  }
  __device__ void Final(const RecurrenceShape& s, const SeqRow& b, int64_t j, const float* state,
                        int64_t stride) const {
    io.dh0[b.state * s.hidden + j] = state[0];
    io.dc0[b.state * s.hidden + j] = state[stride];
  }
  __host__ __device__ unsigned* Counter(const RecurrenceShape& s, int64_t d) const {
    return reinterpret_cast<unsigned*>(io.dh0 + d * s.hidden);
  }
};

template <>
struct Cell<GruBwdIo> {
  static constexpr int kGates = 3;
  static constexpr bool kBypass = true;
  GruBwdIo io;
  __device__ const float* Exchange() const { return io.dgates_h; }
  __device__ __nv_bfloat16* Ring() const { return io.exchange.rows; }
  __device__ void Init(const RecurrenceShape& s, const SeqRow& b, int64_t j, float* state, int64_t stride) const {
    state[0] = io.dh_n[b.state * s.hidden + j];
    state[stride] = 0.f;
  }
  __device__ void Prefetch(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t) const {
    const int64_t H = s.hidden, row = At(s, b, t);
    for (int q = 0; q < 4; ++q) PrefetchL2(io.saved + row * 4 * H + q * H + j);
    PrefetchL2(io.dh_seq + row * H + j);
  }
  struct Operands {
    GruGates a;
    float h_n, h_prev, dh;
  };
  __device__ Operands Load(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t, int64_t t_prev) const {
    const int64_t H = s.hidden, row = At(s, b, t);
    const float* keep = io.saved + row * 4 * H;
    return {GruGates{keep[j], keep[H + j], keep[2 * H + j]}, keep[3 * H + j],
            t_prev < 0 ? io.h0[b.state * H + j] : io.h_seq[At(s, b, t_prev) * H + j], io.dh_seq[row * H + j]};
  }
  template <typename Sent = float>
  __device__ void Grad(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t, const Operands& o,
                       float* state, int64_t stride, Sent* sent = nullptr, int sent_stride = 0) const {
    const int64_t H = s.hidden, row = At(s, b, t);
    float d_x[3], d_h[3];
    state[stride] = GruCellGrad(o.a, o.h_n, o.h_prev, o.dh + state[0], d_x, d_h);
    for (int q = 0; q < 3; ++q) {
      io.dgates_x[row * 3 * H + q * H + j] = d_x[q];
      io.dgates_h[row * 3 * H + q * H + j] = d_h[q];
      if (sent != nullptr) sent[q * sent_stride] = FromFloat<Sent>(d_h[q]);
    }
  }
  __device__ void Zero(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t) const {
    for (int q = 0; q < 3; ++q) {
      io.dgates_x[At(s, b, t) * 3 * s.hidden + q * s.hidden + j] = 0.f;
      io.dgates_h[At(s, b, t) * 3 * s.hidden + q * s.hidden + j] = 0.f;
    }
  }
  __device__ void Final(const RecurrenceShape& s, const SeqRow& b, int64_t j, const float* state, int64_t) const {
    io.dh0[b.state * s.hidden + j] = state[0];
  }
  __host__ __device__ unsigned* Counter(const RecurrenceShape& s, int64_t d) const {
    return reinterpret_cast<unsigned*>(io.dh0 + d * s.hidden);
  }
};

template <>
struct Cell<RnnBwdIo> {
  static constexpr int kGates = 1;
  static constexpr bool kBypass = false;
  RnnBwdIo io;
  __device__ const float* Exchange() const { return io.dgates; }
  __device__ __nv_bfloat16* Ring() const { return io.exchange.rows; }
  __device__ void Init(const RecurrenceShape& s, const SeqRow& b, int64_t j, float* state, int64_t) const {
    state[0] = io.dh_n[b.state * s.hidden + j];
  }
  __device__ void Prefetch(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t) const {
    PrefetchL2(io.h_seq + At(s, b, t) * s.hidden + j);
    PrefetchL2(io.dh_seq + At(s, b, t) * s.hidden + j);
  }
  struct Operands {
    float h, dh;
  };
  __device__ Operands Load(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t, int64_t) const {
    const int64_t row = At(s, b, t) * s.hidden + j;
    return {io.h_seq[row], io.dh_seq[row]};
  }
  template <typename Sent = float>
  __device__ void Grad(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t, const Operands& o,
                       float* state, int64_t, Sent* sent = nullptr, int = 0) const {
    const float d = RnnCellGrad(io.act, o.h, o.dh + state[0]);
    io.dgates[At(s, b, t) * s.hidden + j] = d;
    if (sent != nullptr) sent[0] = FromFloat<Sent>(d);
  }
  __device__ void Zero(const RecurrenceShape& s, const SeqRow& b, int64_t j, int64_t t) const {
    io.dgates[At(s, b, t) * s.hidden + j] = 0.f;
  }
  __device__ void Final(const RecurrenceShape& s, const SeqRow& b, int64_t j, const float* state, int64_t) const {
    io.dh0[b.state * s.hidden + j] = state[0];
  }
  __host__ __device__ unsigned* Counter(const RecurrenceShape& s, int64_t d) const {
    return reinterpret_cast<unsigned*>(io.dh0 + d * s.hidden);
  }
};

template <typename Io>
constexpr bool kIsBackward = false;
template <>
constexpr bool kIsBackward<LstmBwdIo> = true;
template <>
constexpr bool kIsBackward<GruBwdIo> = true;
template <>
constexpr bool kIsBackward<RnnBwdIo> = true;

// g = the gates_x of unit j of pair b at `step` of its len valid steps (g unchanged past them): the
// forward kernels that load them a step ahead into registers.
template <typename Io>
__device__ __forceinline__ void LoadGatesX(const Cell<Io>& cell, const RecurrenceShape& s, SeqRow b, int64_t j,
                                           int64_t step, int64_t len, bool rev, float (&g)[Cell<Io>::kGates]) {
  if (step < len) {
    const int H = int(s.hidden);
    const float* p = cell.io.gates_x + At(s, b, StepTime(step, len, rev)) * Cell<Io>::kGates * H + j;
#pragma unroll
    for (int q = 0; q < Cell<Io>::kGates; ++q) g[q] = p[q * H];
  }
}

// The backward cell's operands of unit j of pair b at `step` (< len) of its len valid steps: the
// kernels that load them a step ahead into registers.
template <typename Io>
__device__ __forceinline__ typename Cell<Io>::Operands LoadOperands(const Cell<Io>& cell, const RecurrenceShape& s,
                                                                    SeqRow b, int64_t j, int64_t step, int64_t len,
                                                                    bool rev) {
  return cell.Load(s, b, j, StepTime(step, len, rev), step == 0 ? -1 : StepTime(step - 1, len, rev));
}

// Backward state slots per (row, unit): the gradient reaching h, and the LSTM's dc or GRU's bypass.
template <typename Io>
constexpr int kStateSlots = (std::is_same_v<Io, RnnBwdIo> ? 1 : 2);

// --- kernels ----------------------------------------------------------------------------------

// The shared-memory layout of both kernels: W_hh's slice, then the float buffers.
struct Plan {
  int units = 0;   // hidden units per block (the last block may have fewer)
  int blocks = 0;  // P
  int chunk = 0;   // forward: batch rows per pass over the input buffer (0: GlobalMmaProduct, no buffer)
  int group = 0;   // forward: batch rows per pass of the cell (a multiple of chunk, or B)
  int ldw = 0, ldx = 0;  // row strides (elements) of W_hh's slice and the forward's input buffer
  int threads = 0;       // kNarrow or kWide
  int ld = 0;            // cluster kernels: the row length of W_hh's slice and the exchange buffers
  size_t weight_bytes = 0, smem_bytes = 0;
};

__host__ __device__ inline size_t AlignUp(size_t bytes) { return (bytes + 15) / 16 * 16; }

// `shape` with D as a compile-time constant (the kernels' template parameter, shape.directions).
// With one direction (and d = 0) the kernels then compile to the instructions they had before
// directions existed: with D and d known only at run time, the latency-bound steps of unidirectional
// layers ran 3-6% slower (H100 and H200).
template <int kDirections>
__device__ __forceinline__ RecurrenceShape WithDirections(RecurrenceShape shape) {
  shape.directions = kDirections;
  return shape;
}

// Forward: block p owns units [p * units, p * units + U); smem holds w [kGates * U][ldw] (row q U + u
// is W_hh row q H + j0 + u), a chunk of previous h [chunk][ldx], the products of a group of batch
// rows [group][kGates U] and the split sums. A step multiplies a group's rows chunk by chunk (or,
// with no chunk buffer, straight from L2: GlobalMmaProduct), then runs the cell over the whole
// group: one wait on the cell's global operands a group, not a chunk.
template <typename W, typename Io, bool kTf32, int kThreads, int kDirections>
__global__ void __launch_bounds__(kThreads, 1)
    PersistentFwdKernel(Cell<Io> cell, const W* __restrict__ w_hh, const int32_t* __restrict__ seq_lengths,
                        RecurrenceShape shape, bool reverse, Plan plan, int first_direction) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kGates = Cell<Io>::kGates;
  const RecurrenceShape s = WithDirections<kDirections>(shape);
  const int d = kDirections == 1 ? 0 : first_direction + int(blockIdx.x) / plan.blocks;
  const int block = kDirections == 1 ? int(blockIdx.x) : int(blockIdx.x) % plan.blocks;
  const bool rev = Reversed(reverse, d);
  const int H = int(s.hidden), j0 = block * plan.units, U = std::min(plan.units, H - j0), R = kGates * U;
  const int64_t B = s.batch, T = s.steps;
  W* w = reinterpret_cast<W*>(smem);
  float* x = reinterpret_cast<float*>(smem + plan.weight_bytes);
  float* pre = x + plan.chunk * plan.ldx;
  float* partial = pre + plan.group * kGates * plan.units;
  w_hh += int64_t(d) * s.gates() * H;  // this direction's W_hh
  const int Kp = int(KPadded(H));  // rows of w and x are zero past H, up to Kp (the TF32 product's blocks)
  for (int e = threadIdx.x; e < R * Kp; e += kThreads) {
    const int r = e / Kp, k = e % Kp;
    w[r * plan.ldw + k] = k < H ? StoredWeight<kTf32>(w_hh[(int64_t(r / U) * H + j0 + r % U) * H + k]) : W(0.f);
  }
  for (int e = threadIdx.x; e < plan.chunk * plan.ldx; e += kThreads) x[e] = 0.f;  // LoadRows writes [0, H)
  // With a bf16 exchange (a bfloat16 W_hh, Bf16StateFits(H)) the product reads h_prev's bfloat16
  // copies, published like h_seq: h0's are published here, each block its own units'.
  __nv_bfloat16* mirror = nullptr;
  if constexpr (kTf32 && std::is_same_v<W, __nv_bfloat16>) mirror = cell.io.exchange.rows;
  const int64_t first_rows = B * T * s.directions;  // the mirror's rows of h_seq; h0's follow
  for (int e = threadIdx.x; e < B * U && mirror != nullptr; e += kThreads) {
    const SeqRow r = s.Row(e / U, d);
    PublishBf16(mirror + (first_rows + r.state) * H + j0 + e % U, cell.HPrev(s, r, -1)[j0 + e % U]);
  }
  // Where the cell runs one group of rows with at most one (row, unit) pair a thread, the pair is the
  // same every step: the thread keeps its carried state (c, or the GRU's h) in a register and loads
  // its gates_x a step ahead, through the product, so the cell waits on no global load (else each
  // step's gates_x are prefetched to L2).
  const bool ahead = plan.group == B && B * U <= kThreads;
  const bool mine = ahead && int(threadIdx.x) < B * U;
  const int n = mine ? int(threadIdx.x) / U : 0, u = mine ? int(threadIdx.x) % U : 0;
  const SeqRow row = s.Row(n, d);
  const int64_t j = j0 + u, len = mine ? ValidSteps(seq_lengths[n], T) : 0;
  float carried = mine ? cell.Carried0(s, row, j) : 0.f;
  float gx[kGates] = {}, gx_next[kGates] = {};  // this step's gates_x and the next one's
  auto load_gates_x = [&](int64_t step, float (&g)[kGates]) {
    if (mine) LoadGatesX(cell, s, row, j, step, len, rev, g);
  };
  load_gates_x(0, gx);
  // GlobalMmaProduct's work split, the same every step: a full group's (a last, shorter group's is
  // computed where it runs).
  auto split_for = [&](int cols) {
    if constexpr (kTf32) {
      if (mirror != nullptr) return MmaSplitFor<kThreads / 32, int(kBf16KBlock)>(cols, H, R > kMmaM);
      return MmaSplitFor<kThreads / 32, Tf32Operands<W>::kKBlock>(cols, H);
    }
    return MmaSplit{};
  };
  const MmaSplit full_split = split_for(plan.group);
  __syncthreads();  // LoadRows's warps write rows that other threads zeroed
  for (int64_t step = 0; step < T; ++step) {
    if (ahead) {
      load_gates_x(step + 1, gx_next);
    } else {
      for (int e = threadIdx.x; e < B * U; e += kThreads) {
        const int64_t b = e / U, len = ValidSteps(seq_lengths[b], T);
        const float* gx = cell.io.gates_x + At(s, s.Row(b, d), StepTime(step, len, rev)) * kGates * H + j0 + e % U;
        if (step < len) {
          for (int q = 0; q < kGates; ++q) PrefetchL2(gx + q * H);
        }
      }
    }
    const bool poll = step > 0 || mirror != nullptr;  // h_prev was published: await each value
    for (int64_t g0 = 0; g0 < B; g0 += plan.group) {
      const int group = int(std::min<int64_t>(plan.group, B - g0));
      const MmaSplit work = group == plan.group ? full_split : split_for(group);
      auto h_prev = [&](int64_t b) -> const float* {  // null past the row's end: its product is dropped
        const int64_t len = ValidSteps(seq_lengths[b], T);
        return step < len ? cell.HPrev(s, s.Row(b, d), step == 0 ? -1 : StepTime(step - 1, len, rev)) : nullptr;
      };
      auto store = [&](int m, int n, float sum) { pre[n * R + m] = sum; };
      if constexpr (kTf32 && std::is_same_v<W, __nv_bfloat16>) {
        if (mirror != nullptr) {  // the bfloat16 copies straight from L2 (ends synchronized)
          auto h_prev_bf16 = [&](int i) -> const __nv_bfloat16* {
            const int64_t b = g0 + i, len = ValidSteps(seq_lengths[b], T);
            const SeqRow r = s.Row(b, d);
            if (step >= len) return nullptr;
            return mirror + (step == 0 ? first_rows + r.state : At(s, r, StepTime(step - 1, len, rev))) * H;
          };
          GlobalMmaProduct<Bf16Operands, kThreads>(w, plan.ldw, h_prev_bf16, R, group, work, store, partial, poll);
        }
      }
      if constexpr (kTf32) {
        if (plan.chunk == 0 && mirror == nullptr) {  // the rows straight from L2 (ends synchronized)
          GlobalMmaProduct<Tf32Operands<W>, kThreads>(w, plan.ldw, [&](int i) { return h_prev(g0 + i); }, R,
                                                         group, work, store, partial, poll);
        }
      }
      for (int c0 = 0; c0 < group && plan.chunk > 0; c0 += plan.chunk) {
        const int rows = std::min(plan.chunk, group - c0);
        LoadRows<kThreads / 32>(x, plan.ldx, rows, H, [&](int i) { return h_prev(g0 + c0 + i); }, poll);
        __syncthreads();
        Product<kTf32, kThreads>(w, plan.ldw, x, plan.ldx, R, rows, H, pre + c0 * R, partial);  // ends synchronized
      }
      if (ahead) {
        if (mine && step < len) {
          cell.Advance(s, row, j, StepTime(step, len, rev), gx, 1, carried, pre + n * R + u, U);
        } else if (mine) {
          cell.Zero(s, row, j, step);  // steps past the row's end are t = len .. T - 1
        }
      } else {
        for (int e = threadIdx.x; e < group * U; e += kThreads) {
          const int64_t b = g0 + e / U, j = j0 + e % U, len = ValidSteps(seq_lengths[b], T);
          if (step < len) {
            const int64_t t_prev = step == 0 ? -1 : StepTime(step - 1, len, rev);
            cell.Step(s, s.Row(b, d), j, StepTime(step, len, rev), t_prev, pre + (e / U) * R + e % U, U);
          } else {
            cell.Zero(s, s.Row(b, d), j, step);
          }
        }
      }
      __syncthreads();  // before the next group overwrites pre
    }
#pragma unroll
    for (int q = 0; q < kGates; ++q) gx[q] = gx_next[q];
  }
  for (int e = threadIdx.x; e < B * U; e += kThreads) {
    const int64_t b = e / U, len = ValidSteps(seq_lengths[b], T);
    cell.Final(s, s.Row(b, d), j0 + e % U, len == 0 ? -1 : StepTime(len - 1, len, rev));
  }
}

// Backward: block p owns units [j0, j0 + U); smem holds wt [U][ldw] (wt[u][k] = W_hh[k][j0 + u]), the
// state [slots][B][units] and the split sums. The product reads every unit's gate gradients straight
// from L2: staging them in shared memory beside W_hh^T's slice left room for few batch rows a round
// (5 at H 1024 float32: 13 rounds a step). With a bf16 exchange ring (a bfloat16 W_hh), the cells
// also write their gate gradients rounded to bfloat16 into the ring's slot of the step's parity, and
// the product multiplies those on tensor cores (Bf16GradProduct): half the bytes, and no float32 FMAs
// (H200, the backward stage: LSTM (512, 16, 512, 512) 2.79 -> 2.44 ms, (256, 64, 1024, 1024) 6.25 ->
// 4.04, a bidirectional (256, 32, 512, 512) layer 2.64 -> 1.69). A slot is rewritten two steps later,
// after every block has passed the barrier of the step between, so after every block's product read it.
template <typename W, typename Io, int kThreads, int kDirections>
__global__ void __launch_bounds__(kThreads, 1)
    PersistentBwdKernel(Cell<Io> cell, const W* __restrict__ w_hh, const int32_t* __restrict__ seq_lengths,
                        RecurrenceShape shape, bool reverse, Plan plan, int first_direction) {
  extern __shared__ __align__(16) unsigned char smem[];
  const RecurrenceShape s = WithDirections<kDirections>(shape);
  const int d = kDirections == 1 ? 0 : first_direction + int(blockIdx.x) / plan.blocks;
  const int block = kDirections == 1 ? int(blockIdx.x) : int(blockIdx.x) % plan.blocks;
  const bool rev = Reversed(reverse, d);
  const int H = int(s.hidden), G = int(s.gates()), j0 = block * plan.units, U = std::min(plan.units, H - j0);
  const int64_t B = s.batch, T = s.steps, stride = B * plan.units;
  W* wt = reinterpret_cast<W*>(smem);
  float* state = reinterpret_cast<float*>(smem + plan.weight_bytes);
  float* partial = state + kStateSlots<Io> * stride;
  unsigned* counter = cell.Counter(s, d);
  // The bf16 ring's rows (zero past G) and W^T's slice (zero from G to Kp, so the pad sums to 0).
  __nv_bfloat16* const ring = std::is_same_v<W, __nv_bfloat16> ? cell.Ring() : nullptr;
  const int Kp = ring != nullptr ? int(Bf16RowLength(G)) : G;
  auto ring_row = [&](int64_t step, int64_t b) {
    return ring + ((step & 1) * B * s.directions + s.Row(b, d).state) * Kp;
  };
  if (ring != nullptr) {  // the pads of this direction's rows, spread over its blocks
    const int64_t pad = Kp - G;
    for (int64_t e = int64_t(block) * kThreads + threadIdx.x; e < 2 * B * pad; e += int64_t(plan.blocks) * kThreads) {
      ring_row(e / pad / B, e / pad % B)[G + e % pad] = FromFloat<__nv_bfloat16>(0.f);
    }
  }
  w_hh += int64_t(d) * s.gates() * H;  // this direction's W_hh
  for (int e = threadIdx.x; e < U * Kp; e += kThreads) {
    const int k = e / U, u = e % U;
    wt[u * plan.ldw + k] = k < G ? w_hh[int64_t(k) * H + j0 + u] : FromFloat<W>(0.f);
  }
  // With at most one (row, unit) pair a thread, a thread loads its pair's operands of the next step
  // into registers while it waits at the barrier and through the product, so the cell waits on no
  // global load (else each step's operands are prefetched to L2).
  const bool ahead = B * U <= kThreads;
  const bool mine = ahead && int(threadIdx.x) < B * U;
  const int n = mine ? int(threadIdx.x) / U : 0, u = mine ? int(threadIdx.x) % U : 0;
  const SeqRow row = s.Row(n, d);
  const int64_t j = j0 + u, len = mine ? ValidSteps(seq_lengths[n], T) : 0;
  typename Cell<Io>::Operands operands{};
  auto load_operands = [&](int64_t step) {
    if (mine && step < len) {
      operands = LoadOperands(cell, s, row, j, step, len, rev);
    }
  };
  for (int e = threadIdx.x; e < B * U; e += kThreads) {
    const int64_t b = e / U, len = ValidSteps(seq_lengths[b], T);
    cell.Init(s, s.Row(b, d), j0 + e % U, state + b * plan.units + e % U, stride);
    if (T - 1 < len && !ahead) cell.Prefetch(s, s.Row(b, d), j0 + e % U, StepTime(T - 1, len, rev));
  }
  load_operands(T - 1);
  for (int64_t step = T - 1; step >= 0; --step) {
    // Gate gradients of the own units (their state lives with the same (row, unit) mapping).
    // (row b, unit j)'s gate gradients into the ring, or its zeros past the row's end.
    auto sent = [&](int64_t b, int64_t j) { return ring == nullptr ? nullptr : ring_row(step, b) + j; };
    auto zero = [&](int64_t b, int64_t j) {
      cell.Zero(s, s.Row(b, d), j, step);
      for (int q = 0; q < Cell<Io>::kGates && ring != nullptr; ++q) sent(b, j)[q * H] = FromFloat<__nv_bfloat16>(0.f);
    };
    if (ahead) {
      if (mine && step < len) {
        cell.Grad(s, row, j, StepTime(step, len, rev), operands, state + n * plan.units + u, stride, sent(n, j), H);
      } else if (mine) {
        zero(n, j);
      }
    } else {
      for (int e = threadIdx.x; e < B * U; e += kThreads) {
        const int64_t b = e / U, j = j0 + e % U, len = ValidSteps(seq_lengths[b], T);
        if (step < len) {
          const int64_t t = StepTime(step, len, rev), t_prev = step == 0 ? -1 : StepTime(step - 1, len, rev);
          cell.Grad(s, s.Row(b, d), j, t, cell.Load(s, s.Row(b, d), j, t, t_prev), state + b * plan.units + e % U,
                    stride, sent(b, j), H);
        } else {
          zero(b, j);
        }
      }
    }
    GridArrive(counter);
    if (step > 0 && ahead) {  // the next step's operands
      load_operands(step - 1);
    } else if (step > 0) {
      for (int e = threadIdx.x; e < B * U; e += kThreads) {
        const int64_t b = e / U, len = ValidSteps(seq_lengths[b], T);
        if (step - 1 < len) cell.Prefetch(s, s.Row(b, d), j0 + e % U, StepTime(step - 1, len, rev));
      }
    }
    GridWait(counter, unsigned(T - step) * plan.blocks);  // every block wrote this step's gradients
    // The gradient reaching h_prev of the own units: W_hh^T (every unit's gate gradients). A row
    // past its length reads its zeroed gate gradients of this step (cell.Zero); its product is dropped.
    auto gradients_of = [&](int b) -> const float* {
      const int64_t len = ValidSteps(seq_lengths[b], T);
      return cell.Exchange() + At(s, s.Row(b, d), step < len ? StepTime(step, len, rev) : step) * G;
    };
    // The product of (unit u, row b) lands in the state of that row's next (earlier) step. The cell
    // step's threads are done with it (GridArrive synchronized the block), and BlockMatmul ends
    // synchronized before the next cell step reads it.
    auto store = [&](int u, int b, float sum) {
      float* st = state + b * plan.units + u;
      if (step < ValidSteps(seq_lengths[b], T)) st[0] = sum + (Cell<Io>::kBypass ? st[stride] : 0.f);
    };
    if constexpr (std::is_same_v<W, __nv_bfloat16>) {
      if (ring != nullptr) {
        Bf16GradProduct<kThreads>(wt, plan.ldw, [&](int b) -> const __nv_bfloat16* { return ring_row(step, b); },
                                  U, int(B), Kp, store, partial);
        continue;
      }
    }
    if (U > 4) {  // a tile spans up to 8 units: with H <= 8 SMs, each gradient is read once
      BlockMatmul<8, 4, true, kThreads>(wt, plan.ldw, gradients_of, U, int(B), G, store, partial);
    } else {
      BlockMatmul<4, 8, true, kThreads>(wt, plan.ldw, gradients_of, U, int(B), G, store, partial);
    }
  }
  // Block 0 owns the counter word: it writes its results once every block has left its last wait.
  GridArrive(counter);
  if (block == 0) GridWait(counter, unsigned(T + 1) * plan.blocks);
  for (int e = threadIdx.x; e < B * U; e += kThreads) {
    cell.Final(s, s.Row(e / U, d), j0 + e % U, state + (e / U) * plan.units + e % U, stride);
  }
}

// --- cluster kernels (one batch row) ---------------------------------------------------------------
// Where a direction's W_hh slices fit on the blocks of one thread-block cluster (at most 16 on sm_90)
// and the batch is one row, the blocks exchange each step's values through distributed shared memory
// instead of global memory and a grid barrier: a block sends its units' new h (forward) or gate
// gradients (backward) straight into every block's exchange buffer with st.async, whose bytes
// complete a transaction count on the receiving block's mbarrier; a block waits on its own barrier
// only. A step then holds no L2 round trip and no grid-wide fence on its critical path (at B 1, the
// persistent kernels' step was those round trips). Two exchange buffers alternate: a block can
// send into a buffer only after it received the receiver's values of the step before, which the
// receiver sent after its last read of that buffer.

// The cluster kernels' work split (a batch of one row): block p (its cluster rank) owns units
// [j0, j0 + U); its warp v owns the units u = v + kClusterWarps i, lane i unit i of the warp. A step's
// products split k over the lanes, two units at a time, summed by butterfly shuffles (every lane gets
// every sum); lane i then runs its unit's cell with its operands in registers (loaded a step ahead)
// and the warp sends each unit's results to every block (lane p to block p). No block barrier a step:
// a warp waits only on its block's mbarrier.
constexpr int kClusterWarps = kNarrow / 32;

// The warp's units of a block's U: u = warp + kClusterWarps i for i < this.
__device__ __forceinline__ int ClusterUnits(int U, int warp) {
  return U > warp ? (U - warp + kClusterWarps - 1) / kClusterWarps : 0;
}

// sums[r] = sum_k rows[r][k] x[k] for k < K (a multiple of 4; rows 8-byte aligned, zero past their
// length), in every lane: the lanes take 4 consecutive k each, 128 a round.
template <int kRows, typename W>
__device__ __forceinline__ void WarpDots(const W* const (&rows)[kRows], const float* x, int K, int lane,
                                         float (&sums)[kRows]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) sums[r] = 0.f;
  for (int k = 4 * lane; k < K; k += 128) {
    const float4 xv = *reinterpret_cast<const float4*>(x + k);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float wv[4];
      LoadVec<4>(rows[r] + k, wv);
      sums[r] = fmaf(wv[0], xv.x, fmaf(wv[1], xv.y, fmaf(wv[2], xv.z, fmaf(wv[3], xv.w, sums[r]))));
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m /= 2) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) sums[r] += __shfl_xor_sync(0xffffffffu, sums[r], m);
  }
}

// out[q] (lane i: unit i of the warp) = sum_k w_row(unit, q)[k] x[k] for q < kGates, two units a pass.
template <int kGates, typename W, typename Row>
__device__ __forceinline__ void ClusterProduct(Row w_row, int units, const float* x, int K, int lane,
                                               float (&out)[kGates]) {
  for (int i = 0; i < units; i += 2) {
    const int i2 = std::min(i + 1, units - 1);  // a lone last unit is summed twice
    const W* rows[2 * kGates];
#pragma unroll
    for (int q = 0; q < kGates; ++q) {
      rows[q] = w_row(i, q);
      rows[kGates + q] = w_row(i2, q);
    }
    float sums[2 * kGates];
    WarpDots(rows, x, K, lane, sums);
#pragma unroll
    for (int q = 0; q < kGates; ++q) {
      if (lane == i) out[q] = sums[q];
      if (lane == i + 1) out[q] = sums[kGates + q];
    }
  }
}

// Lane p < blocks sends v to block p's float at `at` (this block's shared-memory address of it,
// mapped to block p), announcing its 4 bytes on block p's barrier at `bar`.
__device__ __forceinline__ void SendToBlock(float v, uint32_t at, uint32_t bar, int lane, int blocks) {
  if (lane < blocks) {
    uint32_t dst, remote_bar;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(dst) : "r"(at), "r"(lane));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_bar) : "r"(bar), "r"(lane));
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(dst),
                 "r"(__float_as_uint(v)), "r"(remote_bar)
                 : "memory");
  }
}

// Thread 0's setup of the two exchange barriers (exchange x of a launch's `count`, x = 0, 1, ...,
// completes barrier x % 2): one arrival (its own, announcing an exchange's bytes) and the
// transaction bytes; armed for exchanges 0 and 1.
__device__ __forceinline__ void InitExchangeBarriers(uint64_t* arrived, uint32_t bytes, int64_t count) {
  sm90::BarrierInit(&arrived[0], 1);
  sm90::BarrierInit(&arrived[1], 1);
  sm90::BarrierInitFence();
  for (int64_t x = 0; x < 2 && x < count; ++x) sm90::BarrierArriveExpectTx(&arrived[x], bytes);
}

// Waits for exchange x and re-arms its barrier for exchange x + 2, whose bytes can only come after
// this block sends exchange x + 1 (thread 0's warp sends its part after this).
__device__ __forceinline__ void WaitExchange(uint64_t* arrived, int64_t x, int64_t count, uint32_t bytes) {
  sm90::BarrierWait(&arrived[x & 1], uint32_t(x >> 1) & 1);
  if (threadIdx.x == 0 && x + 2 < count) sm90::BarrierArriveExpectTx(&arrived[x & 1], bytes);
}

// Forward, one cluster a direction: w [kGates U][ld] (row q U + u is W_hh row q H + j0 + u, zero
// from H up to ld), then the exchange buffers in[2][ld]: step s's product reads every unit's h of
// step s - 1 (rounded to TF32 when the product is; step 0's from h0) from in[s % 2]. A lane's gates_x
// of the next step are loaded into registers while this step runs; the carried state stays in a
// register.
template <typename W, typename Io, bool kTf32, int kDirections>
__global__ void __launch_bounds__(kNarrow, 1)
    ClusterFwdKernel(Cell<Io> cell, const W* __restrict__ w_hh, const int32_t* __restrict__ seq_lengths,
                     RecurrenceShape shape, bool reverse, Plan plan) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kGates = Cell<Io>::kGates;
  const RecurrenceShape s = WithDirections<kDirections>(shape);
  const int d = kDirections == 1 ? 0 : int(blockIdx.x) / plan.blocks, block = int(blockIdx.x) % plan.blocks;
  const bool rev = Reversed(reverse, d);
  const int H = int(s.hidden), j0 = block * plan.units, U = std::min(plan.units, H - j0), R = kGates * U;
  const int K = plan.ld, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t T = s.steps;
  W* w = reinterpret_cast<W*>(smem);
  float* in = reinterpret_cast<float*>(smem + plan.weight_bytes);
  uint64_t* arrived = reinterpret_cast<uint64_t*>(in + 2 * K);
  const uint32_t bytes = uint32_t(H) * sizeof(float);  // a step's h from every block
  w_hh += int64_t(d) * s.gates() * H;
  for (int e = threadIdx.x; e < R * K; e += kNarrow) {
    const int r = e / K, k = e % K;
    w[r * K + k] = k < H ? StoredWeight<kTf32>(w_hh[(int64_t(r / U) * H + j0 + r % U) * H + k]) : W(0.f);
  }
  const SeqRow row = s.Row(0, d);
  for (int k = threadIdx.x; k < 2 * K; k += kNarrow) {
    in[k] = k < H ? StoredWeight<kTf32>(cell.HPrev(s, row, -1)[k]) : 0.f;  // h0, zeros past it
  }
  const int64_t len = ValidSteps(seq_lengths[0], T);
  if (threadIdx.x == 0) InitExchangeBarriers(arrived, bytes, len - 1);  // exchange x: step x's h
  const int units = ClusterUnits(U, warp);
  const bool mine = lane < units;
  const int64_t j = j0 + warp + kClusterWarps * lane;
  float carried = mine ? cell.Carried0(s, row, j) : 0.f;
  float gx[kGates] = {}, gx_next[kGates] = {};  // this step's gates_x and the next one's
  auto load_gates_x = [&](int64_t step, float (&g)[kGates]) {
    if (mine) LoadGatesX(cell, s, row, j, step, len, rev, g);
  };
  load_gates_x(0, gx);
  sm90::ClusterSync();  // w, in and every block's barriers are ready before any block sends
  auto w_row = [&](int i, int q) { return w + (q * U + warp + kClusterWarps * i) * K; };
  const uint32_t to = sm90::SharedAddress(in) + uint32_t(j0 + warp) * sizeof(float);
  // Steps past the row's end (len < T) write zeros and send nothing; the other blocks stop there too.
  for (int64_t step = 0; step < T; ++step) {
    if (step >= len) {
      if (mine) cell.Zero(s, row, j, step);
      continue;
    }
    const int slot = int(step & 1);
    load_gates_x(step + 1, gx_next);
    if (step > 0) WaitExchange(arrived, step - 1, len - 1, bytes);
    float rec[kGates] = {};  // this lane's unit's products
    ClusterProduct<kGates, W>(w_row, units, in + slot * K, K, lane, rec);
    float h = 0.f;
    if (mine) h = StoredWeight<kTf32>(cell.Advance(s, row, j, StepTime(step, len, rev), gx, 1, carried, rec, 1));
    if (step + 1 < len) {
      const uint32_t bar = sm90::SharedAddress(&arrived[slot]);  // exchange `step`
      for (int i = 0; i < units; ++i) {
        const float v = __shfl_sync(0xffffffffu, h, i);
        SendToBlock(v, to + uint32_t((1 - slot) * K + kClusterWarps * i) * sizeof(float), bar, lane, plan.blocks);
      }
    }
#pragma unroll
    for (int q = 0; q < kGates; ++q) gx[q] = gx_next[q];
  }
  if (mine) cell.Final(s, row, j, len == 0 ? -1 : StepTime(len - 1, len, rev));
  sm90::ClusterSync();  // no block leaves while another may still send to it
#endif
}

// Backward, one cluster a direction: wt [U][ld] (wt[u][k] = W_hh[k][j0 + u], zero from G up to
// ld), then in[2][ld]: each step a block sends its units' gate gradients (the ones multiplied by
// W_hh^T) to every block, and multiplies every unit's, received in in[exchange % 2], by its columns
// of W_hh for the gradient reaching its units of h_prev. A lane keeps its unit's state slots in
// registers and loads the next step's cell operands while this step runs.
template <typename W, typename Io, int kDirections>
__global__ void __launch_bounds__(kNarrow, 1)
    ClusterBwdKernel(Cell<Io> cell, const W* __restrict__ w_hh, const int32_t* __restrict__ seq_lengths,
                     RecurrenceShape shape, bool reverse, Plan plan) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kGates = Cell<Io>::kGates;
  const RecurrenceShape s = WithDirections<kDirections>(shape);
  const int d = kDirections == 1 ? 0 : int(blockIdx.x) / plan.blocks, block = int(blockIdx.x) % plan.blocks;
  const bool rev = Reversed(reverse, d);
  const int H = int(s.hidden), G = int(s.gates()), j0 = block * plan.units, U = std::min(plan.units, H - j0);
  const int K = plan.ld, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t T = s.steps;
  W* wt = reinterpret_cast<W*>(smem);
  float* in = reinterpret_cast<float*>(smem + plan.weight_bytes);
  uint64_t* arrived = reinterpret_cast<uint64_t*>(in + 2 * K);
  const uint32_t bytes = uint32_t(G) * sizeof(float);  // a step's gate gradients from every block
  w_hh += int64_t(d) * s.gates() * H;
  for (int e = threadIdx.x; e < U * K; e += kNarrow) {
    const int k = e / U, u = e % U;
    wt[u * K + k] = k < G ? w_hh[int64_t(k) * H + j0 + u] : W(0.f);
  }
  for (int k = threadIdx.x; k < 2 * K; k += kNarrow) in[k] = 0.f;  // the columns past G stay zero
  const SeqRow row = s.Row(0, d);
  const int64_t len = ValidSteps(seq_lengths[0], T);
  if (threadIdx.x == 0) InitExchangeBarriers(arrived, bytes, len);  // exchange x: step len - 1 - x's
  const int units = ClusterUnits(U, warp);
  const bool mine = lane < units;
  const int64_t j = j0 + warp + kClusterWarps * lane;
  using Operands = typename Cell<Io>::Operands;
  auto load = [&](int64_t step) { return LoadOperands(cell, s, row, j, step, len, rev); };  // a step < len
  float state[2] = {};  // kStateSlots<Io> of them used
  Operands operands{};
  if (mine) {
    cell.Init(s, row, j, state, 1);
    if (len > 0) operands = load(len - 1);
  }
  sm90::ClusterSync();  // wt, in and every block's barriers are ready before any block sends
  auto w_row = [&](int i, int) { return wt + (warp + kClusterWarps * i) * K; };
  const uint32_t to = sm90::SharedAddress(in) + uint32_t(j0 + warp) * sizeof(float);
  for (int64_t step = T - 1; step >= len; --step) {  // past the row's end: zero gate gradients
    if (mine) cell.Zero(s, row, j, step);
  }
  for (int64_t step = len - 1; step >= 0; --step) {
    const int64_t x = len - 1 - step;
    const int slot = int(x & 1);
    float sent[kGates] = {};
    if (mine) cell.Grad(s, row, j, StepTime(step, len, rev), operands, state, 1, sent, 1);
    const uint32_t bar = sm90::SharedAddress(&arrived[slot]);
    for (int i = 0; i < units; ++i) {
#pragma unroll
      for (int q = 0; q < kGates; ++q) {
        const float v = __shfl_sync(0xffffffffu, sent[q], i);
        SendToBlock(v, to + uint32_t(slot * K + q * H + kClusterWarps * i) * sizeof(float), bar, lane, plan.blocks);
      }
    }
    if (mine && step > 0) operands = load(step - 1);
    WaitExchange(arrived, x, len, bytes);
    float dh[1] = {};
    ClusterProduct<1, W>(w_row, units, in + slot * K, K, lane, dh);
    if (mine) state[0] = dh[0] + (Cell<Io>::kBypass ? state[1] : 0.f);
  }
  if (mine) cell.Final(s, row, j, state, 1);
  sm90::ClusterSync();  // no block leaves while another may still send to it
#endif
}

// --- cluster kernels (a batch of rows) ---------------------------------------------------------
// Batches of 2 to 16 rows run in clusters too, with their products on TF32 tensor cores: per step a
// block multiplies its W_hh slice by every row's received state (forward), or its units' gate
// gradients by its slice of W_hh^T and sends each block the partial sums of that block's units
// (backward), in 16-byte (forward) and 8-byte st.async stores. The forward rounds W_hh and the
// multiplied h to TF32, as the persistent TF32 forward does; the backward, for a 16-bit W_hh (exact
// in TF32), stays exact to float32 rounding: each gate gradient is split into a TF32 value and a
// TF32 remainder (the two products sum to the float32 product within 2^-22 relative), and the
// partial sums are added in a fixed order. Blocks of kWide threads, one
// (row, unit) pair a thread; U is a multiple of 4 (forward) or 8 (backward) and H of kKBlock.

// The largest W_hh slice (elements) a block of the tensor-core cluster kernels holds: 64 rows of
// 256 (LSTM H 256, 16 blocks), where they stepped faster than the persistent kernels (H200, batches
// of 2 to 16).
constexpr int64_t kClusterBatchSlice = 64 * 256;

// Lane-wide st.async of 4 (or 2) floats to block `rank`'s shared-memory address `at` (this block's
// address of it, mapped), announcing their bytes on that block's barrier at `bar`.
__device__ __forceinline__ void SendToBlock(float4 v, uint32_t at, uint32_t bar, int rank) {
  uint32_t dst, remote_bar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(dst) : "r"(at), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_bar) : "r"(bar), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(dst),
               "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
               "r"(__float_as_uint(v.w)), "r"(remote_bar)
               : "memory");
}
__device__ __forceinline__ void SendToBlock(float2 v, uint32_t at, uint32_t bar, int rank) {
  uint32_t dst, remote_bar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(dst) : "r"(at), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_bar) : "r"(bar), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(dst),
               "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(remote_bar)
               : "memory");
}

// Forward: w [kGates U][ldw] (row q U + u is W_hh row q H + j0 + u), then in[2][B][ldx] (every row's
// h of the step before, TF32-rounded; step 0's from h0), the products [B][kGates units], this
// step's h of the block's units [B][units] (sent from there) and MmaBlockProduct's split sums.
// Thread e runs the cell of row e / U, unit e % U, its gates_x loaded a step ahead into registers
// and its carried state in a register. Every step exchanges every row's h (rows past their end
// send zeros), so all blocks count the same T - 1 exchanges.
template <typename W, typename Io, int kDirections>
__global__ void __launch_bounds__(kWide, 1)
    ClusterBatchFwdKernel(Cell<Io> cell, const W* __restrict__ w_hh, const int32_t* __restrict__ seq_lengths,
                          RecurrenceShape shape, bool reverse, Plan plan) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kGates = Cell<Io>::kGates;
  const RecurrenceShape s = WithDirections<kDirections>(shape);
  const int d = kDirections == 1 ? 0 : int(blockIdx.x) / plan.blocks, block = int(blockIdx.x) % plan.blocks;
  const bool rev = Reversed(reverse, d);
  const int H = int(s.hidden), j0 = block * plan.units, U = std::min(plan.units, H - j0), R = kGates * U;
  const int B = int(s.batch), ldw = plan.ldw, ldx = plan.ldx;
  const int64_t T = s.steps;
  W* w = reinterpret_cast<W*>(smem);
  uint64_t* arrived = reinterpret_cast<uint64_t*>(smem + plan.weight_bytes);
  float* in = reinterpret_cast<float*>(arrived + 2);
  float* pre = in + 2 * B * ldx;
  float* out = pre + B * kGates * plan.units;
  float* partial = out + B * plan.units;
  const uint32_t bytes = uint32_t(B * H) * sizeof(float);  // a step's h of every row from every block
  w_hh += int64_t(d) * s.gates() * H;
  for (int e = threadIdx.x; e < R * H; e += kWide) {
    const int r = e / H, k = e % H;
    w[r * ldw + k] = StoredWeight<true>(w_hh[(int64_t(r / U) * H + j0 + r % U) * H + k]);
  }
  for (int e = threadIdx.x; e < B * H; e += kWide) {
    in[(e / H) * ldx + e % H] = __uint_as_float(Tf32(cell.HPrev(s, s.Row(e / H, d), -1)[e % H]));
  }
  if (threadIdx.x == 0) InitExchangeBarriers(arrived, bytes, T - 1);  // exchange x: step x's h
  const bool mine = int(threadIdx.x) < B * U;
  const int n = mine ? int(threadIdx.x) / U : 0, u = mine ? int(threadIdx.x) % U : 0;
  const int64_t j = j0 + u, len = ValidSteps(seq_lengths[n], T);
  const SeqRow row = s.Row(n, d);
  float carried = mine ? cell.Carried0(s, row, j) : 0.f;
  float gx[kGates] = {}, gx_next[kGates] = {};  // this step's gates_x and the next one's
  auto load_gates_x = [&](int64_t step, float (&g)[kGates]) {
    if (mine) LoadGatesX(cell, s, row, j, step, len, rev, g);
  };
  load_gates_x(0, gx);
  sm90::ClusterSync();  // w, in and every block's barriers are ready before any block sends
  const int chunks = B * U / 4;  // 16-byte pieces of this block's h a step
  for (int64_t step = 0; step < T; ++step) {
    const int slot = int(step & 1);
    load_gates_x(step + 1, gx_next);
    if (step > 0) WaitExchange(arrived, step - 1, T - 1, bytes);
    const float* x = in + slot * B * ldx;
    MmaBlockProduct<kWide, false, false>([&](int m) { return w + m * ldw; }, [&](int r) { return x + r * ldx; }, R,
                                         B, H, pre, 1, R, partial);  // ends synchronized
    if (mine) {
      float h = 0.f;  // sent for steps past the row's end (their products are dropped)
      if (step < len) {
        h = cell.Advance(s, row, j, StepTime(step, len, rev), gx, 1, carried, pre + n * R + u, U);
      } else {
        cell.Zero(s, row, j, step);
      }
      out[n * U + u] = __uint_as_float(Tf32(h));
    }
    if (step + 1 < T) {
      __syncthreads();  // out is whole
      const uint32_t bar = sm90::SharedAddress(&arrived[slot]);  // exchange `step`
      const uint32_t to = sm90::SharedAddress(in + (1 - slot) * B * ldx + j0);
      for (int e = threadIdx.x; e < chunks * plan.blocks; e += kWide) {
        const int c = e % chunks, r = c / (U / 4), i = 4 * (c % (U / 4));
        SendToBlock(*reinterpret_cast<const float4*>(out + r * U + i), to + uint32_t(r * ldx + i) * sizeof(float),
                    bar, e / chunks);
      }
    }
#pragma unroll
    for (int q = 0; q < kGates; ++q) gx[q] = gx_next[q];
  }
  if (mine) cell.Final(s, row, j, len == 0 ? -1 : StepTime(len - 1, len, rev));
  sm90::ClusterSync();  // no block leaves while another may still send to it
#endif
}

// Backward: wt [H][ldw] (wt[k][r] = W_hh[q H + j0 + u][k] for the block's gate r = q U + u, zero
// from R up to ldw; each row's 16-byte pieces swapped in halves on odd rows when ldw's pieces fill
// whole 128-byte lines, so the two rows a load phase reads take disjoint banks), then in[2][blocks]
// [B][units] (the partial sums each block sent of this block's units), and the gate gradients
// dg[2][16][ldg] that the product multiplies. A step: each thread's cell writes its pair's gate
// gradients to dg, the warps multiply dg (16 rows, zero past B) by wt, n tiles of 8 units a warp,
// send each tile's sums to the block that owns its units, and each thread adds its pair's partial
// sums from every block, in rank order.
template <typename W, typename Io, int kDirections>
__global__ void __launch_bounds__(kWide, 1)
    ClusterBatchBwdKernel(Cell<Io> cell, const W* __restrict__ w_hh, const int32_t* __restrict__ seq_lengths,
                          RecurrenceShape shape, bool reverse, Plan plan) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kGates = Cell<Io>::kGates, kTiles = 4;  // n tiles a warp holds at once
  const RecurrenceShape s = WithDirections<kDirections>(shape);
  const int d = kDirections == 1 ? 0 : int(blockIdx.x) / plan.blocks, block = int(blockIdx.x) % plan.blocks;
  const bool rev = Reversed(reverse, d);
  const int H = int(s.hidden), j0 = block * plan.units, U = std::min(plan.units, H - j0), R = kGates * U;
  const int B = int(s.batch), ldw = plan.ldw, ldg = plan.ldx, units = plan.units;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t T = s.steps;
  W* wt = reinterpret_cast<W*>(smem);
  uint64_t* arrived = reinterpret_cast<uint64_t*>(smem + plan.weight_bytes);
  float* in = reinterpret_cast<float*>(arrived + 2);
  float* dg = in + 2 * plan.blocks * B * units;
  const int flip = ldw % 64 == 0 ? 4 : 0;  // 16-byte pieces a row a multiple of 8: swap halves on odd rows
  auto piece = [&](int k, int p) { return wt + k * ldw + 8 * (p ^ (k & 1 ? flip : 0)); };
  w_hh += int64_t(d) * s.gates() * H;
  for (int e = threadIdx.x; e < H * ldw; e += kWide) {
    const int k = e / ldw, r = e % ldw;
    piece(k, r / 8)[r % 8] = r < R ? w_hh[(int64_t(r / U) * H + j0 + r % U) * H + k] : W(0.f);
  }
  for (int e = threadIdx.x; e < 2 * 16 * ldg; e += kWide) dg[e] = 0.f;  // rows past B and gates past R stay zero
  const uint32_t bytes = uint32_t(plan.blocks * B * U) * sizeof(float);  // partial sums from every block
  if (threadIdx.x == 0) InitExchangeBarriers(arrived, bytes, T);  // exchange x: step T - 1 - x's
  const bool mine = int(threadIdx.x) < B * U;
  const int n = mine ? int(threadIdx.x) / U : 0, u = mine ? int(threadIdx.x) % U : 0;
  const int64_t j = j0 + u, len = ValidSteps(seq_lengths[n], T);
  const SeqRow row = s.Row(n, d);
  using Operands = typename Cell<Io>::Operands;
  auto load = [&](int64_t step) { return LoadOperands(cell, s, row, j, step, len, rev); };  // a step < len
  float state[2] = {};  // kStateSlots<Io> of them used
  Operands operands{};
  if (mine) {
    cell.Init(s, row, j, state, 1);
    if (len > 0) operands = load(len - 1);
  }
  sm90::ClusterSync();  // wt, in, dg and every block's barriers are ready before any block sends
  const int tiles = H / kMmaN, k_blocks = (R + kKBlock - 1) / kKBlock;
  for (int64_t step = T - 1; step >= 0; --step) {
    const int64_t x = T - 1 - step;
    const int slot = int(x & 1);
    float* a = dg + slot * 16 * ldg;
    if (mine) {
      float sent[kGates] = {};  // zero past the row's end
      if (step < len) {
        cell.Grad(s, row, j, StepTime(step, len, rev), operands, state, 1, sent, 1);
        if (step > 0) operands = load(step - 1);
      } else {
        cell.Zero(s, row, j, step);
      }
#pragma unroll
      for (int q = 0; q < kGates; ++q) a[n * ldg + q * U + u] = sent[q];
    }
    __syncthreads();  // a is whole
    const uint32_t bar = sm90::SharedAddress(&arrived[slot]);
    const uint32_t to = sm90::SharedAddress(in + (slot * plan.blocks + block) * B * units);
    for (int tile0 = warp * kTiles; tile0 < tiles; tile0 += kWide / 32 * kTiles) {
      float acc[kTiles][4] = {};
      for (int blk = 0; blk < k_blocks; ++blk) {
        const float* a_lo = a + g * ldg + blk * kKBlock + 8 * t;
        uint32_t hi[2][8], lo[2][8];  // [row g, g + 8][k]: TF32 value and remainder
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float4 v0 = *reinterpret_cast<const float4*>(a_lo + 8 * i * ldg);
          const float4 v1 = *reinterpret_cast<const float4*>(a_lo + 8 * i * ldg + 4);
          const float v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            hi[i][k] = Tf32(v[k]);
            lo[i][k] = Tf32(v[k] - __uint_as_float(hi[i][k]));
          }
        }
#pragma unroll
        for (int tt = 0; tt < kTiles; ++tt) {
          const int tile = std::min(tile0 + tt, tiles - 1);  // a repeated last tile's sums are dropped
          uint32_t bv[8];
          LoadTf32x8<false>(piece(tile * kMmaN + g, 4 * blk + t), bv);
#pragma unroll
          for (int q = 0; q < kKBlock / kMmaK; ++q) {
            const uint32_t bf[2] = {bv[2 * q], bv[2 * q + 1]};
            const uint32_t ah[4] = {hi[0][2 * q], hi[1][2 * q], hi[0][2 * q + 1], hi[1][2 * q + 1]};
            const uint32_t al[4] = {lo[0][2 * q], lo[1][2 * q], lo[0][2 * q + 1], lo[1][2 * q + 1]};
            MmaTf32(acc[tt], al, bf);
            MmaTf32(acc[tt], ah, bf);
          }
        }
      }
#pragma unroll
      for (int tt = 0; tt < kTiles; ++tt) {
        if (tile0 + tt >= tiles) break;
        const int k = (tile0 + tt) * kMmaN + 2 * t, p = k / units, c = k % units;  // the owner, its unit
        if (g < B) SendToBlock(make_float2(acc[tt][0], acc[tt][1]), to + uint32_t(g * units + c) * 4, bar, p);
        if (g + 8 < B) SendToBlock(make_float2(acc[tt][2], acc[tt][3]), to + uint32_t((g + 8) * units + c) * 4, bar, p);
      }
    }
    WaitExchange(arrived, x, T, bytes);
    if (mine && step < len) {
      float dh = 0.f;
      const float* part = in + slot * plan.blocks * B * units + n * units + u;
      for (int p = 0; p < plan.blocks; ++p) dh += part[p * B * units];
      state[0] = dh + (Cell<Io>::kBypass ? state[1] : 0.f);
    }
  }
  if (mine) cell.Final(s, row, j, state, 1);
  sm90::ClusterSync();  // no block leaves while another may still send to it
#endif
}

// --- host -------------------------------------------------------------------------------------

// Sizes the grid: the fewest units per block that spread H over the SMs, then (forward) the largest
// batch chunk (a multiple of the tile width when possible) that fits next to W_hh's slice, and the
// largest group of rows (all of B when they fit) whose products the rest holds. bf16_exchange: the
// products read Bf16Exchange's rows (rnn_persistent.h). False when nothing fits.
template <typename Io>
bool MakePlan(const RecurrenceShape& s, size_t w_size, bool tf32, bool bf16_exchange, int sms, size_t smem_limit,
              Plan* plan) {
  const int64_t H = s.hidden, G = s.gates(), K = kIsBackward<Io> ? G : H;  // the products' reduction length
  plan->units = int((H + sms - 1) / sms);
  if constexpr (kIsBackward<Io>) {  // bf16_exchange: the bf16 gradient ring
    const int64_t fewest = bf16_exchange ? int64_t(kMmaN) : (kFewestBackwardPairs + s.batch - 1) / s.batch;
    plan->units = int(std::min<int64_t>(H, std::max<int64_t>(plan->units, fewest)));
  }
  plan->blocks = int((H + plan->units - 1) / plan->units);
  const int64_t wide = bf16_exchange ? kWideBf16Backward : kWideBackward;
  plan->threads = !kIsBackward<Io> || s.batch * plan->units >= wide ? kWide : kNarrow;
  // Rows of K + 16 bytes: the backward's (BlockMatmul's lanes stride along one row) and those of the
  // bf16 exchange's products (K padded to the backward's row length; a load phase's rows then fall
  // 16 bytes apart modulo 128, on disjoint banks); else the forward's FragmentStride.
  const int64_t padded_k = bf16_exchange ? Bf16RowLength(K) : K;
  plan->ldw = int(kIsBackward<Io> || bf16_exchange ? padded_k + 16 / int64_t(w_size)
                                                    : FragmentStride(K, int64_t(w_size)));
  const int64_t units = plan->units, partial = plan->threads / 32 * (tf32 ? kMmaTile : 32);
  if constexpr (kIsBackward<Io>) {  // no input buffer: the state and the split sums
    plan->weight_bytes = AlignUp(size_t(units * plan->ldw) * w_size);
    plan->smem_bytes = plan->weight_bytes + size_t(kStateSlots<Io> * s.batch * units + partial) * sizeof(float);
    return plan->smem_bytes <= smem_limit;
  } else {
    plan->weight_bytes = AlignUp(size_t(Cell<Io>::kGates * units * plan->ldw) * w_size);
    const int64_t per_pre = Cell<Io>::kGates * units;  // a batch row's products
    const int64_t free_floats = (int64_t(smem_limit) - int64_t(plan->weight_bytes)) / int64_t(sizeof(float));
    if (tf32 && H % kKBlock == 0) {  // GlobalMmaProduct: no input buffer, split sums of 2 m tiles a warp
      const int64_t room = free_floats - 2 * partial;
      if (room < per_pre) return false;
      plan->chunk = plan->ldx = 0;
      plan->group = int(std::min<int64_t>(s.batch, room / per_pre));
      plan->smem_bytes = plan->weight_bytes + size_t(2 * partial + plan->group * per_pre) * sizeof(float);
      return true;
    }
    plan->ldx = int(FragmentStride(K, sizeof(float)));
    const int64_t room = free_floats - partial;
    if (room < plan->ldx + per_pre) return false;
    int64_t chunk = std::min<int64_t>({s.batch, kMaxChunk, room / (plan->ldx + per_pre)});
    if (chunk > kTileCols) chunk = chunk / kTileCols * kTileCols;
    int64_t group = std::min<int64_t>(s.batch, (room - chunk * plan->ldx) / per_pre);
    if (group < s.batch) group = group / chunk * chunk;
    plan->chunk = int(chunk);
    plan->group = int(group);
    plan->smem_bytes = plan->weight_bytes + size_t(partial + chunk * plan->ldx + group * per_pre) * sizeof(float);
    return true;
  }
}

// The cluster kernels' plan for clusters of up to `size` blocks: the fewest units a block that spread
// H over them. A batch of one row runs on the CUDA-core cluster kernels; a batch of 2 to 16 rows
// on the tensor-core ones, with H a multiple of kKBlock, one (row, unit) pair a thread, a W_hh slice
// of at most kClusterBatchSlice elements and, forward, `tf32` (their products round W_hh and the
// state), backward, a 16-bit W_hh (exact in TF32). Larger batches and slices, and the backward of a
// float32 W_hh, stay on the persistent kernels: with larger slices the 16 SMs step slower than the
// grid (H200, LSTM (512, 16, 512, 512) bf16, 128 KB slices: fwd 2.32 -> 3.12 ms, fwd+bwd 5.29 ->
// 6.97; Nsight Compute: the block's product, issue-bound, held 44% of the stall samples). False
// when the buffers do not fit.
template <typename Io>
bool MakeClusterPlan(const RecurrenceShape& s, size_t w_size, bool tf32, int size, size_t smem_limit, Plan* plan) {
  if (s.batch < 1 || s.hidden > INT32_MAX / 16) return false;
  const bool backward = kIsBackward<Io>;
  const int64_t H = s.hidden, gates = s.gates() / H, B = s.batch;
  plan->units = int((H + size - 1) / size);
  if (B == 1) {
    plan->blocks = int((H + plan->units - 1) / plan->units);
    plan->threads = kNarrow;
    if (plan->units > 32 * kClusterWarps) return false;  // a lane a unit
    plan->ld = int(((backward ? s.gates() : H) + 3) / 4 * 4);
    plan->weight_bytes = AlignUp(size_t((backward ? 1 : gates) * plan->units * plan->ld) * w_size);
    plan->smem_bytes = plan->weight_bytes + 2 * size_t(plan->ld) * sizeof(float) + 2 * sizeof(uint64_t);
    return plan->smem_bytes <= smem_limit;
  }
  if (B > 16 || H % kKBlock != 0 || (backward ? w_size != 2 : !tf32)) return false;
  const int multiple = backward ? kMmaN : 4;  // the backward's n tiles, the forward's 16-byte sends
  plan->units = (plan->units + multiple - 1) / multiple * multiple;
  plan->blocks = int((H + plan->units - 1) / plan->units);
  plan->threads = kWide;
  const int64_t units = plan->units, R = gates * units;
  if (B * units > kWide || R * H > kClusterBatchSlice) return false;
  if (backward) {
    plan->ldw = int(KPadded(R));
    plan->ldx = int(FragmentStride(R, sizeof(float)));  // the gate gradients' rows
    plan->weight_bytes = AlignUp(size_t(H * plan->ldw) * w_size);
    plan->smem_bytes = plan->weight_bytes + 2 * sizeof(uint64_t) +
                       size_t(2 * plan->blocks * B * units + 2 * kMmaM * plan->ldx) * sizeof(float);
  } else {
    plan->ldw = int(FragmentStride(H, w_size));
    plan->ldx = int(FragmentStride(H, sizeof(float)));
    plan->weight_bytes = AlignUp(size_t(R * plan->ldw) * w_size);
    plan->smem_bytes = plan->weight_bytes + 2 * sizeof(uint64_t) +
                       size_t(2 * B * plan->ldx + B * R + B * units + kWide / 32 * kMmaTile) * sizeof(float);
  }
  return plan->smem_bytes <= smem_limit;
}

// Launches the cluster kernels (sm_90) where their plan fits: clusters of 16 blocks, else 8.
template <typename W, typename Io>
ffi::Error LaunchCluster(cudaStream_t stream, const W* w_hh, const int32_t* seq_lengths, const RecurrenceShape& s,
                         bool reverse, bool tf32, const Io& io, int device, size_t smem_limit, bool* launched) {
  int major = 0;
  JAXDNN_RETURN_IF_ERROR(CudaError(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute"));
  if (major < 9) return ffi::Error::Success();
  for (int size : {16, 8}) {
    Plan plan;
    if (!MakeClusterPlan<Io>(s, sizeof(W), tf32, size, smem_limit, &plan)) continue;
    auto select = [&](auto directions) {
      constexpr int kD = decltype(directions)::value;
      using Kernel = void (*)(Cell<Io>, const W*, const int32_t*, RecurrenceShape, bool, Plan);
      if constexpr (kIsBackward<Io>) {
        if constexpr (sizeof(W) == 2) {  // MakeClusterPlan takes batches above 1 for 16-bit W_hh only
          if (s.batch > 1) return Kernel(ClusterBatchBwdKernel<W, Io, kD>);
        }
        return Kernel(ClusterBwdKernel<W, Io, kD>);
      } else {
        if (s.batch > 1) return Kernel(ClusterBatchFwdKernel<W, Io, kD>);
        return tf32 ? Kernel(ClusterFwdKernel<W, Io, true, kD>) : Kernel(ClusterFwdKernel<W, Io, false, kD>);
      }
    };
    const auto kernel =
        s.directions == 1 ? select(std::integral_constant<int, 1>{}) : select(std::integral_constant<int, 2>{});
    JAXDNN_RETURN_IF_ERROR(CudaError(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem_bytes)),
        "cudaFuncSetAttribute"));
    JAXDNN_RETURN_IF_ERROR(CudaError(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
                                     "cudaFuncSetAttribute"));
    const ClusterLaunch launch(unsigned(plan.blocks), dim3(unsigned(s.directions * plan.blocks)),
                               dim3(unsigned(plan.threads)), plan.smem_bytes, stream);
    int clusters = 0;  // a direction's cluster each, all resident at once
    JAXDNN_RETURN_IF_ERROR(CudaError(cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch.config), "occupancy"));
    if (clusters < s.directions) continue;
    JAXDNN_RETURN_IF_ERROR(CudaError(
        cudaLaunchKernelEx(&launch.config, kernel, Cell<Io>{io}, w_hh, seq_lengths, s, reverse, plan), "rnn cluster"));
    *launched = true;
    return ffi::Error::Success();
  }
  return ffi::Error::Success();
}

template <typename W, typename Io>
ffi::Error Launch(cudaStream_t stream, const W* w_hh, const int32_t* seq_lengths, const RecurrenceShape& s,
                  bool reverse, bool tf32, const Io& io, bool* launched) {
  int device = 0, sms = 0, smem_limit = 0, per_sm = 0;
  JAXDNN_RETURN_IF_ERROR(CudaError(cudaGetDevice(&device), "cudaGetDevice"));
  JAXDNN_RETURN_IF_ERROR(
      CudaError(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute"));
  JAXDNN_RETURN_IF_ERROR(CudaError(
      cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute"));
  // The directions run at once, each over its share of the SMs, when that plan fits: a step is
  // latency-bound, so two concurrent recurrences take little longer than one. Otherwise one launch
  // a direction, over every SM.
  const int directions = int(s.directions);
  int together = directions;
  Plan plan;
  if (s.hidden > INT32_MAX / 8) return ffi::Error::Success();
  Io cluster_io = io;  // the cluster kernels take no bf16 exchange
  cluster_io.exchange = {};
  const bool bf16_exchange = io.exchange.rows != nullptr;
  tf32 = tf32 || bf16_exchange;  // (the forward's bf16 product is in its TF32 kernel)
  JAXDNN_RETURN_IF_ERROR(
      LaunchCluster(stream, w_hh, seq_lengths, s, reverse, tf32, cluster_io, device, size_t(smem_limit), launched));
  if (*launched) return ffi::Error::Success();
  auto make_plan = [&](int blocks) {
    return MakePlan<Io>(s, sizeof(W), tf32, bf16_exchange, blocks, size_t(smem_limit), &plan);
  };
  if (directions == 1 || !make_plan(sms / directions)) {
    together = 1;
    if (!make_plan(sms)) return ffi::Error::Success();
  }
  auto select = [&](auto directions) {
    constexpr int kD = decltype(directions)::value;
    if constexpr (kIsBackward<Io>) {
      return plan.threads == kWide ? PersistentBwdKernel<W, Io, kWide, kD> : PersistentBwdKernel<W, Io, kNarrow, kD>;
    } else {
      return tf32 ? PersistentFwdKernel<W, Io, true, kWide, kD> : PersistentFwdKernel<W, Io, false, kWide, kD>;
    }
  };
  const auto kernel =
      directions == 1 ? select(std::integral_constant<int, 1>{}) : select(std::integral_constant<int, 2>{});
  JAXDNN_RETURN_IF_ERROR(CudaError(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem_bytes)),
      "cudaFuncSetAttribute"));
  JAXDNN_RETURN_IF_ERROR(CudaError(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, plan.threads, plan.smem_bytes), "occupancy"));
  if (int64_t(per_sm) * sms < int64_t(together) * plan.blocks) return ffi::Error::Success();

  const Cell<Io> cell{io};
  if constexpr (kIsBackward<Io>) {
    for (int d = 0; d < directions; ++d) {
      JAXDNN_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(cell.Counter(s, d), 0, sizeof(unsigned), stream),
                                       "cudaMemsetAsync (rnn barrier)"));
    }
  } else if (bf16_exchange) {  // the product polls the bfloat16 copies alone
    const size_t bytes = size_t(Bf16ExchangeElements(s, /*backward=*/false)) * sizeof(__nv_bfloat16);
    JAXDNN_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(cell.io.exchange.rows, kPendingByte, bytes, stream),
                                     "cudaMemsetAsync (rnn published bf16 h)"));
  } else {
    const size_t bytes = size_t(s.batch * s.steps * s.directions * s.hidden) * sizeof(float);
    JAXDNN_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(cell.io.h_seq, kPendingByte, bytes, stream),
                                     "cudaMemsetAsync (rnn published h)"));
  }
  cudaLaunchAttribute cooperative;
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(together * plan.blocks));
  config.blockDim = dim3(unsigned(plan.threads));
  config.dynamicSmemBytes = plan.smem_bytes;
  config.stream = stream;
  config.attrs = &cooperative;
  config.numAttrs = 1;
  for (int first = 0; first < directions; first += together) {
    JAXDNN_RETURN_IF_ERROR(CudaError(
        cudaLaunchKernelEx(&config, kernel, cell, w_hh, seq_lengths, s, reverse, plan, first), "rnn persistent"));
  }
  *launched = true;
  return ffi::Error::Success();
}

}  // namespace

template <typename Io>
ffi::Error PersistentRecurrence(cudaStream_t stream, ffi::DataType w_type, const void* w_hh,
                                const int32_t* seq_lengths, const RecurrenceShape& shape, bool reverse, bool tf32,
                                const Io& io, bool* launched) {
  *launched = false;
  return DispatchFloat<float, __nv_bfloat16, __half>(w_type, "w_hh", [&](auto tag) {
    using W = decltype(tag);
    return Launch(stream, static_cast<const W*>(w_hh), seq_lengths, shape, reverse, tf32, io, launched);
  });
}

template ffi::Error PersistentRecurrence<LstmFwdIo>(cudaStream_t, ffi::DataType, const void*, const int32_t*,
                                                    const RecurrenceShape&, bool, bool, const LstmFwdIo&, bool*);
template ffi::Error PersistentRecurrence<LstmBwdIo>(cudaStream_t, ffi::DataType, const void*, const int32_t*,
                                                    const RecurrenceShape&, bool, bool, const LstmBwdIo&, bool*);
template ffi::Error PersistentRecurrence<GruFwdIo>(cudaStream_t, ffi::DataType, const void*, const int32_t*,
                                                   const RecurrenceShape&, bool, bool, const GruFwdIo&, bool*);
template ffi::Error PersistentRecurrence<GruBwdIo>(cudaStream_t, ffi::DataType, const void*, const int32_t*,
                                                   const RecurrenceShape&, bool, bool, const GruBwdIo&, bool*);
template ffi::Error PersistentRecurrence<RnnFwdIo>(cudaStream_t, ffi::DataType, const void*, const int32_t*,
                                                   const RecurrenceShape&, bool, bool, const RnnFwdIo&, bool*);
template ffi::Error PersistentRecurrence<RnnBwdIo>(cudaStream_t, ffi::DataType, const void*, const int32_t*,
                                                   const RecurrenceShape&, bool, bool, const RnnBwdIo&, bool*);

}  // namespace jaxdnn
