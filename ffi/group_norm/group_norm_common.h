// Shared by the CPU and CUDA group norm handlers: the shape they decode, operand checks, and the
// per-group arithmetic both kernels must agree on.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "common/activation.h"
#include "common/ffi_common.h"
#if defined(__CUDACC__)
#include "common/cuda_common.cuh"
#endif

namespace jaxdnn {

// x seen as [N, S, C] with C = G * K channels, and the P chunks each sample's S positions are split
// into (the workspace's second axis).
struct GroupNormShape {
  int64_t batch = 0;       // N
  int64_t spatial = 0;     // S
  int64_t channels = 0;    // C
  int64_t groups = 0;      // G
  int64_t group_size = 0;  // K = C / G
  int64_t chunks = 0;      // P
};

// Positions [ChunkBegin(p), ChunkBegin(p + 1)) of a sample belong to chunk p (some may be empty).
JAXDNN_HOST_DEVICE inline int64_t ChunkBegin(const GroupNormShape& shape, int64_t chunk) {
  return shape.spatial * chunk / shape.chunks;
}

// A group's statistics from its shifted sums over `count` = S * K elements, sum(x - shift) and
// sum((x - shift)^2): with the shift a value of the group (its first element), E[(x - shift)^2] -
// E[x - shift]^2 does not cancel catastrophically the way E[x^2] - E[x]^2 does for data far from 0.
JAXDNN_HOST_DEVICE inline void GroupMoments(float shifted_sum, float shifted_squares, float shift,
                                            int64_t count, float epsilon, float* mean, float* rstd) {
  if (count == 0) {  // no positions: y is empty; report the statistics of zeros
    *mean = 0.f;
    *rstd = 1.f / sqrtf(epsilon);
    return;
  }
  const float m = shifted_sum / float(count);
  const float var = fmaxf(shifted_squares / float(count) - m * m, 0.f);
  *mean = shift + m;
  *rstd = 1.f / sqrtf(var + epsilon);
}

inline ffi::Error CheckGroupNormX(ffi::AnyBuffer::Dimensions x, int64_t num_groups,
                                  GroupNormShape* shape) {
  if (x.size() != 3) return InvalidArgument("group_norm: x must have shape [N, S, C]");
  shape->batch = x[0];
  shape->spatial = x[1];
  shape->channels = x[2];
  if (shape->channels < 1) return InvalidArgument("group_norm: x's channel axis must be non-empty");
  if (num_groups < 1 || shape->channels % num_groups != 0) {
    return InvalidArgument("group_norm: num_groups (" + std::to_string(num_groups) +
                           ") must be >= 1 and divide the channels (" +
                           std::to_string(shape->channels) + ")");
  }
  shape->groups = num_groups;
  shape->group_size = shape->channels / num_groups;
  return ffi::Error::Success();
}

// The workspace is [N, P, 2, C]; P >= 1 is read off it.
inline ffi::Error CheckGroupNormWorkspace(ffi::AnyBuffer::Dimensions dims, GroupNormShape* shape) {
  if (dims.size() != 4 || dims[0] != shape->batch || dims[1] < 1 || dims[2] != 2 ||
      dims[3] != shape->channels) {
    return InvalidArgument("group_norm: workspace must have shape [N, P >= 1, 2, C]");
  }
  shape->chunks = dims[1];
  return ffi::Error::Success();
}

// scale and bias (and dscale and dbias, which take their dtype) are float32 or x's dtype, both the
// same: the kernels read them as float, so 16-bit parameters need no conversion pass in XLA.
inline ffi::Error CheckParams(const ffi::AnyBuffer& x, const ffi::AnyBuffer& scale, const ffi::AnyBuffer& bias,
                              int64_t channels) {
  JAXDNN_RETURN_IF_ERROR(ExpectElements("scale", scale.dimensions(), channels));
  JAXDNN_RETURN_IF_ERROR(ExpectElements("bias", bias.dimensions(), channels));
  if (scale.element_type() != bias.element_type() ||
      (scale.element_type() != ffi::DataType::F32 && scale.element_type() != x.element_type())) {
    return InvalidArgument("group_norm: scale and bias must both be float32 or both x's dtype");
  }
  return ffi::Error::Success();
}

#if defined(__CUDACC__)
// A per-channel parameter (scale or bias) in float32 or in x's dtype T, read as float.
template <typename T>
struct Param {
  const void* data;
  bool f32;

  __device__ __forceinline__ float operator[](int64_t c) const {
    return f32 ? static_cast<const float*>(data)[c] : ToFloat(static_cast<const T*>(data)[c]);
  }
  // The parameter from channel c0 on.
  __host__ __device__ __forceinline__ Param From(int64_t c0) const {
    return {f32 ? static_cast<const void*>(static_cast<const float*>(data) + c0)
                : static_cast<const void*>(static_cast<const T*>(data) + c0),
            f32};
  }
};

template <typename T>
Param<T> ParamOf(const ffi::AnyBuffer& buffer) {
  return {buffer.untyped_data(), buffer.element_type() == ffi::DataType::F32};
}
#endif

inline ffi::Error CheckActivationKind(int64_t kind) {
  if (kind < 0 || kind >= kNumActivations) {
    return InvalidArgument("group_norm: unknown activation " + std::to_string(kind));
  }
  return ffi::Error::Success();
}

// Everything the forward handlers decode.
inline ffi::Error CheckGroupNormFwd(const ffi::AnyBuffer& x, const ffi::AnyBuffer& scale,
                                    const ffi::AnyBuffer& bias, const ffi::AnyBuffer& y,
                                    const ffi::Buffer<ffi::F32>& mean,
                                    const ffi::Buffer<ffi::F32>& rstd,
                                    const ffi::Buffer<ffi::F32>& workspace, int64_t num_groups,
                                    int64_t activation, GroupNormShape* shape) {
  JAXDNN_RETURN_IF_ERROR(CheckGroupNormX(x.dimensions(), num_groups, shape));
  JAXDNN_RETURN_IF_ERROR(CheckGroupNormWorkspace(workspace.dimensions(), shape));
  JAXDNN_RETURN_IF_ERROR(CheckActivationKind(activation));
  JAXDNN_RETURN_IF_ERROR(CheckParams(x, scale, bias, shape->channels));
  JAXDNN_RETURN_IF_ERROR(ExpectElements("mean", mean.dimensions(), shape->batch * shape->groups));
  JAXDNN_RETURN_IF_ERROR(ExpectElements("rstd", rstd.dimensions(), shape->batch * shape->groups));
  if (y.element_type() != x.element_type() || ElementCount(y.dimensions()) != ElementCount(x.dimensions())) {
    return InvalidArgument("group_norm: y must have x's shape and dtype");
  }
  return ffi::Error::Success();
}

// Everything the backward handlers decode.
inline ffi::Error CheckGroupNormBwd(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                    const ffi::AnyBuffer& scale, const ffi::AnyBuffer& bias,
                                    const ffi::Buffer<ffi::F32>& mean,
                                    const ffi::Buffer<ffi::F32>& rstd, const ffi::AnyBuffer& dx,
                                    const ffi::AnyBuffer& dscale, const ffi::AnyBuffer& dbias,
                                    const ffi::Buffer<ffi::F32>& workspace,
                                    const ffi::Buffer<ffi::F32>& group_sums, int64_t num_groups,
                                    int64_t activation, GroupNormShape* shape) {
  JAXDNN_RETURN_IF_ERROR(CheckGroupNormX(x.dimensions(), num_groups, shape));
  JAXDNN_RETURN_IF_ERROR(CheckGroupNormWorkspace(workspace.dimensions(), shape));
  JAXDNN_RETURN_IF_ERROR(CheckActivationKind(activation));
  JAXDNN_RETURN_IF_ERROR(CheckParams(x, scale, bias, shape->channels));
  JAXDNN_RETURN_IF_ERROR(ExpectElements("dscale", dscale.dimensions(), shape->channels));
  JAXDNN_RETURN_IF_ERROR(ExpectElements("dbias", dbias.dimensions(), shape->channels));
  if (dscale.element_type() != scale.element_type() || dbias.element_type() != scale.element_type()) {
    return InvalidArgument("group_norm: dscale and dbias must have scale's dtype");
  }
  const int64_t stats = shape->batch * shape->groups;
  JAXDNN_RETURN_IF_ERROR(ExpectElements("mean", mean.dimensions(), stats));
  JAXDNN_RETURN_IF_ERROR(ExpectElements("rstd", rstd.dimensions(), stats));
  JAXDNN_RETURN_IF_ERROR(ExpectElements("group_sums", group_sums.dimensions(), 2 * stats));
  const int64_t n = ElementCount(x.dimensions());
  if (dy.element_type() != x.element_type() || dx.element_type() != x.element_type() ||
      ElementCount(dy.dimensions()) != n || ElementCount(dx.dimensions()) != n) {
    return InvalidArgument("group_norm: dy and dx must have x's shape and dtype");
  }
  return ffi::Error::Success();
}

}  // namespace jaxdnn
