// Row converters shared by the checkpoint loaders (issue 7).
#pragma once

#include <cstdint>
#include <vector>

#include "io/checkpoint.hpp"

namespace w4a8moe::io {

// int4 values in [-8, 7] -> nibbles: dst[j] = (v[2j] + 8) | (v[2j + 1] + 8) << 4. n even.
void pack_nibbles(const int8_t* values, int64_t n, uint8_t* dst);

// One float row of n elements -> int4 nibbles and f32 scales (group_size, or -1 for one scale),
// with the rule of quantize_weights; adds the introduced error to `stats`. Throws Error naming
// `what` if a value is not finite.
void convert_row(const float* row, int64_t n, int group_size, QuantRule rule, uint8_t* nibbles,
                 float* scales, Conversion& stats, const std::string& what);

// Stores scale i of a row in `dtype` (f32, bf16 or f16); the caller knows it is exact (a widening
// or the same dtype).
void store_scale(uint8_t* dst, DType dtype, int64_t i, float value);

}  // namespace w4a8moe::io
