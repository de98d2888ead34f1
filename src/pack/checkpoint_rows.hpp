// One expert's projection of a quantized checkpoint (w4a8moe/checkpoint.hpp's layouts, without
// the leading E) decoded to the packer's input: rows of nibbles (value + 8), scales [N, G],
// zero points [N, G] (w4a8moe's z = zero - 8) and the act-order input order. The one decoder of
// these layouts: pack_checkpoint_moe / pack_checkpoint_linear and the program's checkpoint
// loader (src/io) call it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "w4a8moe/checkpoint.hpp"

namespace w4a8moe::detail {

// Views of one expert's tensors: rank 2 ([K/8, N] for GPTQ's weight, ...), g_idx rank 1 [K].
// Shapes and dtypes are the caller's to check (check_checkpoint_projection); the decoder checks
// the values.
struct CheckpointProjection {
  CheckpointFormat format = CheckpointFormat::gptq;
  int64_t rows = 0, cols = 0;  // N outputs, K inputs
  int group_size = -1;         // -1 or a divisor of K
  TensorView weight, scale, zero_point, g_idx;
  // The tensors' names in errors, and the expert's index in positions (-1: none).
  std::string weight_name, scale_name, zero_point_name, g_idx_name;
  int64_t expert = -1;
};

inline int64_t checkpoint_groups(const CheckpointProjection& p) {
  return p.group_size == -1 ? 1 : p.cols / p.group_size;
}

// Checks the rank-2 views' dtypes and shapes against p.rows, p.cols and p.group_size; throws
// Error naming the tensor.
void check_checkpoint_projection(const CheckpointProjection& p);

// The act-order of g_idx [K] (input k's group): the inputs sorted by group, stably, each group
// holding group_size (K for -1) of them. Empty when g_idx is empty or already k / g. Throws Error
// naming p.g_idx_name when a group index is out of range or a group's count is wrong.
std::vector<int32_t> checkpoint_group_order(const CheckpointProjection& p);

// The parts of decode_checkpoint_projection, for loaders that read some of a projection their
// own way: the weights as stored (nibbles [N, K/2]), a row's columns in `order` (none when
// empty), the scales, the zero points.
void decode_checkpoint_weights(const CheckpointProjection& p, const int32_t* row_map,
                               uint8_t* nibbles);
void sort_checkpoint_columns(const std::vector<int32_t>& order, uint8_t* nibbles, int64_t rows,
                             int64_t cols);
void decode_checkpoint_scales(const CheckpointProjection& p, const int32_t* row_map,
                              uint8_t* scales, DType scale_dtype);
void decode_checkpoint_zero_points(const CheckpointProjection& p, const int32_t* row_map,
                                   int8_t* zero_points);

// Decodes the projection: nibbles [N, K/2] (uint8, element 2j low, value + 8) with the columns in
// `order` (act-order: checkpoint_group_order(p); empty: as stored); scales [N, G] in scale_dtype
// (the given dtype, or f32); zero_points [N, G] int8 (nullptr: symmetric, p.zero_point is not
// read). Output row n is the checkpoint's row row_map[n] (nullptr: n), scales and zero points
// with it. Throws Error naming the tensor for a zero outside [0, 15] (GPTQ's "gptq" format
// stores zero - 1) or a compressed-tensors int8 zero point outside [-8, 7].
void decode_checkpoint_projection(const CheckpointProjection& p, const std::vector<int32_t>& order,
                                  const int32_t* row_map, uint8_t* nibbles, uint8_t* scales,
                                  DType scale_dtype, int8_t* zero_points);

}  // namespace w4a8moe::detail
