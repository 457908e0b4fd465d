// CPU attention: the CUDA kernels' decomposition (attention.cu), one tile at a time, in float32;
// the tiles spread over XLA's intra-op threads (each writes its own outputs, so the results do not
// depend on the threads).
//
// Forward: per (b, n, tile of kQueryRows queries), stream the keys the tile can reach in tiles
// of kKeyWidth: S = Q K^T, the logits and an online softmax per query row, O += P V.
// Backward: delta = rowsum(do * o); dq per (b, n, query tile) streaming keys: S = Q K^T,
// dP = dO V^T, dS = P (dP - delta) (and dbias there, each element written once), dQ += dS K; dk and
// dv per (b, kv head, tile of kKeyRows keys), streaming the queries of every head of the
// group: S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q.
// The products run on common/matmul_cpu.h's register tiles (operands packed into float strips, each
// sum in a fixed order: deterministic), compiled for the CPU's ISA (CallForIsa). The logits take the
// rules of attention_problem.h one at a time where a mask, segment ids, a bias, a soft cap or
// dropout is present; with the index rules alone (lengths, causal, window) a row's keys are one span
// and its logits, probabilities and gradients are vectorized loops.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention/attention.h"
#include "attention/attention_common.h"
#include "attention/attention_problem.h"
#include "common/cpu_isa.h"
#include "common/half_cpu.h"
#include "common/matmul_cpu.h"
#include "common/parallel_cpu.h"
#include "common/vector_cpu.h"

namespace jaxdnn {
namespace {

// The CPU's tiles: kQueryRows queries (forward, dq) stream the keys kKeyWidth at a time, kKeyRows
// keys (dk, dv) stream the queries kQueryWidth at a time. Larger than the CUDA kernels' tiles (16 x
// 32): each streamed tile is packed into float once for more rows, and the products are longer
// (2-core AVX-512 machine, B2 T128 S128 N4 H64 bf16 fwd+bwd: 2.1 ms with the CUDA kernels' tiles,
// 1.66 with 64 rows by 32, 1.60 with 64 by 64).
constexpr int kQueryRows = 64, kKeyWidth = 64, kKeyRows = 64, kQueryWidth = 64;

// Tiles of `tile` covering `length`.
inline int64_t TileCount(int64_t length, int64_t tile) { return (length + tile - 1) / tile; }

// The register tile of a build: kRows rows by kStrips FloatVectors. The tiles' rows (kQueryRows,
// kKeyRows) hold whole strips of rows, the streamed tiles (kKeyWidth, kQueryWidth) whole strips of
// columns.
template <typename IsaTagT>
struct Tiles {
  static constexpr CpuIsa kIsa = IsaTagT::value;
  static constexpr int kRows = kIsa == CpuIsa::kAvx512 ? 8 : (kIsa == CpuIsa::kAvx2 ? 4 : 2);
  static constexpr int kStrips = kIsa == CpuIsa::kAvx512 ? 2 : 1;
  static constexpr int kCols = kStrips * kStripCols;
  static_assert(kQueryRows % kRows == 0 && kKeyRows % kRows == 0, "row tiles hold whole strips");
  static_assert(kKeyWidth % kCols == 0 && kQueryWidth % kCols == 0, "column tiles hold whole strips");
};

// Element (r, c) of a [rows, depth] matrix packed as PackStrips' strips of kRows rows.
template <int kRows>
JAXDNN_ALWAYS_INLINE inline float& Packed(float* strips, int64_t depth, int64_t r, int64_t c) {
  return strips[(r / kRows) * depth * kRows + c * kRows + r % kRows];
}

// Whether the logits follow the index rules alone: no mask, segment ids, bias, soft cap or dropout.
bool IndexRulesOnly(const AttentionProblem& p) {
  return p.mask == nullptr && p.q_seg == nullptr && p.bias == nullptr && p.soft_cap == 0.f &&
         p.dropout_seed == nullptr;
}

// The keys [*lo, *hi) that query t of batch b attends by the index rules (Attends without its
// per-logit operands): the lengths, causality and the window.
inline void IndexSpan(const AttentionProblem& p, int64_t b, int64_t t, int64_t* lo, int64_t* hi) {
  int64_t first = p.window_left >= 0 ? std::max<int64_t>(0, t - p.window_left) : 0;
  int64_t last = t < p.QueryLimit(b) ? p.KeyLimit(b) : 0;
  if (p.causal) last = std::min(last, t + 1);
  if (p.window_right >= 0) last = std::min(last, t + p.window_right + 1);
  *lo = first;
  *hi = std::max(first, last);
}

// exp(logit - max), 0 for a dropped logit (or a row with no key: max -inf).
JAXDNN_ALWAYS_INLINE inline float ProbAbove(float logit, float max) {
  return logit == -INFINITY || max == -INFINITY ? 0.f : Exp(logit - max);
}

// Turns row[c] (q.k of query t and key s0 + c) into its logit, -inf where the query does not
// attend the key and for c >= cols, for c < width.
JAXDNN_ALWAYS_INLINE inline void RowLogits(const AttentionProblem& p, bool index_rules, int64_t b, int64_t n,
                                           int64_t t, int64_t s0, int64_t cols, int width, float* row) {
  if (index_rules) {
    int64_t lo, hi;
    IndexSpan(p, b, t, &lo, &hi);
    lo = std::clamp<int64_t>(lo - s0, 0, cols);
    hi = std::clamp<int64_t>(hi - s0, lo, cols);
    const float scale = p.scale;
    for (int c = 0; c < width; ++c) {
      const float logit = row[c] * scale;
      row[c] = (c >= lo) & (c < hi) ? logit : -INFINITY;  // no branch: the loop vectorizes
    }
    return;
  }
  for (int c = 0; c < width; ++c) {
    const int64_t s = s0 + c;
    row[c] = c < cols && p.Attends(b, n, t, s) ? p.Logit(row[c], b, n, t, s) : -INFINITY;
  }
}

// fn(isa, b, n, t0, rows) for every (batch, head, tile of kQueryRows queries from t0, `rows` of
// them), as items of ParallelFor, compiled for the active ISA (CallForIsa; fn is a lambda declared
// JAXDNN_ALWAYS_INLINE).
template <typename Fn>
void ForQueryTiles(ffi::ThreadPool& pool, const AttentionProblem& p, const Fn& fn) {
  const int64_t tiles = TileCount(p.q_len, kQueryRows);
  ParallelFor(pool, p.batch * p.heads * tiles, [&](int64_t item) {
    const int64_t b = item / (p.heads * tiles), n = item / tiles % p.heads, t0 = item % tiles * kQueryRows;
    const int64_t rows = std::min<int64_t>(kQueryRows, p.q_len - t0);
    CallForIsa([&](auto isa) JAXDNN_ALWAYS_INLINE { fn(isa, b, n, t0, rows); });
  });
}

template <typename T>
void AttentionFwd(ffi::ThreadPool& pool, const AttentionProblem& p, const T* q, const T* k, const T* v, T* o,
                  float* lse) {
  const int64_t h = p.head_dim, q_stride = p.heads * h, k_stride = p.kv_heads * h;
  const bool index_rules = IndexRulesOnly(p);
  ForQueryTiles(pool, p, [&](auto isa, int64_t b, int64_t n, int64_t t0, int64_t rows) JAXDNN_ALWAYS_INLINE {
    using Tile = Tiles<decltype(isa)>;
    constexpr int kRows = Tile::kRows, kStrips = Tile::kStrips, kWidth = kKeyWidth;
    const int64_t hp = RoundUp(h, Tile::kCols), kh = n / p.Group();
    auto [q_pack, k_pack, v_pack, acc, logits, p_pack] = ScratchBuffers(
        {kQueryRows * h, kWidth * h, kWidth * hp, kQueryRows * hp, kQueryRows * kWidth, kQueryRows * kWidth});
    std::fill_n(acc, kQueryRows * hp, 0.f);
    OnlineSoftmax softmax[kQueryRows];
    PackStrips<kRows>(q + p.QueryRow(b, t0, n), 1, q_stride, h, rows, q_pack);
    int64_t lo, hi;
    p.KeyRange(b, t0, t0 + rows, &lo, &hi);
    for (int64_t s0 = lo; s0 < hi; s0 += kWidth) {
      const int64_t cols = std::min<int64_t>(kWidth, hi - s0);
      const int width = int(RoundUp(cols, kVectorFloats));  // the columns the row loops take
      PackStrips<Tile::kCols>(k + p.KeyRow(b, s0, kh), 1, k_stride, h, cols, k_pack);  // K^T
      PackStrips<Tile::kCols>(v + p.KeyRow(b, s0, kh), k_stride, 1, cols, h, v_pack);  // V
      StripProducts<kRows, kStrips>(q_pack, rows, k_pack, cols, h, logits, kWidth, true);
      for (int64_t r = 0; r < RoundUp(rows, kRows); ++r) {
        float* row = &logits[r * kWidth];
        float probs[kWidth] = {};
        if (r < rows) {
          const int64_t t = t0 + r;
          RowLogits(p, index_rules, b, n, t, s0, cols, width, row);
          const float factor = softmax[r].Rescale(MaxOf(row, width));
          if (factor != 1.f) {
            for (int64_t i = 0; i < hp; ++i) acc[r * hp + i] *= factor;
          }
          const float max = softmax[r].max;
          for (int c = 0; c < width; ++c) probs[c] = ProbAbove(row[c], max);
          // The normalizer is undropped; 16 partial sums (SumOf), which vectorize.
          softmax[r].sum += float(SumOf(width, [&](int64_t c) JAXDNN_ALWAYS_INLINE { return probs[c]; }));
          if (!index_rules) {
            for (int c = 0; c < cols; ++c) probs[c] *= DropoutScale(p, b, n, t, s0 + c);
          }
        }
        for (int64_t c = 0; c < cols; ++c) Packed<kRows>(p_pack, cols, r, c) = probs[c];
      }
      StripProducts<kRows, kStrips>(p_pack, rows, v_pack, h, cols, acc, hp, false);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float inv_sum = softmax[r].InvSum();
      T* out = o + p.QueryRow(b, t0 + r, n);
      for (int64_t i = 0; i < h; ++i) out[i] = FromFloat<T>(acc[r * hp + i] * inv_sum);
      lse[p.StatIndex(b, n, t0 + r)] = softmax[r].LogSumExp();
    }
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

// The backward of one logit by the index rules alone: its probability exp(logit - lse) (0 where
// the query does not attend the key), and ds = P (dp - delta) (0 there too).
JAXDNN_ALWAYS_INLINE inline float IndexRulesDs(bool attends, float logit, float dp, float row_lse, float row_delta,
                                               float* prob) {
  *prob = attends & (row_lse != -INFINITY) ? Exp(logit - row_lse) : 0.f;
  return attends ? *prob * (dp - row_delta) : 0.f;
}

// The same by the per-logit rules, for an attended logit of (b, n, t, s): ds = P (dp * dropout -
// delta) into *ds, the kept probability P * dropout into *kept; returns the gradient of the dot
// (through the soft cap).
inline float RulesDotGrad(const AttentionProblem& p, float logit, float dp, float row_lse, float row_delta,
                          int64_t b, int64_t n, int64_t t, int64_t s, float* ds, float* kept) {
  const float prob = ProbFromLse(logit, row_lse), drop = DropoutScale(p, b, n, t, s);
  *ds = prob * (dp * drop - row_delta);
  *kept = prob * drop;
  return p.DotGrad(*ds, logit, b, n, t, s);
}

// dq (and dbias) per (b, n, query tile), streaming the keys the tile reaches.
template <typename T>
void AttentionBwdQuery(ffi::ThreadPool& pool, const AttentionProblem& p, const T* d_out, const T* q, const T* k,
                       const T* v, const float* lse, const float* delta, T* dq, float* dbias) {
  const int64_t h = p.head_dim, q_stride = p.heads * h, k_stride = p.kv_heads * h;
  const bool index_rules = IndexRulesOnly(p);
  ForQueryTiles(pool, p, [&](auto isa, int64_t b, int64_t n, int64_t t0, int64_t rows) JAXDNN_ALWAYS_INLINE {
    using Tile = Tiles<decltype(isa)>;
    constexpr int kRows = Tile::kRows, kStrips = Tile::kStrips, kWidth = kKeyWidth;
    const int64_t hp = RoundUp(h, Tile::kCols), kh = n / p.Group();
    auto [q_pack, do_pack, k_pack, v_pack, k_rows, acc, logits, dp, g_pack] = ScratchBuffers(
        {kQueryRows * h, kQueryRows * h, kWidth * h, kWidth * h, kWidth * hp, kQueryRows * hp, kQueryRows * kWidth,
         kQueryRows * kWidth, kQueryRows * kWidth});
    std::fill_n(acc, kQueryRows * hp, 0.f);
    PackStrips<kRows>(q + p.QueryRow(b, t0, n), 1, q_stride, h, rows, q_pack);
    PackStrips<kRows>(d_out + p.QueryRow(b, t0, n), 1, q_stride, h, rows, do_pack);
    int64_t lo, hi;
    p.KeyRange(b, t0, t0 + rows, &lo, &hi);
    for (int64_t s0 = lo; s0 < hi; s0 += kWidth) {
      const int64_t cols = std::min<int64_t>(kWidth, hi - s0);
      const int width = int(RoundUp(cols, kVectorFloats));  // the columns the row loops take
      PackStrips<Tile::kCols>(k + p.KeyRow(b, s0, kh), 1, k_stride, h, cols, k_pack);  // K^T
      PackStrips<Tile::kCols>(v + p.KeyRow(b, s0, kh), 1, k_stride, h, cols, v_pack);  // V^T
      PackStrips<Tile::kCols>(k + p.KeyRow(b, s0, kh), k_stride, 1, cols, h, k_rows);  // K
      StripProducts<kRows, kStrips>(q_pack, rows, k_pack, cols, h, logits, kWidth, true);
      StripProducts<kRows, kStrips>(do_pack, rows, v_pack, cols, h, dp, kWidth, true);
      for (int64_t r = 0; r < RoundUp(rows, kRows); ++r) {
        float g[kWidth] = {};
        if (r < rows) {
          const int64_t t = t0 + r;
          float* row = &logits[r * kWidth];
          RowLogits(p, index_rules, b, n, t, s0, cols, width, row);
          const float row_lse = lse[p.StatIndex(b, n, t)], row_delta = delta[p.StatIndex(b, n, t)];
          const float* dp_row = &dp[r * kWidth];
          float ds[kWidth] = {}, kept[kWidth];
          if (index_rules) {
            for (int c = 0; c < width; ++c) {
              ds[c] = IndexRulesDs(row[c] != -INFINITY, row[c], dp_row[c], row_lse, row_delta, &kept[c]);
              g[c] = ds[c] * p.scale;
            }
          } else {
            for (int c = 0; c < cols; ++c) {
              if (row[c] == -INFINITY) continue;  // not attended
              g[c] = RulesDotGrad(p, row[c], dp_row[c], row_lse, row_delta, b, n, t, s0 + c, &ds[c], &kept[c]);
            }
          }
          if (dbias != nullptr) {
            float* out = dbias + p.StatIndex(b, n, t) * p.kv_len + s0;
            for (int64_t c = 0; c < cols; ++c) out[c] = ds[c];
          }
        }
        for (int64_t c = 0; c < cols; ++c) Packed<kRows>(g_pack, cols, r, c) = g[c];
      }
      StripProducts<kRows, kStrips>(g_pack, rows, k_rows, h, cols, acc, hp, false);
    }
    for (int64_t r = 0; r < rows; ++r) {
      T* out = dq + p.QueryRow(b, t0 + r, n);
      for (int64_t i = 0; i < h; ++i) out[i] = FromFloat<T>(acc[r * hp + i]);
    }
  });
}

// dk and dv per (b, kv head, key tile), streaming the queries of every head of the group.
template <typename T>
void AttentionBwdKey(ffi::ThreadPool& pool, const AttentionProblem& p, const T* d_out, const T* q, const T* k,
                     const T* v, const float* lse, const float* delta, T* dk, T* dv) {
  const int64_t h = p.head_dim, group = p.Group(), tiles = TileCount(p.kv_len, kKeyRows);
  const int64_t q_stride = p.heads * h, k_stride = p.kv_heads * h;
  const bool index_rules = IndexRulesOnly(p);
  ParallelFor(pool, p.batch * p.kv_heads * tiles, [&](int64_t item) {
    const int64_t b = item / (p.kv_heads * tiles), kh = item / tiles % p.kv_heads;
    const int64_t s0 = item % tiles * kKeyRows;
    CallForIsa([&](auto isa) JAXDNN_ALWAYS_INLINE {
      using Tile = Tiles<decltype(isa)>;
      constexpr int kRows = Tile::kRows, kStrips = Tile::kStrips, kWidth = kQueryWidth;
      const int64_t hp = RoundUp(h, Tile::kCols);
      const int64_t keys = std::min<int64_t>(kKeyRows, p.kv_len - s0);
      auto [k_pack, v_pack, q_pack, do_pack, q_rows, do_rows, dk_acc, dv_acc, dots, dp, g_pack, p_pack] =
          ScratchBuffers({kKeyRows * h, kKeyRows * h, kWidth * h, kWidth * h, kWidth * hp, kWidth * hp,
                          kKeyRows * hp, kKeyRows * hp, kKeyRows * kWidth, kKeyRows * kWidth, kKeyRows * kWidth,
                          kKeyRows * kWidth});
      std::fill_n(dk_acc, kKeyRows * hp, 0.f);
      std::fill_n(dv_acc, kKeyRows * hp, 0.f);
      PackStrips<kRows>(k + p.KeyRow(b, s0, kh), 1, k_stride, h, keys, k_pack);
      PackStrips<kRows>(v + p.KeyRow(b, s0, kh), 1, k_stride, h, keys, v_pack);
      int64_t lo, hi;
      p.QueryRange(b, s0, s0 + keys, &lo, &hi);
      for (int64_t n = kh * group; n < (kh + 1) * group; ++n) {
        for (int64_t t0 = lo; t0 < hi; t0 += kWidth) {
          const int64_t cols = std::min<int64_t>(kWidth, hi - t0);
          const int width = int(RoundUp(cols, kVectorFloats));  // the columns the row loops take
          const T* q_first = q + p.QueryRow(b, t0, n);
          const T* do_first = d_out + p.QueryRow(b, t0, n);
          PackStrips<Tile::kCols>(q_first, 1, q_stride, h, cols, q_pack);     // Q^T
          PackStrips<Tile::kCols>(do_first, 1, q_stride, h, cols, do_pack);   // dO^T
          PackStrips<Tile::kCols>(q_first, q_stride, 1, cols, h, q_rows);     // Q
          PackStrips<Tile::kCols>(do_first, q_stride, 1, cols, h, do_rows);   // dO
          StripProducts<kRows, kStrips>(k_pack, keys, q_pack, cols, h, dots, kWidth, true);
          StripProducts<kRows, kStrips>(v_pack, keys, do_pack, cols, h, dp, kWidth, true);
          // Each query's span of the tile's keys by the index rules (as key indices c, 32-bit so that
          // the loops over the queries vectorize) and its statistics, once for every key of the tile.
          int32_t span_lo[kWidth], span_hi[kWidth];
          float row_lse[kWidth], row_delta[kWidth];
          for (int r = 0; r < kWidth; ++r) {
            const int64_t t = t0 + std::min<int64_t>(r, cols - 1);
            int64_t first, last;
            IndexSpan(p, b, t, &first, &last);
            span_lo[r] = int32_t(std::clamp<int64_t>(first - s0, 0, keys));
            span_hi[r] = r < cols ? int32_t(std::clamp<int64_t>(last - s0, span_lo[r], keys)) : span_lo[r];
            row_lse[r] = lse[p.StatIndex(b, n, t)];
            row_delta[r] = delta[p.StatIndex(b, n, t)];
          }
          for (int64_t c = 0; c < RoundUp(keys, kRows); ++c) {
            float g[kWidth] = {}, kept[kWidth] = {};
            if (c < keys) {
              const int64_t s = s0 + c;
              const float* dot = &dots[c * kWidth];
              const float* dp_row = &dp[c * kWidth];
              float ds;
              if (index_rules) {
                const int32_t key = int32_t(c);
                for (int r = 0; r < width; ++r) {
                  const bool attends = (key >= span_lo[r]) & (key < span_hi[r]);
                  g[r] = IndexRulesDs(attends, dot[r] * p.scale, dp_row[r], row_lse[r], row_delta[r], &kept[r]) *
                         p.scale;
                }
              } else {
                for (int r = 0; r < cols; ++r) {
                  const int64_t t = t0 + r;
                  if (!p.Attends(b, n, t, s)) continue;
                  g[r] = RulesDotGrad(p, p.Logit(dot[r], b, n, t, s), dp_row[r], row_lse[r], row_delta[r], b, n, t, s,
                                      &ds, &kept[r]);
                }
              }
            }
            for (int64_t r = 0; r < cols; ++r) {
              Packed<kRows>(g_pack, cols, c, r) = g[r];
              Packed<kRows>(p_pack, cols, c, r) = kept[r];
            }
          }
          StripProducts<kRows, kStrips>(p_pack, keys, do_rows, h, cols, dv_acc, hp, false);
          StripProducts<kRows, kStrips>(g_pack, keys, q_rows, h, cols, dk_acc, hp, false);
        }
      }
      for (int64_t c = 0; c < keys; ++c) {
        T* dk_out = dk + p.KeyRow(b, s0 + c, kh);
        T* dv_out = dv + p.KeyRow(b, s0 + c, kh);
        for (int64_t i = 0; i < h; ++i) {
          dk_out[i] = FromFloat<T>(dk_acc[c * hp + i]);
          dv_out[i] = FromFloat<T>(dv_acc[c * hp + i]);
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
                            int64_t dropout_keep, int64_t dropout_heads) {
  AttentionProblem p;
  JAXDNN_RETURN_IF_ERROR(MakeAttentionProblem(
      {&q, &k, &v, &bias, &mask, &q_lens, &kv_lens, &q_seg, &kv_seg, &dropout_seed, scale, soft_cap, causal,
       window_left, window_right, present, dropout_keep, dropout_heads}, &p));
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
                            int64_t present, int64_t dropout_keep, int64_t dropout_heads,
                            int64_t bias_grad) {
  AttentionProblem p;
  JAXDNN_RETURN_IF_ERROR(MakeAttentionProblem(
      {&q, &k, &v, &bias, &mask, &q_lens, &kv_lens, &q_seg, &kv_seg, &dropout_seed, scale, soft_cap, causal,
       window_left, window_right, present, dropout_keep, dropout_heads}, &p));
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
