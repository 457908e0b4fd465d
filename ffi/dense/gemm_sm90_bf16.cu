// The Hopper tensor-core GEMM for bfloat16 operands (see gemm_sm90.cuh).
#include "dense/gemm_sm90.cuh"

namespace jaxdnn {

ffi::Error GemmSm90Bf16(const GemmProblem& p, cudaStream_t stream) { return sm90::Dispatch<cutlass::bfloat16_t>(p, stream); }

}  // namespace jaxdnn
