// The persistent recurrence kernels (rnn_persistent.cu): one cooperative grid runs a layer's whole
// sequence in each of its directions (both at once where they fit), forward or backward through
// time, with W_hh held on chip (a layer of one batch row, or of 2 to 16 rows with small W_hh
// slices: one thread-block cluster a direction, on sm_90). rnn.cu's handlers call them first and
// fall back to the per-row baseline when the plan does not fit the device.
// Shapes and meanings are rnn.h's; the *Io structs carry each target's operands and results.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/ffi_common.h"
#include "rnn/rnn_cell.h"

namespace jaxdnn {

// The values a persistent kernel's blocks exchange each step, in bfloat16 (a bfloat16 W_hh's reduced
// products on bf16 tensor cores), which its product then reads instead of the float32 rows:
// - forward: the h of every step, [B T D + B D][H] (h_seq's rows, then h0's), published like h_seq;
// - backward: the gate gradients of the last two steps, [2][B D][Bf16RowLength(G)], zero past G.
// Null: TF32 (forward) or exact float32 (backward) products of the float32 rows.
struct Bf16Exchange {
  __nv_bfloat16* rows = nullptr;
};
struct LstmFwdIo {
  const float *gates_x, *h0, *c0;
  float *h_seq, *c_seq, *acts, *h_n, *c_n;
  Bf16Exchange exchange;
};
struct LstmBwdIo {
  const float *dh_seq, *dh_n, *dc_n, *acts, *c_seq, *c0;
  float *dgates, *dh0, *dc0;
  Bf16Exchange exchange;
};
struct GruFwdIo {
  const float *gates_x, *b_hh, *h0;
  float *h_seq, *saved, *h_n;
  Bf16Exchange exchange;
};
struct GruBwdIo {
  const float *dh_seq, *dh_n, *saved, *h_seq, *h0;
  float *dgates_x, *dgates_h, *dh0;
  Bf16Exchange exchange;
};
struct RnnFwdIo {
  const float *gates_x, *h0;
  float *h_seq, *h_n;
  Activation act;
  Bf16Exchange exchange;
};
struct RnnBwdIo {
  const float *dh_seq, *dh_n, *h_seq;
  float *dgates, *dh0;
  Activation act;
  Bf16Exchange exchange;
};

// Elements of a backward row of Bf16Exchange: G rounded up to the bf16 product's k blocks.
inline constexpr int64_t kBf16KBlock = 64;
__host__ __device__ constexpr int64_t Bf16RowLength(int64_t G) {
  return (G + kBf16KBlock - 1) / kBf16KBlock * kBf16KBlock;
}
// Whether a forward of H hidden units can exchange its h in bfloat16: its rows, unpadded, must fill
// the bf16 product's k blocks.
__host__ __device__ constexpr bool Bf16StateFits(int64_t H) { return H % kBf16KBlock == 0; }
// Elements of io.exchange.rows (the layouts above).
inline int64_t Bf16ExchangeElements(const RecurrenceShape& s, bool backward) {
  return backward ? 2 * s.batch * s.directions * Bf16RowLength(s.gates())
                  : (s.steps + 1) * s.batch * s.directions * s.hidden;
}

// Launches the persistent kernel of `Io`'s target on `stream` and sets *launched, or leaves *launched
// false (and launches nothing) when W_hh's slices or the per-block buffers do not fit in shared memory
// or the grid cannot be co-resident. w_hh [D, G, H] has dtype w_type (float32, bfloat16 or float16).
// The recurrent products run on tensor cores with float32 sums when the forward's tf32 allows, with
// W_hh and the multiplied state rounded to TF32, or when io.exchange.rows is given (the caller gives
// it only for a bfloat16 W_hh, and forward only where Bf16StateFits(H)): forward, with the state
// rounded to bfloat16, backward, with the gate gradients rounded to bfloat16, on bf16 tensor cores.
// Otherwise (the backward's tf32 is unused) they are exact float32 sums on CUDA cores. The cluster
// kernels (small batches) ignore io.exchange.
template <typename Io>
ffi::Error PersistentRecurrence(cudaStream_t stream, ffi::DataType w_type, const void* w_hh,
                                const int32_t* seq_lengths, const RecurrenceShape& shape, bool reverse, bool tf32,
                                const Io& io, bool* launched);

}  // namespace jaxdnn
