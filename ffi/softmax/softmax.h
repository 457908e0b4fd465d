// Softmax and log-softmax over the last axis. Targets (versioned: the ABI of exported programs):
//   jaxdnn_softmax_fwd_v1       (x[R,D]) -> (y[R,D])           y = exp(x - max) / sum(exp(x - max))
//   jaxdnn_softmax_bwd_v1       (dy, y) -> (dx)                dx = y * (dy - sum(dy * y))
//   jaxdnn_log_softmax_fwd_v1   (x) -> (y)                     y = x - max - log(sum(exp(x - max)))
//   jaxdnn_log_softmax_bwd_v1   (dy, y) -> (dx)                dx = dy - exp(y) * sum(dy)
// R is every leading axis folded together; sums are over D, in float32.
#pragma once

#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxdnn {

// The operands and results of each target, shared by its CPU and CUDA handlers.
template <typename Binding>
auto BindSoftmaxFwd(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()   // x [..., D]
      .template Ret<xla::ffi::AnyBuffer>();  // y, x's shape and dtype
}

template <typename Binding>
auto BindSoftmaxBwd(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()   // dy [..., D]
      .template Arg<xla::ffi::AnyBuffer>()   // y [..., D], the forward's output
      .template Ret<xla::ffi::AnyBuffer>();  // dx
}

}  // namespace jaxdnn

XLA_FFI_DECLARE_HANDLER_SYMBOL(SoftmaxFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SoftmaxBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LogSoftmaxFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LogSoftmaxBwdCpu);

#ifdef JAXDNN_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(SoftmaxFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SoftmaxBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LogSoftmaxFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LogSoftmaxBwdCuda);
#endif
