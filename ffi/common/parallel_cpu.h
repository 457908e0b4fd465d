// Work spread over XLA's intra-op thread pool, for the CPU kernels.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "common/ffi_common.h"

namespace jaxdnn {

// Runs fn(i) for i in [0, n) on the calling thread and on up to n - 1 tasks of XLA's intra-op
// thread pool. Each takes items from a shared counter, so the caller waits only for items already
// taken, never for a task that has not started: a busy pool, or none, cannot deadlock it (a task
// that starts late finds no items left and touches nothing of the caller's).
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const Fn& fn) {
  struct Progress {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto progress = std::make_shared<Progress>();
  auto run = [progress, n, &fn] {
    for (int64_t i; (i = progress->next.fetch_add(1)) < n;) {
      fn(i);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < std::min<int64_t>(pool.num_threads(), n); ++t) pool.Schedule([run] { run(); });
  run();
  while (progress->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// fn(begin, end) over [0, n) cut into one chunk a thread of the pool (and the caller), each of at
// least `grain` items; fewer items than 2 * grain run on the caller alone, with no task scheduled.
template <typename Fn>
void ParallelChunks(ffi::ThreadPool& pool, int64_t n, int64_t grain, const Fn& fn) {
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), n / grain));
  if (chunks == 1) return fn(int64_t{0}, n);
  ParallelFor(pool, chunks, [&](int64_t c) { fn(n * c / chunks, n * (c + 1) / chunks); });
}

// The rows of `shape` a chunk of a row-wise kernel's work takes at least: 32768 values (one row at
// least), far more than a task's scheduling costs.
inline int64_t RowsPerChunk(RowsFeatures shape) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, shape.features));
}

// A spinning thread's pause (the x86 `pause`, arm's `yield`: a hint to the core, not a syscall).
inline void SpinPause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Rounds of `parts` parts that the calling thread and up to `helpers` tasks of XLA's intra-op pool
// share: each Run(fn) is one round, fn(part) for every part < parts, and returns once all are done.
// The helpers are scheduled once and spin between rounds, so a round costs no task launch (a
// recurrence's step is microseconds). Thread i takes part i first (the caller 0), so that a part's
// data stays in one core's cache from round to round, then any part still open. As in ParallelFor, a
// helper that starts late, or never, only leaves the caller more parts: a part is taken once, by a
// compare-and-swap of its last round, and a helper touches the caller's data only for a part it
// took of the round that is open (which cannot end before that part is done).
class RoundTeam {
 public:
  RoundTeam(ffi::ThreadPool& pool, int64_t helpers, int64_t parts) : state_(std::make_shared<State>(parts)) {
    for (int64_t id = 1; id <= helpers && parts > 1; ++id) {
      pool.Schedule([state = state_, id] {
        for (int64_t seen = -1, spins = 0;; ++spins) {
          const int64_t round = state->round.load(std::memory_order_acquire);
          if (round == seen) {
            if (state->finished.load(std::memory_order_acquire)) return;
            SpinPause();
            if (spins % 1024 == 0) std::this_thread::yield();
            continue;
          }
          seen = round;
          state->TakeParts(round, id);
        }
      });
    }
  }
  ~RoundTeam() { state_->finished.store(true, std::memory_order_release); }
  RoundTeam(const RoundTeam&) = delete;
  RoundTeam& operator=(const RoundTeam&) = delete;

  int64_t parts() const { return state_->parts; }

  template <typename Fn>
  void Run(const Fn& fn) {
    State& s = *state_;
    if (s.parts == 1) return fn(int64_t(0));
    s.call = [](const void* ctx, int64_t part) { (*static_cast<const Fn*>(ctx))(part); };
    s.ctx = &fn;
    s.done.store(0, std::memory_order_relaxed);
    s.round.store(++round_, std::memory_order_release);
    s.TakeParts(round_, 0);
    while (s.done.load(std::memory_order_acquire) < s.parts) SpinPause();
  }

 private:
  struct State {
    explicit State(int64_t parts) : parts(parts), taken(new std::atomic<int64_t>[parts]) {
      for (int64_t p = 0; p < parts; ++p) taken[p].store(-1, std::memory_order_relaxed);
    }
    // The parts of `round` still open, starting at part `first`.
    void TakeParts(int64_t round, int64_t first) {
      for (int64_t i = 0; i < parts; ++i) {
        const int64_t part = (first + i) % parts;
        int64_t previous = round - 1;
        if (taken[part].compare_exchange_strong(previous, round, std::memory_order_acq_rel)) {
          call(ctx, part);
          done.fetch_add(1, std::memory_order_release);
        }
      }
    }
    const int64_t parts;
    std::unique_ptr<std::atomic<int64_t>[]> taken;  // each part's last round taken
    std::atomic<int64_t> round{-1}, done{0};
    std::atomic<bool> finished{false};
    void (*call)(const void*, int64_t) = nullptr;  // the open round's fn, set before it opens
    const void* ctx = nullptr;
  };
  std::shared_ptr<State> state_;
  int64_t round_ = -1;
};

// Buffers of the given sizes (floats), one after another in the calling thread's scratch, which is
// kept for the thread's life: for the work items' buffers (attention's tiles allocated and zeroed
// anew had cost 100-200 KiB of memset a tile; a fresh allocation costs page faults). Valid until the
// thread's next call; items do not nest, so an item may keep its buffers throughout.
template <size_t N>
std::array<float*, N> ScratchBuffers(const int64_t (&sizes)[N]) {
  int64_t total = 0;
  for (int64_t size : sizes) total += size;
  thread_local std::vector<float> scratch;
  if (int64_t(scratch.size()) < total) scratch.resize(total);
  std::array<float*, N> buffers;
  float* next = scratch.data();
  for (size_t i = 0; i < N; ++i) {
    buffers[i] = next;
    next += sizes[i];
  }
  return buffers;
}

// A call's large buffer of floats (contents undefined), taken from a process-wide cache of the
// buffers earlier calls released, and given back to it when destroyed: for buffers shared by a call's
// items (a convolution's float filters, its partial dW's). A fresh allocation of megabytes comes from
// mmap, and each of its pages faults on first touch: on the 2-core development machine a 7^2 512 ->
// 512 convolution's forward took 8.2 ms in a process where larger layers had run before it (malloc
// had returned their memory to the system) and 3.9 ms with its 9 MB of float filters reused. The
// cache keeps at most kKept buffers, so it holds about what the calls in flight at once have used.
class CachedBuffer {
 public:
  explicit CachedBuffer(int64_t size) {
    {
      std::lock_guard<std::mutex> lock(Cache().mutex);
      auto& kept = Cache().buffers;
      auto best = kept.end();  // the smallest kept buffer that is large enough
      for (auto it = kept.begin(); it != kept.end(); ++it) {
        if (it->first >= size && (best == kept.end() || it->first < best->first)) best = it;
      }
      if (best != kept.end()) {
        buffer_ = std::move(*best);
        kept.erase(best);
        return;
      }
    }
    const int64_t capacity = std::max<int64_t>(size, 1);
    buffer_ = {capacity, std::unique_ptr<float[]>(new float[capacity])};
  }
  ~CachedBuffer() {
    std::lock_guard<std::mutex> lock(Cache().mutex);
    auto& kept = Cache().buffers;
    kept.push_back(std::move(buffer_));
    if (kept.size() > kKept) {
      kept.erase(std::min_element(kept.begin(), kept.end(),
                                  [](const auto& a, const auto& b) { return a.first < b.first; }));
    }
  }
  CachedBuffer(const CachedBuffer&) = delete;
  CachedBuffer& operator=(const CachedBuffer&) = delete;

  float* data() const { return buffer_.second.get(); }

 private:
  static constexpr size_t kKept = 8;
  using Buffer = std::pair<int64_t, std::unique_ptr<float[]>>;  // (capacity, storage)
  struct Kept {
    std::mutex mutex;
    std::vector<Buffer> buffers;
  };
  static Kept& Cache() {
    static Kept* kept = new Kept;  // never destroyed: a buffer may be released during exit
    return *kept;
  }
  Buffer buffer_;
};

// A CPU handler's binding with XLA's intra-op thread pool as its first argument.
inline auto BindWithThreadPool() { return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>(); }

}  // namespace jaxdnn
