// Shared by every family's FFI handlers (CPU and CUDA): shape decoding and error helpers.
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxdnn {

namespace ffi = xla::ffi;

inline ffi::Error InvalidArgument(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxdnn: " + message);
}

// A shape as text for error messages: "[2,3,4]".
inline std::string Dims(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? "," : "") + std::to_string(dims[i]);
  return s + "]";
}

// A tensor seen as rows x features: features is the last axis, rows every leading axis folded
// together (1 for a rank-1 tensor, 0 when a leading axis is empty).
struct RowsFeatures {
  int64_t rows = 0;
  int64_t features = 0;
};

inline RowsFeatures AsRowsFeatures(ffi::AnyBuffer::Dimensions dims) {
  RowsFeatures shape;
  if (dims.size() == 0) return shape;
  shape.features = dims.back();
  shape.rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) shape.rows *= dims[i];
  return shape;
}

inline int64_t ElementCount(ffi::AnyBuffer::Dimensions dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

// Checks that a buffer holds exactly `expected` elements (used for per-row and per-feature operands).
inline ffi::Error ExpectElements(const char* name, ffi::AnyBuffer::Dimensions dims, int64_t expected) {
  int64_t n = ElementCount(dims);
  if (n != expected) {
    return InvalidArgument(std::string(name) + " has " + std::to_string(n) + " elements, expected " +
                           std::to_string(expected));
  }
  return ffi::Error::Success();
}

// Calls fn(T{}) with the storage type of `dtype` (float32, bfloat16, float16): the CPU and CUDA
// code name their own 16-bit types, so they pass them in.
template <typename F32, typename BF16, typename F16, typename Fn>
ffi::Error DispatchFloat(ffi::DataType dtype, const char* name, Fn&& fn) {
  switch (dtype) {
    case ffi::DataType::F32: return fn(F32{});
    case ffi::DataType::BF16: return fn(BF16{});
    case ffi::DataType::F16: return fn(F16{});
    default:
      return InvalidArgument(std::string(name) + " must be float32, bfloat16 or float16, got dtype " +
                             std::to_string(static_cast<int>(dtype)));
  }
}

}  // namespace jaxdnn

// Returns the ffi::Error of `expr` from the enclosing handler when it is not success.
#define JAXDNN_RETURN_IF_ERROR(expr)              \
  do {                                            \
    ::xla::ffi::Error jaxdnn_error_ = (expr);     \
    if (jaxdnn_error_.failure()) return jaxdnn_error_; \
  } while (0)
