// The TF32 product contracted over both operands' rows, c[l] = a[l]^T . b[l] for a [L, K, M] and
// b [L, K, N] (trans_a, float32, tf32): dense's weight gradient x^T . dz, which is also the float32
// wgrad of a 1x1 convolution (M and N its channels, K its pixels) and of the im2col patches of the
// others that take the GEMM (conv's _wgrad_by_gemm). wgmma reads TF32 operands K-major only, and
// both operands here are M- and N-major: CUTLASS's builder transposes them on the way, and ran a
// 1x1 64->256 wgrad (N 128, 56^2) at 0.49x cuDNN's TF32 one (H200). mma.sync takes its operands from
// registers, so each lane reads its fragments from the rows as they were copied in.
//
// A block of 8 warps owns one kTileM x kTileN tile of c (16384 sums, 64 a thread, each warp 32 x 64:
// 2 x 8 mma tiles) and walks all K rows of its batch entry: kStages stages of kStageRows rows of
// both operands' tile columns, copied by cp.async (16 bytes a copy, zeros past the ends) into rows
// padded to a stride of 8 (mod 32) floats, so that a fragment's 32 loads (lane 4 g + t reads row t,
// column g) hit 32 banks. The caller splits long K into batch entries (dense.py's _row_slices) so
// that the blocks fill the GPU. It multiplies at about 95 TFLOP/s on an H200 (4096^3 through this
// kernel: 1.43 ms, CUTLASS's wgmma 0.56), so the heuristic takes it for small products only
// (kStreamedMaxOutputs): a 1x1 64->256 wgrad at N 128, 56^2 (401408 x 64 x 256) takes 0.161 ms
// (3.2 TB/s of its operands; CUTLASS's 0.297, cuBLAS's 0.131). Measured and slower (2026-11-29):
// 16-byte fragment loads (rows and columns permuted so that a lane's values sit together; 0.182
// ms), 16-row stages with two blocks an SM (0.167; with both, 0.209). Fewer load instructions and
// more warps did not help, so the mma.sync issue rate or the cvt.rna conversions set the rate (not
// profiled).
#include "common/activation.h"
#include "common/cuda_common.cuh"
#include "dense/dense.h"
#include "dense/gemm_sm90.h"

namespace jaxdnn {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kStageRows = 32, kStages = 4;
constexpr int kWarpM = 32, kWarpN = 64;  // a warp's tile: 2 x 8 mma tiles of 16 x 8
constexpr int kTileArea = kWarps * kWarpM * kWarpN;

template <int kTileM>
struct StreamedTile {
  static constexpr int kM = kTileM, kN = kTileArea / kTileM;
  static constexpr int kWarpsM = kM / kWarpM;
  static_assert(kWarpsM * (kN / kWarpN) == kWarps, "the warps must cover the tile");
  static constexpr int kStrideA = kM + 8, kStrideB = kN + 8;  // 8 (mod 32) floats: see the top
  static constexpr int kStageFloats = kStageRows * (kStrideA + kStrideB);
  static constexpr int kSharedBytes = kStages * kStageFloats * int(sizeof(float));
};

// One operand's copies of a stage: kStageRows rows of `cols` floats from column `col0` of a
// row-major [K, width] matrix, as cols / 4 chunks a row. A thread copies the same chunk of every
// kThreads / (cols / 4)-th row.
template <int kCols, int kStride>
struct StageCopies {
  static constexpr int kChunksPerRow = kCols / 4, kRowStep = kThreads / kChunksPerRow;
  static_assert(kThreads % kChunksPerRow == 0 && kStageRows % kRowStep == 0, "uneven copies");
  const float* base;
  const float* src;  // the thread's first row's chunk at k = 0
  int row, col;      // the thread's first row in a stage and its column in the tile
  int64_t width, k_end;
  bool col_inside;

  __device__ StageCopies(const float* matrix, int64_t width, int64_t k_end, int64_t col0)
      : base(matrix), width(width), k_end(k_end) {
    row = int(threadIdx.x) / kChunksPerRow, col = 4 * (int(threadIdx.x) % kChunksPerRow);
    col_inside = col0 + col < width;  // width % 4 == 0: a chunk is inside or outside whole
    src = matrix + row * width + col0 + col;
  }

  __device__ __forceinline__ void Issue(float* stage, int64_t k0) const {
#pragma unroll
    for (int i = 0; i < kStageRows / kRowStep; ++i) {
      const int r = row + i * kRowStep;
      const bool valid = col_inside && k0 + r < k_end;
      CpAsync16OrZeros(stage + r * kStride + col, valid ? src + (k0 + r - row) * width : base, valid);
    }
  }
};

template <int kTileM>
__global__ void __launch_bounds__(kThreads) StreamedTf32Kernel(GemmProblem p) {
  using Tile = StreamedTile<kTileM>;
  extern __shared__ __align__(16) float shared[];
  const int64_t l = blockIdx.z, m0 = int64_t(blockIdx.y) * Tile::kM, n0 = int64_t(blockIdx.x) * Tile::kN;
  const StageCopies<Tile::kM, Tile::kStrideA> copy_a(static_cast<const float*>(p.a) + l * p.k * p.m, p.m, p.k, m0);
  const StageCopies<Tile::kN, Tile::kStrideB> copy_b(static_cast<const float*>(p.b) + l * p.k * p.n, p.n, p.k, n0);
  auto issue = [&](int64_t s) {  // stage s's copies into slot s % kStages, as one group (maybe empty)
    if (s * kStageRows < p.k) {
      float* slot = shared + (s % kStages) * Tile::kStageFloats;
      copy_a.Issue(slot, s * kStageRows);
      copy_b.Issue(slot + kStageRows * Tile::kStrideA, s * kStageRows);
    }
    CpAsyncCommit();
  };

  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int warp_m = (warp % Tile::kWarpsM) * kWarpM, warp_n = (warp / Tile::kWarpsM) * kWarpN;
  float acc[2][8][4] = {};
  const int64_t stages = (p.k + kStageRows - 1) / kStageRows;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(s);
  for (int64_t s = 0; s < stages; ++s) {
    CpAsyncWait<kStages - 2>();  // stage s has landed (this thread's copies) ...
    __syncthreads();             // ... everyone's, and every warp is done with stage s - 1's slot
    issue(s + kStages - 1);      // into that slot
    const float* sa = shared + (s % kStages) * Tile::kStageFloats;
    const float* sb = sa + kStageRows * Tile::kStrideA;
#pragma unroll
    for (int kk = 0; kk < kStageRows; kk += 8) {
      // A's mma tile is a^T: element (m, k) sits at sa[k][m]; B's (k, n) at sb[k][n].
      uint32_t fa[2][4], fb[8][2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float* f = sa + (kk + t) * Tile::kStrideA + warp_m + 16 * i + g;
        fa[i][0] = Tf32(f[0]), fa[i][1] = Tf32(f[8]);
        fa[i][2] = Tf32(f[4 * Tile::kStrideA]), fa[i][3] = Tf32(f[4 * Tile::kStrideA + 8]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float* f = sb + (kk + t) * Tile::kStrideB + warp_n + 8 * j + g;
        fb[j][0] = Tf32(f[0]), fb[j][1] = Tf32(f[4 * Tile::kStrideB]);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) MmaTf32(acc[i][j], fa[i], fb[j]);
      }
    }
  }
  CpAsyncWait<0>();  // the empty groups past the end

  float* c = static_cast<float*>(p.c) + l * p.m * p.n;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = m0 + warp_m + 16 * i + g + 8 * half;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int64_t col = n0 + warp_n + 8 * j + 2 * t;  // n % 4 == 0: col + 1 is inside with col
        if (row >= p.m || col >= p.n) continue;
        float v[2] = {acc[i][j][2 * half], acc[i][j][2 * half + 1]};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          v[e] = ActivateKind(p.activation, v[e] + (p.bias != nullptr ? p.bias[col + e] : 0.f), p.activation_param);
        }
        *reinterpret_cast<float2*>(c + row * p.n + col) = make_float2(v[0], v[1]);
      }
    }
  }
}

template <int kTileM>
ffi::Error Launch(const GemmProblem& p, cudaStream_t stream) {
  using Tile = StreamedTile<kTileM>;
  const dim3 grid(unsigned((p.n + Tile::kN - 1) / Tile::kN), unsigned((p.m + Tile::kM - 1) / Tile::kM), unsigned(p.batch));
  JAXDNN_RETURN_IF_ERROR(CudaError(cudaFuncSetAttribute(StreamedTf32Kernel<kTileM>,
                                                        cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSharedBytes),
                                   "gemm (streamed TF32)"));
  StreamedTf32Kernel<kTileM><<<grid, kThreads, Tile::kSharedBytes, stream>>>(p);
  return LaunchError("gemm (streamed TF32)");
}

}  // namespace

int StreamedTf32TileM(int64_t m, int64_t n) {
  // The tile shape that reads the least: each tile reads its kM + kN columns of every row.
  int best = 0;
  int64_t best_reads = 0;
  for (const int tile_m : {64, 128, 256}) {
    const int64_t tile_n = kTileArea / tile_m;
    const int64_t reads = (m + tile_m - 1) / tile_m * ((n + tile_n - 1) / tile_n) * (tile_m + tile_n);
    if (best == 0 || reads < best_reads) best = tile_m, best_reads = reads;
  }
  return best;
}

ffi::Error GemmStreamedTf32(const GemmProblem& p, cudaStream_t stream) {
  switch (StreamedTf32TileM(p.m, p.n)) {
    case 64: return Launch<64>(p, stream);
    case 128: return Launch<128>(p, stream);
    default: return Launch<256>(p, stream);
  }
}

}  // namespace jaxdnn
