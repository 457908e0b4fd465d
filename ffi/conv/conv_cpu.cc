// CPU convolution: im2col per block of pixel rows, then a matmul with float32 accumulation, in tiles
// of kTileRows x kTileCols held in registers (an AVX2/FMA build of them where the CPU has it).
//   fprop: for each block of output rows and group, A [pixels, taps * Cg] gathers the input pixels
//          they read; y [pixels, Kg] = A @ W_g [taps * Cg, Kg] over the taps that read data (padding
//          and dilation holes are zeros, skipped where a whole tile has them).
//   dgrad: for each block of input rows and group, A [pixels, taps * Kg] gathers the dy pixels that
//          read each input pixel (none for most taps of a strided convolution);
//          dx [pixels, Cg] = A @ W_g^T [taps * Kg, Cg].
//   wgrad: dW_g [taps * Cg, Kg] = sum over blocks of output rows of A^T @ dy, A as in fprop.
// The gathers use conv_geometry.h's index maps and the forward conv_epilogue.h's epilogue, the CUDA
// kernels' own.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "common/half_cpu.h"
#include "conv/conv.h"
#include "conv/conv_common.h"
#include "conv/conv_epilogue.h"
#include "conv/conv_geometry.h"

namespace jaxdnn {
namespace {

// The im2col matrix of a block of pixels (whole rows): `block` values per window tap and pixel, and
// which taps of each pixel read data. The others (padding, dilation holes, strides that skip a pixel)
// hold zeros: a tile of pixels skips a tap only when none of its pixels reads data through it.
struct TapRows {
  // rows: the block's pixels (the gathers set it; the storage holds the largest block)
  int64_t rows = 0, taps = 0, block = 0;
  std::vector<float> values;   // [rows, taps * block]
  std::vector<uint8_t> valid;  // [rows, taps]

  TapRows(int64_t rows, int64_t taps, int64_t block)
      : rows(rows), taps(taps), block(block), values(rows * taps * block), valid(rows * taps) {}
  float* At(int64_t row, int64_t tap) { return values.data() + (row * taps + tap) * block; }
  const float* At(int64_t row, int64_t tap) const { return values.data() + (row * taps + tap) * block; }
};

// The matmuls' tiles: kTileRows rows of the result by kTileCols columns, held in registers (8 AVX2
// registers) while the reduction runs; every matrix's columns are padded to a multiple of kTileCols.
constexpr int kTileRows = 4, kTileCols = 16;

int64_t PaddedCols(int64_t cols) { return (cols + kTileCols - 1) / kTileCols * kTileCols; }

// out[rows, cols] = A @ b[taps * block, cols] (cols a multiple of kTileCols), skipping the taps no
// pixel of a tile reads through. The reduction runs in chunks of taps of about kChunkValues values,
// so that a chunk of a strip of b's columns stays in L1 across the row tiles (a tile's partial sums
// go through `out` between chunks). A tile past the last row repeats it (its results are not stored).
constexpr int64_t kChunkValues = 256;

inline __attribute__((always_inline)) void MatMulTiles(const TapRows& a, const float* b, float* out,
                                                       int64_t cols) {
  const int64_t chunk_taps = std::max<int64_t>(1, kChunkValues / std::max<int64_t>(1, a.block));
  for (int64_t c0 = 0; c0 < cols; c0 += kTileCols) {
    for (int64_t t0 = 0; t0 == 0 || t0 < a.taps; t0 += chunk_taps) {  // once with no taps: zeros
      const int64_t t1 = std::min(a.taps, t0 + chunk_taps);
      for (int64_t r0 = 0; r0 < a.rows; r0 += kTileRows) {
        const int64_t tile_rows = std::min<int64_t>(kTileRows, a.rows - r0);
        float acc[kTileRows][kTileCols] = {};
        if (t0 > 0) {
          for (int64_t i = 0; i < tile_rows; ++i) std::copy_n(out + (r0 + i) * cols + c0, kTileCols, acc[i]);
        }
        for (int64_t tap = t0; tap < t1; ++tap) {
          bool read = false;
          const float* rows[kTileRows];
          for (int i = 0; i < kTileRows; ++i) {
            const int64_t r = r0 + std::min<int64_t>(i, tile_rows - 1);
            read = read || a.valid[r * a.taps + tap];
            rows[i] = a.At(r, tap);
          }
          if (!read) continue;
          const float* b_block = b + tap * a.block * cols + c0;
          for (int64_t j = 0; j < a.block; ++j) {
            const float* b_row = b_block + j * cols;
            for (int i = 0; i < kTileRows; ++i) {
              const float scale = rows[i][j];
              for (int c = 0; c < kTileCols; ++c) acc[i][c] += scale * b_row[c];
            }
          }
        }
        for (int64_t i = 0; i < tile_rows; ++i) std::copy_n(acc[i], kTileCols, out + (r0 + i) * cols + c0);
      }
    }
  }
}

// acc[taps * block, cols] += A^T @ b[rows, cols] (cols a multiple of kTileCols) over each row's valid
// taps, a tile of kTileRows values of a tap's block by kTileCols columns at a time (a tile past the
// block's end repeats its last value; those sums are not stored).
inline __attribute__((always_inline)) void MatMulTransposedAccumulateTiles(const TapRows& a, const float* b,
                                                                           float* acc, int64_t cols) {
  for (int64_t tap = 0; tap < a.taps; ++tap) {
    for (int64_t j0 = 0; j0 < a.block; j0 += kTileRows) {
      const int64_t tile_rows = std::min<int64_t>(kTileRows, a.block - j0);
      for (int64_t c0 = 0; c0 < cols; c0 += kTileCols) {
        float tile[kTileRows][kTileCols] = {};
        for (int64_t r = 0; r < a.rows; ++r) {
          if (!a.valid[r * a.taps + tap]) continue;
          const float* a_values = a.At(r, tap) + j0;
          const float* b_row = b + r * cols + c0;
          for (int i = 0; i < kTileRows; ++i) {
            const float scale = a_values[std::min<int64_t>(i, tile_rows - 1)];
            for (int c = 0; c < kTileCols; ++c) tile[i][c] += scale * b_row[c];
          }
        }
        for (int64_t i = 0; i < tile_rows; ++i) {
          float* acc_row = acc + (tap * a.block + j0 + i) * cols + c0;
          for (int c = 0; c < kTileCols; ++c) acc_row[c] += tile[i][c];
        }
      }
    }
  }
}

// The matmuls for the CPU at hand: built for AVX2 and FMA too on x86-64 (the package's baseline is
// SSE2), chosen once at run time.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2,fma"))) void MatMulAvx2(const TapRows& a, const float* b, float* out, int64_t cols) {
  MatMulTiles(a, b, out, cols);
}
__attribute__((target("avx2,fma"))) void MatMulTransposedAccumulateAvx2(const TapRows& a, const float* b,
                                                                         float* acc, int64_t cols) {
  MatMulTransposedAccumulateTiles(a, b, acc, cols);
}
bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

void MatMul(const TapRows& a, const float* b, float* out, int64_t cols) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (HasAvx2()) return MatMulAvx2(a, b, out, cols);
#endif
  MatMulTiles(a, b, out, cols);
}

void MatMulTransposedAccumulate(const TapRows& a, const float* b, float* acc, int64_t cols) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (HasAvx2()) return MatMulTransposedAccumulateAvx2(a, b, acc, cols);
#endif
  MatMulTransposedAccumulateTiles(a, b, acc, cols);
}

// Calls fn(tap index, tap coordinates) for every window tap in row-major order.
template <typename Fn>
void ForEachTap(const ConvGeometry& g, Fn&& fn) {
  int64_t t[3];
  int64_t tap = 0;
  for (t[0] = 0; t[0] < g.window[0]; ++t[0])
    for (t[1] = 0; t[1] < g.window[1]; ++t[1])
      for (t[2] = 0; t[2] < g.window[2]; ++t[2]) fn(tap++, t);
}

// A row of pixels of an [N, sizes[0], sizes[1], sizes[2]] grid: its sample and first two coordinates.
struct PixelRow {
  int64_t n, at[3];
};

// The matmuls take blocks of about kBlockPixels pixels (whole rows), so that each pass over a large
// filter serves many pixels.
constexpr int64_t kBlockPixels = 64;

int64_t RowsPerBlock(int64_t width) { return std::max<int64_t>(1, kBlockPixels / std::max<int64_t>(1, width)); }

// Calls fn(rows, first pixel) for blocks of RowsPerBlock consecutive rows of an [N, sizes[0],
// sizes[1], sizes[2]] pixel grid (their pixels are consecutive too; the last block may have fewer).
template <typename Fn>
void ForEachRowBlock(int64_t batch, const int64_t sizes[3], Fn&& fn) {
  const int64_t per_block = RowsPerBlock(sizes[2]);
  std::vector<PixelRow> rows;
  int64_t first = 0;
  for (int64_t n = 0; n < batch; ++n)
    for (int64_t a0 = 0; a0 < sizes[0]; ++a0)
      for (int64_t a1 = 0; a1 < sizes[1]; ++a1) {
        if (rows.empty()) first = ((n * sizes[0] + a0) * sizes[1] + a1) * sizes[2];
        rows.push_back({n, {a0, a1, 0}});
        if (int64_t(rows.size()) == per_block) {
          fn(rows, first);
          rows.clear();
        }
      }
  if (!rows.empty()) fn(rows, first);
}

// A [rows * W, taps * block] for rows of W pixels: for each pixel p and tap t, the `block` values of
// `src` from offset_of(n, p, t) + `first` (zeros where offset_of is negative: no data).
template <typename T, typename OffsetOf>
void GatherRows(const ConvGeometry& g, const T* src, const std::vector<PixelRow>& rows, int64_t width,
                int64_t first, OffsetOf offset_of, TapRows* a) {
  a->rows = int64_t(rows.size()) * width;
  for (size_t row = 0; row < rows.size(); ++row) {
    int64_t p[3] = {rows[row].at[0], rows[row].at[1], 0};
    for (p[2] = 0; p[2] < width; ++p[2]) {
      const int64_t pixel = int64_t(row) * width + p[2];
      ForEachTap(g, [&](int64_t tap, const int64_t* t) {
        const int64_t offset = offset_of(rows[row].n, p, t);
        a->valid[pixel * a->taps + tap] = offset >= 0;
        float* dst = a->At(pixel, tap);
        if (offset < 0) {
          std::fill_n(dst, a->block, 0.0f);
          return;
        }
        for (int64_t c = 0; c < a->block; ++c) dst[c] = ToFloat(src[offset + first + c]);
      });
    }
  }
}

// A [rows * W, taps * Cg]: the input channels of `group` that each pixel of the output rows reads.
template <typename T>
void GatherInputRows(const ConvGeometry& g, const T* x, const std::vector<PixelRow>& rows, int64_t group,
                     TapRows* a) {
  GatherRows(g, x, rows, g.out[2], group * g.GroupChannels(),
             [&](int64_t n, const int64_t* o, const int64_t* t) { return g.InputOffset(n, o, t); }, a);
}

// A [rows * W, taps * Kg]: the dy features of `group` of the output pixel that reads each pixel of
// the input rows through each tap.
template <typename T>
void GatherGradRows(const ConvGeometry& g, const T* dy, const std::vector<PixelRow>& rows, int64_t group,
                    TapRows* a) {
  GatherRows(g, dy, rows, g.in[2], group * g.GroupFilters(),
             [&](int64_t n, const int64_t* i, const int64_t* t) { return g.OutputOffset(n, i, t); }, a);
}

// The filter of one group as float: [taps * Cg, Kg] (for fprop) or, transposed per tap, [taps * Kg,
// Cg] (for dgrad), its columns padded with zeros to PaddedCols.
template <typename T>
std::vector<float> GroupFilter(const ConvGeometry& g, const T* w, int64_t group, bool transposed) {
  const int64_t cg = g.GroupChannels(), kg = g.GroupFilters(), taps = g.Taps();
  const int64_t cols = PaddedCols(transposed ? cg : kg);
  std::vector<float> out(taps * (transposed ? kg : cg) * cols, 0.0f);
  for (int64_t tap = 0; tap < taps; ++tap)
    for (int64_t c = 0; c < cg; ++c)
      for (int64_t k = 0; k < kg; ++k) {
        const float v = ToFloat(w[(tap * cg + c) * g.filters + group * kg + k]);
        out[transposed ? (tap * kg + k) * cols + c : (tap * cg + c) * cols + k] = v;
      }
  return out;
}

template <typename T>
void Fprop(const ConvGeometry& g, const T* x, const T* w, const ConvEpilogue<T>& epilogue, T* y) {
  const int64_t cg = g.GroupChannels(), kg = g.GroupFilters(), cols = PaddedCols(kg);
  TapRows a(RowsPerBlock(g.out[2]) * g.out[2], g.Taps(), cg);
  std::vector<float> y_rows(a.rows * cols);
  for (int64_t group = 0; group < g.groups; ++group) {
    const std::vector<float> filter = GroupFilter(g, w, group, false);
    ForEachRowBlock(g.batch, g.out, [&](const std::vector<PixelRow>& rows, int64_t pixel) {
      GatherInputRows(g, x, rows, group, &a);
      MatMul(a, filter.data(), y_rows.data(), cols);
      for (int64_t r = 0; r < a.rows; ++r) {
        for (int64_t k = group * kg; k < (group + 1) * kg; ++k) {
          const int64_t index = (pixel + r) * g.filters + k;
          y[index] = FromFloat<T>(epilogue.Apply(y_rows[r * cols + k - group * kg], index, k));
        }
      }
    });
  }
}

template <typename T>
void Dgrad(const ConvGeometry& g, const T* dy, const T* w, T* dx) {
  const int64_t cg = g.GroupChannels(), kg = g.GroupFilters(), cols = PaddedCols(cg);
  TapRows a(RowsPerBlock(g.in[2]) * g.in[2], g.Taps(), kg);
  std::vector<float> dx_rows(a.rows * cols);
  for (int64_t group = 0; group < g.groups; ++group) {
    const std::vector<float> filter = GroupFilter(g, w, group, true);
    ForEachRowBlock(g.batch, g.in, [&](const std::vector<PixelRow>& rows, int64_t pixel) {
      GatherGradRows(g, dy, rows, group, &a);
      MatMul(a, filter.data(), dx_rows.data(), cols);
      for (int64_t i = 0; i < a.rows; ++i)
        for (int64_t c = 0; c < cg; ++c) {
          dx[(pixel + i) * g.channels + group * cg + c] = FromFloat<T>(dx_rows[i * cols + c]);
        }
    });
  }
}

template <typename T>
void Wgrad(const ConvGeometry& g, const T* x, const T* dy, T* dw) {
  const int64_t cg = g.GroupChannels(), kg = g.GroupFilters(), taps = g.Taps(), cols = PaddedCols(kg);
  TapRows a(RowsPerBlock(g.out[2]) * g.out[2], taps, cg);
  std::vector<float> dy_rows(a.rows * cols, 0.0f), acc(taps * cg * cols);
  for (int64_t group = 0; group < g.groups; ++group) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    ForEachRowBlock(g.batch, g.out, [&](const std::vector<PixelRow>& rows, int64_t pixel) {
      GatherInputRows(g, x, rows, group, &a);
      for (int64_t r = 0; r < a.rows; ++r)
        for (int64_t k = 0; k < kg; ++k) dy_rows[r * cols + k] = ToFloat(dy[(pixel + r) * g.filters + group * kg + k]);
      MatMulTransposedAccumulate(a, dy_rows.data(), acc.data(), cols);
    });
    for (int64_t j = 0; j < taps * cg; ++j)
      for (int64_t k = 0; k < kg; ++k) dw[j * g.filters + group * kg + k] = FromFloat<T>(acc[j * cols + k]);
  }
}

ffi::Error ConvFpropImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> /*workspace: the GPU's*/, ConvAttrs attrs) {
  ConvGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakeConvGeometry(attrs, x.dimensions(), w.dimensions(), y->dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, w, *y));
  if (g.OutPixels() * g.filters == 0) return ffi::Error::Success();
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    Fprop(g, static_cast<const T*>(x.untyped_data()), static_cast<const T*>(w.untyped_data()), ConvEpilogue<T>{},
          static_cast<T*>(y->untyped_data()));
    return ffi::Error::Success();
  });
}

ffi::Error ConvFpropFusedImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
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
    Fprop(g, static_cast<const T*>(x.untyped_data()), static_cast<const T*>(w.untyped_data()), epilogue,
          static_cast<T*>(y->untyped_data()));
    return ffi::Error::Success();
  });
}

ffi::Error ConvDgradImpl(ffi::AnyBuffer dy, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> dx,
                         ffi::Result<ffi::AnyBuffer> /*workspace: the GPU's*/, ConvAttrs attrs) {
  ConvGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakeConvGeometry(attrs, dx->dimensions(), w.dimensions(), dy.dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(dy, w, *dx));
  if (g.InPixels() * g.channels == 0) return ffi::Error::Success();
  return DispatchFloat<float, Bf16, Half>(dy.element_type(), "dy", [&](auto type_tag) {
    using T = decltype(type_tag);
    Dgrad(g, static_cast<const T*>(dy.untyped_data()), static_cast<const T*>(w.untyped_data()),
          static_cast<T*>(dx->untyped_data()));
    return ffi::Error::Success();
  });
}

ffi::Error ConvWgradImpl(ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dw,
                         ffi::Result<ffi::AnyBuffer> /*workspace: the GPU's*/, ConvAttrs attrs) {
  ConvGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakeConvGeometry(attrs, x.dimensions(), dw->dimensions(), dy.dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, dy, *dw));
  if (g.Taps() * g.GroupChannels() * g.filters == 0) return ffi::Error::Success();
  // An empty batch still writes dw (zeros): the loops over N simply run no rows.
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    Wgrad(g, static_cast<const T*>(x.untyped_data()), static_cast<const T*>(dy.untyped_data()),
          static_cast<T*>(dw->untyped_data()));
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConvFpropCpu, jaxdnn::ConvFpropImpl, jaxdnn::BindConvFprop(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ConvFpropFusedCpu, jaxdnn::ConvFpropFusedImpl,
                              jaxdnn::BindConvFpropFused(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ConvDgradCpu, jaxdnn::ConvDgradImpl, jaxdnn::BindConvDgrad(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ConvWgradCpu, jaxdnn::ConvWgradImpl, jaxdnn::BindConvWgrad(ffi::Ffi::Bind()));
