// Operand checks shared by the CPU and CUDA attention handlers: the buffers and attributes become
// one AttentionProblem, or an InvalidArgument error (never an abort).
#pragma once

#include <cstdint>
#include <string>

#include "attention/attention.h"
#include "attention/attention_problem.h"
#include "common/ffi_common.h"

namespace jaxdnn {
namespace attention_internal {

// A broadcastable [B, N, T, S] operand (bias, mask): rank 4, each axis 1 or full; its strides with
// 0 on the broadcast axes.
inline ffi::Error BroadcastStrides(const char* name, ffi::AnyBuffer::Dimensions dims, const int64_t full[4],
                                   int64_t strides[4]) {
  bool ok = dims.size() == 4;
  for (int a = 0; ok && a < 4; ++a) ok = dims[a] == 1 || dims[a] == full[a];
  if (!ok) {
    return InvalidArgument(std::string("attention: ") + name + " has shape " + Dims(dims) +
                           ", expected 4 axes each 1 or [B, N, T, S] = [" + std::to_string(full[0]) + "," +
                           std::to_string(full[1]) + "," + std::to_string(full[2]) + "," +
                           std::to_string(full[3]) + "]");
  }
  int64_t stride = 1;
  for (int a = 3; a >= 0; --a) {
    strides[a] = dims[a] == 1 ? 0 : stride;
    stride *= dims[a];
  }
  return ffi::Error::Success();
}

inline ffi::Error ExpectDims(const char* name, ffi::AnyBuffer::Dimensions dims, std::initializer_list<int64_t> want) {
  bool ok = dims.size() == want.size();
  size_t i = 0;
  for (int64_t w : want) ok = ok && dims[i++] == w;
  if (ok) return ffi::Error::Success();
  std::string expected = "[";
  i = 0;
  for (int64_t w : want) expected += (i++ ? "," : "") + std::to_string(w);
  return InvalidArgument(std::string("attention: ") + name + " has shape " + Dims(dims) + ", expected " +
                         expected + "]");
}

}  // namespace attention_internal

// The operands and attributes every attention target shares.
struct AttentionInputs {
  const ffi::AnyBuffer* q;
  const ffi::AnyBuffer* k;
  const ffi::AnyBuffer* v;
  const ffi::Buffer<ffi::F32>* bias;
  const ffi::Buffer<ffi::PRED>* mask;
  const ffi::Buffer<ffi::S32>* q_lens;
  const ffi::Buffer<ffi::S32>* kv_lens;
  const ffi::Buffer<ffi::S32>* q_seg;
  const ffi::Buffer<ffi::S32>* kv_seg;
  const ffi::Buffer<ffi::U32>* dropout_seed;
  float scale, soft_cap;
  int64_t causal, window_left, window_right, present, dropout_keep, dropout_heads;
};

inline ffi::Error MakeAttentionProblem(const AttentionInputs& in, AttentionProblem* p) {
  using attention_internal::ExpectDims;
  const auto qd = in.q->dimensions(), kd = in.k->dimensions();
  if (qd.size() != 4 || kd.size() != 4) {
    return InvalidArgument("attention: q must be [B, T, N, H] and k [B, S, K, H], got " +
                           Dims(qd) + " and " + Dims(kd));
  }
  p->batch = qd[0];
  p->q_len = qd[1];
  p->heads = qd[2];
  p->head_dim = qd[3];
  p->kv_len = kd[1];
  p->kv_heads = kd[2];
  JAXDNN_RETURN_IF_ERROR(ExpectDims("k", kd, {p->batch, p->kv_len, p->kv_heads, p->head_dim}));
  JAXDNN_RETURN_IF_ERROR(ExpectDims("v", in.v->dimensions(), {p->batch, p->kv_len, p->kv_heads, p->head_dim}));
  if (in.k->element_type() != in.q->element_type() || in.v->element_type() != in.q->element_type()) {
    return InvalidArgument("attention: q, k and v must share one dtype");
  }
  if (p->kv_heads < 1 || p->heads % p->kv_heads != 0) {
    return InvalidArgument("attention: the query heads N = " + std::to_string(p->heads) +
                           " must be a multiple of the key/value heads K = " + std::to_string(p->kv_heads));
  }
  if (p->head_dim < 1) return InvalidArgument("attention: the head size H must be >= 1");
  if (in.present < 0 || in.present > 127) return InvalidArgument("attention: bad `present` attribute");
  if (in.dropout_keep < 1 || in.dropout_keep > kAttnKeepAll) {
    return InvalidArgument("attention: dropout_keep must be in [1, 2^24]");
  }
  if (in.dropout_heads != 0 && in.dropout_heads != 1) {
    return InvalidArgument("attention: dropout_heads must be 0 or 1");
  }
  if (in.window_left < -1 || in.window_right < -1) {
    return InvalidArgument("attention: window sizes must be >= 0 (or -1 for unbounded)");
  }
  if (!(in.soft_cap >= 0.f)) return InvalidArgument("attention: logits_soft_cap must be >= 0");
  p->scale = in.scale;
  p->soft_cap = in.soft_cap;
  p->causal = in.causal != 0;
  p->window_left = in.window_left;
  p->window_right = in.window_right;

  const int64_t full[4] = {p->batch, p->heads, p->q_len, p->kv_len};
  auto absent = [](const char* name, ffi::AnyBuffer::Dimensions dims) {
    return ExpectDims(name, dims, {0});
  };
  if (in.present & kAttentionBias) {
    JAXDNN_RETURN_IF_ERROR(attention_internal::BroadcastStrides("bias", in.bias->dimensions(), full, p->bias_stride));
    p->bias = in.bias->typed_data();
  } else {
    JAXDNN_RETURN_IF_ERROR(absent("bias", in.bias->dimensions()));
  }
  if (in.present & kAttentionMask) {
    JAXDNN_RETURN_IF_ERROR(attention_internal::BroadcastStrides("mask", in.mask->dimensions(), full, p->mask_stride));
    p->mask = in.mask->typed_data();
  } else {
    JAXDNN_RETURN_IF_ERROR(absent("mask", in.mask->dimensions()));
  }
  if (in.present & kAttentionQueryLengths) {
    JAXDNN_RETURN_IF_ERROR(ExpectDims("q_lens", in.q_lens->dimensions(), {p->batch}));
    p->q_lens = in.q_lens->typed_data();
  } else {
    JAXDNN_RETURN_IF_ERROR(absent("q_lens", in.q_lens->dimensions()));
  }
  if (in.present & kAttentionKeyLengths) {
    JAXDNN_RETURN_IF_ERROR(ExpectDims("kv_lens", in.kv_lens->dimensions(), {p->batch}));
    p->kv_lens = in.kv_lens->typed_data();
  } else {
    JAXDNN_RETURN_IF_ERROR(absent("kv_lens", in.kv_lens->dimensions()));
  }
  const bool q_seg = (in.present & kAttentionQuerySegments) != 0;
  if (q_seg != ((in.present & kAttentionKeySegments) != 0)) {
    return InvalidArgument("attention: q_seg and kv_seg come together");
  }
  if (q_seg) {
    JAXDNN_RETURN_IF_ERROR(ExpectDims("q_seg", in.q_seg->dimensions(), {p->batch, p->q_len}));
    JAXDNN_RETURN_IF_ERROR(ExpectDims("kv_seg", in.kv_seg->dimensions(), {p->batch, p->kv_len}));
    p->q_seg = in.q_seg->typed_data();
    p->kv_seg = in.kv_seg->typed_data();
  } else {
    JAXDNN_RETURN_IF_ERROR(absent("q_seg", in.q_seg->dimensions()));
    JAXDNN_RETURN_IF_ERROR(absent("kv_seg", in.kv_seg->dimensions()));
  }
  if (in.present & kAttentionDropout) {
    JAXDNN_RETURN_IF_ERROR(ExpectDims("dropout_seed", in.dropout_seed->dimensions(), {p->batch, 2}));
    p->dropout_seed = in.dropout_seed->typed_data();
    p->dropout_keep = static_cast<uint32_t>(in.dropout_keep);
    p->dropout_head_mask = in.dropout_heads ? ~0u : 0u;
  } else {
    JAXDNN_RETURN_IF_ERROR(absent("dropout_seed", in.dropout_seed->dimensions()));
  }
  return ffi::Error::Success();
}

// Checks a result (or extra operand) shaped like q / k, with q's dtype.
inline ffi::Error ExpectLike(const char* name, const ffi::AnyBuffer& buffer, const ffi::AnyBuffer& like) {
  if (buffer.element_type() != like.element_type()) {
    return InvalidArgument(std::string("attention: ") + name + " must have the dtype of q");
  }
  const auto want = like.dimensions();
  return attention_internal::ExpectDims(name, buffer.dimensions(), {want[0], want[1], want[2], want[3]});
}

// Checks a [B, N, T] float32 statistic (lse, delta).
inline ffi::Error ExpectStat(const char* name, ffi::AnyBuffer::Dimensions dims, const AttentionProblem& p) {
  return attention_internal::ExpectDims(name, dims, {p.batch, p.heads, p.q_len});
}

// Checks dbias: [B, N, T, S] when the bias gradient is asked for, [0] otherwise.
inline ffi::Error ExpectBiasGrad(ffi::AnyBuffer::Dimensions dims, const AttentionProblem& p, int64_t bias_grad) {
  if (bias_grad != 0 && p.bias == nullptr) return InvalidArgument("attention: bias_grad without a bias");
  if (bias_grad == 0) return attention_internal::ExpectDims("dbias", dims, {0});
  return attention_internal::ExpectDims("dbias", dims, {p.batch, p.heads, p.q_len, p.kv_len});
}

// The backward's buffers beyond the problem's own: do, o and dq like q, dk and dv like k, lse and
// delta [B, N, T], dbias as bias_grad asks.
inline ffi::Error CheckAttentionBwd(const AttentionProblem& p, const ffi::AnyBuffer& d_out, const ffi::AnyBuffer& q,
                                    const ffi::AnyBuffer& k, const ffi::AnyBuffer& o,
                                    ffi::AnyBuffer::Dimensions lse, const ffi::AnyBuffer& dq,
                                    const ffi::AnyBuffer& dk, const ffi::AnyBuffer& dv,
                                    ffi::AnyBuffer::Dimensions dbias, ffi::AnyBuffer::Dimensions delta,
                                    int64_t bias_grad) {
  JAXDNN_RETURN_IF_ERROR(ExpectLike("do", d_out, q));
  JAXDNN_RETURN_IF_ERROR(ExpectLike("o", o, q));
  JAXDNN_RETURN_IF_ERROR(ExpectLike("dq", dq, q));
  JAXDNN_RETURN_IF_ERROR(ExpectLike("dk", dk, k));
  JAXDNN_RETURN_IF_ERROR(ExpectLike("dv", dv, k));
  JAXDNN_RETURN_IF_ERROR(ExpectStat("lse", lse, p));
  JAXDNN_RETURN_IF_ERROR(ExpectStat("delta", delta, p));
  return ExpectBiasGrad(dbias, p, bias_grad);
}

}  // namespace jaxdnn
