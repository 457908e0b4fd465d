// Operand checks and per-element math shared by the CPU and CUDA batch norm handlers.
#pragma once

#include <initializer_list>
#include <optional>
#include <string>

#include "common/activation.h"
#include "common/ffi_common.h"

namespace jaxdnn {

// x as [outer, channels, inner] (see batch_norm.h).
struct ChannelShape {
  int64_t outer = 0;
  int64_t channels = 0;
  int64_t inner = 0;
  int64_t elements() const { return outer * channels * inner; }
  int64_t per_channel() const { return outer * inner; }
};

// What every stage's handler checks first: x is [O, C, I] (decoded into `shape`), every buffer in
// `full` (null for an absent optional one: a residual, g) has x's dtype and shape, every one in
// `per_channel` has C elements, and `act` names an activation.
inline ffi::Error CheckBatchNormStage(const ffi::AnyBuffer& x, std::initializer_list<const ffi::AnyBuffer*> full,
                                      std::initializer_list<ffi::AnyBuffer::Dimensions> per_channel, int64_t act,
                                      ChannelShape* shape) {
  auto dims = x.dimensions();
  if (dims.size() != 3) {
    return InvalidArgument("batch_norm: x must be [O, C, I], got rank " + std::to_string(dims.size()));
  }
  *shape = ChannelShape{dims[0], dims[1], dims[2]};
  if (act < 0 || act >= kNumActivations) {
    return InvalidArgument("batch_norm: unknown activation " + std::to_string(act));
  }
  for (const ffi::AnyBuffer* b : full) {
    if (b != nullptr &&
        (b->element_type() != x.element_type() || ElementCount(b->dimensions()) != shape->elements())) {
      return InvalidArgument("batch_norm: dy, residual and the results must have x's shape and dtype");
    }
  }
  for (auto channel_dims : per_channel) {
    JAXDNN_RETURN_IF_ERROR(ExpectElements("batch_norm: a per-channel operand", channel_dims, shape->channels));
  }
  return ffi::Error::Success();
}

// The optional residual operand, or null.
inline const ffi::AnyBuffer* OrNull(const std::optional<ffi::AnyBuffer>& buffer) {
  return buffer.has_value() ? &*buffer : nullptr;
}

// The optional residual's data, or null.
template <typename T>
const T* DataOrNull(const std::optional<ffi::AnyBuffer>& buffer) {
  return buffer.has_value() ? static_cast<const T*>(buffer->untyped_data()) : nullptr;
}

// The workspace [P, 2, C] of the sum stages; returns P (at least 1).
inline ffi::Error WorkspaceBlocks(ffi::AnyBuffer::Dimensions dims, const ChannelShape& shape, int64_t* blocks) {
  if (dims.size() != 3 || dims[0] < 1 || dims[1] != 2 || dims[2] != shape.channels) {
    return InvalidArgument("batch_norm: the workspace must be [P >= 1, 2, C]");
  }
  *blocks = dims[0];
  return ffi::Error::Success();
}

// The fused epilogue: y = act(a (x - mean) + bias + r). Centering first keeps the precision of x
// when the mean is large (a x + b would cancel).
JAXDNN_HOST_DEVICE inline float BatchNormOut(float x, float a, float mean, float bias, float r, int64_t act,
                                             float param) {
  return ActivateKind(act, a * (x - mean) + bias + r, param);
}

// The gradient reaching the normalized value: g = dy act'(pre-activation) (dy itself for identity).
JAXDNN_HOST_DEVICE inline float BatchNormGrad(float dy, float x, float a, float mean, float bias, float r,
                                              int64_t act, float param) {
  return act == 0 ? dy : dy * ActivateGradKind(act, a * (x - mean) + bias + r, param);
}

}  // namespace jaxdnn
