// CPU GEMM with a fused epilogue: c[l] = act(op_a(a[l]) . op_b(b[l]) + bias), float32 accumulation.
// c is cut into tiles of a batch entry's rows and kColumnBlock columns, shared out over XLA's
// intra-op threads (ParallelFor). A tile sums over K in blocks of kDepthBlock: it packs op_a's
// [rows, depth] panel in strips of a register tile's rows and op_b's [depth, columns] panel in strips
// of its columns, converting bfloat16/float16 to float and undoing the transposes, so that one
// micro-kernel (common/matmul_cpu.h) serves every dtype and layout; the tile's float sums stay in
// the workspace between depth blocks. Then the epilogue: bias, the activation (a compile-time
// constant), rounding to c's dtype. Every element is summed over K in order, whatever the tiles and
// threads: the results do not depend on the thread count. Register tiles: AVX-512 8 x 32, AVX2/FMA
// 6 x 16, the baseline 2 x 16, chosen at run time (common/cpu_isa.h).
#include <algorithm>
#include <cstdint>
#include <string>

#include "common/activation.h"
#include "common/cpu_isa.h"
#include "common/half_cpu.h"
#include "common/matmul_cpu.h"
#include "common/parallel_cpu.h"
#include "dense/dense.h"

namespace jaxdnn {
namespace {

constexpr int64_t kDepthBlock = 256;   // K per packed panel
constexpr int64_t kColumnBlock = 256;  // columns of c per tile (op_b's panel: 256 KiB, L2)

bool IsFloat(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

// The matrices of one batch entry, as the kernel reads them (op_a, op_b undo the transposes).
template <typename T>
struct Operands {
  const T* a;
  const T* b;
  int64_t m, n, k;
  bool trans_a, trans_b;
};

// A tile of c: rows [row0, row0 + rows) and columns [col0, col0 + cols) of one batch entry.
struct TileOfC {
  int64_t row0, rows, col0, cols;
};

// op_a's rows [row0, row0 + rows) x depth [p0, p0 + depth) as strips of kRows rows.
template <int kRows, typename T>
JAXDNN_ALWAYS_INLINE inline void PackA(const Operands<T>& op, int64_t row0, int64_t rows, int64_t p0, int64_t depth,
                                       float* out) {
  if (op.trans_a) return PackStrips<kRows>(op.a + p0 * op.m + row0, op.m, 1, depth, rows, out);  // a [K, M]
  PackStrips<kRows>(op.a + row0 * op.k + p0, 1, op.k, depth, rows, out);                        // a [M, K]
}

// op_b's depth [p0, p0 + depth) x columns [col0, col0 + cols) as strips of kCols columns.
template <int kCols, typename T>
JAXDNN_ALWAYS_INLINE inline void PackB(const Operands<T>& op, int64_t p0, int64_t depth, int64_t col0, int64_t cols,
                                       float* out) {
  if (op.trans_b) return PackStrips<kCols>(op.b + col0 * op.k + p0, 1, op.k, depth, cols, out);  // b [N, K]
  PackStrips<kCols>(op.b + p0 * op.n + col0, op.n, 1, depth, cols, out);                        // b [K, N]
}

// The packed panels and a tile's float sums ([kMaxRowBlock][kColumnBlock]), whole register tiles,
// in the thread's scratch (ScratchBuffers).
constexpr int64_t kTilesPerRowBlock = 16;                // register tiles' rows in a tile of c
constexpr int64_t kMaxRowBlock = kTilesPerRowBlock * 8;  // the widest build's (8 rows a register tile)
struct Workspace {
  float *packed_a, *packed_b, *sums;
};

Workspace ThreadWorkspace() {
  auto [packed_a, packed_b, sums] = ScratchBuffers(
      {kMaxRowBlock * kDepthBlock, kDepthBlock * kColumnBlock, kMaxRowBlock * kColumnBlock});
  return {packed_a, packed_b, sums};
}

// Rows of the register tiles of each build: AVX-512 8 x 32 (16 of the 32 registers hold sums), AVX2
// with FMA 6 x 16 (12 of 16), the baseline (SSE2) 2 x 16 (8 of 16).
constexpr int RegisterRows(CpuIsa isa) { return isa == CpuIsa::kAvx512 ? 8 : (isa == CpuIsa::kAvx2 ? 6 : 2); }

// ws.sums[tile.rows, tile.cols] = op_a . op_b over the tile (rows rounded up to whole register
// tiles, columns to whole strips), compiled for the active ISA.
template <typename T>
void TileProduct(const Operands<T>& op, const TileOfC& tile, const Workspace& ws) {
  CallForIsa([&](auto isa) JAXDNN_ALWAYS_INLINE {
    constexpr int kRows = RegisterRows(decltype(isa)::value);
    constexpr int kStrips = decltype(isa)::value == CpuIsa::kAvx512 ? 2 : 1;
    for (int64_t p0 = 0; p0 < op.k; p0 += kDepthBlock) {
      const int64_t depth = std::min(kDepthBlock, op.k - p0);
      PackA<kRows>(op, tile.row0, tile.rows, p0, depth, ws.packed_a);
      PackB<kStrips * kStripCols>(op, p0, depth, tile.col0, tile.cols, ws.packed_b);
      StripProducts<kRows, kStrips>(ws.packed_a, tile.rows, ws.packed_b, tile.cols, depth,
                                    ws.sums, kColumnBlock, p0 == 0);
    }
  });
  if (op.k == 0) {
    for (int64_t i = 0; i < tile.rows; ++i) std::fill_n(ws.sums + i * kColumnBlock, tile.cols, 0.f);
  }
}

// c's tile = act(sums + bias), rounded to T; bias may be null.
template <Activation kAct, typename T>
JAXDNN_ALWAYS_INLINE inline void Epilogue(const Workspace& ws, const TileOfC& tile, const float* bias, float param,
                                          int64_t n, T* c) {
  static const float kNoBias[kColumnBlock] = {};
  const float* b = bias != nullptr ? bias + tile.col0 : kNoBias;
  for (int64_t i = 0; i < tile.rows; ++i) {
    const float* sums = ws.sums + i * kColumnBlock;
    T* out = c + (tile.row0 + i) * n + tile.col0;
    for (int64_t j = 0; j < tile.cols; ++j) out[j] = FromFloat<T>(Activate<kAct>(sums[j] + b[j], param));
  }
}

template <typename T>
void Gemm(ffi::ThreadPool& pool, const GemmShape& shape, const T* a, const T* b, const float* bias,
          const GemmAttrs& attrs, T* c) {
  // Tiles of kTilesPerRowBlock register tiles' rows, fewer where that leaves a thread without two
  // tiles (a tile's packed op_b panel is then shared by fewer rows).
  const int64_t reg_rows = RegisterRows(ActiveCpuIsa()), threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t column_tiles = (shape.n + kColumnBlock - 1) / kColumnBlock;
  int64_t row_block = kTilesPerRowBlock * reg_rows;
  while (row_block > 2 * reg_rows &&
         shape.batch * column_tiles * ((shape.m + row_block - 1) / row_block) < 2 * threads) {
    row_block = (row_block / 2 + reg_rows - 1) / reg_rows * reg_rows;
  }
  const int64_t row_tiles = (shape.m + row_block - 1) / row_block;
  ParallelFor(pool, shape.batch * row_tiles * column_tiles, [&](int64_t item) {
    const int64_t l = item / (row_tiles * column_tiles), rt = item / column_tiles % row_tiles;
    const int64_t ct = item % column_tiles;
    const TileOfC tile{rt * row_block, std::min(row_block, shape.m - rt * row_block), ct * kColumnBlock,
                       std::min(kColumnBlock, shape.n - ct * kColumnBlock)};
    const Operands<T> op{a + l * shape.m * shape.k, b + l * shape.k * shape.n, shape.m, shape.n, shape.k,
                         attrs.trans_a != 0, attrs.trans_b != 0};
    const Workspace ws = ThreadWorkspace();
    TileProduct(op, tile, ws);
    T* c_entry = c + l * shape.m * shape.n;
    DispatchActivation(attrs.activation, [&](auto act) {
      CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
        Epilogue<decltype(act)::value>(ws, tile, bias, attrs.activation_param, shape.n, c_entry);
      });
    });
  });
}

ffi::Error GemmImpl(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::F32> bias,
                    ffi::Result<ffi::AnyBuffer> c, GemmAttrs attrs) {
  GemmShape shape;
  JAXDNN_RETURN_IF_ERROR(CheckGemm(a, b, bias, *c, attrs, &shape));
  if (shape.batch == 0 || shape.m == 0 || shape.n == 0) return ffi::Error::Success();
  const float* bias_data = bias.element_count() > 0 ? bias.typed_data() : nullptr;
  return DispatchFloat<float, Bf16, Half>(a.element_type(), "gemm: a", [&](auto type_tag) {
    using T = decltype(type_tag);
    Gemm<T>(pool, shape, static_cast<const T*>(a.untyped_data()), static_cast<const T*>(b.untyped_data()),
            bias_data, attrs, static_cast<T*>(c->untyped_data()));
    return ffi::Error::Success();
  });
}

}  // namespace

ffi::Error CheckGemm(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::F32> bias, const ffi::AnyBuffer& c,
                     const GemmAttrs& attrs, GemmShape* shape) {
  const std::string operands = " (a " + Dims(a.dimensions()) + ", b " + Dims(b.dimensions()) + ", c " +
                               Dims(c.dimensions()) + ")";
  if (attrs.trans_a != 0 && attrs.trans_a != 1) {
    return InvalidArgument("gemm: trans_a must be 0 or 1, got " + std::to_string(attrs.trans_a));
  }
  if (attrs.trans_b != 0 && attrs.trans_b != 1) {
    return InvalidArgument("gemm: trans_b must be 0 or 1, got " + std::to_string(attrs.trans_b));
  }
  if (attrs.tf32 != 0 && attrs.tf32 != 1) {
    return InvalidArgument("gemm: tf32 must be 0 or 1, got " + std::to_string(attrs.tf32));
  }
  if (attrs.activation < 0 || attrs.activation >= kNumActivations) {
    return InvalidArgument("gemm: unknown activation " + std::to_string(attrs.activation));
  }
  if (!IsFloat(a.element_type())) return InvalidArgument("gemm: a must be float32, bfloat16 or float16");
  if (b.element_type() != a.element_type() || c.element_type() != a.element_type()) {
    return InvalidArgument("gemm: a, b and c must share one dtype");
  }
  if (a.dimensions().size() != 3 || b.dimensions().size() != 3 || c.dimensions().size() != 3) {
    return InvalidArgument("gemm: a, b and c must have rank 3" + operands);
  }
  auto ad = a.dimensions(), bd = b.dimensions(), cd = c.dimensions();
  shape->batch = ad[0];
  shape->m = attrs.trans_a ? ad[2] : ad[1];
  shape->k = attrs.trans_a ? ad[1] : ad[2];
  const int64_t b_k = attrs.trans_b ? bd[2] : bd[1];
  shape->n = attrs.trans_b ? bd[1] : bd[2];
  if (bd[0] != shape->batch || cd[0] != shape->batch) {
    return InvalidArgument("gemm: a, b and c must have one batch size" + operands);
  }
  if (b_k != shape->k) return InvalidArgument("gemm: a and b disagree on K" + operands);
  if (cd[1] != shape->m || cd[2] != shape->n) return InvalidArgument("gemm: c must be [L, M, N]" + operands);
  const auto bias_dims = bias.dimensions();
  if (bias_dims.size() != 1 || (bias_dims[0] != shape->n && bias_dims[0] != 0)) {
    return InvalidArgument("gemm: bias must be [N] or [0], got " + Dims(bias_dims) + operands);
  }
  return ffi::Error::Success();
}

}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmCpu, jaxdnn::GemmImpl, jaxdnn::BindGemm(jaxdnn::BindWithThreadPool()));
