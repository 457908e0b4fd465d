// The Hopper tensor-core GEMM for float32 operands multiplied as TF32 (see gemm_sm90.cuh).
#include "dense/gemm_sm90.cuh"

namespace jaxdnn {

ffi::Error GemmSm90Tf32(const GemmProblem& p, cudaStream_t stream) { return sm90::Dispatch<float>(p, stream); }

}  // namespace jaxdnn
