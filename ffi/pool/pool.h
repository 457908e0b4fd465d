// Max and average pooling, batch first and channels last. Every spatial rank (1-D, 2-D, 3-D) is
// seen as 3-D: the Python side inserts size-1 spatial axes, so x is [..., D, H, W, C] and the pooled
// output [..., P, Q, R, C]; the leading axes are folded into N. Targets (versioned: the ABI of
// exported programs):
//   jaxdnn_max_pool_infer_v1  (x) -> (y)                   y = max over each window (padding = -inf)
//   jaxdnn_max_pool_fwd_v1    (x) -> (y, argmax)           argmax [..., P, Q, R, C] (uint8 when the
//                                                          window has <= 256 elements, else int32):
//                                                          the row-major offset in the window of the
//                                                          first maximal element (ties as in XLA)
//   jaxdnn_max_pool_bwd_v1    (dy, argmax) -> (dx)         dx = sum of the dy whose window chose it
//   jaxdnn_avg_pool_fwd_v1    (x) -> (y)                   y = window sum / divisor
//   jaxdnn_avg_pool_bwd_v1    (dy) -> (dx)                 dx = sum of dy / divisor over the windows
//                                                          that cover each element
// The divisor is the window volume (count_include_pad) or the count of its elements inside x.
// Attributes (int64, per spatial axis d h w): window_*, stride_*, pad_* (low padding), in_* (D H W)
// and out_* (P Q R), checked against the buffers; avg pool adds count_include_pad (bool).
#pragma once

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxdnn {

// The pooling window as decoded from a target's attributes (every one of them: the FFI decodes the
// attribute dictionary into this struct by name).
struct PoolAttrs {
  int64_t window_d, window_h, window_w;
  int64_t stride_d, stride_h, stride_w;
  int64_t pad_d, pad_h, pad_w;  // low padding; the high padding only shows in out_*
  int64_t in_d, in_h, in_w;
  int64_t out_d, out_h, out_w;
};

struct AvgPoolAttrs {
  PoolAttrs pool;
  bool count_include_pad;
};

template <typename Binding>
auto BindMaxPoolInfer(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()  // x [..., D, H, W, C]
      .template Ret<xla::ffi::AnyBuffer>()  // y [..., P, Q, R, C], x's dtype
      .template Attrs<PoolAttrs>();
}

template <typename Binding>
auto BindMaxPoolFwd(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()  // x [..., D, H, W, C]
      .template Ret<xla::ffi::AnyBuffer>()  // y [..., P, Q, R, C], x's dtype
      .template Ret<xla::ffi::AnyBuffer>()  // argmax [..., P, Q, R, C], uint8 or int32
      .template Attrs<PoolAttrs>();
}

template <typename Binding>
auto BindMaxPoolBwd(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()  // dy [..., P, Q, R, C]
      .template Arg<xla::ffi::AnyBuffer>()  // argmax [..., P, Q, R, C], from the forward
      .template Ret<xla::ffi::AnyBuffer>()  // dx [..., D, H, W, C], dy's dtype
      .template Attrs<PoolAttrs>();
}

template <typename Binding>
auto BindAvgPoolFwd(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()  // x [..., D, H, W, C]
      .template Ret<xla::ffi::AnyBuffer>()  // y [..., P, Q, R, C], x's dtype
      .template Attrs<AvgPoolAttrs>();
}

template <typename Binding>
auto BindAvgPoolBwd(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()  // dy [..., P, Q, R, C]
      .template Ret<xla::ffi::AnyBuffer>()  // dx [..., D, H, W, C], dy's dtype
      .template Attrs<AvgPoolAttrs>();
}

}  // namespace jaxdnn

// Both structs are decoded from the attribute dictionary by name (every attribute must be there).
#define JAXDNN_POOL_ATTR_MEMBERS \
  StructMember<int64_t>("window_d"),  \
  StructMember<int64_t>("window_h"),  \
  StructMember<int64_t>("window_w"),  \
  StructMember<int64_t>("stride_d"),  \
  StructMember<int64_t>("stride_h"),  \
  StructMember<int64_t>("stride_w"),  \
  StructMember<int64_t>("pad_d"),  \
  StructMember<int64_t>("pad_h"),  \
  StructMember<int64_t>("pad_w"),  \
  StructMember<int64_t>("in_d"),  \
  StructMember<int64_t>("in_h"),  \
  StructMember<int64_t>("in_w"),  \
  StructMember<int64_t>("out_d"),  \
  StructMember<int64_t>("out_h"),  \
  StructMember<int64_t>("out_w")

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxdnn::PoolAttrs, JAXDNN_POOL_ATTR_MEMBERS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxdnn::AvgPoolAttrs, JAXDNN_POOL_ATTR_MEMBERS,
                                      StructMember<bool>("count_include_pad"));

XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxPoolInferCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxPoolFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxPoolBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AvgPoolFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AvgPoolBwdCpu);

#ifdef JAXDNN_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxPoolInferCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxPoolFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxPoolBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AvgPoolFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AvgPoolBwdCuda);
#endif
