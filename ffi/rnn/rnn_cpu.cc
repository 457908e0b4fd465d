// CPU LSTM, GRU and plain RNN recurrences: the CUDA kernels' decomposition, with a chunk of up to
// kChunkRows batch rows (instead of one) stepping through time together. Per step: the recurrent
// products of the chunk's running rows (rows past their length drop out), then the per-unit cell
// math of rnn_cell.h. The chunks of every direction run in parallel on XLA's intra-op thread pool
// (smaller chunks where that gives every thread one; fewer chunks than threads split their products
// by columns over the spare ones: ForEachChunk); each direction's W_hh is converted to float32
// and packed once per call (PackWeights), so that the products keep tiles of 4 rows x 2 vectors of
// sums in vector registers over the whole reduction (AVX-512, AVX2 or SSE2 vectors: cpu_isa.h).
#include <algorithm>
#include <string_view>
#include <vector>

#include "common/cpu_isa.h"
#include "common/half_cpu.h"
#include "common/parallel_cpu.h"
#include "rnn/rnn.h"
#include "rnn/rnn_cell.h"
#include "rnn/rnn_common.h"

namespace jaxdnn {
namespace {

using F32 = ffi::Buffer<ffi::F32>;
using F32Result = ffi::Result<ffi::Buffer<ffi::F32>>;

constexpr int64_t kChunkRows = 16;

// The per-step products' register tile: up to kTileRows batch rows x one panel of columns, two
// vectors of the widest the CPU has (cpu_isa.h: 16 floats with AVX-512, 8 with AVX2, 4 on the
// baseline, SSE2), so 8 vector sums kept across the whole reduction. Written with the GCC/Clang
// vector extension: left to itself the compiler vectorized along the reduction, shuffling each
// step's panel rows into place (slower than the plain axpy loops this replaced).
constexpr int64_t kTileRows = 4;

// A vector of kWidth floats; aligned(4): loads need not be aligned (std::vector's storage is 16-byte
// aligned, a panel row 32 to 128 bytes).
template <int kWidth>
struct VectorOf;
template <>
struct VectorOf<4> {
  using type = float __attribute__((vector_size(16), aligned(4)));
};
template <>
struct VectorOf<8> {
  using type = float __attribute__((vector_size(32), aligned(4)));
};
template <>
struct VectorOf<16> {
  using type = float __attribute__((vector_size(64), aligned(4)));
};

// The vector width of the CPU's products (cpu_isa.h).
int ActiveVectorWidth() {
#ifdef JAXDNN_CPU_ISA_VARIANTS
  if (ActiveCpuIsa() == CpuIsa::kAvx512) return 16;
  if (ActiveCpuIsa() == CpuIsa::kAvx2) return 8;
#endif
  return 4;
}

// A direction's recurrent weights as the right operand B [K, N] of the per-step products (float32),
// packed in panels of `panel` columns (two vectors), each [K][panel] and zero past N: the tile reads
// a row of its panel as one contiguous run, and a panel (32 KiB at K 256 and 32 columns) stays in L1
// while every row tile uses it.
struct PackedWeights {
  int64_t k = 0, n = 0, panel = 0;
  std::vector<float> panels;
  int64_t PanelCount() const { return (n + panel - 1) / panel; }
  const float* Panel(int64_t p) const { return panels.data() + p * k * panel; }
};

// Direction d's W_hh [G, H] (of w_hh [D, G, H]) packed as B = W_hh (K = G, N = H), or as B = W_hh^T
// (K = H, N = G) when `transpose`, in panels of two vectors of the CPU's width.
ffi::Error PackWeights(const ffi::AnyBuffer& w_hh, int64_t d, bool transpose, PackedWeights* out) {
  return DispatchFloat<float, Bf16, Half>(w_hh.element_type(), "w_hh", [&](auto tag) {
    using W = decltype(tag);
    const int64_t gates = w_hh.dimensions()[1], hidden = w_hh.dimensions()[2];
    const W* w = static_cast<const W*>(w_hh.untyped_data()) + d * gates * hidden;
    out->k = transpose ? hidden : gates;
    out->n = transpose ? gates : hidden;
    out->panel = 2 * ActiveVectorWidth();
    out->panels.assign(out->PanelCount() * out->k * out->panel, 0.f);
    for (int64_t g = 0; g < gates; ++g) {
      for (int64_t j = 0; j < hidden; ++j) {
        const int64_t k = transpose ? j : g, n = transpose ? g : j;
        out->panels[((n / out->panel) * out->k + k) * out->panel + n % out->panel] = ToFloat(w[g * hidden + j]);
      }
    }
    return ffi::Error::Success();
  });
}

// A chunk of batch rows [begin, begin + count) in direction d, and their valid step counts.
struct RowChunk {
  RecurrenceShape shape;
  int64_t begin = 0, d = 0;
  bool reverse = false;  // this direction's order (Reversed)
  std::vector<int64_t> lens;
  int64_t MaxSteps() const { return lens.empty() ? 0 : *std::max_element(lens.begin(), lens.end()); }
  // The chunk's r-th row in direction d.
  SeqRow Row(int64_t r) const { return shape.Row(begin + r, d); }
  // Its state's index in the [B D, H] view of the states.
  int64_t Pair(int64_t r) const { return Row(r).state; }
  // Its `step`-th step in the [B T D, ...] view of the per-step arrays.
  int64_t At(int64_t r, int64_t step) const { return jaxdnn::At(shape, Row(r), StepTime(step, lens[r], reverse)); }
};

RowChunk MakeChunk(const int32_t* seq_lengths, int64_t begin, int64_t rows, const RecurrenceShape& s, int64_t d,
                   bool reverse) {
  RowChunk chunk;
  chunk.shape = s;
  chunk.begin = begin;
  chunk.d = d;
  chunk.reverse = Reversed(reverse, d);
  for (int64_t b = begin; b < std::min(s.batch, begin + rows); ++b) {
    chunk.lens.push_back(ValidSteps(seq_lengths[b], s.steps));
  }
  return chunk;
}

// dst[r] = src[chunk.Pair(r)] (rows of `width` floats), for the chunk's rows.
void GatherRows(const float* src, const RowChunk& chunk, int64_t width, float* dst) {
  for (size_t r = 0; r < chunk.lens.size(); ++r) std::copy_n(src + chunk.Pair(r) * width, width, dst + r * width);
}

// dst[chunk.Pair(r)] = src[r], for the chunk's rows.
void ScatterRows(const float* src, const RowChunk& chunk, int64_t width, float* dst) {
  for (size_t r = 0; r < chunk.lens.size(); ++r) std::copy_n(src + r * width, width, dst + chunk.Pair(r) * width);
}

// Batch rows a chunk: kChunkRows, or fewer (a multiple of kTileRows) where that gives each of the
// pool's threads a chunk: a layer of 16 rows in one direction is then 2 chunks on 2 threads, not 1.
// (A row's sums depend on the size of the tile it lands in, so the results are those of the
// machine's thread count: the same bits on every run there.)
int64_t ChunkRows(const RecurrenceShape& s, int64_t threads) {
  const int64_t per_direction = std::max<int64_t>(1, (threads + s.directions - 1) / s.directions);
  const int64_t rows = (s.batch + per_direction - 1) / per_direction;
  return std::clamp((rows + kTileRows - 1) / kTileRows * kTileRows, kTileRows, kChunkRows);
}

// Columns of a step's product a thread at least, where a chunk's products are split over threads.
constexpr int64_t kMinPartColumns = 128;

// Runs fn(chunk, w, team) over the chunks of batch rows of every direction, in parallel (they are
// independent recurrences), w being the direction's W_hh packed by PackWeights (as W_hh^T when
// `transpose`). fn allocates its own buffers: chunks run on several threads at once. Where there are
// fewer chunks than the pool's threads (one batch row of one direction: 1 chunk on 2 threads), each
// chunk's per-step products are split by columns over a team of the spare threads (RoundTeam, at
// least kMinPartColumns columns a part): each thread then reads its part of W_hh every step, which
// stays in its core's cache, where one thread streamed all of it. The split changes no sum.
template <typename Fn>
ffi::Error ForEachChunk(ffi::ThreadPool& pool, const ffi::AnyBuffer& w_hh, bool transpose,
                        const int32_t* seq_lengths, const RecurrenceShape& s, bool reverse, Fn fn) {
  std::vector<PackedWeights> w(s.directions);
  for (int64_t d = 0; d < s.directions; ++d) JAXDNN_RETURN_IF_ERROR(PackWeights(w_hh, d, transpose, &w[d]));
  const int64_t threads = pool.num_threads(), rows = ChunkRows(s, threads);
  const int64_t chunks = (s.batch + rows - 1) / rows, items = s.directions * chunks;
  const int64_t helpers = std::max<int64_t>(0, threads / items - 1);
  const int64_t parts = std::clamp<int64_t>(w[0].n / kMinPartColumns, 1, helpers + 1);
  ParallelFor(pool, items, [&](int64_t i) {
    const int64_t d = i / chunks;
    RoundTeam team(pool, helpers, parts);
    fn(MakeChunk(seq_lengths, i % chunks * rows, rows, s, d, reverse), w[d], team);
  });
  return ffi::Error::Success();
}

// sum[i] = a_rows[i] . (the panel's 2 kWidth columns) over k < K, for a tile of R rows. Tiles of 1
// or 2 rows keep 4 / R partial sums along k, so that 8 independent vector sums (6 for 3 rows) hide
// the adds' latency (a lone row with one chain ran slower than the axpy loops this replaced).
template <int R, int kWidth>
inline __attribute__((always_inline)) void TileProducts(const float* const* a_rows, const float* panel,
                                                        int64_t K, typename VectorOf<kWidth>::type (&sum)[R][2]) {
  using Vector = typename VectorOf<kWidth>::type;
  constexpr int kSplit = R >= 4 ? 1 : 4 / R;
  Vector part[kSplit][R][2] = {};
  auto accumulate = [&](int s, int64_t k) {
    const Vector* w = reinterpret_cast<const Vector*>(panel + k * 2 * kWidth);
    for (int i = 0; i < R; ++i) {
      const float x = a_rows[i][k];
      for (int v = 0; v < 2; ++v) part[s][i][v] += x * w[v];
    }
  };
  int64_t k0 = 0;
  for (; k0 + kSplit <= K; k0 += kSplit) {
    for (int s = 0; s < kSplit; ++s) accumulate(s, k0 + s);
  }
  for (; k0 < K; ++k0) accumulate(0, k0);
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < 2; ++v) {
      sum[i][v] = part[0][i][v];
      for (int s = 1; s < kSplit; ++s) sum[i][v] += part[s][i][v];
    }
  }
}

// c[rows[i], n0 + j] = the products of a tile of R rows with panel p (columns n0 = p 2 kWidth on).
template <int R, int kWidth>
inline __attribute__((always_inline)) void StoreTile(const PackedWeights& b, const float* a, int64_t lda,
                                                     const int64_t* rows, int64_t p, float* c, int64_t ldc) {
  const float* a_rows[R];
  for (int i = 0; i < R; ++i) a_rows[i] = a + rows[i] * lda;
  typename VectorOf<kWidth>::type sum[R][2];
  TileProducts<R, kWidth>(a_rows, b.Panel(p), b.k, sum);
  const int64_t n0 = p * b.panel, cols = std::min(b.panel, b.n - n0);
  for (int i = 0; i < R; ++i) {
    for (int64_t j = 0; j < cols; ++j) c[rows[i] * ldc + n0 + j] = sum[i][j / kWidth][j % kWidth];
  }
}

// The products of RunningRowProducts (below) on vectors of kWidth floats (b's panels of 2 kWidth),
// panels [p0, p1).
template <int kWidth>
inline __attribute__((always_inline)) void RowProducts(const PackedWeights& b, const float* a, int64_t lda,
                                                       const int64_t* running, int64_t count, float* c,
                                                       int64_t ldc, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t i0 = 0; i0 < count; i0 += kTileRows) {
      const int64_t* rows = running + i0;
      switch (std::min(kTileRows, count - i0)) {
        case 1: StoreTile<1, kWidth>(b, a, lda, rows, p, c, ldc); break;
        case 2: StoreTile<2, kWidth>(b, a, lda, rows, p, c, ldc); break;
        case 3: StoreTile<3, kWidth>(b, a, lda, rows, p, c, ldc); break;
        default: StoreTile<4, kWidth>(b, a, lda, rows, p, c, ldc); break;
      }
    }
  }
}

// Built for AVX-512 and for AVX2 with FMA too on x86-64 (the package's baseline is SSE2), as the
// convolution's matmuls.
#ifdef JAXDNN_CPU_ISA_VARIANTS
__attribute__((target("avx512f"))) void RowProductsAvx512(const PackedWeights& b, const float* a, int64_t lda,
                                                          const int64_t* running, int64_t count, float* c,
                                                          int64_t ldc, int64_t p0, int64_t p1) {
  RowProducts<16>(b, a, lda, running, count, c, ldc, p0, p1);
}
__attribute__((target("avx2,fma"))) void RowProductsAvx2(const PackedWeights& b, const float* a, int64_t lda,
                                                         const int64_t* running, int64_t count, float* c,
                                                         int64_t ldc, int64_t p0, int64_t p1) {
  RowProducts<8>(b, a, lda, running, count, c, ldc, p0, p1);
}
#endif

// c[r, n] = sum_k a[r, k] B[k, n] for the chunk rows r still running at `step` (the other rows of c
// are left as they are); rows of a and c are lda and ldc floats apart. The forward's products are
// h W_hh^T (B = W_hh^T), the backward's d W_hh (B = W_hh). Panels outside, so that each stays in L1
// while every tile of rows uses it; the team's parts take contiguous runs of panels.
void RunningRowProducts(RoundTeam& team, const PackedWeights& b, const float* a, int64_t lda, const RowChunk& chunk,
                        int64_t step, float* c, int64_t ldc) {
  int64_t running[kChunkRows];
  int64_t count = 0;
  for (int64_t r = 0; r < int64_t(chunk.lens.size()); ++r) {
    if (step < chunk.lens[r]) running[count++] = r;
  }
  const int64_t panels = b.PanelCount(), parts = team.parts();
  team.Run([&](int64_t part) {
    const int64_t p0 = part * panels / parts, p1 = (part + 1) * panels / parts;
#ifdef JAXDNN_CPU_ISA_VARIANTS
    if (b.panel == 32) return RowProductsAvx512(b, a, lda, running, count, c, ldc, p0, p1);
    if (b.panel == 16) return RowProductsAvx2(b, a, lda, running, count, c, ldc, p0, p1);
#endif
    RowProducts<4>(b, a, lda, running, count, c, ldc, p0, p1);
  });
}

// One row's cells of a forward step over its H units: gx and p the step's input projection and
// recurrent product ([gates, H] each), the activations saved for the backward, the carried h and c
// updated and copied to the sequences. __restrict (the arrays are distinct) spares GCC the run-time
// alias checks that exceeded its limit and kept these loops scalar; inlined into CallVectorized's
// variants.
JAXDNN_ALWAYS_INLINE inline void LstmCells(int64_t H, const float* __restrict gx, const float* __restrict p,
                                           float* __restrict acts, float* __restrict h, float* __restrict c,
                                           float* __restrict h_seq, float* __restrict c_seq) {
  for (int64_t j = 0; j < H; ++j) {
    const LstmGates g = LstmActivate(gx[j] + p[j], gx[H + j] + p[H + j], gx[2 * H + j] + p[2 * H + j],
                                     gx[3 * H + j] + p[3 * H + j]);
    c[j] = g.f * c[j] + g.i * g.g;
    h[j] = g.o * Tanh(c[j]);
    acts[j] = g.i, acts[H + j] = g.f, acts[2 * H + j] = g.g, acts[3 * H + j] = g.o;
    h_seq[j] = h[j];
    c_seq[j] = c[j];
  }
}

// The same for the GRU (bias: b_hh; keep: r, z, n and the recurrent product of n, for the backward).
JAXDNN_ALWAYS_INLINE inline void GruCells(int64_t H, const float* __restrict gx, const float* __restrict p,
                                          const float* __restrict bias, float* __restrict keep,
                                          float* __restrict h, float* __restrict h_seq) {
  for (int64_t j = 0; j < H; ++j) {
    const float hp_n = p[2 * H + j] + bias[2 * H + j];
    const GruGates a = GruActivate(gx[j], gx[H + j], gx[2 * H + j], p[j] + bias[j], p[H + j] + bias[H + j], hp_n);
    h[j] = GruOutput(a, h[j]);
    keep[j] = a.r, keep[H + j] = a.z, keep[2 * H + j] = a.n, keep[3 * H + j] = hp_n;
    h_seq[j] = h[j];
  }
}

ffi::Error LstmFwdImpl(ffi::ThreadPool pool,
                       F32 gates_x, ffi::AnyBuffer w_hh, F32 h0, F32 c0, ffi::Buffer<ffi::S32> seq_lengths,
                       F32Result h_seq, F32Result c_seq, F32Result acts, F32Result h_n, F32Result c_n,
                       int64_t reverse, int64_t /*tf32*/, int64_t /*bf16_state: always exact here*/) {
  RecurrenceShape s;
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(gates_x.dimensions(), 4, 4, &s));
  JAXDNN_RETURN_IF_ERROR(CheckRecurrenceOperands(
      s, w_hh, {h0.dimensions(), c0.dimensions(), h_n->dimensions(), c_n->dimensions()}, seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 1, {h_seq->dimensions(), c_seq->dimensions()}));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 4, {acts->dimensions()}));
  if (s.empty()) return ffi::Error::Success();
  const int64_t H = s.hidden, G = s.gates(), T = s.steps, sequences = s.batch * s.directions * T;
  std::fill_n(h_seq->typed_data(), sequences * H, 0.f);  // steps past each row's end stay zero
  std::fill_n(c_seq->typed_data(), sequences * H, 0.f);
  std::fill_n(acts->typed_data(), sequences * G, 0.f);
  return ForEachChunk(pool, w_hh, /*transpose=*/true, seq_lengths.typed_data(), s, reverse != 0,
                      [&](const RowChunk& chunk, const PackedWeights& wt, RoundTeam& team) {
    const int64_t rows = int64_t(chunk.lens.size());
    std::vector<float> h(rows * H), c(rows * H), pre(rows * G);
    GatherRows(h0.typed_data(), chunk, H, h.data());
    GatherRows(c0.typed_data(), chunk, H, c.data());
    for (int64_t step = 0; step < chunk.MaxSteps(); ++step) {
      RunningRowProducts(team, wt, h.data(), H, chunk, step, pre.data(), G);
      for (int64_t r = 0; r < rows; ++r) {
        if (step >= chunk.lens[r]) continue;
        const int64_t row = chunk.At(r, step);
        float *hr = h.data() + r * H, *cr = c.data() + r * H;
        CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
          LstmCells(H, gates_x.typed_data() + row * G, pre.data() + r * G, acts->typed_data() + row * G, hr, cr,
                    h_seq->typed_data() + row * H, c_seq->typed_data() + row * H);
        });
      }
    }
    ScatterRows(h.data(), chunk, H, h_n->typed_data());
    ScatterRows(c.data(), chunk, H, c_n->typed_data());
  });
}

ffi::Error LstmBwdImpl(ffi::ThreadPool pool,
                       F32 dh_seq, F32 dh_n, F32 dc_n, F32 acts, F32 c_seq, F32 c0, ffi::AnyBuffer w_hh,
                       ffi::Buffer<ffi::S32> seq_lengths, F32Result dgates, F32Result dh0, F32Result dc0,
                       int64_t reverse, int64_t /*bf16_gradients: always exact here*/) {
  RecurrenceShape s;
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(acts.dimensions(), 4, 4, &s));
  JAXDNN_RETURN_IF_ERROR(CheckRecurrenceOperands(
      s, w_hh, {dh_n.dimensions(), dc_n.dimensions(), c0.dimensions(), dh0->dimensions(), dc0->dimensions()},
      seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 1, {dh_seq.dimensions(), c_seq.dimensions()}));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 4, {dgates->dimensions()}));
  if (s.empty()) return ffi::Error::Success();
  const int64_t H = s.hidden, G = s.gates(), T = s.steps;
  std::fill_n(dgates->typed_data(), s.batch * s.directions * T * G, 0.f);
  return ForEachChunk(pool, w_hh, /*transpose=*/false, seq_lengths.typed_data(), s, reverse != 0,
                      [&](const RowChunk& chunk, const PackedWeights& w, RoundTeam& team) {
    const int64_t rows = int64_t(chunk.lens.size());
    std::vector<float> dh(rows * H), dc(rows * H), dg(rows * G);
    GatherRows(dh_n.typed_data(), chunk, H, dh.data());
    GatherRows(dc_n.typed_data(), chunk, H, dc.data());
    for (int64_t step = chunk.MaxSteps() - 1; step >= 0; --step) {
      for (int64_t r = 0; r < rows; ++r) {
        if (step >= chunk.lens[r]) continue;
        const int64_t row = chunk.At(r, step);
        const float* a = acts.typed_data() + row * G;
        const float* c = c_seq.typed_data() + row * H;
        const float* c_prev = step > 0 ? c_seq.typed_data() + chunk.At(r, step - 1) * H
                                       : c0.typed_data() + chunk.Pair(r) * H;
        const float* dy = dh_seq.typed_data() + row * H;
        float* out = dgates->typed_data() + row * G;
        float *dgr = dg.data() + r * G, *dhr = dh.data() + r * H, *dcr = dc.data() + r * H;
        for (int64_t j = 0; j < H; ++j) {
          float d_pre[4];
          dcr[j] = LstmCellGrad(LstmGates{a[j], a[H + j], a[2 * H + j], a[3 * H + j]}, c[j], c_prev[j],
                                dy[j] + dhr[j], dcr[j], d_pre);
          for (int q = 0; q < 4; ++q) out[q * H + j] = dgr[q * H + j] = d_pre[q];
        }
      }
      RunningRowProducts(team, w, dg.data(), G, chunk, step, dh.data(), H);
    }
    ScatterRows(dh.data(), chunk, H, dh0->typed_data());
    ScatterRows(dc.data(), chunk, H, dc0->typed_data());
  });
}

ffi::Error GruFwdImpl(ffi::ThreadPool pool,
                      F32 gates_x, ffi::AnyBuffer w_hh, F32 b_hh, F32 h0, ffi::Buffer<ffi::S32> seq_lengths,
                      F32Result h_seq, F32Result saved, F32Result h_n, int64_t reverse,
                      int64_t /*tf32*/, int64_t /*bf16_state: always exact here*/) {
  RecurrenceShape s;
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(gates_x.dimensions(), 3, 3, &s));
  JAXDNN_RETURN_IF_ERROR(
      CheckRecurrenceOperands(s, w_hh, {h0.dimensions(), h_n->dimensions()}, seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(ExpectShape("b_hh", b_hh.dimensions(), {s.directions, s.gates()}));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 1, {h_seq->dimensions()}));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 4, {saved->dimensions()}));
  if (s.empty()) return ffi::Error::Success();
  const int64_t H = s.hidden, G = s.gates(), T = s.steps, sequences = s.batch * s.directions * T;
  std::fill_n(h_seq->typed_data(), sequences * H, 0.f);
  std::fill_n(saved->typed_data(), sequences * 4 * H, 0.f);
  return ForEachChunk(pool, w_hh, /*transpose=*/true, seq_lengths.typed_data(), s, reverse != 0,
                      [&](const RowChunk& chunk, const PackedWeights& wt, RoundTeam& team) {
    const float* bias = b_hh.typed_data() + chunk.d * s.gates();
    const int64_t rows = int64_t(chunk.lens.size());
    std::vector<float> h(rows * H), hp(rows * G);
    GatherRows(h0.typed_data(), chunk, H, h.data());
    for (int64_t step = 0; step < chunk.MaxSteps(); ++step) {
      RunningRowProducts(team, wt, h.data(), H, chunk, step, hp.data(), G);
      for (int64_t r = 0; r < rows; ++r) {
        if (step >= chunk.lens[r]) continue;
        const int64_t row = chunk.At(r, step);
        CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
          GruCells(H, gates_x.typed_data() + row * G, hp.data() + r * G, bias, saved->typed_data() + row * 4 * H,
                   h.data() + r * H, h_seq->typed_data() + row * H);
        });
      }
    }
    ScatterRows(h.data(), chunk, H, h_n->typed_data());
  });
}

ffi::Error GruBwdImpl(ffi::ThreadPool pool,
                      F32 dh_seq, F32 dh_n, F32 saved, F32 h_seq, F32 h0, ffi::AnyBuffer w_hh,
                      ffi::Buffer<ffi::S32> seq_lengths, F32Result dgates_x, F32Result dgates_h, F32Result dh0,
                      int64_t reverse, int64_t /*bf16_gradients: always exact here*/) {
  RecurrenceShape s;
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(saved.dimensions(), 4, 3, &s));
  JAXDNN_RETURN_IF_ERROR(CheckRecurrenceOperands(s, w_hh, {dh_n.dimensions(), h0.dimensions(), dh0->dimensions()},
                                                 seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 1, {dh_seq.dimensions(), h_seq.dimensions()}));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 3, {dgates_x->dimensions(), dgates_h->dimensions()}));
  if (s.empty()) return ffi::Error::Success();
  const int64_t H = s.hidden, G = s.gates(), T = s.steps;
  std::fill_n(dgates_x->typed_data(), s.batch * s.directions * T * G, 0.f);
  std::fill_n(dgates_h->typed_data(), s.batch * s.directions * T * G, 0.f);
  return ForEachChunk(pool, w_hh, /*transpose=*/false, seq_lengths.typed_data(), s, reverse != 0,
                      [&](const RowChunk& chunk, const PackedWeights& w, RoundTeam& team) {
    const int64_t rows = int64_t(chunk.lens.size());
    std::vector<float> dh(rows * H), bypass(rows * H), dgh(rows * G);
    GatherRows(dh_n.typed_data(), chunk, H, dh.data());
    for (int64_t step = chunk.MaxSteps() - 1; step >= 0; --step) {
      for (int64_t r = 0; r < rows; ++r) {
        if (step >= chunk.lens[r]) continue;
        const int64_t row = chunk.At(r, step);
        const float* keep = saved.typed_data() + row * 4 * H;
        const float* h_prev = step > 0 ? h_seq.typed_data() + chunk.At(r, step - 1) * H
                                       : h0.typed_data() + chunk.Pair(r) * H;
        const float* dy = dh_seq.typed_data() + row * H;
        float* out_x = dgates_x->typed_data() + row * G;
        float* out_h = dgates_h->typed_data() + row * G;
        float *dgr = dgh.data() + r * G, *dhr = dh.data() + r * H;
        for (int64_t j = 0; j < H; ++j) {
          float d_x[3], d_h[3];
          bypass[r * H + j] = GruCellGrad(GruGates{keep[j], keep[H + j], keep[2 * H + j]}, keep[3 * H + j],
                                          h_prev[j], dy[j] + dhr[j], d_x, d_h);
          for (int q = 0; q < 3; ++q) out_x[q * H + j] = d_x[q], out_h[q * H + j] = dgr[q * H + j] = d_h[q];
        }
      }
      RunningRowProducts(team, w, dgh.data(), G, chunk, step, dh.data(), H);
      for (int64_t r = 0; r < rows; ++r) {
        if (step >= chunk.lens[r]) continue;
        for (int64_t j = 0; j < H; ++j) dh[r * H + j] += bypass[r * H + j];
      }
    }
    ScatterRows(dh.data(), chunk, H, dh0->typed_data());
  });
}

ffi::Error RnnFwdImpl(ffi::ThreadPool pool,
                      F32 gates_x, ffi::AnyBuffer w_hh, F32 h0, ffi::Buffer<ffi::S32> seq_lengths, F32Result h_seq,
                      F32Result h_n, int64_t reverse, std::string_view nonlinearity,
                      int64_t /*tf32*/, int64_t /*bf16_state: always exact here*/) {
  RecurrenceShape s;
  Activation act;
  JAXDNN_RETURN_IF_ERROR(DecodeNonlinearity(nonlinearity, &act));
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(gates_x.dimensions(), 1, 1, &s));
  JAXDNN_RETURN_IF_ERROR(
      CheckRecurrenceOperands(s, w_hh, {h0.dimensions(), h_n->dimensions()}, seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 1, {h_seq->dimensions()}));
  if (s.empty()) return ffi::Error::Success();
  const int64_t H = s.hidden, T = s.steps;
  std::fill_n(h_seq->typed_data(), s.batch * s.directions * T * H, 0.f);
  return ForEachChunk(pool, w_hh, /*transpose=*/true, seq_lengths.typed_data(), s, reverse != 0,
                      [&](const RowChunk& chunk, const PackedWeights& wt, RoundTeam& team) {
    const int64_t rows = int64_t(chunk.lens.size());
    std::vector<float> h(rows * H), pre(rows * H);
    GatherRows(h0.typed_data(), chunk, H, h.data());
    for (int64_t step = 0; step < chunk.MaxSteps(); ++step) {
      RunningRowProducts(team, wt, h.data(), H, chunk, step, pre.data(), H);
      for (int64_t r = 0; r < rows; ++r) {
        if (step >= chunk.lens[r]) continue;
        const int64_t row = chunk.At(r, step);
        const float* gx = gates_x.typed_data() + row * H;
        const float* p = pre.data() + r * H;
        float* hr = h.data() + r * H;
        float* hs = h_seq->typed_data() + row * H;
        CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
          for (int64_t j = 0; j < H; ++j) hr[j] = hs[j] = RnnActivate(act, gx[j] + p[j]);
        });
      }
    }
    ScatterRows(h.data(), chunk, H, h_n->typed_data());
  });
}

ffi::Error RnnBwdImpl(ffi::ThreadPool pool,
                      F32 dh_seq, F32 dh_n, F32 h_seq, ffi::AnyBuffer w_hh, ffi::Buffer<ffi::S32> seq_lengths,
                      F32Result dgates, F32Result dh0, int64_t reverse, std::string_view nonlinearity,
                      int64_t /*bf16_gradients: always exact here*/) {
  RecurrenceShape s;
  Activation act;
  JAXDNN_RETURN_IF_ERROR(DecodeNonlinearity(nonlinearity, &act));
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(h_seq.dimensions(), 1, 1, &s));
  JAXDNN_RETURN_IF_ERROR(
      CheckRecurrenceOperands(s, w_hh, {dh_n.dimensions(), dh0->dimensions()}, seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 1, {dh_seq.dimensions(), dgates->dimensions()}));
  if (s.empty()) return ffi::Error::Success();
  const int64_t H = s.hidden, T = s.steps;
  std::fill_n(dgates->typed_data(), s.batch * s.directions * T * H, 0.f);
  return ForEachChunk(pool, w_hh, /*transpose=*/false, seq_lengths.typed_data(), s, reverse != 0,
                      [&](const RowChunk& chunk, const PackedWeights& w, RoundTeam& team) {
    const int64_t rows = int64_t(chunk.lens.size());
    std::vector<float> dh(rows * H), dg(rows * H);
    GatherRows(dh_n.typed_data(), chunk, H, dh.data());
    for (int64_t step = chunk.MaxSteps() - 1; step >= 0; --step) {
      for (int64_t r = 0; r < rows; ++r) {
        if (step >= chunk.lens[r]) continue;
        const int64_t row = chunk.At(r, step);
        const float* h = h_seq.typed_data() + row * H;
        const float* dy = dh_seq.typed_data() + row * H;
        float* out = dgates->typed_data() + row * H;
        float *dgr = dg.data() + r * H, *dhr = dh.data() + r * H;
        for (int64_t j = 0; j < H; ++j) out[j] = dgr[j] = RnnCellGrad(act, h[j], dy[j] + dhr[j]);
      }
      RunningRowProducts(team, w, dg.data(), H, chunk, step, dh.data(), H);
    }
    ScatterRows(dh.data(), chunk, H, dh0->typed_data());
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(LstmFwdCpu, jaxdnn::LstmFwdImpl, jaxdnn::BindLstmFwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(LstmBwdCpu, jaxdnn::LstmBwdImpl, jaxdnn::BindLstmBwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GruFwdCpu, jaxdnn::GruFwdImpl, jaxdnn::BindGruFwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GruBwdCpu, jaxdnn::GruBwdImpl, jaxdnn::BindGruBwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RnnFwdCpu, jaxdnn::RnnFwdImpl, jaxdnn::BindRnnFwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RnnBwdCpu, jaxdnn::RnnBwdImpl, jaxdnn::BindRnnBwd(jaxdnn::BindWithThreadPool()));
