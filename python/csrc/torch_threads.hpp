// Which threads the torch ops' forward calls run on, shared by torch_ops.cpp and torch_ep_ops.cpp
// so that both follow the one setting (w4a8moe.set_num_threads).
//
// By default (setting 0) a call runs on PyTorch's own intra-op threads through at::parallel_for,
// as many tasks as torch.get_num_threads(): threads already awake from the previous op, and no
// second pool competing for the same cores (docs/pytorch.md, "Threads"). A setting n > 0 runs it
// on n threads of the library's own, from its per-process w4a8moe::ContextPool.
#pragma once

#include <ATen/Parallel.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe_torch::threads {

// 0: PyTorch's intra-op threads; n > 0: n threads of the library's own.
inline std::atomic<int64_t> g_own_threads{0};

inline int torch_threads() {
  at::internal::lazy_init_num_threads();  // else a new thread sees OpenMP's default, not torch's
  return std::clamp(at::get_num_threads(), 1, w4a8moe::Context::kMaxThreads);
}

// The thread count the next forward call uses.
inline int wanted_threads() {
  const int64_t n = g_own_threads.load(std::memory_order_relaxed);
  return n > 0 ? static_cast<int>(n) : torch_threads();
}

// How many of PyTorch's threads ran the tasks of the last forward call on them (0: the last call
// ran on the library's own threads): what the tests check the OpenMP build of at::parallel_for by.
inline std::atomic<int> g_torch_threads_used{0};

// One task per index, spread by PyTorch over its intra-op threads (the caller's thread among
// them). Inside one of PyTorch's parallel regions, at::parallel_for runs the range inline.
inline void torch_parallel_for(int n, const std::function<void(int)>& task) {
  std::atomic<int> ranges{0};
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    ranges.fetch_add(1, std::memory_order_relaxed);
    for (int64_t i = begin; i < end; ++i) task(static_cast<int>(i));
  });
  g_torch_threads_used.store(ranges.load(), std::memory_order_relaxed);
}

// The calling Python thread's Context on PyTorch's threads (its scratch kept between calls; one
// per Python thread, so concurrent calls never share one), made anew when torch's count changes.
inline w4a8moe::Context& torch_threads_context(int threads) {
  thread_local std::unique_ptr<w4a8moe::Context> context;
  if (!context || context->threads() != threads) {
    context.reset();
    context = std::make_unique<w4a8moe::Context>(w4a8moe::Executor{threads, &torch_parallel_for});
  }
  return *context;
}

// Set in a child process made by fork(). GNU OpenMP's thread team does not survive fork: a
// child whose parent had run a parallel region hangs in its first one (plain torch does too, on
// `torch.ones(1 << 24).sum()` with two threads), so a forked child runs the ops on the library's
// own threads, whose pool starts fresh there.
inline std::atomic<bool> g_forked_child{false};
inline const bool g_fork_handler = [] {
  pthread_atfork(nullptr, nullptr, [] { g_forked_child.store(true); });
  return true;
}();

// Runs f(context) on the Context the setting chooses.
template <class F>
decltype(auto) with_context(F&& f) {
  int64_t own = g_own_threads.load(std::memory_order_relaxed);
  if (own == 0 && g_forked_child.load(std::memory_order_relaxed)) own = torch_threads();
  if (own > 0) {
    auto lease = w4a8moe::ContextPool::instance().lease(static_cast<int>(own));
    g_torch_threads_used.store(0, std::memory_order_relaxed);
    return f(lease.context());
  }
  return f(torch_threads_context(torch_threads()));
}

}  // namespace w4a8moe_torch::threads
