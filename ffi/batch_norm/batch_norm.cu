// CUDA batch norm over x seen as [O, C, I] (see batch_norm.h). Two layouts, one kernel of each kind:
// - channels last (I == 1): a block is a tile of `row_lanes` rows x `pack_lanes` 16-byte channel packs;
//   each thread keeps its channels' coefficients (or sums) in registers and strides down the rows,
//   so no element needs a division to find its channel.
// - channels first (I > 1): a block owns one channel at a time and a chunk of O; its threads stride
//   along the contiguous runs of I elements.
// The sum stages write one partial sum per block and channel to the workspace, reduced afterwards in
// a fixed order (deterministic). The elementwise stages walk the rows backwards: the sum stage before
// them ended at the last rows, which are still in L2.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <type_traits>

#include "batch_norm/batch_norm.h"
#include "batch_norm/batch_norm_common.h"
#include "common/cuda_common.cuh"
#include "common/row_reduce.cuh"

namespace jaxdnn {
namespace {

constexpr int kThreads = 256;

// The channels-last tile of this thread: the pack of V channels from `channel`, rows row_lane,
// row_lane + row_lanes*gridDim.x, ...; `active` is false for the threads past the last pack.
struct LastLayoutThread {
  int64_t channel;
  int pack_lanes;  // threads across the channel packs
  int row_lane;
  int row_lanes;   // threads down the rows (kThreads / pack_lanes)
  bool active;
};

template <int V>
__device__ __forceinline__ LastLayoutThread MakeLastLayoutThread(int64_t channels) {
  const int64_t packs = channels / V;
  LastLayoutThread t;
  t.pack_lanes = int(packs < kThreads ? packs : kThreads);
  t.row_lanes = kThreads / t.pack_lanes;
  t.row_lane = threadIdx.x / t.pack_lanes;
  const int64_t pack = int64_t(blockIdx.y) * t.pack_lanes + threadIdx.x % t.pack_lanes;
  t.channel = pack * V;
  t.active = pack < packs && t.row_lane < t.row_lanes;
  return t;
}

// The channels-last stages stage their 16-byte packs through shared memory with cp.async,
// kStages rows ahead of the row a thread computes on: loads in flight without holding registers.
// (These kernels hold a pack's channel coefficients in registers, so only 2-4 blocks fit an SM; one
// load at a time per thread left them ~20% under copy bandwidth, and register-staged rows ahead
// spilled.) Slots: [kStages][3 operands: x, dy, residual][kThreads] packs of 16 bytes; a stage
// that reads x alone takes them as [3 kStages][1][kThreads], 3 kStages rows ahead (with 4 rows of x
// alone in flight the statistics pass read x at 3.15 TB/s, against 3.9 for the backward's sums
// pass with two operands: H200, Nsight Compute).
constexpr int kStages = 4;
constexpr int kStagedBytes = kStages * 3 * kThreads * 16;

// Dynamic shared memory of a channels-last kernel: the row slots (16-byte packs), which the sum
// stage then reuses for its block reduction (float2 per channel lane).
template <typename T, int V>
constexpr int LastSharedBytes() {
  constexpr int reduction = kThreads * V * int(sizeof(float2));
  return sizeof(Pack<T, V>) == 16 && kStagedBytes > reduction ? kStagedBytes : reduction;
}

// The raw packs of one element group: x, and dy and residual where the stage reads them.
template <typename T, int V>
struct Packs {
  Pack<T, V> x, dy, r;
};

template <typename T, int V>
__device__ __forceinline__ Packs<T, V> LoadPacks(const T* dy, const T* x, const T* residual, int64_t e) {
  Packs<T, V> p;
  p.x = *reinterpret_cast<const Pack<T, V>*>(x + e);
  if (dy != nullptr) p.dy = *reinterpret_cast<const Pack<T, V>*>(dy + e);
  if (residual != nullptr) p.r = *reinterpret_cast<const Pack<T, V>*>(residual + e);
  return p;
}

// The float values of loaded packs (0 for the operands the stage does not read).
template <typename T, int V>
__device__ __forceinline__ void Unpack(const Packs<T, V>& p, bool dy, bool residual, float (&xv)[V], float (&gv)[V],
                                       float (&rv)[V]) {
#pragma unroll
  for (int k = 0; k < V; ++k) {
    xv[k] = ToFloat(p.x.v[k]);
    gv[k] = dy ? ToFloat(p.dy.v[k]) : 0.f;
    rv[k] = residual ? ToFloat(p.r.v[k]) : 0.f;
  }
}

// Streams rows first, first + step, ... < rows through kSlots stages of this thread's slots
// [kSlots][kOperands][kThreads] (operand o: sources[o], skipped where null), calling
// fn(stage's slot of operand 0, row) once the row's copies have landed.
template <int kSlots, int kOperands, typename T, int V, typename Element, typename Fn>
__device__ __forceinline__ void StreamRows(const T* const (&sources)[3], int64_t first, int64_t step, int64_t rows,
                                           Element element, Pack<T, V>* slots, Fn&& fn) {
  auto slot = [&](int stage) { return slots + stage * kOperands * kThreads + threadIdx.x; };
  StreamThroughSlots<kSlots>(
      first, step, rows,
      [&](int stage, int64_t r) {
#pragma unroll
        for (int operand = 0; operand < kOperands; ++operand) {
          if (sources[operand] != nullptr) CpAsync16(slot(stage) + operand * kThreads, sources[operand] + element(r));
        }
      },
      [&](int stage, int64_t r) { fn(slot(stage), r); });
}

// Calls fn(packs, row) for rows first, first + step, ... < rows in that order (row counted from the
// end when `reverse`), with the row's packs of x, dy and residual (the non-null ones) at
// row * channels + channel. 16-byte packs come through `slots` (kStagedBytes of shared memory, this
// thread's own slots only, so no block barrier is needed); narrower ones are loaded directly.
template <typename T, int V, typename Fn>
__device__ __forceinline__ void ForEachRow(const T* dy, const T* x, const T* residual, int64_t first, int64_t step,
                                           int64_t rows, int64_t channels, int64_t channel, bool reverse,
                                           Pack<T, V>* slots, Fn&& fn) {
  auto element = [&](int64_t r) { return (reverse ? rows - 1 - r : r) * channels + channel; };
  if constexpr (sizeof(Pack<T, V>) != 16) {
    for (int64_t r = first; r < rows; r += step) fn(LoadPacks<T, V>(dy, x, residual, element(r)), element(r));
  } else {
    const T* sources[3] = {x, dy, residual};
    if (dy == nullptr && residual == nullptr) {  // x alone: three times the rows in flight
      StreamRows<3 * kStages, 1>(sources, first, step, rows, element, slots, [&](const Pack<T, V>* slot, int64_t r) {
        Packs<T, V> packs;
        packs.x = *slot;
        fn(packs, element(r));
      });
    } else {
      StreamRows<kStages, 3>(sources, first, step, rows, element, slots, [&](const Pack<T, V>* slot, int64_t r) {
        Packs<T, V> packs;
        packs.x = slot[0];
        if (dy != nullptr) packs.dy = slot[kThreads];
        if (residual != nullptr) packs.r = slot[2 * kThreads];
        fn(packs, element(r));
      });
    }
  }
}

template <typename T, int V>
__device__ __forceinline__ void StorePack(T* p, const float (&in)[V]) {
  Pack<T, V> v;
#pragma unroll
  for (int k = 0; k < V; ++k) v.v[k] = FromFloat<T>(in[k]);
  StoreWords(p, v);
}

// The coefficients of the V elements of a pack: channels c, c+1, ... (channels last, step 1) or
// channel c for all (channels first, step 0).
template <int V>
__device__ __forceinline__ void LoadChannels(const float* p, int step, float (&out)[V]) {
#pragma unroll
  for (int k = 0; k < V; ++k) out[k] = __ldg(p + k * step);
}

// The per-element operation of each stage, on the float values of a pack (V channel lanes).
// Sum stages give the two terms to accumulate; elementwise stages write their outputs.
struct StatsOp {
  const float* shift;
  template <int V> struct Channels { float shift[V]; };
  template <int V>
  __device__ Channels<V> Load(int64_t c, int step) const {
    Channels<V> ch;
    LoadChannels<V>(shift + c, step, ch.shift);
    return ch;
  }
  template <int V>
  __device__ void Terms(const Channels<V>& ch, const float (&dy)[V], const float (&x)[V], const float (&r)[V],
                        float (&first)[V], float (&second)[V]) const {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      first[k] = x[k] - ch.shift[k];
      second[k] = first[k] * first[k];
    }
  }
};

// The per-channel affine and activation of the other stages: pre = a (x - mean) + bias [+ residual].
struct Affine {
  const float *a, *mean, *bias;
  int64_t act;
  float param;
  template <int V> struct Channels { float a[V], mean[V], bias[V]; };
  template <int V>
  __device__ Channels<V> Load(int64_t c, int step) const {
    Channels<V> ch;
    LoadChannels<V>(a + c, step, ch.a);
    LoadChannels<V>(mean + c, step, ch.mean);
    LoadChannels<V>(bias + c, step, ch.bias);
    return ch;
  }
  // The pack's pre-activations a (x - mean) + bias + r (as in BatchNormOut).
  template <int V>
  __device__ void Pre(const Channels<V>& ch, const float (&x)[V], const float (&r)[V], float (&pre)[V]) const {
#pragma unroll
    for (int k = 0; k < V; ++k) pre[k] = ch.a[k] * (x[k] - ch.mean[k]) + ch.bias[k] + r[k];
  }
  // g = dy act'(pre) for the pack (as in BatchNormGrad), one activation switch for the V values; dy
  // itself without kAct.
  template <bool kAct, int V>
  __device__ void Grad(const Channels<V>& ch, const float (&dy)[V], const float (&x)[V], const float (&r)[V],
                       float (&g)[V]) const {
#pragma unroll
    for (int k = 0; k < V; ++k) g[k] = dy[k];
    if constexpr (kAct) {
      float pre[V];
      Pre<V>(ch, x, r, pre);
      ActivateGradKindN(act, pre, g, param);
    }
  }
};

// The ops that apply the activation come in two instantiations (see WithActivation): kAct, and the
// identity's, which carries no activation code (whose registers the identity kernels paid for too).
template <bool kAct>
struct BwdSumsOp : Affine {
  template <int V>
  __device__ void Terms(const Channels<V>& ch, const float (&dy)[V], const float (&x)[V], const float (&r)[V],
                        float (&first)[V], float (&second)[V]) const {
    Grad<kAct, V>(ch, dy, x, r, first);
#pragma unroll
    for (int k = 0; k < V; ++k) second[k] = first[k] * (x[k] - ch.mean[k]);
  }
};

// Sum stage, channels last: per-thread register sums down the rows, then the block's row lanes
// are added in a fixed order through shared memory; one partial per (block row, channel). g_out,
// when given, receives each element's first term (the backward's g).
template <typename T, int V, typename Op>
__global__ void __launch_bounds__(kThreads) SumsLastKernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                           const T* __restrict__ residual, Op op, int64_t rows,
                                                           int64_t channels, float* __restrict__ partials,
                                                           T* __restrict__ g_out) {
  extern __shared__ __align__(16) unsigned char shared[];  // LastSharedBytes<T, V>()
  const LastLayoutThread t = MakeLastLayoutThread<V>(channels);
  float2 sum[V];
#pragma unroll
  for (int k = 0; k < V; ++k) sum[k] = make_float2(0.f, 0.f);
  if (t.active) {
    const auto ch = op.template Load<V>(t.channel, 1);
    ForEachRow<T, V>(dy, x, residual, int64_t(blockIdx.x) * t.row_lanes + t.row_lane, int64_t(gridDim.x) * t.row_lanes,
                     rows, channels, t.channel, false, reinterpret_cast<Pack<T, V>*>(shared),
                     [&](const Packs<T, V>& packs, int64_t e) {
                       float xv[V], gv[V], rv[V], first[V], second[V];
                       Unpack(packs, dy != nullptr, residual != nullptr, xv, gv, rv);
                       op.template Terms<V>(ch, gv, xv, rv, first, second);
#pragma unroll
                       for (int k = 0; k < V; ++k) {
                         sum[k].x += first[k];
                         sum[k].y += second[k];
                       }
                       if (g_out != nullptr) StorePack<T, V>(g_out + e, first);
                     });
  }
  float2* staged = reinterpret_cast<float2*>(shared);  // the row slots, free once every thread is done
  __syncthreads();
#pragma unroll
  for (int k = 0; k < V; ++k) staged[threadIdx.x * V + k] = sum[k];
  __syncthreads();
  if (t.active && t.row_lane == 0) {
    for (int lane = 1; lane < t.row_lanes; ++lane) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float2 other = staged[(lane * t.pack_lanes + threadIdx.x) * V + k];
        sum[k].x += other.x;
        sum[k].y += other.y;
      }
    }
    float* out = partials + int64_t(blockIdx.x) * 2 * channels + t.channel;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      out[k] = sum[k].x;
      out[channels + k] = sum[k].y;
    }
  }
}

// Sum stage, channels first: a block sums one channel's runs of its chunk of O, then the next channel.
template <typename T, int V, typename Op>
__global__ void __launch_bounds__(kThreads) SumsFirstKernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                            const T* __restrict__ residual, Op op, ChannelShape s,
                                                            float* __restrict__ partials, T* __restrict__ g_out) {
  for (int64_t c = blockIdx.y; c < s.channels; c += gridDim.y) {
    const auto ch = op.template Load<V>(c, 0);
    float2 sum = make_float2(0.f, 0.f);
    for (int64_t o = blockIdx.x; o < s.outer; o += gridDim.x) {
      const int64_t base = (o * s.channels + c) * s.inner;
      for (int64_t i = int64_t(threadIdx.x) * V; i < s.inner; i += int64_t(kThreads) * V) {
        float xv[V], gv[V], rv[V], first[V], second[V];
        Unpack(LoadPacks<T, V>(dy, x, residual, base + i), dy != nullptr, residual != nullptr, xv, gv, rv);
        op.template Terms<V>(ch, gv, xv, rv, first, second);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          sum.x += first[k];
          sum.y += second[k];
        }
        if (g_out != nullptr) StorePack<T, V>(g_out + base + i, first);
      }
    }
    sum = GroupReduce(sum, kThreads, make_float2(0.f, 0.f),
                      [](float2 p, float2 q) { return make_float2(p.x + q.x, p.y + q.y); });
    if (threadIdx.x == 0) {
      partials[int64_t(blockIdx.x) * 2 * s.channels + c] = sum.x;
      partials[(int64_t(blockIdx.x) * 2 + 1) * s.channels + c] = sum.y;
    }
    __syncthreads();  // GroupReduce's shared memory is reused for the next channel
  }
}

// out1[c] = sum_p partials[p, 0, c], out2[c] = sum_p partials[p, 1, c], in a fixed order: a block
// takes 32 consecutive channels (a warp's lanes), its warp w adds p = w, w + kSumWarps, ..., and the
// warps' sums are added in order. (A thread per channel looping over every p was one latency-bound
// block for C = 256: about a third of the statistics stage's time.)
constexpr int kSumWarps = 32;

__global__ void __launch_bounds__(kSumWarps * 32)
    SumPartialsKernel(const float* __restrict__ partials, int blocks, int64_t channels, float* __restrict__ out1,
                      float* __restrict__ out2) {
  __shared__ float2 warp_sums[kSumWarps][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t first = int64_t(blockIdx.x) * 32; first < channels; first += int64_t(gridDim.x) * 32) {
    const int64_t c = first + lane;
    float2 sum = make_float2(0.f, 0.f);
    if (c < channels) {
      for (int p = warp; p < blocks; p += kSumWarps) {
        sum.x += partials[int64_t(p) * 2 * channels + c];
        sum.y += partials[(int64_t(p) * 2 + 1) * channels + c];
      }
    }
    warp_sums[warp][lane] = sum;
    __syncthreads();
    if (warp == 0 && c < channels) {
      for (int w = 1; w < kSumWarps; ++w) {
        sum.x += warp_sums[w][lane].x;
        sum.y += warp_sums[w][lane].y;
      }
      out1[c] = sum.x;
      out2[c] = sum.y;
    }
    __syncthreads();  // warp_sums is reused for the next channels
  }
}

// The elementwise stages: y = act(pre), or dx = a g + k1 (x - mean) + k0.
template <bool kAct>
struct FwdOp : Affine {
  template <int V>
  __device__ void Apply(const Channels<V>& ch, const float (&dy)[V], const float (&x)[V], const float (&r)[V],
                        float (&out)[V]) const {
    Pre<V>(ch, x, r, out);
    if constexpr (kAct) ActivateKindN(act, out, param);
  }
};

template <bool kAct>
struct BwdDxOp : Affine {
  const float *k1, *k0;
  template <int V> struct Channels : Affine::Channels<V> { float k1[V], k0[V]; };
  template <int V>
  __device__ Channels<V> Load(int64_t c, int step) const {
    Channels<V> ch;
    static_cast<Affine::Channels<V>&>(ch) = Affine::Load<V>(c, step);
    LoadChannels<V>(k1 + c, step, ch.k1);
    LoadChannels<V>(k0 + c, step, ch.k0);
    return ch;
  }
  template <int V>
  __device__ void Apply(const Channels<V>& ch, const float (&dy)[V], const float (&x)[V], const float (&r)[V],
                        float (&dx)[V]) const {
    float g[V];
    Grad<kAct, V>(ch, dy, x, r, g);
#pragma unroll
    for (int k = 0; k < V; ++k) dx[k] = ch.a[k] * g[k] + ch.k1[k] * (x[k] - ch.mean[k]) + ch.k0[k];
  }
};

// One element pack of an elementwise stage, loaded: op.Apply and the store.
template <typename T, int V, typename Op, typename Channels>
__device__ __forceinline__ void ApplyPacks(const Op& op, const Channels& ch, const Packs<T, V>& p, bool dy,
                                           bool residual, T* out, int64_t e) {
  float xv[V], gv[V], rv[V], o[V];
  Unpack(p, dy, residual, xv, gv, rv);
  op.template Apply<V>(ch, gv, xv, rv, o);
  StorePack<T, V>(out + e, o);
}

template <typename T, int V, typename Op>
__global__ void __launch_bounds__(kThreads) ApplyLastKernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                            const T* __restrict__ residual, Op op, int64_t rows,
                                                            int64_t channels, T* __restrict__ out) {
  const LastLayoutThread t = MakeLastLayoutThread<V>(channels);
  if (!t.active) return;
  extern __shared__ __align__(16) unsigned char shared[];  // LastSharedBytes<T, V>()
  const auto ch = op.template Load<V>(t.channel, 1);
  ForEachRow<T, V>(dy, x, residual, int64_t(blockIdx.x) * t.row_lanes + t.row_lane, int64_t(gridDim.x) * t.row_lanes,
                   rows, channels, t.channel, true, reinterpret_cast<Pack<T, V>*>(shared),
                   [&](const Packs<T, V>& packs, int64_t e) {
                     ApplyPacks<T, V>(op, ch, packs, dy != nullptr, residual != nullptr, out, e);
                   });
}

template <typename T, int V, typename Op>
__global__ void __launch_bounds__(kThreads) ApplyFirstKernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                             const T* __restrict__ residual, Op op, ChannelShape s,
                                                             T* __restrict__ out) {
  for (int64_t c = blockIdx.y; c < s.channels; c += gridDim.y) {
    const auto ch = op.template Load<V>(c, 0);
    for (int64_t step = blockIdx.x; step < s.outer; step += gridDim.x) {
      const int64_t base = ((s.outer - 1 - step) * s.channels + c) * s.inner;
      for (int64_t i = int64_t(threadIdx.x) * V; i < s.inner; i += int64_t(kThreads) * V) {
        ApplyPacks<T, V>(op, ch, LoadPacks<T, V>(dy, x, residual, base + i), dy != nullptr, residual != nullptr, out,
                         base + i);
      }
    }
  }
}

// 16-byte packs when every pack stays within one channel run (channels last: C a multiple of V;
// channels first: I a multiple of V) and every buffer is 16-byte aligned; single elements otherwise.
template <typename T>
bool UseVectors(const ChannelShape& s, std::initializer_list<const void*> buffers) {
  constexpr int V = kVec16<T>;
  if ((s.inner == 1 ? s.channels : s.inner) % V != 0) return false;
  for (const void* p : buffers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// The grid of a launch: y covers the channels (packs of V for channels last), x the rows of O in
// `blocks_x` strided chunks, at most `max_x` (for the sum stages: the workspace's P).
template <int V>
dim3 LaunchGrid(const ChannelShape& s, int resident, int64_t max_x) {
  int64_t y, x_needed;
  if (s.inner == 1) {
    const int64_t packs = s.channels / V;
    const int64_t pack_lanes = std::min<int64_t>(packs, kThreads);
    y = (packs + pack_lanes - 1) / pack_lanes;
    x_needed = (s.outer + kThreads / pack_lanes - 1) / (kThreads / pack_lanes);
  } else {
    y = std::min<int64_t>(s.channels, 65535);
    x_needed = s.outer;
  }
  const int64_t x = std::min({x_needed, std::max<int64_t>(1, resident / y), max_x, int64_t(1) << 30});
  return dim3(unsigned(std::max<int64_t>(x, 1)), unsigned(y));
}

// Runs a sum stage: partial sums per block into `workspace`, then their fixed-order sum.
template <typename T, int V, typename Op>
ffi::Error LaunchSums(cudaStream_t stream, const T* dy, const T* x, const T* residual, const Op& op,
                      const ChannelShape& s, float* workspace, int64_t workspace_blocks, float* out1,
                      float* out2, T* g_out, const char* what) {
  const bool last = s.inner == 1;
  if (last && s.channels / V > int64_t(kThreads) * 65535) return InvalidArgument("batch_norm: too many channels");
  auto kernel_last = SumsLastKernel<T, V, Op>;
  auto kernel_first = SumsFirstKernel<T, V, Op>;
  constexpr int kShared = LastSharedBytes<T, V>();
  const int resident = last ? ResidentBlocks(kernel_last, kThreads, kShared) : ResidentBlocks(kernel_first, kThreads, 0);
  const dim3 grid = LaunchGrid<V>(s, resident, workspace_blocks);
  if (last) {
    kernel_last<<<grid, kThreads, kShared, stream>>>(dy, x, residual, op, s.outer, s.channels, workspace, g_out);
  } else {
    kernel_first<<<grid, kThreads, 0, stream>>>(dy, x, residual, op, s, workspace, g_out);
  }
  JAXDNN_RETURN_IF_ERROR(LaunchError(what));
  const int64_t sum_blocks = std::min<int64_t>((s.channels + 31) / 32, 4096);
  SumPartialsKernel<<<unsigned(sum_blocks), kSumWarps * 32, 0, stream>>>(workspace, int(grid.x), s.channels, out1,
                                                                        out2);
  return LaunchError(what);
}

template <typename T, int V, typename Op>
ffi::Error LaunchApply(cudaStream_t stream, const T* dy, const T* x, const T* residual, const Op& op,
                       const ChannelShape& s, T* out, const char* what) {
  const bool last = s.inner == 1;
  if (last && s.channels / V > int64_t(kThreads) * 65535) return InvalidArgument("batch_norm: too many channels");
  auto kernel_last = ApplyLastKernel<T, V, Op>;
  auto kernel_first = ApplyFirstKernel<T, V, Op>;
  constexpr int kShared = LastSharedBytes<T, V>();
  const int resident = last ? ResidentBlocks(kernel_last, kThreads, kShared) : ResidentBlocks(kernel_first, kThreads, 0);
  const dim3 grid = LaunchGrid<V>(s, 4 * resident, int64_t(1) << 30);
  if (last) {
    kernel_last<<<grid, kThreads, kShared, stream>>>(dy, x, residual, op, s.outer, s.channels, out);
  } else {
    kernel_first<<<grid, kThreads, 0, stream>>>(dy, x, residual, op, s, out);
  }
  return LaunchError(what);
}

// Calls fn(std::integral_constant<bool, act is not the identity>).
template <typename Fn>
ffi::Error WithActivation(int64_t act, Fn&& fn) {
  return act != int64_t(Activation::kIdentity) ? fn(std::true_type{}) : fn(std::false_type{});
}

// Zero sums for an empty batch (every output is written, even then).
ffi::Error ZeroSums(cudaStream_t stream, float* out1, float* out2, int64_t channels) {
  JAXDNN_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(out1, 0, channels * sizeof(float), stream), "batch_norm"));
  return CudaError(cudaMemsetAsync(out2, 0, channels * sizeof(float), stream), "batch_norm");
}

ffi::Error StatsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> shift,
                     ffi::Result<ffi::Buffer<ffi::F32>> s1, ffi::Result<ffi::Buffer<ffi::F32>> s2,
                     ffi::Result<ffi::Buffer<ffi::F32>> workspace) {
  ChannelShape s;
  JAXDNN_RETURN_IF_ERROR(
      CheckBatchNormStage(x, {}, {shift.dimensions(), s1->dimensions(), s2->dimensions()}, 0, &s));
  if (s.channels == 0) return ffi::Error::Success();
  if (s.elements() == 0) return ZeroSums(stream, s1->typed_data(), s2->typed_data(), s.channels);
  int64_t blocks = 0;
  JAXDNN_RETURN_IF_ERROR(WorkspaceBlocks(workspace->dimensions(), s, &blocks));
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    const StatsOp op{shift.typed_data()};
    auto launch = [&](auto vec) {
      return LaunchSums<T, decltype(vec)::value>(stream, nullptr, xp, nullptr, op, s, workspace->typed_data(), blocks,
                                                 s1->typed_data(), s2->typed_data(), static_cast<T*>(nullptr),
                                                 "batch_norm statistics");
    };
    return UseVectors<T>(s, {xp}) ? launch(std::integral_constant<int, kVec16<T>>{})
                                  : launch(std::integral_constant<int, 1>{});
  });
}

ffi::Error FwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> mean,
                   ffi::Buffer<ffi::F32> bias, std::optional<ffi::AnyBuffer> residual, ffi::Result<ffi::AnyBuffer> y, int64_t act,
                   float param) {
  ChannelShape s;
  JAXDNN_RETURN_IF_ERROR(CheckBatchNormStage(
      x, {&*y, OrNull(residual)}, {a.dimensions(), mean.dimensions(), bias.dimensions()}, act, &s));
  if (s.elements() == 0) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    const T* rp = DataOrNull<T>(residual);
    T* yp = static_cast<T*>(y->untyped_data());
    const Affine affine{a.typed_data(), mean.typed_data(), bias.typed_data(), act, param};
    auto launch = [&](auto vec) {
      return WithActivation(act, [&](auto has_act) {
        const FwdOp<decltype(has_act)::value> op{affine};
        return LaunchApply<T, decltype(vec)::value>(stream, nullptr, xp, rp, op, s, yp, "batch_norm forward");
      });
    };
    return UseVectors<T>(s, {xp, rp, yp}) ? launch(std::integral_constant<int, kVec16<T>>{})
                                          : launch(std::integral_constant<int, 1>{});
  });
}

// The backward sums of both sum stages, and g itself when `g_out` is given (with a residual).
ffi::Error BackwardSums(cudaStream_t stream, const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                        ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> bias,
                        const ffi::AnyBuffer* residual, ffi::AnyBuffer* g_out, ffi::Result<ffi::Buffer<ffi::F32>> sg,
                        ffi::Result<ffi::Buffer<ffi::F32>> sgx, ffi::Result<ffi::Buffer<ffi::F32>> workspace,
                        int64_t act, float param) {
  ChannelShape s;
  JAXDNN_RETURN_IF_ERROR(CheckBatchNormStage(
      x, {&dy, residual, g_out},
      {a.dimensions(), mean.dimensions(), bias.dimensions(), sg->dimensions(), sgx->dimensions()}, act, &s));
  if (s.channels == 0) return ffi::Error::Success();
  if (s.elements() == 0) return ZeroSums(stream, sg->typed_data(), sgx->typed_data(), s.channels);
  int64_t blocks = 0;
  JAXDNN_RETURN_IF_ERROR(WorkspaceBlocks(workspace->dimensions(), s, &blocks));
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* gp = static_cast<const T*>(dy.untyped_data());
    const T* xp = static_cast<const T*>(x.untyped_data());
    const T* rp = residual ? static_cast<const T*>(residual->untyped_data()) : nullptr;
    T* go = g_out ? static_cast<T*>(g_out->untyped_data()) : nullptr;
    const Affine affine{a.typed_data(), mean.typed_data(), bias.typed_data(), act, param};
    auto launch = [&](auto vec) {
      return WithActivation(act, [&](auto has_act) {
        const BwdSumsOp<decltype(has_act)::value> op{affine};
        return LaunchSums<T, decltype(vec)::value>(stream, gp, xp, rp, op, s, workspace->typed_data(), blocks,
                                                   sg->typed_data(), sgx->typed_data(), go,
                                                   "batch_norm backward sums");
      });
    };
    return UseVectors<T>(s, {gp, xp, rp, go}) ? launch(std::integral_constant<int, kVec16<T>>{})
                                              : launch(std::integral_constant<int, 1>{});
  });
}

ffi::Error BwdSumsImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> a,
                       ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> bias, ffi::Result<ffi::Buffer<ffi::F32>> sg,
                       ffi::Result<ffi::Buffer<ffi::F32>> sgx, ffi::Result<ffi::Buffer<ffi::F32>> workspace,
                       int64_t act, float param) {
  return BackwardSums(stream, dy, x, a, mean, bias, nullptr, nullptr, sg, sgx, workspace, act, param);
}

ffi::Error BwdGradImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> a,
                       ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> bias, ffi::AnyBuffer residual,
                       ffi::Result<ffi::AnyBuffer> g, ffi::Result<ffi::Buffer<ffi::F32>> sg,
                       ffi::Result<ffi::Buffer<ffi::F32>> sgx, ffi::Result<ffi::Buffer<ffi::F32>> workspace,
                       int64_t act, float param) {
  return BackwardSums(stream, dy, x, a, mean, bias, &residual, &*g, sg, sgx, workspace, act, param);
}

ffi::Error BwdDxImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> a,
                     ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> k1, ffi::Buffer<ffi::F32> k0,
                     ffi::Result<ffi::AnyBuffer> dx, int64_t act, float param) {
  ChannelShape s;
  JAXDNN_RETURN_IF_ERROR(CheckBatchNormStage(
      x, {&dy, &*dx}, {a.dimensions(), mean.dimensions(), bias.dimensions(), k1.dimensions(), k0.dimensions()},
      act, &s));
  if (s.elements() == 0) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* gp = static_cast<const T*>(dy.untyped_data());
    const T* xp = static_cast<const T*>(x.untyped_data());
    T* dxp = static_cast<T*>(dx->untyped_data());
    const Affine affine{a.typed_data(), mean.typed_data(), bias.typed_data(), act, param};
    auto launch = [&](auto vec) {
      return WithActivation(act, [&](auto has_act) {
        const BwdDxOp<decltype(has_act)::value> op{affine, k1.typed_data(), k0.typed_data()};
        return LaunchApply<T, decltype(vec)::value>(stream, gp, xp, static_cast<const T*>(nullptr), op, s, dxp,
                                                    "batch_norm backward dx");
      });
    };
    return UseVectors<T>(s, {gp, xp, dxp}) ? launch(std::integral_constant<int, kVec16<T>>{})
                                           : launch(std::integral_constant<int, 1>{});
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormStatsCuda, jaxdnn::StatsImpl, jaxdnn::BindBatchNormStats(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormFwdCuda, jaxdnn::FwdImpl, jaxdnn::BindBatchNormFwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBwdSumsCuda, jaxdnn::BwdSumsImpl,
                              jaxdnn::BindBatchNormBwdSums(jaxdnn::BindCuda()), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBwdGradCuda, jaxdnn::BwdGradImpl,
                              jaxdnn::BindBatchNormBwdGrad(jaxdnn::BindCuda()), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBwdDxCuda, jaxdnn::BwdDxImpl, jaxdnn::BindBatchNormBwdDx(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
