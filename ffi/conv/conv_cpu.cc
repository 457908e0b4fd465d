// CPU convolution: im2col per block of pixel rows, then a matmul with float32 accumulation, in tiles
// held in registers (AVX-512 and AVX2/FMA builds of them, chosen at run time: cpu_isa.h), the blocks
// shared out over XLA's intra-op threads.
//   fprop: for each block of output rows and group, A [pixels, taps * Cg] gathers the input pixels
//          they read; y [pixels, Kg] = A @ W_g [taps * Cg, Kg] over the taps that read data (padding
//          and dilation holes are zeros, skipped where a whole tile has them).
//   dgrad: for each block of input rows and group, A [pixels, taps * Kg] gathers the dy pixels that
//          read each input pixel (none for most taps of a strided convolution);
//          dx [pixels, Cg] = A @ W_g^T [taps * Kg, Cg].
//   wgrad: dW_g [taps * Cg, Kg] = sum over blocks of output rows of A^T @ dy, A as in fprop (its
//          columns copied into panels of kRows, each read by every strip of dy's columns).
// The gathers use conv_geometry.h's index maps and the forward conv_epilogue.h's epilogue, the CUDA
// kernels' own. Depthwise convolutions (one channel a group, as many filters) take the direct
// kernels of depthwise_cpu.cc instead.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "common/cpu_isa.h"
#include "common/half_cpu.h"
#include "common/parallel_cpu.h"
#include "common/vector_cpu.h"
#include "conv/conv.h"
#include "conv/conv_common.h"
#include "conv/conv_epilogue.h"
#include "conv/conv_geometry.h"
#include "conv/depthwise_cpu.h"

namespace jaxdnn {
namespace {

// The im2col matrix of a block of pixels (whole rows): `block` values per window tap and pixel, and
// which taps of each pixel read data. The others (padding, dilation holes, strides that skip a pixel)
// are undefined until ZeroUnreadTaps writes zeros where a tile of pixels will read them: a tile skips
// a tap only when none of its pixels reads data through it.
struct TapRows {
  // rows: the block's pixels (the gathers set it; the storage holds the largest block)
  int64_t rows = 0, taps = 0, block = 0;
  float* values;               // [rows, taps * block]: Floats(rows, taps, block) of the caller's scratch
  std::vector<uint8_t> valid;  // [rows, taps]
  std::vector<int64_t> pixel;  // [rows]: the pixel of the block (its index in it) that each row is

  TapRows(int64_t rows, int64_t taps, int64_t block, float* values)
      : rows(rows), taps(taps), block(block), values(values), valid(rows * taps), pixel(rows) {}
  static int64_t Floats(int64_t rows, int64_t taps, int64_t block) { return rows * taps * block; }
  float* At(int64_t row, int64_t tap) { return values + (row * taps + tap) * block; }
  const float* At(int64_t row, int64_t tap) const { return values + (row * taps + tap) * block; }
};

// Zeros in the values of each tap that a pixel does not read where another pixel of its group of
// kMaxTileRows rows (the tiles of every build lie within such groups) reads it. Most groups read a
// tap with all of their pixels or none (the gathers order a row's pixels by the taps they read), so
// a strided dgrad writes few of the zeros of the taps its pixels skip (3 of 4 at stride 2).
constexpr int64_t kMaxTileRows = 8;

void ZeroUnreadTaps(TapRows* a) {
  for (int64_t r0 = 0; r0 < a->rows; r0 += kMaxTileRows) {
    const int64_t r1 = std::min(a->rows, r0 + kMaxTileRows);
    for (int64_t tap = 0; tap < a->taps; ++tap) {
      int64_t reading = 0;
      for (int64_t r = r0; r < r1; ++r) reading += a->valid[r * a->taps + tap];
      if (reading == 0 || reading == r1 - r0) continue;
      for (int64_t r = r0; r < r1; ++r) {
        if (!a->valid[r * a->taps + tap]) std::fill_n(a->At(r, tap), a->block, 0.0f);
      }
    }
  }
}

// The window taps [first, end) a wgrad item gathers and multiplies (every tap elsewhere).
struct TapSpan {
  int64_t first, end;
};
constexpr TapSpan kEveryTap{0, INT64_MAX};

// The matmuls' tiles: kRows rows of the result by strips of kTileCols columns, held in registers
// while the reduction runs (independent sums hide the FMA's latency; each value of A loaded feeds a
// whole tile row); every matrix's columns are padded to a multiple of kTileCols. A strip of a tile
// row is one FloatVector (common/vector_cpu.h).
constexpr int kTileCols = kVectorFloats;

int64_t PaddedCols(int64_t cols) { return (cols + kTileCols - 1) / kTileCols * kTileCols; }

// out[rows, cols] = A @ B for B [taps * block, cols] (cols a multiple of kTileCols) stored as strips
// of kTileCols columns, b [cols / kTileCols][taps * block][kTileCols], skipping the taps no pixel of
// a tile reads through, in tiles of kRows rows by kStrips strips (the columns a whole tile does not
// fill, in tiles of one strip). The reduction runs in chunks of taps of about kChunkValues values a
// strip, so that a chunk of b's strips stays in L1 across the row tiles (a tile's partial sums go
// through `out` between chunks; a chunk is contiguous in each strip: B's rows side by side, cols
// floats apart, had mapped a chunk onto an eighth of L1's sets at 128 columns). A tile past the last
// row repeats it (its results are not stored).
constexpr int64_t kChunkValues = 256;

// acc[kRows][kStrips] += rows[i][j] * B's row j for j < depth, B's rows kTileCols floats apart in each
// of kStrips strips strip_floats apart, from b.
template <int kRows, int kStrips>
inline __attribute__((always_inline)) void AccumulateRun(const float* const (&rows)[kRows], const float* b,
                                                         int64_t depth, int64_t strip_floats,
                                                         FloatVector (&acc)[kRows][kStrips]) {
  for (int64_t j = 0; j < depth; ++j) {
    FloatVector b_row[kStrips];
    for (int s = 0; s < kStrips; ++s) b_row[s] = LoadVector(b + s * strip_floats + j * kTileCols);
#pragma GCC unroll 16
    for (int i = 0; i < kRows; ++i) {
      const float value = rows[i][j];
      for (int s = 0; s < kStrips; ++s) acc[i][s] += value * b_row[s];
    }
  }
}

template <int kRows, int kStrips>
inline __attribute__((always_inline)) void MatMulColumns(const TapRows& a, const float* b, float* out,
                                                         int64_t cols, int64_t c0) {
  static_assert(kMaxTileRows % kRows == 0, "a tile must lie within one of ZeroUnreadTaps' groups");
  const int64_t chunk_taps = std::max<int64_t>(1, kChunkValues / kStrips / std::max<int64_t>(1, a.block));
  const int64_t strip_floats = a.taps * a.block * kTileCols;
  const float* strips = b + c0 / kTileCols * strip_floats;  // the tile's first strip
  for (int64_t t0 = 0; t0 == 0 || t0 < a.taps; t0 += chunk_taps) {  // once with no taps: zeros
    const int64_t t1 = std::min(a.taps, t0 + chunk_taps);
    for (int64_t r0 = 0; r0 < a.rows; r0 += kRows) {
      const int64_t tile_rows = std::min<int64_t>(kRows, a.rows - r0);
      const auto read = [&](int64_t tap) {  // whether some row of the tile reads data through `tap`
        bool any = false;
        for (int64_t i = 0; i < tile_rows; ++i) any = any || a.valid[(r0 + i) * a.taps + tap];
        return any;
      };
      bool every_tap = true, some_tap = false;
      for (int64_t tap = t0; tap < t1; ++tap) {
        const bool tap_read = read(tap);
        every_tap = every_tap && tap_read;
        some_tap = some_tap || tap_read;
      }
      // A chunk the tile reads nothing through leaves its sums as they are (a strided dgrad's
      // pixels read 1 to 4 of its taps).
      if (!some_tap && t0 > 0) continue;
      FloatVector acc[kRows][kStrips] = {};
      if (t0 > 0) {
        for (int64_t i = 0; i < tile_rows; ++i)
          for (int s = 0; s < kStrips; ++s) acc[i][s] = LoadVector(out + (r0 + i) * cols + c0 + s * kTileCols);
      }
      // The tile's rows from tap t0 on: a row's taps lie side by side, so where the tile reads every
      // tap of the chunk, the chunk is one run (a stem's 3 channels a tap made runs of 3 values).
      const float* rows[kRows];
      for (int i = 0; i < kRows; ++i) rows[i] = a.At(r0 + std::min<int64_t>(i, tile_rows - 1), t0);
      if (every_tap && t1 > t0) {
        AccumulateRun<kRows, kStrips>(rows, strips + t0 * a.block * kTileCols, (t1 - t0) * a.block, strip_floats, acc);
      } else {
        for (int64_t tap = t0; tap < t1; ++tap) {
          if (!read(tap)) continue;
          const float* tap_rows[kRows];
          for (int i = 0; i < kRows; ++i) tap_rows[i] = rows[i] + (tap - t0) * a.block;
          AccumulateRun<kRows, kStrips>(tap_rows, strips + tap * a.block * kTileCols, a.block, strip_floats, acc);
        }
      }
      for (int64_t i = 0; i < tile_rows; ++i)
        for (int s = 0; s < kStrips; ++s) StoreVector(acc[i][s], out + (r0 + i) * cols + c0 + s * kTileCols);
    }
  }
}

template <int kRows, int kStrips>
inline __attribute__((always_inline)) void MatMulTiles(const TapRows& a, const float* b, float* out,
                                                       int64_t cols) {
  int64_t c0 = 0;
  for (; c0 + kStrips * kTileCols <= cols; c0 += kStrips * kTileCols) {
    MatMulColumns<kRows, kStrips>(a, b, out, cols, c0);
  }
  for (; c0 < cols; c0 += kTileCols) MatMulColumns<kRows, 1>(a, b, out, cols, c0);
}

// acc[taps * block, cols] += A^T @ b[rows, cols] over each row's valid taps (cols a multiple of
// kTileCols; with `first`, acc = instead: it need not be zeroed and is not read), a tile of kRows
// values of a tap's block by kStrips strips of kTileCols columns at a time (as MatMulTiles). The
// tile's values come from a panel of A: the rows' kRows values side by side (past the block's end,
// its last value repeated; those sums are not stored), copied out of A once and read from L1 by every
// strip of columns. In place, consecutive rows' values lie taps * block floats apart.
template <int kRows, int kStrips>
inline __attribute__((always_inline)) void MatMulTransposedColumns(const TapRows& a, const float* panel,
                                                                   int64_t tap, int64_t tile_rows, const float* b,
                                                                   float* acc, int64_t cols, int64_t c0, bool first) {
  FloatVector tile[kRows][kStrips] = {};
  for (int64_t r = 0; r < a.rows; ++r) {
    if (!a.valid[r * a.taps + tap]) continue;
    FloatVector b_row[kStrips];
    for (int s = 0; s < kStrips; ++s) b_row[s] = LoadVector(b + r * cols + c0 + s * kTileCols);
#pragma GCC unroll 16
    for (int i = 0; i < kRows; ++i) {
      const float value = panel[r * kRows + i];
      for (int s = 0; s < kStrips; ++s) tile[i][s] += value * b_row[s];
    }
  }
  for (int64_t i = 0; i < tile_rows; ++i) {
    for (int s = 0; s < kStrips; ++s) {
      float* acc_row = acc + i * cols + c0 + s * kTileCols;
      if (first) {
        StoreVector(tile[i][s], acc_row);
        continue;
      }
      StoreVector(LoadVector(acc_row) + tile[i][s], acc_row);
    }
  }
}

template <int kRows, int kStrips>
inline __attribute__((always_inline)) void MatMulTransposedAccumulateTiles(const TapRows& a, const float* b,
                                                                           float* acc, int64_t cols, bool first,
                                                                           TapSpan taps) {
  std::vector<float> panel(a.rows * kRows);
  for (int64_t tap = taps.first; tap < std::min(taps.end, a.taps); ++tap) {
    for (int64_t j0 = 0; j0 < a.block; j0 += kRows) {
      const int64_t tile_rows = std::min<int64_t>(kRows, a.block - j0);
      for (int64_t r = 0; r < a.rows; ++r) {
        const float* values = a.At(r, tap) + j0;
        if (tile_rows == kRows) {
          __builtin_memcpy(panel.data() + r * kRows, values, sizeof(float) * kRows);
        } else {
          for (int i = 0; i < kRows; ++i) panel[r * kRows + i] = values[std::min<int64_t>(i, tile_rows - 1)];
        }
      }
      float* acc_rows = acc + (tap * a.block + j0) * cols;
      int64_t c0 = 0;
      for (; c0 + kStrips * kTileCols <= cols; c0 += kStrips * kTileCols) {
        MatMulTransposedColumns<kRows, kStrips>(a, panel.data(), tap, tile_rows, b, acc_rows, cols, c0, first);
      }
      for (; c0 < cols; c0 += kTileCols) {
        MatMulTransposedColumns<kRows, 1>(a, panel.data(), tap, tile_rows, b, acc_rows, cols, c0, first);
      }
    }
  }
}

// The matmuls for the CPU at hand (cpu_isa.h): built for AVX-512 (8 x 32 tiles: 16 of the 32
// registers hold sums) and for AVX2 with FMA (4 x 16: 8 of 16) too on x86-64 (the package's baseline
// is SSE2).
#ifdef JAXDNN_CPU_ISA_VARIANTS
__attribute__((target("avx512f"))) void MatMulAvx512(const TapRows& a, const float* b, float* out, int64_t cols) {
  MatMulTiles<8, 2>(a, b, out, cols);
}
__attribute__((target("avx512f"))) void MatMulTransposedAccumulateAvx512(const TapRows& a, const float* b,
                                                                          float* acc, int64_t cols, bool first,
                                                                          TapSpan taps) {
  MatMulTransposedAccumulateTiles<8, 2>(a, b, acc, cols, first, taps);
}
__attribute__((target("avx2,fma"))) void MatMulAvx2(const TapRows& a, const float* b, float* out, int64_t cols) {
  MatMulTiles<4, 1>(a, b, out, cols);
}
__attribute__((target("avx2,fma"))) void MatMulTransposedAccumulateAvx2(const TapRows& a, const float* b,
                                                                         float* acc, int64_t cols, bool first,
                                                                         TapSpan taps) {
  MatMulTransposedAccumulateTiles<4, 1>(a, b, acc, cols, first, taps);
}
#endif

void MatMul(const TapRows& a, const float* b, float* out, int64_t cols) {
#ifdef JAXDNN_CPU_ISA_VARIANTS
  if (ActiveCpuIsa() == CpuIsa::kAvx512) return MatMulAvx512(a, b, out, cols);
  if (ActiveCpuIsa() == CpuIsa::kAvx2) return MatMulAvx2(a, b, out, cols);
#endif
  MatMulTiles<4, 1>(a, b, out, cols);
}

void MatMulTransposedAccumulate(const TapRows& a, const float* b, float* acc, int64_t cols, bool first,
                                TapSpan taps) {
#ifdef JAXDNN_CPU_ISA_VARIANTS
  if (ActiveCpuIsa() == CpuIsa::kAvx512) return MatMulTransposedAccumulateAvx512(a, b, acc, cols, first, taps);
  if (ActiveCpuIsa() == CpuIsa::kAvx2) return MatMulTransposedAccumulateAvx2(a, b, acc, cols, first, taps);
#endif
  MatMulTransposedAccumulateTiles<4, 1>(a, b, acc, cols, first, taps);
}

// The matmuls take blocks of about kBlockPixels pixels, so that each pass over a large filter serves
// many pixels: whole rows, or segments of a row as long as 2 * kBlockPixels or more (a 1-D
// convolution's rows of 16000 pixels as one block each had made A 12 MB, the matmul streaming it from
// memory, and a block a sample for the threads).
constexpr int64_t kBlockPixels = 64;

// The pixels of a row that a block takes: the whole row, or kBlockPixels for a long one.
inline int64_t RowSegment(int64_t width) { return width >= 2 * kBlockPixels ? kBlockPixels : width; }

// A block's pixels of a row of an [N, sizes[0], sizes[1], sizes[2]] grid: its sample, first two
// coordinates and first column (at[2]), and `count` pixels from there.
struct PixelRow {
  int64_t n, at[3], count;
};

// An [N, sizes[0], sizes[1], sizes[2]] pixel grid in blocks: of `per_block` consecutive whole rows of
// `width` pixels (the last block may have fewer rows), or of one segment of a row (RowSegment; the
// last segment of a row may be shorter). A block's pixels are consecutive.
struct RowBlocks {
  int64_t sizes[2], width, segment, segments, per_block, rows, count;

  RowBlocks(int64_t batch, const int64_t grid[3])
      : sizes{grid[0], grid[1]},
        width(grid[2]),
        segment(std::max<int64_t>(1, RowSegment(grid[2]))),
        segments((grid[2] + segment - 1) / segment),
        per_block(segments > 1 ? 1 : std::max<int64_t>(1, kBlockPixels / std::max<int64_t>(1, grid[2]))),
        rows(batch * grid[0] * grid[1]),
        count(segments > 1 ? rows * segments : (rows + per_block - 1) / per_block) {}
  int64_t MaxPixels() const { return per_block * segment; }
  // Block b's rows (or its one row's segment) into *out; returns its first pixel.
  int64_t Get(int64_t b, std::vector<PixelRow>* out) const {
    out->clear();
    const int64_t first_row = segments > 1 ? b / segments : b * per_block;
    const int64_t column = segments > 1 ? b % segments * segment : 0;
    const int64_t end_row = segments > 1 ? first_row + 1 : std::min(rows, first_row + per_block);
    for (int64_t r = first_row; r < end_row; ++r) {
      out->push_back({r / (sizes[0] * sizes[1]), {r / sizes[1] % sizes[0], r % sizes[1], column},
                      std::min(segment, width - column)});
    }
    return first_row * width + column;
  }
};

// The products of fprop and dgrad: for every block of `blocks` and group, gather(rows, group, &a)
// fills the block's im2col matrix A (`values` a tap), A @ the group's filter (`filters`, one group's
// filter every `filter_floats`) goes into a [pixels, cols] result, and store(group, first pixel, a,
// result) writes it out (its row r for the block's pixel a.pixel[r]). The blocks run in spans on
// XLA's intra-op threads: about four spans a thread, for balance, of at most kSpanBlocks blocks (each
// span takes its buffers from its thread's scratch). A span writes only its own pixels, so the split
// changes no result.
constexpr int64_t kSpanBlocks = 8;

template <typename Gather, typename Store>
void BlockProducts(ffi::ThreadPool& pool, const ConvGeometry& g, const RowBlocks& blocks, int64_t values,
                   const float* filters, int64_t filter_floats, int64_t cols, const Gather& gather,
                   const Store& store) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_span = std::clamp<int64_t>(g.groups * blocks.count / (4 * threads), 1, kSpanBlocks);
  const int64_t spans = (blocks.count + per_span - 1) / per_span;
  ParallelFor(pool, g.groups * spans, [&](int64_t i) {
    const int64_t group = i / spans, first = i % spans * per_span;
    const int64_t pixels = blocks.MaxPixels();
    const auto [a_values, result] = ScratchBuffers({TapRows::Floats(pixels, g.Taps(), values), pixels * cols});
    TapRows a(pixels, g.Taps(), values, a_values);
    std::vector<PixelRow> rows;
    for (int64_t b = first; b < std::min(blocks.count, first + per_span); ++b) {
      const int64_t pixel = blocks.Get(b, &rows);
      gather(rows, group, &a);
      ZeroUnreadTaps(&a);
      MatMul(a, filters + group * filter_floats, result, cols);
      store(group, pixel, a, result);
    }
  });
}

// The index maps a gather reads its source through: x's pixel that an output pixel reads through a
// tap (fprop, wgrad), or dy's pixel that reads an input pixel through it (dgrad), one axis at a time.
inline auto InputMap(const ConvGeometry& g) {
  return [&g](int axis, int64_t o, int64_t t) { return g.InputAt(axis, o, t); };
}
inline auto OutputMap(const ConvGeometry& g) {
  return [&g](int axis, int64_t i, int64_t t) { return g.OutputAt(axis, i, t); };
}

// A gather's last axis, the same for every row of pixels of a call, so worked out once a call: the
// source coordinate map(2, p2, t2) of each of a row's `width` pixels through each tap t2 of the last
// axis (-1: no data), and the order of the row's pixels among A's rows. With `by_taps`, the pixels go
// in the order of the taps they read (stably), so that a tile of A's rows holds pixels that read the
// same taps, and skips the others: a stride-2 dgrad's odd and even columns, side by side, had made
// every tile multiply the taps of both (twice the products).
struct RowAxis {
  int64_t width, taps;
  std::vector<int64_t> at, order;  // [width, taps], [width]: each block's segment of a row (RowSegment)
                                   // ordered within itself

  template <typename AxisMap>
  RowAxis(const ConvGeometry& g, int64_t width, AxisMap map, bool by_taps)
      : width(width), taps(g.window[2]), at(width * taps), order(width) {
    for (int64_t p2 = 0; p2 < width; ++p2)
      for (int64_t t2 = 0; t2 < taps; ++t2) at[p2 * taps + t2] = map(2, p2, t2);
    for (int64_t q = 0; q < width; ++q) order[q] = q;
    if (!by_taps) return;
    const int64_t segment = std::max<int64_t>(1, RowSegment(width));
    for (int64_t first = 0; first < width; first += segment) {
      std::stable_sort(order.begin() + first, order.begin() + std::min(width, first + segment),
                       [&](int64_t p, int64_t q) {
                         for (int64_t t2 = 0; t2 < taps; ++t2) {
                           const bool p_reads = at[p * taps + t2] >= 0, q_reads = at[q * taps + t2] >= 0;
                           if (p_reads != q_reads) return p_reads;
                         }
                         return false;
                       });
    }
  }
};

// A [pixels, taps * block] for a block's rows (each PixelRow::count pixels from column at[2]): for
// each pixel p and tap t, the `block` values from value `first` of the source pixel (n, map(0, p0,
// t0), map(1, p1, t1), map(2, p2, t2)) of a grid of `sizes` with `pixel_values` values a pixel
// (undefined where a map gives -1, no data: a->valid says which taps of each row read data, and
// ZeroUnreadTaps writes the zeros the products read). The first two axes' coordinates are worked out
// once a row, the last axis' once a call (`axis`): a pixel's offset for each tap, from the geometry's
// divisions and modulos, had cost the stem's gather more than its products. A's rows follow
// axis.order; a->pixel says which pixel of the block each is.
template <typename T, typename AxisMap>
void GatherRows(const ConvGeometry& g, const T* src, const std::vector<PixelRow>& rows, const RowAxis& axis,
                const int64_t (&sizes)[3], int64_t pixel_values, int64_t first, AxisMap map, TapRows* a,
                TapSpan taps = kEveryTap) {
  const int64_t w01 = g.window[0] * g.window[1], w2 = axis.taps;
  std::vector<int64_t> row01(w01);  // the source's row of pixels (n, i0, i1) through each tap, or -1
  a->rows = 0;
  for (size_t row = 0; row < rows.size(); ++row) {
    const PixelRow& r = rows[row];
    const int64_t width = r.count, column = r.at[2];
    for (int64_t t01 = 0; t01 < w01; ++t01) {
      const int64_t i0 = map(0, r.at[0], t01 / g.window[1]), i1 = map(1, r.at[1], t01 % g.window[1]);
      row01[t01] = i0 < 0 || i1 < 0 ? -1 : (r.n * sizes[0] + i0) * sizes[1] + i1;
    }
    for (int64_t q = 0; q < width; ++q) {
      const int64_t pixel = a->rows + q, p2 = axis.order[column + q];
      a->pixel[pixel] = a->rows + p2 - column;
      for (int64_t t01 = 0; t01 < w01; ++t01) {
        for (int64_t t2 = 0; t2 < w2; ++t2) {
          const int64_t tap = t01 * w2 + t2;
          if (tap < taps.first || tap >= taps.end) continue;
          const int64_t i2 = axis.at[p2 * w2 + t2];
          const bool valid = row01[t01] >= 0 && i2 >= 0;
          a->valid[pixel * a->taps + tap] = valid;
          if (!valid) continue;  // its values are undefined (ZeroUnreadTaps)
          float* dst = a->At(pixel, tap);
          const T* values = src + (row01[t01] * sizes[2] + i2) * pixel_values + first;
          for (int64_t c = 0; c < a->block; ++c) dst[c] = ToFloat(values[c]);
        }
      }
    }
    a->rows += width;
  }
}

// A [rows * W, taps * Cg]: the input channels of `group` that each pixel of the output rows reads
// (axis: RowAxis(g, g.out[2], InputMap(g), ...)).
template <typename T>
void GatherInputRows(const ConvGeometry& g, const T* x, const std::vector<PixelRow>& rows, int64_t group,
                     const RowAxis& axis, TapRows* a, TapSpan taps = kEveryTap) {
  GatherRows(g, x, rows, axis, g.in, g.channels, group * g.GroupChannels(), InputMap(g), a, taps);
}

// A [rows * W, taps * Kg]: the dy features of `group` of the output pixel that reads each pixel of
// the input rows through each tap (axis: RowAxis(g, g.in[2], OutputMap(g), ...)).
template <typename T>
void GatherGradRows(const ConvGeometry& g, const T* dy, const std::vector<PixelRow>& rows, int64_t group,
                    const RowAxis& axis, TapRows* a) {
  GatherRows(g, dy, rows, axis, g.out, g.filters, group * g.GroupFilters(), OutputMap(g), a);
}

// A group's filter as float: [taps * Cg, Kg] (for fprop) or, transposed per tap, [taps * Kg, Cg] (for
// dgrad), its columns padded with zeros to PaddedCols, in MatMulColumns' strips of kTileCols columns:
// [cols / kTileCols][taps * rows][kTileCols].
struct GroupFilterShape {
  int64_t rows, cols, floats;  // rows and columns a tap, floats a group
  GroupFilterShape(const ConvGeometry& g, bool transposed)
      : rows(transposed ? g.GroupFilters() : g.GroupChannels()),
        cols(PaddedCols(transposed ? g.GroupChannels() : g.GroupFilters())),
        floats(g.Taps() * rows * cols) {}
};

// Every group's filter into filters [groups, GroupFilterShape::floats]; a tap of a group an item on
// XLA's intra-op threads. The transpose goes kTileCols channels at a time, so that both sides stream.
template <typename T>
void GroupFilters(ffi::ThreadPool& pool, const ConvGeometry& g, const T* w, bool transposed, float* filters) {
  const int64_t cg = g.GroupChannels(), kg = g.GroupFilters(), taps = g.Taps();
  const GroupFilterShape shape(g, transposed);
  const int64_t rows = shape.rows, cols = shape.cols, used = transposed ? cg : kg;
  const int64_t strip_floats = taps * rows * kTileCols;
  ParallelFor(pool, g.groups * taps, [&](int64_t item) {
    const int64_t group = item / taps, tap = item % taps;
    const T* src = w + tap * cg * g.filters + group * kg;  // [Cg, K] with stride K, this group's Kg columns
    float* dst = filters + group * shape.floats + tap * rows * kTileCols;  // the tap's rows of the first strip
    // (row r, column c) of the tap at dst[c / kTileCols * strip_floats + r * kTileCols + c % kTileCols]
    const auto at = [&](int64_t r, int64_t c) -> float& {
      return dst[c / kTileCols * strip_floats + r * kTileCols + c % kTileCols];
    };
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = used; c < cols; ++c) at(r, c) = 0.0f;
    if (!transposed) {
      for (int64_t c = 0; c < cg; ++c)
        for (int64_t k = 0; k < kg; ++k) at(c, k) = ToFloat(src[c * g.filters + k]);
      return;
    }
    for (int64_t c0 = 0; c0 < cg; c0 += kTileCols)
      for (int64_t k = 0; k < kg; ++k)
        for (int64_t c = c0; c < std::min(cg, c0 + kTileCols); ++c) at(k, c) = ToFloat(src[c * g.filters + k]);
  });
}

// y[index, index + count) = the epilogue of one pixel's features [k, k + count) from their sums `acc`
// (overwritten): ConvEpilogue::Apply's sums and rounding, each step a loop over the features that
// vectorizes (the activation's kind a constant in its loop), where Apply a value at a time did not.
template <typename T>
void StoreFeatures(const ConvEpilogue<T>& epilogue, float* acc, int64_t count, int64_t index, int64_t k, T* y) {
  if (epilogue.bias != nullptr) {
    for (int64_t i = 0; i < count; ++i) acc[i] += ToFloat(epilogue.bias[k + i]);
  }
  if (epilogue.residual != nullptr) {
    for (int64_t i = 0; i < count; ++i) acc[i] += ToFloat(epilogue.residual[index + i]);
  }
  if (epilogue.activation != 0) {
    DispatchActivation(epilogue.activation, [&](auto kind) {
      for (int64_t i = 0; i < count; ++i) acc[i] = Activate<decltype(kind)::value>(acc[i], epilogue.activation_param);
    });
  }
  for (int64_t i = 0; i < count; ++i) y[index + i] = FromFloat<T>(acc[i]);
}

template <typename T>
void Fprop(ffi::ThreadPool& pool, const ConvGeometry& g, const T* x, const T* w, const ConvEpilogue<T>& epilogue,
           T* y) {
  if (TakesDepthwiseCpu(g)) return DepthwiseFpropCpu(pool, g, x, w, epilogue, y);
  const int64_t cg = g.GroupChannels(), kg = g.GroupFilters(), cols = PaddedCols(kg);
  const GroupFilterShape shape(g, false);
  const CachedBuffer filters(g.groups * shape.floats);
  GroupFilters(pool, g, w, false, filters.data());
  const RowAxis axis(g, g.out[2], InputMap(g), true);
  BlockProducts(
      pool, g, RowBlocks(g.batch, g.out), cg, filters.data(), shape.floats, cols,
      [&](const std::vector<PixelRow>& rows, int64_t group, TapRows* a) {
        GatherInputRows(g, x, rows, group, axis, a);
      },
      [&](int64_t group, int64_t pixel, const TapRows& a, float* y_rows) {
        for (int64_t r = 0; r < a.rows; ++r) {
          const int64_t index = (pixel + a.pixel[r]) * g.filters + group * kg;
          StoreFeatures(epilogue, y_rows + r * cols, kg, index, group * kg, y);
        }
      });
}

template <typename T>
void Dgrad(ffi::ThreadPool& pool, const ConvGeometry& g, const T* dy, const T* w, T* dx) {
  if (TakesDepthwiseCpu(g)) return DepthwiseDgradCpu(pool, g, dy, w, dx);
  const int64_t cg = g.GroupChannels(), kg = g.GroupFilters(), cols = PaddedCols(cg);
  const GroupFilterShape shape(g, true);
  const CachedBuffer filters(g.groups * shape.floats);
  GroupFilters(pool, g, w, true, filters.data());
  const RowAxis axis(g, g.in[2], OutputMap(g), true);
  BlockProducts(
      pool, g, RowBlocks(g.batch, g.in), kg, filters.data(), shape.floats, cols,
      [&](const std::vector<PixelRow>& rows, int64_t group, TapRows* a) {
        GatherGradRows(g, dy, rows, group, axis, a);
      },
      [&](int64_t group, int64_t pixel, const TapRows& a, float* dx_rows) {
        for (int64_t r = 0; r < a.rows; ++r) {
          T* dst = dx + (pixel + a.pixel[r]) * g.channels + group * cg;
          for (int64_t c = 0; c < cg; ++c) dst[c] = FromFloat<T>(dx_rows[r * cols + c]);
        }
      });
}

// wgrad sums over every block, in slices of the blocks summed into dW's of their own, then added in
// order; each slice's taps are split into items on XLA's intra-op threads (an item gathering its
// taps' values only). How many slices depends on the problem alone (a slice of kSlicePixels output
// pixels or more, at most kMaxSlices, and partial sums of at most kSliceFloats floats in all), not on
// the threads, so that the result does not either. Slices of fewer pixels had cost more in storing and
// adding their partial dW's than they saved (2-core AVX-512 machine, 28^2 128 -> 128 3x3 at N 2:
// 16 slices of 56 pixels, wgrad 6.1 ms against XLA's 3.1).
constexpr int64_t kMaxSlices = 16, kSliceFloats = int64_t(1) << 24, kSlicePixels = 1024;
// Taps an item takes: enough for kMinItemOutputs values of dW (a stem's 16 taps of 12 channels by 64
// filters stay one item: 16 items of one tap each, every one converting dy again, ran 17% slower).
constexpr int64_t kMinItemOutputs = 16384;

template <typename T, typename D>
void Wgrad(ffi::ThreadPool& pool, const ConvGeometry& g, const T* x, const T* dy, D* dw) {
  if (TakesDepthwiseCpu(g)) return DepthwiseWgradCpu(pool, g, x, dy, dw);
  const int64_t cg = g.GroupChannels(), kg = g.GroupFilters(), taps = g.Taps(), cols = PaddedCols(kg);
  const RowBlocks blocks(g.batch, g.out);
  const int64_t part = taps * cg * cols;  // one slice's dW of one group
  const RowAxis axis(g, g.out[2], InputMap(g), false);
  const int64_t wanted_items = std::clamp<int64_t>(part / kMinItemOutputs, 1, taps);
  const int64_t per_item = (taps + wanted_items - 1) / wanted_items;  // taps an item
  const int64_t tap_items = (taps + per_item - 1) / per_item;         // none of them empty
  // Two slices at least where a slice's taps are one item (a 1x1 layer of few pixels), for two items.
  const int64_t min_slices = tap_items == 1 ? 2 : 1;
  const int64_t slices = std::max<int64_t>(
      1, std::min({blocks.count, kMaxSlices, std::max(g.OutPixels() / kSlicePixels, min_slices),
                   kSliceFloats / (g.groups * part)}));
  // [groups, slices, taps * Cg, cols], each item's first block writing its own rows (zeroing it first
  // cost as much as the products on filters of a few MB, 7^2 512 -> 512, where a slice has one or two
  // blocks)
  const CachedBuffer parts_buffer(g.groups * slices * part);
  float* const parts = parts_buffer.data();
  ParallelFor(pool, g.groups * slices * tap_items, [&](int64_t item) {
    const int64_t group = item / (slices * tap_items), slice = item / tap_items % slices;
    const TapSpan span{item % tap_items * per_item, std::min(taps, (item % tap_items + 1) * per_item)};
    float* out = parts + (group * slices + slice) * part;
    const int64_t pixels = blocks.MaxPixels();
    const auto [a_values, dy_rows] = ScratchBuffers({TapRows::Floats(pixels, taps, cg), pixels * cols});
    TapRows a(pixels, taps, cg, a_values);
    for (int64_t r = 0; r < pixels; ++r) std::fill(dy_rows + r * cols + kg, dy_rows + (r + 1) * cols, 0.0f);
    std::vector<PixelRow> rows;
    const int64_t first = blocks.count * slice / slices, end = blocks.count * (slice + 1) / slices;
    if (first == end) {  // no blocks (an empty batch)
      std::fill_n(out + span.first * cg * cols, (span.end - span.first) * cg * cols, 0.0f);
    }
    for (int64_t b = first; b < end; ++b) {
      const int64_t pixel = blocks.Get(b, &rows);
      GatherInputRows(g, x, rows, group, axis, &a, span);
      for (int64_t r = 0; r < a.rows; ++r)
        for (int64_t k = 0; k < kg; ++k) dy_rows[r * cols + k] = ToFloat(dy[(pixel + r) * g.filters + group * kg + k]);
      MatMulTransposedAccumulate(a, dy_rows, out, cols, b == first, span);
    }
  });
  ParallelFor(pool, g.groups * taps * cg, [&](int64_t row) {  // row: a group's [tap, channel]
    const int64_t group = row / (taps * cg), j = row % (taps * cg);
    for (int64_t k = 0; k < kg; ++k) {
      float sum = 0.0f;
      for (int64_t slice = 0; slice < slices; ++slice) sum += parts[(group * slices + slice) * part + j * cols + k];
      dw[j * g.filters + group * kg + k] = FromFloat<D>(sum);
    }
  });
}

ffi::Error ConvFpropImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> /*workspace: the GPU's*/, ConvAttrs attrs) {
  ConvGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakeConvGeometry(attrs, x.dimensions(), w.dimensions(), y->dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, w, *y));
  if (g.OutPixels() * g.filters == 0) return ffi::Error::Success();
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    Fprop(pool, g, static_cast<const T*>(x.untyped_data()), static_cast<const T*>(w.untyped_data()), ConvEpilogue<T>{},
          static_cast<T*>(y->untyped_data()));
    return ffi::Error::Success();
  });
}

ffi::Error ConvFpropFusedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                              std::optional<ffi::AnyBuffer> residual, ffi::Result<ffi::AnyBuffer> y,
                              ffi::Result<ffi::AnyBuffer> /*workspace: the GPU's*/, ConvFusedAttrs attrs) {
  ConvGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakeConvGeometry(attrs.conv, x.dimensions(), w.dimensions(), y->dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, w, *y));
  JAXDNN_RETURN_IF_ERROR(CheckEpilogue(g, x, bias, residual, *y, attrs.activation));
  if (g.OutPixels() * g.filters == 0) return ffi::Error::Success();
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    ConvEpilogue<T> epilogue;
    epilogue.bias = static_cast<const T*>(bias.untyped_data());
    epilogue.residual = residual.has_value() ? static_cast<const T*>(residual->untyped_data()) : nullptr;
    epilogue.activation = attrs.activation;
    epilogue.activation_param = attrs.activation_param;
    Fprop(pool, g, static_cast<const T*>(x.untyped_data()), static_cast<const T*>(w.untyped_data()), epilogue,
          static_cast<T*>(y->untyped_data()));
    return ffi::Error::Success();
  });
}

ffi::Error ConvDgradImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> dx,
                         ffi::Result<ffi::AnyBuffer> /*workspace: the GPU's*/, ConvAttrs attrs) {
  ConvGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakeConvGeometry(attrs, dx->dimensions(), w.dimensions(), dy.dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(dy, w, *dx));
  if (g.InPixels() * g.channels == 0) return ffi::Error::Success();
  return DispatchFloat<float, Bf16, Half>(dy.element_type(), "dy", [&](auto type_tag) {
    using T = decltype(type_tag);
    Dgrad(pool, g, static_cast<const T*>(dy.untyped_data()), static_cast<const T*>(w.untyped_data()),
          static_cast<T*>(dx->untyped_data()));
    return ffi::Error::Success();
  });
}

ffi::Error ConvWgradImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dw,
                         ffi::Result<ffi::AnyBuffer> /*workspace: the GPU's*/, ConvAttrs attrs) {
  ConvGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakeConvGeometry(attrs, x.dimensions(), dw->dimensions(), dy.dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckWgradDtypes(x, dy, *dw));
  if (g.Taps() * g.GroupChannels() * g.filters == 0) return ffi::Error::Success();
  // An empty batch still writes dw (zeros): the loops over N simply run no rows.
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    const T* x_data = static_cast<const T*>(x.untyped_data());
    const T* dy_data = static_cast<const T*>(dy.untyped_data());
    if (dw->element_type() == x.element_type()) {
      Wgrad(pool, g, x_data, dy_data, static_cast<T*>(dw->untyped_data()));
    } else {  // float32 sums of 16-bit operands
      Wgrad(pool, g, x_data, dy_data, static_cast<float*>(dw->untyped_data()));
    }
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConvFpropCpu, jaxdnn::ConvFpropImpl, jaxdnn::BindConvFprop(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ConvFpropFusedCpu, jaxdnn::ConvFpropFusedImpl,
                              jaxdnn::BindConvFpropFused(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ConvDgradCpu, jaxdnn::ConvDgradImpl, jaxdnn::BindConvDgrad(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ConvWgradCpu, jaxdnn::ConvWgradImpl, jaxdnn::BindConvWgrad(jaxdnn::BindWithThreadPool()));
