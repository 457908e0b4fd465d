// Grouped convolution kernels (grouped.h): implicit GEMMs on mma.sync (m16n8k16, 16-bit operands,
// float32 sums), one small product per group, operands staged in shared memory by cp.async.
//
// Both kernels work on pixel tiles: up to 128 output pixels of one image, `rows` whole output rows
// (or a run of `cols` columns of them where rows are wider than 64), or several whole images where
// each has at most 64 output pixels, and the tile's halo: the input
// pixels its windows read, loaded once for every tap (a tap is an offset into the halo), with one
// extra pixel of zeros that the wgrad's pixels past the tile's end read. A block takes 64 features
// (64 / W groups of W = Cg = Kg) and their groups' 64 channels; a pixel's 64 values are 8 16-byte
// chunks in a shared-memory row of 9 (kRowBytes: the 8 rows an ldmatrix reads, consecutive pixels,
// fall in different banks). Each lane's ldmatrix addresses are worked out once a tile; a tap adds
// one offset (H200, ResNeXt-50's 14^2 layer: the integer work of XOR-swizzled addresses per load
// kept the ALU pipe the busiest and the tensor cores mostly idle).
//
// Forward (GroupedFpropKernel): a block keeps its features' filter [taps, W, 64] in shared memory
// and walks pixel tiles (a fixed stride of them: blocks of one feature tile share its filter), the
// next tile's halo loading while it multiplies the current one. Its 8 warps take 32 pixels x 32
// features each; for each tap and 16 channels of a group, a warp multiplies its pixels' values
// (ldmatrix rows: one pixel each, anywhere in the halo) by the group's filter columns
// (ldmatrix.trans), and writes its sums through the epilogue.
// dgrad (unit strides) is this forward on dy with the filter flipped and each group's W x W block
// transposed (FlipGroupsKernel, into the workspace), padding (window - 1) * dilation - pad.
// wgrad (GroupedWgradKernel): dw[tap, c, k] = sum over output pixels of x[pixel through tap, c] *
// dy[pixel, k], c and k of one group. A block takes 64 features, up to 160 / W taps and a slice of
// the pixel tiles; per tile it stages the halo and the tile's dy rows, and each warp sums its
// 16 x 16 tiles (16 channels x 16 features of a group, for a tap) over the tile's pixels, 16 at a
// time, with x transposed by ldmatrix.trans. The slices' float32 partial sums land in the workspace
// and SumSlicesKernel (cuda_common.cuh) adds them in order. No atomics: the results are deterministic.
#include "conv/grouped.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <utility>

#include "common/cuda_common.cuh"
#include "conv/conv_epilogue.h"

namespace jaxdnn {
namespace {

constexpr int kThreads = 256;               // 8 warps
constexpr int kFeatures = 64;               // a block's features, and their groups' channels
constexpr int kPixelChunks = kFeatures / 8; // 16-byte chunks of a pixel's 64 values
constexpr int kRowChunks = kPixelChunks + 1;  // a pixel's row in shared memory, one chunk of padding
constexpr uint32_t kRowBytes = 16 * kRowChunks;
constexpr int kTilePixels = 128;            // output pixels a tile, at most
constexpr int kMaxReach = 8;                // (window - 1) * dilation on H and W
constexpr int kMaxHaloPixels = 384;         // a halo's, its zero pixel included (54 KB)
constexpr int kMaxFilterRows = 640;         // taps * W of the forward's resident filter (90 KB)
constexpr int kWgradTapChannels = 160;      // wgrad: taps * W a block (its sums: 40 floats a thread)
constexpr int64_t kSizeLimit = 1 << 24;     // sizes and pads the int coordinates take

// The 2-D problem a kernel sees: the depth folded into the batch; unit strides.
struct GroupedShape {
  int64_t images;             // N * D
  int height, width;          // the input's
  int out_height, out_width;  // the output's
  int window_h, window_w;
  int pad_h, pad_w;           // low padding (may be negative)
  int dilation_h, dilation_w;
  int channels;               // C == K

  __host__ __device__ int Taps() const { return window_h * window_w; }
  __host__ __device__ int ReachH() const { return (window_h - 1) * dilation_h; }
  __host__ __device__ int ReachW() const { return (window_w - 1) * dilation_w; }
};

GroupedShape ShapeOf(const ConvGeometry& g) {
  return GroupedShape{g.batch * g.in[0], int(g.in[1]),  int(g.in[2]),  int(g.out[1]),
                      int(g.out[2]),     int(g.window[1]), int(g.window[2]), int(g.pad[1]),
                      int(g.pad[2]),     int(g.rhs_dilation[1]), int(g.rhs_dilation[2]), int(g.channels)};
}

// The forward over dy that dgrad is: the input and output sides swapped, the padding mirrored.
GroupedShape DgradShapeOf(const ConvGeometry& g) {
  GroupedShape s = ShapeOf(g);
  std::swap(s.height, s.out_height);
  std::swap(s.width, s.out_width);
  s.pad_h = s.ReachH() - s.pad_h;
  s.pad_w = s.ReachW() - s.pad_w;
  return s;
}

// How a problem's output pixels split into tiles: `rows` x `cols` pixels of an image (the last row
// and column blocks of an image may be smaller), or, where an image's output fills at most half a
// tile, `images` whole images a tile (the last tile may hold fewer), and the halo every tile loads:
// `halo_rows` x `halo_cols` pixels an image, the images' halos one after the other, then the zero
// pixel. (ResNeXt's 7^2 layers: two images, 98 pixels a tile, where one left half the forward's
// warps without pixels.)
struct Tiling {
  int rows, cols;
  int row_blocks, col_blocks;  // of an image
  int images;                  // a tile's
  int halo_rows, halo_cols;
  int64_t tiles;

  __host__ __device__ int ZeroPixel() const { return images * halo_rows * halo_cols; }
  __host__ __device__ int HaloPixels() const { return ZeroPixel() + 1; }
};

Tiling TilingOf(const GroupedShape& s) {
  Tiling t;
  const int col_blocks = (s.out_width + 63) / 64;
  t.cols = (s.out_width + col_blocks - 1) / col_blocks;
  t.rows = std::max(1, std::min(s.out_height, kTilePixels / t.cols));
  // Smaller tiles until the halo fits (a window's reach is at most kMaxReach: 1 x 1 always does).
  while ((t.rows + s.ReachH()) * (t.cols + s.ReachW()) + 1 > kMaxHaloPixels) {
    if (t.rows > 1) {
      --t.rows;
    } else {
      t.cols = (t.cols + 1) / 2;
    }
  }
  t.row_blocks = (s.out_height + t.rows - 1) / t.rows;
  t.rows = (s.out_height + t.row_blocks - 1) / t.row_blocks;  // even blocks
  t.col_blocks = (s.out_width + t.cols - 1) / t.cols;
  t.cols = (s.out_width + t.col_blocks - 1) / t.col_blocks;
  t.halo_rows = t.rows + s.ReachH();
  t.halo_cols = t.cols + s.ReachW();
  t.images = 1;
  if (t.row_blocks == 1 && t.col_blocks == 1) {
    const int64_t fit = std::min(kTilePixels / (t.rows * t.cols), (kMaxHaloPixels - 1) / (t.halo_rows * t.halo_cols));
    t.images = int(std::max<int64_t>(1, std::min(fit, s.images)));
  }
  t.tiles = (s.images + t.images - 1) / t.images * t.row_blocks * t.col_blocks;
  return t;
}

// One tile's place: its first image's offset in the input, its first output pixel, its size (whole
// images: rows x cols an image), and the input coordinates of its halo's first pixel.
struct PixelTile {
  int64_t image_offset;  // of the input image, in elements
  int64_t first_pixel;   // the output pixel index of the tile's (0, 0)
  int rows, cols, images, count;
  int h0, w0;
};

__device__ __forceinline__ PixelTile TileAt(const GroupedShape& s, const Tiling& t, int64_t index) {
  PixelTile tile;
  const int col_block = int(index % t.col_blocks);
  const int64_t rest = index / t.col_blocks;
  const int row_block = int(rest % t.row_blocks);
  const int64_t image = rest / t.row_blocks * t.images;
  const int p0 = row_block * t.rows, q0 = col_block * t.cols;
  tile.rows = min(t.rows, s.out_height - p0);
  tile.cols = min(t.cols, s.out_width - q0);
  tile.images = int(min(int64_t(t.images), s.images - image));
  tile.count = tile.images * tile.rows * tile.cols;
  tile.image_offset = image * s.height * s.width * s.channels;
  tile.first_pixel = (image * s.out_height + p0) * s.out_width + q0;
  tile.h0 = p0 - s.pad_h;
  tile.w0 = q0 - s.pad_w;
  return tile;
}

// The output pixel index of the tile's pixel i (< count): whole images follow each other in y.
__device__ __forceinline__ int64_t OutputPixel(const GroupedShape& s, const PixelTile& tile, int i) {
  return tile.first_pixel + int64_t(i / tile.cols) * s.out_width + i % tile.cols;
}

// The halo pixel the tile's pixel i reads through tap (0, 0); -1 past the tile's end.
__device__ __forceinline__ int HaloPixel(const Tiling& t, const PixelTile& tile, int i) {
  if (i >= tile.count) return -1;
  // The division by an image's rows only in tiles of several images: this runs at every wgrad step.
  const int row = i / tile.cols, image = t.images > 1 ? row / t.rows : 0;
  return ((row - image * t.rows) + image * t.halo_rows) * t.halo_cols + i % tile.cols;
}

// The 16-byte chunk `chunk` of pixel (row) `row` of a tile of kRowChunks-chunk rows.
__device__ __forceinline__ int Row(int row, int chunk) { return row * kRowChunks + chunk; }

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 matrices of 16-bit values, lane l giving the address of row l % 8 of matrix l / 8;
// .trans hands each thread the transposed matrices' elements.
__device__ __forceinline__ void LdMatrix(uint32_t address, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void LdMatrixTrans(uint32_t address, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// d += a (16 x 16, row-major) . b (16 x 8, column-major), float32 sums.
template <typename T>
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Where a thread's copies of a halo go: chunk tid % 8 of pixels tid / 8 + 32 j, walked as (image,
// row, column) of the halo without a division per copy. Set once a kernel (the halo's shape is fixed).
struct HaloWalk {
  int chunk, first_row, first_col, step_rows, step_cols;

  __device__ HaloWalk(const Tiling& t) {
    const int pixel = threadIdx.x / kPixelChunks, step = kThreads / kPixelChunks;
    chunk = threadIdx.x % kPixelChunks;
    first_row = pixel / t.halo_cols, first_col = pixel % t.halo_cols;
    step_rows = step / t.halo_cols, step_cols = step % t.halo_cols;
  }
};

// Issues the copies of a tile's halo (the input pixels of channels c0.. its windows read; zeros in
// the padding, past the last image and in the zero pixel) into `halo`. kSeveral: the tile may hold
// several images (the walk then crosses from one image's halo rows to the next's); without, a copy
// costs what it did before such tiles. (A build that made these checks for every tile, with a
// division more in HaloPixel, ran the 14^2 and 28^2 layers, one image a tile, 9-11% slower on an
// H200; which of the two cost it was not measured.)
template <bool kSeveral, typename T>
__device__ __forceinline__ void IssueHaloOf(const GroupedShape& s, const Tiling& t, const HaloWalk& walk,
                                            const PixelTile& tile, const T* __restrict__ x, int c0, uint4* halo) {
  static_assert(kThreads % kPixelChunks == 0, "a thread copies one chunk of its pixels");
  const int zero = t.ZeroPixel(), step = kThreads / kPixelChunks;
  const bool channel_valid = c0 + 8 * walk.chunk < s.channels;
  const int64_t image_elements = int64_t(s.height) * s.width * s.channels;
  const T* image = x + tile.image_offset + c0 + 8 * walk.chunk;
  int hr = walk.first_row, wc = walk.first_col, sub = 0;  // sub: the tile's image of the halo row hr
  if constexpr (kSeveral) {
    while (hr >= t.halo_rows) hr -= t.halo_rows, ++sub, image += image_elements;
  }
  for (int pixel = threadIdx.x / kPixelChunks; pixel <= zero; pixel += step) {
    const int h = tile.h0 + hr, w = tile.w0 + wc;
    const bool valid = channel_valid && pixel < zero && (!kSeveral || sub < tile.images) && h >= 0 &&
                       h < s.height && w >= 0 && w < s.width;
    CpAsync16OrZeros(halo + Row(pixel, walk.chunk), valid ? image + (int64_t(h) * s.width + w) * s.channels : x,
                     valid);
    hr += walk.step_rows, wc += walk.step_cols;
    if (wc >= t.halo_cols) wc -= t.halo_cols, ++hr;
    if constexpr (kSeveral) {
      while (hr >= t.halo_rows) hr -= t.halo_rows, ++sub, image += image_elements;
    }
  }
}

template <typename T>
__device__ __forceinline__ void IssueHalo(const GroupedShape& s, const Tiling& t, const HaloWalk& walk,
                                          const PixelTile& tile, const T* __restrict__ x, int c0, uint4* halo) {
  if (t.images > 1) {
    IssueHaloOf<true>(s, t, walk, tile, x, c0, halo);
  } else {
    IssueHaloOf<false>(s, t, walk, tile, x, c0, halo);
  }
}

// y [pixels, C] for x [images, H, W, C] and w [taps, W, C] (kWidth = W channels a group); grid
// (feature tiles x blocks a feature tile); dynamic shared memory: the filter [taps * W rows] and
// two halos. Three blocks an SM (78 registers, no spills): 24 warps to hide the loads' latency.
template <typename T, int kWidth>
__global__ void __launch_bounds__(kThreads, 3) GroupedFpropKernel(const GroupedShape s, const Tiling t,
                                                                  int feature_tiles, const T* __restrict__ x,
                                                                  const T* __restrict__ w,
                                                                  const ConvEpilogue<T> epilogue, T* __restrict__ y) {
  extern __shared__ uint4 shared[];
  const int taps = s.Taps(), channels = s.channels;
  const int filter_rows = taps * kWidth;
  uint4* filter = shared;                                    // [taps * W rows][kRowChunks]
  uint4* halos = shared + filter_rows * kRowChunks;          // [2][halo pixels][kRowChunks]
  const int halo_chunks = t.HaloPixels() * kRowChunks;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int f0 = int(blockIdx.x % feature_tiles) * kFeatures;
  const int64_t first_tile = blockIdx.x / feature_tiles, tile_step = gridDim.x / feature_tiles;
  const HaloWalk walk(t);

  // The block's filter columns f0.., loaded once.
  for (int i = tid; i < filter_rows * kPixelChunks; i += kThreads) {
    const int row = i / kPixelChunks, chunk = i % kPixelChunks;
    const bool valid = f0 + 8 * chunk < channels;
    CpAsync16OrZeros(filter + Row(row, chunk), valid ? w + int64_t(row) * channels + f0 + 8 * chunk : w, valid);
  }
  if (first_tile < t.tiles) IssueHalo(s, t, walk, TileAt(s, t, first_tile), x, f0, halos);
  CpAsyncCommit();

  // Warp (warp_m, warp_n) of 4 x 2: the tile's pixels warp_m * 32.., features warp_n * 32...
  const int warp_m = warp / 2, warp_n = warp % 2;
  // This lane's ldmatrix rows. The filter's (trans, 16 channels x 16 features): rows tap * W + k0 +
  // lane % 8 + 8 (lane / 8 % 2), chunk warp_n * 4 + 2 nb + lane / 16 for the nb-th 16 features. The
  // halo's: its pixel of each m-tile, chunk (the group's first channel + k0) / 8 + lane / 16.
  const uint32_t filter_lane =
      SharedAddress(filter) + kRowBytes * (lane % 8 + 8 * (lane / 8 % 2)) + 16 * (warp_n * 4 + lane / 16);
  const uint32_t chunk_lane = 16 * (warp_n * 4 + lane / 16);
  const uint32_t tap_row_bytes = kRowBytes * s.dilation_h * t.halo_cols, tap_col_bytes = kRowBytes * s.dilation_w;
  const bool plain = epilogue.bias == nullptr && epilogue.residual == nullptr && epilogue.activation == 0;
  const int lane_feature = f0 + warp_n * 32 + lane % 4 * 2;
  int buffer = 0;
  for (int64_t index = first_tile; index < t.tiles; index += tile_step, buffer ^= 1) {
    const PixelTile tile = TileAt(s, t, index);
    if (index + tile_step < t.tiles) {
      IssueHalo(s, t, walk, TileAt(s, t, index + tile_step), x, f0, halos + (buffer ^ 1) * halo_chunks);
    }
    CpAsyncCommit();
    CpAsyncWait<1>();  // this tile's halo (and the filter) have landed
    __syncthreads();

    // Pixels past the tile's end read pixel 0 (shifted by the taps, still inside the halo): their
    // rows of the products are never stored.
    const uint32_t halo_base = SharedAddress(halos + buffer * halo_chunks) + chunk_lane;
    uint32_t pixel_lane[2];
    bool active[2];  // whether the m-tile holds any of the tile's pixels (uniform across the warp)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const int first = (warp_m * 2 + mt) * 16;
      active[mt] = first < tile.count;
      pixel_lane[mt] = halo_base + kRowBytes * max(0, HaloPixel(t, tile, first + lane % 16));
    }
    float acc[2][4][4] = {};
    uint32_t filter_tap = filter_lane;
    for (int r = 0; r < s.window_h; ++r) {
      uint32_t shift = r * tap_row_bytes;
      for (int c = 0; c < s.window_w; ++c, shift += tap_col_bytes, filter_tap += kWidth * kRowBytes) {
#pragma unroll
        for (int k0 = 0; k0 < kWidth; k0 += 16) {  // 16 channels of each group at a time
          uint32_t b[2][4];                         // [16 channels][2 x 8 features], for each 16 features
#pragma unroll
          for (int nb = 0; nb < 2; ++nb) LdMatrixTrans(filter_tap + kRowBytes * k0 + 32 * nb, b[nb]);
          uint32_t a[2][4];
#pragma unroll
          for (int nb = 0; nb < 2; ++nb) {
            // The group of these 16 features; for W >= 32 both halves of the warp's 32 are one group.
            if (nb == 0 || kWidth == 16) {
#pragma unroll
              for (int mt = 0; mt < 2; ++mt) {
                if (active[mt]) LdMatrix(pixel_lane[mt] + shift + 32 * nb + 2 * k0, a[mt]);
              }
            }
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
              if (!active[mt]) continue;
              Mma<T>(acc[mt][2 * nb], a[mt], b[nb][0], b[nb][1]);
              Mma<T>(acc[mt][2 * nb + 1], a[mt], b[nb][2], b[nb][3]);
            }
          }
        }
      }
    }

#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = (warp_m * 2 + mt) * 16 + lane / 4 + 8 * half;
        if (i >= tile.count) continue;
        const int64_t pixel = OutputPixel(s, tile, i);
        T* out = y + pixel * channels + lane_feature;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          if (lane_feature + nt * 8 >= channels) continue;
          float v0 = acc[mt][nt][2 * half], v1 = acc[mt][nt][2 * half + 1];
          if (!plain) {
            const int64_t index = pixel * channels + lane_feature + nt * 8;
            v0 = epilogue.Apply(v0, index, lane_feature + nt * 8);
            v1 = epilogue.Apply(v1, index + 1, lane_feature + nt * 8 + 1);
          }
          Pack<T, 2> pair;
          pair.v[0] = FromFloat<T>(v0);
          pair.v[1] = FromFloat<T>(v1);
          StoreWords(out + nt * 8, pair);
        }
      }
    }
    __syncthreads();  // every warp is done with this halo before the next iteration refills it
  }
  CpAsyncWait<0>();
}

// The dgrad's filter: flipped[r, c, k, ch] = w[R - 1 - r, S - 1 - c, ch % W, ch / W * W + k] for
// w [R, S, W, C] (both [taps, W, C]).
template <typename T>
__global__ void FlipGroupsKernel(const T* __restrict__ w, int window_h, int window_w, int width, int channels,
                                 T* __restrict__ flipped) {
  const int64_t elements = int64_t(window_h) * window_w * width * channels;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < elements;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int ch = int(e % channels);
    const int64_t rest = e / channels;
    const int k = int(rest % width), tap = int(rest / width);
    const int r = tap / window_w, c = tap - r * window_w;
    const int source_tap = (window_h - 1 - r) * window_w + (window_w - 1 - c);
    flipped[e] = w[(int64_t(source_tap) * width + ch % width) * channels + ch / width * width + k];
  }
}

// The wgrad's taps a block: at most kWgradTapChannels / W, in even blocks.
int WgradTapBlocks(int taps, int width) {
  const int most = kWgradTapChannels / width;
  return (taps + most - 1) / most;
}

// partial[slice, tap, c, k] (float32, [slices, taps, W, C]) for the pixel tiles of slice blockIdx.z,
// the taps of tap block blockIdx.y, features blockIdx.x * 64..; dynamic shared memory: two stages of
// a halo and the tile's dy rows.
template <typename T, int kWidth>
__global__ void __launch_bounds__(kThreads, 2) GroupedWgradKernel(const GroupedShape s, const Tiling t,
                                                                  const T* __restrict__ x, const T* __restrict__ dy,
                                                                  float* __restrict__ partial) {
  // Per tap, the block's (channel, feature) pairs are 64 / W groups of W x W: W / 4 tiles of 16 x 16.
  constexpr int kTapTiles = kWidth / 4;
  constexpr int kGroupTiles = kWidth / 16;  // 16-wide tiles along a group's channels (and features)
  constexpr int kItems = (kWgradTapChannels / kWidth * kTapTiles + 7) / 8;  // (tap, tile) pairs a warp
  extern __shared__ uint4 shared[];
  const int halo_chunks = t.HaloPixels() * kRowChunks;
  constexpr int kDyChunks = kTilePixels * kRowChunks;
  const int stage_chunks = halo_chunks + kDyChunks;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int channels = s.channels, taps = s.Taps();
  const int f0 = blockIdx.x * kFeatures;
  const int tap_blocks = gridDim.y;
  const int block_taps = (taps + tap_blocks - 1) / tap_blocks;
  const int tap0 = blockIdx.y * block_taps, here = min(block_taps, taps - tap0);
  const int64_t first = blockIdx.z * t.tiles / gridDim.z, end = (blockIdx.z + 1) * t.tiles / gridDim.z;
  const HaloWalk walk(t);

  // This warp's (tap, tile) pairs: warp + 8 j of the block's here * kTapTiles. Their ldmatrix
  // offsets from this lane's rows: x^T's, the tap's halo shift (in bytes) and the chunk of its 16
  // channels; dy's, the chunk of its 16 features.
  uint32_t shift[kItems], a_chunk[kItems], b_chunk[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int item = min(warp + 8 * j, here * kTapTiles - 1);
    const int tap = tap0 + item / kTapTiles, tile = item % kTapTiles;
    const int r = tap / s.window_w, c = tap - r * s.window_w;
    shift[j] = kRowBytes * (r * s.dilation_h * t.halo_cols + c * s.dilation_w);
    const int group = tile / (kGroupTiles * kGroupTiles), rest = tile % (kGroupTiles * kGroupTiles);
    a_chunk[j] = 16 * ((group * kWidth + rest / kGroupTiles * 16) / 8 + lane / 8 % 2);
    b_chunk[j] = 16 * ((group * kWidth + rest % kGroupTiles * 16) / 8 + lane / 16);
  }

  auto issue = [&](int stage, int64_t index) {
    uint4* halo = shared + stage * stage_chunks;
    const PixelTile tile = TileAt(s, t, index);
    IssueHalo(s, t, walk, tile, x, f0, halo);
    uint4* dy_rows = halo + halo_chunks;
    for (int i = tid; i < kTilePixels * kPixelChunks; i += kThreads) {
      const int pixel = i / kPixelChunks, chunk = i % kPixelChunks;
      const bool valid = pixel < tile.count && f0 + 8 * chunk < channels;
      const T* src = valid ? dy + OutputPixel(s, tile, pixel) * channels + f0 + 8 * chunk : dy;
      CpAsync16OrZeros(dy_rows + Row(pixel, chunk), src, valid);
    }
  };

  float acc[kItems][2][4] = {};
  if (first < end) issue(0, first);
  CpAsyncCommit();
  int buffer = 0;
  for (int64_t index = first; index < end; ++index, buffer ^= 1) {
    const PixelTile tile = TileAt(s, t, index);
    if (index + 1 < end) issue(buffer ^ 1, index + 1);
    CpAsyncCommit();
    CpAsyncWait<1>();
    __syncthreads();
    const uint32_t halo_base = SharedAddress(shared + buffer * stage_chunks);
    const uint32_t dy_base = halo_base + 16 * halo_chunks;
    for (int p0 = 0; p0 < tile.count; p0 += 16) {
      // ldmatrix rows: for x^T (trans), pixels p0 + (lane % 8) + 8 (lane / 16); for dy (trans),
      // p0 + (lane % 8) + 8 (lane / 8 % 2). Pixels past the tile read the zero pixel, unshifted
      // (x: an inf or NaN times dy's zeros there would reach dw), and zeros (dy).
      const int a_origin = HaloPixel(t, tile, p0 + lane % 8 + 8 * (lane / 16));
      const uint32_t a_lane = halo_base + kRowBytes * (a_origin >= 0 ? a_origin : t.ZeroPixel());
      const uint32_t shift_mask = a_origin >= 0 ? ~0u : 0u;
      const uint32_t b_lane = dy_base + kRowBytes * (p0 + lane % 8 + 8 * (lane / 8 % 2));
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        if (warp + 8 * j >= here * kTapTiles) break;
        uint32_t a[4], b[4];
        LdMatrixTrans(a_lane + (shift[j] & shift_mask) + a_chunk[j], a);
        LdMatrixTrans(b_lane + b_chunk[j], b);
        Mma<T>(acc[j][0], a, b[0], b[1]);
        Mma<T>(acc[j][1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }
  CpAsyncWait<0>();

  float* out = partial + int64_t(blockIdx.z) * taps * kWidth * channels;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int item = warp + 8 * j;
    if (item >= here * kTapTiles) break;
    const int tap = tap0 + item / kTapTiles, tile = item % kTapTiles;
    const int group = tile / (kGroupTiles * kGroupTiles), rest = tile % (kGroupTiles * kGroupTiles);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int k = f0 + group * kWidth + rest % kGroupTiles * 16 + nt * 8 + lane % 4 * 2;
      if (k >= channels) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int c = rest / kGroupTiles * 16 + lane / 4 + 8 * half;
        *reinterpret_cast<float2*>(out + (int64_t(tap) * kWidth + c) * channels + k) =
            make_float2(acc[j][nt][2 * half], acc[j][nt][2 * half + 1]);
      }
    }
  }
}

int ElementwiseBlocks(int64_t elements) {
  return int(std::min<int64_t>(4096, std::max<int64_t>(1, (elements + kThreads - 1) / kThreads)));
}

int FeatureTiles(int channels) { return (channels + kFeatures - 1) / kFeatures; }

// fn(type tag, width tag) for the dtype and the group width (both checked by GroupedApplies).
template <typename Fn>
ffi::Error DispatchGrouped(ffi::DataType dtype, int64_t width, Fn&& fn) {
  auto on_width = [&](auto type_tag) {
    if (width == 16) return fn(type_tag, std::integral_constant<int, 16>());
    return fn(type_tag, std::integral_constant<int, 32>());
  };
  if (dtype == ffi::DataType::BF16) return on_width(__nv_bfloat16());
  return on_width(__half());
}

// Raises `kernel`'s dynamic shared memory limit to `bytes`.
template <typename Kernel>
ffi::Error AllowShared(Kernel kernel, size_t bytes, const char* what) {
  return CudaError(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)), what);
}

template <typename T, int kWidth>
ffi::Error LaunchFprop(cudaStream_t stream, const GroupedShape& s, const T* x, const T* w,
                       const ConvEpilogue<T>& epilogue, T* y) {
  const Tiling t = TilingOf(s);
  const size_t bytes = kRowBytes * (size_t(s.Taps()) * kWidth + 2 * size_t(t.HaloPixels()));
  auto kernel = GroupedFpropKernel<T, kWidth>;
  JAXDNN_RETURN_IF_ERROR(AllowShared(kernel, bytes, "grouped conv forward"));
  // As many blocks as fit at once, the same number for every feature tile (each keeps its filter).
  const int feature_tiles = FeatureTiles(s.channels);
  const int64_t per_feature_tile =
      std::max<int64_t>(1, std::min<int64_t>(t.tiles, ResidentBlocks(kernel, kThreads, bytes) / feature_tiles));
  kernel<<<unsigned(per_feature_tile * feature_tiles), kThreads, bytes, stream>>>(s, t, feature_tiles, x, w,
                                                                                  epilogue, y);
  return LaunchError("grouped conv forward");
}

}  // namespace

bool GroupedApplies(const ConvGeometry& g, ffi::DataType dtype) {
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) return false;
  const int64_t width = g.GroupChannels();
  if (g.groups <= 1 || g.groups >= g.channels || g.GroupFilters() != width) return false;
  if (width != 16 && width != 32) return false;
  if (g.window[0] != 1 || g.pad[0] != 0 || g.InPixels() == 0 || g.OutPixels() == 0) return false;
  for (int a = 0; a < 3; ++a) {
    if (g.stride[a] != 1 || g.lhs_dilation[a] != 1) return false;
  }
  for (int a = 1; a < 3; ++a) {
    if ((g.window[a] - 1) * g.rhs_dilation[a] > kMaxReach) return false;
    if (g.in[a] > kSizeLimit || g.out[a] > kSizeLimit || std::abs(g.pad[a]) > kSizeLimit) return false;
  }
  return g.Taps() * width <= kMaxFilterRows && g.channels <= kSizeLimit;
}

ffi::Error GroupedFprop(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype, const void* x,
                        const void* w, const void* bias, const void* residual, int64_t activation,
                        float activation_param, void* y) {
  return DispatchGrouped(dtype, g.GroupChannels(), [&](auto type_tag, auto width_tag) {
    using T = decltype(type_tag);
    constexpr int kWidth = decltype(width_tag)::value;
    ConvEpilogue<T> epilogue;
    epilogue.bias = static_cast<const T*>(bias);
    epilogue.residual = static_cast<const T*>(residual);
    epilogue.activation = activation;
    epilogue.activation_param = activation_param;
    return LaunchFprop<T, kWidth>(stream, ShapeOf(g), static_cast<const T*>(x), static_cast<const T*>(w),
                                  epilogue, static_cast<T*>(y));
  });
}

std::optional<ffi::Error> GroupedDgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype,
                                       const void* dy, const void* w, void* workspace, size_t workspace_bytes,
                                       void* dx) {
  const int64_t filter = g.Taps() * g.GroupChannels() * g.filters;
  if (workspace_bytes < size_t(filter) * 2) return std::nullopt;
  return DispatchGrouped(dtype, g.GroupChannels(), [&](auto type_tag, auto width_tag) {
    using T = decltype(type_tag);
    constexpr int kWidth = decltype(width_tag)::value;
    T* flipped = static_cast<T*>(workspace);
    FlipGroupsKernel<<<ElementwiseBlocks(filter), kThreads, 0, stream>>>(
        static_cast<const T*>(w), int(g.window[1]), int(g.window[2]), kWidth, int(g.channels), flipped);
    JAXDNN_RETURN_IF_ERROR(LaunchError("grouped conv dgrad: filter"));
    return LaunchFprop<T, kWidth>(stream, DgradShapeOf(g), static_cast<const T*>(dy), flipped, ConvEpilogue<T>(),
                                  static_cast<T*>(dx));
  });
}

int64_t GroupedWgradSlices(const ConvGeometry& g) {
  const int64_t blocks = FeatureTiles(int(g.filters)) * WgradTapBlocks(int(g.Taps()), int(g.GroupChannels()));
  // At most one wave: 132 SMs (an H100/H200), two blocks each; each slice at least 64 pixels.
  const int64_t most = std::min<int64_t>(256, (g.OutPixels() + 63) / 64);
  return std::max<int64_t>(1, std::min(2 * 132 / blocks, most));
}

std::optional<ffi::Error> GroupedWgrad(cudaStream_t stream, const ConvGeometry& g, ffi::DataType dtype,
                                       const void* x, const void* dy, ffi::DataType dw_dtype, void* workspace,
                                       size_t workspace_bytes, void* dw) {
  const int64_t elements = g.Taps() * g.GroupChannels() * g.filters;
  const int64_t slices = std::min<int64_t>(GroupedWgradSlices(g), workspace_bytes / (4 * elements));
  if (slices < 1) return std::nullopt;
  const GroupedShape s = ShapeOf(g);
  const Tiling t = TilingOf(s);
  float* partial = static_cast<float*>(workspace);
  return DispatchGrouped(dtype, g.GroupChannels(), [&](auto type_tag, auto width_tag) {
    using T = decltype(type_tag);
    constexpr int kWidth = decltype(width_tag)::value;
    const size_t bytes = 2 * kRowBytes * (size_t(t.HaloPixels()) + kTilePixels);
    auto kernel = GroupedWgradKernel<T, kWidth>;
    JAXDNN_RETURN_IF_ERROR(AllowShared(kernel, bytes, "grouped conv wgrad"));
    const dim3 grid(unsigned(FeatureTiles(s.channels)), unsigned(WgradTapBlocks(s.Taps(), kWidth)),
                    unsigned(slices));
    kernel<<<grid, kThreads, bytes, stream>>>(s, t, static_cast<const T*>(x), static_cast<const T*>(dy), partial);
    JAXDNN_RETURN_IF_ERROR(LaunchError("grouped conv wgrad"));
    if (dw_dtype == ffi::DataType::F32) {
      SumSlicesKernel<<<ElementwiseBlocks(elements), kThreads, 0, stream>>>(partial, slices, elements,
                                                                           static_cast<float*>(dw));
    } else {
      SumSlicesKernel<<<ElementwiseBlocks(elements), kThreads, 0, stream>>>(partial, slices, elements,
                                                                           static_cast<T*>(dw));
    }
    return LaunchError("grouped conv wgrad: sum of slices");
  });
}

}  // namespace jaxdnn
