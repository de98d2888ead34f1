// Walks GemmArgs::prefetch at the pace of a call's work (internal linkage: included by ISA files).
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/kernel.hpp"

namespace w4a8moe::detail {
namespace {

// The lines of the two ranges are spread evenly over the call's work: a unit is one chunk of 8
// columns of one panel record, the call holds ceil(rows / panel) * groups * group_len / 8 of
// them, and a kernel reports them with advance() as it goes. A call given as many lines as it
// reads (weights, scales and zero points) prefetches at the pace it reads; given a share of the
// next task (the caller splits it over the task's tiles, docs/performance.md "In the layer, part by
// part"), proportionally fewer, so that no tile asks DRAM for more than the whole task's time
// allows.
struct Prefetcher {
  const uint8_t* p[2];
  int64_t left[2];
  // lines due per unit of work in 32.32 fixed point, rounded up (so that the call's units cover
  // all its lines), and the fraction of a line owed: no division per group in the hot loop
  uint64_t per_unit = 0, owed = 0;
  explicit Prefetcher(const GemmArgs& a)
      : p{a.prefetch[0].begin, a.prefetch[1].begin},
        left{a.prefetch[0].lines, a.prefetch[1].lines} {
    const int64_t units = (a.n_end - a.n_begin + a.geometry->panel - 1) / a.geometry->panel *
                          a.geometry->groups * (a.geometry->group_len / 8);
    // at most 2^24 lines (1 GiB) per call are paced (no caller asks for more): per_unit < 2^57,
    // and n * per_unit stays inside 64 bits for any n up to the call's units
    const auto lines =
        static_cast<uint64_t>(std::min<int64_t>(left[0] + left[1], int64_t{1} << 24));
    const auto u = static_cast<uint64_t>(std::max<int64_t>(units, 1));
    if (lines > 0) per_unit = ((lines << 32) + u - 1) / u;
  }
  // n units of work done: issue the lines due by now.
  inline void advance(int64_t n) {
    if (per_unit == 0) return;
    owed += static_cast<uint64_t>(n) * per_unit;
    step(static_cast<int64_t>(owed >> 32));
    owed &= 0xffffffffu;
  }
  // n lines at once.
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
};

}  // namespace
}  // namespace w4a8moe::detail
