// CPU convolution: im2col per row of pixels, then a matmul with float32 accumulation.
//   fprop: for each output row (n, p, q) and group, A [R, taps * Cg] gathers the input pixels the
//          row reads; y_row [R, Kg] = A @ W_g [taps * Cg, Kg] over the taps that read data (padding
//          and dilation holes are skipped).
//   dgrad: for each input row (n, d, h) and group, A [W, taps * Kg] gathers the dy pixels that read
//          each input pixel (none for most taps of a strided convolution: skipped);
//          dx_row [W, Cg] = A @ W_g^T [taps * Kg, Cg].
//   wgrad: dW_g [taps * Cg, Kg] = sum over output rows of A^T @ dy_row, A as in fprop.
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

// The im2col matrix of one row of pixels: `block` values per window tap and pixel, and which taps of
// each pixel read data. The others (padding, dilation holes, strides that skip a pixel) are left
// unwritten and skipped by the matmuls, as the CUDA kernels skip them.
struct TapRows {
  int64_t rows = 0, taps = 0, block = 0;
  std::vector<float> values;   // [rows, taps * block]
  std::vector<uint8_t> valid;  // [rows, taps]

  TapRows(int64_t rows, int64_t taps, int64_t block)
      : rows(rows), taps(taps), block(block), values(rows * taps * block), valid(rows * taps) {}
  float* At(int64_t row, int64_t tap) { return values.data() + (row * taps + tap) * block; }
  const float* At(int64_t row, int64_t tap) const { return values.data() + (row * taps + tap) * block; }
};

// out[rows, cols] = A @ b[taps * block, cols] over each row's valid taps; the inner loop runs over
// contiguous columns of b and out (vectorized), one row of out stays in cache.
void MatMul(const TapRows& a, const float* b, float* out, int64_t cols) {
  for (int64_t r = 0; r < a.rows; ++r) {
    float* out_row = out + r * cols;
    std::fill(out_row, out_row + cols, 0.0f);
    for (int64_t tap = 0; tap < a.taps; ++tap) {
      if (!a.valid[r * a.taps + tap]) continue;
      const float* a_block = a.At(r, tap);
      const float* b_block = b + tap * a.block * cols;
      for (int64_t j = 0; j < a.block; ++j) {
        const float scale = a_block[j];
        const float* b_row = b_block + j * cols;
        for (int64_t c = 0; c < cols; ++c) out_row[c] += scale * b_row[c];
      }
    }
  }
}

// acc[taps * block, cols] += A^T @ b[rows, cols] over each row's valid taps.
void MatMulTransposedAccumulate(const TapRows& a, const float* b, float* acc, int64_t cols) {
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* b_row = b + r * cols;
    for (int64_t tap = 0; tap < a.taps; ++tap) {
      if (!a.valid[r * a.taps + tap]) continue;
      const float* a_block = a.At(r, tap);
      float* acc_block = acc + tap * a.block * cols;
      for (int64_t j = 0; j < a.block; ++j) {
        const float scale = a_block[j];
        float* acc_row = acc_block + j * cols;
        for (int64_t c = 0; c < cols; ++c) acc_row[c] += scale * b_row[c];
      }
    }
  }
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

// Calls fn(n, row coordinates [a0, a1, 0], row offset in pixels) for every row of an
// [N, sizes[0], sizes[1], sizes[2]] pixel grid.
template <typename Fn>
void ForEachRow(int64_t batch, const int64_t sizes[3], Fn&& fn) {
  int64_t at[3] = {0, 0, 0};
  for (int64_t n = 0; n < batch; ++n)
    for (at[0] = 0; at[0] < sizes[0]; ++at[0])
      for (at[1] = 0; at[1] < sizes[1]; ++at[1]) fn(n, at, ((n * sizes[0] + at[0]) * sizes[1] + at[1]) * sizes[2]);
}

// A [R, taps * Cg]: the input channels of `group` that each pixel of output row (n, o) reads.
template <typename T>
void GatherInputRow(const ConvGeometry& g, const T* x, int64_t n, const int64_t row[3], int64_t group, TapRows* a) {
  const int64_t cg = g.GroupChannels();
  int64_t o[3] = {row[0], row[1], 0};
  for (o[2] = 0; o[2] < g.out[2]; ++o[2]) {
    ForEachTap(g, [&](int64_t tap, const int64_t* t) {
      const int64_t offset = g.InputOffset(n, o, t);
      a->valid[o[2] * a->taps + tap] = offset >= 0;
      if (offset < 0) return;
      const T* src = x + offset + group * cg;
      float* dst = a->At(o[2], tap);
      for (int64_t c = 0; c < cg; ++c) dst[c] = ToFloat(src[c]);
    });
  }
}

// A [W, taps * Kg]: the dy features of `group` of the output pixel that reads each pixel of input
// row (n, i) through each tap.
template <typename T>
void GatherGradRow(const ConvGeometry& g, const T* dy, int64_t n, const int64_t row[3], int64_t group, TapRows* a) {
  const int64_t kg = g.GroupFilters();
  int64_t i[3] = {row[0], row[1], 0};
  for (i[2] = 0; i[2] < g.in[2]; ++i[2]) {
    ForEachTap(g, [&](int64_t tap, const int64_t* t) {
      const int64_t offset = g.OutputOffset(n, i, t);
      a->valid[i[2] * a->taps + tap] = offset >= 0;
      if (offset < 0) return;
      const T* src = dy + offset + group * kg;
      float* dst = a->At(i[2], tap);
      for (int64_t k = 0; k < kg; ++k) dst[k] = ToFloat(src[k]);
    });
  }
}

// The filter of one group as float: [taps * Cg, Kg] (for fprop and wgrad) or, transposed per tap,
// [taps * Kg, Cg] (for dgrad).
template <typename T>
std::vector<float> GroupFilter(const ConvGeometry& g, const T* w, int64_t group, bool transposed) {
  const int64_t cg = g.GroupChannels(), kg = g.GroupFilters(), taps = g.Taps();
  std::vector<float> out(taps * cg * kg);
  for (int64_t tap = 0; tap < taps; ++tap)
    for (int64_t c = 0; c < cg; ++c)
      for (int64_t k = 0; k < kg; ++k) {
        const float v = ToFloat(w[(tap * cg + c) * g.filters + group * kg + k]);
        out[transposed ? (tap * kg + k) * cg + c : (tap * cg + c) * kg + k] = v;
      }
  return out;
}

template <typename T>
void Fprop(const ConvGeometry& g, const T* x, const T* w, const ConvEpilogue<T>& epilogue, T* y) {
  const int64_t cg = g.GroupChannels(), kg = g.GroupFilters(), width = g.out[2];
  TapRows a(width, g.Taps(), cg);
  std::vector<float> y_row(width * kg);
  for (int64_t group = 0; group < g.groups; ++group) {
    const std::vector<float> filter = GroupFilter(g, w, group, false);
    ForEachRow(g.batch, g.out, [&](int64_t n, const int64_t* row, int64_t pixel) {
      GatherInputRow(g, x, n, row, group, &a);
      MatMul(a, filter.data(), y_row.data(), kg);
      for (int64_t r = 0; r < width; ++r) {
        for (int64_t k = group * kg; k < (group + 1) * kg; ++k) {
          const int64_t index = (pixel + r) * g.filters + k;
          y[index] = FromFloat<T>(epilogue.Apply(y_row[r * kg + k - group * kg], index, k));
        }
      }
    });
  }
}

template <typename T>
void Dgrad(const ConvGeometry& g, const T* dy, const T* w, T* dx) {
  const int64_t cg = g.GroupChannels(), kg = g.GroupFilters(), width = g.in[2];
  TapRows a(width, g.Taps(), kg);
  std::vector<float> dx_row(width * cg);
  for (int64_t group = 0; group < g.groups; ++group) {
    const std::vector<float> filter = GroupFilter(g, w, group, true);
    ForEachRow(g.batch, g.in, [&](int64_t n, const int64_t* row, int64_t pixel) {
      GatherGradRow(g, dy, n, row, group, &a);
      MatMul(a, filter.data(), dx_row.data(), cg);
      for (int64_t i = 0; i < width; ++i)
        for (int64_t c = 0; c < cg; ++c) dx[(pixel + i) * g.channels + group * cg + c] = FromFloat<T>(dx_row[i * cg + c]);
    });
  }
}

template <typename T>
void Wgrad(const ConvGeometry& g, const T* x, const T* dy, T* dw) {
  const int64_t cg = g.GroupChannels(), kg = g.GroupFilters(), width = g.out[2], taps = g.Taps();
  TapRows a(width, taps, cg);
  std::vector<float> dy_row(width * kg), acc(taps * cg * kg);
  for (int64_t group = 0; group < g.groups; ++group) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    ForEachRow(g.batch, g.out, [&](int64_t n, const int64_t* row, int64_t pixel) {
      GatherInputRow(g, x, n, row, group, &a);
      for (int64_t r = 0; r < width; ++r)
        for (int64_t k = 0; k < kg; ++k) dy_row[r * kg + k] = ToFloat(dy[(pixel + r) * g.filters + group * kg + k]);
      MatMulTransposedAccumulate(a, dy_row.data(), acc.data(), kg);
    });
    for (int64_t j = 0; j < taps * cg; ++j)
      for (int64_t k = 0; k < kg; ++k) dw[j * g.filters + group * kg + k] = FromFloat<T>(acc[j * kg + k]);
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
