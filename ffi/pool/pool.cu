// CUDA pooling: one thread per (pixel, group of V channels), grid-stride, running the per-pixel
// functions of pool_window.h (shared with the CPU kernels). The vector path has its own kernels for
// the common square windows (DispatchWindow): unrolled forward windows, and a backward thread per
// block of input pixels (PoolBwdBlock).
//
// Channels are contiguous, so a group is one 16-byte access (V = 8 for 16-bit types, 4 for float32)
// when C is a multiple of V and the buffers are aligned; otherwise V = 1. Consecutive threads take
// consecutive groups of one pixel, then the next pixel along W: a warp's accesses to one window row
// are contiguous, and the rows and columns that neighbouring windows share are served by L1/L2, so
// x is read from DRAM about once.
//
// Traffic (the ResNet stem, bf16 [128, 112, 112, 64], 3x3 stride 2 SAME -> [128, 56, 56, 64]):
// inference forward reads x and writes y (257 MB); the training forward also writes the uint8
// argmax (+26 MB); the backward reads dy and argmax and writes dx (282 MB). Recomputing the argmax
// in the backward instead would read x (206 MB) in place of argmax (26 MB).
#include <algorithm>
#include <cstdint>

#include "common/cuda_common.cuh"
#include "pool/pool.h"
#include "pool/pool_common.h"
#include "pool/pool_window.h"

namespace jaxdnn {
namespace {

constexpr int kBlock = 256;
constexpr int64_t kMaxBlocks = 1 << 20;  // beyond, the grid strides

int Blocks(int64_t threads) {
  return int(std::min(kMaxBlocks, std::max<int64_t>(1, (threads + kBlock - 1) / kBlock)));
}

// a / b for a, b >= 0, with a 32-bit division when both fit (64-bit division is a long routine).
__device__ __forceinline__ int64_t Quotient(int64_t a, int64_t b) {
  return ((a | b) >> 32) == 0 ? int64_t(uint32_t(a) / uint32_t(b)) : a / b;
}

// Splits a thread's work item into (n, pixel coordinates at[3], channel group) of an
// [N, sizes[0], sizes[1], sizes[2]] grid of pixels, each of `groups` channel groups; returns n.
__device__ __forceinline__ int64_t SplitItem(int64_t item, int64_t groups, const int sizes[3], int at[3],
                                             int64_t* group) {
  int64_t rest = Quotient(item, groups);
  *group = item - rest * groups;
#pragma unroll
  for (int a = 2; a >= 0; --a) {
    const int64_t next = Quotient(rest, sizes[a]);
    at[a] = int(rest - next * sizes[a]);
    rest = next;
  }
  return rest;
}

// Calls fn(n, pixel coordinates, first channel) for every (pixel, channel group of V) work item of an
// [N, sizes[0], sizes[1], sizes[2]] grid of pixels, grid-stride.
template <int V, typename Fn>
__device__ __forceinline__ void ForEachItem(int64_t pixels, const int sizes[3], int64_t channels, Fn&& fn) {
  const int64_t groups = channels / V;
  const int64_t items = pixels * groups;
  for (int64_t item = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; item < items;
       item += int64_t(gridDim.x) * blockDim.x) {
    int at[3];
    int64_t group;
    const int64_t n = SplitItem(item, groups, sizes, at, &group);
    fn(n, at, group * V);
  }
}

template <typename T, typename Idx, int V, typename W>
__global__ void __launch_bounds__(kBlock)
    MaxPoolFwdKernel(const PoolGeometry g, const T* __restrict__ x, T* __restrict__ y, Idx* __restrict__ argmax) {
  ForEachItem<V>(g.OutPixels(), g.out, g.channels, [&](int64_t n, const int* o, int64_t c) {
    MaxPoolPixel<V, W>(g, x, y, argmax, n, o, c);
  });
}

template <typename T, typename Idx, int V>
__global__ void __launch_bounds__(kBlock) MaxPoolBwdKernel(const PoolGeometry g, const T* __restrict__ dy,
                                                           const Idx* __restrict__ argmax, T* __restrict__ dx) {
  ForEachItem<V>(g.InPixels(), g.in, g.channels, [&](int64_t n, const int* i, int64_t c) {
    MaxPoolBwdPixel<V>(g, dy, argmax, dx, n, i, c);
  });
}

template <typename T, int V, typename W>
__global__ void __launch_bounds__(kBlock)
    AvgPoolFwdKernel(const PoolGeometry g, const T* __restrict__ x, T* __restrict__ y, bool count_include_pad) {
  ForEachItem<V>(g.OutPixels(), g.out, g.channels, [&](int64_t n, const int* o, int64_t c) {
    AvgPoolPixel<V, W>(g, x, y, count_include_pad, n, o, c);
  });
}

template <typename T, int V>
__global__ void __launch_bounds__(kBlock)
    AvgPoolBwdKernel(const PoolGeometry g, const T* __restrict__ dy, T* __restrict__ dx, bool count_include_pad) {
  ForEachItem<V>(g.InPixels(), g.in, g.channels, [&](int64_t n, const int* i, int64_t c) {
    AvgPoolBwdPixel<V>(g, dy, dx, count_include_pad, n, i, c);
  });
}

// The backward of a SquareWindow pooling (max with argmax, average without): a thread per block of
// S x S input pixels and group of V channels (PoolBwdBlock).
template <typename T, typename Idx, int V, typename W>
__global__ void __launch_bounds__(kBlock)
    PoolBwdBlockKernel(const PoolGeometry g, const BlockGrid b, const T* __restrict__ dy, const Idx* __restrict__ argmax,
                       T* __restrict__ dx, bool count_include_pad) {
  const int64_t blocks = g.batch * b.sizes[0] * b.sizes[1] * int64_t(b.sizes[2]);
  ForEachItem<V>(blocks, b.sizes, g.channels, [&](int64_t n, const int* at, int64_t c) {
    const int m[2] = {b.first[0] + at[1], b.first[1] + at[2]};
    PoolBwdBlock<V, W>(g, dy, argmax, dx, count_include_pad, n, at[0], m, c);
  });
}

// The vector path of a backward: the block kernel for a SquareWindow, else the per-pixel `kernel`.
template <typename T, typename Idx, typename Kernel, typename... Args>
void LaunchVectorBwd(cudaStream_t stream, const PoolGeometry& g, Kernel per_pixel, const T* dy, const Idx* argmax,
                     T* dx, bool count_include_pad, Args... args) {
  constexpr int kV = kVec16<T>;
  DispatchWindow(g, [&](auto window) {
    using W = decltype(window);
    if constexpr (W::kSize > 0) {
      const BlockGrid b = MakeBlockGrid<W>(g);
      const int64_t blocks = g.batch * b.sizes[0] * b.sizes[1] * int64_t(b.sizes[2]);
      PoolBwdBlockKernel<T, Idx, kV, W><<<Blocks(blocks * (g.channels / kV)), kBlock, 0, stream>>>(
          g, b, dy, argmax, dx, count_include_pad);
    } else {
      per_pixel<<<Blocks(g.InPixels() * (g.channels / kV)), kBlock, 0, stream>>>(g, args...);
    }
  });
}

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Whether V = kVec16<T> channel groups serve these buffers: C a multiple of V, every buffer aligned
// to its group's access (`index_bytes`: the argmax's element size, 0 when there is none).
template <typename T>
bool VectorGroups(int64_t channels, const void* a, const void* b, const void* argmax = nullptr,
                  size_t index_bytes = 0) {
  constexpr int kV = kVec16<T>;
  return channels % kV == 0 && Aligned(a, 16) && Aligned(b, 16) &&
         (argmax == nullptr || Aligned(argmax, kV * index_bytes));
}

// Calls fn(Idx{}) with the argmax buffer's index type (the handler checked it).
template <typename Fn>
ffi::Error DispatchArgmax(ffi::DataType dtype, Fn&& fn) {
  return dtype == ffi::DataType::U8 ? fn(uint8_t{}) : fn(int32_t{});
}

template <typename T, typename Idx>
ffi::Error LaunchMaxPoolFwd(cudaStream_t stream, const PoolGeometry& g, const T* x, T* y, Idx* argmax) {
  constexpr int kV = kVec16<T>;
  if (VectorGroups<T>(g.channels, x, y, argmax, sizeof(Idx))) {
    DispatchWindow(g, [&](auto window) {
      MaxPoolFwdKernel<T, Idx, kV, decltype(window)>
          <<<Blocks(g.OutPixels() * (g.channels / kV)), kBlock, 0, stream>>>(g, x, y, argmax);
    });
  } else {
    MaxPoolFwdKernel<T, Idx, 1, RuntimeWindow><<<Blocks(g.OutPixels() * g.channels), kBlock, 0, stream>>>(g, x, y, argmax);
  }
  return LaunchError("max pool forward");
}

ffi::Error MaxPoolInferImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                            PoolAttrs attrs) {
  PoolGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakePoolGeometry(attrs, x.dimensions(), y->dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, *y));
  if (g.OutPixels() * g.channels == 0) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    return LaunchMaxPoolFwd<T, uint8_t>(stream, g, static_cast<const T*>(x.untyped_data()),
                                        static_cast<T*>(y->untyped_data()), nullptr);
  });
}

ffi::Error MaxPoolFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> argmax, PoolAttrs attrs) {
  PoolGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakePoolGeometry(attrs, x.dimensions(), y->dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, *y));
  JAXDNN_RETURN_IF_ERROR(CheckArgmax(*argmax, y->dimensions(), g));
  if (g.OutPixels() * g.channels == 0) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    return DispatchArgmax(argmax->element_type(), [&](auto index_tag) {
      using Idx = decltype(index_tag);
      return LaunchMaxPoolFwd<T, Idx>(stream, g, static_cast<const T*>(x.untyped_data()),
                                      static_cast<T*>(y->untyped_data()), static_cast<Idx*>(argmax->untyped_data()));
    });
  });
}

ffi::Error MaxPoolBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer argmax,
                          ffi::Result<ffi::AnyBuffer> dx, PoolAttrs attrs) {
  PoolGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakePoolGeometry(attrs, dx->dimensions(), dy.dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(dy, *dx));
  JAXDNN_RETURN_IF_ERROR(CheckArgmax(argmax, dy.dimensions(), g));
  if (g.InPixels() * g.channels == 0) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(dy.element_type(), "dy", [&](auto type_tag) {
    using T = decltype(type_tag);
    return DispatchArgmax(argmax.element_type(), [&](auto index_tag) {
      using Idx = decltype(index_tag);
      constexpr int kV = kVec16<T>;
      const T* grad = static_cast<const T*>(dy.untyped_data());
      const Idx* chosen = static_cast<const Idx*>(argmax.untyped_data());
      T* out = static_cast<T*>(dx->untyped_data());
      if (VectorGroups<T>(g.channels, grad, out, chosen, sizeof(Idx))) {
        LaunchVectorBwd(stream, g, MaxPoolBwdKernel<T, Idx, kV>, grad, chosen, out, false, grad, chosen, out);
      } else {
        MaxPoolBwdKernel<T, Idx, 1><<<Blocks(g.InPixels() * g.channels), kBlock, 0, stream>>>(g, grad, chosen, out);
      }
      return LaunchError("max pool backward");
    });
  });
}

ffi::Error AvgPoolFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          AvgPoolAttrs attrs) {
  PoolGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakePoolGeometry(attrs.pool, x.dimensions(), y->dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(x, *y));
  if (g.OutPixels() * g.channels == 0) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(x.element_type(), "x", [&](auto type_tag) {
    using T = decltype(type_tag);
    constexpr int kV = kVec16<T>;
    const T* in = static_cast<const T*>(x.untyped_data());
    T* out = static_cast<T*>(y->untyped_data());
    if (VectorGroups<T>(g.channels, in, out)) {
      DispatchWindow(g, [&](auto window) {
        AvgPoolFwdKernel<T, kV, decltype(window)><<<Blocks(g.OutPixels() * (g.channels / kV)), kBlock, 0, stream>>>(
            g, in, out, attrs.count_include_pad);
      });
    } else {
      AvgPoolFwdKernel<T, 1, RuntimeWindow><<<Blocks(g.OutPixels() * g.channels), kBlock, 0, stream>>>(g, in, out,
                                                                                      attrs.count_include_pad);
    }
    return LaunchError("avg pool forward");
  });
}

ffi::Error AvgPoolBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                          AvgPoolAttrs attrs) {
  PoolGeometry g;
  JAXDNN_RETURN_IF_ERROR(MakePoolGeometry(attrs.pool, dx->dimensions(), dy.dimensions(), &g));
  JAXDNN_RETURN_IF_ERROR(CheckSameDtype(dy, *dx));
  if (g.InPixels() * g.channels == 0) return ffi::Error::Success();
  return DispatchFloat<float, __nv_bfloat16, __half>(dy.element_type(), "dy", [&](auto type_tag) {
    using T = decltype(type_tag);
    constexpr int kV = kVec16<T>;
    const T* grad = static_cast<const T*>(dy.untyped_data());
    T* out = static_cast<T*>(dx->untyped_data());
    if (VectorGroups<T>(g.channels, grad, out)) {
      LaunchVectorBwd(stream, g, AvgPoolBwdKernel<T, kV>, grad, static_cast<const uint8_t*>(nullptr), out,
                      attrs.count_include_pad, grad, out, attrs.count_include_pad);
    } else {
      AvgPoolBwdKernel<T, 1><<<Blocks(g.InPixels() * g.channels), kBlock, 0, stream>>>(g, grad, out,
                                                                                     attrs.count_include_pad);
    }
    return LaunchError("avg pool backward");
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxPoolInferCuda, jaxdnn::MaxPoolInferImpl, jaxdnn::BindMaxPoolInfer(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxPoolFwdCuda, jaxdnn::MaxPoolFwdImpl, jaxdnn::BindMaxPoolFwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxPoolBwdCuda, jaxdnn::MaxPoolBwdImpl, jaxdnn::BindMaxPoolBwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(AvgPoolFwdCuda, jaxdnn::AvgPoolFwdImpl, jaxdnn::BindAvgPoolFwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(AvgPoolBwdCuda, jaxdnn::AvgPoolBwdImpl, jaxdnn::BindAvgPoolBwd(jaxdnn::BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});
