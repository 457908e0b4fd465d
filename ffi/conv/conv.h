// Convolution, batch first and channels last. Every spatial rank (1-D, 2-D, 3-D) is seen as 3-D:
// the Python side transposes any dimension_numbers to this canonical layout and inserts size-1
// spatial axes in front of the missing ones. Shapes (G = groups, C = G * Cg, K = G * Kg):
//   x  [N, D, H, W, C]      the input (lhs)
//   w  [T, U, V, Cg, K]     the filter (rhs): window T x U x V, Cg input channels per group
//   y  [N, P, Q, R, K]      the output; output feature k belongs to group k / Kg and reads the
//                           input channels [group * Cg, (group + 1) * Cg)
// y[n, o, k] = sum over taps t and c < Cg of x~[n, o * stride + t * rhs_dilation - pad, group * Cg + c]
//              * w[t, c, k], where x~ is x with lhs_dilation - 1 zeros between its elements (a
// transposed convolution) and zeros outside it. pad is the low padding and may be negative (it crops),
// as in lax; the high padding only shows in the output sizes.
// Targets (versioned: the ABI of exported programs); all accumulate in float32. Each has a last
// result `workspace`: scratch for the GPU's tensor-core kernels, which take filters [K, T, U, V, Cg]
// (the filter, or wgrad's result, transposed there). Sized at trace time: T*U*V*Cg*K elements of
// x's dtype for 16-bit dtypes (and for float32 forwards with tf32), none otherwise; a smaller one
// sends the stage to another kernel.
//   jaxdnn_conv_fprop_v4  (x, w)  -> (y)    the forward
//   jaxdnn_conv_fprop_fused_v4  (x, w, bias, [residual]) -> (y)
//                                         y = act(conv(x, w) + bias + residual): bias [K], residual
//                                         y's shape, both x's dtype; attributes activation (int64, the
//                                         Activation enum of common/activation.h), activation_param (f32)
//   jaxdnn_conv_dgrad_v4  (dy, w) -> (dx)   the gradient w.r.t. x (the transpose of fprop in x)
//   jaxdnn_conv_wgrad_v4  (x, dy) -> (dw)   the gradient w.r.t. w (summed over N and the output pixels);
//                                         dw in x's dtype, or float32 for 16-bit x and dy (the sums
//                                         unrounded; not for depthwise ones)
// Attributes (int64, per spatial axis d h w): in_* (D H W), out_* (P Q R), window_* (T U V), stride_*,
// pad_*, lhs_dilation_*, rhs_dilation_*, groups, algorithm (a ConvAlgorithm) and tf32 (1: the GPU's
// forward may multiply float32 operands as TF32 on the tensor cores, as cuDNN's float32 convolutions
// do at JAX's default precision; the CPU kernels, the backward stages' kernels and 16-bit operands
// ignore it). The sizes are checked against the buffers' shapes (every stage's abstract evaluation
// needs the one size its operands do not give).
#pragma once

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxdnn {

// The kernel a GPU stage runs on (the `algorithm` attribute), chosen by jaxdnn/_autotune.py when
// autotuning is on: kConvAuto is the heuristic; the others ask for one kernel and get the heuristic's
// choice where that kernel cannot take the stage (so every value is valid for every stage). All are
// deterministic; they differ only in float32 summation order. The CPU kernels ignore it.
enum ConvAlgorithm : int64_t {
  kConvAuto = 0,
  kConvGemm = 1,       // a pointwise stage (1x1 window, unit strides) on ffi/dense's GEMM
  kConvTileWide = 2,   // implicit GEMM, 128 x 128 CTA tiles (wgrad: 128 filters a tile)
  kConvTileTall = 3,   // implicit GEMM, 256 x 64 tiles (wgrad: 64 filters a tile)
  kConvTileSmall = 4,  // implicit GEMM, 128 x 64 tiles, two CTAs an SM (fprop and dgrad)
  kConvHalo = 5,       // the halo kernels (conv/halo_sm90.h): 64-channel 3x3 layers, 64-channel 1x1 ones
  kConvIm2col = 6,     // the im2col kernels (conv/im2col_sm90.h), 256 (or 128) x 128 tiles (fprop, unit-stride dgrad)
  kConvIm2colWide = 7, // the im2col kernels, 128 x 256 tiles
  kConvIm2colNarrow = 8,  // the im2col kernels, 256 x 64 tiles
};

// Whether `algorithm` lets the halo kernels take a problem they can: the heuristic's, or asked for.
inline bool AllowsHalo(int64_t algorithm) { return algorithm == kConvAuto || algorithm == kConvHalo; }

// The convolution's attributes as decoded from a target's attribute dictionary (by name).
struct ConvAttrs {
  int64_t in_d, in_h, in_w;
  int64_t out_d, out_h, out_w;
  int64_t window_d, window_h, window_w;
  int64_t stride_d, stride_h, stride_w;
  int64_t pad_d, pad_h, pad_w;  // low padding, may be negative
  int64_t lhs_dilation_d, lhs_dilation_h, lhs_dilation_w;
  int64_t rhs_dilation_d, rhs_dilation_h, rhs_dilation_w;
  int64_t groups;
  int64_t algorithm;  // a ConvAlgorithm
  int64_t tf32;       // 1: float32 forwards may run on the tensor cores as TF32
};

// The fused forward's attributes: the convolution's and its epilogue's.
struct ConvFusedAttrs {
  ConvAttrs conv;
  int64_t activation;
  float activation_param;
};

template <typename Binding>
auto BindConvFprop(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()  // x [N, D, H, W, C]
      .template Arg<xla::ffi::AnyBuffer>()  // w [T, U, V, Cg, K], x's dtype
      .template Ret<xla::ffi::AnyBuffer>()  // y [N, P, Q, R, K], x's dtype
      .template Ret<xla::ffi::AnyBuffer>()  // workspace
      .template Attrs<ConvAttrs>();
}

template <typename Binding>
auto BindConvFpropFused(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()          // x [N, D, H, W, C]
      .template Arg<xla::ffi::AnyBuffer>()          // w [T, U, V, Cg, K], x's dtype
      .template Arg<xla::ffi::AnyBuffer>()          // bias [K], x's dtype
      .template OptionalArg<xla::ffi::AnyBuffer>()  // residual [N, P, Q, R, K], x's dtype
      .template Ret<xla::ffi::AnyBuffer>()          // y [N, P, Q, R, K], x's dtype
      .template Ret<xla::ffi::AnyBuffer>()  // workspace
      .template Attrs<ConvFusedAttrs>();
}

template <typename Binding>
auto BindConvDgrad(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()  // dy [N, P, Q, R, K]
      .template Arg<xla::ffi::AnyBuffer>()  // w [T, U, V, Cg, K], dy's dtype
      .template Ret<xla::ffi::AnyBuffer>()  // dx [N, D, H, W, C], dy's dtype
      .template Ret<xla::ffi::AnyBuffer>()  // workspace
      .template Attrs<ConvAttrs>();
}

template <typename Binding>
auto BindConvWgrad(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()  // x [N, D, H, W, C]
      .template Arg<xla::ffi::AnyBuffer>()  // dy [N, P, Q, R, K], x's dtype
      .template Ret<xla::ffi::AnyBuffer>()  // dw [T, U, V, Cg, K], x's dtype or float32
      .template Ret<xla::ffi::AnyBuffer>()  // workspace
      .template Attrs<ConvAttrs>();
}

}  // namespace jaxdnn

// ConvAttrs' members by name, in order (also the first members of ConvFusedAttrs).
#define JAXDNN_CONV_ATTR_MEMBERS \
  StructMember<int64_t>("in_d"),  \
  StructMember<int64_t>("in_h"),  \
  StructMember<int64_t>("in_w"),  \
  StructMember<int64_t>("out_d"),  \
  StructMember<int64_t>("out_h"),  \
  StructMember<int64_t>("out_w"),  \
  StructMember<int64_t>("window_d"),  \
  StructMember<int64_t>("window_h"),  \
  StructMember<int64_t>("window_w"),  \
  StructMember<int64_t>("stride_d"),  \
  StructMember<int64_t>("stride_h"),  \
  StructMember<int64_t>("stride_w"),  \
  StructMember<int64_t>("pad_d"),  \
  StructMember<int64_t>("pad_h"),  \
  StructMember<int64_t>("pad_w"),  \
  StructMember<int64_t>("lhs_dilation_d"),  \
  StructMember<int64_t>("lhs_dilation_h"),  \
  StructMember<int64_t>("lhs_dilation_w"),  \
  StructMember<int64_t>("rhs_dilation_d"),  \
  StructMember<int64_t>("rhs_dilation_h"),  \
  StructMember<int64_t>("rhs_dilation_w"),  \
  StructMember<int64_t>("groups"),  \
  StructMember<int64_t>("algorithm"),  \
  StructMember<int64_t>("tf32")

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxdnn::ConvAttrs, JAXDNN_CONV_ATTR_MEMBERS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxdnn::ConvFusedAttrs, JAXDNN_CONV_ATTR_MEMBERS,
                                      StructMember<int64_t>("activation"),
                                      StructMember<float>("activation_param"));

XLA_FFI_DECLARE_HANDLER_SYMBOL(ConvFpropCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ConvFpropFusedCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ConvDgradCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ConvWgradCpu);

#ifdef JAXDNN_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(ConvFpropCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ConvFpropFusedCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ConvDgradCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ConvWgradCuda);
#endif
