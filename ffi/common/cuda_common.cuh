// Shared by every family's CUDA kernels: error checks, dtype conversion, vector packs, reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "common/ffi_common.h"

namespace jaxdnn {

// The start of every CUDA handler's binding: the XLA stream the kernels are launched on.
inline auto BindCuda() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }

inline ffi::Error CudaError(cudaError_t status, const char* where) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jaxdnn: CUDA error in ") + where + ": " + cudaGetErrorString(status));
}

// After a kernel launch: reports a bad launch configuration (or an earlier asynchronous error).
inline ffi::Error LaunchError(const char* kernel) { return CudaError(cudaGetLastError(), kernel); }

// The current device's SMs (1 if the query fails).
inline int SmCount() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms > 0 ? sms : 1;
}

// Whether the current device has compute capability 9 or more (TMA, clusters, programmatic launch).
inline bool Sm90OrLater() {
  int device = 0, major = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
}

// The configuration of a launch (cudaLaunchKernelEx) of `grid` blocks in 1-D clusters of
// `cluster_blocks`, for cudaOccupancyMaxActiveClusters too. Not copyable: `config` points at
// `attribute`.
struct ClusterLaunch {
  cudaLaunchAttribute attribute;
  cudaLaunchConfig_t config = {};

  ClusterLaunch(unsigned cluster_blocks, dim3 grid, dim3 block, size_t smem, cudaStream_t stream) {
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = cluster_blocks;
    attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// Blocks of `kernel` (with `block` threads and `smem` bytes) that fit on the device at once.
template <typename Kernel>
inline int ResidentBlocks(Kernel kernel, int block, size_t smem) {
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block, smem);
  return per_sm > 0 ? per_sm * SmCount() : 1;
}

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T FromFloat(float v);
template <> __device__ __forceinline__ float FromFloat<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half FromFloat<__half>(float v) { return __float2half_rn(v); }

// N elements moved as one aligned access (16 bytes when N * sizeof(T) == 16).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Stores `value` to global memory at p (aligned to its size) as whole 16/8/4-byte words. Assigning
// a struct of 16-bit floats may compile to 2- or 4-byte stores, a fraction of the write bandwidth;
// the explicit vector store cannot be split.
template <typename Value>
__device__ __forceinline__ void StoreWords(void* p, const Value& value) {
  constexpr int kBytes = sizeof(Value);
  if constexpr (kBytes % 16 == 0) {
    uint32_t w[kBytes / 4];
    memcpy(w, &value, kBytes);
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(static_cast<char*>(p) + 16 * i),
                   "r"(w[4 * i]), "r"(w[4 * i + 1]), "r"(w[4 * i + 2]), "r"(w[4 * i + 3])
                   : "memory");
    }
  } else if constexpr (kBytes == 8) {
    uint32_t w[2];
    memcpy(w, &value, 8);
    asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(p), "r"(w[0]), "r"(w[1]) : "memory");
  } else {
    static_assert(kBytes <= 4 && (kBytes & (kBytes - 1)) == 0, "StoreWords: 1, 2, 4, 8 or 16k bytes");
    using Word = std::conditional_t<kBytes == 4, uint32_t, std::conditional_t<kBytes == 2, uint16_t, uint8_t>>;
    Word word;
    memcpy(&word, &value, kBytes);
    *static_cast<Word*>(p) = word;
  }
}

// Elements of T in one 16-byte access.
template <typename T>
constexpr int kVec16 = 16 / sizeof(T);

// Asynchronous 16-byte global -> shared copies (sm_80+): loads in flight without holding registers.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(gmem) : "memory");
}
// A 16-byte copy that lands zeros instead where `valid` is false (then nothing is read: `gmem` need
// only be some valid address).
__device__ __forceinline__ void CpAsync16OrZeros(void* smem, const void* gmem, bool valid) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most `kPending` of this thread's committed copy groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// --- TF32 mma.sync: m16n8k8, float32 sums. Fragments (lane = 4 g + t): A [16 x 8] holds a0 (g, t),
// a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4); B [8 x 8] b0 (k t, n g), b1 (k t + 4, n g); D [16 x 8]
// d0 (g, 2 t), d1 (g, 2 t + 1), d2 (g + 8, 2 t), d3 (g + 8, 2 t + 1).

// v rounded to TF32 (nearest, ties away from zero: cuBLAS's conversion), as the mma's operand bits.
__device__ __forceinline__ uint32_t Tf32(float v) {
  uint32_t bits;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(v));
  return bits;
}

__device__ __forceinline__ void MmaTf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// bf16 mma.sync: m16n8k16, float32 sums. Fragments: A [16 x 16] holds a0 (g, 2t..2t+1), a1 (g + 8,
// 2t..2t+1), a2 (g, 2t+8..2t+9), a3 (g + 8, 2t+8..2t+9), two bf16 a register, the lower k in the low
// half; B [16 x 8] b0 (k 2t..2t+1, n g), b1 (k 2t+8..2t+9, n g); D as MmaTf32's.
__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Streams the indices first, first + step, ... < end through kSlots stages of a thread's own
// shared-memory slots, kSlots - 1 indices ahead of use, so that the loads in flight hold no
// registers: issue(stage, r) issues index r's copies (CpAsync16) into stage `stage`, use(stage, r)
// runs once they have landed. Each thread reads only the slots it filled: no block barrier.
// ready() runs once, after the first kSlots - 1 indices' copies are issued and before the first use
// (a kernel launched early waits there for the previous one, with its first loads in flight).
template <int kSlots, typename Issue, typename Use, typename Ready>
__device__ __forceinline__ void StreamThroughSlots(int64_t first, int64_t step, int64_t end, Issue&& issue,
                                                   Use&& use, Ready&& ready) {
  auto issue_group = [&](int stage, int64_t r) {
    if (r < end) issue(stage, r);
    CpAsyncCommit();  // an empty group past the end keeps the wait count uniform
  };
#pragma unroll
  for (int stage = 0; stage < kSlots - 1; ++stage) issue_group(stage, first + stage * step);
  ready();
  int stage = 0;
  for (int64_t r = first; r < end; r += step) {
    issue_group((stage + kSlots - 1) % kSlots, r + (kSlots - 1) * step);  // the slot read last iteration
    CpAsyncWait<kSlots - 1>();                                            // r's copies have landed
    use(stage, r);
    stage = (stage + 1) % kSlots;
  }
  CpAsyncWait<0>();
}

template <int kSlots, typename Issue, typename Use>
__device__ __forceinline__ void StreamThroughSlots(int64_t first, int64_t step, int64_t end, Issue&& issue,
                                                   Use&& use) {
  StreamThroughSlots<kSlots>(first, step, end, issue, use, [] {});
}

// Programmatic dependent launch (sm_90): a kernel launched by LaunchEarly may be scheduled while
// the kernel before it on the stream is still finishing (which hides the launch gap between
// them), and waits in WaitForPreviousKernel until that kernel, and so everything before it, has
// finished and its writes are visible: it must call it before it reads anything that kernel (or
// one before it) wrote, and before it writes anything. A kernel calling LetNextKernelLaunch lets
// the next one (launched early) take the SM slots its blocks free; launched early itself, it calls
// it after its own WaitForPreviousKernel, so that whatever the next kernel reads before its wait
// is complete (or before it, where the next kernel reads nothing before its wait that the kernel
// before this one writes). On older GPUs, and in kernels launched without the attribute, both are no-ops.
__device__ __forceinline__ void WaitForPreviousKernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void LetNextKernelLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The attribute is set only on GPUs of compute capability >= 9 (elsewhere an ordinary launch).
template <typename... Params, typename... Args>
cudaError_t LaunchEarly(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                        Args&&... args) {
  const bool early = Sm90OrLater();
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = early ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// out[i] = the sum over s < slices of partial[s * count + i], in slice order, rounded once: the last
// step of a reduction split into slices of float32 partial sums (deterministic: no atomics).
template <typename T>
__global__ void SumSlicesKernel(const float* __restrict__ partial, int64_t slices, int64_t count,
                                T* __restrict__ out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    float total = 0.f;
    for (int64_t s = 0; s < slices; ++s) total += partial[s * count + i];
    out[i] = FromFloat<T>(total);
  }
}

}  // namespace jaxdnn
