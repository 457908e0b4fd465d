// Which vector instructions the CPU kernels' hot loops run with: the widest that the CPU has among
// the builds made of them, capped by the environment variable JAXDNN_CPU_ISA ("avx512", "avx2" or
// "baseline", as oneDNN's ONEDNN_MAX_CPU_ISA; other values are ignored) to compare or test the
// builds. Chosen once per process, at the first call.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <cstring>

// For the functions that the CPU kernels' vectorized loops call: GCC leaves calls out of line in
// large functions (a dispatch over activations and dtypes inlines many loops into one), and a loop
// with a call in it stays scalar.
#define JAXDNN_ALWAYS_INLINE __attribute__((always_inline))

namespace jaxdnn {

enum class CpuIsa { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };  // in order of width

// The builds exist for x86-64 with GCC or Clang (function multiversioning by target attributes).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define JAXDNN_CPU_ISA_VARIANTS 1
#endif

inline CpuIsa ActiveCpuIsa() {
  static const CpuIsa isa = [] {
    CpuIsa has = CpuIsa::kBaseline;
#ifdef JAXDNN_CPU_ISA_VARIANTS
    if (__builtin_cpu_supports("avx512f")) {
      has = CpuIsa::kAvx512;
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      has = CpuIsa::kAvx2;
    }
#endif
    const char* cap = std::getenv("JAXDNN_CPU_ISA");
    if (cap != nullptr && std::strcmp(cap, "avx2") == 0) return std::min(has, CpuIsa::kAvx2);
    if (cap != nullptr && std::strcmp(cap, "baseline") == 0) return CpuIsa::kBaseline;
    return has;
  }();
  return isa;
}

// Runs fn() compiled for AVX2 and FMA where the active ISA has them (avx2 or avx512), else for the
// baseline: for the loops that GCC vectorizes by itself (the elementwise ones). fn is a lambda
// declared JAXDNN_ALWAYS_INLINE, whose body, and every call in it, is inlined into the variant (a
// call left out of line would run the baseline's code, one value at a time). One variant serves
// AVX-512 CPUs too: GCC's vectorizer keeps to 256-bit vectors there.
#ifdef JAXDNN_CPU_ISA_VARIANTS
template <typename Fn>
__attribute__((target("avx2,fma"))) void CallAvx2(const Fn& fn) {
  fn();
}
#endif
template <typename Fn>
void CallVectorized(const Fn& fn) {
#ifdef JAXDNN_CPU_ISA_VARIANTS
  if (ActiveCpuIsa() >= CpuIsa::kAvx2) return CallAvx2(fn);
#endif
  fn();
}

// Runs fn(IsaTag<isa>{}) compiled for the active ISA: AVX-512F, AVX2 with FMA, or the baseline, for
// loops that pick their register tiles from the ISA at compile time (common/matmul_cpu.h). fn is a
// lambda declared JAXDNN_ALWAYS_INLINE, as for CallVectorized.
template <CpuIsa kIsa>
struct IsaTag {
  static constexpr CpuIsa value = kIsa;
};
#ifdef JAXDNN_CPU_ISA_VARIANTS
template <typename Fn>
__attribute__((target("avx512f"))) void CallAvx512Tag(const Fn& fn) {
  fn(IsaTag<CpuIsa::kAvx512>{});
}
template <typename Fn>
__attribute__((target("avx2,fma"))) void CallAvx2Tag(const Fn& fn) {
  fn(IsaTag<CpuIsa::kAvx2>{});
}
#endif
template <typename Fn>
void CallForIsa(const Fn& fn) {
#ifdef JAXDNN_CPU_ISA_VARIANTS
  if (ActiveCpuIsa() == CpuIsa::kAvx512) return CallAvx512Tag(fn);
  if (ActiveCpuIsa() == CpuIsa::kAvx2) return CallAvx2Tag(fn);
#endif
  fn(IsaTag<CpuIsa::kBaseline>{});
}

inline const char* CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx2:
      return "avx2";
    default:
      return "baseline";
  }
}

}  // namespace jaxdnn
