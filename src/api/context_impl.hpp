// A Context's insides, shared by the drivers that run on it (forward(), linear()): its worker
// threads, the task claims of the forward driver's phases, and the scratch arena.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>

#include "api/task_claims.hpp"
#include "common/format.hpp"
#include "common/large_alloc.hpp"
#include "thread_pool.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe {

namespace detail {

inline size_t align64(size_t v) { return (v + 63) / 64 * 64; }

struct AlignedFree {
  void operator()(uint8_t* p) const noexcept { std::free(p); }
};

}  // namespace detail

struct Context::Impl {
  explicit Impl(int threads) : pool(threads), gate_up_tasks(threads), down_tasks(threads) {}
  Impl(int threads, detail::ExecutorFn executor)
      : pool(threads, std::move(executor)), gate_up_tasks(threads), down_tasks(threads) {}
  detail::ThreadPool pool;
  detail::TaskClaims gate_up_tasks, down_tasks;  // of the running chunk's phases 1 and 2
  std::unique_ptr<uint8_t, detail::AlignedFree> arena;
  size_t arena_bytes = 0;
  size_t memory_limit = Context::kDefaultMemoryLimit;

  uint8_t* reserve(size_t bytes) {
    if (bytes > arena_bytes) {
      arena.reset();
      auto* p = static_cast<uint8_t*>(detail::large_alloc(bytes, 64));
      if (p == nullptr)  // a message, not std::bad_alloc
        throw Error(detail::cat("context: cannot allocate ", detail::align64(bytes),
                                " bytes of scratch memory"));
      arena.reset(p);
      arena_bytes = detail::align64(bytes);  // in use; the allocation may round up to 2 MiB
    }
    return arena.get();
  }
};

}  // namespace w4a8moe
