// Hopper (sm_90a) building blocks for tensor-core kernels written without CUTLASS's templates:
// mbarriers, TMA tile loads, wgmma (warpgroup matrix multiply) with its shared-memory descriptors,
// register reallocation, named barriers and cluster barriers. Everything here is a thin wrapper over one PTX
// instruction; the kernels compose them (ffi/attention/attention_sm90*.cu).
//
// Shared-memory tiles: a tile of R rows x 64 16-bit columns (128 bytes a row) written by TMA with
// the 128-byte swizzle is the canonical wgmma operand: K-major (the 64 columns are the reduction
// axis: rows are M or N) or MN-major (the 64 columns are M or N: rows are the reduction axis).
// Wider tiles are stored as consecutive 64-column chunks of R x 128 bytes. Every chunk starts on a
// 1024-byte boundary (the swizzle pattern repeats every 8 rows of 128 bytes).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace jaxdnn {
namespace sm90 {

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The 1024-byte aligned start of dynamic shared memory (the swizzled tiles need it); kernels ask
// for 1024 bytes more than they use.
__device__ __forceinline__ uint8_t* AlignedShared(uint8_t* raw) {
  const uint32_t address = SharedAddress(raw);
  return raw + ((1024 - (address & 1023)) & 1023);
}

// --- mbarriers ---------------------------------------------------------------------------------

__device__ __forceinline__ void BarrierInit(uint64_t* bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SharedAddress(bar)), "r"(arrivals));
}
// Makes the initialized barriers visible to the TMA unit (then __syncthreads before use).
__device__ __forceinline__ void BarrierInitFence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also announces `bytes` the TMA will deliver in this phase.
__device__ __forceinline__ void BarrierArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SharedAddress(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void BarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SharedAddress(bar)) : "memory");
}
// Waits until the phase of parity `phase` has completed.
__device__ __forceinline__ void BarrierWait(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(SharedAddress(bar)),
      "r"(phase)
      : "memory");
}

// --- a ring of pipeline stages --------------------------------------------------------------------
// Stage use e (0, 1, 2, ...) takes slot e % kRing in phase e / kRing: its `full` barrier completes
// with the producer's one arrival and its TMA bytes, its `empty` one with the consumers' releases.

// Thread 0's initialization of the ring's barriers (each `empty` one completed by `releases`
// arrivals) and of `loaded`, a single-arrival barrier (or none), made visible to the TMA unit; the
// block synchronizes after.
template <int kRing>
__device__ __forceinline__ void InitRing(uint64_t* full, uint64_t* empty, int releases, uint64_t* loaded = nullptr) {
  for (int s = 0; s < kRing; ++s) {
    BarrierInit(&full[s], 1);
    BarrierInit(&empty[s], releases);
  }
  if (loaded != nullptr) BarrierInit(loaded, 1);
  BarrierInitFence();
}
// Waits for the TMA loads of stage use e.
template <int kRing>
__device__ __forceinline__ void WaitFull(uint64_t* full, int e) {
  BarrierWait(&full[e % kRing], (e / kRing) & 1);
}
// The producer's wait before reusing slot e % kRing: its use e - kRing has been released.
template <int kRing>
__device__ __forceinline__ void WaitEmpty(uint64_t* empty, int e) {
  if (e >= kRing) BarrierWait(&empty[e % kRing], (e / kRing - 1) & 1);
}

// --- TMA ---------------------------------------------------------------------------------------

// Loads the box at coordinates (c0 innermost .. c3) of a 4-D tensor map into shared memory,
// completing `bytes` (the whole box, out-of-bounds parts zero-filled) on `bar`.
__device__ __forceinline__ void TmaLoad4d(void* smem, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                          int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(SharedAddress(smem)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(SharedAddress(bar))
      : "memory");
}

// Loads an im2col box of a 4-D [N][H][W][C] tensor map (cuTensorMapEncodeIm2col): the map's pixels per
// column, consecutive output positions walked from the one whose window starts at (w, h) of image n
// (within the map's bounding box, at its traversal strides), each pixel read at (w + offset_w, h +
// offset_h): its channels c .. c + channels per pixel. Out-of-bounds pixels are zero-filled.
__device__ __forceinline__ void TmaLoadIm2col4d(void* smem, const CUtensorMap* map, uint64_t* bar, int c, int w,
                                                int h, int n, uint16_t offset_w, uint16_t offset_h) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6], {%7, %8};\n" ::"r"(SharedAddress(smem)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c), "r"(w), "r"(h), "r"(n), "r"(SharedAddress(bar)), "h"(offset_w),
      "h"(offset_h)
      : "memory");
}

// Adds the shared-memory box to the box at coordinates (c0 innermost .. c3) of a 4-D float32 tensor
// map (elementwise, by the TMA unit; out-of-bounds parts dropped), in this thread's current bulk
// group (BulkWaitAll / BulkWaitReads complete it).
__device__ __forceinline__ void TmaReduceAdd4d(const CUtensorMap* map, const void* smem, int c0, int c1, int c2,
                                               int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(SharedAddress(smem))
      : "memory");
}

// Stores the shared-memory box to the box at coordinates (c0 innermost .. c3) of a 4-D tensor map
// (out-of-bounds parts dropped), in this thread's current bulk group (BulkWaitAll / BulkWaitReads
// complete it).
__device__ __forceinline__ void TmaStore4d(const CUtensorMap* map, const void* smem, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(SharedAddress(smem))
      : "memory");
}

__device__ __forceinline__ void TmaPrefetchDescriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// --- warpgroups ----------------------------------------------------------------------------------

// Register reallocation between warpgroups (the kernel needs __launch_bounds__(threads, 1)).
template <int kRegisters>
__device__ __forceinline__ void RegistersIncrease() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void RegistersDecrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// This thread's warpgroup, as a value the compiler knows to be uniform across the warp: wgmma under
// a branch on it is not serialized as in a divergent path.
__device__ __forceinline__ int WarpgroupIndex() { return __shfl_sync(0xffffffff, int(threadIdx.x) / 128, 0); }

// A barrier among `threads` threads (a multiple of 32) on hardware barrier `id` (1..15; 0 is
// __syncthreads).
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrives at barrier `id` without waiting (the other threads of the `threads` sync on it).
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Makes this thread's ordinary shared-memory writes visible to the async proxy (wgmma, TMA) that
// reads them after the next barrier.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// --- global-memory synchronization between CTAs --------------------------------------------------

__device__ __forceinline__ int LoadAcquire(const int* p) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(p) : "memory");
  return value;
}
// global[0 .. bytes / 4) += shared[...] as float32, by the TMA unit (both 16-byte aligned, bytes a
// multiple of 16), in this thread's current bulk group.
__device__ __forceinline__ void BulkAddToGlobal(float* global, const float* shared, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(global),
               "r"(SharedAddress(shared)), "r"(bytes)
               : "memory");
}
// Closes this thread's bulk group and waits until every bulk operation it issued has completed
// (its writes performed, its shared-memory reads done).
__device__ __forceinline__ void BulkWaitAll() {
  asm volatile("cp.async.bulk.commit_group;\ncp.async.bulk.wait_group 0;\n" ::: "memory");
}
// Closes this thread's bulk group and waits until every bulk operation it issued, but those of its
// last kPending groups, has read its shared-memory source (the buffer may be reused; the global
// writes may still be under way).
template <int kPending = 0>
__device__ __forceinline__ void BulkWaitReads() {
  asm volatile("cp.async.bulk.commit_group;\ncp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// Orders this thread's generic-proxy global accesses with its async-proxy (bulk) ones.
__device__ __forceinline__ void FenceProxyAsyncGlobal() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// --- clusters ------------------------------------------------------------------------------------

// The cluster-wide barrier in its two halves: every thread of every CTA of the cluster arrives
// (releasing its shared-memory writes to the cluster), then waits for all of them (acquiring the
// others'). Work may go between the halves. The .aligned forms want the warp converged.
__device__ __forceinline__ void ClusterArrive() {
  __syncwarp();
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void ClusterSync() {
  ClusterArrive();
  ClusterWait();
}

// --- wgmma ---------------------------------------------------------------------------------------

// Orders this thread's register and shared-memory writes before the next wgmma reads them.
__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending committed wgmma groups of this warpgroup are in flight.
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accesses of accumulator registers across an asynchronous wgmma:
// the registers are "used and redefined" here, between the wgmma and the wait that completes it.
template <int kCount>
__device__ __forceinline__ void FenceRegisters(float (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// The same for one A fragment (4 packed pairs) or for A fragments in registers (read by the wgmma
// until its wait).
__device__ __forceinline__ void FenceRegisters(uint32_t (&r)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[j])::"memory");
}
template <int kRows>
__device__ __forceinline__ void FenceRegisters(uint32_t (&r)[kRows][4]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i) FenceRegisters(r[i]);
}

// The shared-memory descriptor of a 128-byte-swizzled operand (see the top of this file).
// K-major: 8-row core groups 1024 bytes apart (the stride byte offset); the leading byte offset is
// unused. MN-major: 8-row groups along the reduction axis 1024 bytes apart, and the 64-element
// chunks along M/N `chunk_bytes` apart (the leading byte offset). Fields are in 16-byte units.
__device__ __forceinline__ uint64_t DescriptorKMajor(const void* smem) {
  const uint64_t address = SharedAddress(smem);
  return ((address & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
__device__ __forceinline__ uint64_t DescriptorMNMajor(const void* smem, uint32_t chunk_bytes) {
  const uint64_t address = SharedAddress(smem);
  return ((address & 0x3FFFF) >> 4) | (uint64_t((chunk_bytes >> 4) & 0x3FFF) << 16) |
         (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Two floats as one register of two 16-bit values (the low half is the first): an A operand
// fragment of wgmma taken from registers.
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t PackPair<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t PackPair<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// D[64 x N] (+)= A[64 x 16] B[16 x N] for one warpgroup, float32 accumulators, 16-bit T operands.
// SS: A and B from shared memory (descriptors); RS: A from registers (4 packed pairs a thread).
// kTransB = 0: B K-major (B's rows are N), 1: B MN-major (B's rows are the reduction axis); SS's
// kTransA likewise for A (1: A's rows in shared memory are the reduction axis, M contiguous).
// accumulate = 0 overwrites D. The accumulator fragment of thread t (warp w = t / 32, lane l):
// element i is row 16 w + l / 4 + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 (l % 4) + (i & 1).
// The A fragment from registers is the same layout for a 64 x 16 slice, packed in pairs.
template <int N, typename T>
struct Wgmma;

// The accumulators of a wgmma N wide (N / 2 floats a thread): JAXDNN_WGMMA_R<N / 2> lists their
// registers in the instruction, JAXDNN_WGMMA_D<N / 2> their "+f" operands.
#define JAXDNN_WGMMA_R16 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define JAXDNN_WGMMA_D16 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define JAXDNN_WGMMA_R32 JAXDNN_WGMMA_R16 \
  ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define JAXDNN_WGMMA_D32 JAXDNN_WGMMA_D16, \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define JAXDNN_WGMMA_R64 JAXDNN_WGMMA_R32 \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47" \
  ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define JAXDNN_WGMMA_D64 JAXDNN_WGMMA_D32, \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define JAXDNN_WGMMA_R128 JAXDNN_WGMMA_R64 \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79" \
  ", %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95" \
  ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111" \
  ", %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define JAXDNN_WGMMA_D128 JAXDNN_WGMMA_D64, \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// Wgmma<N, T> for T named PTX in the instruction ("bf16", "f16"), with accumulators R and D (above).
// Q to Q6 are the operand numbers N / 2 to N / 2 + 6 (the preprocessor cannot add): SS's a, b,
// accumulate, kTransB, kTransA; RS's 4 A registers, b, accumulate, kTransB.
#define JAXDNN_WGMMA(N, T, PTX, R, D, Q, Q1, Q2, Q3, Q4, Q5, Q6)                                      \
  template <>                                                                                         \
  struct Wgmma<N, T> {                                                                                \
    template <int kTransB, int kTransA = 0>                                                           \
    static __device__ __forceinline__ void SS(float* d, uint64_t a, uint64_t b, int accumulate) {     \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #Q2 ", 0;\n"                                  \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " {" R "}, %" #Q     \
                   ", %" #Q1 ", p, 1, 1, %" #Q4 ", %" #Q3 ";\n}\n"                                    \
                   : D                                                                                \
                   : "l"(a), "l"(b), "r"(accumulate), "n"(kTransB), "n"(kTransA));                    \
    }                                                                                                 \
    template <int kTransB>                                                                            \
    static __device__ __forceinline__ void RS(float* d, const uint32_t* a, uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #Q5 ", 0;\n"                                  \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " {" R "}, {%" #Q    \
                   ", %" #Q1 ", %" #Q2 ", %" #Q3 "}, %" #Q4 ", p, 1, 1, %" #Q6 ";\n}\n"               \
                   : D                                                                                \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransB)); \
    }                                                                                                 \
  };

JAXDNN_WGMMA(32, __nv_bfloat16, "bf16", JAXDNN_WGMMA_R16, JAXDNN_WGMMA_D16, 16, 17, 18, 19, 20, 21, 22)
JAXDNN_WGMMA(32, __half, "f16", JAXDNN_WGMMA_R16, JAXDNN_WGMMA_D16, 16, 17, 18, 19, 20, 21, 22)
JAXDNN_WGMMA(64, __nv_bfloat16, "bf16", JAXDNN_WGMMA_R32, JAXDNN_WGMMA_D32, 32, 33, 34, 35, 36, 37, 38)
JAXDNN_WGMMA(64, __half, "f16", JAXDNN_WGMMA_R32, JAXDNN_WGMMA_D32, 32, 33, 34, 35, 36, 37, 38)
JAXDNN_WGMMA(128, __nv_bfloat16, "bf16", JAXDNN_WGMMA_R64, JAXDNN_WGMMA_D64, 64, 65, 66, 67, 68, 69, 70)
JAXDNN_WGMMA(128, __half, "f16", JAXDNN_WGMMA_R64, JAXDNN_WGMMA_D64, 64, 65, 66, 67, 68, 69, 70)
JAXDNN_WGMMA(256, __nv_bfloat16, "bf16", JAXDNN_WGMMA_R128, JAXDNN_WGMMA_D128, 128, 129, 130, 131, 132, 133, 134)
JAXDNN_WGMMA(256, __half, "f16", JAXDNN_WGMMA_R128, JAXDNN_WGMMA_D128, 128, 129, 130, 131, 132, 133, 134)

#undef JAXDNN_WGMMA
#undef JAXDNN_WGMMA_R16
#undef JAXDNN_WGMMA_D16
#undef JAXDNN_WGMMA_R32
#undef JAXDNN_WGMMA_D32
#undef JAXDNN_WGMMA_R64
#undef JAXDNN_WGMMA_D64
#undef JAXDNN_WGMMA_R128
#undef JAXDNN_WGMMA_D128

}  // namespace sm90
}  // namespace jaxdnn
