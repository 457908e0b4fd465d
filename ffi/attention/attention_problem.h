// The attention problem as the kernels see it, and the per-logit rules shared by the CPU kernels
// (compiled as host code) and the CUDA kernels (device code): which (query, key) pairs take part,
// the range of keys a tile of queries can reach (and of queries a tile of keys), the logit itself
// and its derivative, and the online-softmax update. The CPU tests thereby exercise the CUDA
// kernels' own masking, block skipping and softmax arithmetic.
//
// Layout (see attention.h): q, o [B, T, N, H]; k, v [B, S, K, H]; lse, delta [B, N, T].
#pragma once

#include <cmath>
#include <cstdint>

#include "common/activation.h"

#ifdef __CUDACC__
#define JAXDNN_ATTN_HD __host__ __device__ __forceinline__
#else
#define JAXDNN_ATTN_HD inline
#endif

namespace jaxdnn {

// Which optional operands are real (the `present` attribute).
enum AttentionOperand : int64_t {
  kAttentionBias = 1,
  kAttentionMask = 2,
  kAttentionQueryLengths = 4,
  kAttentionKeyLengths = 8,
  kAttentionQuerySegments = 16,
  kAttentionKeySegments = 32,
  kAttentionDropout = 64,
};

// dropout_keep of "keep every probability" (the hash is 24 bits).
constexpr int64_t kAttnKeepAll = int64_t(1) << 24;

// A 32-bit integer finalizer (xorshift-multiply; every input bit affects every output bit).
JAXDNN_ATTN_HD uint32_t MixBits(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0x735a2d97u;
  x ^= x >> 15;
  return x;
}

// Query rows per tile of the forward and dQ kernels, and keys per tile they stream through; keys
// per tile of the dK/dV kernel and queries per tile it streams. The CPU kernels use the same tiles.
constexpr int kAttnQueryTile = 16;
constexpr int kAttnKeyTile = 32;
constexpr int kAttnBwdKeyTile = 16;
constexpr int kAttnBwdQueryTile = 32;

struct AttentionProblem {
  int64_t batch = 0, q_len = 0, kv_len = 0;       // B, T, S
  int64_t heads = 0, kv_heads = 0, head_dim = 0;  // N, K, H
  float scale = 1.f;
  float soft_cap = 0.f;  // 0: no soft cap
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // -1: unbounded
  const float* bias = nullptr;
  int64_t bias_stride[4] = {0, 0, 0, 0};  // elements per step of b, n, t, s (0 on broadcast axes)
  const bool* mask = nullptr;
  int64_t mask_stride[4] = {0, 0, 0, 0};
  const int32_t* q_lens = nullptr;
  const int32_t* kv_lens = nullptr;
  const int32_t* q_seg = nullptr;   // [B, T]
  const int32_t* kv_seg = nullptr;  // [B, S]
  const uint32_t* dropout_seed = nullptr;  // [B, 2]
  uint32_t dropout_keep = uint32_t(kAttnKeepAll);
  uint32_t dropout_head_mask = ~0u;  // 0: the heads share one mask (the hash sees head 0)

  JAXDNN_ATTN_HD int64_t Group() const { return heads / kv_heads; }
  // Offsets of row (b, t, n) of q/o/do and of row (b, s, kh) of k/v, in elements.
  JAXDNN_ATTN_HD int64_t QueryRow(int64_t b, int64_t t, int64_t n) const {
    return ((b * q_len + t) * heads + n) * head_dim;
  }
  JAXDNN_ATTN_HD int64_t KeyRow(int64_t b, int64_t s, int64_t kh) const {
    return ((b * kv_len + s) * kv_heads + kh) * head_dim;
  }
  JAXDNN_ATTN_HD int64_t StatIndex(int64_t b, int64_t n, int64_t t) const { return (b * heads + n) * q_len + t; }

  // The valid queries [0, QueryLimit) and keys [0, KeyLimit) of batch b (the sequence lengths).
  JAXDNN_ATTN_HD int64_t QueryLimit(int64_t b) const {
    if (q_lens == nullptr) return q_len;
    const int64_t len = q_lens[b];
    return len < 0 ? 0 : (len < q_len ? len : q_len);
  }
  JAXDNN_ATTN_HD int64_t KeyLimit(int64_t b) const {
    if (kv_lens == nullptr) return kv_len;
    const int64_t len = kv_lens[b];
    return len < 0 ? 0 : (len < kv_len ? len : kv_len);
  }

  // The keys [*lo, *hi) that some query of [t_begin, t_end) may attend (causal/window/length block
  // skipping); empty when *lo >= *hi.
  JAXDNN_ATTN_HD void KeyRange(int64_t b, int64_t t_begin, int64_t t_end, int64_t* lo, int64_t* hi) const {
    int64_t first = 0, last = KeyLimit(b);  // [first, last)
    if (causal && t_end < last) last = t_end;
    if (window_right >= 0 && t_end + window_right < last) last = t_end + window_right;
    if (window_left >= 0 && t_begin - window_left > first) first = t_begin - window_left;
    *lo = first;
    *hi = last;
  }

  // The queries [*lo, *hi) that may attend some key of [s_begin, s_end).
  JAXDNN_ATTN_HD void QueryRange(int64_t b, int64_t s_begin, int64_t s_end, int64_t* lo, int64_t* hi) const {
    int64_t first = 0, last = QueryLimit(b);
    if (causal && s_begin > first) first = s_begin;
    if (window_right >= 0 && s_begin - window_right > first) first = s_begin - window_right;
    if (window_left >= 0 && s_end + window_left < last) last = s_end + window_left;
    *lo = first;
    *hi = last;
  }

  // Whether query t of head n attends key s (batch b).
  JAXDNN_ATTN_HD bool Attends(int64_t b, int64_t n, int64_t t, int64_t s) const {
    if (t >= QueryLimit(b) || s >= KeyLimit(b)) return false;
    if (causal && s > t) return false;
    if (window_left >= 0 && s < t - window_left) return false;
    if (window_right >= 0 && s > t + window_right) return false;
    if (mask != nullptr &&
        !mask[b * mask_stride[0] + n * mask_stride[1] + t * mask_stride[2] + s * mask_stride[3]]) {
      return false;
    }
    if (q_seg != nullptr && q_seg[b * q_len + t] != kv_seg[b * kv_len + s]) return false;
    return true;
  }

  // The logit of (b, n, t, s) from the dot product q.k: scale, soft cap, then bias. The cap's tanh
  // is libdevice's when kPrecise (Tanh of common/activation.h: the float32 kernels'); otherwise
  // tanhf, which the build's --use_fast_math makes the tanh.approx instruction, whose relative
  // error of up to 1e-5 is below the 16-bit kernels' rounding but had taken a float32 decoding
  // forward with a soft cap to 1.03e-5 against the tests' 1e-5.
  template <bool kPrecise = false>
  JAXDNN_ATTN_HD float Logit(float dot, int64_t b, int64_t n, int64_t t, int64_t s) const {
    float logit = dot * scale;
    if (soft_cap > 0.f) logit = soft_cap * (kPrecise ? Tanh(logit / soft_cap) : tanhf(logit / soft_cap));
    if (bias != nullptr) {
      logit += bias[b * bias_stride[0] + n * bias_stride[1] + t * bias_stride[2] + s * bias_stride[3]];
    }
    return logit;
  }

  // d logit / d dot times `ds` (the gradient of the logit): scale, through the soft cap's tanh,
  // recovered from the logit without its bias.
  JAXDNN_ATTN_HD float DotGrad(float ds, float logit, int64_t b, int64_t n, int64_t t, int64_t s) const {
    if (soft_cap > 0.f) {
      if (bias != nullptr) {
        logit -= bias[b * bias_stride[0] + n * bias_stride[1] + t * bias_stride[2] + s * bias_stride[3]];
      }
      const float capped = logit / soft_cap;  // tanh of the scaled logit over the cap
      ds *= 1.f - capped * capped;
    }
    return ds * scale;
  }
};

// Dropout of (b, n, t, s): 0 for a dropped probability, 1 / keep for a kept one (1 without
// dropout); with dropout_head_mask 0, every head's is head 0's. jaxdnn/reference/attention.py
// computes the same hash.
JAXDNN_ATTN_HD float DropoutScale(const AttentionProblem& p, int64_t b, int64_t n, int64_t t, int64_t s) {
  if (p.dropout_seed == nullptr) return 1.f;
  uint32_t h = MixBits(p.dropout_seed[2 * b] ^ (uint32_t(n) & p.dropout_head_mask));
  h = MixBits(h ^ uint32_t(t));
  h = MixBits((h + uint32_t(s) * 0x9e3779b9u) ^ p.dropout_seed[2 * b + 1]);
  return (h >> 8) < p.dropout_keep ? float(kAttnKeepAll) / float(p.dropout_keep) : 0.f;
}

// The running max m and sum l = sum(exp(logit - m)) of one query row over the keys seen so far.
struct OnlineSoftmax {
  float max = -INFINITY;
  float sum = 0.f;

  // Takes a tile whose largest logit is tile_max: returns the factor exp(old max - new max) by
  // which the sum and the output accumulator are rescaled (0 before any key; 1 if nothing new).
  // After it, add exp(logit - max) of the tile's logits to `sum`. Tiles of dropped logits
  // (tile_max == -inf) leave everything as it is.
  JAXDNN_ATTN_HD float Rescale(float tile_max) {
    if (tile_max <= max) return 1.f;
    const float factor = max == -INFINITY ? 0.f : expf(max - tile_max);
    max = tile_max;
    sum *= factor;
    return factor;
  }
  // Exp of a logit relative to the running max (0 for a dropped logit).
  JAXDNN_ATTN_HD float Prob(float logit) const { return logit == -INFINITY ? 0.f : expf(logit - max); }
  // 1 / sum, or 0 for a row with no key (its output is 0).
  JAXDNN_ATTN_HD float InvSum() const { return sum > 0.f ? 1.f / sum : 0.f; }
  // The row's logsumexp; -inf for a row with no key.
  JAXDNN_ATTN_HD float LogSumExp() const { return sum > 0.f ? max + logf(sum) : -INFINITY; }
};

// The probability of a logit from the row's saved logsumexp (0 for a dropped logit or a row with
// no key).
JAXDNN_ATTN_HD float ProbFromLse(float logit, float lse) {
  return (logit == -INFINITY || lse == -INFINITY) ? 0.f : expf(logit - lse);
}

}  // namespace jaxdnn
