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

}  // namespace jaxdnn
