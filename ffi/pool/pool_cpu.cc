// CPU pooling on rows of pixels spread over XLA's intra-op threads, each chunk compiled for the CPU's
// vector instructions: the forwards a pixel's window at a time over all its channels, the backwards
// through the per-pixel functions of pool_window.h (the CUDA kernels' own, with the same window
// policies) in groups of channels. Both walk the windows and order the sums as the CUDA kernels do.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/cpu_isa.h"
#include "common/half_cpu.h"
#include "common/parallel_cpu.h"
#include "pool/pool.h"
#include "pool/pool_common.h"
#include "pool/pool_window.h"

namespace jaxdnn {
namespace {

// The backward's channels per call of a per-pixel function: kWide while they reach it, so that a
// window's offsets are worked out once for many channels, then groups of kLanes, then one at a time.
constexpr int kWide = 64, kLanes = 8;
// The values (pixels x channels) a thread's chunk of rows holds at least.
constexpr int64_t kGrainValues = int64_t{1} << 15;

// Calls fn(n, pixel coordinates) for every pixel of [N, s0, s1, s2], the rows (n, s0, s1) in chunks
// over the pool's threads, each chunk compiled for the CPU's vectors (fn is a lambda declared
// JAXDNN_ALWAYS_INLINE, as CallVectorized asks).
template <typename Fn>
void ForEachPixel(ffi::ThreadPool& pool, int64_t batch, const int sizes[3], int64_t channels, const Fn& fn) {
  const int64_t rows = batch * sizes[0] * sizes[1];
  const int64_t row_values = std::max<int64_t>(1, sizes[2] * channels);
  ParallelChunks(pool, rows, std::max<int64_t>(1, kGrainValues / row_values), [&](int64_t begin, int64_t end) {
    CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
      for (int64_t row = begin; row < end; ++row) {
        const int64_t n = row / (int64_t(sizes[0]) * sizes[1]);
        int at[3] = {int(row / sizes[1] % sizes[0]), int(row % sizes[1]), 0};
        for (; at[2] < sizes[2]; ++at[2]) fn(n, at);
      }
    });
  });
}

// ForEachPixel with fn(n, pixel, channel offset, lanes tag) for every channel group of a pixel
// (kWide, then kLanes, then the last C % kLanes one at a time): the per-pixel functions' lanes.
template <typename Fn>
void ForEachPixelLanes(ffi::ThreadPool& pool, int64_t batch, const int sizes[3], int64_t channels, const Fn& fn) {
  ForEachPixel(pool, batch, sizes, channels, [&](int64_t n, const int* at) JAXDNN_ALWAYS_INLINE {
    int64_t c = 0;
    for (; c + kWide <= channels; c += kWide) fn(n, at, c, std::integral_constant<int, kWide>{});
    for (; c + kLanes <= channels; c += kLanes) fn(n, at, c, std::integral_constant<int, kLanes>{});
    for (; c < channels; ++c) fn(n, at, c, std::integral_constant<int, 1>{});
  });
}

// The forwards on the CPU: a pixel's window one element at a time, each over all channels, loops
// that vectorize over running values in scratch (the per-pixel functions' fixed lanes, on the
// CPU, kept them in memory behind masked stores, which are slow on AMD's cores: the 3x3/2 max
// pool ran at 3 cycles a value). The window's walk is theirs (ForEachWindowElement), and so are the
// rules and the order of the sums (MaxPoolPixelFloat, AvgPoolPixel): the same bits.

// Max pool of output pixel (n, o): y and, unless `argmax` is null, the chosen offset in the window.
// best, arg and nan: C floats of scratch each (arg the offsets, nan 1 where a NaN was seen).
template <typename W, typename T, typename Idx>
JAXDNN_ALWAYS_INLINE inline void MaxPoolPixelChannels(const PoolGeometry& g, const T* x, T* y, Idx* argmax, int64_t n,
                                                      const int o[3], float* best, float* arg, float* nan) {
  const int64_t channels = g.channels;
  for (int64_t c = 0; c < channels; ++c) {
    best[c] = -INFINITY;
    arg[c] = 0.f;
    nan[c] = 0.f;
  }
  ForEachWindowElement<W>(g, n, o, 0, [&](int k, bool inside, int64_t at) JAXDNN_ALWAYS_INLINE {
    // Every value loaded, then every one stored: written as `best[c] = take ? v : best[c]`, GCC made
    // the stores conditional (masked) again.
    const auto visit = [&](int64_t c, float v) JAXDNN_ALWAYS_INLINE {
      const float was_best = best[c], was_arg = arg[c], was_nan = nan[c];
      const bool take = !(was_best >= v);  // padding enters as -inf
      const float now_nan = v != v ? 1.f : was_nan, now_best = take ? v : was_best;
      const float now_arg = take ? float(k) : was_arg;
      best[c] = now_best;
      arg[c] = now_arg;
      nan[c] = now_nan;
    };
    if (inside) {
      for (int64_t c = 0; c < channels; ++c) visit(c, ToFloat(x[at + c]));
    } else {
      for (int64_t c = 0; c < channels; ++c) visit(c, -INFINITY);
    }
  });
  const int64_t offset = g.OutOffset(n, o[0], o[1], o[2]);
  for (int64_t c = 0; c < channels; ++c) y[offset + c] = FromFloat<T>(nan[c] != 0.f ? NAN : best[c]);
  if (argmax != nullptr) {
    for (int64_t c = 0; c < channels; ++c) argmax[offset + c] = Idx(arg[c]);
  }
}

// Average pool of output pixel (n, o); sum: C floats of scratch.
template <typename W, typename T>
JAXDNN_ALWAYS_INLINE inline void AvgPoolPixelChannels(const PoolGeometry& g, const T* x, T* y, bool count_include_pad,
                                                      int64_t n, const int o[3], float* sum) {
  const int64_t channels = g.channels;
  for (int64_t c = 0; c < channels; ++c) sum[c] = 0.f;
  ForEachWindowElement<W>(g, n, o, 0, [&](int, bool inside, int64_t at) JAXDNN_ALWAYS_INLINE {
    if (!inside) return;  // padding adds nothing
    for (int64_t c = 0; c < channels; ++c) sum[c] += ToFloat(x[at + c]);
  });
  const float divisor = float(g.Divisor(o, count_include_pad));  // 0 only for all-padding windows: NaN, as flax
  const int64_t offset = g.OutOffset(n, o[0], o[1], o[2]);
  for (int64_t c = 0; c < channels; ++c) y[offset + c] = FromFloat<T>(sum[c] / divisor);
}

// Calls fn(Idx{}) with the argmax buffer's index type (the handler checked it).
template <typename Fn>
ffi::Error DispatchArgmax(ffi::DataType dtype, Fn&& fn) {
  return dtype == ffi::DataType::U8 ? fn(uint8_t{}) : fn(int32_t{});
}

// A backward as the CUDA kernels run it: blocks of input pixels for a SquareWindow (PoolBwdBlock,
// max when `argmax` is non-null), else per_pixel(n, pixel, channel offset, lanes tag) per pixel.
template <typename T, typename Idx, typename Fn>
void PoolBackward(ffi::ThreadPool& pool, const PoolGeometry& g, const T* dy, const Idx* argmax, T* dx,
                  bool count_include_pad, Fn&& per_pixel) {
  DispatchWindow(g, [&](auto window) {
    using W = decltype(window);
    if constexpr (W::kSize > 0) {
      const BlockGrid b = MakeBlockGrid<W>(g);
      ForEachPixelLanes(pool, g.batch, b.sizes, g.channels, [&](int64_t n, const int* at, int64_t c, auto lanes)
                                                              JAXDNN_ALWAYS_INLINE {
        const int m[2] = {b.first[0] + at[1], b.first[1] + at[2]};
        PoolBwdBlock<decltype(lanes)::value, W>(g, dy, argmax, dx, count_include_pad, n, at[0], m, c);
      });
    } else {
      ForEachPixelLanes(pool, g.batch, g.in, g.channels, per_pixel);
    }
  });
}

template <typename T, typename Idx>
void MaxPoolForward(ffi::ThreadPool& pool, const PoolGeometry& g, const T* x, T* y, Idx* argmax) {
  DispatchWindow(g, [&](auto window) {
    ForEachPixel(pool, g.batch, g.out, g.channels, [&](int64_t n, const int* o) JAXDNN_ALWAYS_INLINE {
      const auto [best, arg, nan] = ScratchBuffers({g.channels, g.channels, g.channels});
      MaxPoolPixelChannels<decltype(window)>(g, x, y, argmax, n, o, best, arg, nan);
    });
  });
}

ffi::Error MaxPoolInferImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, PoolAttrs attrs) {
  PoolGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakePoolGeometry(attrs, x.dimensions(), y->dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, *y));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    MaxPoolForward<T, uint8_t>(pool, g, static_cast<const T*>(x.untyped_data()), static_cast<T*>(y->untyped_data()),
                               nullptr);
    return ffi::Error::Success();
  });
}

ffi::Error MaxPoolFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> argmax, PoolAttrs attrs) {
  PoolGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakePoolGeometry(attrs, x.dimensions(), y->dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, *y));
  JAXDNN_RETURN_IF_ERROR(CheckArgmax(*argmax, y->dimensions(), g));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    return DispatchArgmax(argmax->element_type(), [&](auto index_tag) {
      using Idx = decltype(index_tag);
      MaxPoolForward<T, Idx>(pool, g, static_cast<const T*>(x.untyped_data()), static_cast<T*>(y->untyped_data()),
                             static_cast<Idx*>(argmax->untyped_data()));
      return ffi::Error::Success();
    });
  });
}

ffi::Error MaxPoolBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer argmax,
                          ffi::Result<ffi::AnyBuffer> dx, PoolAttrs attrs) {
  PoolGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakePoolGeometry(attrs, dx->dimensions(), dy.dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(dy, *dx));
  JAXDNN_RETURN_IF_ERROR(CheckArgmax(argmax, dy.dimensions(), g));
  return DispatchFloat<float, Bf16, Half>(dy.element_type(), "dy", [&](auto type_tag) {
    using T = decltype(type_tag);
    return DispatchArgmax(argmax.element_type(), [&](auto index_tag) {
      using Idx = decltype(index_tag);
      const T* grad = static_cast<const T*>(dy.untyped_data());
      const Idx* chosen = static_cast<const Idx*>(argmax.untyped_data());
      T* out = static_cast<T*>(dx->untyped_data());
      PoolBackward(pool, g, grad, chosen, out, false, [&](int64_t n, const int* i, int64_t c, auto lanes)
                                                           JAXDNN_ALWAYS_INLINE {
        MaxPoolBwdPixel<decltype(lanes)::value>(g, grad, chosen, out, n, i, c);
      });
      return ffi::Error::Success();
    });
  });
}

ffi::Error AvgPoolFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, AvgPoolAttrs attrs) {
  PoolGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakePoolGeometry(attrs.pool, x.dimensions(), y->dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, *y));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    const T* in = static_cast<const T*>(x.untyped_data());
    T* out = static_cast<T*>(y->untyped_data());
    DispatchWindow(g, [&](auto window) {
      ForEachPixel(pool, g.batch, g.out, g.channels, [&](int64_t n, const int* o) JAXDNN_ALWAYS_INLINE {
        const auto [sum] = ScratchBuffers({g.channels});
        AvgPoolPixelChannels<decltype(window)>(g, in, out, attrs.count_include_pad, n, o, sum);
      });
    });
    return ffi::Error::Success();
  });
}

ffi::Error AvgPoolBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx, AvgPoolAttrs attrs) {
  PoolGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakePoolGeometry(attrs.pool, dx->dimensions(), dy.dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(dy, *dx));
  return DispatchFloat<float, Bf16, Half>(dy.element_type(), "dy", [&](auto type_tag) {
    using T = decltype(type_tag);
    const T* grad = static_cast<const T*>(dy.untyped_data());
    T* out = static_cast<T*>(dx->untyped_data());
    PoolBackward(pool, g, grad, static_cast<const uint8_t*>(nullptr), out, attrs.count_include_pad,
                 [&](int64_t n, const int* i, int64_t c, auto lanes) JAXDNN_ALWAYS_INLINE {
                   AvgPoolBwdPixel<decltype(lanes)::value>(g, grad, out, attrs.count_include_pad, n, i, c);
                 });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxPoolInferCpu, jaxdnn::MaxPoolInferImpl,
                              jaxdnn::BindMaxPoolInfer(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxPoolFwdCpu, jaxdnn::MaxPoolFwdImpl,
                              jaxdnn::BindMaxPoolFwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxPoolBwdCpu, jaxdnn::MaxPoolBwdImpl,
                              jaxdnn::BindMaxPoolBwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AvgPoolFwdCpu, jaxdnn::AvgPoolFwdImpl,
                              jaxdnn::BindAvgPoolFwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AvgPoolBwdCpu, jaxdnn::AvgPoolBwdImpl,
                              jaxdnn::BindAvgPoolBwd(jaxdnn::BindWithThreadPool()));
