// The one expression that adds a weighted expert row into a token's f32 sum. forward() and the
// exact combine of expert parallelism both call it, so that a combine adding the same rows in the
// same order gives forward()'s bits (the compiler treats one inline expression, with the
// library's flags, the same way in both).
#pragma once

#include <cstdint>

namespace w4a8moe::detail {

inline void add_weighted_row(float* acc, float weight, const float* y, int64_t n) {
  for (int64_t h = 0; h < n; ++h) acc[h] += weight * y[h];
}

}  // namespace w4a8moe::detail
