// Walks GemmArgs::prefetch one 64-byte line per step (internal linkage: included by ISA files).
#pragma once

#include "kernels/kernel.hpp"

namespace w4a8moe::detail {
namespace {

struct Prefetcher {
  const uint8_t* p[2];
  int64_t left[2];
  explicit Prefetcher(const GemmArgs& a)
      : p{a.prefetch[0].begin, a.prefetch[1].begin},
        left{a.prefetch[0].lines, a.prefetch[1].lines} {}
  // n steps at once (a kernel calls this once per scale group instead of once per chunk).
  inline void step(int64_t n) {
    for (int i = 0; i < 2 && n > 0; ++i) {
      const int64_t take = left[i] < n ? left[i] : n;
      for (int64_t j = 0; j < take; ++j) __builtin_prefetch(p[i] + 64 * j, 0, 2);
      if (take > 0) {
        p[i] += 64 * take;
        left[i] -= take;
        n -= take;
      }
    }
  }
  inline void step() {
    const int i = left[0] > 0 ? 0 : 1;
    if (left[i] > 0) {
      __builtin_prefetch(p[i], 0, 2);  // read, keep in L2 (prefetcht1 on x86)
      p[i] += 64;
      --left[i];
    }
  }
};

}  // namespace
}  // namespace w4a8moe::detail
