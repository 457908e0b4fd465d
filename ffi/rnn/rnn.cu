// CUDA LSTM, GRU and plain RNN recurrences (see rnn.h). Each handler runs the persistent kernel of
// rnn_persistent.cu (W_hh on chip across a cooperative grid) when its plan fits the device, and
// otherwise the per-row kernels below: a fallback without on-chip weights, for layers whose W_hh
// slices do not fit in the SMs' shared memory (on a 132-SM Hopper, H above about 2000 for the LSTM).
//
// One block per (batch row, direction) pair steps through that row's valid time steps; its state (h,
// c, or the recurrent gradients in the backward) lives in shared memory, so no grid-wide sync is
// needed. The direction's W_hh [G, H] is read from global memory (L2-resident after the first step) every step:
// - forward, per step: warps take the G gate rows of W_hh in turn, lanes stride along a row
//   (coalesced) for the dot product with h, a shuffle reduction gives pre[k]; then each thread
//   updates its hidden units j (the cell math of rnn_cell.h, shared with the CPU kernel).
// - backward, per step: each thread computes its units' gate gradients (rnn_cell.h), then
//   dh_prev[j] = sum_k W_hh[k, j] dgates[k] with threads along j (coalesced columns).
// Traffic: per step and row, G H elements of W_hh from L2, plus that step's float32 values in HBM
// (LSTM: 2G + 2H forward, 2G + 3H backward; GRU: G + 5H forward, 2G + 6H backward; plain RNN: 2H
// forward, 3H backward). The B D blocks share
// W_hh through L2, but each step waits on a full pass over it, and with B far below the SM count most
// of the GPU idles: hence the persistent kernels.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string_view>

#include "common/cuda_common.cuh"
#include "rnn/rnn.h"
#include "rnn/rnn_cell.h"
#include "rnn/rnn_common.h"
#include "rnn/rnn_persistent.h"

namespace jaxdnn {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Shared memory per block, at most six float vectors of H: LSTM h, c and 4H pre-activations (dh, dc
// and 4H gate gradients in the backward); GRU h and 3H recurrent pre-activations (dh, the bypass
// part of dh_prev and 3H gradients); the plain RNN h and H pre-activations (dh and H gradients).
size_t SharedBytes(int64_t hidden) { return size_t(6 * hidden) * sizeof(float); }

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Zeros the per-step results of a (row, direction) pair at the steps past its end (t >= len:
// padding is at the end in both directions); a step's results are `width` floats.
__device__ __forceinline__ void ZeroPastEnd(float* seq, const RecurrenceShape& s, const SeqRow& row, int64_t len,
                                            int64_t width) {
  for (int64_t e = threadIdx.x; e < (s.steps - len) * width; e += blockDim.x) {
    seq[At(s, row, len + e / width) * width + e % width] = 0.f;
  }
}

// This block's (batch row, direction) pair (blockIdx.x is its state index b D + d), its direction,
// valid steps and order.
struct BlockPair {
  SeqRow row;
  int64_t d, len;
  bool rev;
};

__device__ __forceinline__ BlockPair ThisBlockPair(const RecurrenceShape& s, const int32_t* seq_lengths,
                                                   bool reverse) {
  const int64_t b = blockIdx.x / s.directions, d = blockIdx.x % s.directions;
  return BlockPair{s.Row(b, d), d, ValidSteps(seq_lengths[b], s.steps), Reversed(reverse, d)};
}

template <typename W>
__global__ void __launch_bounds__(kThreads)
    LstmFwdKernel(const float* __restrict__ gates_x, const W* __restrict__ w_hh, const float* __restrict__ h0,
                  const float* __restrict__ c0, const int32_t* __restrict__ seq_lengths, RecurrenceShape s,
                  bool reverse, float* __restrict__ h_seq, float* __restrict__ c_seq, float* __restrict__ acts,
                  float* __restrict__ h_n, float* __restrict__ c_n) {
  extern __shared__ float smem[];
  const int64_t H = s.hidden, G = s.gates();
  float* h = smem;
  float* c = smem + H;
  float* pre = smem + 2 * H;
  const auto [row, d, len, rev] = ThisBlockPair(s, seq_lengths, reverse);
  w_hh += d * s.gates() * s.hidden;  // this direction's W_hh
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    h[j] = h0[row.state * H + j];
    c[j] = c0[row.state * H + j];
  }
  ZeroPastEnd(h_seq, s, row, len, H);
  ZeroPastEnd(c_seq, s, row, len, H);
  ZeroPastEnd(acts, s, row, len, G);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t step = 0; step < len; ++step) {
    const int64_t t = StepTime(step, len, rev);
    const int64_t at = At(s, row, t);
    __syncthreads();  // h of the previous step is complete (and pre no longer read)
    for (int64_t k = warp; k < G; k += kWarps) {
      const W* w = w_hh + k * H;
      float sum = 0.f;
      for (int64_t j = lane; j < H; j += 32) sum += ToFloat(w[j]) * h[j];
      sum = WarpSum(sum);
      if (lane == 0) pre[k] = gates_x[at * G + k] + sum;
    }
    __syncthreads();  // every pre[k] is written, every read of h is done
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      const LstmGates a = LstmActivate(pre[j], pre[H + j], pre[2 * H + j], pre[3 * H + j]);
      const float c_new = a.f * c[j] + a.i * a.g;
      const float h_new = a.o * Tanh(c_new);
      c[j] = c_new;
      h[j] = h_new;
      float* act = acts + at * G;
      act[j] = a.i;
      act[H + j] = a.f;
      act[2 * H + j] = a.g;
      act[3 * H + j] = a.o;
      h_seq[at * H + j] = h_new;
      c_seq[at * H + j] = c_new;
    }
  }
  // Each thread reads back only the units it wrote last: no sync needed.
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    h_n[row.state * H + j] = h[j];
    c_n[row.state * H + j] = c[j];
  }
}

template <typename W>
__global__ void __launch_bounds__(kThreads)
    LstmBwdKernel(const float* __restrict__ dh_seq, const float* __restrict__ dh_n, const float* __restrict__ dc_n,
                  const float* __restrict__ acts, const float* __restrict__ c_seq, const float* __restrict__ c0,
                  const W* __restrict__ w_hh, const int32_t* __restrict__ seq_lengths, RecurrenceShape s,
                  bool reverse, float* __restrict__ dgates, float* __restrict__ dh0, float* __restrict__ dc0) {
  extern __shared__ float smem[];
  const int64_t H = s.hidden, G = s.gates();
  float* dh = smem;       // gradient reaching h from the next step
  float* dc = smem + H;   // gradient reaching c from the next step
  float* dg = smem + 2 * H;
  const auto [row, d, len, rev] = ThisBlockPair(s, seq_lengths, reverse);
  w_hh += d * s.gates() * s.hidden;  // this direction's W_hh
  // Every thread owns the same units j in both phases, so dh[j] and dc[j] need no sync of their own.
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    dh[j] = dh_n[row.state * H + j];
    dc[j] = dc_n[row.state * H + j];
  }
  ZeroPastEnd(dgates, s, row, len, G);
  for (int64_t step = len - 1; step >= 0; --step) {
    const int64_t at = At(s, row, StepTime(step, len, rev));
    const float* c_prev = step > 0 ? c_seq + At(s, row, StepTime(step - 1, len, rev)) * H : c0 + row.state * H;
    const float* a = acts + at * G;
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      float d_pre[4];
      dc[j] = LstmCellGrad(LstmGates{a[j], a[H + j], a[2 * H + j], a[3 * H + j]}, c_seq[at * H + j], c_prev[j],
                           dh_seq[at * H + j] + dh[j], dc[j], d_pre);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        dg[q * H + j] = d_pre[q];
        dgates[at * G + q * H + j] = d_pre[q];
      }
    }
    __syncthreads();  // every dg[k] is written
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      float sum = 0.f;
      for (int64_t k = 0; k < G; ++k) sum += ToFloat(w_hh[k * H + j]) * dg[k];
      dh[j] = sum;
    }
    __syncthreads();  // every read of dg is done before the next step overwrites it
  }
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    dh0[row.state * H + j] = dh[j];
    dc0[row.state * H + j] = dc[j];
  }
}

template <typename W>
__global__ void __launch_bounds__(kThreads)
    GruFwdKernel(const float* __restrict__ gates_x, const W* __restrict__ w_hh, const float* __restrict__ b_hh,
                 const float* __restrict__ h0, const int32_t* __restrict__ seq_lengths, RecurrenceShape s, bool reverse,
                 float* __restrict__ h_seq, float* __restrict__ saved, float* __restrict__ h_n) {
  extern __shared__ float smem[];
  const int64_t H = s.hidden, G = s.gates();
  float* h = smem;
  float* hp = smem + H;  // W_hh h + b_hh
  const auto [row, d, len, rev] = ThisBlockPair(s, seq_lengths, reverse);
  w_hh += d * s.gates() * s.hidden;  // this direction's W_hh
  b_hh += d * s.gates();
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) h[j] = h0[row.state * H + j];
  ZeroPastEnd(h_seq, s, row, len, H);
  ZeroPastEnd(saved, s, row, len, 4 * H);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t step = 0; step < len; ++step) {
    const int64_t at = At(s, row, StepTime(step, len, rev));
    __syncthreads();  // h of the previous step is complete (and hp no longer read)
    for (int64_t k = warp; k < G; k += kWarps) {
      const W* w = w_hh + k * H;
      float sum = 0.f;
      for (int64_t j = lane; j < H; j += 32) sum += ToFloat(w[j]) * h[j];
      sum = WarpSum(sum);
      if (lane == 0) hp[k] = sum + b_hh[k];
    }
    __syncthreads();  // every hp[k] is written, every read of h is done
    const float* gx = gates_x + at * G;
    float* keep = saved + at * 4 * H;
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      const GruGates a = GruActivate(gx[j], gx[H + j], gx[2 * H + j], hp[j], hp[H + j], hp[2 * H + j]);
      h[j] = GruOutput(a, h[j]);
      keep[j] = a.r;
      keep[H + j] = a.z;
      keep[2 * H + j] = a.n;
      keep[3 * H + j] = hp[2 * H + j];
      h_seq[at * H + j] = h[j];
    }
  }
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) h_n[row.state * H + j] = h[j];
}

template <typename W>
__global__ void __launch_bounds__(kThreads)
    GruBwdKernel(const float* __restrict__ dh_seq, const float* __restrict__ dh_n, const float* __restrict__ saved,
                 const float* __restrict__ h_seq, const float* __restrict__ h0, const W* __restrict__ w_hh,
                 const int32_t* __restrict__ seq_lengths, RecurrenceShape s, bool reverse,
                 float* __restrict__ dgates_x, float* __restrict__ dgates_h, float* __restrict__ dh0) {
  extern __shared__ float smem[];
  const int64_t H = s.hidden, G = s.gates();
  float* dh = smem;           // gradient reaching h from the next step
  float* bypass = smem + H;   // the part of dh_prev that does not go through W_hh (dh z)
  float* dgh = smem + 2 * H;  // gradients of the recurrent pre-activations
  const auto [row, d, len, rev] = ThisBlockPair(s, seq_lengths, reverse);
  w_hh += d * s.gates() * s.hidden;  // this direction's W_hh
  // Every thread owns the same units j in both phases, so dh[j] and bypass[j] need no sync of their own.
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) dh[j] = dh_n[row.state * H + j];
  ZeroPastEnd(dgates_x, s, row, len, G);
  ZeroPastEnd(dgates_h, s, row, len, G);
  for (int64_t step = len - 1; step >= 0; --step) {
    const int64_t at = At(s, row, StepTime(step, len, rev));
    const float* h_prev = step > 0 ? h_seq + At(s, row, StepTime(step - 1, len, rev)) * H : h0 + row.state * H;
    const float* keep = saved + at * 4 * H;
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      float d_x[3], d_h[3];
      bypass[j] = GruCellGrad(GruGates{keep[j], keep[H + j], keep[2 * H + j]}, keep[3 * H + j], h_prev[j],
                              dh_seq[at * H + j] + dh[j], d_x, d_h);
#pragma unroll
      for (int q = 0; q < 3; ++q) {
        dgh[q * H + j] = d_h[q];
        dgates_x[at * G + q * H + j] = d_x[q];
        dgates_h[at * G + q * H + j] = d_h[q];
      }
    }
    __syncthreads();  // every dgh[k] is written
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      float sum = bypass[j];
      for (int64_t k = 0; k < G; ++k) sum += ToFloat(w_hh[k * H + j]) * dgh[k];
      dh[j] = sum;
    }
    __syncthreads();  // every read of dgh is done before the next step overwrites it
  }
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) dh0[row.state * H + j] = dh[j];
}

// The plain RNN: LstmFwdKernel's decomposition with one gate row per unit, h = act(pre).
template <typename W>
__global__ void __launch_bounds__(kThreads)
    RnnFwdKernel(const float* __restrict__ gates_x, const W* __restrict__ w_hh, const float* __restrict__ h0,
                 const int32_t* __restrict__ seq_lengths, RecurrenceShape s, bool reverse, Activation act,
                 float* __restrict__ h_seq, float* __restrict__ h_n) {
  extern __shared__ float smem[];
  const int64_t H = s.hidden;
  float* h = smem;
  float* pre = smem + H;
  const auto [row, d, len, rev] = ThisBlockPair(s, seq_lengths, reverse);
  w_hh += d * s.gates() * s.hidden;  // this direction's W_hh
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) h[j] = h0[row.state * H + j];
  ZeroPastEnd(h_seq, s, row, len, H);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t step = 0; step < len; ++step) {
    const int64_t at = At(s, row, StepTime(step, len, rev));
    __syncthreads();  // h of the previous step is complete (and pre no longer read)
    for (int64_t k = warp; k < H; k += kWarps) {
      const W* w = w_hh + k * H;
      float sum = 0.f;
      for (int64_t j = lane; j < H; j += 32) sum += ToFloat(w[j]) * h[j];
      sum = WarpSum(sum);
      if (lane == 0) pre[k] = gates_x[at * H + k] + sum;
    }
    __syncthreads();  // every pre[k] is written, every read of h is done
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      h[j] = RnnActivate(act, pre[j]);
      h_seq[at * H + j] = h[j];
    }
  }
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) h_n[row.state * H + j] = h[j];
}

template <typename W>
__global__ void __launch_bounds__(kThreads)
    RnnBwdKernel(const float* __restrict__ dh_seq, const float* __restrict__ dh_n, const float* __restrict__ h_seq,
                 const W* __restrict__ w_hh, const int32_t* __restrict__ seq_lengths, RecurrenceShape s,
                 bool reverse, Activation act, float* __restrict__ dgates, float* __restrict__ dh0) {
  extern __shared__ float smem[];
  const int64_t H = s.hidden;
  float* dh = smem;      // gradient reaching h from the next step
  float* dg = smem + H;  // gradients of the pre-activations
  const auto [row, d, len, rev] = ThisBlockPair(s, seq_lengths, reverse);
  w_hh += d * s.gates() * s.hidden;  // this direction's W_hh
  // Every thread owns the same units j in both phases, so dh[j] needs no sync of its own.
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) dh[j] = dh_n[row.state * H + j];
  ZeroPastEnd(dgates, s, row, len, H);
  for (int64_t step = len - 1; step >= 0; --step) {
    const int64_t at = At(s, row, StepTime(step, len, rev));
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      dg[j] = RnnCellGrad(act, h_seq[at * H + j], dh_seq[at * H + j] + dh[j]);
      dgates[at * H + j] = dg[j];
    }
    __syncthreads();  // every dg[k] is written
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      float sum = 0.f;
      for (int64_t k = 0; k < H; ++k) sum += ToFloat(w_hh[k * H + j]) * dg[k];
      dh[j] = sum;
    }
    __syncthreads();  // every read of dg is done before the next step overwrites it
  }
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) dh0[row.state * H + j] = dh[j];
}

// Lets `kernel` use `bytes` of dynamic shared memory (above 48 KiB needs an opt-in), or says why not.
template <typename Kernel>
ffi::Error AllowSharedMemory(Kernel kernel, size_t bytes) {
  int device = 0, limit = 0;
  JAXDNN_RETURN_IF_ERROR(CudaError(cudaGetDevice(&device), "cudaGetDevice"));
  JAXDNN_RETURN_IF_ERROR(
      CudaError(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                "cudaDeviceGetAttribute"));
  if (bytes > size_t(limit)) {
    return InvalidArgument("rnn: hidden_size " + std::to_string(bytes / (6 * sizeof(float))) +
                           " needs more shared memory per block than this GPU has");
  }
  if (bytes <= 48 * 1024) return ffi::Error::Success();
  return CudaError(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
                   "cudaFuncSetAttribute");
}

// The persistent kernels' bf16 exchange (rnn_persistent.h) when the attribute (bf16_state forward,
// bf16_gradients backward) allows it and W_hh is bfloat16 (forward: and Bf16StateFits(H)); none
// otherwise, or when XLA's scratch allocator has no room (alignment 16: it refuses more).
Bf16Exchange Bf16Rows(ffi::ScratchAllocator& scratch, const RecurrenceShape& s, const ffi::AnyBuffer& w_hh,
                      bool backward, int64_t allowed) {
  if (allowed == 0 || w_hh.element_type() != ffi::DataType::BF16 || (!backward && !Bf16StateFits(s.hidden))) {
    return {};
  }
  const size_t bytes = size_t(Bf16ExchangeElements(s, backward)) * sizeof(__nv_bfloat16);
  const std::optional<void*> buffer = scratch.Allocate(bytes, 16);
  return {buffer.has_value() ? static_cast<__nv_bfloat16*>(*buffer) : nullptr};
}

ffi::Error LstmFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> gates_x, ffi::AnyBuffer w_hh,
                       ffi::Buffer<ffi::F32> h0, ffi::Buffer<ffi::F32> c0, ffi::Buffer<ffi::S32> seq_lengths,
                       ffi::Result<ffi::Buffer<ffi::F32>> h_seq, ffi::Result<ffi::Buffer<ffi::F32>> c_seq,
                       ffi::Result<ffi::Buffer<ffi::F32>> acts, ffi::Result<ffi::Buffer<ffi::F32>> h_n,
                       ffi::Result<ffi::Buffer<ffi::F32>> c_n, int64_t reverse, int64_t tf32, int64_t bf16_state,
                       ffi::ScratchAllocator scratch) {
  RecurrenceShape s;
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(gates_x.dimensions(), 4, 4, &s));
  JAXDNN_RETURN_IF_ERROR(CheckRecurrenceOperands(
      s, w_hh, {h0.dimensions(), c0.dimensions(), h_n->dimensions(), c_n->dimensions()}, seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 1, {h_seq->dimensions(), c_seq->dimensions()}));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 4, {acts->dimensions()}));
  if (s.empty()) return ffi::Error::Success();
  if (s.batch * s.directions > INT32_MAX) return InvalidArgument("rnn: more than 2^31 - 1 batch rows");
  const LstmFwdIo io{gates_x.typed_data(), h0.typed_data(), c0.typed_data(), h_seq->typed_data(),
                     c_seq->typed_data(), acts->typed_data(), h_n->typed_data(), c_n->typed_data(),
                     Bf16Rows(scratch, s, w_hh, false, bf16_state)};
  bool launched = false;
  JAXDNN_RETURN_IF_ERROR(PersistentRecurrence(stream, w_hh.element_type(), w_hh.untyped_data(),
                                              seq_lengths.typed_data(), s, reverse != 0, tf32 != 0, io,
                                              &launched));
  if (launched) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(w_hh.element_type(), "w_hh", [&](auto tag) {
    using W = decltype(tag);
    const size_t bytes = SharedBytes(s.hidden);
    JAXDNN_RETURN_IF_ERROR(AllowSharedMemory(LstmFwdKernel<W>, bytes));
    LstmFwdKernel<W><<<unsigned(s.batch * s.directions), kThreads, bytes, stream>>>(
        gates_x.typed_data(), static_cast<const W*>(w_hh.untyped_data()), h0.typed_data(), c0.typed_data(),
        seq_lengths.typed_data(), s, reverse != 0, h_seq->typed_data(), c_seq->typed_data(), acts->typed_data(),
        h_n->typed_data(), c_n->typed_data());
    return LaunchError("lstm forward");
  });
}

ffi::Error LstmBwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> dh_seq, ffi::Buffer<ffi::F32> dh_n,
                       ffi::Buffer<ffi::F32> dc_n, ffi::Buffer<ffi::F32> acts, ffi::Buffer<ffi::F32> c_seq,
                       ffi::Buffer<ffi::F32> c0, ffi::AnyBuffer w_hh, ffi::Buffer<ffi::S32> seq_lengths,
                       ffi::Result<ffi::Buffer<ffi::F32>> dgates, ffi::Result<ffi::Buffer<ffi::F32>> dh0,
                       ffi::Result<ffi::Buffer<ffi::F32>> dc0, int64_t reverse, int64_t bf16_gradients,
                       ffi::ScratchAllocator scratch) {
  RecurrenceShape s;
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(acts.dimensions(), 4, 4, &s));
  JAXDNN_RETURN_IF_ERROR(CheckRecurrenceOperands(
      s, w_hh, {dh_n.dimensions(), dc_n.dimensions(), c0.dimensions(), dh0->dimensions(), dc0->dimensions()},
      seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 1, {dh_seq.dimensions(), c_seq.dimensions()}));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 4, {dgates->dimensions()}));
  if (s.empty()) return ffi::Error::Success();
  if (s.batch * s.directions > INT32_MAX) return InvalidArgument("rnn: more than 2^31 - 1 batch rows");
  const LstmBwdIo io{dh_seq.typed_data(), dh_n.typed_data(), dc_n.typed_data(), acts.typed_data(),
                     c_seq.typed_data(), c0.typed_data(), dgates->typed_data(), dh0->typed_data(),
                     dc0->typed_data(), Bf16Rows(scratch, s, w_hh, true, bf16_gradients)};
  bool launched = false;
  JAXDNN_RETURN_IF_ERROR(PersistentRecurrence(stream, w_hh.element_type(), w_hh.untyped_data(),
                                              seq_lengths.typed_data(), s, reverse != 0, /*tf32=*/false, io,
                                              &launched));
  if (launched) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(w_hh.element_type(), "w_hh", [&](auto tag) {
    using W = decltype(tag);
    const size_t bytes = SharedBytes(s.hidden);
    JAXDNN_RETURN_IF_ERROR(AllowSharedMemory(LstmBwdKernel<W>, bytes));
    LstmBwdKernel<W><<<unsigned(s.batch * s.directions), kThreads, bytes, stream>>>(
        dh_seq.typed_data(), dh_n.typed_data(), dc_n.typed_data(), acts.typed_data(), c_seq.typed_data(),
        c0.typed_data(), static_cast<const W*>(w_hh.untyped_data()), seq_lengths.typed_data(), s, reverse != 0,
        dgates->typed_data(), dh0->typed_data(), dc0->typed_data());
    return LaunchError("lstm backward");
  });
}

ffi::Error GruFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> gates_x, ffi::AnyBuffer w_hh,
                      ffi::Buffer<ffi::F32> b_hh, ffi::Buffer<ffi::F32> h0, ffi::Buffer<ffi::S32> seq_lengths,
                      ffi::Result<ffi::Buffer<ffi::F32>> h_seq, ffi::Result<ffi::Buffer<ffi::F32>> saved,
                      ffi::Result<ffi::Buffer<ffi::F32>> h_n, int64_t reverse, int64_t tf32, int64_t bf16_state,
                      ffi::ScratchAllocator scratch) {
  RecurrenceShape s;
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(gates_x.dimensions(), 3, 3, &s));
  JAXDNN_RETURN_IF_ERROR(
      CheckRecurrenceOperands(s, w_hh, {h0.dimensions(), h_n->dimensions()}, seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(ExpectShape("b_hh", b_hh.dimensions(), {s.directions, s.gates()}));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 1, {h_seq->dimensions()}));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 4, {saved->dimensions()}));
  if (s.empty()) return ffi::Error::Success();
  if (s.batch * s.directions > INT32_MAX) return InvalidArgument("rnn: more than 2^31 - 1 batch rows");
  const GruFwdIo io{gates_x.typed_data(), b_hh.typed_data(), h0.typed_data(), h_seq->typed_data(),
                    saved->typed_data(), h_n->typed_data(), Bf16Rows(scratch, s, w_hh, false, bf16_state)};
  bool launched = false;
  JAXDNN_RETURN_IF_ERROR(PersistentRecurrence(stream, w_hh.element_type(), w_hh.untyped_data(),
                                              seq_lengths.typed_data(), s, reverse != 0, tf32 != 0, io,
                                              &launched));
  if (launched) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(w_hh.element_type(), "w_hh", [&](auto tag) {
    using W = decltype(tag);
    const size_t bytes = SharedBytes(s.hidden);
    JAXDNN_RETURN_IF_ERROR(AllowSharedMemory(GruFwdKernel<W>, bytes));
    GruFwdKernel<W><<<unsigned(s.batch * s.directions), kThreads, bytes, stream>>>(
        gates_x.typed_data(), static_cast<const W*>(w_hh.untyped_data()), b_hh.typed_data(), h0.typed_data(),
        seq_lengths.typed_data(), s, reverse != 0, h_seq->typed_data(), saved->typed_data(), h_n->typed_data());
    return LaunchError("gru forward");
  });
}

ffi::Error GruBwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> dh_seq, ffi::Buffer<ffi::F32> dh_n,
                      ffi::Buffer<ffi::F32> saved, ffi::Buffer<ffi::F32> h_seq, ffi::Buffer<ffi::F32> h0,
                      ffi::AnyBuffer w_hh, ffi::Buffer<ffi::S32> seq_lengths,
                      ffi::Result<ffi::Buffer<ffi::F32>> dgates_x, ffi::Result<ffi::Buffer<ffi::F32>> dgates_h,
                      ffi::Result<ffi::Buffer<ffi::F32>> dh0, int64_t reverse, int64_t bf16_gradients,
                      ffi::ScratchAllocator scratch) {
  RecurrenceShape s;
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(saved.dimensions(), 4, 3, &s));
  JAXDNN_RETURN_IF_ERROR(CheckRecurrenceOperands(s, w_hh, {dh_n.dimensions(), h0.dimensions(), dh0->dimensions()},
                                                 seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 1, {dh_seq.dimensions(), h_seq.dimensions()}));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 3, {dgates_x->dimensions(), dgates_h->dimensions()}));
  if (s.empty()) return ffi::Error::Success();
  if (s.batch * s.directions > INT32_MAX) return InvalidArgument("rnn: more than 2^31 - 1 batch rows");
  const GruBwdIo io{dh_seq.typed_data(), dh_n.typed_data(), saved.typed_data(), h_seq.typed_data(),
                    h0.typed_data(), dgates_x->typed_data(), dgates_h->typed_data(), dh0->typed_data(),
                    Bf16Rows(scratch, s, w_hh, true, bf16_gradients)};
  bool launched = false;
  JAXDNN_RETURN_IF_ERROR(PersistentRecurrence(stream, w_hh.element_type(), w_hh.untyped_data(),
                                              seq_lengths.typed_data(), s, reverse != 0, /*tf32=*/false, io,
                                              &launched));
  if (launched) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(w_hh.element_type(), "w_hh", [&](auto tag) {
    using W = decltype(tag);
    const size_t bytes = SharedBytes(s.hidden);
    JAXDNN_RETURN_IF_ERROR(AllowSharedMemory(GruBwdKernel<W>, bytes));
    GruBwdKernel<W><<<unsigned(s.batch * s.directions), kThreads, bytes, stream>>>(
        dh_seq.typed_data(), dh_n.typed_data(), saved.typed_data(), h_seq.typed_data(), h0.typed_data(),
        static_cast<const W*>(w_hh.untyped_data()), seq_lengths.typed_data(), s, reverse != 0,
        dgates_x->typed_data(), dgates_h->typed_data(), dh0->typed_data());
    return LaunchError("gru backward");
  });
}

ffi::Error RnnFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> gates_x, ffi::AnyBuffer w_hh,
                      ffi::Buffer<ffi::F32> h0, ffi::Buffer<ffi::S32> seq_lengths,
                      ffi::Result<ffi::Buffer<ffi::F32>> h_seq, ffi::Result<ffi::Buffer<ffi::F32>> h_n,
                      int64_t reverse, std::string_view nonlinearity, int64_t tf32, int64_t bf16_state,
                      ffi::ScratchAllocator scratch) {
  RecurrenceShape s;
  Activation act;
  JAXDNN_RETURN_IF_ERROR(DecodeNonlinearity(nonlinearity, &act));
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(gates_x.dimensions(), 1, 1, &s));
  JAXDNN_RETURN_IF_ERROR(
      CheckRecurrenceOperands(s, w_hh, {h0.dimensions(), h_n->dimensions()}, seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 1, {h_seq->dimensions()}));
  if (s.empty()) return ffi::Error::Success();
  if (s.batch * s.directions > INT32_MAX) return InvalidArgument("rnn: more than 2^31 - 1 batch rows");
  const RnnFwdIo io{gates_x.typed_data(), h0.typed_data(), h_seq->typed_data(), h_n->typed_data(), act,
                    Bf16Rows(scratch, s, w_hh, false, bf16_state)};
  bool launched = false;
  JAXDNN_RETURN_IF_ERROR(PersistentRecurrence(stream, w_hh.element_type(), w_hh.untyped_data(),
                                              seq_lengths.typed_data(), s, reverse != 0, tf32 != 0, io,
                                              &launched));
  if (launched) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(w_hh.element_type(), "w_hh", [&](auto tag) {
    using W = decltype(tag);
    const size_t bytes = SharedBytes(s.hidden);
    JAXDNN_RETURN_IF_ERROR(AllowSharedMemory(RnnFwdKernel<W>, bytes));
    RnnFwdKernel<W><<<unsigned(s.batch * s.directions), kThreads, bytes, stream>>>(
        gates_x.typed_data(), static_cast<const W*>(w_hh.untyped_data()), h0.typed_data(), seq_lengths.typed_data(),
        s, reverse != 0, act, h_seq->typed_data(), h_n->typed_data());
    return LaunchError("rnn forward");
  });
}

ffi::Error RnnBwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> dh_seq, ffi::Buffer<ffi::F32> dh_n,
                      ffi::Buffer<ffi::F32> h_seq, ffi::AnyBuffer w_hh, ffi::Buffer<ffi::S32> seq_lengths,
                      ffi::Result<ffi::Buffer<ffi::F32>> dgates, ffi::Result<ffi::Buffer<ffi::F32>> dh0,
                      int64_t reverse, std::string_view nonlinearity, int64_t bf16_gradients,
                      ffi::ScratchAllocator scratch) {
  RecurrenceShape s;
  Activation act;
  JAXDNN_RETURN_IF_ERROR(DecodeNonlinearity(nonlinearity, &act));
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(h_seq.dimensions(), 1, 1, &s));
  JAXDNN_RETURN_IF_ERROR(
      CheckRecurrenceOperands(s, w_hh, {dh_n.dimensions(), dh0->dimensions()}, seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 1, {dh_seq.dimensions(), dgates->dimensions()}));
  if (s.empty()) return ffi::Error::Success();
  if (s.batch * s.directions > INT32_MAX) return InvalidArgument("rnn: more than 2^31 - 1 batch rows");
  const RnnBwdIo io{dh_seq.typed_data(), dh_n.typed_data(), h_seq.typed_data(), dgates->typed_data(),
                    dh0->typed_data(), act, Bf16Rows(scratch, s, w_hh, true, bf16_gradients)};
  bool launched = false;
  JAXDNN_RETURN_IF_ERROR(PersistentRecurrence(stream, w_hh.element_type(), w_hh.untyped_data(),
                                              seq_lengths.typed_data(), s, reverse != 0, /*tf32=*/false, io,
                                              &launched));
  if (launched) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(w_hh.element_type(), "w_hh", [&](auto tag) {
    using W = decltype(tag);
    const size_t bytes = SharedBytes(s.hidden);
    JAXDNN_RETURN_IF_ERROR(AllowSharedMemory(RnnBwdKernel<W>, bytes));
    RnnBwdKernel<W><<<unsigned(s.batch * s.directions), kThreads, bytes, stream>>>(
        dh_seq.typed_data(), dh_n.typed_data(), h_seq.typed_data(), static_cast<const W*>(w_hh.untyped_data()),
        seq_lengths.typed_data(), s, reverse != 0, act, dgates->typed_data(), dh0->typed_data());
    return LaunchError("rnn backward");
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

// Not kCmdBufferCompatible: the persistent kernels are cooperative launches, kept out of CUDA graphs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(LstmFwdCuda, jaxdnn::LstmFwdImpl,
                              jaxdnn::BindLstmFwd(jaxdnn::BindCuda()).Ctx<ffi::ScratchAllocator>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(LstmBwdCuda, jaxdnn::LstmBwdImpl,
                              jaxdnn::BindLstmBwd(jaxdnn::BindCuda()).Ctx<ffi::ScratchAllocator>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GruFwdCuda, jaxdnn::GruFwdImpl,
                              jaxdnn::BindGruFwd(jaxdnn::BindCuda()).Ctx<ffi::ScratchAllocator>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GruBwdCuda, jaxdnn::GruBwdImpl,
                              jaxdnn::BindGruBwd(jaxdnn::BindCuda()).Ctx<ffi::ScratchAllocator>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(RnnFwdCuda, jaxdnn::RnnFwdImpl,
                              jaxdnn::BindRnnFwd(jaxdnn::BindCuda()).Ctx<ffi::ScratchAllocator>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(RnnBwdCuda, jaxdnn::RnnBwdImpl,
                              jaxdnn::BindRnnBwd(jaxdnn::BindCuda()).Ctx<ffi::ScratchAllocator>());
