// Row converters shared by the checkpoint loaders.
#pragma once

#include <cstdint>
#include <vector>

#include "io/checkpoint.hpp"

namespace w4a8moe::io {

// Projection `which` of an expert (0 gate, 1 up: [I, H]; 2 down: [H, I]): output rows, input
// columns, and scale groups per row at the layer's group size.
struct ProjectionShape {
  int64_t rows = 0, cols = 0, groups = 1;
};
ProjectionShape projection_shape(const LayerInfo& info, int which);

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

// Columns of a row-major [in, out] float matrix (f32/bf16/f16) as rows: dst[r * in + k] =
// matrix[k, first + r * step] for r in [0, count). Hugging Face's fused expert tensors are stored
// [E, in, out] (x @ W), the transpose of the packer's rows.
void gather_columns(const uint8_t* matrix, DType dtype, int64_t in, int64_t out, int64_t first,
                    int64_t step, int64_t count, float* dst);

// One row of n elements (a multiple of 32) of Hugging Face's MXFP4 tensors (gpt-oss
// "<name>_blocks" / "<name>_scales"): 16 bytes and one scale byte per 32 elements; byte b of a
// block holds element 2b in its low nibble and 2b + 1 in its high nibble, each an FP4 (e2m1) code;
// the value is e2m1(code) * 2^(scale - 127). A scale of 255 gives non-finite values.
void decode_mxfp4_row(const uint8_t* blocks, const uint8_t* scales, int64_t n, float* dst);

}  // namespace w4a8moe::io
