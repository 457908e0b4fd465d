// Operand checks shared by the CPU and CUDA convolution handlers: the attributes and the three
// buffers' shapes become one ConvGeometry, or an InvalidArgument error.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "common/activation.h"
#include "common/ffi_common.h"
#include "conv/conv.h"
#include "conv/conv_geometry.h"

namespace jaxdnn {
namespace conv_internal {

inline ffi::Error ShapeError(const std::string& what, ffi::AnyBuffer::Dimensions x, ffi::AnyBuffer::Dimensions w,
                             ffi::AnyBuffer::Dimensions y) {
  return InvalidArgument("conv: " + what + " (x " + Dims(x) + ", w " + Dims(w) + ", y " + Dims(y) + ")");
}

}  // namespace conv_internal

// The geometry of x [N, D, H, W, C] convolved with w [T, U, V, Cg, K] into y [N, P, Q, R, K].
inline ffi::Error MakeConvGeometry(const ConvAttrs& attrs, ffi::AnyBuffer::Dimensions x,
                                   ffi::AnyBuffer::Dimensions w, ffi::AnyBuffer::Dimensions y,
                                   ConvGeometry* g) {
  using conv_internal::ShapeError;
  if (x.size() != 5 || w.size() != 5 || y.size() != 5) return ShapeError("every operand must have rank 5", x, w, y);
  const int64_t in[3] = {attrs.in_d, attrs.in_h, attrs.in_w};
  const int64_t out[3] = {attrs.out_d, attrs.out_h, attrs.out_w};
  const int64_t window[3] = {attrs.window_d, attrs.window_h, attrs.window_w};
  for (int a = 0; a < 3; ++a) {
    if (x[1 + a] != in[a] || y[1 + a] != out[a] || w[a] != window[a]) {
      return ShapeError("spatial axis " + std::to_string(a) + " differs from the attributes: in " +
                            std::to_string(in[a]) + ", out " + std::to_string(out[a]) + ", window " +
                            std::to_string(window[a]),
                        x, w, y);
    }
  }
  const int64_t stride[3] = {attrs.stride_d, attrs.stride_h, attrs.stride_w};
  const int64_t pad[3] = {attrs.pad_d, attrs.pad_h, attrs.pad_w};
  const int64_t lhs_dilation[3] = {attrs.lhs_dilation_d, attrs.lhs_dilation_h, attrs.lhs_dilation_w};
  const int64_t rhs_dilation[3] = {attrs.rhs_dilation_d, attrs.rhs_dilation_h, attrs.rhs_dilation_w};
  // Bounds that keep every coordinate the kernels form (o * stride + t * rhs_dilation + |pad|,
  // i * lhs_dilation + |pad|) far inside int64.
  constexpr int64_t kLimit = int64_t(1) << 30;
  for (int a = 0; a < 3; ++a) {
    const bool ok = stride[a] >= 1 && stride[a] <= kLimit && lhs_dilation[a] >= 1 && lhs_dilation[a] <= kLimit &&
                    rhs_dilation[a] >= 1 && rhs_dilation[a] <= kLimit && pad[a] >= -kLimit && pad[a] <= kLimit &&
                    x[1 + a] <= kLimit && y[1 + a] <= kLimit && w[a] >= 1 && w[a] <= kLimit;
    if (!ok) {
      return ShapeError("bad window on spatial axis " + std::to_string(a) + ": stride " + std::to_string(stride[a]) +
                            ", pad " + std::to_string(pad[a]) + ", lhs_dilation " + std::to_string(lhs_dilation[a]) +
                            ", rhs_dilation " + std::to_string(rhs_dilation[a]),
                        x, w, y);
    }
  }
  if (attrs.tf32 != 0 && attrs.tf32 != 1) return InvalidArgument("conv: tf32 must be 0 or 1");
  const int64_t groups = attrs.groups;
  if (groups < 1 || x[4] != groups * w[3] || w[4] % groups != 0) {
    return ShapeError("groups = " + std::to_string(groups) + " must divide K and C must be groups * Cg", x, w, y);
  }
  if (x[0] != y[0] || w[4] != y[4]) return ShapeError("x and y differ in N, or w and y in K", x, w, y);
  g->batch = x[0];
  g->channels = x[4];
  g->filters = w[4];
  g->groups = groups;
  for (int a = 0; a < 3; ++a) {
    g->in[a] = x[1 + a];
    g->out[a] = y[1 + a];
    g->window[a] = w[a];
    g->stride[a] = stride[a];
    g->pad[a] = pad[a];
    g->lhs_dilation[a] = lhs_dilation[a];
    g->rhs_dilation[a] = rhs_dilation[a];
  }
  return ffi::Error::Success();
}

// Every operand and result of a stage shares one dtype.
inline ffi::Error CheckSameDtype(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, const ffi::AnyBuffer& c) {
  if (a.element_type() != b.element_type() || a.element_type() != c.element_type()) {
    return InvalidArgument("conv: operands and result must share one dtype");
  }
  return ffi::Error::Success();
}

// wgrad's operands share one dtype; dw has it too, or is float32 when the operands are 16-bit (the
// sums before their rounding: jaxdnn/_conv_kernels.py's float32 wgrad as products of bfloat16 parts).
inline ffi::Error CheckWgradDtypes(const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy, const ffi::AnyBuffer& dw) {
  const bool sums = dw.element_type() == ffi::DataType::F32 &&
                    (x.element_type() == ffi::DataType::BF16 || x.element_type() == ffi::DataType::F16);
  if (x.element_type() != dy.element_type() || (dw.element_type() != x.element_type() && !sums)) {
    return InvalidArgument("conv wgrad: x and dy must share one dtype, dw must have it too or be float32 "
                           "for 16-bit operands");
  }
  return ffi::Error::Success();
}

// The fused forward's epilogue operands: bias [K] and an optional residual of y's shape, both in x's
// dtype, and a known activation.
inline ffi::Error CheckEpilogue(const ConvGeometry& g, const ffi::AnyBuffer& x, const ffi::AnyBuffer& bias,
                                const std::optional<ffi::AnyBuffer>& residual, const ffi::AnyBuffer& y,
                                int64_t activation) {
  JAXDNN_RETURN_IF_ERROR(ExpectElements("conv: bias", bias.dimensions(), g.filters));
  if (bias.element_type() != x.element_type()) return InvalidArgument("conv: bias must have x's dtype");
  if (residual.has_value()) {
    const auto dims = residual->dimensions(), y_dims = y.dimensions();
    bool same = dims.size() == y_dims.size();
    for (size_t i = 0; same && i < dims.size(); ++i) same = dims[i] == y_dims[i];
    if (!same || residual->element_type() != x.element_type()) {
      return InvalidArgument("conv: residual must have y's shape " + Dims(y_dims) +
                             " and x's dtype, got " + Dims(dims));
    }
  }
  if (activation < 0 || activation >= kNumActivations) {
    return InvalidArgument("conv: unknown activation " + std::to_string(activation));
  }
  return ffi::Error::Success();
}

}  // namespace jaxdnn
