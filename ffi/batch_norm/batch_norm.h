// BatchNorm FFI handlers. Every target sees x as [O, C, I]: C channels (the normalized-over axis
// is everything else), O the axes before the channel axis folded together, I those after it
// (I = 1 for channels last, H*W for channels first). Per-channel vectors are [C] float32.
// Targets (the ABI of exported programs, hence versioned):
//   jaxdnn_batch_norm_stats_v1  (x, shift) -> (s1, s2, workspace[P,2,C])
//       s1 = sum(x - shift), s2 = sum((x - shift)^2) over O and I: the batch moments about a
//       shift close to the mean (the running mean), so the variance does not cancel.
//   jaxdnn_batch_norm_fwd_v1    (x, a, mean, bias[, residual]) -> y = act(pre)
//       pre = a (x - mean) + bias [+ residual]
//   jaxdnn_batch_norm_bwd_sums_v2 (dy, x, a, mean, bias) -> (sg, sgx, workspace[P,2,C])
//       g = dy act'(pre); sg = sum(g), sgx = sum(g (x - mean)) over O and I.
//   jaxdnn_batch_norm_bwd_grad_v1 (dy, x, a, mean, bias, residual) -> (g, sg, sgx, workspace[P,2,C])
//       the same sums with a residual in pre, and g itself (x's dtype): with a residual and an
//       activation, g is dresidual, and the dx stage reads g alone (identity activation) instead of
//       dy, x and the residual again: one array less to move.
//   jaxdnn_batch_norm_bwd_dx_v2 (dy, x, a, mean, bias, k1, k0) -> dx
//       dx = a g + k1 (x - mean) + k0.
// a = scale * rstd, k1 and k0 are per-channel coefficients computed in JAX from the statistics
// (jaxdnn/batch_norm.py), so the kernels serve training and inference alike. The workspace holds per-block partial sums that
// the CUDA kernels reduce in a fixed order (same bits every run); P is chosen at trace time and the
// CPU kernels ignore it. attrs: activation (an Activation of common/activation.h), activation_param.
#pragma once

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxdnn {

template <typename Binding>
auto BindBatchNormStats(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // x [O, C, I]
      .template Arg<ffi::Buffer<ffi::F32>>()   // shift [C]
      .template Ret<ffi::Buffer<ffi::F32>>()   // s1 [C]
      .template Ret<ffi::Buffer<ffi::F32>>()   // s2 [C]
      .template Ret<ffi::Buffer<ffi::F32>>();  // workspace [P, 2, C]
}

template <typename Binding>
auto BindBatchNormFwd(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // x [O, C, I]
      .template Arg<ffi::Buffer<ffi::F32>>()   // a [C]
      .template Arg<ffi::Buffer<ffi::F32>>()   // mean [C]
      .template Arg<ffi::Buffer<ffi::F32>>()   // bias [C]
      .template OptionalArg<ffi::AnyBuffer>()  // residual, x's shape and dtype
      .template Ret<ffi::AnyBuffer>()          // y, x's shape and dtype
      .template Attr<int64_t>("activation")
      .template Attr<float>("activation_param");
}

template <typename Binding>
auto BindBatchNormBwdSums(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // dy [O, C, I]
      .template Arg<ffi::AnyBuffer>()          // x [O, C, I]
      .template Arg<ffi::Buffer<ffi::F32>>()   // a [C]
      .template Arg<ffi::Buffer<ffi::F32>>()   // mean [C]
      .template Arg<ffi::Buffer<ffi::F32>>()   // bias [C]
      .template Ret<ffi::Buffer<ffi::F32>>()   // sg [C]
      .template Ret<ffi::Buffer<ffi::F32>>()   // sgx [C]
      .template Ret<ffi::Buffer<ffi::F32>>()   // workspace [P, 2, C]
      .template Attr<int64_t>("activation")
      .template Attr<float>("activation_param");
}

template <typename Binding>
auto BindBatchNormBwdGrad(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // dy [O, C, I]
      .template Arg<ffi::AnyBuffer>()          // x [O, C, I]
      .template Arg<ffi::Buffer<ffi::F32>>()   // a [C]
      .template Arg<ffi::Buffer<ffi::F32>>()   // mean [C]
      .template Arg<ffi::Buffer<ffi::F32>>()   // bias [C]
      .template Arg<ffi::AnyBuffer>()          // residual [O, C, I]
      .template Ret<ffi::AnyBuffer>()          // g, x's shape and dtype
      .template Ret<ffi::Buffer<ffi::F32>>()   // sg [C]
      .template Ret<ffi::Buffer<ffi::F32>>()   // sgx [C]
      .template Ret<ffi::Buffer<ffi::F32>>()   // workspace [P, 2, C]
      .template Attr<int64_t>("activation")
      .template Attr<float>("activation_param");
}

template <typename Binding>
auto BindBatchNormBwdDx(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // dy [O, C, I]
      .template Arg<ffi::AnyBuffer>()          // x [O, C, I]
      .template Arg<ffi::Buffer<ffi::F32>>()   // a [C]
      .template Arg<ffi::Buffer<ffi::F32>>()   // mean [C]
      .template Arg<ffi::Buffer<ffi::F32>>()   // bias [C]
      .template Arg<ffi::Buffer<ffi::F32>>()   // k1 [C]
      .template Arg<ffi::Buffer<ffi::F32>>()   // k0 [C]
      .template Ret<ffi::AnyBuffer>()          // dx
      .template Attr<int64_t>("activation")
      .template Attr<float>("activation_param");
}

}  // namespace jaxdnn

XLA_FFI_DECLARE_HANDLER_SYMBOL(BatchNormStatsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BatchNormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BatchNormBwdSumsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BatchNormBwdGradCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BatchNormBwdDxCpu);

#ifdef JAXDNN_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(BatchNormStatsCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BatchNormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BatchNormBwdSumsCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BatchNormBwdGradCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(BatchNormBwdDxCuda);
#endif
