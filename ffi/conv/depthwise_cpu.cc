// The CPU's depthwise convolution (depthwise_cpu.h). Each stage walks rows of pixels (an output
// row for fprop and wgrad, an input row for dgrad): for each window row (t0, t1) that reads data,
// the row of the other operand it meets is converted once to float (channels padded to a multiple
// of 16, zeros for padding), and each window column t2 is then one pass along the row, 16 channels
// at a time, in vectors of the GCC/Clang extension (built for AVX-512 and AVX2 too, chosen at run
// time as conv_cpu.cc's matmuls are: cpu_isa.h):
//   fprop: acc[q] += x_row[q * s + t2 * d] * w[t]           (then the epilogue, y's dtype)
//   dgrad: acc[i] += dy_row[o] * w[t] where o * s + t2 * d - pad = i
//   wgrad: dw[t] += sum over q of x_row[q * s + t2 * d] * dy_row[q]
// The rows are shared out over XLA's intra-op threads; wgrad's in a fixed number of slices summed in
// order, so that the result does not depend on the threads.
#include "conv/depthwise_cpu.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/cpu_isa.h"
#include "common/parallel_cpu.h"
#include "common/vector_cpu.h"

namespace jaxdnn {
namespace {

constexpr int64_t kLanes = kVectorFloats;  // channels a vector

// dst[j * dst_step + c] += src[j * src_step + c] * w[c] for j < count, c < strips * kLanes.
inline __attribute__((always_inline)) void AxpyPixels(float* dst, int64_t dst_step, const float* src,
                                                      int64_t src_step, const float* w, int64_t count,
                                                      int64_t strips) {
  for (int64_t s = 0; s < strips; ++s) {
    const FloatVector weight = LoadVector(w + s * kLanes);
    for (int64_t j = 0; j < count; ++j) {
      float* d = dst + j * dst_step + s * kLanes;
      StoreVector(LoadVector(d) + LoadVector(src + j * src_step + s * kLanes) * weight, d);
    }
  }
}

// out[c] += the sum over j < count (in order) of x[j * x_step + c] * dy[j * dy_step + c], for
// c < strips * kLanes.
inline __attribute__((always_inline)) void DotPixels(const float* x, int64_t x_step, const float* dy, int64_t dy_step,
                                                     int64_t count, int64_t strips, float* out) {
  for (int64_t s = 0; s < strips; ++s) {
    FloatVector sum = {};
    for (int64_t j = 0; j < count; ++j) {
      sum += LoadVector(x + j * x_step + s * kLanes) * LoadVector(dy + j * dy_step + s * kLanes);
    }
    StoreVector(LoadVector(out + s * kLanes) + sum, out + s * kLanes);
  }
}

using AxpyFn = void (*)(float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t);
using DotFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*);

void AxpyBaseline(float* dst, int64_t dst_step, const float* src, int64_t src_step, const float* w, int64_t count,
                  int64_t strips) {
  AxpyPixels(dst, dst_step, src, src_step, w, count, strips);
}
void DotBaseline(const float* x, int64_t x_step, const float* dy, int64_t dy_step, int64_t count, int64_t strips,
                 float* out) {
  DotPixels(x, x_step, dy, dy_step, count, strips, out);
}
#ifdef JAXDNN_CPU_ISA_VARIANTS
__attribute__((target("avx512f"))) void AxpyAvx512(float* dst, int64_t dst_step, const float* src, int64_t src_step,
                                                   const float* w, int64_t count, int64_t strips) {
  AxpyPixels(dst, dst_step, src, src_step, w, count, strips);
}
__attribute__((target("avx512f"))) void DotAvx512(const float* x, int64_t x_step, const float* dy, int64_t dy_step,
                                                  int64_t count, int64_t strips, float* out) {
  DotPixels(x, x_step, dy, dy_step, count, strips, out);
}
__attribute__((target("avx2,fma"))) void AxpyAvx2(float* dst, int64_t dst_step, const float* src, int64_t src_step,
                                                  const float* w, int64_t count, int64_t strips) {
  AxpyPixels(dst, dst_step, src, src_step, w, count, strips);
}
__attribute__((target("avx2,fma"))) void DotAvx2(const float* x, int64_t x_step, const float* dy, int64_t dy_step,
                                                 int64_t count, int64_t strips, float* out) {
  DotPixels(x, x_step, dy, dy_step, count, strips, out);
}
#endif

// The row passes for the CPU at hand.
struct RowOps {
  AxpyFn axpy = AxpyBaseline;
  DotFn dot = DotBaseline;
};

RowOps ActiveRowOps() {
#ifdef JAXDNN_CPU_ISA_VARIANTS
  if (ActiveCpuIsa() == CpuIsa::kAvx512) return {AxpyAvx512, DotAvx512};
  if (ActiveCpuIsa() == CpuIsa::kAvx2) return {AxpyAvx2, DotAvx2};
#endif
  return {};
}

// C, padded to whole vectors of kLanes.
struct Channels {
  int64_t count, padded, strips;
  explicit Channels(int64_t count)
      : count(count), padded((count + kLanes - 1) / kLanes * kLanes), strips(padded / kLanes) {}
};

// The filter w [taps, C] as float [taps, padded C].
template <typename T>
std::vector<float> FilterTaps(const ConvGeometry& g, const Channels& ch, const T* w) {
  std::vector<float> taps(g.Taps() * ch.padded, 0.0f);
  for (int64_t t = 0; t < g.Taps(); ++t)
    for (int64_t c = 0; c < ch.count; ++c) taps[t * ch.padded + c] = ToFloat(w[t * ch.count + c]);
  return taps;
}

// dst[j] for j < extent (`padded` floats each) = pixel j - pad of src, a row of `width` pixels of
// `channels` values, as floats; zeros outside the row and past the channels.
template <typename T>
void FillRow(const T* src, int64_t width, int64_t channels, int64_t pad, int64_t extent, int64_t padded, float* dst) {
  for (int64_t j = 0; j < extent; ++j) {
    float* d = dst + j * padded;
    const int64_t i = j - pad;
    if (i < 0 || i >= width) {
      std::fill_n(d, padded, 0.0f);
      continue;
    }
    for (int64_t c = 0; c < channels; ++c) d[c] = ToFloat(src[i * channels + c]);
    std::fill(d + channels, d + padded, 0.0f);
  }
}

// The first element of row (n, a, b) of an [N, A, B, width, C] array.
int64_t RowOffset(int64_t n, int64_t a, int64_t b, const int64_t sizes[3], int64_t channels) {
  return ((n * sizes[0] + a) * sizes[1] + b) * sizes[2] * channels;
}

// Runs fn(first, end) over [0, rows) in spans on XLA's intra-op threads (about four a thread, at most
// kSpanRows rows each: a span sets up its own row buffers).
constexpr int64_t kSpanRows = 64;

template <typename Fn>
void ForRowSpans(ffi::ThreadPool& pool, int64_t rows, const Fn& fn) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_span = std::clamp<int64_t>(rows / (4 * threads), 1, kSpanRows);
  const int64_t spans = (rows + per_span - 1) / per_span;
  ParallelFor(pool, spans, [&](int64_t span) { fn(span * per_span, std::min(rows, (span + 1) * per_span)); });
}

// The positions of an fprop/wgrad input row that an output row of `width` pixels reads through
// every window column: q * s + t2 * d for q < width, t2 < V.
int64_t InputExtent(const ConvGeometry& g, int64_t width) {
  return width == 0 ? 0 : (width - 1) * g.stride[2] + (g.window[2] - 1) * g.rhs_dilation[2] + 1;
}

// Calls fn(t, x_row) for each window row (t0, t1) through which output row (n, o0, o1) reads x,
// with x_row that x row filled by FillRow over InputExtent and t the row's first tap.
template <typename T, typename Fn>
void ForEachInputRow(const ConvGeometry& g, const Channels& ch, const T* x, int64_t n, int64_t o0, int64_t o1,
                     int64_t extent, float* x_row, const Fn& fn) {
  for (int64_t t0 = 0; t0 < g.window[0]; ++t0) {
    const int64_t i0 = g.InputAt(0, o0, t0);
    if (i0 < 0) continue;
    for (int64_t t1 = 0; t1 < g.window[1]; ++t1) {
      const int64_t i1 = g.InputAt(1, o1, t1);
      if (i1 < 0) continue;
      FillRow(x + RowOffset(n, i0, i1, g.in, ch.count), g.in[2], ch.count, g.pad[2], extent, ch.padded, x_row);
      fn((t0 * g.window[1] + t1) * g.window[2], x_row);
    }
  }
}

}  // namespace

bool TakesDepthwiseCpu(const ConvGeometry& g) {
  for (int a = 0; a < 3; ++a) {
    if (g.lhs_dilation[a] != 1) return false;
  }
  return g.channels >= 1 && g.groups == g.channels && g.filters == g.channels;
}

template <typename T>
void DepthwiseFpropCpu(ffi::ThreadPool& pool, const ConvGeometry& g, const T* x, const T* w,
                       const ConvEpilogue<T>& epilogue, T* y) {
  const Channels ch(g.channels);
  const std::vector<float> taps = FilterTaps(g, ch, w);
  const RowOps ops = ActiveRowOps();
  const int64_t width = g.out[2], extent = InputExtent(g, width);
  const int64_t step = g.stride[2] * ch.padded, tap_shift = g.rhs_dilation[2] * ch.padded;
  ForRowSpans(pool, g.batch * g.out[0] * g.out[1], [&](int64_t first, int64_t end) {
    std::vector<float> acc(width * ch.padded), x_row(extent * ch.padded);
    for (int64_t r = first; r < end; ++r) {
      const int64_t n = r / (g.out[0] * g.out[1]), o0 = r / g.out[1] % g.out[0], o1 = r % g.out[1];
      std::fill(acc.begin(), acc.end(), 0.0f);
      ForEachInputRow(g, ch, x, n, o0, o1, extent, x_row.data(), [&](int64_t tap, const float* row) {
        for (int64_t t2 = 0; t2 < g.window[2]; ++t2) {
          ops.axpy(acc.data(), ch.padded, row + t2 * tap_shift, step, taps.data() + (tap + t2) * ch.padded, width,
                   ch.strips);
        }
      });
      const int64_t base = RowOffset(n, o0, o1, g.out, ch.count);
      for (int64_t q = 0; q < width; ++q)
        for (int64_t c = 0; c < ch.count; ++c) {
          const int64_t index = base + q * ch.count + c;
          y[index] = FromFloat<T>(epilogue.Apply(acc[q * ch.padded + c], index, c));
        }
    }
  });
}

template <typename T>
void DepthwiseDgradCpu(ffi::ThreadPool& pool, const ConvGeometry& g, const T* dy, const T* w, T* dx) {
  const Channels ch(g.channels);
  const std::vector<float> taps = FilterTaps(g, ch, w);
  const RowOps ops = ActiveRowOps();
  const int64_t width = g.in[2], out_width = g.out[2], s = g.stride[2];
  ForRowSpans(pool, g.batch * g.in[0] * g.in[1], [&](int64_t first, int64_t end) {
    std::vector<float> acc(width * ch.padded), dy_row(out_width * ch.padded);
    for (int64_t r = first; r < end; ++r) {
      const int64_t n = r / (g.in[0] * g.in[1]), i0 = r / g.in[1] % g.in[0], i1 = r % g.in[1];
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t0 = 0; t0 < g.window[0]; ++t0) {
        const int64_t o0 = g.OutputAt(0, i0, t0);
        if (o0 < 0) continue;
        for (int64_t t1 = 0; t1 < g.window[1]; ++t1) {
          const int64_t o1 = g.OutputAt(1, i1, t1);
          if (o1 < 0) continue;
          FillRow(dy + RowOffset(n, o0, o1, g.out, ch.count), out_width, ch.count, 0, out_width, ch.padded,
                  dy_row.data());
          for (int64_t t2 = 0; t2 < g.window[2]; ++t2) {
            // Output pixel o reads input pixel i = o * s + shift through t2: the o in [0, out_width)
            // whose i lies in [0, width).
            const int64_t shift = t2 * g.rhs_dilation[2] - g.pad[2];
            const int64_t o_first = shift >= 0 ? 0 : (-shift + s - 1) / s;
            const int64_t o_end = width - 1 - shift < 0 ? 0 : std::min(out_width, (width - 1 - shift) / s + 1);
            if (o_end <= o_first) continue;
            const int64_t tap = (t0 * g.window[1] + t1) * g.window[2] + t2;
            ops.axpy(acc.data() + (o_first * s + shift) * ch.padded, s * ch.padded,
                     dy_row.data() + o_first * ch.padded, ch.padded, taps.data() + tap * ch.padded, o_end - o_first,
                     ch.strips);
          }
        }
      }
      const int64_t base = RowOffset(n, i0, i1, g.in, ch.count);
      for (int64_t i = 0; i < width; ++i)
        for (int64_t c = 0; c < ch.count; ++c) dx[base + i * ch.count + c] = FromFloat<T>(acc[i * ch.padded + c]);
    }
  });
}

// wgrad's slices: at most kMaxSlices, a function of the problem alone.
constexpr int64_t kMaxSlices = 16;

template <typename T, typename D>
void DepthwiseWgradCpu(ffi::ThreadPool& pool, const ConvGeometry& g, const T* x, const T* dy, D* dw) {
  const Channels ch(g.channels);
  const RowOps ops = ActiveRowOps();
  const int64_t width = g.out[2], extent = InputExtent(g, width), taps = g.Taps();
  const int64_t step = g.stride[2] * ch.padded, tap_shift = g.rhs_dilation[2] * ch.padded;
  const int64_t rows = g.batch * g.out[0] * g.out[1];
  const int64_t slices = std::max<int64_t>(1, std::min(kMaxSlices, rows));
  std::vector<float> partial(slices * taps * ch.padded, 0.0f);  // [slices, taps, padded C]
  ParallelFor(pool, slices, [&](int64_t slice) {
    std::vector<float> dy_row(width * ch.padded), x_row(extent * ch.padded);
    float* sums = partial.data() + slice * taps * ch.padded;
    for (int64_t r = rows * slice / slices; r < rows * (slice + 1) / slices; ++r) {
      const int64_t n = r / (g.out[0] * g.out[1]), o0 = r / g.out[1] % g.out[0], o1 = r % g.out[1];
      FillRow(dy + RowOffset(n, o0, o1, g.out, ch.count), width, ch.count, 0, width, ch.padded, dy_row.data());
      ForEachInputRow(g, ch, x, n, o0, o1, extent, x_row.data(), [&](int64_t tap, const float* row) {
        for (int64_t t2 = 0; t2 < g.window[2]; ++t2) {
          ops.dot(row + t2 * tap_shift, step, dy_row.data(), ch.padded, width, ch.strips,
                  sums + (tap + t2) * ch.padded);
        }
      });
    }
  });
  for (int64_t t = 0; t < taps; ++t)
    for (int64_t c = 0; c < ch.count; ++c) {
      float sum = 0.0f;
      for (int64_t slice = 0; slice < slices; ++slice) sum += partial[(slice * taps + t) * ch.padded + c];
      dw[t * ch.count + c] = FromFloat<D>(sum);
    }
}

#define JAXDNN_DEPTHWISE_CPU(T)                                                                                  \
  template void DepthwiseFpropCpu<T>(ffi::ThreadPool&, const ConvGeometry&, const T*, const T*,                  \
                                     const ConvEpilogue<T>&, T*);                                                \
  template void DepthwiseDgradCpu<T>(ffi::ThreadPool&, const ConvGeometry&, const T*, const T*, T*);            \
  template void DepthwiseWgradCpu<T, T>(ffi::ThreadPool&, const ConvGeometry&, const T*, const T*, T*);         \
  template void DepthwiseWgradCpu<T, float>(ffi::ThreadPool&, const ConvGeometry&, const T*, const T*, float*);
JAXDNN_DEPTHWISE_CPU(Bf16)
JAXDNN_DEPTHWISE_CPU(Half)
#undef JAXDNN_DEPTHWISE_CPU
template void DepthwiseFpropCpu<float>(ffi::ThreadPool&, const ConvGeometry&, const float*, const float*,
                                       const ConvEpilogue<float>&, float*);
template void DepthwiseDgradCpu<float>(ffi::ThreadPool&, const ConvGeometry&, const float*, const float*, float*);
template void DepthwiseWgradCpu<float, float>(ffi::ThreadPool&, const ConvGeometry&, const float*, const float*,
                                              float*);

}  // namespace jaxdnn
