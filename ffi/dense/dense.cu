// CUDA GEMM handler (jaxdnn_gemm_v3, see dense.h). bfloat16/float16 problems whose rows suit TMA, and
// float32 ones with the tf32 attribute, run on the Hopper tensor-core kernels (gemm_sm90.cuh); exact
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

// CUDA-core tiles: a block computes a kTile x kTile tile of c with 16 x 16 threads, each a 4 x 4
// patch (rows ty + 16 i, columns tx + 16 j: consecutive threads touch consecutive columns); the
// operands pass through shared memory kDepth columns of K at a time.
constexpr int kTile = 64, kDepth = 16, kThreads = 16;

// x[row, col] of a row-major [rows, cols] matrix as float; zero outside it.
template <typename T>
__device__ __forceinline__ float Load(const T* x, int64_t row, int64_t col, int64_t rows, int64_t cols) {
  return row < rows && col < cols ? ToFloat(x[row * cols + col]) : 0.f;
}

template <typename T>
__global__ void __launch_bounds__(kThreads* kThreads) GemmTiled(GemmProblem p) {
  __shared__ float tile_a[kDepth][kTile + 1];  // [k][m]; +1 keeps the transposed stores conflict-free
  __shared__ float tile_b[kDepth][kTile + 1];  // [k][n]
  const int64_t l = blockIdx.z;
  const T* a = static_cast<const T*>(p.a) + l * p.m * p.k;
  const T* b = static_cast<const T*>(p.b) + l * p.k * p.n;
  T* c = static_cast<T*>(p.c) + l * p.m * p.n;
  const int tx = threadIdx.x, ty = threadIdx.y, t = ty * kThreads + tx;
  const int64_t m0 = int64_t(blockIdx.y) * kTile, n0 = int64_t(blockIdx.x) * kTile;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < p.k; k0 += kDepth) {
    for (int e = t; e < kDepth * kTile; e += kThreads * kThreads) {
      const int kk = e / kTile, mm = e % kTile;
      // op_a is [M, K]: stored [M, K], or [K, M] when transposed.
      tile_a[kk][mm] = p.trans_a ? Load(a, k0 + kk, m0 + mm, p.k, p.m)
                                 : Load(a, m0 + mm, k0 + kk, p.m, p.k);
      // op_b is [K, N]: stored [K, N], or [N, K] when transposed.
      tile_b[kk][mm] = p.trans_b ? Load(b, n0 + mm, k0 + kk, p.n, p.k)
                                 : Load(b, k0 + kk, n0 + mm, p.k, p.n);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kDepth; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = tile_a[kk][ty + kThreads * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = tile_b[kk][tx + kThreads * j];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t row = m0 + ty + kThreads * i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t col = n0 + tx + kThreads * j;
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
    return InvalidArgument("gemm: M / 64 and the batch size must be at most 65535 on the CUDA-core path");
  }
  return DispatchFloat<float, __nv_bfloat16, __half>(dtype, "a", [&](auto tag) {
    GemmTiled<decltype(tag)><<<grid, dim3(kThreads, kThreads), 0, stream>>>(p);
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
  const bool fits = major == 9 && p.k > 0 && a_row % align == 0 && b_row % align == 0 && p.n % align == 0 &&
                    p.m < INT32_MAX && p.n < INT32_MAX && p.k < INT32_MAX && p.batch < INT32_MAX;
  if (!fits) return std::nullopt;
  if (tf32) return GemmSm90Tf32(p, stream);
  return dtype == ffi::DataType::BF16 ? GemmSm90Bf16(p, stream) : GemmSm90F16(p, stream);
}

}  // namespace jaxdnn

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmCuda, jaxdnn::GemmImpl, jaxdnn::BindGemm(jaxdnn::BindCuda()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
