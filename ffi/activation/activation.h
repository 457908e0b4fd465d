// Standalone activations, elementwise over any shape. Targets (versioned: the ABI of exported programs):
//   jaxdnn_activation_fwd_v1  (x) -> (y = f(x))                 attrs: kind, param
//   jaxdnn_activation_bwd_v1  (dy, x) -> (dx = dy * f'(x))      attrs: kind, param
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

}  // namespace jaxdnn

XLA_FFI_DECLARE_HANDLER_SYMBOL(ActivationFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ActivationBwdCpu);

#ifdef JAXDNN_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(ActivationFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ActivationBwdCuda);
#endif
