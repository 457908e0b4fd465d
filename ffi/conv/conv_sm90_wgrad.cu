// The Hopper tensor-core convolution's gradient w.r.t. its filter (see conv_sm90.cuh).
#include "conv/conv_sm90.cuh"

namespace jaxdnn {

std::optional<ffi::Error> ConvSm90Wgrad(const ConvSm90Problem& p, ffi::DataType dtype, const void* x,
                                        const void* dy, float* partial, int slices, cudaStream_t stream) {
  return sm90::ForDtype(dtype, [&](auto element) {
    return sm90::Wgrad<decltype(element)>(p, x, dy, partial, slices, stream);
  });
}

}  // namespace jaxdnn
