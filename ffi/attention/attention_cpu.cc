// CPU attention: the CUDA kernels' decomposition (attention.cu), one tile at a time, in float32;
// the tiles spread over XLA's intra-op threads (each writes its own outputs, so the results do not
// depend on the threads), their loops compiled for AVX2/FMA where the CPU has it (CallVectorized).
//
// Forward: per (b, n, tile of kAttnQueryTile queries), stream the keys the tile can reach in tiles
// of kAttnKeyTile, with an online softmax per query row; memory: one tile of q, k, v in float32.
// Backward: delta = rowsum(do * o); dq per (b, n, query tile) streaming keys (and dbias there, each
// element written once); dk and dv per (b, kv head, tile of kAttnBwdKeyTile keys), streaming the
// queries of every head of the group. Every sum runs in a fixed order: deterministic.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention/attention.h"
#include "attention/attention_common.h"
#include "attention/attention_problem.h"
#include "common/cpu_isa.h"
#include "common/half_cpu.h"
#include "common/parallel_cpu.h"

namespace jaxdnn {
namespace {

// Tiles of `tile` covering `length`.
inline int64_t TileCount(int64_t length, int64_t tile) { return (length + tile - 1) / tile; }

// Reads H values of one row as float32.
template <typename T>
JAXDNN_ALWAYS_INLINE inline void LoadRow(const T* x, int64_t h, float* out) {
  for (int64_t i = 0; i < h; ++i) out[i] = ToFloat(x[i]);
}

// A tile of up to kWidth rows of H values, kept twice: row-major [kWidth][H] (rows scaled into an
// accumulator) and transposed [H][kWidth] (a row times the tile, vectorized over the tile's rows,
// as the CUDA kernels spread them over lanes). Rows past `rows` are zero.
template <int kWidth>
struct Tile {
  std::vector<float> rows_major, transposed;
  explicit Tile(int64_t h) : rows_major(kWidth * h), transposed(kWidth * h) {}

  template <typename T, typename RowPointer>
  JAXDNN_ALWAYS_INLINE void Load(int64_t rows, int64_t h, RowPointer row_pointer) {
    std::fill(transposed.begin(), transposed.end(), 0.f);
    for (int64_t r = 0; r < rows; ++r) {
      const T* x = row_pointer(r);
      for (int64_t i = 0; i < h; ++i) {
        const float value = ToFloat(x[i]);
        rows_major[r * h + i] = value;
        transposed[i * kWidth + r] = value;
      }
    }
  }
  const float* Row(int64_t r, int64_t h) const { return &rows_major[r * h]; }

  // out[c] = row . (tile row c) for every c < kWidth, summed over H in order (as the CUDA kernels).
  JAXDNN_ALWAYS_INLINE void Dots(const float* row, int64_t h, float* out) const {
    float sums[kWidth] = {};  // local, so they stay in registers (out might alias the tile)
    const float* column = transposed.data();
    for (int64_t i = 0; i < h; ++i, column += kWidth) {
      const float x = row[i];
      for (int c = 0; c < kWidth; ++c) sums[c] += x * column[c];
    }
    for (int c = 0; c < kWidth; ++c) out[c] = sums[c];
  }
};

template <typename T>
void AttentionFwd(ffi::ThreadPool& pool, const AttentionProblem& p, const T* q, const T* k, const T* v, T* o,
                  float* lse) {
  const int64_t h = p.head_dim, tiles = TileCount(p.q_len, kAttnQueryTile);
  ParallelFor(pool, p.batch * p.heads * tiles, [&](int64_t item) {
    const int64_t b = item / (p.heads * tiles), n = item / tiles % p.heads, t0 = item % tiles * kAttnQueryTile;
    std::vector<float> q_tile(kAttnQueryTile * h), acc(kAttnQueryTile * h, 0.f);
    Tile<kAttnKeyTile> k_tile(h), v_tile(h);
    float dots[kAttnKeyTile], logits[kAttnKeyTile];
    CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
      const int64_t kh = n / p.Group();
      const int64_t rows = std::min<int64_t>(kAttnQueryTile, p.q_len - t0);
      OnlineSoftmax softmax[kAttnQueryTile];
      for (int64_t r = 0; r < rows; ++r) LoadRow(q + p.QueryRow(b, t0 + r, n), h, &q_tile[r * h]);
      int64_t lo, hi;
      p.KeyRange(b, t0, t0 + rows, &lo, &hi);
      for (int64_t s0 = lo; s0 < hi; s0 += kAttnKeyTile) {
        const int64_t cols = std::min<int64_t>(kAttnKeyTile, hi - s0);
        auto key_row = [&](int64_t c) { return k + p.KeyRow(b, s0 + c, kh); };
        auto value_row = [&](int64_t c) { return v + p.KeyRow(b, s0 + c, kh); };
        k_tile.Load<T>(cols, h, key_row);
        v_tile.Load<T>(cols, h, value_row);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t t = t0 + r;
          k_tile.Dots(&q_tile[r * h], h, dots);
          float tile_max = -INFINITY;
          for (int64_t c = 0; c < cols; ++c) {
            const int64_t s = s0 + c;
            logits[c] = p.Attends(b, n, t, s) ? p.Logit(dots[c], b, n, t, s) : -INFINITY;
            tile_max = std::max(tile_max, logits[c]);
          }
          const float factor = softmax[r].Rescale(tile_max);
          if (softmax[r].max == -INFINITY) continue;
          float* a = &acc[r * h];
          if (factor != 1.f) {
            for (int64_t i = 0; i < h; ++i) a[i] *= factor;
          }
          for (int64_t c = 0; c < cols; ++c) {
            const float prob = softmax[r].Prob(logits[c]);
            softmax[r].sum += prob;  // the normalizer is undropped
            const float kept = prob * DropoutScale(p, b, n, t, s0 + c);
            const float* vr = v_tile.Row(c, h);
            for (int64_t i = 0; i < h; ++i) a[i] += kept * vr[i];
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv_sum = softmax[r].InvSum();
        T* out = o + p.QueryRow(b, t0 + r, n);
        for (int64_t i = 0; i < h; ++i) out[i] = FromFloat<T>(acc[r * h + i] * inv_sum);
        lse[p.StatIndex(b, n, t0 + r)] = softmax[r].LogSumExp();
      }
    });
  });
}

// delta[b, n, t] = sum over H of do * o.
template <typename T>
void AttentionDelta(const AttentionProblem& p, const T* d_out, const T* o, float* delta) {
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t t = 0; t < p.q_len; ++t) {
      for (int64_t n = 0; n < p.heads; ++n) {
        const int64_t row = p.QueryRow(b, t, n);
        float sum = 0.f;
        for (int64_t i = 0; i < p.head_dim; ++i) sum += ToFloat(d_out[row + i]) * ToFloat(o[row + i]);
        delta[p.StatIndex(b, n, t)] = sum;
      }
    }
  }
}

// dq (and dbias) per (b, n, query tile), streaming the keys the tile reaches.
template <typename T>
void AttentionBwdQuery(ffi::ThreadPool& pool, const AttentionProblem& p, const T* d_out, const T* q, const T* k,
                       const T* v, const float* lse, const float* delta, T* dq, float* dbias) {
  const int64_t h = p.head_dim, tiles = TileCount(p.q_len, kAttnQueryTile);
  ParallelFor(pool, p.batch * p.heads * tiles, [&](int64_t item) {
    const int64_t b = item / (p.heads * tiles), n = item / tiles % p.heads, t0 = item % tiles * kAttnQueryTile;
    std::vector<float> q_tile(kAttnQueryTile * h), do_tile(kAttnQueryTile * h), acc(kAttnQueryTile * h, 0.f);
    Tile<kAttnKeyTile> k_tile(h), v_tile(h);
    float dots[kAttnKeyTile], dp[kAttnKeyTile];
    CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
      const int64_t kh = n / p.Group();
      const int64_t rows = std::min<int64_t>(kAttnQueryTile, p.q_len - t0);
      for (int64_t r = 0; r < rows; ++r) {
        LoadRow(q + p.QueryRow(b, t0 + r, n), h, &q_tile[r * h]);
        LoadRow(d_out + p.QueryRow(b, t0 + r, n), h, &do_tile[r * h]);
      }
      int64_t lo, hi;
      p.KeyRange(b, t0, t0 + rows, &lo, &hi);
      for (int64_t s0 = lo; s0 < hi; s0 += kAttnKeyTile) {
        const int64_t cols = std::min<int64_t>(kAttnKeyTile, hi - s0);
        k_tile.Load<T>(cols, h, [&](int64_t c) { return k + p.KeyRow(b, s0 + c, kh); });
        v_tile.Load<T>(cols, h, [&](int64_t c) { return v + p.KeyRow(b, s0 + c, kh); });
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t t = t0 + r;
          const float row_lse = lse[p.StatIndex(b, n, t)], row_delta = delta[p.StatIndex(b, n, t)];
          k_tile.Dots(&q_tile[r * h], h, dots);
          v_tile.Dots(&do_tile[r * h], h, dp);
          float* a = &acc[r * h];
          for (int64_t c = 0; c < cols; ++c) {
            const int64_t s = s0 + c;
            float ds = 0.f, logit = 0.f;
            if (p.Attends(b, n, t, s)) {
              logit = p.Logit(dots[c], b, n, t, s);
              ds = ProbFromLse(logit, row_lse) * (dp[c] * DropoutScale(p, b, n, t, s) - row_delta);
            }
            if (dbias != nullptr) dbias[p.StatIndex(b, n, t) * p.kv_len + s] = ds;
            if (ds == 0.f) continue;
            const float g = p.DotGrad(ds, logit, b, n, t, s);
            const float* kr = k_tile.Row(c, h);
            for (int64_t i = 0; i < h; ++i) a[i] += g * kr[i];
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* out = dq + p.QueryRow(b, t0 + r, n);
        for (int64_t i = 0; i < h; ++i) out[i] = FromFloat<T>(acc[r * h + i]);
      }
    });
  });
}

// dk and dv per (b, kv head, key tile), streaming the queries of every head of the group.
template <typename T>
void AttentionBwdKey(ffi::ThreadPool& pool, const AttentionProblem& p, const T* d_out, const T* q, const T* k,
                     const T* v, const float* lse, const float* delta, T* dk, T* dv) {
  const int64_t h = p.head_dim, group = p.Group(), tiles = TileCount(p.kv_len, kAttnBwdKeyTile);
  ParallelFor(pool, p.batch * p.kv_heads * tiles, [&](int64_t item) {
    const int64_t b = item / (p.kv_heads * tiles), kh = item / tiles % p.kv_heads;
    const int64_t s0 = item % tiles * kAttnBwdKeyTile;
    std::vector<float> k_tile(kAttnBwdKeyTile * h), v_tile(kAttnBwdKeyTile * h);
    std::vector<float> dk_acc(kAttnBwdKeyTile * h, 0.f), dv_acc(kAttnBwdKeyTile * h, 0.f);
    Tile<kAttnBwdQueryTile> q_tile(h), do_tile(h);
    float dots[kAttnBwdQueryTile], dp[kAttnBwdQueryTile];
    CallVectorized([&]() JAXDNN_ALWAYS_INLINE {
      const int64_t cols = std::min<int64_t>(kAttnBwdKeyTile, p.kv_len - s0);
      for (int64_t c = 0; c < cols; ++c) {
        LoadRow(k + p.KeyRow(b, s0 + c, kh), h, &k_tile[c * h]);
        LoadRow(v + p.KeyRow(b, s0 + c, kh), h, &v_tile[c * h]);
      }
      int64_t lo, hi;
      p.QueryRange(b, s0, s0 + cols, &lo, &hi);
      for (int64_t n = kh * group; n < (kh + 1) * group; ++n) {
        for (int64_t t0 = lo; t0 < hi; t0 += kAttnBwdQueryTile) {
          const int64_t rows = std::min<int64_t>(kAttnBwdQueryTile, hi - t0);
          q_tile.Load<T>(rows, h, [&](int64_t r) { return q + p.QueryRow(b, t0 + r, n); });
          do_tile.Load<T>(rows, h, [&](int64_t r) { return d_out + p.QueryRow(b, t0 + r, n); });
          for (int64_t c = 0; c < cols; ++c) {
            const int64_t s = s0 + c;
            q_tile.Dots(&k_tile[c * h], h, dots);
            do_tile.Dots(&v_tile[c * h], h, dp);
            float* dk_row = &dk_acc[c * h];
            float* dv_row = &dv_acc[c * h];
            for (int64_t r = 0; r < rows; ++r) {
              const int64_t t = t0 + r;
              if (!p.Attends(b, n, t, s)) continue;
              const float logit = p.Logit(dots[r], b, n, t, s);
              const float prob = ProbFromLse(logit, lse[p.StatIndex(b, n, t)]);
              if (prob == 0.f) continue;
              const float drop = DropoutScale(p, b, n, t, s);
              const float ds = prob * (dp[r] * drop - delta[p.StatIndex(b, n, t)]);
              const float g = p.DotGrad(ds, logit, b, n, t, s);
              const float kept = prob * drop;
              const float* qr = q_tile.Row(r, h);
              const float* dor = do_tile.Row(r, h);
              for (int64_t i = 0; i < h; ++i) {
                dv_row[i] += kept * dor[i];
                dk_row[i] += g * qr[i];
              }
            }
          }
        }
      }
      for (int64_t c = 0; c < cols; ++c) {
        T* dk_out = dk + p.KeyRow(b, s0 + c, kh);
        T* dv_out = dv + p.KeyRow(b, s0 + c, kh);
        for (int64_t i = 0; i < h; ++i) {
          dk_out[i] = FromFloat<T>(dk_acc[c * h + i]);
          dv_out[i] = FromFloat<T>(dv_acc[c * h + i]);
        }
      }
    });
  });
}

ffi::Error AttentionFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::F32> bias,
                            ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_lens,
                            ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_seg,
                            ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::U32> dropout_seed,
                            ffi::Result<ffi::AnyBuffer> o,
                            ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale, float soft_cap,
                            int64_t causal, int64_t window_left, int64_t window_right, int64_t present,
                            int64_t dropout_keep) {
  AttentionProblem p;
  JAXDNN_RETURN_IF_ERROR(MakeAttentionProblem(
      {&q, &k, &v, &bias, &mask, &q_lens, &kv_lens, &q_seg, &kv_seg, &dropout_seed, scale, soft_cap, causal,
       window_left, window_right, present, dropout_keep}, &p));
  JAXDNN_RETURN_IF_ERROR(ExpectLike("o", *o, q));
  JAXDNN_RETURN_IF_ERROR(ExpectStat("lse", lse->dimensions(), p));
  if (ElementCount(q.dimensions()) == 0) return ffi::Error::Success();
  return DispatchFloat<float, Bf16, Half>(q.element_type(), "q", [&](auto tag) {
    using T = decltype(tag);
    AttentionFwd<T>(pool, p, static_cast<const T*>(q.untyped_data()), static_cast<const T*>(k.untyped_data()),
                    static_cast<const T*>(v.untyped_data()), static_cast<T*>(o->untyped_data()),
                    lse->typed_data());
    return ffi::Error::Success();
  });
}

ffi::Error AttentionBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer d_out, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> bias,
                            ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_lens,
                            ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_seg,
                            ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::U32> dropout_seed,
                            ffi::Result<ffi::AnyBuffer> dq,
                            ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                            ffi::Result<ffi::Buffer<ffi::F32>> dbias, ffi::Result<ffi::Buffer<ffi::F32>> delta,
                            ffi::Result<ffi::Buffer<ffi::F32>> /*dq_accum: CUDA only*/,
                            ffi::Result<ffi::Buffer<ffi::S32>> /*semaphores: CUDA only*/, float scale,
                            float soft_cap, int64_t causal, int64_t window_left, int64_t window_right,
                            int64_t present, int64_t dropout_keep, int64_t bias_grad) {
  AttentionProblem p;
  JAXDNN_RETURN_IF_ERROR(MakeAttentionProblem(
      {&q, &k, &v, &bias, &mask, &q_lens, &kv_lens, &q_seg, &kv_seg, &dropout_seed, scale, soft_cap, causal,
       window_left, window_right, present, dropout_keep}, &p));
  JAXDNN_RETURN_IF_ERROR(CheckAttentionBwd(p, d_out, q, k, o, lse.dimensions(), *dq, *dk, *dv, dbias->dimensions(),
                                           delta->dimensions(), bias_grad));
  if (dbias->element_count() > 0) std::memset(dbias->typed_data(), 0, dbias->size_bytes());
  return DispatchFloat<float, Bf16, Half>(q.element_type(), "q", [&](auto tag) {
    using T = decltype(tag);
    auto in = [](const ffi::AnyBuffer& x) { return static_cast<const T*>(x.untyped_data()); };
    auto out = [](ffi::Result<ffi::AnyBuffer>& x) { return static_cast<T*>(x->untyped_data()); };
    // dk and dv are written for every key (0 where no query attends); dq for every query row.
    AttentionDelta<T>(p, in(d_out), in(o), delta->typed_data());
    AttentionBwdQuery<T>(pool, p, in(d_out), in(q), in(k), in(v), lse.typed_data(), delta->typed_data(), out(dq),
                         bias_grad != 0 ? dbias->typed_data() : nullptr);
    AttentionBwdKey<T>(pool, p, in(d_out), in(q), in(k), in(v), lse.typed_data(), delta->typed_data(), out(dk),
                       out(dv));
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionFwdCpu, jaxdnn::AttentionFwdImpl,
                              jaxdnn::BindAttentionFwd(jaxdnn::BindWithThreadPool()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionBwdCpu, jaxdnn::AttentionBwdImpl,
                              jaxdnn::BindAttentionBwd(jaxdnn::BindWithThreadPool()));
