// GroupNorm FFI handlers, channels last. Targets (the ABI of exported programs, hence versioned):
//   jaxdnn_group_norm_fwd_v1  (x[N,S,C], scale[C], bias[C]: both float32 or both x's dtype)
//                             -> (y[N,S,C], mean[N,G] f32, rstd[N,G] f32, workspace[N,P,2,C] f32)
//   jaxdnn_group_norm_bwd_v1  (dy, x, scale, bias, mean, rstd)
//                             -> (dx, dscale[C], dbias[C] (scale's dtype), workspace[N,P,2,C] f32,
//                                 group_sums[N,G,2] f32)
// N samples, S spatial positions (every axis between the first and the last folded together), C
// channels in G groups of K = C / G. Statistics are per (sample, group), over S * K elements.
// y = act((x - mean) * rstd * scale + bias), act given by the `activation` attributes (an Activation
// of common/activation.h and its parameter).
//
// Both stages split each sample's S positions into P chunks (P is chosen at trace time,
// jaxdnn/group_norm.py): a chunk's per-channel partial sums go to workspace[n, p], and fixed-order
// reductions over the chunks give the statistics (forward) or the group sums and dscale/dbias
// (backward), so the results have the same bits on every run. The CPU kernels use the same
// decomposition and workspace.
#pragma once

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxdnn {

// The operands, results and attributes of each target, shared by its CPU and CUDA handlers (the
// CUDA binding starts with the stream context).
template <typename Binding>
auto BindGroupNormFwd(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // x [N, S, C]
      .template Arg<ffi::AnyBuffer>()          // scale [C]
      .template Arg<ffi::AnyBuffer>()          // bias [C]
      .template Ret<ffi::AnyBuffer>()          // y, x's shape and dtype
      .template Ret<ffi::Buffer<ffi::F32>>()   // mean [N, G]
      .template Ret<ffi::Buffer<ffi::F32>>()   // rstd [N, G]
      .template Ret<ffi::Buffer<ffi::F32>>()   // workspace [N, P, 2, C]: per-chunk channel sums
      .template Attr<float>("epsilon")
      .template Attr<int64_t>("num_groups")
      .template Attr<int64_t>("activation")
      .template Attr<float>("activation_param");
}

template <typename Binding>
auto BindGroupNormBwd(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // dy [N, S, C]
      .template Arg<ffi::AnyBuffer>()          // x [N, S, C]
      .template Arg<ffi::AnyBuffer>()          // scale [C]
      .template Arg<ffi::AnyBuffer>()          // bias [C] (the activation's input needs it)
      .template Arg<ffi::Buffer<ffi::F32>>()   // mean [N, G]
      .template Arg<ffi::Buffer<ffi::F32>>()   // rstd [N, G]
      .template Ret<ffi::AnyBuffer>()          // dx
      .template Ret<ffi::AnyBuffer>()          // dscale [C]
      .template Ret<ffi::AnyBuffer>()          // dbias [C]
      .template Ret<ffi::Buffer<ffi::F32>>()   // workspace [N, P, 2, C]: per-chunk channel sums
      .template Ret<ffi::Buffer<ffi::F32>>()   // group_sums [N, G, 2]: per-group sums for dx
      .template Attr<int64_t>("num_groups")
      .template Attr<int64_t>("activation")
      .template Attr<float>("activation_param");
}

}  // namespace jaxdnn

XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupNormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupNormBwdCpu);

#ifdef JAXDNN_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupNormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupNormBwdCuda);
#endif
