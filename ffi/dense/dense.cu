// CUDA GEMM handler (jaxdnn_gemm_v3, see dense.h). bfloat16/float16 problems whose rows suit TMA, and
// float32 ones with the tf32 attribute, run on the Hopper tensor-core kernels (gemm_sm90.cuh; small
// float32 a^T . b products, weight gradients, on gemm_streamed_tf32.cu's mma.sync kernel); exact
// float32 and unaligned problems run on a tiled CUDA-core kernel here, with the same epilogue.
#include <climits>
#include <optional>
#include <utility>

#include "common/activation.h"
#include "common/cuda_common.cuh"
#include "dense/dense.h"
#include "dense/gemm_sm90.h"

namespace jaxdnn {
namespace {

// CUDA-core tiles: a block of 256 threads computes a 128 x 128 tile of c, each thread an 8 x 8 patch
// (rows 4 ty + i and 64 + 4 ty + i, columns 4 tx + j and 64 + 4 tx + j for i, j < 4, with ty, tx the
// thread's place in a 16 x 16 grid), so that it reads its operands from shared memory as float4s and
// makes 64 multiply-adds per 4 loads. The operands pass through shared memory kDepth values of K at a
// time, in two buffers: the next slice's global loads are in flight while this one is multiplied.
// (The first form, 64 x 64 tiles of 4 x 4 patches, ran a float32 4096^3 product at 9.9 TFLOP/s on an
// H200.)
constexpr int kTile = 128, kDepth = 8, kThreads = 256;
constexpr int kLoads = kTile * kDepth / kThreads;  // elements of each operand a thread loads a slice
constexpr int kRowStride = kTile + 4;  // keeps the slices' transposed stores free of bank conflicts

using Slice = float[kDepth][kRowStride];  // [k][m] of op_a, [k][n] of op_b

// A thread's part of one operand's slices. op_a [M, K] is stored [M, K] or (trans_a) [K, M]; op_b
// [K, N] is stored [N, K] (trans_b) or [K, N]: either way an operand is `outer` (M or N) rows by K,
// stored K-contiguous or outer-contiguous. Element e = threadIdx.x + kThreads * r (r < kLoads) of a
// slice runs along the stored contiguous axis, so that a warp's loads are coalesced; it sits at
// ptr + r * r_stride, at K index k0 + k_first + r * k_per_r, and bit r of `inside` says whether its
// outer index is inside the matrix. The per-element offsets are worked out once, not every slice.
template <typename T>
struct SliceWalk {
  const T* ptr;
  int64_t r_stride, slice_stride;
  int k_first, k_per_r, o_first, o_per_r;  // the element's place in the slice: [k][o]
  unsigned inside = 0;

  __device__ SliceWalk(const T* x, int64_t outer, int64_t K, int64_t o0, bool k_contiguous) {
    const int t = threadIdx.x;
    if (k_contiguous) {  // e -> (o = e / kDepth, k = e % kDepth)
      k_first = t % kDepth, k_per_r = 0, o_first = t / kDepth, o_per_r = kThreads / kDepth;
      ptr = x + (o0 + o_first) * K + k_first, r_stride = o_per_r * K, slice_stride = kDepth;
    } else {  // e -> (k = e / kTile, o = e % kTile)
      k_first = t / kTile, k_per_r = kThreads / kTile, o_first = t % kTile, o_per_r = 0;
      ptr = x + k_first * outer + o0 + o_first, r_stride = k_per_r * outer, slice_stride = kDepth * outer;
    }
#pragma unroll
    for (int r = 0; r < kLoads; ++r) inside |= unsigned(o0 + o_first + r * o_per_r < outer) << r;
  }

  // The thread's elements of the slice at k0 (zero outside the matrix), then on to the next slice.
  __device__ __forceinline__ void Load(int64_t k0, int64_t K, float (&v)[kLoads]) {
#pragma unroll
    for (int r = 0; r < kLoads; ++r) {
      v[r] = (inside >> r & 1u) && k0 + k_first + r * k_per_r < K ? ToFloat(ptr[r * r_stride]) : 0.f;
    }
    ptr += slice_stride;
  }

  __device__ __forceinline__ void Store(const float (&v)[kLoads], Slice& tile) const {
#pragma unroll
    for (int r = 0; r < kLoads; ++r) tile[k_first + r * k_per_r][o_first + r * o_per_r] = v[r];
  }
};

// v[0, 4) = row[at, at + 4) and v[4, 8) = row[at + 64, at + 68).
__device__ __forceinline__ void LoadPatch(const float* row, int at, float (&v)[8]) {
  const float4 lo = *reinterpret_cast<const float4*>(row + at);
  const float4 hi = *reinterpret_cast<const float4*>(row + at + kTile / 2);
  v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) GemmTiled(GemmProblem p) {
  __shared__ __align__(16) Slice tile_a[2], tile_b[2];
  const int64_t l = blockIdx.z;
  T* c = static_cast<T*>(p.c) + l * p.m * p.n;
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const int64_t m0 = int64_t(blockIdx.y) * kTile, n0 = int64_t(blockIdx.x) * kTile;
  SliceWalk<T> walk_a(static_cast<const T*>(p.a) + l * p.m * p.k, p.m, p.k, m0, !p.trans_a);
  SliceWalk<T> walk_b(static_cast<const T*>(p.b) + l * p.k * p.n, p.n, p.k, n0, p.trans_b);
  float acc[8][8] = {};
  float ra[kLoads], rb[kLoads];
  walk_a.Load(0, p.k, ra);
  walk_b.Load(0, p.k, rb);
  walk_a.Store(ra, tile_a[0]);
  walk_b.Store(rb, tile_b[0]);
  __syncthreads();
  const int64_t slices = (p.k + kDepth - 1) / kDepth;
  for (int64_t s = 0; s < slices; ++s) {
    const int cur = int(s & 1);
    if (s + 1 < slices) {
      walk_a.Load((s + 1) * kDepth, p.k, ra);
      walk_b.Load((s + 1) * kDepth, p.k, rb);
    }
#pragma unroll
    for (int kk = 0; kk < kDepth; ++kk) {
      float av[8], bv[8];
      LoadPatch(tile_a[cur][kk], 4 * ty, av);
      LoadPatch(tile_b[cur][kk], 4 * tx, bv);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
    }
    // The other buffer was last read in the previous slice, before the barrier that ended it.
    if (s + 1 < slices) {
      walk_a.Store(ra, tile_a[cur ^ 1]);
      walk_b.Store(rb, tile_b[cur ^ 1]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t row = m0 + 4 * ty + i % 4 + (i / 4) * (kTile / 2);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t col = n0 + 4 * tx + j % 4 + (j / 4) * (kTile / 2);
      if (row < p.m && col < p.n) {
        const float pre = acc[i][j] + (p.bias != nullptr ? p.bias[col] : 0.f);
        c[row * p.n + col] = FromFloat<T>(ActivateKind(p.activation, pre, p.activation_param));
      }
    }
  }
}

ffi::Error GemmTiledCuda(const GemmProblem& p, ffi::DataType dtype, cudaStream_t stream) {
  const dim3 grid((p.n + kTile - 1) / kTile, (p.m + kTile - 1) / kTile, p.batch);
  if (grid.y > 65535 || grid.z > 65535) {
    return InvalidArgument("gemm: M / 128 and the batch size must be at most 65535 on the CUDA-core path");
  }
  return DispatchFloat<float, __nv_bfloat16, __half>(dtype, "a", [&](auto tag) {
    GemmTiled<decltype(tag)><<<grid, kThreads, 0, stream>>>(p);
    return LaunchError("gemm (CUDA cores)");
  });
}

ffi::Error GemmImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::F32> bias,
                    ffi::Result<ffi::AnyBuffer> c, GemmAttrs attrs) {
  GemmShape shape;
  JAXDNN_RETURN_IF_ERROR(CheckGemm(a, b, bias, *c, attrs, &shape));
  if (shape.batch == 0 || shape.m == 0 || shape.n == 0) return ffi::Error::Success();
  const GemmProblem p{a.untyped_data(), b.untyped_data(),
                      bias.element_count() > 0 ? bias.typed_data() : nullptr, c->untyped_data(),
                      shape.batch, shape.m, shape.n, shape.k, attrs.trans_a != 0, attrs.trans_b != 0,
                      int(attrs.activation), attrs.activation_param, attrs.algorithm, attrs.tf32 != 0};
  if (auto status = GemmOnTensorCores(p, a.element_type(), stream)) return std::move(*status);
  return GemmTiledCuda(p, a.element_type(), stream);
}

}  // namespace

std::optional<ffi::Error> GemmOnTensorCores(const GemmProblem& p, ffi::DataType dtype, cudaStream_t stream) {
  const bool tf32 = dtype == ffi::DataType::F32 && p.tf32;
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16 && !tf32) return std::nullopt;
  int device = 0, major = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  const int64_t a_row = p.trans_a ? p.m : p.k, b_row = p.trans_b ? p.k : p.n;
  const int64_t align = tf32 ? 4 : 8;  // elements in 16 bytes: TMA's row alignment
  // Both operands transposed has no kernel there: jaxdnn's products never ask for it (dense.py).
  const bool fits = major == 9 && !(p.trans_a && p.trans_b) && p.k > 0 && a_row % align == 0 &&
                    b_row % align == 0 && p.n % align == 0 && p.m < INT32_MAX && p.n < INT32_MAX &&
                    p.k < INT32_MAX && p.batch < INT32_MAX;
  if (!fits) return std::nullopt;
  if (tf32 && p.trans_a && !p.trans_b) {
    const bool streams = p.algorithm == kGemmStreamed || (p.algorithm == kGemmAuto && p.m * p.n <= kStreamedMaxOutputs);
    if (streams && (p.m + 63) / 64 <= 65535 && p.batch <= 65535) return GemmStreamedTf32(p, stream);
  }
  if (tf32) return GemmSm90Tf32(p, stream);
  return dtype == ffi::DataType::BF16 ? GemmSm90Bf16(p, stream) : GemmSm90F16(p, stream);
}

}  // namespace jaxdnn

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmCuda, jaxdnn::GemmImpl, jaxdnn::BindGemm(jaxdnn::BindCuda()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
