// Allocation of large buffers (packed experts, forward scratch) on 2 MiB boundaries with
// transparent huge pages requested (madvise; Linux's default THP mode is "madvise"). Streaming
// the experts of a layer then costs one TLB entry per 2 MiB instead of one per 4 KiB: with 4 KiB
// pages the software prefetches of the next task's weights and the first loads of each slice
// wait for page walks. Smaller buffers keep the caller's alignment. Free with std::free.
#pragma once

#include <cstddef>
#include <cstdlib>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace w4a8moe::detail {

inline constexpr size_t kHugePage = size_t{2} << 20;

// bytes rounded up to the alignment used (so the result is valid for std::aligned_alloc), or 0
// when that overflows.
inline size_t large_alloc_size(size_t bytes, size_t align) {
  const size_t a = bytes >= kHugePage ? kHugePage : align;
  if (bytes > SIZE_MAX - a) return 0;
  const size_t rounded = (bytes + a - 1) / a * a;
  return rounded == 0 ? a : rounded;
}

// Null when the size overflows or the system refuses; the caller throws its own Error.
inline void* large_alloc(size_t bytes, size_t align) {
  const size_t size = large_alloc_size(bytes, align);
  if (size == 0) return nullptr;
  void* p = std::aligned_alloc(size >= kHugePage ? kHugePage : align, size);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (p != nullptr && size >= kHugePage) ::madvise(p, size, MADV_HUGEPAGE);  // a hint only
#endif
  return p;
}

}  // namespace w4a8moe::detail
