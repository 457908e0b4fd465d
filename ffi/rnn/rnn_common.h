// Operand checks shared by the CPU and CUDA recurrence handlers (see rnn.h for the shapes).
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>

#include "common/ffi_common.h"
#include "rnn/rnn_cell.h"  // RecurrenceShape

namespace jaxdnn {

// Reads B, T, D and H off a [B, T, D, width_per_unit * H] operand (the gates, or the saved residuals).
inline ffi::Error DecodeRecurrenceShape(ffi::AnyBuffer::Dimensions dims, int64_t width_per_unit,
                                        int64_t gates_per_unit, RecurrenceShape* shape) {
  if (dims.size() != 4 || dims[3] % width_per_unit != 0 || dims[2] < 1 || dims[2] > 2) {
    return InvalidArgument("rnn: the gates operand must be [B, T, D, " + std::to_string(width_per_unit) +
                           "H] with D 1 or 2");
  }
  *shape = RecurrenceShape{dims[0], dims[1], dims[2], dims[3] / width_per_unit, gates_per_unit};
  return ffi::Error::Success();
}

inline ffi::Error ExpectShape(const char* name, ffi::AnyBuffer::Dimensions dims,
                              std::initializer_list<int64_t> expected) {
  bool same = dims.size() == expected.size();
  size_t i = 0;
  for (int64_t e : expected) same = same && dims[i++] == e;
  if (!same) {
    std::string want;
    for (int64_t e : expected) want += (want.empty() ? "" : ", ") + std::to_string(e);
    return InvalidArgument(std::string("rnn: ") + name + " must have shape [" + want + "]");
  }
  return ffi::Error::Success();
}

// Checks w_hh [D, G, H], the per-row states [B, D, H] and seq_lengths [B].
inline ffi::Error CheckRecurrenceOperands(const RecurrenceShape& s, const ffi::AnyBuffer& w_hh,
                                          std::initializer_list<ffi::AnyBuffer::Dimensions> states,
                                          ffi::AnyBuffer::Dimensions seq_lengths) {
  JAXDNN_RETURN_IF_ERROR(ExpectShape("w_hh", w_hh.dimensions(), {s.directions, s.gates(), s.hidden}));
  for (auto dims : states) {
    JAXDNN_RETURN_IF_ERROR(ExpectShape("a state operand", dims, {s.batch, s.directions, s.hidden}));
  }
  return ExpectShape("seq_lengths", seq_lengths, {s.batch});
}

// Checks per-step operands and results [B, T, D, width_per_unit * H].
inline ffi::Error CheckSequences(const RecurrenceShape& s, int64_t width_per_unit,
                                 std::initializer_list<ffi::AnyBuffer::Dimensions> sequences) {
  for (auto dims : sequences) {
    JAXDNN_RETURN_IF_ERROR(ExpectShape("a per-step operand", dims,
                                       {s.batch, s.steps, s.directions, width_per_unit * s.hidden}));
  }
  return ffi::Error::Success();
}

// The plain RNN's `nonlinearity` attribute: "tanh" -> Activation::kTanh, "relu" -> kRelu.
inline ffi::Error DecodeNonlinearity(std::string_view name, Activation* act) {
  if (name == "tanh") {
    *act = Activation::kTanh;
  } else if (name == "relu") {
    *act = Activation::kRelu;
  } else {
    return InvalidArgument("rnn: nonlinearity must be \"tanh\" or \"relu\", got \"" + std::string(name) + "\"");
  }
  return ffi::Error::Success();
}

}  // namespace jaxdnn
