// CUDA LayerNorm / RMSNorm.
//
// Forward: one group of `group` threads per row (a warp for short rows, a whole block for long
// ones). The fast path keeps the row in registers as loaded (16-byte packs, up to kIters a thread)
// and reduces mean and variance in one pass by combining per-thread (count, mean, M2) moments;
// rows that are not a multiple of a 16-byte vector, or longer than the registers hold, take the
// streaming path, which re-reads the row (from L1/L2) for each pass.
//
// Backward: a persistent grid of G blocks (as many as are resident at once, capped by the
// workspace's P). Block b owns a contiguous chunk of rows; each thread stages its columns of the
// next row in shared memory with cp.async while it computes dx for the current one, and accumulates
// dscale/dbias for its columns in registers; the block writes them to workspace[b]. A second kernel
// sums workspace[0..G) in a fixed order, so the result has the same bits on every run on a device.
#include <algorithm>
#include <type_traits>

#include "common/cuda_common.cuh"
#include "common/row_reduce.cuh"
#include "norm/norm.h"
#include "norm/norm_common.h"

namespace jaxdnn {
namespace {

constexpr int kIters = kRowIters;
constexpr int kMaxBwdGroup = 512;  // the cached backward holds two rows of registers a thread

// Row statistics as (count, mean, sum of squared deviations). Combining two partial results
// (Chan et al.) is exact in the sense of a two-pass variance, so one reduction gives mean and variance.
struct Moments {
  float count, mean, m2;
};

__device__ __forceinline__ Moments Combine(Moments a, Moments b) {
  const float count = a.count + b.count;
  if (count == 0.f) return a;
  const float delta = b.mean - a.mean;
  const float weight = b.count / count;
  return {count, a.mean + delta * weight, a.m2 + b.m2 + delta * delta * a.count * weight};
}

// The row's moments, combined over its group.
__device__ __forceinline__ Moments GroupMoments(Moments m, int group) {
  return GroupReduce(m, group, Moments{0.f, 0.f, 0.f}, Combine);
}

// The fused activation, in the kAct instantiations only (launched when one is given): the identity
// kernels carry no activation code, whose per-element run-time dispatch cost registers, spills and
// a third of the norm kernels' speed. It takes a whole pack of pre-activations (xhat * scale +
// bias) at once: one switch on the kind per pack, so the pack's evaluations overlap.
// pre <- act(pre).
template <bool kAct, int N>
__device__ __forceinline__ void ApplyActivation(float (&pre)[N], NormActivation act) {
  if constexpr (kAct) ActivateKindN(act.kind, pre, act.param);
}

// dy <- dy * act'(pre): the gradient reaching the affine output, for a pack.
template <bool kAct, int N>
__device__ __forceinline__ void ActivationGradIn(const float (&pre)[N], float (&dy)[N], NormActivation act) {
  if constexpr (kAct) ActivateGradKindN(act.kind, pre, dy, act.param);
}

// Columns a streaming kernel's thread takes at once (j, j + blockDim.x, ...): a pack for the
// activation when one is fused, one column otherwise (the identity kernels' loops as they were).
template <bool kAct>
constexpr int kStreamPack = kAct ? 4 : 1;

// Calls fn(std::integral_constant<bool, act.kind != 0>); RMSNorm has no fused activation, so no
// kAct instantiation.
template <bool kRms, typename Fn>
ffi::Error WithActivation(NormActivation act, Fn&& fn) {
  if constexpr (kRms) return fn(std::false_type{});
  else return act.kind != 0 ? fn(std::true_type{}) : fn(std::false_type{});
}

// ---------------------------------------------------------------------------------------------
// Forward

template <typename T, bool kRms, bool kAct>
__global__ void __launch_bounds__(kMaxGroup) NormFwdCached(const T* __restrict__ x, const float* __restrict__ scale,
                             const float* __restrict__ bias, T* __restrict__ y,
                             float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows,
                             int features, int group, float epsilon, NormActivation act) {
  constexpr int kVec = kVec16<T>;
  using Vec = Pack<T, kVec>;
  const RowGroup g = MakeRowGroup(group);
  if (group <= 32 && g.row >= rows) return;  // wider groups: the grid has exactly `rows` blocks
  const T* xr = x + g.row * features;
  // The row stays in registers as loaded (16-byte packs, half the registers of floats for 16-bit
  // types, so more rows fit on an SM); each pass converts again, which costs next to nothing.
  Vec raw[kIters];
  int valid = 0;  // vectors this thread holds
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int col = (i * group + g.lane) * kVec;
    if (col < features) {
      raw[i] = *reinterpret_cast<const Vec*>(xr + col);
      ++valid;
    }
  }
  // This thread's moments, two-pass over its registers, then one reduction over the row.
  float mean = 0.f, rstd;
  if (kRms) {
    float sq[1] = {0.f};
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      if (i < valid) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) sq[0] += ToFloat(raw[i].v[k]) * ToFloat(raw[i].v[k]);
      }
    }
    GroupSum(sq, group);
    rstd = rsqrtf(sq[0] / features + epsilon);
  } else {
    Moments m = {float(valid * kVec), 0.f, 0.f};
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      if (i < valid) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) sum += ToFloat(raw[i].v[k]);
      }
    }
    m.mean = valid > 0 ? sum / m.count : 0.f;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      if (i < valid) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float c = ToFloat(raw[i].v[k]) - m.mean;
          m.m2 += c * c;
        }
      }
    }
    m = GroupMoments(m, group);
    mean = m.mean;
    rstd = rsqrtf(m.m2 / features + epsilon);
  }
  T* yr = y + g.row * features;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int col = (i * group + g.lane) * kVec;
    if (i < valid) {
      const Pack<float, kVec> s = *reinterpret_cast<const Pack<float, kVec>*>(scale + col);
      Pack<float, kVec> b;
      if (!kRms) b = *reinterpret_cast<const Pack<float, kVec>*>(bias + col);
      float pre[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float xhat = (ToFloat(raw[i].v[k]) - mean) * rstd;
        pre[k] = xhat * s.v[k] + (kRms ? 0.f : b.v[k]);
      }
      ApplyActivation<kAct>(pre, act);
      Vec out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) out.v[k] = FromFloat<T>(pre[k]);
      *reinterpret_cast<Vec*>(yr + col) = out;
    }
  }
  if (g.lane == 0) {
    if (!kRms) mean_out[g.row] = mean;
    rstd_out[g.row] = rstd;
  }
}

// One row per block, any feature count.
template <typename T, bool kRms, bool kAct>
__global__ void NormFwdStreaming(const T* __restrict__ x, const float* __restrict__ scale,
                                 const float* __restrict__ bias, T* __restrict__ y,
                                 float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                 int features, float epsilon, NormActivation act) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * features;
  float mean = 0.f;
  if (!kRms) {
    float sum[1] = {0.f};
    for (int j = threadIdx.x; j < features; j += blockDim.x) sum[0] += ToFloat(xr[j]);
    GroupSum(sum, blockDim.x);
    mean = sum[0] / features;
  }
  float sq[1] = {0.f};
  for (int j = threadIdx.x; j < features; j += blockDim.x) {
    const float c = ToFloat(xr[j]) - mean;
    sq[0] += c * c;
  }
  GroupSum(sq, blockDim.x);
  const float rstd = rsqrtf(sq[0] / features + epsilon);
  T* yr = y + row * features;
  constexpr int kPack = kStreamPack<kAct>;
  for (int first = threadIdx.x; first < features; first += kPack * blockDim.x) {
    float pre[kPack];
#pragma unroll
    for (int p = 0; p < kPack; ++p) {
      const int j = first + p * blockDim.x;
      pre[p] = j < features ? (ToFloat(xr[j]) - mean) * rstd * scale[j] + (kRms ? 0.f : bias[j]) : 0.f;
    }
    ApplyActivation<kAct>(pre, act);
#pragma unroll
    for (int p = 0; p < kPack; ++p) {
      const int j = first + p * blockDim.x;
      if (j < features) yr[j] = FromFloat<T>(pre[p]);
    }
  }
  if (threadIdx.x == 0) {
    if (!kRms) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// ---------------------------------------------------------------------------------------------
// Backward. With xhat = (x - mean) * rstd and g = scale * dy (dy times the activation's derivative
// first when one is fused, with pre = xhat * scale + bias):
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMSNorm drops mean(g))
//   dscale = sum_rows(dy * xhat), dbias = sum_rows(dy)

// bias[col, col + kVec) when an activation needs it (its derivative takes the affine output), else 0.
template <int kVec, bool kAct>
__device__ __forceinline__ Pack<float, kVec> BiasPack(const float* bias, int col) {
  if (kAct) return *reinterpret_cast<const Pack<float, kVec>*>(bias + col);
  return Pack<float, kVec>{};
}

// A pack's d = dy * act'(xhat * scale + bias), kSub values a switch; kErf: act is gelu_erf (which
// the other kernels' switch omits, see NormBwdCached).
template <int kSub, bool kErf, typename T, int kVec>
__device__ __forceinline__ void PackGradIn(const Pack<T, kVec>& xs, const Pack<T, kVec>& dys,
                                           const Pack<float, kVec>& s, const Pack<float, kVec>& b, float mean,
                                           float rstd, NormActivation act, float (&d)[kVec]) {
  float previous = 0.f;  // kErf: the last result of the previous sub-pack
#pragma unroll
  for (int h = 0; h < kVec; h += kSub) {
    float pre[kSub], part[kSub];
#pragma unroll
    for (int k = 0; k < kSub; ++k) {
      part[k] = ToFloat(dys.v[h + k]);
      pre[k] = (ToFloat(xs.v[h + k]) - mean) * rstd * s.v[h + k] + b.v[h + k];
    }
    if constexpr (kErf) {
      // Without a switch between them the compiler would interleave every erfc of the pack and
      // spill; these empty asm statements make the sub-pack's inputs wait for the previous result.
#pragma unroll
      for (int k = 0; k < kSub; ++k) asm volatile("" : "+f"(pre[k]) : "f"(previous));
      ActivateGradPack<Activation::kGeluErf>(pre, part, act.param);
      previous = part[kSub - 1];
    } else {
      ActivateGradKindN<kSub, Activation::kGeluErf>(act.kind, pre, part, act.param);
    }
#pragma unroll
    for (int k = 0; k < kSub; ++k) d[h + k] = part[k];
  }
}

// Rows [begin, end) of block `block` when `rows` rows are split over `blocks` blocks.
__device__ __forceinline__ void BlockRows(int64_t rows, int blocks, int block, int64_t* begin,
                                          int64_t* end) {
  *begin = rows * block / blocks;
  *end = rows * (block + 1) / blocks;
}

// Each thread stages its own columns of the next row (x and dy) in shared memory with cp.async
// while it works on the current one, so a row's loads are always in flight; dscale/dbias for the
// thread's columns accumulate in registers.
//
// The row's dscale/dbias accumulators take 64 of the 128 registers a thread has in 512-thread blocks
// (16-bit LayerNorm): room for act' on 4 values at once, but not for erfc's temporaries 4 at a time
// (with gelu_erf in the switch, the kernel spilled accumulators on every row, whatever the
// activation). So the kAct kernels' switch omits gelu_erf, and the kErf instantiation, launched
// exactly when the kind is gelu_erf, runs it alone, one sub-pack after the other (see PackGradIn).
template <typename T, bool kRms, bool kAct, bool kErf>
__global__ void __launch_bounds__(kMaxBwdGroup) NormBwdCached(
    const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ scale,
    const float* __restrict__ bias, const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
    T* __restrict__ dx, float* __restrict__ workspace, int64_t rows, int features, int group,
    NormActivation act) {
  constexpr int kVec = kVec16<T>;
  constexpr int kSums = kRms ? 1 : 2;
  constexpr int kGradSub = 4;  // act' values a switch (a sub-pack of the 16-byte pack)
  using Vec = Pack<T, kVec>;
  const RowGroup g = MakeRowGroup(group);
  int64_t begin, end;
  BlockRows(rows, gridDim.x, blockIdx.x, &begin, &end);

  // [groups][2 stages][x, dy][kIters][group] vectors: lane-consecutive, so conflict-free. Each thread
  // only reads the slots it filled itself, so the pipeline needs no barrier.
  extern __shared__ uint4 shared[];
  Vec* stages = reinterpret_cast<Vec*>(shared) + g.index * 4 * kIters * group + g.lane;
  auto slot = [&](int stage, int tensor, int i) {
    return stages + ((stage * 2 + tensor) * kIters + i) * group;
  };
  auto stage_row = [&](int64_t row, int stage) {
    if (row < end) {
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        const int col = (i * group + g.lane) * kVec;
        if (col < features) {
          CpAsync16(slot(stage, 0, i), x + row * features + col);
          CpAsync16(slot(stage, 1, i), dy + row * features + col);
        }
      }
    }
    CpAsyncCommit();  // an empty group past the end keeps the wait count uniform
  };

  float acc_scale[kIters][kVec] = {};
  float acc_bias[kIters][kVec] = {};
  int64_t row = begin + g.index;
  stage_row(row, 0);
  for (int stage = 0; row < end; row += g.count, stage ^= 1) {
    stage_row(row + g.count, stage ^ 1);
    const float mean = kRms ? 0.f : mean_in[row];
    const float rstd = rstd_in[row];
    CpAsyncWait<1>();  // this row's copies have landed
    float sums[2] = {0.f, 0.f};  // sum(g), sum(g * xhat)
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int col = (i * group + g.lane) * kVec;
      if (col < features) {
        const Vec xs = *slot(stage, 0, i), dys = *slot(stage, 1, i);
        const Pack<float, kVec> s = *reinterpret_cast<const Pack<float, kVec>*>(scale + col);
        const Pack<float, kVec> b = BiasPack<kVec, kAct>(bias, col);
        float d[kVec];  // dy * act'(pre); the identity kernels convert dy where they use it
        if constexpr (kAct) PackGradIn<kGradSub, kErf>(xs, dys, s, b, mean, rstd, act, d);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float xhat = (ToFloat(xs.v[k]) - mean) * rstd;
          const float gk = s.v[k] * (kAct ? d[k] : ToFloat(dys.v[k]));
          sums[0] += gk;
          sums[1] += gk * xhat;
        }
      }
    }
    GroupSum(sums, group);
    const float mean_g = kRms ? 0.f : sums[0] / features;
    const float mean_g_xhat = sums[1] / features;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int col = (i * group + g.lane) * kVec;
      if (col < features) {
        const Vec xs = *slot(stage, 0, i), dys = *slot(stage, 1, i);
        const Pack<float, kVec> s = *reinterpret_cast<const Pack<float, kVec>*>(scale + col);
        const Pack<float, kVec> b = BiasPack<kVec, kAct>(bias, col);
        float d[kVec];  // act'(pre) again: cheaper than holding a row of it in registers
        if constexpr (kAct) PackGradIn<kGradSub, kErf>(xs, dys, s, b, mean, rstd, act, d);
        Vec out;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float xhat = (ToFloat(xs.v[k]) - mean) * rstd;
          const float dyk = kAct ? d[k] : ToFloat(dys.v[k]);
          out.v[k] = FromFloat<T>(rstd * (s.v[k] * dyk - mean_g - xhat * mean_g_xhat));
          acc_scale[i][k] += dyk * xhat;
          if (!kRms) acc_bias[i][k] += dyk;
        }
        *reinterpret_cast<Vec*>(dx + row * features + col) = out;
      }
    }
  }
  CpAsyncWait<0>();

  // workspace[block] = the sum of the groups' accumulators, in group order (deterministic).
  float* out = workspace + int64_t(blockIdx.x) * kSums * features;
  if (g.count == 1) {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int col = (i * group + g.lane) * kVec;
      if (col < features) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          out[col + k] = acc_scale[i][k];
          if (!kRms) out[features + col + k] = acc_bias[i][k];
        }
      }
    }
    return;
  }
  // Several groups: through shared memory (the stages, no longer needed), laid out
  // [groups][kSums][kIters * kVec][group] so that the writes are conflict-free.
  __syncthreads();
  float* combined = reinterpret_cast<float*>(shared);
  const int slots = kIters * kVec * group;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      float* dst = combined + g.index * kSums * slots + (i * kVec + k) * group + g.lane;
      dst[0] = acc_scale[i][k];
      if (!kRms) dst[slots] = acc_bias[i][k];
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < kSums * slots; j += blockDim.x) {
    const int sum = j / slots, slot_index = j % slots;
    const int lane = slot_index % group, ik = slot_index / group;
    const int col = ((ik / kVec) * group + lane) * kVec + ik % kVec;
    if (col < features) {
      float total = 0.f;
      for (int c = 0; c < g.count; ++c) total += combined[(c * kSums + sum) * slots + slot_index];
      out[sum * features + col] = total;
    }
  }
}

// One row group = the whole block; accumulates straight into workspace[block] (its own row of it).
template <typename T, bool kRms, bool kAct>
__global__ void NormBwdStreaming(const T* __restrict__ dy, const T* __restrict__ x,
                                 const float* __restrict__ scale, const float* __restrict__ bias,
                                 const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
                                 T* __restrict__ dx, float* __restrict__ workspace, int64_t rows, int features,
                                 NormActivation act) {
  constexpr int kSums = kRms ? 1 : 2;
  constexpr int kPack = kStreamPack<kAct>;
  int64_t begin, end;
  BlockRows(rows, gridDim.x, blockIdx.x, &begin, &end);
  float* out = workspace + int64_t(blockIdx.x) * kSums * features;
  for (int j = threadIdx.x; j < features; j += blockDim.x) {
    out[j] = 0.f;
    if (!kRms) out[features + j] = 0.f;
  }
  for (int64_t row = begin; row < end; ++row) {
    const T* xr = x + row * features;
    const T* dyr = dy + row * features;
    const float mean = kRms ? 0.f : mean_in[row];
    const float rstd = rstd_in[row];
    // d = dy * act'(pre) of columns first, first + blockDim.x, ... (0 past the row's end); the
    // identity kernels convert dy where they use it.
    auto grad_in = [&](int first, float (&d)[kPack]) {
      float pre[kPack];
#pragma unroll
      for (int p = 0; p < kPack; ++p) {
        const int j = first + p * blockDim.x;
        const bool inside = j < features;
        d[p] = inside ? ToFloat(dyr[j]) : 0.f;
        pre[p] = inside ? (ToFloat(xr[j]) - mean) * rstd * scale[j] + bias[j] : 0.f;
      }
      ActivationGradIn<kAct>(pre, d, act);
    };
    float sums[2] = {0.f, 0.f};
    for (int first = threadIdx.x; first < features; first += kPack * blockDim.x) {
      float d[kPack];
      if constexpr (kAct) grad_in(first, d);
#pragma unroll
      for (int p = 0; p < kPack; ++p) {
        const int j = first + p * blockDim.x;
        if (j < features) {
          const float xhat = (ToFloat(xr[j]) - mean) * rstd;
          const float gj = scale[j] * (kAct ? d[p] : ToFloat(dyr[j]));
          sums[0] += gj;
          sums[1] += gj * xhat;
        }
      }
    }
    GroupSum(sums, blockDim.x);
    const float mean_g = kRms ? 0.f : sums[0] / features;
    const float mean_g_xhat = sums[1] / features;
    for (int first = threadIdx.x; first < features; first += kPack * blockDim.x) {
      float d[kPack];
      if constexpr (kAct) grad_in(first, d);
#pragma unroll
      for (int p = 0; p < kPack; ++p) {
        const int j = first + p * blockDim.x;
        if (j < features) {
          const float xhat = (ToFloat(xr[j]) - mean) * rstd;
          const float dj = kAct ? d[p] : ToFloat(dyr[j]);
          dx[row * features + j] = FromFloat<T>(rstd * (scale[j] * dj - mean_g - xhat * mean_g_xhat));
          out[j] += dj * xhat;
          if (!kRms) out[features + j] += dj;
        }
      }
    }
  }
}

// dscale[j] (and dbias[j]) = sum over p < partials of workspace[p][s][j], in a fixed order.
// Threads (x, y): x is the column within a 32-wide tile, y strides over the partial rows.
__global__ void SumPartials(const float* __restrict__ workspace, int partials, int64_t sums_features,
                            int features, float* __restrict__ dscale, float* __restrict__ dbias) {
  __shared__ float tile[32][33];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.f;
  if (col < sums_features) {
    for (int p = threadIdx.y; p < partials; p += 32) s += workspace[p * sums_features + col];
  }
  tile[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < sums_features) {
    float total = 0.f;
    for (int k = 0; k < 32; ++k) total += tile[k][threadIdx.x];
    if (col < features) {
      dscale[col] = total;
    } else {
      dbias[col - features] = total;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launch plans and handlers

constexpr size_t kMaxBwdSmem = 200 * 1024;  // backward stages, below Hopper's 227 KB
constexpr int kWarpRowsBwdBlock = 128;        // backward block size when a warp handles a row

// The backward's plan: the forward's, with two stages of x and dy (kIters 16-byte vectors a thread
// each) in shared memory, which also hold the combined accumulators (kSums * kIters * kVec floats a
// thread) at the end; rows too long for that take the streaming kernel.
struct BwdPlan : RowPlan {
  size_t smem;
};

template <typename T>
BwdPlan MakeBwdPlan(int64_t features) {
  BwdPlan plan{MakeRowPlan<T>(features, kWarpRowsBwdBlock), 0};
  plan.smem = size_t(plan.block) * 4 * kIters * 16;
  if (plan.cached && (plan.smem > kMaxBwdSmem || plan.group > kMaxBwdGroup)) {
    plan.cached = false;
    plan.group = plan.block = kMaxGroup;
  }
  return plan;
}

template <bool kRms>
ffi::Error NormFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                       ffi::Buffer<ffi::F32>* bias, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::Buffer<ffi::F32>>* mean, ffi::Result<ffi::Buffer<ffi::F32>> rstd,
                       float epsilon, NormActivation act) {
  RowsFeatures shape;
  JAXDNN_RETURN_IF_ERROR(CheckNormFwd(x, scale, bias, *y, mean, *rstd, &shape));
  JAXDNN_RETURN_IF_ERROR(CheckNormActivation(act));
  if (shape.rows == 0) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const RowPlan plan = MakeRowPlan<T>(shape.features);
    const int64_t grid = RowGrid(plan, shape.rows);
    if (grid > 0x7fffffff) return InvalidArgument("norm: too many rows for one launch");
    const T* xp = static_cast<const T*>(x.untyped_data());
    const float* bp = kRms ? nullptr : bias->typed_data();
    T* yp = static_cast<T*>(y->untyped_data());
    float* mp = kRms ? nullptr : (*mean)->typed_data();
    const int features = int(shape.features);
    return WithActivation<kRms>(act, [&](auto has_act) {
      constexpr bool kAct = decltype(has_act)::value;
      if (plan.cached) {
        NormFwdCached<T, kRms, kAct><<<grid, plan.block, 0, stream>>>(
            xp, scale.typed_data(), bp, yp, mp, rstd->typed_data(), shape.rows, features, plan.group,
            epsilon, act);
      } else {
        NormFwdStreaming<T, kRms, kAct><<<grid, plan.block, 0, stream>>>(
            xp, scale.typed_data(), bp, yp, mp, rstd->typed_data(), features, epsilon, act);
      }
      return LaunchError("norm forward");
    });
  });
}

template <bool kRms>
ffi::Error NormBwdCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                       ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32>* bias, ffi::Buffer<ffi::F32>* mean,
                       ffi::Buffer<ffi::F32> rstd, ffi::Result<ffi::AnyBuffer> dx,
                       ffi::Result<ffi::Buffer<ffi::F32>> dscale,
                       ffi::Result<ffi::Buffer<ffi::F32>>* dbias,
                       ffi::Result<ffi::Buffer<ffi::F32>> workspace, NormActivation act) {
  constexpr int kSums = kRms ? 1 : 2;
  RowsFeatures shape;
  int64_t max_partials = 0;
  JAXDNN_RETURN_IF_ERROR(
      CheckNormBwd(dy, x, scale, mean, rstd, *dx, *dscale, dbias, *workspace, &shape, &max_partials));
  JAXDNN_RETURN_IF_ERROR(CheckNormActivation(act));
  if (bias != nullptr) JAXDNN_RETURN_IF_ERROR(ExpectElements("bias", bias->dimensions(), shape.features));
  const float* bp = kRms ? nullptr : bias->typed_data();
  float* dscale_p = dscale->typed_data();
  float* dbias_p = kRms ? nullptr : (*dbias)->typed_data();
  if (shape.rows == 0) {  // sums over no rows
    JAXDNN_RETURN_IF_ERROR(CudaError(
        cudaMemsetAsync(dscale_p, 0, shape.features * sizeof(float), stream), "memset"));
    if (!kRms) {
      JAXDNN_RETURN_IF_ERROR(CudaError(
          cudaMemsetAsync(dbias_p, 0, shape.features * sizeof(float), stream), "memset"));
    }
    return ffi::Error::Success();
  }
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const BwdPlan plan = MakeBwdPlan<T>(shape.features);
    const int features = int(shape.features);
    const T* dyp = static_cast<const T*>(dy.untyped_data());
    const T* xp = static_cast<const T*>(x.untyped_data());
    const float* mp = kRms ? nullptr : mean->typed_data();
    T* dxp = static_cast<T*>(dx->untyped_data());
    float* ws = workspace->typed_data();
    int64_t blocks = std::min(max_partials, shape.rows);
    JAXDNN_RETURN_IF_ERROR(WithActivation<kRms>(act, [&](auto has_act) {
      constexpr bool kAct = decltype(has_act)::value;
      if (plan.cached) {
        auto kernel = NormBwdCached<T, kRms, kAct, false>;
        if constexpr (kAct) {
          if (act.kind == int64_t(Activation::kGeluErf)) kernel = NormBwdCached<T, kRms, true, true>;
        }
        JAXDNN_RETURN_IF_ERROR(CudaError(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem)),
            "norm backward shared memory"));
        blocks = std::min<int64_t>(blocks, ResidentBlocks(kernel, plan.block, plan.smem));
        kernel<<<blocks, plan.block, plan.smem, stream>>>(dyp, xp, scale.typed_data(), bp, mp, rstd.typed_data(),
                                                          dxp, ws, shape.rows, features, plan.group, act);
      } else {
        auto kernel = NormBwdStreaming<T, kRms, kAct>;
        blocks = std::min<int64_t>(blocks, ResidentBlocks(kernel, plan.block, 0));
        kernel<<<blocks, plan.block, 0, stream>>>(dyp, xp, scale.typed_data(), bp, mp, rstd.typed_data(),
                                                  dxp, ws, shape.rows, features, act);
      }
      return LaunchError("norm backward");
    }));
    const int64_t sums_features = int64_t(kSums) * features;
    SumPartials<<<(sums_features + 31) / 32, dim3(32, 32), 0, stream>>>(
        ws, int(blocks), sums_features, features, dscale_p, dbias_p);
    return LaunchError("norm backward partial sums");
  });
}

ffi::Error LayerNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::F32> bias, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::Buffer<ffi::F32>> mean,
                            ffi::Result<ffi::Buffer<ffi::F32>> rstd, float epsilon, int64_t activation,
                            float activation_param) {
  return NormFwdCuda<false>(stream, x, scale, &bias, y, &mean, rstd, epsilon, {activation, activation_param});
}

ffi::Error RmsNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::F32>> rstd,
                          float epsilon) {
  return NormFwdCuda<true>(stream, x, scale, nullptr, y, nullptr, rstd, epsilon, {});
}

ffi::Error LayerNormBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> mean,
                            ffi::Buffer<ffi::F32> rstd, ffi::Result<ffi::AnyBuffer> dx,
                            ffi::Result<ffi::Buffer<ffi::F32>> dscale,
                            ffi::Result<ffi::Buffer<ffi::F32>> dbias,
                            ffi::Result<ffi::Buffer<ffi::F32>> workspace, int64_t activation,
                            float activation_param) {
  return NormBwdCuda<false>(stream, dy, x, scale, &bias, &mean, rstd, dx, dscale, &dbias, workspace,
                            {activation, activation_param});
}

ffi::Error RmsNormBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                          ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> rstd,
                          ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::Buffer<ffi::F32>> dscale,
                          ffi::Result<ffi::Buffer<ffi::F32>> workspace) {
  return NormBwdCuda<true>(stream, dy, x, scale, nullptr, nullptr, rstd, dx, dscale, nullptr, workspace, {});
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormFwdCuda, jaxdnn::LayerNormFwdImpl,
                              jaxdnn::BindLayerNormFwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormFwdCuda, jaxdnn::RmsNormFwdImpl,
                              jaxdnn::BindRmsNormFwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormBwdCuda, jaxdnn::LayerNormBwdImpl,
                              jaxdnn::BindLayerNormBwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormBwdCuda, jaxdnn::RmsNormBwdImpl,
                              jaxdnn::BindRmsNormBwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
