// The per-unit LSTM, GRU and plain RNN math shared by the CPU and CUDA kernels (host/device code), so the CPU
// tests exercise the CUDA kernels' own arithmetic; only the recurrent matrix-vector products differ
// in their summation order.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/activation.h"  // JAXDNN_HOST_DEVICE, Sigmoid

namespace jaxdnn {

// A (batch row b, direction d) pair, one independent sequence: where its state is in the [B D, H]
// view of the states [B, D, H], and its step 0 in the [B T D, ...] view of the per-step arrays
// [B, T, D, ...] (At).
struct SeqRow {
  int64_t state;  // b D + d
  int64_t first;  // b T D + d
};

// The sizes of one layer's recurrence in D directions (rnn.h): G = gates_per_unit * H gate rows.
struct RecurrenceShape {
  int64_t batch = 0;           // B
  int64_t steps = 0;           // T
  int64_t directions = 1;      // D: 1, or 2 (the second runs the other way through time)
  int64_t hidden = 0;          // H
  int64_t gates_per_unit = 4;  // 4 (LSTM), 3 (GRU) or 1 (plain RNN)
  JAXDNN_HOST_DEVICE int64_t gates() const { return gates_per_unit * hidden; }
  JAXDNN_HOST_DEVICE bool empty() const { return batch == 0 || hidden == 0; }
  JAXDNN_HOST_DEVICE SeqRow Row(int64_t b, int64_t d) const {
    return SeqRow{b * directions + d, b * steps * directions + d};
  }
  // A pair's direction d.
  JAXDNN_HOST_DEVICE int64_t Direction(const SeqRow& r) const { return directions == 1 ? 0 : r.state & 1; }
};

// The index of a pair's time step t in the [B T D, ...] view of a per-step array.
JAXDNN_HOST_DEVICE inline int64_t At(const RecurrenceShape& s, const SeqRow& r, int64_t t) {
  return r.first + t * s.directions;
}

// Whether direction d runs from each row's end: the target's `reverse` for direction 0, the
// opposite for direction 1.
JAXDNN_HOST_DEVICE inline bool Reversed(bool reverse, int64_t d) { return reverse != (d == 1); }

// The steps row b runs: seq_lengths[b] clamped to [0, T], so a bad length never reads out of bounds.
JAXDNN_HOST_DEVICE inline int64_t ValidSteps(int32_t length, int64_t steps) {
  return length < 0 ? 0 : (length > steps ? steps : int64_t(length));
}

// The time index of the s-th step a row runs (0 <= s < len): forward s, reverse len - 1 - s.
JAXDNN_HOST_DEVICE inline int64_t StepTime(int64_t s, int64_t len, bool reverse) {
  return reverse ? len - 1 - s : s;
}

// --- LSTM: gates (i, f, g, o); c = f c_prev + i g, h = o tanh(c) ----------------------------------

struct LstmGates {
  float i, f, g, o;
};

JAXDNN_HOST_DEVICE inline LstmGates LstmActivate(float pre_i, float pre_f, float pre_g, float pre_o) {
  return LstmGates{Sigmoid(pre_i), Sigmoid(pre_f), Tanh(pre_g), Sigmoid(pre_o)};
}

// One unit's backward step. Given the forward's activations a, cell state c and previous cell
// state c_prev, the gradient dh reaching h (from the output and the next step) and dc_next reaching
// c from the next step: writes the pre-activation gradients (i, f, g, o) to d_pre and returns the
// gradient reaching c_prev.
JAXDNN_HOST_DEVICE inline float LstmCellGrad(const LstmGates& a, float c, float c_prev, float dh, float dc_next,
                                             float (&d_pre)[4]) {
  const float tanh_c = Tanh(c);
  const float dc = dc_next + dh * a.o * (1.f - tanh_c * tanh_c);
  d_pre[0] = dc * a.g * a.i * (1.f - a.i);
  d_pre[1] = dc * c_prev * a.f * (1.f - a.f);
  d_pre[2] = dc * a.i * (1.f - a.g * a.g);
  d_pre[3] = dh * tanh_c * a.o * (1.f - a.o);
  return dc * a.f;
}

// --- GRU (cuDNN's): gates (r, z, n) with the reset gate applied after the recurrent product --------
// r = sigmoid(xr + hr), z = sigmoid(xz + hz), n = tanh(xn + r hn), h = (1 - z) n + z h_prev, where
// x* are the input projections (with b_ih) and h* = W_h* h_prev + b_h* the recurrent ones.

struct GruGates {
  float r, z, n;
};

JAXDNN_HOST_DEVICE inline GruGates GruActivate(float x_r, float x_z, float x_n, float h_r, float h_z, float h_n) {
  const float r = Sigmoid(x_r + h_r);
  return GruGates{r, Sigmoid(x_z + h_z), Tanh(x_n + r * h_n)};
}

JAXDNN_HOST_DEVICE inline float GruOutput(const GruGates& a, float h_prev) { return (1.f - a.z) * a.n + a.z * h_prev; }

// One unit's backward step: from the forward's activations a, its recurrent n pre-activation h_n,
// h_prev and the gradient dh reaching h, writes the gradients of the input projections (r, z, n)
// to d_x and of the recurrent ones to d_h, and returns the part of dh_prev that bypasses W_hh.
JAXDNN_HOST_DEVICE inline float GruCellGrad(const GruGates& a, float h_n, float h_prev, float dh, float (&d_x)[3],
                                            float (&d_h)[3]) {
  const float dn = dh * (1.f - a.z) * (1.f - a.n * a.n);
  d_x[0] = dn * h_n * a.r * (1.f - a.r);
  d_x[1] = dh * (h_prev - a.n) * a.z * (1.f - a.z);
  d_x[2] = dn;
  d_h[0] = d_x[0];
  d_h[1] = d_x[1];
  d_h[2] = dn * a.r;
  return dh * a.z;
}

// --- plain (Elman) RNN, cuDNN's RNN_TANH / RNN_RELU: h = act(x + W_hh h_prev), act tanh or relu ------
// (x the input projection with both biases). `act` is Activation::kTanh or kRelu (rnn_common.h
// decodes the attribute), a run-time value: one uniform branch per unit, no kernel per nonlinearity.

JAXDNN_HOST_DEVICE inline float RnnActivate(Activation act, float pre) {
  return act == Activation::kRelu ? Activate<Activation::kRelu>(pre, 0.f) : Tanh(pre);
}

// One unit's backward step: the gradient of its pre-activation from the gradient dh reaching h, with
// act' taken from the output h itself (so the forward saves nothing but h): tanh' = 1 - h^2,
// relu' = [h > 0] (0 at the kink, as jax.nn.relu's gradient).
JAXDNN_HOST_DEVICE inline float RnnCellGrad(Activation act, float h, float dh) {
  return act == Activation::kRelu ? (h > 0.f ? dh : 0.f) : dh * (1.f - h * h);
}

}  // namespace jaxdnn
