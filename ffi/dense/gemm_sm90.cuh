// Hopper tensor-core GEMM built from CUTLASS's collectives: TMA loads into a shared-memory pipeline,
// wgmma in two consumer warp groups fed by a producer warp (warp-specialized, persistent), and an
// epilogue that adds the bias and applies the activation before a TMA store. Included by one file
// per dtype (gemm_sm90_bf16.cu, gemm_sm90_f16.cu, gemm_sm90_tf32.cu) so they compile in parallel.
// Must be compiled with NDEBUG (CMake's Release build): CUTLASS's device asserts are calls, and a
// call between wgmma instructions makes ptxas serialize them (warning C7510).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <climits>
#include <string>

#include "common/cuda_common.cuh"
#include "common/sm90_activation.cuh"
#include "dense/dense.h"
#include "dense/gemm_sm90.h"

namespace jaxdnn {
namespace sm90 {

// Tile configurations: the CTA tile (M x N x K per pipeline stage), the thread-block cluster (CTAs
// that share each TMA load by multicast) and the schedule (cooperative: the two consumer warp groups
// split one tile). At 8192^3 (bf16, H200, constant inputs in a standalone probe) the large tile ran
// at 1.22 ms, the small one at 1.95 ms and a 64x256 ping-pong at 1.53 ms. The small tile serves
// problems the large one cannot spread over every SM, the narrow one products with few columns.
// A stage is 128 bytes of K a row: 64 elements of 16-bit operands, 32 of float32 ones (TF32), so
// both hold as many stages.
template <class Element>
using StageK = cute::Int<128 / sizeof(Element)>;

template <class Element>
struct CooperativeLarge {
  using TileShape = cute::Shape<cute::_128, cute::_256, StageK<Element>>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
template <class Element>
struct CooperativeSmall {
  using TileShape = cute::Shape<cute::_128, cute::_128, StageK<Element>>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
template <class Element>
struct CooperativeNarrow {  // N <= 64, e.g. a 1x1 convolution down to 64 channels
  using TileShape = cute::Shape<cute::_128, cute::_64, StageK<Element>>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
};

// The kernel for one element type, operand layout and configuration (cutlass::layout::RowMajor /
// ColumnMajor tags: A [M, K] row-major is K-major; B [K, N] row-major is N-major, [N, K] K-major).
// float operands run as TF32; wgmma reads TF32 operands K-major from shared memory only, so for
// the other layouts CUTLASS's builder feeds one operand from registers (transposed on the way).
// kColumnD: D column-major with the bias per row (the transposed product, see Dispatch), else D
// row-major with the bias per column.
template <class Element, class LayoutA, class LayoutB, class Config, bool kColumnD = false>
struct Gemm {
  using LayoutD = cute::conditional_t<kColumnD, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using BiasAct = cute::conditional_t<
      kColumnD, cutlass::epilogue::fusion::LinCombPerRowBiasEltAct<RuntimeActivation, Element, float, float>,
      cutlass::epilogue::fusion::LinCombPerColBiasEltAct<RuntimeActivation, Element, float, float>>;
  static constexpr int kAlign = 16 / sizeof(Element);
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::TileShape,
      typename Config::ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD, kAlign,  // no C operand: the bias is a broadcast row (or column)
      Element, LayoutD, kAlign, typename Config::EpilogueSchedule, BiasAct>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element, LayoutB, kAlign,
      float, typename Config::TileShape, typename Config::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Config::KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// A row-major [L, rows, cols] tensor as CUTLASS's (rows, cols, L) stride for the given layout tag:
// RowMajor (cols contiguous) or ColumnMajor (rows contiguous).
template <class Stride>
Stride PackedStride(int64_t contiguous, int64_t batch_stride) {
  Stride stride{};
  if constexpr (cute::is_same_v<cute::remove_cvref_t<decltype(cute::get<0>(stride))>, cute::Int<1>>) {
    cute::get<1>(stride) = contiguous;
  } else {
    cute::get<0>(stride) = contiguous;
  }
  cute::get<2>(stride) = batch_stride;
  return stride;
}

template <class Element, class LayoutA, class LayoutB, class Config, bool kColumnD>
ffi::Error Run(const GemmProblem& p, cudaStream_t stream) {
  using Adapter = typename Gemm<Element, LayoutA, LayoutB, Config, kColumnD>::Adapter;
  using Kernel = typename Adapter::GemmKernel;
  const int m = int(p.m), n = int(p.n), k = int(p.k), l = int(p.batch);
  // A is (M, K): row-major [M, K] has stride (K, 1); [K, M] (trans_a) has (1, M). B is (N, K):
  // [K, N] has stride (1, N); [N, K] (trans_b) has (K, 1). D is (M, N), row-major (stride (N, 1))
  // or column-major ((1, M)).
  const auto stride_a = PackedStride<typename Kernel::StrideA>(p.trans_a ? p.m : p.k, p.m * p.k);
  const auto stride_b = PackedStride<typename Kernel::StrideB>(p.trans_b ? p.k : p.n, p.n * p.k);
  const int64_t d_contiguous = kColumnD ? p.m : p.n;
  const auto stride_c = PackedStride<typename Kernel::StrideC>(d_contiguous, p.m * p.n);  // unused: no C
  const auto stride_d = PackedStride<typename Kernel::StrideD>(d_contiguous, p.m * p.n);
  typename Adapter::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, l},
      {static_cast<const Element*>(p.a), stride_a, static_cast<const Element*>(p.b), stride_b},
      {{}, nullptr, stride_c, static_cast<Element*>(p.c), stride_d}};
  args.epilogue.thread.bias_ptr = p.bias;
  args.epilogue.thread.activation = {p.activation, p.activation_param};
  args.hw_info.sm_count = SmCount();
  // The persistent scheduler walks 8 tiles together (L2 reuse of their operands): at 8192^3 bf16 on
  // an H200, swizzle 1/2/4/8 ran 1.70/1.69/1.65/1.65 ms, cuBLAS 1.62-1.64 ms in the same runs.
  args.scheduler.max_swizzle_size = 8;

  Adapter gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    return InvalidArgument("gemm: the tensor-core kernel cannot take this problem");
  }
  if (Adapter::get_workspace_size(args) != 0) {  // the data-parallel persistent schedule needs none
    return ffi::Error(ffi::ErrorCode::kInternal, "jaxdnn: gemm: unexpected CUTLASS workspace");
  }
  if (gemm.initialize(args, nullptr, stream) != cutlass::Status::kSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal, "jaxdnn: gemm: CUTLASS initialization failed");
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) return LaunchError("gemm (tensor cores)");
  return LaunchError("gemm (tensor cores)");
}

// The configuration p asks for, or the heuristic's: narrow tiles for N <= 64 (wider ones would mostly
// multiply padding), else large tiles when they give every SM at least one, else the small ones.
template <class Element, class LayoutA, class LayoutB, bool kColumnD = false>
ffi::Error RunTiled(const GemmProblem& p, cudaStream_t stream) {
  int64_t config = p.algorithm;
  if (config != kGemmLarge && config != kGemmSmall && config != kGemmNarrow) {
    const int64_t large_tiles = (p.m + 127) / 128 * ((p.n + 255) / 256) * p.batch;
    config = p.n <= 64 ? kGemmNarrow : large_tiles >= SmCount() ? kGemmLarge : kGemmSmall;
  }
  if (config == kGemmNarrow) return Run<Element, LayoutA, LayoutB, CooperativeNarrow<Element>, kColumnD>(p, stream);
  if (config == kGemmLarge) return Run<Element, LayoutA, LayoutB, CooperativeLarge<Element>, kColumnD>(p, stream);
  return Run<Element, LayoutA, LayoutB, CooperativeSmall<Element>, kColumnD>(p, stream);
}

// Three operand layouts of one element type: neither, B or A transposed (both: GemmOnTensorCores
// declines, as jaxdnn's products never ask for it; see dense.py's _matmul). With float (TF32)
// operands as stored, A [M, K] K-major and B [K, N] N-major, CUTLASS's builder would feed B from
// registers by swapping the operands inside its mainloop, and that kernel wrote non-finite values
// (H200, 2026-11-27). That layout runs as the transposed product C^T = B^T A^T instead: A' = B^T is
// N-major (fed from registers), B' = A^T K-major, and C^T is written column-major, which is C
// row-major, with the bias per row of C^T.
template <class Element>
ffi::Error Dispatch(const GemmProblem& p, cudaStream_t stream) {
  using Row = cutlass::layout::RowMajor;
  using Col = cutlass::layout::ColumnMajor;
  if constexpr (cute::is_same_v<Element, float>) {
    if (!p.trans_a && !p.trans_b) {
      GemmProblem transposed = p;
      transposed.a = p.b, transposed.b = p.a, transposed.m = p.n, transposed.n = p.m;
      transposed.trans_a = transposed.trans_b = true;
      return RunTiled<Element, Col, Col, true>(transposed, stream);
    }
  } else {
    if (!p.trans_a && !p.trans_b) return RunTiled<Element, Row, Row>(p, stream);
  }
  if (p.trans_b) return RunTiled<Element, Row, Col>(p, stream);
  return RunTiled<Element, Col, Row>(p, stream);
}

}  // namespace sm90
}  // namespace jaxdnn
