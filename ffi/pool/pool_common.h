// Operand checks shared by the CPU and CUDA pooling handlers: the attributes and buffer shapes are
// turned into one PoolGeometry, or an InvalidArgument error.
#pragma once

#include <cstdint>
#include <string>

#include "common/ffi_common.h"
#include "pool/pool.h"
#include "pool/pool_window.h"

namespace jaxdnn {

// Largest window whose argmax offsets fit a uint8 argmax.
constexpr int64_t kMaxUint8Window = 256;

namespace pool_internal {

// Checks that `dims` is [..., s0, s1, s2, C] with the given spatial sizes, and reads N and C.
inline ffi::Error CheckShape(const char* name, ffi::AnyBuffer::Dimensions dims, const int64_t spatial[3],
                             int64_t* batch, int64_t* channels) {
  const size_t rank = dims.size();
  bool ok = rank >= 4;
  for (int a = 0; ok && a < 3; ++a) ok = dims[rank - 4 + a] == spatial[a];
  if (!ok) {
    return InvalidArgument(std::string("pool: ") + name + " has shape " + Dims(dims) + ", expected [..., " +
                           std::to_string(spatial[0]) + ", " + std::to_string(spatial[1]) + ", " +
                           std::to_string(spatial[2]) + ", C]");
  }
  *batch = 1;
  for (size_t i = 0; i + 4 < rank; ++i) *batch *= dims[i];
  *channels = dims[rank - 1];
  return ffi::Error::Success();
}

}  // namespace pool_internal

// The geometry of `input` [..., D, H, W, C] pooled into `output` [..., P, Q, R, C] by `attrs`.
inline ffi::Error MakePoolGeometry(const PoolAttrs& attrs, ffi::AnyBuffer::Dimensions input,
                                   ffi::AnyBuffer::Dimensions output, PoolGeometry* g) {
  const int64_t window[3] = {attrs.window_d, attrs.window_h, attrs.window_w};
  const int64_t stride[3] = {attrs.stride_d, attrs.stride_h, attrs.stride_w};
  const int64_t pad[3] = {attrs.pad_d, attrs.pad_h, attrs.pad_w};
  const int64_t in[3] = {attrs.in_d, attrs.in_h, attrs.in_w};
  const int64_t out[3] = {attrs.out_d, attrs.out_h, attrs.out_w};
  constexpr int64_t kIntMax = 0x7fffffff;
  for (int a = 0; a < 3; ++a) {
    // Every coordinate the kernels form (up to (out - 1) * stride + window, or in + pad) fits int.
    const bool ok = window[a] >= 1 && stride[a] >= 1 && pad[a] >= 0 && in[a] >= 0 && out[a] >= 0 &&
                    window[a] <= kIntMax && stride[a] <= kIntMax && pad[a] <= kIntMax &&
                    in[a] <= kIntMax - pad[a] && out[a] <= kIntMax &&
                    (out[a] == 0 || (out[a] - 1) <= (kIntMax - window[a]) / stride[a]);
    if (!ok) {
      return InvalidArgument("pool: bad window on spatial axis " + std::to_string(a) + ": window " +
                             std::to_string(window[a]) + ", stride " + std::to_string(stride[a]) + ", pad " +
                             std::to_string(pad[a]) + ", in " + std::to_string(in[a]) + ", out " +
                             std::to_string(out[a]));
    }
  }
  if (window[0] * window[1] > kIntMax || window[0] * window[1] * window[2] > kIntMax) return InvalidArgument("pool: window too large");
  int64_t in_batch = 0, in_channels = 0, out_batch = 0, out_channels = 0;
  JAXDNN_RETURN_IF_ERROR(pool_internal::CheckShape("input", input, in, &in_batch, &in_channels));
  JAXDNN_RETURN_IF_ERROR(pool_internal::CheckShape("output", output, out, &out_batch, &out_channels));
  if (input.size() != output.size() || in_batch != out_batch || in_channels != out_channels) {
    return InvalidArgument("pool: input " + Dims(input) + " and output " +
                           Dims(output) + " differ in their batch or channel axes");
  }
  g->batch = in_batch;
  g->channels = in_channels;
  for (int a = 0; a < 3; ++a) {
    g->in[a] = int(in[a]);
    g->out[a] = int(out[a]);
    g->window[a] = int(window[a]);
    g->stride[a] = int(stride[a]);
    g->pad[a] = int(pad[a]);
  }
  return ffi::Error::Success();
}

// Checks that the argmax buffer has the pooled output's shape and the dtype the window needs.
inline ffi::Error CheckArgmax(const ffi::AnyBuffer& argmax, ffi::AnyBuffer::Dimensions output,
                              const PoolGeometry& g) {
  const ffi::DataType expected = g.WindowVolume() <= kMaxUint8Window ? ffi::DataType::U8 : ffi::DataType::S32;
  const auto dims = argmax.dimensions();
  bool same = dims.size() == output.size();
  for (size_t i = 0; same && i < dims.size(); ++i) same = dims[i] == output[i];
  if (!same || argmax.element_type() != expected) {
    return InvalidArgument(std::string("pool: argmax must be ") +
                           (expected == ffi::DataType::U8 ? "uint8" : "int32") + " of shape " +
                           Dims(output) + ", got " + Dims(dims) + " of dtype " +
                           std::to_string(static_cast<int>(argmax.element_type())));
  }
  return ffi::Error::Success();
}

// dy/dx (or x/y) share one dtype.
inline ffi::Error CheckSameDtype(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  if (a.element_type() != b.element_type()) return InvalidArgument("pool: operand and result dtypes differ");
  return ffi::Error::Success();
}

}  // namespace jaxdnn
