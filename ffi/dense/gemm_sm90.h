// The GEMM problem as the CUDA handler hands it to a kernel, and the Hopper tensor-core entry points.
// Plain C++ (no CUTLASS): included by dense.cu and by the per-dtype tensor-core files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "common/ffi_common.h"

namespace jaxdnn {

// c[l] = act(op_a(a[l]) . op_b(b[l]) + bias) for l < batch; row-major buffers as in dense.h.
struct GemmProblem {
  const void* a;
  const void* b;
  const float* bias;  // nullptr: no bias
  void* c;
  int64_t batch, m, n, k;
  bool trans_a, trans_b;
  int activation;
  float activation_param;
  int64_t algorithm = 0;  // a GemmAlgorithm (dense.h): the tile configuration, 0 the heuristic
  bool tf32 = false;      // float32 operands may be rounded to TF32 (dense.h)
};

// Runs p on the Hopper tensor cores when they take it: bfloat16 or float16 operands, or float32 ones
// with p.tf32; at most one operand transposed; an sm_90 device, 16-byte aligned rows for TMA (the
// contiguous extent of a, b and c a multiple of 16 bytes), sizes within int32 and K > 0. Returns the
// launch's status, or nothing when p needs another kernel.
std::optional<ffi::Error> GemmOnTensorCores(const GemmProblem& p, ffi::DataType dtype, cudaStream_t stream);

// c = a^T . b of float32 operands a [L, K, M] and b [L, K, N] at TF32 (trans_a, not trans_b), on
// mma.sync, streaming the K rows through shared memory (gemm_streamed_tf32.cu); M and N multiples of
// 4. The heuristic takes it for products of at most kStreamedMaxOutputs sums a batch entry (dense.py
// mirrors both, and the tile choice, to split long K into batch entries).
constexpr int64_t kStreamedMaxOutputs = int64_t(1) << 17;
ffi::Error GemmStreamedTf32(const GemmProblem& p, cudaStream_t stream);
// Its tile's rows (64, 128 or 256; the columns 16384 / that): the shape that reads the least.
int StreamedTf32TileM(int64_t m, int64_t n);

// The warp-specialized TMA + wgmma kernels (CUTLASS), one per operand layout taken; bfloat16,
// float16, and float32 operands multiplied as TF32.
ffi::Error GemmSm90Bf16(const GemmProblem& p, cudaStream_t stream);
ffi::Error GemmSm90F16(const GemmProblem& p, cudaStream_t stream);
ffi::Error GemmSm90Tf32(const GemmProblem& p, cudaStream_t stream);

}  // namespace jaxdnn
