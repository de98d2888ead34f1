// A small pool of persistent worker threads for the forward pass. run() executes a body on every
// thread (the caller is thread 0); inside the body, barrier() separates phases. parallel_for()
// is the one-shot fan-out of the other components.
//
// Waiting spins for a short while (a decode step is a fraction of a millisecond, and a futex
// wake-up costs tens of microseconds), then sleeps on a futex-backed atomic wait, so idle pools
// and oversubscribed machines do not burn CPU.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace w4a8moe::detail {

// About 20-50 microseconds of polling before sleeping (or yielding).
inline constexpr int kSpins = 4000;

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

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const noexcept { return size_; }

  // Runs body(thread_index) on all threads and returns when all are done. The first exception
  // thrown by any thread is rethrown here (bodies must still reach every barrier()).
  template <class Body>
  void run(Body& body) {
    run_impl(&body, [](void* b, int t) { (*static_cast<Body*>(b))(t); });
  }

  // All threads of the current run() wait here for each other.
  void barrier() noexcept { sync_.arrive_and_wait(); }

 private:
  using Trampoline = void (*)(void*, int);
  void run_impl(void* body, Trampoline trampoline);
  void worker(int index);
  void call(int index) noexcept;

  int size_;
  SpinBarrier sync_;
  std::atomic<uint32_t> generation_{0};
  std::atomic<bool> stop_{false};
  void* body_ = nullptr;
  Trampoline trampoline_ = nullptr;
  std::mutex error_mutex_;
  std::exception_ptr error_;
  std::vector<std::thread> threads_;
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
