// CPU GEMM with a fused epilogue: c[l] = act(op_a(a[l]) . op_b(b[l]) + bias), float32 accumulation.
// Cache blocking in the usual three levels, so every loop over K runs on contiguous float panels:
//   for each column block (kColumnBlock columns of c) and row chunk (kRowChunk rows):
//     for each depth block (kDepthBlock of K): pack op_b's [depth, columns] panel once,
//       for each row block (kRowBlock rows): pack op_a's [rows, depth] panel,
//         a register-blocked kRegRows x kRegCols micro-kernel adds their product to a float
//         accumulator of the chunk's [rows, columns];
//     then the epilogue: bias, activation, rounding to c's dtype.
// Packing converts bfloat16/float16 to float and undoes the transposes, so one micro-kernel serves
// every dtype and layout. The accumulator holds kRowChunk x kColumnBlock floats (512 KiB) whatever
// the problem's size; packed panels are padded with zeros to whole register blocks.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/activation.h"
#include "common/half_cpu.h"
#include "dense/dense.h"

namespace jaxdnn {
namespace {

constexpr int64_t kRegRows = 4;         // rows of c per micro-kernel call
constexpr int64_t kRegCols = 8;         // columns of c per micro-kernel call: two 4-wide SSE registers
constexpr int64_t kDepthBlock = 256;    // K per packed panel: a row panel (4 KiB) stays in L1
constexpr int64_t kRowBlock = 64;       // rows per packed op_a panel (64 KiB, L2)
constexpr int64_t kColumnBlock = 256;   // columns per packed op_b panel (256 KiB, L2)
constexpr int64_t kRowChunk = 512;      // rows per float accumulator (op_b is repacked once per chunk)
// Packed panels hold whole register blocks (zero-padded), so the blocks must divide the panels.
static_assert(kRowBlock % kRegRows == 0 && kRowChunk % kRowBlock == 0, "row blocks must nest");
static_assert(kColumnBlock % kRegCols == 0, "column blocks must nest");

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

  float A(int64_t i, int64_t p) const { return ToFloat(trans_a ? a[p * m + i] : a[i * k + p]); }
  float B(int64_t p, int64_t j) const { return ToFloat(trans_b ? b[j * k + p] : b[p * n + j]); }
};

// op_a rows [row0, row0 + rows) x depth [p0, p0 + depth) -> kRegRows-row strips, each [depth][kRegRows].
template <typename T>
void PackA(const Operands<T>& op, int64_t row0, int64_t rows, int64_t p0, int64_t depth, float* out) {
  for (int64_t strip = 0; strip < rows; strip += kRegRows) {
    for (int64_t p = 0; p < depth; ++p) {
      for (int64_t i = 0; i < kRegRows; ++i) {
        *out++ = strip + i < rows ? op.A(row0 + strip + i, p0 + p) : 0.f;
      }
    }
  }
}

// op_b depth [p0, p0 + depth) x columns [col0, col0 + cols) -> kRegCols-column strips, each
// [depth][kRegCols].
template <typename T>
void PackB(const Operands<T>& op, int64_t p0, int64_t depth, int64_t col0, int64_t cols, float* out) {
  for (int64_t strip = 0; strip < cols; strip += kRegCols) {
    for (int64_t p = 0; p < depth; ++p) {
      for (int64_t j = 0; j < kRegCols; ++j) {
        *out++ = strip + j < cols ? op.B(p0 + p, col0 + strip + j) : 0.f;
      }
    }
  }
}

// acc[rows, cols] (leading dimension ld) += a_strip . b_strip over `depth`: the sums stay in
// registers (a fixed-size array the compiler keeps in vector registers) until the end.
void MicroKernel(const float* a_strip, const float* b_strip, int64_t depth, float* acc, int64_t ld,
                 int64_t rows, int64_t cols) {
  float sum[kRegRows][kRegCols] = {};
  for (int64_t p = 0; p < depth; ++p) {
    const float* a = a_strip + p * kRegRows;
    const float* b = b_strip + p * kRegCols;
    for (int64_t i = 0; i < kRegRows; ++i) {
      for (int64_t j = 0; j < kRegCols; ++j) sum[i][j] += a[i] * b[j];
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) acc[i * ld + j] += sum[i][j];
  }
}

// The packed panels and the accumulator, allocated once per call and reused for every batch entry.
struct Workspace {
  std::vector<float> packed_a = std::vector<float>(kRowBlock * kDepthBlock);
  std::vector<float> packed_b = std::vector<float>(kDepthBlock * kColumnBlock);
  std::vector<float> acc = std::vector<float>(kRowChunk * kColumnBlock);
};

template <typename T>
void Gemm(const Operands<T>& op, const float* bias, const GemmAttrs& attrs, Workspace& ws, T* c) {
  std::vector<float>& packed_a = ws.packed_a;
  std::vector<float>& packed_b = ws.packed_b;
  std::vector<float>& acc = ws.acc;
  for (int64_t col0 = 0; col0 < op.n; col0 += kColumnBlock) {
    const int64_t cols = std::min(kColumnBlock, op.n - col0);
    for (int64_t chunk0 = 0; chunk0 < op.m; chunk0 += kRowChunk) {
      const int64_t chunk_rows = std::min(kRowChunk, op.m - chunk0);
      std::fill(acc.begin(), acc.begin() + chunk_rows * kColumnBlock, 0.f);  // small problems: no more
      for (int64_t p0 = 0; p0 < op.k; p0 += kDepthBlock) {
        const int64_t depth = std::min(kDepthBlock, op.k - p0);
        PackB(op, p0, depth, col0, cols, packed_b.data());
        for (int64_t row0 = 0; row0 < chunk_rows; row0 += kRowBlock) {
          const int64_t rows = std::min(kRowBlock, chunk_rows - row0);
          PackA(op, chunk0 + row0, rows, p0, depth, packed_a.data());
          for (int64_t j = 0; j < cols; j += kRegCols) {
            for (int64_t i = 0; i < rows; i += kRegRows) {
              MicroKernel(packed_a.data() + i * depth, packed_b.data() + j * depth, depth,
                          acc.data() + (row0 + i) * kColumnBlock + j, kColumnBlock,
                          std::min(kRegRows, rows - i), std::min(kRegCols, cols - j));
            }
          }
        }
      }
      for (int64_t i = 0; i < chunk_rows; ++i) {
        const float* acc_row = acc.data() + i * kColumnBlock;
        T* c_row = c + (chunk0 + i) * op.n + col0;
        for (int64_t j = 0; j < cols; ++j) {
          const float z = acc_row[j] + (bias != nullptr ? bias[col0 + j] : 0.f);
          c_row[j] = FromFloat<T>(ActivateKind(attrs.activation, z, attrs.activation_param));
        }
      }
    }
  }
}

ffi::Error GemmImpl(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::F32> bias,
                    ffi::Result<ffi::AnyBuffer> c, GemmAttrs attrs) {
  GemmShape shape;
  JAXDNN_RETURN_IF_ERROR(CheckGemm(a, b, bias, *c, attrs, &shape));
  if (shape.batch == 0 || shape.m == 0 || shape.n == 0) return ffi::Error::Success();
  const float* bias_data = bias.element_count() > 0 ? bias.typed_data() : nullptr;
  return DispatchFloat<float, Bf16, Half>(a.element_type(), "gemm: a", [&](auto type_tag) {
    using T = decltype(type_tag);
    Workspace workspace;
    for (int64_t l = 0; l < shape.batch; ++l) {
      Operands<T> op{static_cast<const T*>(a.untyped_data()) + l * shape.m * shape.k,
                     static_cast<const T*>(b.untyped_data()) + l * shape.k * shape.n,
                     shape.m, shape.n, shape.k, attrs.trans_a != 0, attrs.trans_b != 0};
      Gemm(op, bias_data, attrs, workspace, static_cast<T*>(c->untyped_data()) + l * shape.m * shape.n);
    }
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmCpu, jaxdnn::GemmImpl, jaxdnn::BindGemm(ffi::Ffi::Bind()));
