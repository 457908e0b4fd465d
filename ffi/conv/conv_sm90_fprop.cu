// The Hopper tensor-core forward convolution (see conv_sm90.cuh).
#include "conv/conv_sm90.cuh"

namespace jaxdnn {

std::optional<ffi::Error> ConvSm90Fprop(const ConvSm90Problem& p, ffi::DataType dtype, const void* x,
                                        const void* w, const void* bias, const void* residual, int activation,
                                        float activation_param, void* y, cudaStream_t stream) {
  return sm90::ForDtype</*kTf32=*/true>(dtype, [&](auto element) {
    return sm90::Fprop<decltype(element)>(p, x, w, bias, residual, activation, activation_param, y, stream);
  });
}

}  // namespace jaxdnn
