// CPU LSTM recurrence: the CUDA kernels' decomposition (one batch row at a time, stepping through
// its valid time steps with the state in a small buffer), with W_hh converted to float32 once per
// call so the recurrent products run over contiguous float rows.
#include <algorithm>
#include <vector>

#include "common/half_cpu.h"
#include "rnn/lstm_cell.h"
#include "rnn/rnn.h"
#include "rnn/rnn_common.h"

namespace jaxdnn {
namespace {

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

ffi::Error FwdImpl(ffi::Buffer<ffi::F32> gates_x, ffi::AnyBuffer w_hh, ffi::Buffer<ffi::F32> h0,
                   ffi::Buffer<ffi::F32> c0, ffi::Buffer<ffi::S32> seq_lengths, ffi::Result<ffi::Buffer<ffi::F32>> h_seq,
                   ffi::Result<ffi::Buffer<ffi::F32>> c_seq, ffi::Result<ffi::Buffer<ffi::F32>> acts,
                   ffi::Result<ffi::Buffer<ffi::F32>> h_n, ffi::Result<ffi::Buffer<ffi::F32>> c_n, int64_t reverse) {
  RecurrenceShape s;
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(gates_x.dimensions(), &s));
  JAXDNN_RETURN_IF_ERROR(CheckRecurrenceOperands(
      s, w_hh, {h0.dimensions(), c0.dimensions(), h_n->dimensions(), c_n->dimensions()}, seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, {h_seq->dimensions(), c_seq->dimensions()}, {acts->dimensions()}));
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
      const int64_t t = StepTime(step, len, reverse != 0);
      const float* gx = gates_x.typed_data() + (b * T + t) * G;
      for (int64_t k = 0; k < G; ++k) {
        const float* row = w.data() + k * H;
        float sum = 0.f;
        for (int64_t j = 0; j < H; ++j) sum += row[j] * h[j];
        pre[k] = gx[k] + sum;
      }
      float* a = acts->typed_data() + (b * T + t) * G;
      float* hs = h_seq->typed_data() + (b * T + t) * H;
      float* cs = c_seq->typed_data() + (b * T + t) * H;
      for (int64_t j = 0; j < H; ++j) {
        const LstmGates g = LstmActivate(pre[j], pre[H + j], pre[2 * H + j], pre[3 * H + j]);
        c[j] = g.f * c[j] + g.i * g.g;
        h[j] = g.o * tanhf(c[j]);
        a[j] = g.i, a[H + j] = g.f, a[2 * H + j] = g.g, a[3 * H + j] = g.o;
        hs[j] = h[j];
        cs[j] = c[j];
      }
    }
    std::copy_n(h.begin(), H, h_n->typed_data() + b * H);
    std::copy_n(c.begin(), H, c_n->typed_data() + b * H);
  }
  return ffi::Error::Success();
}

ffi::Error BwdImpl(ffi::Buffer<ffi::F32> dh_seq, ffi::Buffer<ffi::F32> dh_n, ffi::Buffer<ffi::F32> dc_n,
                   ffi::Buffer<ffi::F32> acts, ffi::Buffer<ffi::F32> c_seq, ffi::Buffer<ffi::F32> c0, ffi::AnyBuffer w_hh,
                   ffi::Buffer<ffi::S32> seq_lengths, ffi::Result<ffi::Buffer<ffi::F32>> dgates,
                   ffi::Result<ffi::Buffer<ffi::F32>> dh0, ffi::Result<ffi::Buffer<ffi::F32>> dc0, int64_t reverse) {
  RecurrenceShape s;
  JAXDNN_RETURN_IF_ERROR(DecodeRecurrenceShape(acts.dimensions(), &s));
  JAXDNN_RETURN_IF_ERROR(CheckRecurrenceOperands(
      s, w_hh, {dh_n.dimensions(), dc_n.dimensions(), c0.dimensions(), dh0->dimensions(), dc0->dimensions()},
      seq_lengths.dimensions()));
  JAXDNN_RETURN_IF_ERROR(CheckSequences(s, {dh_seq.dimensions(), c_seq.dimensions()}, {dgates->dimensions()}));
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
      const int64_t t = StepTime(step, len, reverse != 0);
      const float* a = acts.typed_data() + (b * T + t) * G;
      const float* c = c_seq.typed_data() + (b * T + t) * H;
      const float* c_prev = step > 0 ? c_seq.typed_data() + (b * T + StepTime(step - 1, len, reverse != 0)) * H
                                     : c0.typed_data() + b * H;
      const float* dy = dh_seq.typed_data() + (b * T + t) * H;
      float* dg = dgates->typed_data() + (b * T + t) * G;
      for (int64_t j = 0; j < H; ++j) {
        float d_pre[4];
        dc[j] = LstmCellGrad(LstmGates{a[j], a[H + j], a[2 * H + j], a[3 * H + j]}, c[j], c_prev[j], dy[j] + dh[j],
                             dc[j], d_pre);
        for (int q = 0; q < 4; ++q) dg[q * H + j] = d_pre[q];
      }
      // dh_prev = W_hh^T dgates, accumulated row by row of W_hh (contiguous).
      std::fill(dh.begin(), dh.end(), 0.f);
      for (int64_t k = 0; k < G; ++k) {
        const float* row = w.data() + k * H;
        const float scale = dg[k];
        for (int64_t j = 0; j < H; ++j) dh[j] += scale * row[j];
      }
    }
    std::copy_n(dh.begin(), H, dh0->typed_data() + b * H);
    std::copy_n(dc.begin(), H, dc0->typed_data() + b * H);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxdnn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(LstmFwdCpu, jaxdnn::FwdImpl, jaxdnn::BindLstmFwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(LstmBwdCpu, jaxdnn::BwdImpl, jaxdnn::BindLstmBwd(ffi::Ffi::Bind()));
