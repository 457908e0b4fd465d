// CUDA convolution. Pointwise stages (1x1 windows, unit strides, no padding, one group) with 16-bit
// operands run on the tensor-core GEMM of ffi/dense (see PointwiseGemm); other 2-D stages with 16-bit
// operands, one group and channel counts multiples of 8 on the implicit-GEMM tensor-core kernels of
// conv_sm90.cuh (see TensorCoreFprop and friends: they take filters [K, R, S, C], so the handlers
// transpose jaxdnn's [R, S, C, K] filters in the targets' workspace result). Everything else
// runs on a CORRECTNESS BASELINE without tensor cores. The baseline trades speed for obviously safe code: scalar loads (no alignment requirement), int64 indexing,
// float32 accumulation, grid-stride loops over a 1-D grid (no gridDim.y/z limits), and the index
// maps of conv_geometry.h that the CPU kernels use too.
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
#include <climits>
#include <cstdint>
#include <optional>
#include <utility>

#include "common/cuda_common.cuh"
#include "conv/conv.h"
#include "conv/conv_common.h"
#include "conv/conv_epilogue.h"
#include "conv/conv_geometry.h"
#include "conv/conv_sm90.h"
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

template <typename T>
__global__ void __launch_bounds__(kBlock)
    ConvWgradKernel(const ConvGeometry g, const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dw) {
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
      dw[row * g.filters + k] = FromFloat<T>(sum);
    }
    __syncthreads();  // partial is rewritten by the next item
  }
}

// A 1x1 convolution with unit strides and dilations, no padding and one group is a GEMM over the
// pixels: y[pixels, K] = x[pixels, C] . w[C, K], dx = dy . w^T, dw = x^T . dy. Such stages run on the
// tensor-core GEMM when it takes them (16-bit operands, channel counts multiples of 8); the result
// is then that launch's status, else nothing.
bool IsPointwise(const ConvGeometry& g) {
  for (int a = 0; a < 3; ++a) {
    if (g.window[a] != 1 || g.stride[a] != 1 || g.pad[a] != 0 || g.lhs_dilation[a] != 1) return false;
  }
  return g.groups == 1;
}

std::optional<ffi::Error> PointwiseGemm(cudaStream_t stream, const ConvGeometry& g, const void* a,
                                        const void* b, void* c, int64_t m, int64_t n, int64_t k, bool trans_a,
                                        bool trans_b, ffi::DataType dtype) {
  if (!IsPointwise(g)) return std::nullopt;
  const GemmProblem p{a, b, nullptr, c, 1, m, n, k, trans_a, trans_b, 0, 0.f};
  return GemmOnTensorCores(p, dtype, stream);
}

}  // namespace

bool MakeConvSm90Problem(const ConvGeometry& g, ffi::DataType dtype, ConvStage stage, ConvSm90Problem* p) {
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) return false;
  if (g.groups != 1 || g.channels % 8 != 0 || g.filters % 8 != 0) return false;
  if (g.window[0] != 1 || g.stride[0] != 1 || g.pad[0] != 0 || g.in[0] != g.out[0]) return false;
  constexpr int64_t kMaxInt = INT32_MAX;
  if (g.InPixels() * g.channels > kMaxInt || g.OutPixels() * g.filters > kMaxInt ||
      g.Taps() * g.channels * g.filters > kMaxInt) {
    return false;
  }
  p->n = int(g.batch * g.in[0]);
  p->h = int(g.in[1]);
  p->w = int(g.in[2]);
  p->c = int(g.channels);
  p->k = int(g.filters);
  p->r = int(g.window[1]);
  p->s = int(g.window[2]);
  p->p = int(g.out[1]);
  p->q = int(g.out[2]);
  for (int a = 0; a < 2; ++a) {
    const int axis = a + 1;
    if (g.lhs_dilation[axis] != 1 || g.pad[axis] < 0 || g.pad[axis] > 64) return false;
    if (stage == ConvStage::kDgrad && g.stride[axis] != 1) return false;
    // CUTLASS derives the output size from both paddings: the high one is what the output's last
    // window needs (none when the input has unread trailing pixels), and must give g's output size.
    const int64_t span = (g.window[axis] - 1) * g.rhs_dilation[axis] + 1;
    const int64_t high = std::max<int64_t>(0, (g.out[axis] - 1) * g.stride[axis] + span - g.in[axis] - g.pad[axis]);
    if (high > 64 || (g.in[axis] + g.pad[axis] + high - span) / g.stride[axis] + 1 != g.out[axis]) return false;
    if (span > 64 || g.stride[axis] > 64) return false;
    p->pad_lo[a] = int(g.pad[axis]);
    p->pad_hi[a] = int(high);
    p->stride[a] = int(g.stride[axis]);
    p->dilation[a] = int(g.rhs_dilation[axis]);
  }
  return true;
}

namespace {

// out[c, r] = in[r, c] for a row-major [rows, cols] matrix of 16-bit values, through 32 x 32 tiles in
// shared memory so both the reads and the writes are coalesced.
constexpr int kTransposeTile = 32;
constexpr int kTransposeRows = 8;  // threads per tile column: each moves 4 values

__global__ void __launch_bounds__(kTransposeTile* kTransposeRows)
    Transpose16Kernel(const uint16_t* __restrict__ in, int64_t rows, int64_t cols, uint16_t* __restrict__ out) {
  __shared__ uint16_t tile[kTransposeTile][kTransposeTile + 1];  // + 1: no bank conflicts on the way out
  const int64_t row0 = int64_t(blockIdx.x) * kTransposeTile, col0 = int64_t(blockIdx.y) * kTransposeTile;
  for (int i = threadIdx.y; i < kTransposeTile; i += kTransposeRows) {
    const int64_t r = row0 + i, c = col0 + threadIdx.x;
    if (r < rows && c < cols) tile[i][threadIdx.x] = in[r * cols + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTransposeTile; i += kTransposeRows) {
    const int64_t c = col0 + i, r = row0 + threadIdx.x;
    if (r < rows && c < cols) out[c * rows + r] = tile[threadIdx.x][i];
  }
}

ffi::Error Transpose16(cudaStream_t stream, const void* in, int64_t rows, int64_t cols, void* out) {
  const dim3 grid(unsigned((rows + kTransposeTile - 1) / kTransposeTile),
                  unsigned((cols + kTransposeTile - 1) / kTransposeTile));
  Transpose16Kernel<<<grid, dim3(kTransposeTile, kTransposeRows), 0, stream>>>(
      static_cast<const uint16_t*>(in), rows, cols, static_cast<uint16_t*>(out));
  return LaunchError("conv filter transpose");
}

// The workspace holds the filter (or wgrad's result) in CUTLASS's [K, R * S * C] layout; a smaller
// one than that (a non-16-bit stage's, empty) sends the stage to the baseline.
bool WorkspaceFits(const ConvGeometry& g, const ffi::AnyBuffer& workspace) {
  return workspace.size_bytes() >= size_t(g.Taps() * g.GroupChannels() * g.filters) * 2;
}

// The tensor-core forward (see conv_sm90.h): its status, or nothing when g needs another kernel.
std::optional<ffi::Error> TensorCoreFprop(cudaStream_t stream, const ConvGeometry& g, const ffi::AnyBuffer& x,
                                          const ffi::AnyBuffer& w, const void* bias, const void* residual,
                                          int64_t activation, float activation_param, ffi::AnyBuffer& y,
                                          ffi::AnyBuffer& workspace) {
  ConvSm90Problem p;
  if (!WorkspaceFits(g, workspace) || !MakeConvSm90Problem(g, x.element_type(), ConvStage::kFprop, &p)) {
    return std::nullopt;
  }
  JAXDNN_RETURN_IF_ERROR(Transpose16(stream, w.untyped_data(), g.Taps() * g.channels, g.filters,
                                     workspace.untyped_data()));
  return ConvSm90Fprop(p, x.element_type(), x.untyped_data(), workspace.untyped_data(), bias, residual,
                       int(activation), activation_param, y.untyped_data(), stream);
}

// The forward with an epilogue (the plain one passes none); `bias` and `residual` may be null.
ffi::Error LaunchFprop(cudaStream_t stream, const ConvGeometry& g, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                       const ffi::AnyBuffer* bias, const ffi::AnyBuffer* residual, int64_t activation,
                       float activation_param, ffi::AnyBuffer& y, ffi::AnyBuffer& workspace) {
  const int64_t items = g.OutPixels() * g.filters;
  if (items == 0) return ffi::Error::Success();
  if (auto status = TensorCoreFprop(stream, g, x, w, bias != nullptr ? bias->untyped_data() : nullptr,
                                    residual != nullptr ? residual->untyped_data() : nullptr, activation,
                                    activation_param, y, workspace)) {
    return std::move(*status);
  }
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
}

ffi::Error ConvFpropImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> workspace, ConvAttrs attrs) {
  ConvGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakeConvGeometry(attrs, x.dimensions(), w.dimensions(), y->dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, w, *y));
  if (g.OutPixels() * g.filters > 0) {
    if (auto status = PointwiseGemm(stream, g, x.untyped_data(), w.untyped_data(), y->untyped_data(),
                                    g.OutPixels(), g.filters, g.channels, false, false, x.element_type())) {
      return std::move(*status);
    }
  }
  return LaunchFprop(stream, g, x, w, nullptr, nullptr, 0, 0.0f, *y, *workspace);
}

ffi::Error ConvFpropFusedImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                              std::optional<ffi::AnyBuffer> residual, ffi::Result<ffi::AnyBuffer> y,
                              ffi::Result<ffi::AnyBuffer> workspace, ConvFusedAttrs attrs) {
  ConvGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakeConvGeometry(attrs.conv, x.dimensions(), w.dimensions(), y->dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, w, *y));
  JAXDNN_RETURN_IF_ERROR(CheckEpilogue(g, x, bias, residual, *y, attrs.activation));
  return LaunchFprop(stream, g, x, w, &bias, residual.has_value() ? &*residual : nullptr, attrs.activation,
                     attrs.activation_param, *y, *workspace);
}

ffi::Error ConvDgradImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> dx,
                         ffi::Result<ffi::AnyBuffer> workspace, ConvAttrs attrs) {
  ConvGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakeConvGeometry(attrs, dx->dimensions(), w.dimensions(), dy.dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(dy, w, *dx));
  const int64_t items = g.InPixels() * g.channels;
  if (items == 0) return ffi::Error::Success();
  if (auto status = PointwiseGemm(stream, g, dy.untyped_data(), w.untyped_data(), dx->untyped_data(),
                                  g.InPixels(), g.channels, g.filters, false, true, dy.element_type())) {
    return std::move(*status);
  }
  ConvSm90Problem p;
  if (g.OutPixels() > 0 && WorkspaceFits(g, *workspace) &&
      MakeConvSm90Problem(g, dy.element_type(), ConvStage::kDgrad, &p)) {
    JAXDNN_RETURN_IF_ERROR(Transpose16(stream, w.untyped_data(), g.Taps() * g.channels, g.filters,
                                       workspace->untyped_data()));
    if (auto status = ConvSm90Dgrad(p, dy.element_type(), dy.untyped_data(), workspace->untyped_data(),
                                    dx->untyped_data(), stream)) {
      return std::move(*status);
    }
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
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, dy, *dw));
  // An empty batch still writes dw (zeros): the blocks sum over no pixels.
  const int64_t rows = g.Taps() * g.GroupChannels();
  if (rows * g.filters == 0) return ffi::Error::Success();
  if (auto status = PointwiseGemm(stream, g, x.untyped_data(), dy.untyped_data(), dw->untyped_data(),
                                  g.channels, g.filters, g.InPixels(), true, false, x.element_type())) {
    return std::move(*status);
  }
  ConvSm90Problem p;
  if (g.OutPixels() > 0 && WorkspaceFits(g, *workspace) &&
      MakeConvSm90Problem(g, x.element_type(), ConvStage::kWgrad, &p)) {
    // CUTLASS writes [K, R * S * C] into the workspace; transposed into dw [R * S * C, K] after.
    if (auto status = ConvSm90Wgrad(p, x.element_type(), x.untyped_data(), dy.untyped_data(),
                                    workspace->untyped_data(), stream)) {
      JAXDNN_RETURN_IF_ERROR(std::move(*status));
      return Transpose16(stream, workspace->untyped_data(), g.filters, rows, dw->untyped_data());
    }
  }
  const int64_t blocks = std::min(kMaxBlocks, rows * ((g.filters + kWgradLanes - 1) / kWgradLanes));
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    ConvWgradKernel<T><<<int(blocks), kBlock, 0, stream>>>(g, static_cast<const T*>(x.untyped_data()),
                                                           static_cast<const T*>(dy.untyped_data()),
                                                           static_cast<T*>(dw->untyped_data()));
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
