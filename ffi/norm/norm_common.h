// Operand checks shared by the CPU and CUDA norm handlers.
#pragma once

#include <initializer_list>
#include <string>
#include <utility>

#include "common/activation.h"
#include "common/ffi_common.h"

namespace jaxdnn {

// The fused activation of layer_norm(..., activation=): y = act(xhat * scale + bias). Kind 0
// (identity) for RMSNorm and a plain LayerNorm, which then never read bias in the backward.
struct NormActivation {
  int64_t kind = 0;  // an Activation of common/activation.h
  float param = 0.f;
};

inline ffi::Error CheckNormActivation(NormActivation act) {
  if (act.kind < 0 || act.kind >= kNumActivations) {
    return InvalidArgument("layer_norm: unknown activation " + std::to_string(act.kind));
  }
  return ffi::Error::Success();
}

// x must have rank >= 1 and a non-empty feature axis; every per-feature operand (scale, bias,
// dscale, dbias) must hold D elements and every per-row one (mean, rstd) R elements.
inline ffi::Error CheckNormShapes(
    ffi::AnyBuffer::Dimensions x_dims, RowsFeatures* shape,
    std::initializer_list<std::pair<const char*, ffi::AnyBuffer::Dimensions>> per_feature,
    std::initializer_list<std::pair<const char*, ffi::AnyBuffer::Dimensions>> per_row) {
  if (x_dims.size() == 0) return InvalidArgument("norm: x must have rank >= 1");
  *shape = AsRowsFeatures(x_dims);
  if (shape->features < 1) return InvalidArgument("norm: x's last axis must be non-empty");
  for (const auto& [name, dims] : per_feature) {
    JAXDNN_RETURN_IF_ERROR(ExpectElements(name, dims, shape->features));
  }
  for (const auto& [name, dims] : per_row) {
    JAXDNN_RETURN_IF_ERROR(ExpectElements(name, dims, shape->rows));
  }
  return ffi::Error::Success();
}

// The workspace is [P, S, D]: P partial blocks of S sums (dscale, and dbias for LayerNorm).
inline ffi::Error CheckNormWorkspace(ffi::AnyBuffer::Dimensions dims, int64_t sums, int64_t features,
                                     int64_t* partials) {
  if (dims.size() != 3 || dims[0] < 1 || dims[1] != sums || dims[2] != features) {
    return InvalidArgument("norm: workspace must have shape [P >= 1, " + std::to_string(sums) + ", " +
                           std::to_string(features) + "]");
  }
  *partials = dims[0];
  return ffi::Error::Success();
}

// Everything the forward handlers decode (bias and mean are null for RMSNorm).
inline ffi::Error CheckNormFwd(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& scale,
                               const ffi::Buffer<ffi::F32>* bias, const ffi::AnyBuffer& y,
                               ffi::Result<ffi::Buffer<ffi::F32>>* mean,
                               const ffi::Buffer<ffi::F32>& rstd, RowsFeatures* shape) {
  JAXDNN_RETURN_IF_ERROR(CheckNormShapes(x.dimensions(), shape, {{"scale", scale.dimensions()}},
                                         {{"rstd", rstd.dimensions()}}));
  if (bias != nullptr) {
    JAXDNN_RETURN_IF_ERROR(ExpectElements("bias", bias->dimensions(), shape->features));
  }
  if (mean != nullptr) {
    JAXDNN_RETURN_IF_ERROR(ExpectElements("mean", (*mean)->dimensions(), shape->rows));
  }
  if (y.element_type() != x.element_type() || ElementCount(y.dimensions()) != ElementCount(x.dimensions())) {
    return InvalidArgument("norm: y must have x's shape and dtype");
  }
  return ffi::Error::Success();
}

// Everything the backward handlers decode (mean and dbias are null for RMSNorm).
inline ffi::Error CheckNormBwd(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                               const ffi::Buffer<ffi::F32>& scale, const ffi::Buffer<ffi::F32>* mean,
                               const ffi::Buffer<ffi::F32>& rstd, const ffi::AnyBuffer& dx,
                               const ffi::Buffer<ffi::F32>& dscale,
                               ffi::Result<ffi::Buffer<ffi::F32>>* dbias,
                               const ffi::Buffer<ffi::F32>& workspace, RowsFeatures* shape,
                               int64_t* partials) {
  JAXDNN_RETURN_IF_ERROR(CheckNormShapes(
      x.dimensions(), shape, {{"scale", scale.dimensions()}, {"dscale", dscale.dimensions()}},
      {{"rstd", rstd.dimensions()}}));
  if (mean != nullptr) {
    JAXDNN_RETURN_IF_ERROR(ExpectElements("mean", mean->dimensions(), shape->rows));
  }
  if (dbias != nullptr) {
    JAXDNN_RETURN_IF_ERROR(ExpectElements("dbias", (*dbias)->dimensions(), shape->features));
  }
  JAXDNN_RETURN_IF_ERROR(
      CheckNormWorkspace(workspace.dimensions(), dbias ? 2 : 1, shape->features, partials));
  const int64_t n = ElementCount(x.dimensions());
  if (dy.element_type() != x.element_type() || dx.element_type() != x.element_type() ||
      ElementCount(dy.dimensions()) != n || ElementCount(dx.dimensions()) != n) {
    return InvalidArgument("norm: dy and dx must have x's shape and dtype");
  }
  return ffi::Error::Success();
}

}  // namespace jaxdnn
