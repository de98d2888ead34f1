// Size arithmetic that throws instead of wrapping around.
#pragma once

#include <cstddef>
#include <cstdint>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

inline size_t checked_add(size_t a, size_t b) {
  size_t r;
  if (__builtin_add_overflow(a, b, &r)) throw Error("size overflow: the dimensions are too large");
  return r;
}

inline size_t checked_mul(size_t a, size_t b) {
  size_t r;
  if (__builtin_mul_overflow(a, b, &r)) throw Error("size overflow: the dimensions are too large");
  return r;
}

}  // namespace w4a8moe::detail
