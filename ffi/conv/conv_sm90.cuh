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
// modes) nests as the others' K does, 64 rows tall for K <= 64 filters. A pipeline stage holds 128
// bytes of channels a row: 64 16-bit values, or 32 float32 ones multiplied as TF32 (the swizzle's
// width either way).
template <class Element>
using StageK = cute::Shape<cute::Int<128 / sizeof(Element)>>;
template <class Element>
using ConvTileWide = cute::Shape<cute::_128, cute::_128, StageK<Element>>;
template <class Element>
using ConvTileTall = cute::Shape<cute::_256, cute::_64, StageK<Element>>;
template <class Element>
using ConvTileSmall = cute::Shape<cute::_128, cute::_64, StageK<Element>>;
template <class Element>
using ConvTileWgrad = cute::Shape<cute::_128, cute::Shape<cute::_128>, StageK<Element>>;
template <class Element>
using ConvTileWgradShort = cute::Shape<cute::_64, cute::Shape<cute::_128>, StageK<Element>>;

// The shared memory a tile's pipeline leaves unused: none (as many stages as fit), or half of it.
enum class Occupancy { kOneCta, kTwoCtas };

// A kernel whose launch bounds ask for two resident CTAs an SM: the compiler keeps it within 128
// registers a thread (CUTLASS's own asks for one CTA and takes about 160).
template <class Base>
struct TwoCtas : Base {
  static constexpr uint32_t MinBlocksPerMultiprocessor = 2;
};

// The kernel of one stage, operand type, tile and result type. Fusion is the epilogue's operation:
// the forward's bias + residual + activation, or a plain store. float operands are multiplied as
// TF32 (CUTLASS's builder maps them to it), which wgmma reads K-major only: of the three stages,
// only the forward has both operands K-major in these layouts.
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

// The tile of a fprop or dgrad: the one p asks for; else, where the GEMM's N (`columns`, fprop's K or
// dgrad's C) is at most 64, the small two-CTA tile if N fills most of its 64 columns and the reduction
// (`depth`: R*S times fprop's C or dgrad's K) is at least 512 (the second CTA hides one's fill and
// epilogue), else the tall one; the wide one for larger N. Measured on an H200: 56x56 64->64 3x3 fprop
// 0.10 ms small vs 0.11 tall; the space-to-depth stem (4x4 on 16 channels) tall 0.66 vs 0.74 fprop
// (depth 256) and 0.70 vs 0.79 dgrad (N 16).
inline int64_t TileFor(const ConvSm90Problem& p, int columns, int depth) {
  if (p.algorithm == kConvTileWide || p.algorithm == kConvTileTall || p.algorithm == kConvTileSmall) {
    return p.algorithm;
  }
  if (columns > 64) return kConvTileWide;
  return columns > 32 && depth >= 512 ? kConvTileSmall : kConvTileTall;
}

template <class Element>
std::optional<ffi::Error> Fprop(const ConvSm90Problem& p, const void* x, const void* w, const void* bias,
                                const void* residual, int activation, float activation_param, void* y,
                                cudaStream_t stream) {
  switch (TileFor(p, p.k, p.r * p.s * p.c)) {
    case kConvTileTall:
      return FpropTiled<Element, ConvTileTall<Element>>(p, x, w, bias, residual, activation, activation_param, y,
                                                        stream);
    case kConvTileSmall:
      return FpropTiled<Element, ConvTileSmall<Element>, Occupancy::kTwoCtas>(p, x, w, bias, residual, activation,
                                                                              activation_param, y, stream);
    default:
      return FpropTiled<Element, ConvTileWide<Element>>(p, x, w, bias, residual, activation, activation_param, y,
                                                        stream);
  }
}

// dgrad (A = dy, B = w, D = dx): plain stores.
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
  switch (TileFor(p, p.c, p.r * p.s * p.k)) {
    case kConvTileTall:
      return BackwardTiled<kDgrad, Element, ConvTileTall<Element>, Element>(p, dy, w, dx, stream, kWhat);
    case kConvTileSmall:
      return BackwardTiled<kDgrad, Element, ConvTileSmall<Element>, Element, Occupancy::kTwoCtas>(p, dy, w, dx,
                                                                                                 stream, kWhat);
    default:
      return BackwardTiled<kDgrad, Element, ConvTileWide<Element>, Element>(p, dy, w, dx, stream, kWhat);
  }
}

// wgrad's slices in one launch: blockIdx.z picks a slice's parameters (its own x, dy and partial sum;
// CUTLASS's conv kernel reads no blockIdx.z, its problem having no batch mode). A launch costs the
// host about 10 us, more than a 1x1 layer's slice takes the GPU, so one per slice left the GPU
// waiting. The parameters (1.5 KB a slice) travel as the kernel's argument, up to 32 KB on sm_90
// (CUDA 12.1 on): kWgradMaxSlices.
template <class Kernel>
struct WgradSlices {
  static constexpr int kCount = 32764 / sizeof(typename Kernel::Params);
  typename Kernel::Params slice[kCount];
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::MaxThreadsPerBlock, Kernel::MinBlocksPerMultiprocessor)
    SlicedWgradKernel(const __grid_constant__ WgradSlices<Kernel> params) {
  extern __shared__ char smem[];
  Kernel op;
  op(params.slice[blockIdx.z], smem);
}

template <class Element, class Tile>
std::optional<ffi::Error> WgradTiled(const ConvSm90Problem& p, const void* x, const void* dy, float* partial,
                                     int slices, cudaStream_t stream) {
  constexpr auto kWgrad = cutlass::conv::Operator::kWgrad;
  constexpr const char* kWhat = "conv wgrad (tensor cores)";
  using Cfg = ConvPlain<kWgrad, Element, Tile, float, Occupancy::kOneCta>;
  using Kernel = typename Cfg::Kernel;
  static_assert(WgradSlices<Kernel>::kCount >= kWgradMaxSlices, "the slices' parameters exceed a kernel argument");
  if (slices < 1 || slices > kWgradMaxSlices || slices > p.n) {
    return ffi::Error(ffi::ErrorCode::kInternal, "jaxdnn: conv wgrad: bad slice count");
  }
  const int64_t x_image = int64_t(p.h) * p.w * p.c, dy_image = int64_t(p.p) * p.q * p.k;
  const int64_t filter = int64_t(p.k) * p.r * p.s * p.c;
  WgradSlices<Kernel> params{};
  for (int s = 0; s < slices; ++s) {
    const int first = int(int64_t(p.n) * s / slices), end = int(int64_t(p.n) * (s + 1) / slices);
    ConvSm90Problem slice = p;
    slice.n = end - first;
    const auto shape = MakeShape<kWgrad>(slice);
    const auto stride = OutputStride<Kernel>(shape);
    typename Cfg::Adapter::Arguments args{
        shape,
        {static_cast<const Element*>(dy) + first * dy_image, static_cast<const Element*>(x) + first * x_image},
        {{}, nullptr, stride, partial + s * filter, stride}};
    args.epilogue.thread.alpha = 1.f;
    args.epilogue.thread.beta = 0.f;
    // The slices are one problem but for their image counts: a refusal comes before anything runs,
    // and the caller falls back.
    if (Cfg::Adapter::can_implement(args) != cutlass::Status::kSuccess) return std::nullopt;
    if (Cfg::Adapter::get_workspace_size(args) != 0) {  // the non-persistent kernels need none
      return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxdnn: unexpected CUTLASS workspace in ") + kWhat);
    }
    params.slice[s] = Kernel::to_underlying_arguments(args, nullptr);
  }
  dim3 grid = Cfg::Adapter::get_grid_shape(params.slice[0]);  // the same output tiles for every slice
  grid.z = slices;
  constexpr int kSmem = Kernel::SharedStorageSize;
  JAXDNN_RETURN_IF_ERROR(CudaError(
      cudaFuncSetAttribute(SlicedWgradKernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem), kWhat));
  SlicedWgradKernel<Kernel><<<grid, Kernel::get_block_shape(), kSmem, stream>>>(params);
  return LaunchError(kWhat);
}

// wgrad's tile: 64 filters a tile unless p asks for the wide one (128). The short one won on every
// ResNet-50 layer an H200 timed (14x14 256->256 3x3 0.079 vs 0.085 ms, 56x56 64->256 1x1 0.105 vs
// 0.158): its twice as many tiles fill the SMs with fewer slices of the batch.
template <class Element>
std::optional<ffi::Error> Wgrad(const ConvSm90Problem& p, const void* x, const void* dy, float* partial,
                                int slices, cudaStream_t stream) {
  if (p.algorithm != kConvTileWide) {
    return WgradTiled<Element, ConvTileWgradShort<Element>>(p, x, dy, partial, slices, stream);
  }
  return WgradTiled<Element, ConvTileWgrad<Element>>(p, x, dy, partial, slices, stream);
}

// The dtype dispatch of one stage: bfloat16 or float16, and float32 (as TF32) where kTf32 (the
// forward; conv_sm90.cu admits no other).
template <bool kTf32 = false, class Run>
std::optional<ffi::Error> ForDtype(ffi::DataType dtype, Run run) {
  if (dtype == ffi::DataType::BF16) return run(cutlass::bfloat16_t{});
  if (dtype == ffi::DataType::F16) return run(cutlass::half_t{});
  if constexpr (kTf32) {
    if (dtype == ffi::DataType::F32) return run(float{});
  }
  return std::nullopt;
}

}  // namespace sm90
}  // namespace jaxdnn
