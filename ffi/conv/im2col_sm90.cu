// The im2col kernels (see im2col_sm90.h) on Hopper's tensor cores (wgmma, TMA).
//
// The GEMM view: out[m][n] = sum over the taps t = (r, s) and the input channels c of
// in[the pixel output position m reads through t][c] * B_t[c][n], with M the output positions
// (N P Q), N the output channels, and the reduction walked a tap and 64 channels at a time.
// - fprop: in = x, B_t = w[r, s] ([C, K], K contiguous: MN-major), out = y with the epilogue.
// - dgrad (unit strides): in = dy, out = dx, and B_t = w[R - 1 - r, S - 1 - s] read as [C, K] with K
//   the reduction (K-major): dx[h, w] = sum over (r, s, k) of dy[h + lower + r d, w + lower + s d, k]
//   w[R - 1 - r, S - 1 - s, c, k], lower = pad - (R - 1) d, as CUTLASS's dgrad runs it.
//
// A tile is kRows consecutive output positions x kN output channels. The CTAs are persistent (one
// an SM) and take the tiles in turn. One thread of a producer warpgroup fills a ring of stages that
// runs across tiles: A = TMA im2col boxes of 128 positions x 64 channels (the copy engine walks the
// positions across rows and images, padding zero-filled), B = the tap's 64 x kN slice of w; two
// consumer warpgroups each multiply their half of A's rows (kBlocks m64 blocks) by B, float32 sums
// in registers. The epilogue (bias, residual, activation) goes through a shared-memory tile of its
// own and a TMA store, which completes while the next tile's products run; the producer loads the
// next tile's first stages during the epilogue. (One CTA a tile, with the result in the stages'
// place, paid each tile's pipeline fill and epilogue in full: a 3x3 64 -> 128 layer's tile has only
// 9 steps.)
//
// As in halo_sm90.cu: no wgmma under a branch on a thread-derived value (sm90::WarpgroupIndex), and
// the first product overwrites its accumulators, so that ptxas does not serialize them.
#include <cuda.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <string>

#include "common/cuda_common.cuh"
#include "common/sm90_async.cuh"
#include "conv/conv_epilogue.h"
#include "conv/im2col_sm90.h"
#include "conv/sm90_maps.h"

namespace jaxdnn {
namespace {

constexpr int kChunk = 64;                  // channels of a reduction step: a 128-byte swizzled row a pixel
constexpr int kChunkBytes = kChunk * 2;
constexpr int kWarpgroup = 128;
constexpr int kConsumers = 2;
constexpr int kThreads = (kConsumers + 1) * kWarpgroup;  // and a producer warpgroup (one thread issues)
constexpr int kMaxShared = 227 * 1024;      // an SM's shared memory for one block
// Registers a thread: the producer gives its own up to the consumers, whose 128 accumulators and
// epilogue need more than the 168 an even split leaves (which spilled 104-120 bytes). A kernel with
// wgmma gets registers for whole warpgroups, so a lone producer warp would not save any.
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;
static_assert(kConsumers * kWarpgroup * kConsumerRegisters + kWarpgroup * kProducerRegisters <= 65536);
constexpr int kBoxPixels = 128;             // output positions of one im2col box
constexpr int kMaxCorner = 127;             // TMA's im2col bounding box corners of a 2-D window: int8
constexpr int kMaxOffset = 255;             // ... and its per-tap offsets: uint8

// A tile of kN output channels x kRows output positions: each warpgroup takes kBlocks m64 blocks,
// 32 kBlocks kN / 64 accumulators a thread (128 in the tiles of 256 x 128 and 128 x 256, 64 in
// 128 x 128 and 256 x 64). The ring has as many stages as fit beside the result tile, at most 6 (3
// of 48 KiB in the large tiles, 6 of 32 KiB in 128 x 128, 4 of 40 KiB in 256 x 64).
template <int kN, int kBlocks>
struct Tile {
  static constexpr int kGroupRows = 64 * kBlocks;
  static constexpr int kRows = kConsumers * kGroupRows;  // output positions a CTA
  static constexpr int kABytes = kRows * kChunkBytes;
  static constexpr int kStageBytes = kABytes + kN * kChunkBytes;
  static constexpr int kResultBytes = kRows * kN * 2;
  static constexpr int kBarrierBytes = 2 * 6 * 8 + 1024;  // the ring's barriers and the alignment's slack
  static constexpr int kStages = std::min(6, (kMaxShared - kResultBytes - kBarrierBytes) / kStageBytes);
  static constexpr int kShared = kStages * kStageBytes + kResultBytes + kBarrierBytes;
  static_assert(kStages >= 3, "a ring of at least 3 stages");
  static_assert(kRows % kBoxPixels == 0, "whole im2col boxes");
};

// The implicit GEMM's gather: in [batch][in_h][in_w][in_c] read by out [batch][out_h][out_w][out_c]
// through taps_h x taps_w taps. Output position (p, q) reads in's pixel (lower_h + p stride_h +
// r dilation_h, lower_w + q stride_w + s dilation_w) through tap (r, s).
struct Gather {
  int batch, in_h, in_w, in_c;
  int out_h, out_w, out_c;
  int taps_h, taps_w;
  int lower_h, lower_w;
  int stride_h, stride_w;
  int dilation_h, dilation_w;
  int pixels;  // batch out_h out_w
  // The bounding box's upper corners (TMA's convention: the last window start is in - 1 + upper).
  int UpperH() const { return lower_h + (out_h - 1) * stride_h - in_h + 1; }
  int UpperW() const { return lower_w + (out_w - 1) * stride_w - in_w + 1; }
};

Gather MakeGather(const ConvGeometry& g, bool dgrad) {
  Gather v{};
  v.batch = int(g.batch * g.in[0]);
  const int64_t* in = dgrad ? g.out : g.in;
  const int64_t* out = dgrad ? g.in : g.out;
  v.in_h = int(in[1]);
  v.in_w = int(in[2]);
  v.in_c = int(dgrad ? g.filters : g.channels);
  v.out_h = int(out[1]);
  v.out_w = int(out[2]);
  v.out_c = int(dgrad ? g.channels : g.filters);
  v.taps_h = int(g.window[1]);
  v.taps_w = int(g.window[2]);
  v.dilation_h = int(g.rhs_dilation[1]);
  v.dilation_w = int(g.rhs_dilation[2]);
  v.stride_h = dgrad ? 1 : int(g.stride[1]);
  v.stride_w = dgrad ? 1 : int(g.stride[2]);
  v.lower_h = int(dgrad ? g.pad[1] - (g.window[1] - 1) * g.rhs_dilation[1] : -g.pad[1]);
  v.lower_w = int(dgrad ? g.pad[2] - (g.window[2] - 1) * g.rhs_dilation[2] : -g.pad[2]);
  v.pixels = int(g.batch * g.in[0] * out[1] * out[2]);
  return v;
}

// The epilogue of one m64 block of a warpgroup's accumulators (thread t's element i: row `row` +
// 8 ((i >> 1) & 1), column 8 (i >> 2) + `col` + (i & 1), as sm90::Wgmma lays them out), 64 columns
// at a time: act(acc + bias + residual) rounded once into the warpgroup's result tile, chunks of
// [group_rows][64] as TMA's 128-byte swizzle lays them out. `position` is the block's first output
// position, `feature` the tile's first output channel.
template <typename T, int kN>
__device__ __forceinline__ void StageBlock(const float (&acc)[kN / 2], const ConvEpilogue<T>& epilogue, int pixels,
                                           int out_c, int position, int feature, int row, int col, int group_rows,
                                           uint8_t* block_tile) {
#pragma unroll
  for (int part = 0; part < kN / 64; ++part) {
    float v[32];
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      v[j] = acc[32 * part + j];
      if (epilogue.bias != nullptr) v[j] += ToFloat(epilogue.bias[feature + 64 * part + 8 * (j >> 2) + col + (j & 1)]);
    }
    if (epilogue.residual != nullptr) {
#pragma unroll
      for (int j = 0; j < 32; j += 2) {
        const int q = row + 8 * ((j >> 1) & 1), k = feature + 64 * part + 8 * (j >> 2) + col;
        if (position + q < pixels) {
          const T* at = epilogue.residual + int64_t(position + q) * out_c + k;
          const uint32_t pair = *reinterpret_cast<const uint32_t*>(at);
          const T* two = reinterpret_cast<const T*>(&pair);
          v[j] += ToFloat(two[0]);
          v[j + 1] += ToFloat(two[1]);
        }
      }
    }
    if (epilogue.activation != 0) ActivateKindN<32>(epilogue.activation, v, epilogue.activation_param);
    uint8_t* chunk = block_tile + part * group_rows * kChunkBytes;
#pragma unroll
    for (int j = 0; j < 32; j += 2) {
      const int q = row + 8 * ((j >> 1) & 1), k = 8 * (j >> 2) + col;
      *reinterpret_cast<uint32_t*>(chunk + q * kChunkBytes + ((k / 8) ^ (q % 8)) * 16 + k % 8 * 2) =
          sm90::PackPair<T>(v[j], v[j + 1]);
    }
  }
}

template <typename T, int kN, int kBlocks, bool kDgrad>
__global__ void __launch_bounds__(kThreads, 1)
    Im2colKernel(const __grid_constant__ CUtensorMap in_map, const __grid_constant__ CUtensorMap w_map,
                 const __grid_constant__ CUtensorMap out_map, Gather g, ConvEpilogue<T> epilogue, int row_tiles,
                 int tiles) {
  using Shape = Tile<kN, kBlocks>;
  constexpr int kStages = Shape::kStages;
  extern __shared__ uint8_t shared_raw[];
  uint8_t* stages = sm90::AlignedShared(shared_raw);
  uint8_t* result = stages + kStages * Shape::kStageBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(result + Shape::kResultBytes);
  uint64_t* empty = full + kStages;
  const int chunks = g.in_c / kChunk, taps = g.taps_h * g.taps_w, steps = taps * chunks;
  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) sm90::InitRing<kStages>(full, empty, kConsumers);
  __syncthreads();
  // Tile t: output positions from (t % row_tiles) kRows, output channels from (t / row_tiles) kN.
  // e counts stage uses across the CTA's tiles (the ring's phases).

  if (warp >= kConsumers * 4) {  // the producer warpgroup
    sm90::RegistersDecrease<kProducerRegisters>();
    if (threadIdx.x != kConsumers * kWarpgroup) return;
    constexpr int kBoxes = Shape::kRows / kBoxPixels;
    int e = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      const int first_position = t % row_tiles * Shape::kRows, first_feature = t / row_tiles * kN;
      int box_w[kBoxes], box_h[kBoxes], box_n[kBoxes];  // where each box's first window starts
#pragma unroll
      for (int i = 0; i < kBoxes; ++i) {
        const int m = first_position + i * kBoxPixels, image = g.out_h * g.out_w;
        const int n = m / image, p = (m - n * image) / g.out_w, q = m - n * image - p * g.out_w;
        box_n[i] = n;
        box_h[i] = g.lower_h + p * g.stride_h;
        box_w[i] = g.lower_w + q * g.stride_w;
      }
      for (int step = 0; step < steps; ++step, ++e) {
        sm90::WaitEmpty<kStages>(empty, e);
        uint8_t* a = stages + e % kStages * Shape::kStageBytes;
        uint8_t* b = a + Shape::kABytes;
        uint64_t* bar = &full[e % kStages];
        const int tap = step / chunks, chunk = step - tap * chunks;
        const int r = tap / g.taps_w, s = tap - r * g.taps_w;
        sm90::BarrierArriveExpectTx(bar, Shape::kStageBytes);
#pragma unroll
        for (int i = 0; i < kBoxes; ++i) {
          sm90::TmaLoadIm2col4d(a + i * kBoxPixels * kChunkBytes, &in_map, bar, chunk * kChunk, box_w[i], box_h[i],
                                box_n[i], uint16_t(s * g.dilation_w), uint16_t(r * g.dilation_h));
        }
        if (kDgrad) {  // rows c of the flipped tap, the 64 columns k of this chunk
          sm90::TmaLoad4d(b, &w_map, bar, 0, chunk, (taps - 1 - tap) * g.out_c + first_feature, 0);
        } else {  // rows c of this chunk, the kN columns k in 64-column chunks
#pragma unroll
          for (int j = 0; j < kN / 64; ++j) {
            sm90::TmaLoad4d(b + j * kChunk * kChunkBytes, &w_map, bar, 0, first_feature / 64 + j,
                            tap * g.in_c + chunk * kChunk, 0);
          }
        }
      }
    }
    return;
  }

  sm90::RegistersIncrease<kConsumerRegisters>();
  const int group = sm90::WarpgroupIndex();
  const bool leader = threadIdx.x % kWarpgroup == 0;  // releases stages, issues the result's stores
  uint8_t* tile = result + group * Shape::kGroupRows * kN * 2;  // this warpgroup's rows of the result
  const int lane = threadIdx.x % 32, row = 16 * (warp % 4) + lane / 4, col = 2 * (lane % 4);
  int e = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int first_position = t % row_tiles * Shape::kRows, first_feature = t / row_tiles * kN;
    float acc[kBlocks][kN / 2];  // set by the tile's first product (accumulate off)
    for (int step = 0; step < steps; ++step, ++e) {
      sm90::WaitFull<kStages>(full, e);
      const uint8_t* a = stages + e % kStages * Shape::kStageBytes + group * Shape::kGroupRows * kChunkBytes;
      const uint8_t* b = stages + e % kStages * Shape::kStageBytes + Shape::kABytes;
      sm90::WgmmaFence();
#pragma unroll
      for (int k = 0; k < kChunk / 16; ++k) {
        const uint64_t bd = kDgrad ? sm90::DescriptorKMajor(b + k * 32)
                                   : sm90::DescriptorMNMajor(b + k * 16 * kChunkBytes, kChunk * kChunkBytes);
#pragma unroll
        for (int block = 0; block < kBlocks; ++block) {
          const uint64_t ad = sm90::DescriptorKMajor(a + block * 64 * kChunkBytes + k * 32);
          sm90::Wgmma<kN, T>::template SS<kDgrad ? 0 : 1>(acc[block], ad, bd, step + k > 0);
        }
      }
      sm90::WgmmaCommit();
#pragma unroll
      for (int block = 0; block < kBlocks; ++block) sm90::FenceRegisters(acc[block]);
      sm90::WgmmaWait<1>();  // the previous use's products are done: its stage may be refilled
#pragma unroll
      for (int block = 0; block < kBlocks; ++block) sm90::FenceRegisters(acc[block]);
      if (step > 0 && leader) sm90::BarrierArrive(&empty[(e - 1) % kStages]);
    }
    sm90::WgmmaWait<0>();
#pragma unroll
    for (int block = 0; block < kBlocks; ++block) sm90::FenceRegisters(acc[block]);
    if (leader) {
      sm90::BarrierArrive(&empty[(e - 1) % kStages]);  // the tile's last stage
      sm90::BulkWaitReads();  // the previous tile's stores have read the result tile
    }
    sm90::NamedBarrierSync(2 + group, kWarpgroup);
    const int group_position = first_position + group * Shape::kGroupRows;
#pragma unroll
    for (int block = 0; block < kBlocks; ++block) {
      StageBlock<T, kN>(acc[block], epilogue, g.pixels, g.out_c, group_position + block * 64, first_feature, row, col,
                        Shape::kGroupRows, tile + block * 64 * kChunkBytes);
    }
    sm90::FenceProxyAsync();
    sm90::NamedBarrierSync(2 + group, kWarpgroup);
    if (leader) {
#pragma unroll
      for (int j = 0; j < kN / 64; ++j) {
        sm90::TmaStore4d(&out_map, tile + j * Shape::kGroupRows * kChunkBytes, 0, first_feature / 64 + j,
                         group_position, 0);
      }
    }
  }
  if (leader) sm90::BulkWaitAll();
}

// --- launchers -----------------------------------------------------------------------------------

// in [batch][in_h][in_w][in_c] for im2col boxes of kBoxPixels positions x 64 channels.
CUresult MakeIm2colMap(CUtensorMap* map, const void* data, ffi::DataType dtype, const Gather& g) {
  const cuuint64_t dims[4] = {cuuint64_t(g.in_c), cuuint64_t(g.in_w), cuuint64_t(g.in_h), cuuint64_t(g.batch)};
  const cuuint64_t pixel = cuuint64_t(g.in_c) * 2;
  const cuuint64_t strides[3] = {pixel, pixel * g.in_w, pixel * g.in_w * g.in_h};
  const int lower[2] = {g.lower_w, g.lower_h};
  const int upper[2] = {g.UpperW(), g.UpperH()};
  const cuuint32_t element_strides[4] = {1, cuuint32_t(g.stride_w), cuuint32_t(g.stride_h), 1};
  return cuTensorMapEncodeIm2col(map, TensorMapType(dtype), 4, const_cast<void*>(data), dims, strides, lower, upper, kChunk,
                                 kBoxPixels, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

template <bool kDgrad, int kN, int kBlocks>
ffi::Error Launch(cudaStream_t stream, const ConvGeometry& cg, ffi::DataType dtype, const void* in, const void* w,
                  const void* bias, const void* residual, int64_t activation, float activation_param, void* out) {
  using Shape = Tile<kN, kBlocks>;
  const char* stage = kDgrad ? "conv dgrad (im2col)" : "conv fprop (im2col)";
  const Gather g = MakeGather(cg, kDgrad);
  const int taps = g.taps_h * g.taps_w;
  const int64_t filters = cg.filters, channels = cg.channels;  // w [taps C rows][K / 64][64]
  CUtensorMap in_map, w_map, out_map;
  if (MakeIm2colMap(&in_map, in, dtype, g) != CUDA_SUCCESS ||
      MakeChunkedMap(&w_map, w, dtype, taps * channels, filters / 64, kDgrad ? kN : 64, 1) != CUDA_SUCCESS ||
      MakeChunkedMap(&out_map, out, dtype, g.pixels, g.out_c / 64, Shape::kGroupRows, 1) != CUDA_SUCCESS) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxdnn: ") + stage + ": cannot encode a TMA descriptor");
  }
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    const auto kernel = Im2colKernel<T, kN, kBlocks, kDgrad>;
    JAXDNN_RETURN_IF_ERROR(
        CudaError(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Shape::kShared), stage));
    const ConvEpilogue<T> epilogue{static_cast<const T*>(bias), static_cast<const T*>(residual), activation,
                                   activation_param};
    const int row_tiles = (g.pixels + Shape::kRows - 1) / Shape::kRows, tiles = row_tiles * (g.out_c / kN);
    const int ctas = std::min(tiles, ResidentBlocks(kernel, kThreads, Shape::kShared));
    kernel<<<ctas, kThreads, Shape::kShared, stream>>>(in_map, w_map, out_map, g, epilogue, row_tiles, tiles);
    return LaunchError(stage);
  };
  return dtype == ffi::DataType::BF16 ? launch(__nv_bfloat16{}) : launch(__half{});
}

// The heuristic's cost of a tile shape: the rounds of persistent CTAs (one an SM) the tiles take,
// times a tile's outputs. A tile's time is about proportional to its outputs, and the last round
// runs whether it is full or not (ResNet's 14x14 256 -> 256: 196 tiles of 128 x 256 on 132 SMs
// take two rounds, 392 of 128 x 128 three rounds of half the work).
int64_t TileCost(const Gather& g, int rows, int features, int sms) {
  const int64_t tiles = (int64_t(g.pixels) + rows - 1) / rows * (g.out_c / features);
  return (tiles + sms - 1) / sms * rows * features;
}

// Whether cost a is at least 10% below cost b: the smaller tile must win by that much, since the
// larger one's products run at a higher rate (a 1-D layer of 512000 positions, 128 -> 128: 2000
// tiles of 256 x 128 cost 3% more than 4000 of 128 x 128).
bool Cheaper(int64_t a, int64_t b) { return 10 * a < 9 * b; }

// Whether a tile of 128 features takes 128 positions rather than 256.
bool NarrowRows(const Gather& g, int sms) { return Cheaper(TileCost(g, 128, 128, sms), TileCost(g, 256, 128, sms)); }

template <bool kDgrad>
ffi::Error LaunchTile(cudaStream_t stream, const ConvGeometry& cg, ffi::DataType dtype, int tile_features,
                      const void* in, const void* w, const void* bias, const void* residual, int64_t activation,
                      float activation_param, void* out) {
  if (tile_features == 256) {
    return Launch<kDgrad, 256, 1>(stream, cg, dtype, in, w, bias, residual, activation, activation_param, out);
  }
  if (tile_features == 64) {
    return Launch<kDgrad, 64, 2>(stream, cg, dtype, in, w, bias, residual, activation, activation_param, out);
  }
  if (NarrowRows(MakeGather(cg, kDgrad), SmCount())) {
    return Launch<kDgrad, 128, 1>(stream, cg, dtype, in, w, bias, residual, activation, activation_param, out);
  }
  return Launch<kDgrad, 128, 2>(stream, cg, dtype, in, w, bias, residual, activation, activation_param, out);
}

}  // namespace

bool Im2colApplies(const ConvGeometry& g, ffi::DataType dtype, bool dgrad, int tile_features) {
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) return false;
  if (tile_features != 64 && tile_features != 128 && tile_features != 256) return false;
  if (g.groups != 1 || g.window[0] != 1 || g.stride[0] != 1 || g.pad[0] != 0 || g.in[0] != g.out[0]) return false;
  const int64_t in_c = dgrad ? g.filters : g.channels, out_c = dgrad ? g.channels : g.filters;
  if (in_c <= 0 || in_c % kChunk != 0 || out_c % tile_features != 0) return false;  // no empty reduction
  for (int a = 1; a < 3; ++a) {
    if (g.lhs_dilation[a] != 1 || g.stride[a] > 8 || (dgrad && g.stride[a] != 1)) return false;
    if ((g.window[a] - 1) * g.rhs_dilation[a] > kMaxOffset || g.pad[a] > kMaxCorner) return false;
  }
  const int64_t pixels = g.batch * g.in[0] * (dgrad ? g.in[1] * g.in[2] : g.out[1] * g.out[2]);
  if (pixels <= 0 || g.InPixels() * g.channels >= INT_MAX || g.OutPixels() * g.filters >= INT_MAX ||
      pixels >= INT_MAX - 256 || g.Taps() * g.channels >= INT_MAX) {
    return false;
  }
  const Gather v = MakeGather(g, dgrad);
  for (const int corner : {v.lower_h, v.lower_w, v.UpperH(), v.UpperW()}) {
    if (corner < -kMaxCorner - 1 || corner > kMaxCorner) return false;
  }
  return IsHopper();
}

int Im2colAutoTile(const ConvGeometry& g, ffi::DataType dtype, bool dgrad) {
  // (a multiple of 256 output channels is one of 128; 64 is left for the rest, with windows of more
  // than one tap: the fused 1x1 forwards, on CUTLASS's tiles, have not been measured against it)
  if (!Im2colApplies(g, dtype, dgrad, 128)) return g.Taps() > 1 && Im2colApplies(g, dtype, dgrad, 64) ? 64 : 0;
  if (!Im2colApplies(g, dtype, dgrad, 256)) return 128;
  const Gather v = MakeGather(g, dgrad);
  const int sms = SmCount();
  const int64_t narrow = TileCost(v, NarrowRows(v, sms) ? 128 : 256, 128, sms);
  return Cheaper(narrow, TileCost(v, 128, 256, sms)) ? 128 : 256;
}

ffi::Error Im2colFprop(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, int tile_features,
                       const void* x, const void* w, const void* bias, const void* residual, int64_t activation,
                       float activation_param, void* y) {
  return LaunchTile<false>(stream, g, dtype, tile_features, x, w, bias, residual, activation, activation_param, y);
}

ffi::Error Im2colDgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, int tile_features,
                       const void* dy, const void* w, void* dx) {
  return LaunchTile<true>(stream, g, dtype, tile_features, dy, w, nullptr, nullptr, 0, 0.f, dx);
}

}  // namespace jaxdnn
