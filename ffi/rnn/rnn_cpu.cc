// CPU LSTM and GRU recurrences: the CUDA kernels' decomposition (one batch row at a time, stepping
// through its valid time steps with the state in a small buffer), with W_hh converted to float32
// once per call so the recurrent products run over contiguous float rows.
#include <algorithm>
#include <vector>

#include "common/half_cpu.h"
#include "rnn/rnn.h"
#include "rnn/rnn_cell.h"
#include "rnn/rnn_common.h"

namespace jaxdnn {
namespace {

using F32 = ffi::Buffer<ffi::F32>;
using F32Result = ffi::Result<ffi::Buffer<ffi::F32>>;

// W_hh [G, H] as float32.
ffi::Error WeightsAsFloat(const ffi::AnyBuffer& w_hh, std::vector<float>* out) {
  return DispatchFloat<float, Bf16, Half>(w_hh.element_type(), "w_hh", [&](auto tag) {
    using W = decltype(tag);
    const W* w = static_cast<const W*>(w_hh.untyped_data());
    out->resize(ElementCount(w_hh.dimensions()));
    for (size_t e = 0; e < out->size(); ++e) (*out)[e] = ToFloat(w[e]);
    return ffi::Error::Success();
  });
}

// out[k] = sum_j W[k, j] h[j] for the G rows of W [G, H].
void RecurrentProducts(const std::vector<float>& w, const float* h, int64_t hidden, int64_t gates, float* out) {
  for (int64_t k = 0; k < gates; ++k) {
    const float* row = w.data() + k * hidden;
    float sum = 0.f;
    for (int64_t j = 0; j < hidden; ++j) sum += row[j] * h[j];
    out[k] = sum;
  }
}

// out[j] = sum_k W[k, j] d[k], accumulated row by row of W (contiguous).
void TransposedProducts(const std::vector<float>& w, const float* d, int64_t hidden, int64_t gates, float* out) {
  std::fill_n(out, hidden, 0.f);
  for (int64_t k = 0; k < gates; ++k) {
    const float* row = w.data() + k * hidden;
    for (int64_t j = 0; j < hidden; ++j) out[j] += d[k] * row[j];
  }
}

ffi::Error LstmFwdImpl(F32 gates_x, ffi::AnyBuffer w_hh, F32 h0, F32 c0, ffi::Buffer<ffi::S32> seq_lengths,
                       F32Result h_seq, F32Result c_seq, F32Result acts, F32Result h_n, F32Result c_n, int64_t reverse) {
  RecurrenceShape s;
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(gates_x.dimensions(), 4, 4, &s));
  JAXDNN_RETURN_IF_ERROR(CheckRecurrenceOperands(
      s, w_hh, {h0.dimensions(), c0.dimensions(), h_n->dimensions(), c_n->dimensions()}, seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 1, {h_seq->dimensions(), c_seq->dimensions()}));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 4, {acts->dimensions()}));
  if (s.empty()) return ffi::Error::Success();
  std::vector<float> w;
  JAXDNN_RETURN_IF_ERROR(WeightsAsFloat(w_hh, &w));
  const int64_t H = s.hidden, G = s.gates(), T = s.steps;
  std::fill_n(h_seq->typed_data(), s.batch * T * H, 0.f);  // steps past each row's end stay zero
  std::fill_n(c_seq->typed_data(), s.batch * T * H, 0.f);
  std::fill_n(acts->typed_data(), s.batch * T * G, 0.f);
  std::vector<float> h(H), c(H), pre(G);
  for (int64_t b = 0; b < s.batch; ++b) {
    std::copy_n(h0.typed_data() + b * H, H, h.begin());
    std::copy_n(c0.typed_data() + b * H, H, c.begin());
    const int64_t len = ValidSteps(seq_lengths.typed_data()[b], T);
    for (int64_t step = 0; step < len; ++step) {
      const int64_t row = b * T + StepTime(step, len, reverse != 0);
      RecurrentProducts(w, h.data(), H, G, pre.data());
      const float* gx = gates_x.typed_data() + row * G;
      float* a = acts->typed_data() + row * G;
      for (int64_t j = 0; j < H; ++j) {
        const LstmGates g = LstmActivate(gx[j] + pre[j], gx[H + j] + pre[H + j], gx[2 * H + j] + pre[2 * H + j],
                                         gx[3 * H + j] + pre[3 * H + j]);
        c[j] = g.f * c[j] + g.i * g.g;
        h[j] = g.o * tanhf(c[j]);
        a[j] = g.i, a[H + j] = g.f, a[2 * H + j] = g.g, a[3 * H + j] = g.o;
        h_seq->typed_data()[row * H + j] = h[j];
        c_seq->typed_data()[row * H + j] = c[j];
      }
    }
    std::copy_n(h.begin(), H, h_n->typed_data() + b * H);
    std::copy_n(c.begin(), H, c_n->typed_data() + b * H);
  }
  return ffi::Error::Success();
}

ffi::Error LstmBwdImpl(F32 dh_seq, F32 dh_n, F32 dc_n, F32 acts, F32 c_seq, F32 c0, ffi::AnyBuffer w_hh,
                       ffi::Buffer<ffi::S32> seq_lengths, F32Result dgates, F32Result dh0, F32Result dc0,
                       int64_t reverse) {
  RecurrenceShape s;
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(acts.dimensions(), 4, 4, &s));
  JAXDNN_RETURN_IF_ERROR(CheckRecurrenceOperands(
      s, w_hh, {dh_n.dimensions(), dc_n.dimensions(), c0.dimensions(), dh0->dimensions(), dc0->dimensions()},
      seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 1, {dh_seq.dimensions(), c_seq.dimensions()}));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 4, {dgates->dimensions()}));
  if (s.empty()) return ffi::Error::Success();
  std::vector<float> w;
  JAXDNN_RETURN_IF_ERROR(WeightsAsFloat(w_hh, &w));
  const int64_t H = s.hidden, G = s.gates(), T = s.steps;
  std::fill_n(dgates->typed_data(), s.batch * T * G, 0.f);
  std::vector<float> dh(H), dc(H);
  for (int64_t b = 0; b < s.batch; ++b) {
    std::copy_n(dh_n.typed_data() + b * H, H, dh.begin());
    std::copy_n(dc_n.typed_data() + b * H, H, dc.begin());
    const int64_t len = ValidSteps(seq_lengths.typed_data()[b], T);
    for (int64_t step = len - 1; step >= 0; --step) {
      const int64_t row = b * T + StepTime(step, len, reverse != 0);
      const float* a = acts.typed_data() + row * G;
      const float* c = c_seq.typed_data() + row * H;
      const float* c_prev = step > 0 ? c_seq.typed_data() + (b * T + StepTime(step - 1, len, reverse != 0)) * H
                                     : c0.typed_data() + b * H;
      const float* dy = dh_seq.typed_data() + row * H;
      float* dg = dgates->typed_data() + row * G;
      for (int64_t j = 0; j < H; ++j) {
        float d_pre[4];
        dc[j] = LstmCellGrad(LstmGates{a[j], a[H + j], a[2 * H + j], a[3 * H + j]}, c[j], c_prev[j], dy[j] + dh[j],
                             dc[j], d_pre);
        for (int q = 0; q < 4; ++q) dg[q * H + j] = d_pre[q];
      }
      TransposedProducts(w, dg, H, G, dh.data());
    }
    std::copy_n(dh.begin(), H, dh0->typed_data() + b * H);
    std::copy_n(dc.begin(), H, dc0->typed_data() + b * H);
  }
  return ffi::Error::Success();
}

ffi::Error GruFwdImpl(F32 gates_x, ffi::AnyBuffer w_hh, F32 b_hh, F32 h0, ffi::Buffer<ffi::S32> seq_lengths,
                      F32Result h_seq, F32Result saved, F32Result h_n, int64_t reverse) {
  RecurrenceShape s;
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(gates_x.dimensions(), 3, 3, &s));
  JAXDNN_RETURN_IF_ERROR(
      CheckRecurrenceOperands(s, w_hh, {h0.dimensions(), h_n->dimensions()}, seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(ExpectShape("b_hh", b_hh.dimensions(), {s.gates()}));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 1, {h_seq->dimensions()}));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 4, {saved->dimensions()}));
  if (s.empty()) return ffi::Error::Success();
  std::vector<float> w;
  JAXDNN_RETURN_IF_ERROR(WeightsAsFloat(w_hh, &w));
  const int64_t H = s.hidden, G = s.gates(), T = s.steps;
  std::fill_n(h_seq->typed_data(), s.batch * T * H, 0.f);
  std::fill_n(saved->typed_data(), s.batch * T * 4 * H, 0.f);
  std::vector<float> h(H), hp(G);
  const float* bias = b_hh.typed_data();
  for (int64_t b = 0; b < s.batch; ++b) {
    std::copy_n(h0.typed_data() + b * H, H, h.begin());
    const int64_t len = ValidSteps(seq_lengths.typed_data()[b], T);
    for (int64_t step = 0; step < len; ++step) {
      const int64_t row = b * T + StepTime(step, len, reverse != 0);
      RecurrentProducts(w, h.data(), H, G, hp.data());
      for (int64_t k = 0; k < G; ++k) hp[k] += bias[k];
      const float* gx = gates_x.typed_data() + row * G;
      float* keep = saved->typed_data() + row * 4 * H;
      for (int64_t j = 0; j < H; ++j) {
        const GruGates a = GruActivate(gx[j], gx[H + j], gx[2 * H + j], hp[j], hp[H + j], hp[2 * H + j]);
        h[j] = GruOutput(a, h[j]);
        keep[j] = a.r, keep[H + j] = a.z, keep[2 * H + j] = a.n, keep[3 * H + j] = hp[2 * H + j];
        h_seq->typed_data()[row * H + j] = h[j];
      }
    }
    std::copy_n(h.begin(), H, h_n->typed_data() + b * H);
  }
  return ffi::Error::Success();
}

ffi::Error GruBwdImpl(F32 dh_seq, F32 dh_n, F32 saved, F32 h_seq, F32 h0, ffi::AnyBuffer w_hh,
                      ffi::Buffer<ffi::S32> seq_lengths, F32Result dgates_x, F32Result dgates_h, F32Result dh0,
                      int64_t reverse) {
  RecurrenceShape s;
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(saved.dimensions(), 4, 3, &s));
  JAXDNN_RETURN_IF_ERROR(CheckRecurrenceOperands(s, w_hh, {dh_n.dimensions(), h0.dimensions(), dh0->dimensions()},
                                                 seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 1, {dh_seq.dimensions(), h_seq.dimensions()}));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, 3, {dgates_x->dimensions(), dgates_h->dimensions()}));
  if (s.empty()) return ffi::Error::Success();
  std::vector<float> w;
  JAXDNN_RETURN_IF_ERROR(WeightsAsFloat(w_hh, &w));
  const int64_t H = s.hidden, G = s.gates(), T = s.steps;
  std::fill_n(dgates_x->typed_data(), s.batch * T * G, 0.f);
  std::fill_n(dgates_h->typed_data(), s.batch * T * G, 0.f);
  std::vector<float> dh(H), bypass(H);
  for (int64_t b = 0; b < s.batch; ++b) {
    std::copy_n(dh_n.typed_data() + b * H, H, dh.begin());
    const int64_t len = ValidSteps(seq_lengths.typed_data()[b], T);
    for (int64_t step = len - 1; step >= 0; --step) {
      const int64_t row = b * T + StepTime(step, len, reverse != 0);
      const float* keep = saved.typed_data() + row * 4 * H;
      const float* h_prev = step > 0 ? h_seq.typed_data() + (b * T + StepTime(step - 1, len, reverse != 0)) * H
                                     : h0.typed_data() + b * H;
      const float* dy = dh_seq.typed_data() + row * H;
      float* dgx = dgates_x->typed_data() + row * G;
      float* dgh = dgates_h->typed_data() + row * G;
      for (int64_t j = 0; j < H; ++j) {
        float d_x[3], d_h[3];
        bypass[j] = GruCellGrad(GruGates{keep[j], keep[H + j], keep[2 * H + j]}, keep[3 * H + j], h_prev[j],
                                dy[j] + dh[j], d_x, d_h);
        for (int q = 0; q < 3; ++q) dgx[q * H + j] = d_x[q], dgh[q * H + j] = d_h[q];
      }
      TransposedProducts(w, dgh, H, G, dh.data());
      for (int64_t j = 0; j < H; ++j) dh[j] += bypass[j];
    }
    std::copy_n(dh.begin(), H, dh0->typed_data() + b * H);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(LstmFwdCpu, jaxdnn::LstmFwdImpl, jaxdnn::BindLstmFwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(LstmBwdCpu, jaxdnn::LstmBwdImpl, jaxdnn::BindLstmBwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GruFwdCpu, jaxdnn::GruFwdImpl, jaxdnn::BindGruFwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GruBwdCpu, jaxdnn::GruBwdImpl, jaxdnn::BindGruBwd(ffi::Ffi::Bind()));
