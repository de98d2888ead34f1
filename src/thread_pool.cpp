#include "thread_pool.hpp"

namespace w4a8moe::detail {

namespace {

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
    stop_.store(true, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    for (auto& t : threads_) t.join();
    throw;
  }
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
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

void ThreadPool::run_impl(void* body, Trampoline trampoline) {
  body_ = body;
  trampoline_ = trampoline;
  error_ = nullptr;
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  call(0);
  sync_.arrive_and_wait();  // everyone finished; also publishes their writes to the caller
  if (error_) std::rethrow_exception(error_);
}

void ThreadPool::worker(int index) {
  uint32_t seen = 0;
  for (;;) {
    wait_change(generation_, seen);
    seen = generation_.load(std::memory_order_acquire);
    if (stop_.load(std::memory_order_relaxed)) return;
    call(index);
    sync_.arrive_and_wait();
  }
}

}  // namespace w4a8moe::detail
