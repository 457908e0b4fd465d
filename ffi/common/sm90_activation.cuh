// The run-time activation of the Hopper tensor-core kernels' CUTLASS epilogues (GEMM and
// convolution): one instantiation serves every activation kind.
#pragma once

#include <cutlass/array.h>
#include <cutlass/cutlass.h>

#include "common/activation.h"

namespace jaxdnn {
namespace sm90 {

// The activation's kind and parameter, known at run time: one instantiation serves every kind.
struct ActivationArgs {
  int kind = 0;  // Activation::kIdentity
  float param = 0.f;
};

// The epilogue's activation functor. CUTLASS applies it to a fragment of accumulators at a time, so
// the kind's switch runs once per fragment and its elements' evaluations overlap (the scalar form
// gives CUTLASS the Arguments type).
template <class T>
struct RuntimeActivation {
  using Arguments = ActivationArgs;
  CUTLASS_HOST_DEVICE T operator()(T x, const Arguments& args) const {
    return ActivateKind(args.kind, x, args.param);
  }
};

template <int N>
struct RuntimeActivation<cutlass::Array<float, N>> {
  using Arguments = ActivationArgs;
  CUTLASS_HOST_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> v,
                                                         const Arguments& args) const {
    float values[N];  // in registers: the copies compile away
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) values[i] = v[i];
    ActivateKindN<N>(args.kind, values, args.param);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) v[i] = values[i];
    return v;
  }
};

}  // namespace sm90
}  // namespace jaxdnn
