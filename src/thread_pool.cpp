#include "thread_pool.hpp"

#include <chrono>

#include "common/format.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

namespace {

int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Polls until `value` differs from `seen` or `budget_ns` passed; true when it changed.
bool poll_change(const std::atomic<uint32_t>& value, uint32_t seen, int64_t budget_ns) noexcept {
  if (value.load(std::memory_order_acquire) != seen) return true;
  if (budget_ns <= 0) return false;
  const int64_t until = now_ns() + budget_ns;
  for (;;) {
    for (int i = 0; i < 64; ++i) {  // a clock read per 64 pauses
      if (value.load(std::memory_order_acquire) != seen) return true;
      cpu_relax();
    }
    if (now_ns() >= until) return value.load(std::memory_order_acquire) != seen;
  }
}

// Waits until `value` differs from `seen`: spin, then futex-backed wait.
void wait_change(const std::atomic<uint32_t>& value, uint32_t seen) noexcept {
  for (int i = 0; i < kSpins; ++i) {
    if (value.load(std::memory_order_acquire) != seen) return;
    cpu_relax();
  }
  while (value.load(std::memory_order_acquire) == seen) value.wait(seen, std::memory_order_acquire);
}

}  // namespace

void SpinBarrier::arrive_and_wait() noexcept {
  const uint32_t phase = phase_.load(std::memory_order_acquire);
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
    arrived_.store(0, std::memory_order_relaxed);
    phase_.fetch_add(1, std::memory_order_release);
    phase_.notify_all();
    return;
  }
  wait_change(phase_, phase);
}

ThreadPool::ThreadPool(int threads) : size_(threads < 1 ? 1 : threads), sync_(size_) {
  threads_.reserve(static_cast<size_t>(size_ - 1));
  try {
    for (int i = 1; i < size_; ++i) threads_.emplace_back(&ThreadPool::worker, this, i);
  } catch (...) {  // the system refused a thread; stop the started ones, then report
    stop_.store(true);
    generation_.fetch_add(1);
    signal_.fetch_add(1);
    signal_.notify_all();
    for (auto& t : threads_) t.join();
    throw;
  }
}

ThreadPool::ThreadPool(int threads, ExecutorFn executor)
    : size_(threads < 1 ? 1 : threads),
      sync_(size_),
      executor_(std::move(executor)),
      entered_(new std::atomic<bool>[static_cast<size_t>(size_)]) {}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  generation_.fetch_add(1);
  signal_.fetch_add(1);
  signal_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::call(int index) noexcept {
  try {
    trampoline_(body_, index);
  } catch (...) {
    std::lock_guard lock(error_mutex_);
    if (!error_) error_ = std::current_exception();
  }
}

void ThreadPool::prewake() noexcept {
  // seq_cst, with the sleepers' increment before their last look (see worker())
  if (sleepers_.load() == 0) return;
  signal_.fetch_add(1);
  signal_.notify_all();
}

void ThreadPool::run_impl(void* body, Trampoline trampoline) {
  body_ = body;
  trampoline_ = trampoline;
  error_ = nullptr;
  if (on_executor()) {
    run_on_executor();
  } else {
    // A worker increments sleepers_ before its last look at generation_, and this reads
    // sleepers_ after the increment of generation_ (both seq_cst): either the worker sees the
    // run, or this sees the sleeper and wakes it. Polling workers need no system call.
    generation_.fetch_add(1);
    if (sleepers_.load() > 0) {
      signal_.fetch_add(1);
      signal_.notify_all();
    }
    call(0);
    sync_.arrive_and_wait();  // everyone finished; also publishes their writes to the caller
  }
  if (error_) std::rethrow_exception(error_);
}

void ThreadPool::run_on_executor() {
  for (int i = 0; i < size_; ++i) entered_[static_cast<size_t>(i)].store(false);
  std::atomic<int> ran{0}, bad{-1};
  const std::function<void(int)> task = [&](int i) {
    if (i < 0 || i >= size_ || entered_[static_cast<size_t>(i)].exchange(true)) {
      bad.store(i);  // out of range or a second time: not run (its buffers are another's)
      return;
    }
    call(i);
    ran.fetch_add(1);
  };
  try {
    executor_(size_, task);
  } catch (const std::exception& e) {
    throw Error(cat("executor: the caller's parallel_for threw: ", e.what()));
  } catch (...) {
    throw Error("executor: the caller's parallel_for threw an exception of an unknown type");
  }
  if (bad.load() != -1)
    throw Error(cat("executor: expected each task index in [0, ", size_, ") once, got index ",
                    bad.load(), " twice or out of range"));
  if (ran.load() != size_)
    throw Error(
        cat("executor: expected parallel_for to run all ", size_, " tasks, it ran ", ran.load()));
}

void ThreadPool::worker(int index) {
  uint32_t seen = 0;
  for (;;) {
    // poll for the next run, then sleep until a run or a prewake; a prewake polls again
    while (!poll_change(generation_, seen, spin_ns())) {
      const uint32_t signal = signal_.load();
      sleepers_.fetch_add(1);
      while (generation_.load() == seen && signal_.load() == signal) signal_.wait(signal);
      sleepers_.fetch_sub(1);
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_.load()) return;
    call(index);
    sync_.arrive_and_wait();
  }
}

}  // namespace w4a8moe::detail
