// Recurrent-network FFI handlers: the time recurrence of one LSTM, GRU or plain RNN layer in D = 1 or 2
// directions. The input projection of every time step (x W_ih^T + biases) is a GEMM done before, in
// XLA, and the weight gradients after (jaxdnn/recurrent.py); these targets are the sequential part only.
// Shapes: B batch rows, D directions, T time steps, H hidden units, G gate rows: 4H for the LSTM, in
// the order (i, f, g, o), 3H for the GRU, (r, z, n), as cuDNN and PyTorch order them, H for the plain
// RNN. Per-step operands are [B, T, D, ...] and states [B, D, H] (so a bidirectional layer's two
// recurrences are one call, which the CUDA kernels run at once, and h_seq is already the layer's
// output, its directions side by side), weights [D, ...]. State and accumulation are float32; W_hh is
// float32, bfloat16 or float16. Row b runs over its first len_b = clamp(seq_lengths[b], 0, T) steps,
// in direction d in time order or, when reversed, from t = len_b - 1 down to 0: direction 0 is
// reversed when the attribute reverse is 1, direction 1 when it is 0. Steps t >= len_b hold zeros in
// every per-step result. The forward targets take the attribute tf32: 1 lets the CUDA kernels round
// W_hh and the state they multiply to TF32 for the recurrent products (tensor cores, float32 sums),
// as cuDNN's default math and XLA's default precision do; 0 asks for exact float32 products; and
// bf16_state: 1 lets the CUDA persistent kernel of a bfloat16 W_hh, H a multiple of 64, round the
// state it multiplies to bfloat16 instead (bf16 tensor cores, float32 sums; h_seq and the other
// results stay float32), as a bfloat16 recurrence in XLA does. The backward targets take the
// attribute bf16_gradients: 1 lets the CUDA persistent kernel of a bfloat16 W_hh round the gate
// gradients it passes from step to step to bfloat16 and multiply them by W_hh on tensor cores
// (float32 sums; the dgates results stay float32), as a bfloat16 recurrence in XLA does; 0, or
// another W_hh dtype, exact float32 products. The CPU kernels compute exactly (a TF32
// backward of float32 gradients ran slower on an H100: its products are a few columns of W_hh a
// block).
// Targets (the ABI of exported programs, hence versioned):
//   jaxdnn_lstm_fwd_v4 (gates_x, w_hh, h0, c0, seq_lengths) -> (h_seq, c_seq, acts, h_n, c_n)
//       gates_x = x W_ih^T + b_ih + b_hh [B, T, D, 4H]; acts[b, t, d] = (sigmoid(i), sigmoid(f),
//       tanh(g), sigmoid(o)) of gates_x[b, t, d] + W_hh[d] h_prev; c = f c_prev + i g, h = o tanh(c);
//       h_n, c_n are the states after the last valid step (h0, c0 when len_b = 0).
//       attrs: reverse, tf32, bf16_state.
//   jaxdnn_lstm_bwd_v3 (dh_seq, dh_n, dc_n, acts, c_seq, c0, w_hh, seq_lengths) -> (dgates, dh0, dc0)
//       backward through time: dgates = d(loss)/d(gates_x) (zero past each row's end), dh0 and dc0
//       the gradients reaching the initial state. attrs: reverse, bf16_gradients.
//   jaxdnn_gru_fwd_v4 (gates_x, w_hh, b_hh, h0, seq_lengths) -> (h_seq, saved, h_n)
//       gates_x = x W_ih^T + b_ih [B, T, D, 3H], b_hh [D, 3H]; with hp = W_hh h_prev + b_hh:
//       r = sigmoid(x_r + hp_r), z = sigmoid(x_z + hp_z), n = tanh(x_n + r hp_n),
//       h = (1 - z) n + z h_prev (cuDNN's GRU); saved[b, t, d] = (r, z, n, hp_n) [4H], the
//       backward's residuals. attrs: reverse, tf32, bf16_state.
//   jaxdnn_gru_bwd_v3 (dh_seq, dh_n, saved, h_seq, h0, w_hh, seq_lengths) -> (dgates_x, dgates_h, dh0)
//       dgates_x = d(loss)/d(gates_x), dgates_h = d(loss)/d(hp) [B, T, D, 3H] (they differ in n: the
//       reset gate scales hp_n), dh0. attrs: reverse, bf16_gradients.
//   jaxdnn_rnn_fwd_v4 (gates_x, w_hh, h0, seq_lengths) -> (h_seq, h_n)
//       the plain (Elman) RNN, cuDNN's RNN_TANH / RNN_RELU: gates_x = x W_ih^T + b_ih + b_hh
//       [B, T, D, H]; h = act(gates_x + W_hh h_prev). h_seq is also the backward's residual.
//       attrs: reverse, nonlinearity ("tanh" or "relu"), tf32, bf16_state.
//   jaxdnn_rnn_bwd_v3 (dh_seq, dh_n, h_seq, w_hh, seq_lengths) -> (dgates, dh0)
//       dgates = d(loss)/d(gates_x), also the gradient of W_hh h_prev, with act' taken from the output
//       h (1 - h^2, or [h > 0]); dh0. attrs: reverse, nonlinearity, bf16_gradients.
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxdnn {

template <typename Binding>
auto BindLstmFwd(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()   // gates_x [B, T, D, G]: x W_ih^T + b_ih + b_hh
      .template Arg<ffi::AnyBuffer>()          // w_hh [D, G, H]
      .template Arg<ffi::Buffer<ffi::F32>>()   // h0 [B, D, H]
      .template Arg<ffi::Buffer<ffi::F32>>()   // c0 [B, D, H]
      .template Arg<ffi::Buffer<ffi::S32>>()   // seq_lengths [B]
      .template Ret<ffi::Buffer<ffi::F32>>()   // h_seq [B, T, D, H]
      .template Ret<ffi::Buffer<ffi::F32>>()   // c_seq [B, T, D, H]
      .template Ret<ffi::Buffer<ffi::F32>>()   // acts [B, T, D, G]: the gate activations
      .template Ret<ffi::Buffer<ffi::F32>>()   // h_n [B, D, H]
      .template Ret<ffi::Buffer<ffi::F32>>()   // c_n [B, D, H]
      .template Attr<int64_t>("reverse")
      .template Attr<int64_t>("tf32")
      .template Attr<int64_t>("bf16_state");
}

template <typename Binding>
auto BindLstmBwd(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()   // dh_seq [B, T, D, H]: cotangent of h_seq
      .template Arg<ffi::Buffer<ffi::F32>>()   // dh_n [B, D, H]
      .template Arg<ffi::Buffer<ffi::F32>>()   // dc_n [B, D, H]
      .template Arg<ffi::Buffer<ffi::F32>>()   // acts [B, T, D, G] from the forward
      .template Arg<ffi::Buffer<ffi::F32>>()   // c_seq [B, T, D, H] from the forward
      .template Arg<ffi::Buffer<ffi::F32>>()   // c0 [B, D, H]
      .template Arg<ffi::AnyBuffer>()          // w_hh [D, G, H]
      .template Arg<ffi::Buffer<ffi::S32>>()   // seq_lengths [B]
      .template Ret<ffi::Buffer<ffi::F32>>()   // dgates [B, T, D, G]
      .template Ret<ffi::Buffer<ffi::F32>>()   // dh0 [B, D, H]
      .template Ret<ffi::Buffer<ffi::F32>>()   // dc0 [B, D, H]
      .template Attr<int64_t>("reverse")
      .template Attr<int64_t>("bf16_gradients");
}

template <typename Binding>
auto BindGruFwd(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()   // gates_x [B, T, D, G]: x W_ih^T + b_ih
      .template Arg<ffi::AnyBuffer>()          // w_hh [D, G, H]
      .template Arg<ffi::Buffer<ffi::F32>>()   // b_hh [D, G]
      .template Arg<ffi::Buffer<ffi::F32>>()   // h0 [B, D, H]
      .template Arg<ffi::Buffer<ffi::S32>>()   // seq_lengths [B]
      .template Ret<ffi::Buffer<ffi::F32>>()   // h_seq [B, T, D, H]
      .template Ret<ffi::Buffer<ffi::F32>>()   // saved [B, T, D, 4H]: r, z, n, hp_n
      .template Ret<ffi::Buffer<ffi::F32>>()   // h_n [B, D, H]
      .template Attr<int64_t>("reverse")
      .template Attr<int64_t>("tf32")
      .template Attr<int64_t>("bf16_state");
}

template <typename Binding>
auto BindGruBwd(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()   // dh_seq [B, T, D, H]: cotangent of h_seq
      .template Arg<ffi::Buffer<ffi::F32>>()   // dh_n [B, D, H]
      .template Arg<ffi::Buffer<ffi::F32>>()   // saved [B, T, D, 4H] from the forward
      .template Arg<ffi::Buffer<ffi::F32>>()   // h_seq [B, T, D, H] from the forward
      .template Arg<ffi::Buffer<ffi::F32>>()   // h0 [B, D, H]
      .template Arg<ffi::AnyBuffer>()          // w_hh [D, G, H]
      .template Arg<ffi::Buffer<ffi::S32>>()   // seq_lengths [B]
      .template Ret<ffi::Buffer<ffi::F32>>()   // dgates_x [B, T, D, G]
      .template Ret<ffi::Buffer<ffi::F32>>()   // dgates_h [B, T, D, G]
      .template Ret<ffi::Buffer<ffi::F32>>()   // dh0 [B, D, H]
      .template Attr<int64_t>("reverse")
      .template Attr<int64_t>("bf16_gradients");
}

template <typename Binding>
auto BindRnnFwd(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()   // gates_x [B, T, D, H]: x W_ih^T + b_ih + b_hh
      .template Arg<ffi::AnyBuffer>()          // w_hh [D, H, H]
      .template Arg<ffi::Buffer<ffi::F32>>()   // h0 [B, D, H]
      .template Arg<ffi::Buffer<ffi::S32>>()   // seq_lengths [B]
      .template Ret<ffi::Buffer<ffi::F32>>()   // h_seq [B, T, D, H]
      .template Ret<ffi::Buffer<ffi::F32>>()   // h_n [B, D, H]
      .template Attr<int64_t>("reverse")
      .template Attr<std::string_view>("nonlinearity")  // "tanh" or "relu"
      .template Attr<int64_t>("tf32")
      .template Attr<int64_t>("bf16_state");
}

template <typename Binding>
auto BindRnnBwd(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()   // dh_seq [B, T, D, H]: cotangent of h_seq
      .template Arg<ffi::Buffer<ffi::F32>>()   // dh_n [B, D, H]
      .template Arg<ffi::Buffer<ffi::F32>>()   // h_seq [B, T, D, H] from the forward
      .template Arg<ffi::AnyBuffer>()          // w_hh [D, H, H]
      .template Arg<ffi::Buffer<ffi::S32>>()   // seq_lengths [B]
      .template Ret<ffi::Buffer<ffi::F32>>()   // dgates [B, T, D, H]
      .template Ret<ffi::Buffer<ffi::F32>>()   // dh0 [B, D, H]
      .template Attr<int64_t>("reverse")
      .template Attr<std::string_view>("nonlinearity")  // "tanh" or "relu"
      .template Attr<int64_t>("bf16_gradients");
}

}  // namespace jaxdnn

XLA_FFI_DECLARE_HANDLER_SYMBOL(LstmFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LstmBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GruFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GruBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RnnFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RnnBwdCpu);

#ifdef JAXDNN_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(LstmFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LstmBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GruFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GruBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RnnFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RnnBwdCuda);
#endif
