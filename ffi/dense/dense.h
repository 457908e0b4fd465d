// Matrix multiply with a fused epilogue, batched: the GEMM core of jaxdnn.dense (and of its
// gradients). For every batch entry l < L:
//   c[l] = act(op_a(a[l]) . op_b(b[l]) + bias)              float32 accumulation
// Shapes (the Python side folds leading axes and broadcasts shared operands, so L is every operand's):
//   a     [L, M, K], or [L, K, M] when trans_a (op_a transposes it back)
//   b     [L, K, N], or [L, N, K] when trans_b
//   bias  [N] float32, or [0] for no bias
//   c     [L, M, N], a's dtype (b must have it too): float32, bfloat16 or float16
// Target (versioned: the ABI of exported programs):
//   jaxdnn_gemm_v3  (a, b, bias) -> (c)
//   attributes: trans_a, trans_b (int64, 0 or 1); activation (int64, the Activation enum of
//   common/activation.h); activation_param (float32, leaky_relu's slope or elu's alpha); algorithm
//   (int64, a GemmAlgorithm); tf32 (int64, 0 or 1: float32 operands may be rounded to TF32 on
//   tensor cores, as XLA's float32 dots at JAX's default precision; 0 keeps exact float32 products,
//   and the CPU kernel's are always exact).
#pragma once

#include <cstdint>
#include <utility>

#include "common/ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace jaxdnn {

// The tensor-core GEMM's tile configuration (the `algorithm` attribute, ffi/dense/gemm_sm90.cuh),
// chosen by jaxdnn/_autotune.py when autotuning is on: kGemmAuto is the heuristic; the others ask for
// one configuration (each takes every problem the tensor cores take). The CPU kernel ignores it.
enum GemmAlgorithm : int64_t {
  kGemmAuto = 0,
  kGemmLarge = 1,   // 128 x 256 tiles in clusters of 2
  kGemmSmall = 2,   // 128 x 128
  kGemmNarrow = 3,  // 128 x 64
  kGemmStreamed = 4,  // float32 a^T . b at TF32 only: mma.sync, K rows streamed (gemm_sm90.h)
};

struct GemmAttrs {
  int64_t trans_a, trans_b;
  int64_t activation;
  float activation_param;
  int64_t algorithm;  // a GemmAlgorithm
  int64_t tf32;       // 0 or 1
};

// The problem's sizes, read from the buffers.
struct GemmShape {
  int64_t batch, m, n, k;
};

template <typename Binding>
auto BindGemm(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()         // a [L, M, K] or [L, K, M]
      .template Arg<xla::ffi::AnyBuffer>()         // b [L, K, N] or [L, N, K], a's dtype
      .template Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // bias [N] or [0]
      .template Ret<xla::ffi::AnyBuffer>()         // c [L, M, N], a's dtype
      .template Attrs<GemmAttrs>();
}

// Checks the operands against each other and returns the sizes: rank 3, one batch size, one dtype,
// K shared by a and b, c [L, M, N], bias [N] or [0], a known activation, trans_* and tf32 0 or 1.
xla::ffi::Error CheckGemm(xla::ffi::AnyBuffer a, xla::ffi::AnyBuffer b, xla::ffi::Buffer<xla::ffi::F32> bias,
                          const xla::ffi::AnyBuffer& c, const GemmAttrs& attrs, GemmShape* shape);

}  // namespace jaxdnn

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxdnn::GemmAttrs, StructMember<int64_t>("trans_a"),
                                      StructMember<int64_t>("trans_b"), StructMember<int64_t>("activation"),
                                      StructMember<float>("activation_param"),
                                      StructMember<int64_t>("algorithm"), StructMember<int64_t>("tf32"));

XLA_FFI_DECLARE_HANDLER_SYMBOL(GemmCpu);

#ifdef JAXDNN_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(GemmCuda);
#endif
