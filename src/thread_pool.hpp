// A small pool of persistent worker threads for the forward pass. run() executes a body on every
// thread (the caller is thread 0); inside the body, barrier() separates phases. parallel_for()
// is the one-shot fan-out of the other components. A pool may instead run its bodies on a
// caller's executor (w4a8moe::Executor): then it owns no threads and has no barrier().
//
// Idle workers poll for the next run for a bounded time (spin_ns(), like OpenMP's
// OMP_WAIT_POLICY / GOMP_SPINCOUNT), then sleep on a futex-backed atomic wait, so idle pools and
// oversubscribed machines do not burn CPU. A run finds polling workers without a system call;
// prewake() starts sleeping ones polling ahead of a run, so that their wake-up overlaps the
// caller's own work.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

// Polls of wait_until() before it yields.
inline constexpr int kSpins = 4000;
// Default and largest time idle workers poll for the next run before sleeping.
inline constexpr int64_t kDefaultSpinNs =
    std::chrono::nanoseconds(Context::kDefaultSpinWait).count();
inline constexpr int64_t kMaxSpinNs = std::chrono::nanoseconds(Context::kMaxSpinWait).count();

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

// Waits until ready() (which should load with acquire): spins, then yields, so that a waiter
// does not hold the core of the thread it waits for on an oversubscribed machine. For waits on
// work that other threads of the same run are doing (and that never waits on the waiter).
template <class Ready>
void wait_until(const Ready& ready) noexcept {
  for (int i = 0; i < kSpins; ++i) {
    if (ready()) return;
    cpu_relax();
  }
  while (!ready()) std::this_thread::yield();
}

// Reusable barrier for a fixed number of threads: spin, then sleep.
class SpinBarrier {
 public:
  explicit SpinBarrier(int threads) : threads_(threads) {}
  void arrive_and_wait() noexcept;

 private:
  const int threads_;
  std::atomic<int> arrived_{0};
  std::atomic<uint32_t> phase_{0};
};

// A caller's executor as the pool sees it: run(n, task) calls task(i) once for each i in
// [0, n) and returns when every call has returned.
using ExecutorFn = std::function<void(int, const std::function<void(int)>&)>;

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  // No threads of its own: run() hands its bodies to `executor`, `threads` of them.
  ThreadPool(int threads, ExecutorFn executor);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const noexcept { return size_; }
  bool on_executor() const noexcept { return static_cast<bool>(executor_); }

  // Runs body(thread_index) on all threads and returns when all are done. The first exception
  // thrown by any thread is rethrown here (bodies must still reach every barrier()). On an
  // executor, an exception of the executor's, or tasks it ran twice or not at all, throw Error.
  template <class Body>
  void run(Body& body) {
    run_impl(&body, [](void* b, int t) { (*static_cast<Body*>(b))(t); });
  }

  // All threads of the current run() wait here for each other. Not on an executor.
  void barrier() noexcept { sync_.arrive_and_wait(); }

  // Sleeping workers start polling for the next run (a no-op when none sleeps).
  void prewake() noexcept;

  // How long idle workers poll before they sleep, in nanoseconds, [0, kMaxSpinNs].
  void set_spin_ns(int64_t ns) noexcept {
    spin_ns_.store(std::clamp<int64_t>(ns, 0, kMaxSpinNs), std::memory_order_relaxed);
  }
  int64_t spin_ns() const noexcept { return spin_ns_.load(std::memory_order_relaxed); }

 private:
  using Trampoline = void (*)(void*, int);
  void run_impl(void* body, Trampoline trampoline);
  void run_on_executor();
  void worker(int index);
  void call(int index) noexcept;

  int size_;
  SpinBarrier sync_;
  std::atomic<uint32_t> generation_{0};  // one more per run
  std::atomic<uint32_t> signal_{0};      // what sleeping workers wait on: runs and prewakes
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> spin_ns_{kDefaultSpinNs};
  std::atomic<bool> stop_{false};
  void* body_ = nullptr;
  Trampoline trampoline_ = nullptr;
  std::mutex error_mutex_;
  std::exception_ptr error_;
  std::vector<std::thread> threads_;
  ExecutorFn executor_;
  std::unique_ptr<std::atomic<bool>[]> entered_;  // on an executor: task i has started
};

// Runs body(i) for every i in [0, n) on up to `threads` threads of a pool made for the call (the
// caller is one of them); thread t takes i = t, t + threads, ... For one-shot fan-outs (packing,
// loading, synthetic weights), where a thread's start-up is small against the work. Rethrows the
// first exception a body threw.
template <class Body>
void parallel_for(int64_t n, int64_t threads, const Body& body) {
  const int workers = static_cast<int>(std::clamp<int64_t>(threads, 1, std::max<int64_t>(n, 1)));
  ThreadPool pool(workers);
  auto task = [&](int t) {
    for (int64_t i = t; i < n; i += workers) body(i);
  };
  pool.run(task);
}

}  // namespace w4a8moe::detail
