// The Hopper (sm_90a) flash-attention kernels: wgmma on tiles loaded by TMA, for 16-bit q, k, v
// (attention_sm90_fwd.cu, attention_sm90_bwd.cu). attention.cu calls them when Sm90Takes says so
// and runs its CUDA-core kernels otherwise (float32, other devices).
#pragma once

#include <cuda_runtime.h>

#include "attention/attention_problem.h"
#include "common/ffi_common.h"

namespace jaxdnn {
namespace attention_sm90 {

// Whether the tensor-core kernels take this problem: bfloat16 or float16 on a compute-capability-9
// device, H a multiple of 8 up to 256, and at least one query and one key.
bool Sm90Takes(const AttentionProblem& p, ffi::DataType dtype);

// o and lse as AttentionFwdKernel's (attention.cu); every element written.
ffi::Error AttentionFwdSm90(cudaStream_t stream, const AttentionProblem& p, ffi::DataType dtype, const void* q,
                            const void* k, const void* v, void* o, float* lse);

// Whether the backward of this problem may run the fused kernel, which needs the workspaces of
// jaxdnn_attention_bwd_v3: dq_accum (float32, q's shape) and semaphores, FusedBackwardSemaphores
// int32 that order the kernel's adds to dq_accum (deterministic), or none (unordered adds: dq's
// bits may differ between runs). The separate kernels (head sizes up to 64 and 256, decoding shapes)
// need neither.
bool FusedBackwardTakes(const AttentionProblem& p);
int64_t FusedBackwardSemaphores(const AttentionProblem& p);

// dq, dk, dv (and dbias when not null: the elements of attended pairs; the caller zeroes it first)
// from delta = rowsum(do o) already in `delta`; dq_accum and semaphores (null: unordered adds) as
// FusedBackwardTakes says.
ffi::Error AttentionBwdSm90(cudaStream_t stream, const AttentionProblem& p, ffi::DataType dtype, const void* d_out,
                            const void* q, const void* k, const void* v, const float* lse, const float* delta,
                            void* dq, void* dk, void* dv, float* dbias, float* dq_accum, int* semaphores);

}  // namespace attention_sm90
}  // namespace jaxdnn
