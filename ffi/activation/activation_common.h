// Operand checks shared by the CPU and CUDA activation handlers.
#pragma once

#include <initializer_list>
#include <string>

#include "common/activation.h"
#include "common/ffi_common.h"

namespace jaxdnn {

// Every buffer has the first one's element count and dtype, and `kind` names an activation.
inline ffi::Error CheckActivation(std::initializer_list<const ffi::AnyBuffer*> buffers, int64_t kind,
                                  int64_t* elements) {
  if (kind < 0 || kind >= kNumActivations) {
    return InvalidArgument("activation: unknown kind " + std::to_string(kind));
  }
  const ffi::AnyBuffer& first = **buffers.begin();
  *elements = ElementCount(first.dimensions());
  for (const ffi::AnyBuffer* b : buffers) {
    if (b->element_type() != first.element_type() || ElementCount(b->dimensions()) != *elements) {
      return InvalidArgument("activation: operands and results must share one shape and dtype");
    }
  }
  return ffi::Error::Success();
}

// The backward with the bias gradient: dy, x and dx as CheckActivation's, rank >= 1 with C the
// last axis; partials [P >= 1, C].
inline ffi::Error CheckActivationBias(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x, const ffi::AnyBuffer& dx,
                                      ffi::Buffer<ffi::F32> partials, int64_t kind, RowsFeatures* shape,
                                      int64_t* chunks) {
  int64_t n = 0;
  JAXDNN_RETURN_IF_ERROR(CheckActivation({&dy, &x, &dx}, kind, &n));
  if (dy.dimensions().size() == 0 || x.dimensions().size() == 0) {
    return InvalidArgument("activation: the bias gradient needs operands of rank >= 1");
  }
  *shape = AsRowsFeatures(x.dimensions());
  const auto dims = partials.dimensions();
  if (dims.size() != 2 || dims[0] < 1 || dims[1] != shape->features ||
      AsRowsFeatures(dy.dimensions()).features != shape->features) {
    return InvalidArgument("activation: partials must be [P >= 1, C] for operands [..., C], got " + Dims(dims) +
                           " for " + Dims(x.dimensions()));
  }
  *chunks = dims[0];
  return ffi::Error::Success();
}

}  // namespace jaxdnn
