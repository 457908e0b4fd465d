// LayerNorm and RMSNorm FFI handlers. Targets (the ABI of exported programs, hence versioned):
//   jaxdnn_layer_norm_fwd_v2  (x[R,D], scale[D] f32, bias[D] f32) -> (y[R,D], mean[R] f32, rstd[R] f32)
//   jaxdnn_layer_norm_bwd_v2  (dy, x, scale, bias, mean, rstd) -> (dx, dscale[D] f32, dbias[D] f32, workspace[P,2,D] f32)
// LayerNorm's attrs activation/activation_param fuse y = act(xhat * scale + bias) (v2; v1 had none).
//   jaxdnn_rms_norm_fwd_v1    (x, scale) -> (y, rstd)
//   jaxdnn_rms_norm_bwd_v1    (dy, x, scale, rstd) -> (dx, dscale, workspace[P,1,D] f32)
// R is every leading axis of x folded together. The workspace holds per-block partial sums of
// dscale/dbias so the CUDA backward reduces them in a fixed order (same bits every run); P is chosen
// at trace time (jaxdnn/norm.py) and the CPU kernels ignore it.
#pragma once

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxdnn {

// The operands, results and attributes of each target, shared by its CPU and CUDA handlers (the
// CUDA binding starts with the stream context): `binding` is `ffi::Ffi::Bind()` or that plus Ctx.
template <typename Binding>
auto BindLayerNormFwd(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // x [..., D]
      .template Arg<ffi::Buffer<ffi::F32>>()   // scale [D]
      .template Arg<ffi::Buffer<ffi::F32>>()   // bias [D]
      .template Ret<ffi::AnyBuffer>()          // y, x's shape and dtype
      .template Ret<ffi::Buffer<ffi::F32>>()   // mean [...]
      .template Ret<ffi::Buffer<ffi::F32>>()   // rstd [...]
      .template Attr<float>("epsilon")
      .template Attr<int64_t>("activation")
      .template Attr<float>("activation_param");
}

template <typename Binding>
auto BindRmsNormFwd(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // x [..., D]
      .template Arg<ffi::Buffer<ffi::F32>>()   // scale [D]
      .template Ret<ffi::AnyBuffer>()          // y
      .template Ret<ffi::Buffer<ffi::F32>>()   // rstd [...]
      .template Attr<float>("epsilon");
}

template <typename Binding>
auto BindLayerNormBwd(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // dy [..., D]
      .template Arg<ffi::AnyBuffer>()          // x [..., D]
      .template Arg<ffi::Buffer<ffi::F32>>()   // scale [D]
      .template Arg<ffi::Buffer<ffi::F32>>()   // bias [D] (for the activation's derivative)
      .template Arg<ffi::Buffer<ffi::F32>>()   // mean [...]
      .template Arg<ffi::Buffer<ffi::F32>>()   // rstd [...]
      .template Ret<ffi::AnyBuffer>()          // dx
      .template Ret<ffi::Buffer<ffi::F32>>()   // dscale [D]
      .template Ret<ffi::Buffer<ffi::F32>>()   // dbias [D]
      .template Ret<ffi::Buffer<ffi::F32>>()   // workspace [P, 2, D]
      .template Attr<int64_t>("activation")
      .template Attr<float>("activation_param");
}

template <typename Binding>
auto BindRmsNormBwd(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // dy [..., D]
      .template Arg<ffi::AnyBuffer>()          // x [..., D]
      .template Arg<ffi::Buffer<ffi::F32>>()   // scale [D]
      .template Arg<ffi::Buffer<ffi::F32>>()   // rstd [...]
      .template Ret<ffi::AnyBuffer>()          // dx
      .template Ret<ffi::Buffer<ffi::F32>>()   // dscale [D]
      .template Ret<ffi::Buffer<ffi::F32>>();  // workspace [P, 1, D]
}

}  // namespace jaxdnn

XLA_FFI_DECLARE_HANDLER_SYMBOL(LayerNormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LayerNormBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormBwdCpu);

#ifdef JAXDNN_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(LayerNormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LayerNormBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormBwdCuda);
#endif
