// The two CUDA driver functions CUTLASS's TMA descriptors need, for the whole library (built with
// CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL, so CUTLASS calls them by name). Without that, CUTLASS looks
// each one up with cudaGetDriverEntryPointByVersion on every descriptor it encodes: host time on every
// launch, which wgrad pays once per slice of the batch. Here the lookup is made once. The library does
// not link libcuda (it loads on machines without a driver, for the CPU kernels): the runtime finds
// the driver's functions. Hidden, so that nothing outside the library binds to these definitions.
#pragma GCC visibility push(hidden)
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

namespace {

template <class Function>
Function DriverFunction(const char* name) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &function, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<Function>(function);
}

}  // namespace

extern "C" {

CUresult cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address,
                                const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                                CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill fill) {
  static const auto function = DriverFunction<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled");
  if (function == nullptr) return CUDA_ERROR_NOT_FOUND;
  return function(map, type, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2, fill);
}

CUresult cuTensorMapEncodeIm2col(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address,
                                 const cuuint64_t* dims, const cuuint64_t* strides, const int* lower,
                                 const int* upper, cuuint32_t channels, cuuint32_t pixels,
                                 const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                                 CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill fill) {
  static const auto function = DriverFunction<PFN_cuTensorMapEncodeIm2col_v12000>("cuTensorMapEncodeIm2col");
  if (function == nullptr) return CUDA_ERROR_NOT_FOUND;
  return function(map, type, rank, address, dims, strides, lower, upper, channels, pixels, element_strides,
                  interleave, swizzle, l2, fill);
}

}  // extern "C"

#pragma GCC visibility pop
