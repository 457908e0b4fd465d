// Operand checks shared by the CPU and CUDA softmax handlers.
#pragma once

#include <initializer_list>

#include "common/ffi_common.h"

namespace jaxdnn {

// Every operand and result has the first one's shape and dtype; rank >= 1 and a non-empty last axis.
inline ffi::Error CheckSoftmax(std::initializer_list<const ffi::AnyBuffer*> buffers, RowsFeatures* shape) {
  const ffi::AnyBuffer& first = **buffers.begin();
  if (first.dimensions().size() == 0) return InvalidArgument("softmax: operands must have rank >= 1");
  *shape = AsRowsFeatures(first.dimensions());
  if (shape->features < 1) return InvalidArgument("softmax: the last axis must be non-empty");
  const int64_t n = ElementCount(first.dimensions());
  for (const ffi::AnyBuffer* b : buffers) {
    if (b->element_type() != first.element_type() || ElementCount(b->dimensions()) != n) {
      return InvalidArgument("softmax: operands and results must share one shape and dtype");
    }
  }
  return ffi::Error::Success();
}

}  // namespace jaxdnn
