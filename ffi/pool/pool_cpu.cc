// CPU pooling: the per-pixel functions of pool_window.h (the CUDA kernels' own, with the same window
// policies), looped over the pixels in order (N, spatial, channel groups of kLanes, then a scalar tail).
#include <cstdint>
#include <type_traits>

#include "common/half_cpu.h"
#include "pool/pool.h"
#include "pool/pool_common.h"
#include "pool/pool_window.h"

namespace jaxdnn {
namespace {

// Channels per call of a per-pixel function: a group the compiler keeps in vector registers.
constexpr int kLanes = 8;

// Calls fn(n, pixel coordinates, channel offset, lanes tag) for every pixel of [N, s0, s1, s2] and
// every channel group of kLanes (the last C % kLanes channels one at a time).
template <typename Fn>
void ForEachPixel(int64_t batch, const int sizes[3], int64_t channels, Fn&& fn) {
  int at[3];
  for (int64_t n = 0; n < batch; ++n) {
    for (at[0] = 0; at[0] < sizes[0]; ++at[0]) {
      for (at[1] = 0; at[1] < sizes[1]; ++at[1]) {
        for (at[2] = 0; at[2] < sizes[2]; ++at[2]) {
          int64_t c = 0;
          for (; c + kLanes <= channels; c += kLanes) fn(n, at, c, std::integral_constant<int, kLanes>{});
          for (; c < channels; ++c) fn(n, at, c, std::integral_constant<int, 1>{});
        }
      }
    }
  }
}

// Calls fn(Idx{}) with the argmax buffer's index type (the handler checked it).
template <typename Fn>
ffi::Error DispatchArgmax(ffi::DataType dtype, Fn&& fn) {
  return dtype == ffi::DataType::U8 ? fn(uint8_t{}) : fn(int32_t{});
}

// A backward as the CUDA kernels run it: blocks of input pixels for a SquareWindow (PoolBwdBlock,
// max when `argmax` is non-null), else per_pixel(n, pixel, channel offset, lanes tag) per pixel.
template <typename T, typename Idx, typename Fn>
void PoolBackward(const PoolGeometry& g, const T* dy, const Idx* argmax, T* dx, bool count_include_pad, Fn&& per_pixel) {
  DispatchWindow(g, [&](auto window) {
    using W = decltype(window);
    if constexpr (W::kSize > 0) {
      const BlockGrid b = MakeBlockGrid<W>(g);
      ForEachPixel(g.batch, b.sizes, g.channels, [&](int64_t n, const int* at, int64_t c, auto lanes) {
        const int m[2] = {b.first[0] + at[1], b.first[1] + at[2]};
        PoolBwdBlock<decltype(lanes)::value, W>(g, dy, argmax, dx, count_include_pad, n, at[0], m, c);
      });
    } else {
      ForEachPixel(g.batch, g.in, g.channels, per_pixel);
    }
  });
}

template <typename T, typename Idx>
void MaxPoolForward(const PoolGeometry& g, const T* x, T* y, Idx* argmax) {
  DispatchWindow(g, [&](auto window) {
    ForEachPixel(g.batch, g.out, g.channels, [&](int64_t n, const int* o, int64_t c, auto lanes) {
      MaxPoolPixel<decltype(lanes)::value, decltype(window)>(g, x, y, argmax, n, o, c);
    });
  });
}

ffi::Error MaxPoolInferImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, PoolAttrs attrs) {
  PoolGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakePoolGeometry(attrs, x.dimensions(), y->dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, *y));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    MaxPoolForward<T, uint8_t>(g, static_cast<const T*>(x.untyped_data()), static_cast<T*>(y->untyped_data()),
                               nullptr);
    return ffi::Error::Success();
  });
}

ffi::Error MaxPoolFwdImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> argmax,
                          PoolAttrs attrs) {
  PoolGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakePoolGeometry(attrs, x.dimensions(), y->dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, *y));
  JAXDNN_RETURN_IF_ERROR(CheckArgmax(*argmax, y->dimensions(), g));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    return DispatchArgmax(argmax->element_type(), [&](auto index_tag) {
      using Idx = decltype(index_tag);
      MaxPoolForward<T, Idx>(g, static_cast<const T*>(x.untyped_data()), static_cast<T*>(y->untyped_data()),
                             static_cast<Idx*>(argmax->untyped_data()));
      return ffi::Error::Success();
    });
  });
}

ffi::Error MaxPoolBwdImpl(ffi::AnyBuffer dy, ffi::AnyBuffer argmax, ffi::Result<ffi::AnyBuffer> dx,
                          PoolAttrs attrs) {
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
      PoolBackward(g, grad, chosen, out, false, [&](int64_t n, const int* i, int64_t c, auto lanes) {
        MaxPoolBwdPixel<decltype(lanes)::value>(g, grad, chosen, out, n, i, c);
      });
      return ffi::Error::Success();
    });
  });
}

ffi::Error AvgPoolFwdImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, AvgPoolAttrs attrs) {
  PoolGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakePoolGeometry(attrs.pool, x.dimensions(), y->dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, *y));
  return DispatchFloat<float, Bf16, Half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    const T* in = static_cast<const T*>(x.untyped_data());
    T* out = static_cast<T*>(y->untyped_data());
    DispatchWindow(g, [&](auto window) {
      ForEachPixel(g.batch, g.out, g.channels, [&](int64_t n, const int* o, int64_t c, auto lanes) {
        AvgPoolPixel<decltype(lanes)::value, decltype(window)>(g, in, out, attrs.count_include_pad, n, o, c);
      });
    });
    return ffi::Error::Success();
  });
}

ffi::Error AvgPoolBwdImpl(ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx, AvgPoolAttrs attrs) {
  PoolGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakePoolGeometry(attrs.pool, dx->dimensions(), dy.dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(dy, *dx));
  return DispatchFloat<float, Bf16, Half>(dy.element_type(), "dy", [&](auto type_tag) {
    using T = decltype(type_tag);
    const T* grad = static_cast<const T*>(dy.untyped_data());
    T* out = static_cast<T*>(dx->untyped_data());
    PoolBackward(g, grad, static_cast<const uint8_t*>(nullptr), out, attrs.count_include_pad,
                 [&](int64_t n, const int* i, int64_t c, auto lanes) {
                   AvgPoolBwdPixel<decltype(lanes)::value>(g, grad, out, attrs.count_include_pad, n, i, c);
                 });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxPoolInferCpu, jaxdnn::MaxPoolInferImpl, jaxdnn::BindMaxPoolInfer(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxPoolFwdCpu, jaxdnn::MaxPoolFwdImpl, jaxdnn::BindMaxPoolFwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxPoolBwdCpu, jaxdnn::MaxPoolBwdImpl, jaxdnn::BindMaxPoolBwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AvgPoolFwdCpu, jaxdnn::AvgPoolFwdImpl, jaxdnn::BindAvgPoolFwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AvgPoolBwdCpu, jaxdnn::AvgPoolBwdImpl, jaxdnn::BindAvgPoolBwd(ffi::Ffi::Bind()));
