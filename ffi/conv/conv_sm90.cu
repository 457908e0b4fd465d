// The tensor-core convolution stages as conv.cu's handlers call them: which problems the CUTLASS
// kernels of conv_sm90.cuh take (16-bit operands; the forward also float32 ones as TF32, when the
// target's tf32 attribute allows it), and the layout work around them, in the targets' workspace:
// - fprop and dgrad: the filter [R, S, C, K] transposed to CUTLASS's [K, R, S, C];
// - channel counts C % 8 != 0 (an RGB stem): x (dx) and the filter with zero channels appended up to
//   TMA's 16-byte rows;
// - strided dgrad: CUTLASS's Hopper dgrad has unit strides only, so dy goes through it with
//   stride - 1 zeros inserted between its pixels (the zero-padded dy of a unit-stride convolution
//   whose output positions o * stride are the strided one's): stride^2 times the work, but on the
//   tensor cores (jaxdnn/_conv_kernels.py sends those whose window spans the stride, 3x3/2, through
//   the convolution's space-to-depth form instead);
// - wgrad: the images split into slices whose float32 partial sums [K, R, S, C] run side by side in
//   one launch (one slice's output tiles alone would leave most SMs idle: CUTLASS's Hopper conv has
//   no split-K), then one kernel adds the slices in a fixed order (deterministic) and transposes the
//   sum to dw [R, S, C, K].
// ResNet's 64-channel 3x3 layers run every stage on the halo kernels instead (halo_sm90.h), and
// pointwise ones with 64 channels on one side their wgrad; the fprop and unit-stride dgrad of layers
// with 64k input and 128k output channels may run on the im2col kernels (im2col_sm90.h).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>

#include "common/cuda_common.cuh"
#include "conv/conv.h"
#include "conv/conv_sm90.h"
#include "conv/halo_sm90.h"
#include "conv/im2col_sm90.h"
#include "dense/gemm_sm90.h"

namespace jaxdnn {
namespace {

constexpr int kTile = 32;      // the transposes' tile: 32 x 32 values through shared memory
constexpr int kTileRows = 8;   // threads per tile column: each moves 4 values
constexpr int kBlock = 256;

// out[c, r] = in[r, c] for a row-major [rows, cols] matrix of 16-bit (T = uint16_t) or 32-bit values;
// reads and writes coalesced.
template <typename T>
__global__ void __launch_bounds__(kTile* kTileRows)
    TransposeKernel(const T* __restrict__ in, int64_t rows, int64_t cols, T* __restrict__ out) {
  __shared__ T tile[kTile][kTile + 1];  // + 1: no bank conflicts on the way out
  const int64_t row0 = int64_t(blockIdx.x) * kTile, col0 = int64_t(blockIdx.y) * kTile;
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int64_t r = row0 + i, c = col0 + threadIdx.x;
    if (r < rows && c < cols) tile[i][threadIdx.x] = in[r * cols + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int64_t c = col0 + i, r = row0 + threadIdx.x;
    if (r < rows && c < cols) out[c * rows + r] = tile[threadIdx.x][i];
  }
}

// dw[r, k] = sum over s < slices of partial[s, k, source(r)] (float32 [slices, K, R * S * Cp]),
// rounded once, for the rows r = rs * C + c of dw [R * S * C, K]: source(r) = rs * Cp + c skips the
// padding channels c >= C of a padded problem (Cp = C otherwise).
template <typename T>
__global__ void __launch_bounds__(kTile* kTileRows)
    SumTransposeKernel(const float* __restrict__ partial, int slices, int64_t rows, int64_t cols, int64_t channels,
                       int64_t padded_channels, T* __restrict__ dw) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t col0 = int64_t(blockIdx.x) * kTile, row0 = int64_t(blockIdx.y) * kTile;
  const int64_t padded_rows = rows / channels * padded_channels;
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int64_t c = col0 + i, r = row0 + threadIdx.x;
    float sum = 0.f;
    if (r < rows && c < cols) {
      const int64_t source = r / channels * padded_channels + r % channels;
      for (int s = 0; s < slices; ++s) sum += partial[(s * cols + c) * padded_rows + source];
    }
    tile[i][threadIdx.x] = sum;
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int64_t r = row0 + i, c = col0 + threadIdx.x;
    if (r < rows && c < cols) dw[r * cols + c] = FromFloat<T>(tile[threadIdx.x][i]);
  }
}

// out [pixels, to] = in [pixels, from] with its channels cut or zero-padded to `to` (T as above).
template <typename T>
__global__ void __launch_bounds__(kBlock)
    CopyChannelsKernel(const T* __restrict__ in, int64_t pixels, int64_t from, int64_t to, T* __restrict__ out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < pixels * to; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = i % to;
    out[i] = c < from ? in[i / to * from + c] : T(0);
  }
}

// wt [K, R * S, Cp] = w [R * S, C, K] transposed, its channels zero-padded to Cp (a gather: only
// padded problems, whose filters are small, take it; the others use TransposeKernel).
template <typename T>
__global__ void __launch_bounds__(kBlock)
    PaddedFilterKernel(const T* __restrict__ w, int64_t taps, int64_t channels, int64_t filters,
                       int64_t padded_channels, T* __restrict__ wt) {
  const int64_t total = filters * taps * padded_channels;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = i % padded_channels, tap = i / padded_channels % taps, k = i / (padded_channels * taps);
    wt[i] = c < channels ? w[(tap * channels + c) * filters + k] : T(0);
  }
}

// dy [N, P, Q, K] spread to [N, (P - 1) * sh + 1, (Q - 1) * sw + 1, K] with zeros between its pixels,
// 8 channels (16 bytes) at a time (the tensor-core problems have K % 8 == 0).
__global__ void __launch_bounds__(kBlock)
    InsertZerosKernel(const uint4* __restrict__ dy, int64_t n, int64_t p, int64_t q, int64_t packs, int sh, int sw,
                      uint4* __restrict__ out) {
  const int64_t hz = (p - 1) * sh + 1, wz = (q - 1) * sw + 1, total = n * hz * wz * packs;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t pack = i % packs, pixel = i / packs;
    const int64_t w = pixel % wz, h = (pixel / wz) % hz, image = pixel / (wz * hz);
    uint4 value = make_uint4(0, 0, 0, 0);
    if (h % sh == 0 && w % sw == 0) value = dy[((image * p + h / sh) * q + w / sw) * packs + pack];
    out[i] = value;
  }
}

// The bytes of a value of the tensor-core stages' dtypes: 2, or 4 for float32 (the forward's TF32).
int64_t ElementBytes(ffi::DataType dtype) { return dtype == ffi::DataType::F32 ? 4 : 2; }

// Runs `launch` with the unsigned integer type of a value of `dtype` (the layout kernels only move
// values).
template <typename Launch>
ffi::Error ForValueBits(ffi::DataType dtype, Launch launch) {
  if (ElementBytes(dtype) == 4) return launch(uint32_t{});
  return launch(uint16_t{});
}

ffi::Error Transpose(cudaStream_t stream, ffi::DataType dtype, const void* in, int64_t rows, int64_t cols,
                     void* out) {
  const dim3 grid(unsigned((rows + kTile - 1) / kTile), unsigned((cols + kTile - 1) / kTile));
  return ForValueBits(dtype, [&](auto bits) {
    using T = decltype(bits);
    TransposeKernel<T><<<grid, dim3(kTile, kTileRows), 0, stream>>>(static_cast<const T*>(in), rows, cols,
                                                                    static_cast<T*>(out));
    return LaunchError("conv filter transpose");
  });
}

int GridFor(int64_t items) { return int(std::clamp<int64_t>((items + kBlock - 1) / kBlock, 1, 1 << 20)); }

// Channels padded to TMA's 16-byte rows: a problem with C % 8 != 0 (an RGB stem) runs on copies of x
// (or dx) and of the filter with zero channels appended.
int64_t PaddedChannels(const ConvGeometry& g) { return (g.channels + 7) / 8 * 8; }
bool Padded(const ConvGeometry& g) { return g.channels % 8 != 0; }
int64_t FilterElements(const ConvGeometry& g) { return g.Taps() * PaddedChannels(g) * g.filters; }
int64_t PaddedInputElements(const ConvGeometry& g) { return Padded(g) ? g.InPixels() * PaddedChannels(g) : 0; }

ffi::Error CopyChannels(cudaStream_t stream, ffi::DataType dtype, const void* in, int64_t pixels, int64_t from,
                        int64_t to, void* out) {
  return ForValueBits(dtype, [&](auto bits) {
    using T = decltype(bits);
    CopyChannelsKernel<T><<<GridFor(pixels * to), kBlock, 0, stream>>>(static_cast<const T*>(in), pixels, from, to,
                                                                       static_cast<T*>(out));
    return LaunchError("conv channel padding");
  });
}

// The filter in CUTLASS's layout [K, R, S, Cp] at wt.
ffi::Error FilterToKrsc(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* w, void* wt) {
  if (!Padded(g)) return Transpose(stream, dtype, w, g.Taps() * g.channels, g.filters, wt);
  return ForValueBits(dtype, [&](auto bits) {
    using T = decltype(bits);
    PaddedFilterKernel<T><<<GridFor(FilterElements(g)), kBlock, 0, stream>>>(
        static_cast<const T*>(w), g.Taps(), g.channels, g.filters, PaddedChannels(g), static_cast<T*>(wt));
    return LaunchError("conv filter transpose");
  });
}

// CUTLASS's 2-D problem for g (its channels padded), when its kernels take g (see conv_sm90.h):
// 16-bit operands, or float32 ones where `tf32` allows TF32 (the forward's callers only).
bool MakeProblem(const ConvGeometry& g, ffi::DataType dtype, bool tf32, int64_t algorithm, ConvSm90Problem* p) {
  const bool sixteen_bit = dtype == ffi::DataType::BF16 || dtype == ffi::DataType::F16;
  if (!sixteen_bit && !(tf32 && dtype == ffi::DataType::F32)) return false;
  if (g.groups != 1 || g.filters % 8 != 0) return false;
  if (g.window[0] != 1 || g.stride[0] != 1 || g.pad[0] != 0 || g.in[0] != g.out[0]) return false;
  constexpr int64_t kMaxInt = INT32_MAX;
  if (g.InPixels() * PaddedChannels(g) > kMaxInt || g.OutPixels() * g.filters > kMaxInt ||
      FilterElements(g) > kMaxInt) {
    return false;
  }
  if (g.OutPixels() == 0) return false;
  *p = ConvSm90Problem{int(g.batch * g.in[0]), int(g.in[1]),     int(g.in[2]),  int(PaddedChannels(g)),
                       int(g.filters),         int(g.window[1]), int(g.window[2]), int(g.out[1]), int(g.out[2])};
  p->algorithm = algorithm;
  for (int a = 0; a < 2; ++a) {
    const int axis = a + 1;
    // TMA's im2col mode bounds the padding and the window's offsets; 64 is well inside them.
    const int64_t span = (g.window[axis] - 1) * g.rhs_dilation[axis] + 1;
    if (g.lhs_dilation[axis] != 1 || g.pad[axis] < 0 || g.pad[axis] > 64 || span > 64 || g.stride[axis] > 64) {
      return false;
    }
    // CUTLASS derives the output size from both paddings: the high one is what the output's last
    // window needs (none when the input has unread trailing pixels), and must give g's output size.
    const int64_t high = std::max<int64_t>(0, (g.out[axis] - 1) * g.stride[axis] + span - g.in[axis] - g.pad[axis]);
    if (high > 64 || (g.in[axis] + g.pad[axis] + high - span) / g.stride[axis] + 1 != g.out[axis]) return false;
    p->pad_lo[a] = int(g.pad[axis]);
    p->pad_hi[a] = int(high);
    p->stride[a] = int(g.stride[axis]);
    p->dilation[a] = int(g.rhs_dilation[axis]);
  }
  return true;
}

// Pixels of dy with zeros inserted between them (the unit-stride form of a strided dgrad).
int64_t SpreadPixels(const ConvGeometry& g) {
  return g.batch * g.out[0] * ((g.out[1] - 1) * g.stride[1] + 1) * ((g.out[2] - 1) * g.stride[2] + 1);
}
bool Strided(const ConvGeometry& g) { return g.stride[1] > 1 || g.stride[2] > 1; }

// The halo kernels run a problem they take unless `algorithm` names another kernel.
bool UsesHalo(const ConvGeometry& g, ffi::DataType dtype, int64_t algorithm) {
  return AllowsHalo(algorithm) && HaloApplies(g, dtype);
}

// The output features of the im2col kernels' tile that runs a problem (fprop, or dgrad with unit
// strides), or 0 where they do not: the one `algorithm` asks for, or the heuristic's: the im2col
// kernels wherever they apply (on an H200 they matched or beat CUTLASS's tiles on every ResNet 3x3
// layer, 2026-11-26), with the tile Im2colAutoTile picks.
int Im2colTile(const ConvGeometry& g, ffi::DataType dtype, bool dgrad, int64_t algorithm) {
  if (algorithm == kConvIm2col || algorithm == kConvIm2colWide || algorithm == kConvIm2colNarrow) {
    const int tile = algorithm == kConvIm2col ? 128 : algorithm == kConvIm2colWide ? 256 : 64;
    return Im2colApplies(g, dtype, dgrad, tile) ? tile : 0;
  }
  return algorithm == kConvAuto ? Im2colAutoTile(g, dtype, dgrad) : 0;
}

}  // namespace

// Workspace layouts (16-byte aligned pieces: every extent below is a multiple of 8 elements):
//   fprop [wt: K R S Cp][xp: N H W Cp, padded problems]
//   dgrad [wt][dy spread: N Pz Qz K, strides > 1][dxp: N H W Cp, padded problems]
//   wgrad [partials: slices x K R S Cp float32][xp, padded problems]
std::optional<ffi::Error> TensorCoreFprop(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype,
                                          const void* x, const void* w, const void* bias, const void* residual,
                                          int64_t activation, float activation_param, void* y, void* workspace,
                                          size_t workspace_bytes, int64_t algorithm, bool tf32) {
  if (UsesHalo(g, dtype, algorithm)) {
    return HaloFprop(stream, g, dtype, x, w, bias, residual, activation, activation_param, y);
  }
  if (const int tile = Im2colTile(g, dtype, false, algorithm)) {
    return Im2colFprop(stream, g, dtype, tile, x, w, bias, residual, activation, activation_param, y);
  }
  ConvSm90Problem p;
  const int64_t bytes = ElementBytes(dtype);
  const size_t need = size_t(FilterElements(g) + PaddedInputElements(g)) * bytes;
  if (!MakeProblem(g, dtype, tf32, algorithm, &p) || workspace_bytes < need) return std::nullopt;
  char* wt = static_cast<char*>(workspace);
  JAXDNN_RETURN_IF_ERROR(FilterToKrsc(stream, g, dtype, w, wt));
  // A plain float32 pointwise forward: dense's TF32 GEMM y = x . wt^T, both operands K-major, the one
  // way wgmma reads TF32 (w [C, K] itself, N-major, made the GEMM run its transposed product).
  const bool plain = bias == nullptr && residual == nullptr && activation == 0;
  if (dtype == ffi::DataType::F32 && plain && g.IsPointwise() && !Padded(g) &&
      (algorithm == kConvAuto || algorithm == kConvGemm)) {
    GemmProblem gemm{x, wt, nullptr, y, 1, g.OutPixels(), g.filters, g.channels, false, true, 0, 0.f};
    gemm.tf32 = true;
    if (auto status = GemmOnTensorCores(gemm, dtype, stream)) return status;
  }
  if (Padded(g)) {
    void* xp = wt + FilterElements(g) * bytes;
    JAXDNN_RETURN_IF_ERROR(CopyChannels(stream, dtype, x, g.InPixels(), g.channels, PaddedChannels(g), xp));
    x = xp;
  }
  return ConvSm90Fprop(p, dtype, x, wt, bias, residual, int(activation), activation_param, y, stream);
}

std::optional<ffi::Error> TensorCoreDgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype,
                                          const void* dy, const void* w, void* dx, void* workspace,
                                          size_t workspace_bytes, int64_t algorithm) {
  if (UsesHalo(g, dtype, algorithm)) return HaloDgrad(stream, g, dtype, dy, w, dx);
  if (const int tile = Im2colTile(g, dtype, true, algorithm)) {
    return Im2colDgrad(stream, g, dtype, tile, dy, w, dx);
  }
  // The unit-stride problem over the zero-inserted dy (the same one when the strides are 1).
  ConvGeometry unit = g;
  for (int a = 1; a < 3; ++a) {
    unit.out[a] = (g.out[a] - 1) * g.stride[a] + 1;
    unit.stride[a] = 1;
  }
  ConvSm90Problem p;
  const int64_t spread = Strided(g) ? SpreadPixels(g) * g.filters : 0;
  const size_t need = size_t(FilterElements(g) + spread + PaddedInputElements(g)) * 2;
  if (!MakeProblem(unit, dtype, /*tf32=*/false, algorithm, &p) || workspace_bytes < need) return std::nullopt;
  char* wt = static_cast<char*>(workspace);
  JAXDNN_RETURN_IF_ERROR(FilterToKrsc(stream, g, dtype, w, wt));
  if (Strided(g)) {
    uint4* spread_dy = reinterpret_cast<uint4*>(wt + FilterElements(g) * 2);
    InsertZerosKernel<<<GridFor(spread / 8), kBlock, 0, stream>>>(static_cast<const uint4*>(dy), g.batch * g.out[0],
                                                                  g.out[1], g.out[2], g.filters / 8, int(g.stride[1]),
                                                                  int(g.stride[2]), spread_dy);
    JAXDNN_RETURN_IF_ERROR(LaunchError("conv dgrad zero insertion"));
    dy = spread_dy;
  }
  void* dxp = Padded(g) ? wt + (FilterElements(g) + spread) * 2 : dx;
  auto status = ConvSm90Dgrad(p, dtype, dy, wt, dxp, stream);
  if (!status.has_value() || status->failure() || !Padded(g)) return status;
  return CopyChannels(stream, dtype, dxp, g.InPixels(), PaddedChannels(g), g.channels, dx);
}

std::optional<ffi::Error> TensorCoreWgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype,
                                          const void* x, const void* dy, ffi::DataType dw_dtype, void* dw,
                                          void* workspace, size_t workspace_bytes, int64_t algorithm) {
  ConvSm90Problem p;
  const size_t slice_bytes = size_t(FilterElements(g)) * sizeof(float);
  const size_t padded_bytes = size_t(PaddedInputElements(g)) * 2;
  const int64_t rows = g.Taps() * g.channels, cols = g.filters;
  if (!MakeProblem(g, dtype, /*tf32=*/false, algorithm, &p) || workspace_bytes < slice_bytes + padded_bytes ||
      rows > int64_t(kTile) * 65535) {
    return std::nullopt;
  }
  float* partial = static_cast<float*>(workspace);
  const size_t halo_bytes = size_t(kHaloWgradSlices + kHaloWgradGroups) * slice_bytes;
  if (workspace_bytes >= halo_bytes) {  // as the Python side sized it
    if (AllowsHalo(algorithm) && HaloWgradApplies(g, dtype)) {
      return HaloWgrad(stream, g, dtype, x, dy, partial, dw_dtype, dw);
    }
    if (AllowsHalo(algorithm) && PointwiseWgradApplies(g, dtype)) {
      return PointwiseWgrad(stream, g, dtype, x, dy, partial, dw_dtype, dw);
    }
  }
  // As many slices as the workspace holds partial sums (the Python side sizes it), at most one per image.
  const int slices = int(std::min<int64_t>(
      {int64_t((workspace_bytes - padded_bytes) / slice_bytes), int64_t(p.n), int64_t(kWgradMaxSlices)}));
  if (Padded(g)) {
    void* xp = static_cast<char*>(workspace) + slices * slice_bytes;
    JAXDNN_RETURN_IF_ERROR(CopyChannels(stream, dtype, x, g.InPixels(), g.channels, PaddedChannels(g), xp));
    x = xp;
  }
  auto status = ConvSm90Wgrad(p, dtype, x, dy, partial, slices, stream);
  if (!status.has_value() || status->failure()) return status;
  const dim3 grid(unsigned((cols + kTile - 1) / kTile), unsigned((rows + kTile - 1) / kTile));
  const dim3 block(kTile, kTileRows);
  return DispatchFloat<float, __nv_bfloat16, __half>(dw_dtype, "dw", [&](auto type_tag) {
    using D = decltype(type_tag);
    SumTransposeKernel<<<grid, block, 0, stream>>>(partial, slices, rows, cols, g.channels, PaddedChannels(g),
                                                   static_cast<D*>(dw));
    return LaunchError("conv wgrad slice sum");
  });
}

}  // namespace jaxdnn
