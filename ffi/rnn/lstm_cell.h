// The per-unit LSTM math shared by the CPU and CUDA kernels (host/device code), so the CPU tests
// exercise the CUDA kernels' own arithmetic; only the recurrent matrix-vector products differ in
// their summation order.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/activation.h"  // JAXDNN_HOST_DEVICE, Sigmoid

namespace jaxdnn {

// The sizes of one layer-direction's recurrence (rnn.h).
struct RecurrenceShape {
  int64_t batch = 0;   // B
  int64_t steps = 0;   // T
  int64_t hidden = 0;  // H
  JAXDNN_HOST_DEVICE int64_t gates() const { return 4 * hidden; }
  JAXDNN_HOST_DEVICE bool empty() const { return batch == 0 || hidden == 0; }
};

// The four gate activations of one hidden unit.
struct LstmGates {
  float i, f, g, o;
};

JAXDNN_HOST_DEVICE inline LstmGates LstmActivate(float pre_i, float pre_f, float pre_g, float pre_o) {
  return LstmGates{Sigmoid(pre_i), Sigmoid(pre_f), tanhf(pre_g), Sigmoid(pre_o)};
}

// The steps row b runs: seq_lengths[b] clamped to [0, T], so a bad length never reads out of bounds.
JAXDNN_HOST_DEVICE inline int64_t ValidSteps(int32_t length, int64_t steps) {
  return length < 0 ? 0 : (length > steps ? steps : int64_t(length));
}

// The time index of the s-th step a row runs (0 <= s < len): forward s, reverse len - 1 - s.
JAXDNN_HOST_DEVICE inline int64_t StepTime(int64_t s, int64_t len, bool reverse) {
  return reverse ? len - 1 - s : s;
}

// One unit's backward step. Given the forward's activations a, cell state c and previous cell
// state c_prev, the gradient dh reaching h (from the output and the next step) and dc_next reaching
// c from the next step: writes the pre-activation gradients (i, f, g, o) to d_pre and returns the
// gradient reaching c_prev.
JAXDNN_HOST_DEVICE inline float LstmCellGrad(const LstmGates& a, float c, float c_prev, float dh, float dc_next,
                                             float (&d_pre)[4]) {
  const float tanh_c = tanhf(c);
  const float dc = dc_next + dh * a.o * (1.f - tanh_c * tanh_c);
  d_pre[0] = dc * a.g * a.i * (1.f - a.i);
  d_pre[1] = dc * c_prev * a.f * (1.f - a.f);
  d_pre[2] = dc * a.i * (1.f - a.g * a.g);
  d_pre[3] = dh * tanh_c * a.o * (1.f - a.o);
  return dc * a.f;
}

}  // namespace jaxdnn
