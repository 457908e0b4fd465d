// Scaled dot-product attention (jax.nn.dot_product_attention's layout and meaning), forward and
// backward, with memory linear in the sequence lengths (blockwise online softmax).
//
// Shapes: q [B, T, N, H], k and v [B, S, K, H] with N a multiple of K (query head n reads key/value
// head n / (N / K): grouped-query and multi-query attention without repeating K/V).
// Logits s = scale q.k, then cap tanh(s / cap) when logits_soft_cap > 0, then + bias; a logit is
// dropped (probability 0) when the causal / window / length / mask / segment rules exclude it.
// A query row with every logit dropped has output 0 and logsumexp -inf. With dropout, each
// probability is then kept (scaled by 1 / keep) or zeroed by a hash of (seed, n, t, s), or of
// (seed, t, s) where the heads share one mask (attention_problem.h), so the backward regenerates
// the forward's mask; lse is undropped.
//
// Targets (versioned: the ABI of exported programs):
//   jaxdnn_attention_fwd_v2 (q, k, v, bias, mask, q_lens, kv_lens, q_seg, kv_seg, dropout_seed)
//       -> (o [B, T, N, H], lse [B, N, T] float32)
//   jaxdnn_attention_bwd_v3 (do, q, k, v, o, lse, bias, mask, q_lens, kv_lens, q_seg, kv_seg,
//                            dropout_seed)
//       -> (dq, dk, dv, dbias [B, N, T, S] float32 or [0], workspace delta [B, N, T] float32,
//           workspace dq_accum [B, T, N, H] float32 or [0], workspace semaphores int32 or [0])
//       dbias is [0] unless the attr bias_grad is 1 (a bias is present and differentiated).
//       dq_accum and semaphores (B * N * ceil(T / 64) of them) are for the Hopper fused kernel of
//       16-bit inputs with 64 < H <= 128 (attention_sm90.h), [0] otherwise; semaphores [0] with
//       such a dq_accum asks for unordered (not deterministic) dq adds.
// Optional operands are always passed; `present` (a bitmask of AttentionOperand) says which are
// real, the others are [0] placeholders:
//   bias [Bb, Nb, Tb, Sb] float32, each axis 1 (broadcast) or full; its gradient is returned
//   unreduced as [B, N, T, S] (the caller sums it down to the bias's shape);
//   mask [Bm, Nm, Tm, Sm] bool, likewise broadcast (true = attend);
//   q_lens, kv_lens [B] int32 (query row t / key s takes part iff t < q_lens[b] / s < kv_lens[b]);
//   q_seg [B, T], kv_seg [B, S] int32 (attend iff the segment ids are equal);
//   dropout_seed [B, 2] uint32 (per batch element, so vmap over keys folds into B).
// attrs: scale, logits_soft_cap (0 = off) float32; is_causal (s <= t), window_left, window_right
// (t - left <= s <= t + right; -1 = unbounded), present, dropout_keep int64 (a probability is kept
// when its 24-bit hash is below it: 2^24 keeps all), dropout_heads int64 (1: a mask per head; 0:
// one mask shared by the heads, Flax's broadcast_dropout); the backward also bias_grad int64.
#pragma once

#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxdnn {

template <typename Binding>
auto BindAttentionMasks(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()   // bias [Bb, Nb, Tb, Sb] or [0]
      .template Arg<ffi::Buffer<ffi::PRED>>()  // mask [Bm, Nm, Tm, Sm] or [0]
      .template Arg<ffi::Buffer<ffi::S32>>()   // q_lens [B] or [0]
      .template Arg<ffi::Buffer<ffi::S32>>()   // kv_lens [B] or [0]
      .template Arg<ffi::Buffer<ffi::S32>>()   // q_seg [B, T] or [0]
      .template Arg<ffi::Buffer<ffi::S32>>()   // kv_seg [B, S] or [0]
      .template Arg<ffi::Buffer<ffi::U32>>();  // dropout_seed [B, 2] or [0]
}

template <typename Binding>
auto BindAttentionAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<float>("scale")
      .template Attr<float>("logits_soft_cap")
      .template Attr<int64_t>("is_causal")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right")
      .template Attr<int64_t>("present")
      .template Attr<int64_t>("dropout_keep")
      .template Attr<int64_t>("dropout_heads");
}

template <typename Binding>
auto BindAttentionFwd(Binding binding) {
  namespace ffi = xla::ffi;
  return BindAttentionAttrs(BindAttentionMasks(
      std::move(binding)
          .template Arg<ffi::AnyBuffer>()     // q [B, T, N, H]
          .template Arg<ffi::AnyBuffer>()     // k [B, S, K, H]
          .template Arg<ffi::AnyBuffer>())    // v [B, S, K, H]
      .template Ret<ffi::AnyBuffer>()         // o [B, T, N, H], q's dtype
      .template Ret<ffi::Buffer<ffi::F32>>());  // lse [B, N, T]
}

template <typename Binding>
auto BindAttentionBwd(Binding binding) {
  namespace ffi = xla::ffi;
  return BindAttentionAttrs(BindAttentionMasks(
      std::move(binding)
          .template Arg<ffi::AnyBuffer>()            // do [B, T, N, H]
          .template Arg<ffi::AnyBuffer>()            // q [B, T, N, H]
          .template Arg<ffi::AnyBuffer>()            // k [B, S, K, H]
          .template Arg<ffi::AnyBuffer>()            // v [B, S, K, H]
          .template Arg<ffi::AnyBuffer>()            // o [B, T, N, H], the forward's output
          .template Arg<ffi::Buffer<ffi::F32>>())    // lse [B, N, T], the forward's logsumexp
      .template Ret<ffi::AnyBuffer>()                // dq, q's shape and dtype
      .template Ret<ffi::AnyBuffer>()                // dk, k's shape and dtype
      .template Ret<ffi::AnyBuffer>()                // dv
      .template Ret<ffi::Buffer<ffi::F32>>()         // dbias [B, N, T, S] or [0]
      .template Ret<ffi::Buffer<ffi::F32>>()         // workspace: delta = rowsum(do * o) [B, N, T]
      .template Ret<ffi::Buffer<ffi::F32>>()         // workspace: dq_accum [B, T, N, H] or [0]
      .template Ret<ffi::Buffer<ffi::S32>>())        // workspace: semaphores or [0]
      .template Attr<int64_t>("bias_grad");
}

}  // namespace jaxdnn

XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionBwdCpu);

#ifdef JAXDNN_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionBwdCuda);
#endif
