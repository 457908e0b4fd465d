// The square-window (3 x 3, 5 x 5, 7 x 7) depthwise kernels streamed through TMA
// (depthwise_sm90.h), for 16-bit values.
//
// A depthwise 3 x 3 conv does 9 multiply-adds per value it moves: it runs at DRAM speed only if
// every SM keeps tens of kilobytes of loads in flight while it computes. Here the TMA unit keeps
// them: a block owns 8-channel vectors [chunk * vectors, + vectors) of `cols` output columns and
// walks its units (blocks of `rows` output rows of one image and column tile) through a ring of
// `stages` shared-memory stages, each holding the unit's input box ((rows - 1) * s + k input rows x
// (cols - 1) * s + k input columns x the vectors for a k x k window; zeros outside x, which is the
// padding). One thread issues the loads; a block-wide barrier after each unit's compute frees its
// stage for the load `stages` units ahead, so the stores and the next units' loads overlap the
// compute. A thread takes `lanes` channels (one word of the box's pixels) of `thread_cols`
// adjacent output columns and computes their `rows` outputs: each input row of the box is read
// once from shared memory and meets up to k outputs a column. For 3 x 3 a thread takes a 16-byte
// vector (8 channels) of one column; a 5 x 5 or 7 x 7 window's taps would not fit in registers for
// 8 channels, so there a thread takes 2 channels: of 3 columns in the forward (the 7 x 7's 49
// multiply-adds per value make it bound by issue: its 3 columns share each loaded input value among
// up to 3 outputs, and 3, odd, keeps the two pixels a warp reads at once in different banks), of
// one column in wgrad. (A wgrad of 3 columns a thread, skipping the columns past the image's edge
// by a branch on the thread's column count, let them reach dw on an H200: an inf in x times TMA's
// zero dy made NaN taps, though the PTX held the branches; one column a thread skips a whole unit
// past the edge, as the 3 x 3 wgrad does, and passed. Its speed against 3 columns is not measured.)
//
// Units: unit u = (image, row block, column tile), column tile fastest; block (chunk, slice) takes
// units slice, slice + slices, ... so the blocks that run together read neighbouring rows (the
// boxes' shared rows then come from L2). The forward has one wave of blocks (at most kWaveBlocks);
// wgrad's slice count is a function of g alone (each slice's float32 partial dw is summed in a
// fixed order: the same bits on every run), its block adds its threads' k^2 taps per column in
// order at the end.
#include "conv/depthwise_sm90.h"

#include <cuda.h>

#include <algorithm>
#include <climits>
#include <string>
#include <type_traits>

#include "common/cuda_common.cuh"
#include "common/sm90_async.cuh"
#include "conv/depthwise_pack.cuh"

namespace jaxdnn {
namespace {

constexpr int kThreads = 192;     // at most, per block: two blocks of up to 168 registers a thread per SM
constexpr int kMaxStages = 4;     // more measured no faster; fewer than 3 starve the loop
constexpr int kMinStages = 3;
// Output rows per unit: a box row then feeds up to 3 outputs ((rows - 1) * s + 3 rows for `rows`
// outputs); 8 would spill at the register bound, 2 would read each row twice as often. The forward
// takes kTallRows where that computes fewer rows past the image's last (14 x 14 and 7 x 7 images:
// H200, 14 x 14 x 1024, 0.0212 -> 0.0196 ms); wgrad's stages (x's box and dy's) would leave room for
// only two stages of 7 rows, and 56 x 56 ran 5% slower forward with them.
constexpr int kRows = 4;
constexpr int kTallRows = 7;
constexpr int kBoxLimit = 256;    // TMA: at most 256 elements along each box dimension
constexpr size_t kBlockShared = 72 * 1024;  // 3 x 3: three blocks per SM (as many as their registers allow)
constexpr size_t kWideBlockShared = 110 * 1024;  // 5 x 5 and 7 x 7: two blocks per SM
constexpr int kHeader = 128;      // the stages' barriers, before the 128-byte aligned stages
// At most this many blocks (3 a SM on an H100/H200's 132): a constant, so wgrad's slices are a
// function of g alone; the forward takes fewer when fewer fit at once (one wave).
constexpr int64_t kWaveBlocks = 3 * 132;

__host__ __device__ int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// What a thread of a kWindow x kWindow kernel takes: kLanes channels (a Word of a box pixel) of
// kCols adjacent output columns (see the top of the file).
__host__ __device__ constexpr int LanesOf(int window) { return window == 3 ? 8 : 2; }
__host__ __device__ constexpr int ThreadColsOf(int window, bool wgrad) { return window == 3 || wgrad ? 1 : 3; }
template <int kWindow, bool kWgrad>
struct ThreadShape {
  static constexpr int kLanes = LanesOf(kWindow);
  static constexpr int kCols = ThreadColsOf(kWindow, kWgrad);
  using Word = std::conditional_t<kLanes == 8, uint4, uint32_t>;
};

struct RowsPlan {
  int window = 3;        // k, the window's height and width
  int stride = 1;        // s, on both H and W
  int vectors = 1;       // 8-channel vectors per pixel a block takes, a power of two <= 16
  int cols = 1;          // output columns per block, a multiple of thread_cols
  int thread_cols = 1;   // output columns per thread, ThreadColsOf(k, wgrad)
  int rows = 1;          // output rows per unit
  int span_cols = 3, span_rows = 3;  // the input box: (cols - 1) * s + k, (rows - 1) * s + k
  int stages = kMaxStages;
  int stage_bytes = 0;   // the input box, and wgrad's dy box after it, 128-byte aligned
  int x_box_bytes = 0, dy_box_bytes = 0, dy_offset = 0;  // dy's box starts dy_offset bytes into a stage
  int64_t chunks = 1, col_tiles = 1, row_blocks = 1, images = 1;
  int64_t units = 0;
  int64_t slices = 1;    // blocks per chunk

  // A pixel's words (a thread's channels each) in the block's vectors, and the block's threads.
  __host__ __device__ int Words() const { return vectors * 8 / LanesOf(window); }
  __host__ __device__ int Threads() const { return Words() * (cols / thread_cols); }
  size_t Shared(bool wgrad) const {
    const size_t ring = size_t(stages) * stage_bytes;
    // wgrad's reduction reuses the ring: every thread's k^2 taps of its channels as float32.
    const size_t sums = size_t(Threads()) * window * window * LanesOf(window) * sizeof(float);
    return kHeader + (wgrad ? std::max(ring, sums) : ring);
  }
};

RowsPlan MakeRowsPlan(const ConvGeometry& g, bool wgrad) {
  RowsPlan plan;
  plan.window = int(g.window[1]);
  plan.stride = int(g.stride[1]);
  const int thread_cols = ThreadColsOf(plan.window, wgrad);
  plan.thread_cols = thread_cols;
  plan.rows = !wgrad && plan.window == 3 &&
                      CeilDiv(g.out[1], kTallRows) * kTallRows < CeilDiv(g.out[1], kRows) * kRows
                  ? kTallRows
                  : kRows;
  const int64_t vectors = g.channels / 8, width = g.out[2];
  const size_t shared = plan.window == 3 ? kBlockShared : kWideBlockShared;
  plan.vectors = 16;
  while (plan.vectors > 1 && plan.vectors / 2 >= vectors) plan.vectors /= 2;
  // At least 4 vectors (64 bytes of a pixel: whole sectors per TMA row) unless C is smaller; 8
  // (and tiles a third narrower) measured 15% slower on 56 x 56 x 256.
  while (plan.vectors > 4 && plan.Words() * CeilDiv(width, thread_cols) > kThreads) plan.vectors /= 2;
  const int64_t box_cols = ((kBoxLimit - plan.window) / plan.stride + 1) / thread_cols * thread_cols;
  int64_t tile = std::min<int64_t>({width, kThreads / plan.Words() * thread_cols, box_cols});
  for (;;) {  // the widest tile whose boxes leave room for kMinStages stages
    plan.col_tiles = CeilDiv(width, tile);
    plan.cols = int(RoundUp(CeilDiv(width, plan.col_tiles), thread_cols));
    plan.span_cols = (plan.cols - 1) * plan.stride + plan.window;
    plan.span_rows = (plan.rows - 1) * plan.stride + plan.window;
    plan.x_box_bytes = plan.span_rows * plan.span_cols * plan.vectors * 16;
    plan.dy_box_bytes = wgrad ? plan.rows * plan.cols * plan.vectors * 16 : 0;
    plan.dy_offset = int(RoundUp(plan.x_box_bytes, 128));
    plan.stage_bytes = plan.dy_offset + int(RoundUp(plan.dy_box_bytes, 128));
    plan.stages = int(std::min<size_t>(kMaxStages, (shared - kHeader) / plan.stage_bytes));
    if (plan.stages >= kMinStages || plan.Threads() <= 32) break;
    if (plan.vectors > 2) {
      plan.vectors /= 2;
    } else {
      tile = (plan.cols + 1) / 2;
    }
  }
  plan.stages = std::max(plan.stages, 2);
  plan.chunks = CeilDiv(vectors, plan.vectors);
  plan.row_blocks = CeilDiv(g.out[1], plan.rows);
  plan.images = g.batch * g.out[0];
  plan.units = plan.images * plan.row_blocks * plan.col_tiles;
  return plan;
}

// A unit's place: image, first output row and column.
// (RowsTake and the launchers keep every count here below 2^31: 32-bit divisions.)
struct Unit {
  int image, p0, q0;

  __device__ Unit(const RowsPlan& plan, int unit) {
    const int col_tiles = int(plan.col_tiles), row_blocks = int(plan.row_blocks);
    const int rest = unit / col_tiles;
    q0 = (unit - rest * col_tiles) * plan.cols;
    image = rest / row_blocks;
    p0 = (rest - image * row_blocks) * plan.rows;
  }
};

// The ring: stage buffers after a 128-byte header of their barriers.
struct Ring {
  uint64_t* full;
  uint8_t* stages;
  int stage_bytes;

  __device__ Ring(uint8_t* shared, const RowsPlan& plan)
      : full(reinterpret_cast<uint64_t*>(shared)), stages(shared + kHeader), stage_bytes(plan.stage_bytes) {}
  template <typename Word>
  __device__ const Word* X(int stage) const {
    return reinterpret_cast<const Word*>(stages + stage * stage_bytes);
  }
  template <typename Word>
  __device__ const Word* Dy(int stage, const RowsPlan& plan) const {
    return reinterpret_cast<const Word*>(stages + stage * stage_bytes + plan.dy_offset);
  }
};

// Thread 0: the loads of the block's j-th unit into `stage` (x's box, and dy's for wgrad).
__device__ __forceinline__ void IssueUnit(const RowsPlan& plan, const ConvGeometry& g, const Ring& ring,
                                          const CUtensorMap* x_map, const CUtensorMap* dy_map, int chunk,
                                          int unit_index, int stage) {
  const Unit unit(plan, unit_index);
  const int c = chunk * plan.vectors * 8;
  uint8_t* base = ring.stages + stage * ring.stage_bytes;
  sm90::BarrierArriveExpectTx(&ring.full[stage], plan.x_box_bytes + plan.dy_box_bytes);
  sm90::TmaLoad4d(base, x_map, &ring.full[stage], c, unit.q0 * plan.stride - int(g.pad[2]),
                  unit.p0 * plan.stride - int(g.pad[1]), unit.image);
  if (dy_map != nullptr) sm90::TmaLoad4d(base + plan.dy_offset, dy_map, &ring.full[stage], c, unit.q0, unit.p0, unit.image);
}

// The block's walk: for each of its units j (in order), waits for the unit's stage, calls
// compute(unit, stage), frees the stage for unit j + stages, then calls finish(unit) (the stores,
// which overlap that load). (Per-warp empty barriers instead of the block-wide one, letting the
// warps drift apart, measured the same.)
template <typename Compute, typename Finish>
__device__ __forceinline__ void WalkUnits(const RowsPlan& plan, const ConvGeometry& g, const Ring& ring,
                                          const CUtensorMap* x_map, const CUtensorMap* dy_map, Compute&& compute,
                                          Finish&& finish) {
  const int chunks = int(plan.chunks), slices = int(plan.slices), units = int(plan.units);
  const int chunk = int(blockIdx.x) % chunks, slice = int(blockIdx.x) / chunks;
  const int count = slice < units ? (units - slice + slices - 1) / slices : 0;
  if (threadIdx.x == 0) {
    sm90::TmaPrefetchDescriptor(x_map);
    if (dy_map != nullptr) sm90::TmaPrefetchDescriptor(dy_map);
    for (int s = 0; s < plan.stages; ++s) sm90::BarrierInit(&ring.full[s], 1);
    sm90::BarrierInitFence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int j = 0; j < min(plan.stages, count); ++j) IssueUnit(plan, g, ring, x_map, dy_map, chunk, slice + j * slices, j);
  }
  int stage = 0;
  uint32_t phase = 0;
  for (int j = 0; j < count; ++j) {
    const Unit unit(plan, slice + j * slices);
    sm90::BarrierWait(&ring.full[stage], phase);
    compute(unit, stage);
    __syncthreads();  // every thread is done with the stage
    if (threadIdx.x == 0 && j + plan.stages < count) {
      IssueUnit(plan, g, ring, x_map, dy_map, chunk, slice + (j + plan.stages) * slices, stage);
    }
    finish(unit);
    if (++stage == plan.stages) stage = 0, phase ^= 1;
  }
}

// Calls fn(o, u, value) for each output row o < kRows of the unit and each input row of its box
// that o reads through window row u, with value[i] the thread's input word i of that row as floats
// (the input column of its output column c through window column v is i = c * kStride + v). Each
// box row is read from shared memory once.
template <typename T, int kWindow, bool kWgrad, int kStride, int kRows, typename Fn>
__device__ __forceinline__ void ForEachWindowRow(const RowsPlan& plan,
                                                 const typename ThreadShape<kWindow, kWgrad>::Word* box, int word,
                                                 int group, Fn&& fn) {
  using Shape = ThreadShape<kWindow, kWgrad>;
  constexpr int kSpan = (Shape::kCols - 1) * kStride + kWindow;
  const int words = plan.vectors * (8 / Shape::kLanes);
  const typename Shape::Word* at = box + group * Shape::kCols * kStride * words + word;
#pragma unroll
  for (int r = 0; r < (kRows - 1) * kStride + kWindow; ++r) {
    float value[kSpan][Shape::kLanes];
#pragma unroll
    for (int i = 0; i < kSpan; ++i) Unpack<T>(at[(r * plan.span_cols + i) * words], value[i]);
#pragma unroll
    for (int o = 0; o < kRows; ++o) {
      const int u = r - o * kStride;
      if (u >= 0 && u < kWindow) fn(o, u, value);
    }
  }
}

// The kLanes values rounded to T, two an instruction, as one word.
template <typename T, int kLanes>
__device__ __forceinline__ auto PackWord(const float (&v)[kLanes]) {
  if constexpr (kLanes == 8) {
    return uint4{sm90::PackPair<T>(v[0], v[1]), sm90::PackPair<T>(v[2], v[3]), sm90::PackPair<T>(v[4], v[5]),
                 sm90::PackPair<T>(v[6], v[7])};
  } else {
    static_assert(kLanes == 2, "a word is 8 or 2 channels");
    return sm90::PackPair<T>(v[0], v[1]);
  }
}

// out[image, p, q, c] = epilogue(sum over u, v < k of in[image, p * s + u - pad_h, q * s + v - pad_w, c]
// * w[u, v, c]), with w[k - 1 - u, k - 1 - v, c] when `flip`, for units of kUnitRows output rows
// (plan.rows).
template <typename T, int kWindow, int kStride, int kUnitRows>
__global__ void __launch_bounds__(kThreads, 2)
    RowsConvKernel(const __grid_constant__ CUtensorMap in_map, const RowsPlan plan, const ConvGeometry g,
                   const T* __restrict__ w, bool flip, const ConvEpilogue<T> epilogue, T* __restrict__ out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Shape = ThreadShape<kWindow, false>;
  constexpr int kLanes = Shape::kLanes, kCols = Shape::kCols, kSpan = (kCols - 1) * kStride + kWindow;
  extern __shared__ __align__(128) uint8_t shared[];
  const Ring ring(shared, plan);
  const int words = plan.vectors * (8 / kLanes);
  const int word = threadIdx.x % words, group = threadIdx.x / words;
  const int64_t channels = g.channels;
  const int64_t c0 = (blockIdx.x % plan.chunks) * plan.vectors * 8 + word * kLanes;
  const bool active = c0 < channels;
  const bool plain = epilogue.bias == nullptr && epilogue.residual == nullptr && epilogue.activation == 0;
  float taps[kWindow * kWindow][kLanes];
  LoadTaps<T, kWindow, kLanes>(w, channels, c0, flip, active, taps);
  float acc[kUnitRows][kCols][kLanes];
  WalkUnits(
      plan, g, ring, &in_map, nullptr,
      [&](const Unit&, int stage) {
#pragma unroll
        for (int o = 0; o < kUnitRows; ++o) {
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
#pragma unroll
            for (int e = 0; e < kLanes; ++e) acc[o][c][e] = 0.f;
          }
        }
        ForEachWindowRow<T, kWindow, false, kStride, kUnitRows>(
            plan, ring.X<typename Shape::Word>(stage), word, group,
            [&](int o, int u, const float (&value)[kSpan][kLanes]) {
#pragma unroll
              for (int c = 0; c < kCols; ++c) {
#pragma unroll
                for (int v = 0; v < kWindow; ++v) {
#pragma unroll
                  for (int e = 0; e < kLanes; ++e) acc[o][c][e] += value[c * kStride + v][e] * taps[u * kWindow + v][e];
                }
              }
            });
      },
      [&](const Unit& unit) {
        if (!active) return;
        const int64_t row = g.out[2] * channels;  // elements between output rows
        const int rows = min(kUnitRows, int(g.out[1]) - unit.p0);
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          const int q = unit.q0 + group * kCols + c;
          if (q >= g.out[2]) break;
          const int64_t first = ((int64_t(unit.image) * g.out[1] + unit.p0) * g.out[2] + q) * channels + c0;
          if (plain) {  // the short path the compute-bound loop needs (no epilogue code in its way)
#pragma unroll
            for (int o = 0; o < kUnitRows; ++o) {
              const auto packed = PackWord<T, kLanes>(acc[o][c]);
              if (o < rows) StoreWords(out + first + o * row, packed);
            }
          } else {
#pragma unroll
            for (int o = 0; o < kUnitRows; ++o) {
              if (o < rows) StoreOutputPack<T, kLanes>(epilogue, acc[o][c], first + o * row, c0, out);
            }
          }
        }
      });
#endif
}

// The block's share of dw[u, v, c] = sum over its units' outputs (p, q) of
// x[image, p * s + u - pad_h, q * s + v - pad_w, c] * dy[image, p, q, c]: to partial[slice] as
// float32, or to dw when there is one slice.
template <typename T, int kWindow, int kStride>
__global__ void __launch_bounds__(kThreads, 2)
    RowsWgradKernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap dy_map,
                    const RowsPlan plan, const ConvGeometry g, float* __restrict__ partial, T* __restrict__ dw) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Shape = ThreadShape<kWindow, true>;
  static_assert(Shape::kCols == 1, "a wgrad thread takes one column");
  constexpr int kLanes = Shape::kLanes, kSpan = kWindow, kTaps = kWindow * kWindow;
  extern __shared__ __align__(128) uint8_t shared[];
  const Ring ring(shared, plan);
  const int words = plan.vectors * (8 / kLanes);
  const int word = threadIdx.x % words, group = threadIdx.x / words;
  float acc[kTaps][kLanes] = {};
  WalkUnits(
      plan, g, ring, &x_map, &dy_map,
      [&](const Unit& unit, int stage) {
        float grad[kRows][kLanes];
        const typename Shape::Word* dy_box = ring.Dy<typename Shape::Word>(stage, plan);
#pragma unroll
        for (int o = 0; o < kRows; ++o) Unpack<T>(dy_box[(o * plan.cols + group) * words + word], grad[o]);
        auto add = [&](int o, int u, const float (&value)[kSpan][kLanes]) {
#pragma unroll
          for (int v = 0; v < kWindow; ++v) {
#pragma unroll
            for (int e = 0; e < kLanes; ++e) acc[u * kWindow + v][e] += value[v][e] * grad[o][e];
          }
        };
        // Outputs past the image's edge do not exist: skipped, not multiplied by TMA's zero dy (an
        // inf or nan in x must not reach dw through them). Units inside the image skip the tests.
        const int rows = unit.q0 + group < g.out[2] ? min(kRows, int(g.out[1]) - unit.p0) : 0;
        if (rows == kRows) {
          ForEachWindowRow<T, kWindow, true, kStride, kRows>(plan, ring.X<typename Shape::Word>(stage), word, group,
                                                             add);
        } else {
          ForEachWindowRow<T, kWindow, true, kStride, kRows>(plan, ring.X<typename Shape::Word>(stage), word, group,
                                                             [&](int o, int u, const float (&value)[kSpan][kLanes]) {
                                                               if (o < rows) add(o, u, value);
                                                             });
        }
      },
      [](const Unit&) {});

  // The block's columns added in order: every thread's taps to shared memory (the ring is free
  // once every warp is done: every load it was sent has landed), then one thread per (word, tap,
  // channel).
  constexpr int kValues = kTaps * kLanes;  // a thread's sums
  __syncthreads();
  float* sums = reinterpret_cast<float*>(shared + kHeader);  // [groups][words][kTaps * kLanes]
#pragma unroll
  for (int t = 0; t < kTaps; ++t) {
#pragma unroll
    for (int e = 0; e < kLanes; ++e) sums[threadIdx.x * kValues + t * kLanes + e] = acc[t][e];
  }
  __syncthreads();
  const int64_t chunk = blockIdx.x % plan.chunks, slice = blockIdx.x / plan.chunks;
  const int64_t channels = g.channels;
  const int groups = plan.cols;  // one column a thread
  for (int i = threadIdx.x; i < words * kValues; i += blockDim.x) {
    const int w = i / kValues, t = (i % kValues) / kLanes, e = i % kLanes;
    const int64_t c = chunk * plan.vectors * 8 + w * kLanes + e;
    if (c >= channels) continue;
    float total = 0.f;
    for (int q = 0; q < groups; ++q) total += sums[(q * words + w) * kValues + t * kLanes + e];
    if (plan.slices == 1) {
      dw[t * channels + c] = FromFloat<T>(total);
    } else {
      partial[(slice * kTaps + t) * channels + c] = total;
    }
  }
#endif
}

// --- launchers -----------------------------------------------------------------------------------------

// The tensor map of an image array [images, height, width, C] of 16-bit T whose box is
// box_rows x box_cols pixels x box_vectors 8-channel vectors; zeros outside the array.
template <typename T>
CUresult MakeImageMap(CUtensorMap* map, const T* data, const ConvGeometry& g, int64_t images, int64_t height,
                      int64_t width, int box_vectors, int box_cols, int box_rows) {
  const CUtensorMapDataType type =
      std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const cuuint64_t dims[4] = {cuuint64_t(g.channels), cuuint64_t(width), cuuint64_t(height), cuuint64_t(images)};
  const cuuint64_t strides[3] = {cuuint64_t(g.channels * 2), cuuint64_t(width * g.channels * 2),
                                 cuuint64_t(height * width * g.channels * 2)};
  const cuuint32_t box[4] = {cuuint32_t(box_vectors * 8), cuuint32_t(box_cols), cuuint32_t(box_rows), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return cuTensorMapEncodeTiled(map, type, 4, const_cast<T*>(data), dims, strides, box, element_strides,
                                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

ffi::Error MapError(const char* stage) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jaxdnn: depthwise ") + stage + " (sm90): cannot encode a TMA descriptor");
}

// Sets the kernel's dynamic shared memory and returns how many of its blocks fit on the device.
template <typename Kernel>
int64_t PrepareKernel(Kernel kernel, const RowsPlan& plan, size_t shared) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  return ResidentBlocks(kernel, plan.Threads(), shared);
}

}  // namespace

bool RowsTake(const ConvGeometry& g, std::initializer_list<const void*> operands) {
  for (const void* p : operands) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  const int64_t k = g.window[1];
  const bool shape = g.channels % 8 == 0 && g.filters == g.channels && g.window[0] == 1 &&
                     (k == 3 || k == 5 || k == 7) && g.window[2] == k && g.rhs_dilation[1] == 1 &&
                     g.rhs_dilation[2] == 1 && g.stride[1] == g.stride[2] && g.stride[1] <= 2 && g.stride[0] == 1 &&
                     g.pad[0] == 0 && g.in[0] == g.out[0] && g.batch >= 1 && g.in[1] >= 1 && g.in[2] >= 1 &&
                     g.out[1] >= 1 && g.out[2] >= 1;
  // TMA coordinates are int32, and the kernels count units (at most one per output pixel) in int.
  const bool coordinates = g.batch * g.in[0] < INT_MAX && g.in[1] < INT_MAX / 4 && g.in[2] < INT_MAX / 4 &&
                           g.batch * g.in[0] * g.out[1] * g.out[2] < INT_MAX / 4;
  if (!shape || !coordinates) return false;
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    return false;
  }
  return major >= 9;
}

namespace {

// The forward kernel for a kWindow x kWindow window, stride s and units of `rows` rows (7 only for
// 3 x 3).
template <typename T, int kWindow>
auto ConvKernelOf(int stride, int rows) {
  if constexpr (kWindow == 3) {
    if (rows == kTallRows) return stride == 1 ? RowsConvKernel<T, 3, 1, kTallRows> : RowsConvKernel<T, 3, 2, kTallRows>;
  }
  return stride == 1 ? RowsConvKernel<T, kWindow, 1, kRows> : RowsConvKernel<T, kWindow, 2, kRows>;
}

template <typename T>
auto ConvKernel(const RowsPlan& plan) {
  if (plan.window == 5) return ConvKernelOf<T, 5>(plan.stride, plan.rows);
  if (plan.window == 7) return ConvKernelOf<T, 7>(plan.stride, plan.rows);
  return ConvKernelOf<T, 3>(plan.stride, plan.rows);
}

template <typename T, int kWindow>
auto WgradKernelOf(int stride) {
  return stride == 1 ? RowsWgradKernel<T, kWindow, 1> : RowsWgradKernel<T, kWindow, 2>;
}

template <typename T>
auto WgradKernel(const RowsPlan& plan) {
  if (plan.window == 5) return WgradKernelOf<T, 5>(plan.stride);
  if (plan.window == 7) return WgradKernelOf<T, 7>(plan.stride);
  return WgradKernelOf<T, 3>(plan.stride);
}

}  // namespace

template <typename T>
ffi::Error RowsConv(cudaStream_t stream, const ConvGeometry& g, const T* in, const T* w, bool flip,
                    const ConvEpilogue<T>& epilogue, T* out) {
  RowsPlan plan = MakeRowsPlan(g, false);
  CUtensorMap in_map;
  if (MakeImageMap(&in_map, in, g, plan.images, g.in[1], g.in[2], plan.vectors, plan.span_cols, plan.span_rows) !=
      CUDA_SUCCESS) {
    return MapError("conv");
  }
  const size_t shared = plan.Shared(false);
  auto kernel = ConvKernel<T>(plan);
  const int64_t resident = PrepareKernel(kernel, plan, shared);
  plan.slices = std::max<int64_t>(1, std::min(plan.units, std::min(resident, kWaveBlocks) / plan.chunks));
  const int64_t blocks = plan.chunks * plan.slices;
  if (blocks > INT_MAX) return InvalidArgument("depthwise conv (sm90): too many blocks");
  kernel<<<int(blocks), plan.Threads(), shared, stream>>>(in_map, plan, g, w, flip, epilogue, out);
  return LaunchError("depthwise conv (sm90)");
}

template <typename T>
ffi::Error RowsWgrad(cudaStream_t stream, const ConvGeometry& g, const T* x, const T* dy, int64_t max_slices,
                     float* partial, T* dw, int64_t* slices) {
  RowsPlan plan = MakeRowsPlan(g, true);
  CUtensorMap x_map, dy_map;
  if (MakeImageMap(&x_map, x, g, plan.images, g.in[1], g.in[2], plan.vectors, plan.span_cols, plan.span_rows) !=
          CUDA_SUCCESS ||
      MakeImageMap(&dy_map, dy, g, plan.images, g.out[1], g.out[2], plan.vectors, plan.cols, plan.rows) !=
          CUDA_SUCCESS) {
    return MapError("wgrad");
  }
  const size_t shared = plan.Shared(true);
  auto kernel = WgradKernel<T>(plan);
  PrepareKernel(kernel, plan, shared);
  plan.slices = std::max<int64_t>(1, std::min({max_slices, plan.units, kWaveBlocks / plan.chunks}));
  const int64_t blocks = plan.chunks * plan.slices;
  if (blocks > INT_MAX) return InvalidArgument("depthwise wgrad (sm90): too many blocks");
  kernel<<<int(blocks), plan.Threads(), shared, stream>>>(x_map, dy_map, plan, g, partial, dw);
  *slices = plan.slices;
  return LaunchError("depthwise wgrad (sm90)");
}

template ffi::Error RowsConv<__nv_bfloat16>(cudaStream_t, const ConvGeometry&, const __nv_bfloat16*,
                                            const __nv_bfloat16*, bool, const ConvEpilogue<__nv_bfloat16>&,
                                            __nv_bfloat16*);
template ffi::Error RowsConv<__half>(cudaStream_t, const ConvGeometry&, const __half*, const __half*, bool,
                                     const ConvEpilogue<__half>&, __half*);
template ffi::Error RowsWgrad<__nv_bfloat16>(cudaStream_t, const ConvGeometry&, const __nv_bfloat16*,
                                             const __nv_bfloat16*, int64_t, float*, __nv_bfloat16*, int64_t*);
template ffi::Error RowsWgrad<__half>(cudaStream_t, const ConvGeometry&, const __half*, const __half*, int64_t,
                                      float*, __half*, int64_t*);

}  // namespace jaxdnn
