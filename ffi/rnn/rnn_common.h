// Operand checks shared by the CPU and CUDA LSTM handlers (see rnn.h for the shapes).
#pragma once

#include <initializer_list>
#include <string>

#include "common/ffi_common.h"
#include "rnn/lstm_cell.h"  // RecurrenceShape

namespace jaxdnn {

// Reads B, T and G = 4H off a [B, T, G] operand (gates_x in the forward, acts in the backward).
inline ffi::Error DecodeRecurrenceShape(ffi::AnyBuffer::Dimensions dims, RecurrenceShape* shape) {
  if (dims.size() != 3 || dims[2] % 4 != 0) {
    return InvalidArgument("lstm: the gates operand must be [B, T, 4H]");
  }
  *shape = RecurrenceShape{dims[0], dims[1], dims[2] / 4};
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
    return InvalidArgument(std::string("lstm: ") + name + " must have shape [" + want + "]");
  }
  return ffi::Error::Success();
}

// Checks w_hh [G, H] (a float type), the per-row operands [B, H] and seq_lengths [B].
inline ffi::Error CheckRecurrenceOperands(const RecurrenceShape& s, const ffi::AnyBuffer& w_hh,
                                          std::initializer_list<ffi::AnyBuffer::Dimensions> states,
                                          ffi::AnyBuffer::Dimensions seq_lengths) {
  JAXDNN_RETURN_IF_ERROR(ExpectShape("w_hh", w_hh.dimensions(), {s.gates(), s.hidden}));
  for (auto dims : states) JAXDNN_RETURN_IF_ERROR(ExpectShape("a state operand", dims, {s.batch, s.hidden}));
  return ExpectShape("seq_lengths", seq_lengths, {s.batch});
}

// Checks the per-step operands and results: per_unit ones are [B, T, H], per_gate ones [B, T, G].
inline ffi::Error CheckSequences(const RecurrenceShape& s, std::initializer_list<ffi::AnyBuffer::Dimensions> per_unit,
                                 std::initializer_list<ffi::AnyBuffer::Dimensions> per_gate) {
  for (auto dims : per_unit) JAXDNN_RETURN_IF_ERROR(ExpectShape("a per-step operand", dims, {s.batch, s.steps, s.hidden}));
  for (auto dims : per_gate) JAXDNN_RETURN_IF_ERROR(ExpectShape("a per-step gates operand", dims, {s.batch, s.steps, s.gates()}));
  return ffi::Error::Success();
}

}  // namespace jaxdnn
