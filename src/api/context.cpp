// Context: its construction, limits and wait policy (the insides: api/context_impl.hpp).
#include <algorithm>
#include <system_error>
#include <thread>

#include "api/context_impl.hpp"
#include "api/forward_driver.hpp"

namespace w4a8moe {

Context::Context(int threads) {
  if (threads < 0)
    throw Error(detail::cat("threads: expected 0 (all hardware threads) or a positive count, got ",
                            threads));
  if (threads == 0)
    threads = static_cast<int>(
        std::clamp<unsigned>(std::thread::hardware_concurrency(), 1u, unsigned{kMaxThreads}));
  // Resource limits: a bounded pool, and a message when the system refuses threads.
  if (threads > kMaxThreads)
    throw Error(detail::cat("threads: expected at most ", kMaxThreads, ", got ", threads));
  try {
    impl_ = std::make_unique<Impl>(threads);
  } catch (const std::system_error& e) {
    throw Error(detail::cat("threads: cannot start ", threads, " threads (", e.what(), ")"));
  }
}

Context::Context(Executor executor) {
  if (executor.threads < 1 || executor.threads > kMaxThreads)
    throw Error(detail::cat("executor.threads: expected a task count in [1, ", kMaxThreads,
                            "], got ", executor.threads));
  if (!executor.parallel_for)
    throw Error("executor.parallel_for: expected a function, got an empty one");
  impl_ = std::make_unique<Impl>(executor.threads, std::move(executor.parallel_for));
}

Context::~Context() = default;

void Context::set_spin_wait(std::chrono::microseconds wait) {
  if (wait < std::chrono::microseconds{0} || wait > kMaxSpinWait)
    throw Error(detail::cat("spin_wait: expected 0 to ", kMaxSpinWait.count(),
                            " microseconds, got ", wait.count()));
  impl_->pool.set_spin_ns(std::chrono::nanoseconds(wait).count());
}

std::chrono::microseconds Context::spin_wait() const noexcept {
  return std::chrono::duration_cast<std::chrono::microseconds>(
      std::chrono::nanoseconds(impl_->pool.spin_ns()));
}

bool Context::on_executor() const noexcept { return impl_->pool.on_executor(); }

int Context::threads() const noexcept { return impl_->pool.size(); }

size_t Context::scratch_bytes() const noexcept { return impl_->arena_bytes; }

void Context::set_memory_limit(size_t bytes) noexcept { impl_->memory_limit = bytes; }

size_t Context::memory_limit() const noexcept { return impl_->memory_limit; }

}  // namespace w4a8moe
