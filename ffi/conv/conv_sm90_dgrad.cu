// The Hopper tensor-core convolution's gradient w.r.t. its input (see conv_sm90.cuh).
#include "conv/conv_sm90.cuh"

namespace jaxdnn {

std::optional<ffi::Error> ConvSm90Dgrad(const ConvSm90Problem& p, ffi::DataType dtype, const void* dy,
                                        const void* w, void* dx, cudaStream_t stream) {
  return sm90::ForDtype(dtype, [&](auto element) { return sm90::Dgrad<decltype(element)>(p, dy, w, dx, stream); });
}

}  // namespace jaxdnn
