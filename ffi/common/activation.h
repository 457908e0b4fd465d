// Activation functions and their derivatives, shared by the CPU and CUDA kernels: the standalone
// activation kernels and the fused epilogues of other families use this one definition.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/math_cpu.h"

// Functions for both the CPU and CUDA kernels; in the CPU kernels (compiled without nvcc) always
// inlined, so that the loops that call them vectorize (common/cpu_isa.h).
#ifdef __CUDACC__
#define JAXDNN_HOST_DEVICE __host__ __device__
#define JAXDNN_UNROLL _Pragma("unroll")
#else
#define JAXDNN_HOST_DEVICE JAXDNN_ALWAYS_INLINE
#define JAXDNN_UNROLL
#endif

namespace jaxdnn {

// The values are an ABI (the `kind` attribute of the activation targets): append, never renumber.
enum class Activation : int64_t {
  kIdentity = 0,
  kRelu = 1,
  kRelu6 = 2,
  kLeakyRelu = 3,  // param: negative_slope
  kElu = 4,        // param: alpha
  kSigmoid = 5,
  kTanh = 6,
  kGeluTanh = 7,   // gelu(approximate=True)
  kGeluErf = 8,    // gelu(approximate=False)
  kSilu = 9,
  kSoftplus = 10,
  kHardTanh = 11,
};
constexpr int64_t kNumActivations = 12;

// Expands JAXDNN_ACTIVATION_CASE(name) for every enumerator, for the switches below.
#define JAXDNN_ACTIVATION_CASES    \
  JAXDNN_ACTIVATION_CASE(kIdentity) \
  JAXDNN_ACTIVATION_CASE(kRelu)     \
  JAXDNN_ACTIVATION_CASE(kRelu6)    \
  JAXDNN_ACTIVATION_CASE(kLeakyRelu) \
  JAXDNN_ACTIVATION_CASE(kElu)      \
  JAXDNN_ACTIVATION_CASE(kSigmoid)  \
  JAXDNN_ACTIVATION_CASE(kTanh)     \
  JAXDNN_ACTIVATION_CASE(kGeluTanh) \
  JAXDNN_ACTIVATION_CASE(kGeluErf)  \
  JAXDNN_ACTIVATION_CASE(kSilu)     \
  JAXDNN_ACTIVATION_CASE(kSoftplus) \
  JAXDNN_ACTIVATION_CASE(kHardTanh)

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

// exp, expm1, log1p, erfc and tanh of the shared code: on the device CUDA's (the build's
// --use_fast_math makes expf and tanhf MUFU approximations), on the host math_cpu.h's branch-free
// forms, with which the CPU kernels' elementwise loops vectorize (libm's are calls, one value at a
// time: gelu ran at 0.3x XLA:CPU's vectorized forward).
#ifdef __CUDA_ARCH__
#define JAXDNN_HOST_OR_DEVICE(device, host) device
#else
#define JAXDNN_HOST_OR_DEVICE(device, host) host
#endif
JAXDNN_HOST_DEVICE inline float Exp(float x) { return JAXDNN_HOST_OR_DEVICE(expf, HostExp)(x); }
JAXDNN_HOST_DEVICE inline float Expm1(float x) { return JAXDNN_HOST_OR_DEVICE(expm1f, HostExpm1)(x); }
JAXDNN_HOST_DEVICE inline float Log1p(float x) { return JAXDNN_HOST_OR_DEVICE(log1pf, HostLog1p)(x); }
JAXDNN_HOST_DEVICE inline float Erfc(float x) { return JAXDNN_HOST_OR_DEVICE(erfcf, HostErfc)(x); }
// tanh for the activations (Tanh below is the recurrences' more accurate one on the device).
JAXDNN_HOST_DEVICE inline float ApproxTanh(float x) { return JAXDNN_HOST_OR_DEVICE(tanhf, HostTanh)(x); }
#undef JAXDNN_HOST_OR_DEVICE

JAXDNN_HOST_DEVICE inline float Sigmoid(float x) { return 1.f / (1.f + Exp(-x)); }

#ifdef __CUDA_ARCH__
extern "C" __device__ float __nv_tanhf(float);  // libdevice's tanh (the CUDA math library's tanhf)
#endif

// tanh within a few ulp on the GPU too, for the recurrences, which compound its error over their
// steps. The build's --use_fast_math turns tanhf into the tanh.approx instruction (relative error
// up to 1e-5, about 80 ulp, measured on an H100), which took fp32 RNN results to the 1e-5 tolerance;
// libdevice's tanh (a polynomial near 0, exp beyond) costs about 15 instructions. The memory-bound
// activation kernels keep tanhf (ApproxTanh above): there the approximation's error is 1.7e-6 in
// norm at fp32, below the tolerance, and under the rounding of the 16-bit dtypes. On the host both
// are HostTanh (within 1.33 ulp; glibc's tanhf went through expm1f and took 4x expf's time, a
// quarter of the CPU LSTM's forward at one batch row).
JAXDNN_HOST_DEVICE inline float Tanh(float x) {
#ifdef __CUDA_ARCH__
  return __nv_tanhf(x);
#else
  return HostTanh(x);
#endif
}

// sigmoid'(x) = s (1 - s), written as e / (1 + e)^2 with e = exp(-|x|): no cancellation in 1 - s.
JAXDNN_HOST_DEVICE inline float SigmoidGrad(float x) {
  const float e = Exp(-fabsf(x));
  return e / ((1.f + e) * (1.f + e));
}

// f(x), with `param` the activation's parameter (see the enum).
template <Activation kAct>
JAXDNN_HOST_DEVICE inline float Activate(float x, float param) {
  switch (kAct) {
    case Activation::kIdentity: return x;
    // Comparisons that fail for a NaN x return x, as jax.nn's maximum, minimum and where do (fmaxf and
    // fminf would return the other operand).
    case Activation::kRelu: return x <= 0.f ? 0.f : x;
    case Activation::kRelu6: return x <= 0.f ? 0.f : (x >= 6.f ? 6.f : x);
    case Activation::kLeakyRelu: return x >= 0.f ? x : param * x;
    case Activation::kElu: return x > 0.f ? x : param * Expm1(x);
    case Activation::kSigmoid: return Sigmoid(x);
    case Activation::kTanh: return ApproxTanh(x);
    // 0.5 (1 + tanh(u)) = sigmoid(2u) and 0.5 (1 + erf(z)) = 0.5 erfc(-z): no cancellation for x < 0.
    case Activation::kGeluTanh: return x * Sigmoid(2.f * kSqrt2OverPi * (x + kGeluCubic * x * x * x));
    case Activation::kGeluErf: return 0.5f * x * Erfc(-x * kInvSqrt2);
    case Activation::kSilu: return x * Sigmoid(x);
    case Activation::kSoftplus: return Log1p(Exp(-fabsf(x))) + (x > 0.f ? x : 0.f);
    case Activation::kHardTanh: return x > 1.f ? 1.f : (x < -1.f ? -1.f : x);
  }
  return x;
}

// f'(x): the derivative with respect to the input (0 at the kinks, as jax.nn's gradients).
template <Activation kAct>
JAXDNN_HOST_DEVICE inline float ActivateGrad(float x, float param) {
  switch (kAct) {
    case Activation::kIdentity: return 1.f;
    case Activation::kRelu: return x > 0.f ? 1.f : 0.f;
    case Activation::kRelu6: return x > 0.f && x < 6.f ? 1.f : 0.f;
    case Activation::kLeakyRelu: return x >= 0.f ? 1.f : param;
    case Activation::kElu: return x > 0.f ? 1.f : param * Exp(x);
    case Activation::kSigmoid: return SigmoidGrad(x);
    case Activation::kTanh: return 4.f * SigmoidGrad(2.f * x);  // 1 - tanh^2, without cancellation
    case Activation::kGeluTanh: {
      const float u2 = 2.f * kSqrt2OverPi * (x + kGeluCubic * x * x * x);
      return Sigmoid(u2) + x * SigmoidGrad(u2) * 2.f * kSqrt2OverPi * (1.f + 3.f * kGeluCubic * x * x);
    }
    case Activation::kGeluErf: return 0.5f * Erfc(-x * kInvSqrt2) + x * kInvSqrt2Pi * Exp(-0.5f * x * x);
    case Activation::kSilu: {
      const float s = Sigmoid(x);
      return s * (1.f + x * (1.f - s));
    }
    case Activation::kSoftplus: return Sigmoid(x);
    case Activation::kHardTanh: return x > 1.f || x < -1.f ? 0.f : 1.f;  // jax.nn: 1 at +-1 and at NaN
  }
  return 1.f;
}

// f(x) and f'(x) for a kind known only at run time, one element at a time: for scalar epilogues (no
// template instantiation per activation). GPU loops over packs of elements use ActivateKindN /
// ActivateGradKindN below; the CPU kernels' loops take the kind as a constant (DispatchActivation).
JAXDNN_HOST_DEVICE inline float ActivateKind(int64_t kind, float x, float param) {
  switch (static_cast<Activation>(kind)) {
#define JAXDNN_ACTIVATION_CASE(name) \
  case Activation::name: return Activate<Activation::name>(x, param);
    JAXDNN_ACTIVATION_CASES
#undef JAXDNN_ACTIVATION_CASE
  }
  return x;
}

JAXDNN_HOST_DEVICE inline float ActivateGradKind(int64_t kind, float x, float param) {
  switch (static_cast<Activation>(kind)) {
#define JAXDNN_ACTIVATION_CASE(name) \
  case Activation::name: return ActivateGrad<Activation::name>(x, param);
    JAXDNN_ACTIVATION_CASES
#undef JAXDNN_ACTIVATION_CASE
  }
  return 1.f;
}

// The same for a pack of N values: one switch for the pack, whose every case applies the
// compile-time function to all N values. A switch per element is an indirect branch per element on
// the GPU, which serializes the evaluations (their MUFU latencies add up) and splits the unrolled
// loops around it; with one switch per pack the N evaluations overlap.
template <Activation kAct, int N>
JAXDNN_HOST_DEVICE inline void ActivatePack(float (&v)[N], float param) {
  JAXDNN_UNROLL
  for (int k = 0; k < N; ++k) v[k] = Activate<kAct>(v[k], param);
}

template <int N>
JAXDNN_HOST_DEVICE inline void ActivateKindN(int64_t kind, float (&v)[N], float param) {
  switch (static_cast<Activation>(kind)) {
#define JAXDNN_ACTIVATION_CASE(name) \
  case Activation::name: ActivatePack<Activation::name>(v, param); return;
    JAXDNN_ACTIVATION_CASES
#undef JAXDNN_ACTIVATION_CASE
  }
}

// grad[k] *= f'(pre[k]) for the N values of a pack (grad holds dy on entry; identity leaves it as
// is, x * 1 being exact), one switch as above.
template <Activation kAct, int N>
JAXDNN_HOST_DEVICE inline void ActivateGradPack(const float (&pre)[N], float (&grad)[N], float param) {
  JAXDNN_UNROLL
  for (int k = 0; k < N; ++k) grad[k] *= ActivateGrad<kAct>(pre[k], param);
}

// kOmitted: a kind whose case compiles to nothing, for a caller that runs it in a kernel of its own
// (gelu_erf's derivative on a pack needs more registers than some kernels can spare, and a switch's
// registers are those of its hungriest case). The default omits the identity, whose case is a no-op.
template <int N, Activation kOmitted = Activation::kIdentity>
JAXDNN_HOST_DEVICE inline void ActivateGradKindN(int64_t kind, const float (&pre)[N], float (&grad)[N],
                                                 float param) {
  switch (static_cast<Activation>(kind)) {
#define JAXDNN_ACTIVATION_CASE(name)                                                           \
  case Activation::name:                                                                       \
    if constexpr (Activation::name != kOmitted) ActivateGradPack<Activation::name>(pre, grad, param); \
    return;
    JAXDNN_ACTIVATION_CASES
#undef JAXDNN_ACTIVATION_CASE
  }
}

template <Activation kAct>
struct ActivationTag {
  static constexpr Activation value = kAct;
};

// Calls fn(ActivationTag<kind>{}), making `kind` a compile-time constant; false for an unknown kind.
template <typename Fn>
bool DispatchActivation(int64_t kind, Fn&& fn) {
  switch (static_cast<Activation>(kind)) {
#define JAXDNN_ACTIVATION_CASE(name) \
  case Activation::name:             \
    fn(ActivationTag<Activation::name>{}); \
    return true;
    JAXDNN_ACTIVATION_CASES
#undef JAXDNN_ACTIVATION_CASE
  }
  return false;
}

}  // namespace jaxdnn
