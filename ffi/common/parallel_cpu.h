// Work spread over XLA's intra-op thread pool, for the CPU kernels.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

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

// A CPU handler's binding with XLA's intra-op thread pool as its first argument.
inline auto BindWithThreadPool() { return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>(); }

}  // namespace jaxdnn
