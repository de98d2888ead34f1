// Walks GemmArgs::prefetch one 64-byte line per step (internal linkage: included by ISA files).
#pragma once

#include "kernels/kernel.hpp"

namespace w4a8moe::detail {
namespace {

struct Prefetcher {
  const uint8_t* p[2];
  int64_t left[2];
  // step_group's pace: a panel record's bytes owed per scale group done, in 64 * groups units
  int64_t record_bytes, group_lines_bytes, owed = 0;
  explicit Prefetcher(const GemmArgs& a)
      : p{a.prefetch[0].begin, a.prefetch[1].begin},
        left{a.prefetch[0].lines, a.prefetch[1].lines},
        record_bytes(static_cast<int64_t>(a.geometry->panel_bytes)),
        group_lines_bytes(64 * a.geometry->groups) {}
  // One scale group of `panels` panel records computed: prefetch those records' share of it
  // (their weights, scales and zero points), so that a call prefetches as many bytes as it
  // reads and the next call's range is ready when it starts.
  inline void step_group(int64_t panels) {
    owed += panels * record_bytes;
    const int64_t n = owed / group_lines_bytes;
    owed -= n * group_lines_bytes;
    step(n);
  }
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
