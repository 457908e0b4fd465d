// CPU activations: one elementwise loop per (activation, dtype).
#include "activation/activation_common.h"
#include "activation/activation.h"
#include "common/half_cpu.h"

namespace jaxdnn {
namespace {

ffi::Error ActivationFwdImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t kind, float param) {
  int64_t n = 0;
  JAXDNN_RETURN_IF_ERROR(CheckActivation({&x, &*y}, kind, &n));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    const T* in = static_cast<const T*>(x.untyped_data());
    T* out = static_cast<T*>(y->untyped_data());
    DispatchActivation(kind, [&](auto act) {
      for (int64_t i = 0; i < n; ++i) {
        out[i] = FromFloat<T>(Activate<decltype(act)::value>(ToFloat(in[i]), param));
      }
    });
    return ffi::Error::Success();
  });
}

ffi::Error ActivationBwdImpl(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> dx,
                             int64_t kind, float param) {
  int64_t n = 0;
  JAXDNN_RETURN_IF_ERROR(CheckActivation({&dy, &x, &*dx}, kind, &n));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    const T* g = static_cast<const T*>(dy.untyped_data());
    const T* in = static_cast<const T*>(x.untyped_data());
    T* out = static_cast<T*>(dx->untyped_data());
    DispatchActivation(kind, [&](auto act) {
      for (int64_t i = 0; i < n; ++i) {
        out[i] = FromFloat<T>(ToFloat(g[i]) * ActivateGrad<decltype(act)::value>(ToFloat(in[i]), param));
      }
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(ActivationFwdCpu, jaxdnn::ActivationFwdImpl,
                              jaxdnn::BindActivationFwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ActivationBwdCpu, jaxdnn::ActivationBwdImpl,
                              jaxdnn::BindActivationBwd(ffi::Ffi::Bind()));
