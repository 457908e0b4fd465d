// The Hopper tensor-core GEMM for float16 operands (see gemm_sm90.cuh).
#include "dense/gemm_sm90.cuh"

namespace jaxdnn {

ffi::Error GemmSm90F16(const GemmProblem& p, cudaStream_t stream) { return sm90::Dispatch<cutlass::half_t>(p, stream); }

}  // namespace jaxdnn
