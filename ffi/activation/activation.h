// Standalone activations, elementwise over any shape. Targets (versioned: the ABI of exported programs):
//   jaxdnn_activation_fwd_v1  (x) -> (y = f(x))                 attrs: kind, param
//   jaxdnn_activation_bwd_v1  (dy, x) -> (dx = dy * f'(x))      attrs: kind, param
//   jaxdnn_activation_bwd_bias_v1  (dy, x) -> (dx, partials)    attrs: kind, param
//     the backward of act(z + bias) over rows of C (the last axis): dx as above and the float32 column
//     sums of dx (its rounded values) over P chunks of rows, partials [P, C] (chunk p: rows
//     [R p / P, R (p + 1) / P)); the bias gradient is their sum over P. P is the caller's (it does
//     not depend on R, so a row-sharded call has the global call's result shape).
// kind is an Activation of common/activation.h; param its parameter (negative_slope, alpha) or 0.
#pragma once

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxdnn {

template <typename Binding>
auto BindActivationFwd(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()  // x
      .template Ret<xla::ffi::AnyBuffer>()  // y, x's shape and dtype
      .template Attr<int64_t>("kind")
      .template Attr<float>("param");
}

template <typename Binding>
auto BindActivationBwd(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()  // dy
      .template Arg<xla::ffi::AnyBuffer>()  // x, the forward's input
      .template Ret<xla::ffi::AnyBuffer>()  // dx
      .template Attr<int64_t>("kind")
      .template Attr<float>("param");
}

template <typename Binding>
auto BindActivationBwdBias(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()  // dy [..., C]
      .template Arg<xla::ffi::AnyBuffer>()  // x, the forward's input
      .template Ret<xla::ffi::AnyBuffer>()  // dx
      .template Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // partials [P, C]
      .template Attr<int64_t>("kind")
      .template Attr<float>("param");
}

}  // namespace jaxdnn

XLA_FFI_DECLARE_HANDLER_SYMBOL(ActivationFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ActivationBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ActivationBwdBiasCpu);

#ifdef JAXDNN_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(ActivationFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ActivationBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ActivationBwdBiasCuda);
#endif
