// Hopper implicit-GEMM convolutions built from CUTLASS's conv collectives: a producer warp loads
// activation tiles with TMA's im2col mode (the window gather done by the copy engine, padding
// included) and filter tiles with plain TMA into a shared-memory pipeline; a consumer warp group runs
// wgmma on them; the epilogue (bias, residual, activation for the forward) ends in a TMA store.
// Included by conv_sm90_{fprop,dgrad,wgrad}.cu, one stage per file so they compile in parallel.
// GEMM views (CUTLASS's): fprop M = N*P*Q, N = K, K = R*S*C; dgrad M = N*H*W, N = C, K = R*S*K;
// wgrad M = K, N = R*S*C, K = N*P*Q.
// Must be compiled with NDEBUG (see gemm_sm90.cuh).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/kernel_hardware_info.hpp>  // before the conv headers, which use it undeclared
#include <cutlass/conv/collective/collective_builder.hpp>
#include <cutlass/conv/convnd_problem_shape.hpp>
#include <cutlass/conv/device/conv_universal_adapter.hpp>
#include <cutlass/conv/dispatch_policy.hpp>
#include <cutlass/conv/kernel/conv_universal.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <optional>

#include "common/cuda_common.cuh"
#include "common/sm90_activation.cuh"
#include "conv/conv.h"
#include "conv/conv_sm90.h"

namespace jaxdnn {
namespace sm90 {

// CTA tiles (M x N x K per pipeline stage), all for one consumer warp group (CUTLASS's Hopper conv
// has neither the cooperative nor the persistent schedule): the wide one for most layers; a tall one
// where the GEMM's N (fprop's K, dgrad's C) is at most 64, as in ResNet's 64-channel stages, whose
// short reductions (R * S * 64) leave a 128 x 64 tile's pipeline fill and epilogue exposed; a small
// one with half the shared memory, so that two CTAs share an SM and one's fill and epilogue overlap
// the other's main loop (an autotuning candidate); and wgrad's, whose N (the filter's (R, S, C)
// modes) nests as the others' K does, 64 rows tall for K <= 64 filters.
using ConvTileWide = cute::Shape<cute::_128, cute::_128, cute::Shape<cute::_64>>;
using ConvTileTall = cute::Shape<cute::_256, cute::_64, cute::Shape<cute::_64>>;
using ConvTileSmall = cute::Shape<cute::_128, cute::_64, cute::Shape<cute::_64>>;
using ConvTileWgrad = cute::Shape<cute::_128, cute::Shape<cute::_128>, cute::Shape<cute::_64>>;
using ConvTileWgradShort = cute::Shape<cute::_64, cute::Shape<cute::_128>, cute::Shape<cute::_64>>;

// The shared memory a tile's pipeline leaves unused: none (as many stages as fit), or half of it.
enum class Occupancy { kOneCta, kTwoCtas };

// A kernel whose launch bounds ask for two resident CTAs an SM: the compiler keeps it within 128
// registers a thread (CUTLASS's own asks for one CTA and takes about 160).
template <class Base>
struct TwoCtas : Base {
  static constexpr uint32_t MinBlocksPerMultiprocessor = 2;
};

// The kernel of one stage, operand type, tile and result type. Fusion is the epilogue's operation:
// the forward's bias + residual + activation, or a plain store.
template <cutlass::conv::Operator Op, class Element, class Tile, class ElementC, class ElementD, class Fusion,
          Occupancy kOccupancy = Occupancy::kOneCta>
struct Conv {
  using Act = cutlass::layout::TensorNHWC;  // [N, H, W, C] activations, [K, R, S, C] filters
  using LayoutC = cute::conditional_t<Op == cutlass::conv::Operator::kWgrad, cutlass::layout::TensorKCSR, Act>;
  static constexpr int kAlign = 16 / sizeof(Element);
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutC, kAlign, ElementD, LayoutC,
      kAlignD, cutlass::epilogue::TmaWarpSpecialized, Fusion>::CollectiveOp;
  // Bytes of shared memory the pipeline's stages leave to the epilogue (and to a second CTA).
  static constexpr int kCarveout =
      static_cast<int>(sizeof(typename Epilogue::SharedStorage)) +
      (kOccupancy == Occupancy::kTwoCtas ? cutlass::gemm::collective::detail::sm90_smem_capacity_bytes / 2 : 0);
  using Mainloop = typename cutlass::conv::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Op, Element, Act, kAlign, Element, Act, kAlign, float,
      Tile, Cluster,
      cutlass::conv::collective::StageCountAutoCarveout<kCarveout>,
      cutlass::conv::collective::KernelScheduleAuto>::CollectiveOp;
  using ProblemShape = cutlass::conv::ConvProblemShape<Op, 2>;
  using OneCtaKernel = cutlass::conv::kernel::ConvUniversal<ProblemShape, Mainloop, Epilogue>;
  using Kernel = cute::conditional_t<kOccupancy == Occupancy::kTwoCtas, TwoCtas<OneCtaKernel>, OneCtaKernel>;
  using Adapter = cutlass::conv::device::ConvUniversalAdapter<Kernel>;
};

// The forward: y = act(acc + bias[k] + residual), the residual as CUTLASS's source C (beta 1).
template <class Element, class Tile, Occupancy kOccupancy>
using ConvFprop =
    Conv<cutlass::conv::Operator::kFprop, Element, Tile, Element, Element,
         cutlass::epilogue::fusion::LinCombPerColBiasEltAct<RuntimeActivation, Element, float, Element, Element>,
         kOccupancy>;

// The backward stages store the accumulator (no source): dgrad in the operands' type, wgrad in
// float32 (partial sums over a slice of the images, added up by the caller).
template <cutlass::conv::Operator Op, class Element, class Tile, class ElementD, Occupancy kOccupancy>
using ConvPlain = Conv<Op, Element, Tile, void, ElementD,
                       cutlass::epilogue::fusion::LinearCombination<ElementD, float, void>, kOccupancy>;

template <cutlass::conv::Operator Op>
cutlass::conv::ConvProblemShape<Op, 2> MakeShape(const ConvSm90Problem& p) {
  return {cutlass::conv::Mode::kCrossCorrelation,
          {p.n, p.h, p.w, p.c},
          {p.k, p.r, p.s, p.c},
          {p.pad_lo[0], p.pad_lo[1]},
          {p.pad_hi[0], p.pad_hi[1]},
          {p.stride[0], p.stride[1]},
          {p.dilation[0], p.dilation[1]},
          1};
}

// Runs one configured kernel: nothing when it cannot take the problem.
template <class Cfg>
std::optional<ffi::Error> Launch(const typename Cfg::Adapter::Arguments& args, cudaStream_t stream,
                                 const char* what) {
  using Adapter = typename Cfg::Adapter;
  Adapter op;
  if (op.can_implement(args) != cutlass::Status::kSuccess) return std::nullopt;
  if (Adapter::get_workspace_size(args) != 0) {  // the non-persistent kernels need none
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxdnn: unexpected CUTLASS workspace in ") + what);
  }
  if (op.initialize(args, nullptr, stream) != cutlass::Status::kSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxdnn: CUTLASS initialization failed in ") + what);
  }
  op.run(stream);
  return LaunchError(what);
}

// The output (C/D) strides of a problem shape, packed: fprop's and dgrad's ((Q, P, N), 1, 0) over
// an [N, P, Q, K] output (the pixel modes innermost first), wgrad's (R * S * C, 1, 0) over [K, R, S, C].
template <class Kernel, class Shape>
typename Kernel::StrideD OutputStride(const Shape& shape) {
  typename Kernel::StrideD stride{};
  if constexpr (cute::is_tuple<cute::remove_cvref_t<decltype(cute::get<0>(stride))>>::value) {
    cute::for_each(cute::make_seq<cute::rank<0>(typename Kernel::StrideD{})>{},
                   [&](auto i) { cute::get<0, i>(stride) = shape.stride_C[Shape::RankT - 2 - i]; });
  } else {
    stride = cutlass::make_cute_packed_stride(stride, shape.shape_C, shape.stride_C, Shape::ConvOp);
  }
  return stride;
}

template <class Element, class Tile, Occupancy kOccupancy = Occupancy::kOneCta>
std::optional<ffi::Error> FpropTiled(const ConvSm90Problem& p, const void* x, const void* w, const void* bias,
                                     const void* residual, int activation, float activation_param, void* y,
                                     cudaStream_t stream) {
  using Cfg = ConvFprop<Element, Tile, kOccupancy>;
  const auto shape = MakeShape<cutlass::conv::Operator::kFprop>(p);
  const auto stride = OutputStride<typename Cfg::Kernel>(shape);
  typename Cfg::Adapter::Arguments args{
      shape,
      {static_cast<const Element*>(x), static_cast<const Element*>(w)},
      {{}, static_cast<const Element*>(residual), stride, static_cast<Element*>(y), stride}};
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = residual != nullptr ? 1.f : 0.f;  // beta 0: C is never read
  args.epilogue.thread.bias_ptr = static_cast<const Element*>(bias);  // null: no bias
  args.epilogue.thread.activation = {activation, activation_param};
  return Launch<Cfg>(args, stream, "conv fprop (tensor cores)");
}

// The tile of a fprop or dgrad: the one p asks for, else the tall one where the GEMM's N (`columns`,
// fprop's K or dgrad's C) is at most 64, else the wide one.
inline int64_t TileFor(const ConvSm90Problem& p, int columns) {
  if (p.algorithm == kConvTileWide || p.algorithm == kConvTileTall || p.algorithm == kConvTileSmall) {
    return p.algorithm;
  }
  return columns <= 64 ? kConvTileTall : kConvTileWide;
}

template <class Element>
std::optional<ffi::Error> Fprop(const ConvSm90Problem& p, const void* x, const void* w, const void* bias,
                                const void* residual, int activation, float activation_param, void* y,
                                cudaStream_t stream) {
  switch (TileFor(p, p.k)) {
    case kConvTileTall:
      return FpropTiled<Element, ConvTileTall>(p, x, w, bias, residual, activation, activation_param, y, stream);
    case kConvTileSmall:
      return FpropTiled<Element, ConvTileSmall, Occupancy::kTwoCtas>(p, x, w, bias, residual, activation,
                                                                     activation_param, y, stream);
    default:
      return FpropTiled<Element, ConvTileWide>(p, x, w, bias, residual, activation, activation_param, y, stream);
  }
}

// dgrad (A = dy, B = w, D = dx) and wgrad (A = dy, B = x, D = dw): plain stores.
template <cutlass::conv::Operator Op, class Element, class Tile, class ElementD,
          Occupancy kOccupancy = Occupancy::kOneCta>
std::optional<ffi::Error> BackwardTiled(const ConvSm90Problem& p, const void* a, const void* b, void* d,
                                        cudaStream_t stream, const char* what) {
  using Cfg = ConvPlain<Op, Element, Tile, ElementD, kOccupancy>;
  const auto shape = MakeShape<Op>(p);
  const auto stride = OutputStride<typename Cfg::Kernel>(shape);
  typename Cfg::Adapter::Arguments args{
      shape,
      {static_cast<const Element*>(a), static_cast<const Element*>(b)},
      {{}, nullptr, stride, static_cast<ElementD*>(d), stride}};
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  return Launch<Cfg>(args, stream, what);
}

template <class Element>
std::optional<ffi::Error> Dgrad(const ConvSm90Problem& p, const void* dy, const void* w, void* dx,
                                cudaStream_t stream) {
  constexpr auto kDgrad = cutlass::conv::Operator::kDgrad;
  constexpr const char* kWhat = "conv dgrad (tensor cores)";
  switch (TileFor(p, p.c)) {
    case kConvTileTall:
      return BackwardTiled<kDgrad, Element, ConvTileTall, Element>(p, dy, w, dx, stream, kWhat);
    case kConvTileSmall:
      return BackwardTiled<kDgrad, Element, ConvTileSmall, Element, Occupancy::kTwoCtas>(p, dy, w, dx, stream,
                                                                                        kWhat);
    default:
      return BackwardTiled<kDgrad, Element, ConvTileWide, Element>(p, dy, w, dx, stream, kWhat);
  }
}

// wgrad's tile: 64 filters a tile where p asks for the tall tile or has at most 64 filters and asks
// for no tile of wgrad's, else 128.
template <class Element>
std::optional<ffi::Error> Wgrad(const ConvSm90Problem& p, const void* x, const void* dy, float* dw,
                                cudaStream_t stream) {
  constexpr auto kWgrad = cutlass::conv::Operator::kWgrad;
  constexpr const char* kWhat = "conv wgrad (tensor cores)";
  const bool short_tile = p.algorithm == kConvTileTall || (p.algorithm != kConvTileWide && p.k <= 64);
  if (short_tile) return BackwardTiled<kWgrad, Element, ConvTileWgradShort, float>(p, dy, x, dw, stream, kWhat);
  return BackwardTiled<kWgrad, Element, ConvTileWgrad, float>(p, dy, x, dw, stream, kWhat);
}

// The dtype dispatch of one stage: bfloat16 or float16 (conv_sm90.cu admits no other).
template <class Run>
std::optional<ffi::Error> ForDtype(ffi::DataType dtype, Run run) {
  if (dtype == ffi::DataType::BF16) return run(cutlass::bfloat16_t{});
  if (dtype == ffi::DataType::F16) return run(cutlass::half_t{});
  return std::nullopt;
}

}  // namespace sm90
}  // namespace jaxdnn
