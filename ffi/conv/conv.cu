// CUDA convolution. Depthwise stages (groups == C, no lhs dilation) run on the memory-bound kernels
// of depthwise.cu; grouped 16-bit ones with 16 or 32 channels and filters a group and unit strides
// on the tensor-core kernels of grouped.cu (grouped.h says which). Stages with 16-bit operands, one
// group and K a multiple of 8 run on tensor cores, and so do float32 forwards (plain and fused)
// whose tf32 attribute allows TF32 products: pointwise forwards and dgrads (1x1 windows, unit
// strides, no padding, C a multiple of 8) on the GEMM of ffi/dense (see PointwiseGemm), or on the
// pointwise product of conv/halo_sm90.h when their reduction has 64 channels, the other 2-D stages
// on the implicit-GEMM kernels of conv_sm90.cuh (through conv_sm90.cu's TensorCoreFprop and friends,
// with the targets' workspace), or on the halo kernels of conv/halo_sm90.h where those take them.
// Everything else runs on a CORRECTNESS BASELINE without tensor cores. The baseline trades speed for
// obviously safe code: scalar loads (no alignment requirement), int64 indexing, float32
// accumulation, grid-stride loops over a 1-D grid (no gridDim.y/z limits), and the index maps of
// conv_geometry.h that the CPU kernels use too.
//   fprop: one thread per y element (n, p, q, r, k), k fastest (the fused forward adds its epilogue
//          to the accumulator before the one rounding): for each tap, the Cg input channels of
//          k's group (the same address across a warp's threads of one pixel and group: a broadcast)
//          times w[tap, c, k] (consecutive k: coalesced).
//   dgrad: one thread per dx element (n, d, h, w, c), c fastest: for each tap whose output pixel reads
//          this input pixel, the Kg features of c's group of dy (a broadcast) times w[tap, c, group].
//   wgrad: one block per (tap, c, 32 consecutive k): 8 warps split the N * P * Q * R output pixels,
//          each lane sums x * dy for its k (dy reads coalesced), then the 8 partial sums are added in
//          shared memory; no atomics, so the result is deterministic.
// Expected cost: every multiply-add loads its two operands (a warp covers 32 consecutive k of one
// pixel: x is one broadcast transaction, w one coalesced one), so the kernels are bound by L1/L2
// bandwidth, not DRAM (w fits in L2; x is re-read from L2 about K / 32 times): expect a few TFLOP/s
// on an H100/H200, two orders of magnitude below cuDNN, and dgrad slower still (its w reads are
// strided by K).
#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>

#include "common/cuda_common.cuh"
#include "conv/conv.h"
#include "conv/conv_common.h"
#include "conv/conv_epilogue.h"
#include "conv/conv_geometry.h"
#include "conv/conv_sm90.h"
#include "conv/depthwise.h"
#include "conv/grouped.h"
#include "conv/halo_sm90.h"
#include "dense/gemm_sm90.h"

namespace jaxdnn {
namespace {

constexpr int kBlock = 256;
constexpr int64_t kMaxBlocks = 1 << 20;  // beyond, the grid strides
constexpr int kWgradLanes = 32;          // filters (k) per wgrad block
constexpr int kWgradSlices = kBlock / kWgradLanes;  // pixel slices per wgrad block

int Blocks(int64_t items) { return int(std::min(kMaxBlocks, std::max<int64_t>(1, (items + kBlock - 1) / kBlock))); }

// The coordinates of window tap `tap` (row-major over T U V).
__device__ __forceinline__ void TapAt(const ConvGeometry& g, int64_t tap, int64_t t[3]) {
  SplitIndex(tap, g.window, t);
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    ConvFpropKernel(const ConvGeometry g, const T* __restrict__ x, const T* __restrict__ w,
                    const ConvEpilogue<T> epilogue, T* __restrict__ y) {
  const int64_t cg = g.GroupChannels(), kg = g.GroupFilters(), taps = g.Taps();
  const int64_t items = g.OutPixels() * g.filters;
  for (int64_t item = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; item < items;
       item += int64_t(gridDim.x) * blockDim.x) {
    const int64_t k = item % g.filters;
    int64_t o[3];
    const int64_t n = SplitIndex(item / g.filters, g.out, o);
    const int64_t channel0 = (k / kg) * cg;
    float acc = 0.0f;
    for (int64_t tap = 0; tap < taps; ++tap) {
      int64_t t[3];
      TapAt(g, tap, t);
      const int64_t offset = g.InputOffset(n, o, t);
      if (offset < 0) continue;
      const T* x_pixel = x + offset + channel0;
      const T* w_tap = w + tap * cg * g.filters + k;
      for (int64_t c = 0; c < cg; ++c) acc += ToFloat(x_pixel[c]) * ToFloat(w_tap[c * g.filters]);
    }
    y[item] = FromFloat<T>(epilogue.Apply(acc, item, k));
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    ConvDgradKernel(const ConvGeometry g, const T* __restrict__ dy, const T* __restrict__ w, T* __restrict__ dx) {
  const int64_t cg = g.GroupChannels(), kg = g.GroupFilters(), taps = g.Taps();
  const int64_t items = g.InPixels() * g.channels;
  for (int64_t item = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; item < items;
       item += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = item % g.channels;
    int64_t i[3];
    const int64_t n = SplitIndex(item / g.channels, g.in, i);
    const int64_t group = c / cg, channel = c - group * cg;
    float acc = 0.0f;
    for (int64_t tap = 0; tap < taps; ++tap) {
      int64_t t[3];
      TapAt(g, tap, t);
      const int64_t offset = g.OutputOffset(n, i, t);
      if (offset < 0) continue;
      const T* dy_pixel = dy + offset + group * kg;
      const T* w_row = w + (tap * cg + channel) * g.filters + group * kg;
      for (int64_t k = 0; k < kg; ++k) acc += ToFloat(dy_pixel[k]) * ToFloat(w_row[k]);
    }
    dx[item] = FromFloat<T>(acc);
  }
}

template <typename T, typename D>
__global__ void __launch_bounds__(kBlock)
    ConvWgradKernel(const ConvGeometry g, const T* __restrict__ x, const T* __restrict__ dy, D* __restrict__ dw) {
  __shared__ float partial[kWgradSlices][kWgradLanes];
  const int64_t cg = g.GroupChannels(), kg = g.GroupFilters();
  const int64_t k_tiles = (g.filters + kWgradLanes - 1) / kWgradLanes;
  const int64_t items = g.Taps() * cg * k_tiles;  // (tap, channel, k tile)
  const int64_t pixels = g.OutPixels();
  const int lane = threadIdx.x % kWgradLanes, slice = threadIdx.x / kWgradLanes;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {  // uniform per block: syncs are safe
    const int64_t k = (item % k_tiles) * kWgradLanes + lane;
    const int64_t row = item / k_tiles;  // tap * Cg + channel
    const int64_t tap = row / cg, channel = row - tap * cg;
    int64_t t[3];
    TapAt(g, tap, t);
    float acc = 0.0f;
    if (k < g.filters) {
      const int64_t x_channel = (k / kg) * cg + channel;
      for (int64_t pixel = slice; pixel < pixels; pixel += kWgradSlices) {
        int64_t o[3];
        const int64_t n = SplitIndex(pixel, g.out, o);
        const int64_t offset = g.InputOffset(n, o, t);
        if (offset >= 0) acc += ToFloat(x[offset + x_channel]) * ToFloat(dy[pixel * g.filters + k]);
      }
    }
    partial[slice][lane] = acc;
    __syncthreads();
    if (slice == 0 && k < g.filters) {
      float sum = 0.0f;
      for (int s = 0; s < kWgradSlices; ++s) sum += partial[s][lane];
      dw[row * g.filters + k] = FromFloat<D>(sum);
    }
    __syncthreads();  // partial is rewritten by the next item
  }
}

// A pointwise convolution (ConvGeometry::IsPointwise) is a GEMM over the pixels: y[pixels, K] =
// x[pixels, C] . w[C, K], dx = dy . w^T, dw = x^T . dy. Such stages run on the tensor-core GEMM when it
// takes them (16-bit operands, channel counts multiples of 8); the result is then that launch's
// status, else nothing. (float32 forwards take the GEMM in TensorCoreFprop, on the transposed filter.)
std::optional<ffi::Error> PointwiseGemm(cudaStream_t stream, const ConvGeometry& g, const void* a,
                                        const void* b, void* c, int64_t m, int64_t n, int64_t k, bool trans_a,
                                        bool trans_b, ffi::DataType dtype) {
  if (!g.IsPointwise()) return std::nullopt;
  const GemmProblem p{a, b, nullptr, c, 1, m, n, k, trans_a, trans_b, 0, 0.f};
  return GemmOnTensorCores(p, dtype, stream);
}

// Whether a pointwise fprop or dgrad tries the GEMM before the implicit-GEMM kernels: unless the
// algorithm asks for one of their tiles (the GEMM stays their fallback).
bool TriesGemmFirst(int64_t algorithm) {
  return algorithm != kConvTileWide && algorithm != kConvTileTall && algorithm != kConvTileSmall;
}

// The forward with an epilogue (the plain one passes none); `bias` and `residual` may be null.
ffi::Error LaunchFprop(cudaStream_t stream, const ConvGeometry& g, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                       const ffi::AnyBuffer* bias, const ffi::AnyBuffer* residual, int64_t activation,
                       float activation_param, int64_t algorithm, bool tf32, ffi::AnyBuffer& y,
                       ffi::AnyBuffer& workspace) {
  const int64_t items = g.OutPixels() * g.filters;
  if (items == 0) return ffi::Error::Success();
  auto baseline = [&] {
    return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto type_tag) {
      using T = decltype(type_tag);
      ConvEpilogue<T> epilogue;
      epilogue.bias = bias != nullptr ? static_cast<const T*>(bias->untyped_data()) : nullptr;
      epilogue.residual = residual != nullptr ? static_cast<const T*>(residual->untyped_data()) : nullptr;
      epilogue.activation = activation;
      epilogue.activation_param = activation_param;
      ConvFpropKernel<T><<<Blocks(items), kBlock, 0, stream>>>(g, static_cast<const T*>(x.untyped_data()),
                                                               static_cast<const T*>(w.untyped_data()), epilogue,
                                                               static_cast<T*>(y.untyped_data()));
      return LaunchError("conv fprop");
    });
  };
  // An empty x (C = 0, or an empty input that the window reads as padding alone) leaves every sum
  // empty: y is the epilogue of zeros, as on the CPU. The baseline kernel writes it without reading x
  // or w; the others would launch empty grids (an invalid launch) on the empty filter or input.
  if (g.InPixels() * g.channels == 0) return baseline();
  const void* bias_data = bias != nullptr ? bias->untyped_data() : nullptr;
  const void* residual_data = residual != nullptr ? residual->untyped_data() : nullptr;
  if (IsDepthwise(g)) {
    return DepthwiseFprop(stream, g, x.element_type(), x.untyped_data(), w.untyped_data(), bias_data,
                          residual_data, activation, activation_param, y.untyped_data());
  }
  if (GroupedApplies(g, x.element_type())) {
    return GroupedFprop(stream, g, x.element_type(), x.untyped_data(), w.untyped_data(), bias_data, residual_data,
                        activation, activation_param, y.untyped_data());
  }
  if (auto status = TensorCoreFprop(stream, g, x.element_type(), x.untyped_data(), w.untyped_data(), bias_data,
                                    residual_data, activation, activation_param, y.untyped_data(),
                                    workspace.untyped_data(), workspace.size_bytes(), algorithm, tf32)) {
    return std::move(*status);
  }
  return baseline();
}

// Whether a plain pointwise fprop or dgrad with 64 channels on its reduction side runs on the halo
// file's pointwise product (conv/halo_sm90.h): unless the algorithm names another kernel.
bool UsesPointwiseProduct(const ConvGeometry& g, ffi::DataType dtype, int64_t algorithm, bool dgrad) {
  return AllowsHalo(algorithm) && PointwiseProductApplies(g, dtype, dgrad);
}

ffi::Error ConvFpropImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> workspace, ConvAttrs attrs) {
  ConvGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakeConvGeometry(attrs, x.dimensions(), w.dimensions(), y->dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, w, *y));
  // An empty x or y goes straight to LaunchFprop, which launches no empty grid.
  const bool empty = g.InPixels() * g.channels == 0 || g.OutPixels() * g.filters == 0;
  if (!empty && UsesPointwiseProduct(g, x.element_type(), attrs.algorithm, false)) {
    return PointwiseProduct(stream, g, x.element_type(), x.untyped_data(), w.untyped_data(), false,
                            y->untyped_data());
  }
  if (!empty && TriesGemmFirst(attrs.algorithm)) {
    if (auto status = PointwiseGemm(stream, g, x.untyped_data(), w.untyped_data(), y->untyped_data(),
                                    g.OutPixels(), g.filters, g.channels, false, false, x.element_type())) {
      return std::move(*status);
    }
  }
  return LaunchFprop(stream, g, x, w, nullptr, nullptr, 0, 0.0f, attrs.algorithm, attrs.tf32 != 0, *y, *workspace);
}

ffi::Error ConvFpropFusedImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                              std::optional<ffi::AnyBuffer> residual, ffi::Result<ffi::AnyBuffer> y,
                              ffi::Result<ffi::AnyBuffer> workspace, ConvFusedAttrs attrs) {
  ConvGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakeConvGeometry(attrs.conv, x.dimensions(), w.dimensions(), y->dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, w, *y));
  JAXDNN_RETURN_IF_ERROR(CheckEpilogue(g, x, bias, residual, *y, attrs.activation));
  return LaunchFprop(stream, g, x, w, &bias, residual.has_value() ? &*residual : nullptr, attrs.activation,
                     attrs.activation_param, attrs.conv.algorithm, attrs.conv.tf32 != 0, *y, *workspace);
}

ffi::Error ConvDgradImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> dx,
                         ffi::Result<ffi::AnyBuffer> workspace, ConvAttrs attrs) {
  ConvGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakeConvGeometry(attrs, dx->dimensions(), w.dimensions(), dy.dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(dy, w, *dx));
  const int64_t items = g.InPixels() * g.channels;
  if (items == 0) return ffi::Error::Success();
  // An empty dy (K = 0, or no output pixels: a window wider than the padded input) leaves every sum
  // empty: dx = 0, as on the CPU. The kernels below would launch empty grids (an invalid launch).
  if (g.OutPixels() * g.filters == 0) {
    return CudaError(cudaMemsetAsync(dx->untyped_data(), 0, dx->size_bytes(), stream), "conv dgrad: memset");
  }
  if (IsDepthwise(g)) {
    return DepthwiseDgrad(stream, g, dy.element_type(), dy.untyped_data(), w.untyped_data(), dx->untyped_data());
  }
  if (GroupedApplies(g, dy.element_type())) {
    if (auto status = GroupedDgrad(stream, g, dy.element_type(), dy.untyped_data(), w.untyped_data(),
                                   workspace->untyped_data(), workspace->size_bytes(), dx->untyped_data())) {
      return std::move(*status);
    }
  }
  if (UsesPointwiseProduct(g, dy.element_type(), attrs.algorithm, true)) {
    return PointwiseProduct(stream, g, dy.element_type(), dy.untyped_data(), w.untyped_data(), true,
                            dx->untyped_data());
  }
  if (TriesGemmFirst(attrs.algorithm)) {
    if (auto status = PointwiseGemm(stream, g, dy.untyped_data(), w.untyped_data(), dx->untyped_data(),
                                    g.InPixels(), g.channels, g.filters, false, true, dy.element_type())) {
      return std::move(*status);
    }
  }
  if (auto status = TensorCoreDgrad(stream, g, dy.element_type(), dy.untyped_data(), w.untyped_data(),
                                    dx->untyped_data(), workspace->untyped_data(), workspace->size_bytes(),
                                    attrs.algorithm)) {
    return std::move(*status);
  }
  if (auto status = PointwiseGemm(stream, g, dy.untyped_data(), w.untyped_data(), dx->untyped_data(),
                                  g.InPixels(), g.channels, g.filters, false, true, dy.element_type())) {
    return std::move(*status);
  }
  return DispatchFloat<float, __nv_bfloat16, __half>(dy.element_type(), "dy", [&](auto type_tag) {
    using T = decltype(type_tag);
    ConvDgradKernel<T><<<Blocks(items), kBlock, 0, stream>>>(g, static_cast<const T*>(dy.untyped_data()),
                                                             static_cast<const T*>(w.untyped_data()),
                                                             static_cast<T*>(dx->untyped_data()));
    return LaunchError("conv dgrad");
  });
}

ffi::Error ConvWgradImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dw,
                         ffi::Result<ffi::AnyBuffer> workspace, ConvAttrs attrs) {
  ConvGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakeConvGeometry(attrs, x.dimensions(), dw->dimensions(), dy.dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckWgradDtypes(x, dy, *dw));
  const ffi::DataType dw_dtype = dw->element_type();
  const bool float_sums = dw_dtype != x.element_type();  // float32 dw of 16-bit operands
  const int64_t rows = g.Taps() * g.GroupChannels();
  if (rows * g.filters == 0) return ffi::Error::Success();
  // An empty x or dy (an empty batch, or no pixels on one side) leaves every sum empty: dw = 0, as on
  // the CPU. The kernels below would launch empty grids (an invalid launch) or map empty tensors.
  if (g.InPixels() == 0 || g.OutPixels() == 0) {
    return CudaError(cudaMemsetAsync(dw->untyped_data(), 0, dw->size_bytes(), stream), "conv wgrad: memset");
  }
  if (IsDepthwise(g)) {
    if (float_sums) return InvalidArgument("conv wgrad: a depthwise dw has its operands' dtype");
    return DepthwiseWgrad(stream, g, x.element_type(), x.untyped_data(), dy.untyped_data(),
                          workspace->untyped_data(), workspace->size_bytes(), dw->untyped_data());
  }
  if (GroupedApplies(g, x.element_type())) {
    if (auto status = GroupedWgrad(stream, g, x.element_type(), x.untyped_data(), dy.untyped_data(), dw_dtype,
                                   workspace->untyped_data(), workspace->size_bytes(), dw->untyped_data())) {
      return std::move(*status);
    }
  }
  // Pointwise stages too go to the conv kernel first unless asked otherwise: it splits the pixels
  // (the GEMM's K) over slices. The GEMM writes the operands' dtype only.
  auto gemm = [&]() -> std::optional<ffi::Error> {
    if (float_sums) return std::nullopt;
    return PointwiseGemm(stream, g, x.untyped_data(), dy.untyped_data(), dw->untyped_data(), g.channels,
                         g.filters, g.InPixels(), true, false, x.element_type());
  };
  if (attrs.algorithm == kConvGemm) {
    if (auto status = gemm()) return std::move(*status);
  }
  if (auto status = TensorCoreWgrad(stream, g, x.element_type(), x.untyped_data(), dy.untyped_data(), dw_dtype,
                                    dw->untyped_data(), workspace->untyped_data(), workspace->size_bytes(),
                                    attrs.algorithm)) {
    return std::move(*status);
  }
  if (auto status = gemm()) return std::move(*status);
  const int64_t blocks = std::min(kMaxBlocks, rows * ((g.filters + kWgradLanes - 1) / kWgradLanes));
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    const T* x_data = static_cast<const T*>(x.untyped_data());
    const T* dy_data = static_cast<const T*>(dy.untyped_data());
    if (float_sums) {
      ConvWgradKernel<<<int(blocks), kBlock, 0, stream>>>(g, x_data, dy_data, static_cast<float*>(dw->untyped_data()));
    } else {
      ConvWgradKernel<<<int(blocks), kBlock, 0, stream>>>(g, x_data, dy_data, static_cast<T*>(dw->untyped_data()));
    }
    return LaunchError("conv wgrad");
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConvFpropCuda, jaxdnn::ConvFpropImpl, jaxdnn::BindConvFprop(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(ConvFpropFusedCuda, jaxdnn::ConvFpropFusedImpl,
                              jaxdnn::BindConvFpropFused(jaxdnn::BindCuda()), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(ConvDgradCuda, jaxdnn::ConvDgradImpl, jaxdnn::BindConvDgrad(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(ConvWgradCuda, jaxdnn::ConvWgradImpl, jaxdnn::BindConvWgrad(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
