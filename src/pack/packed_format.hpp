// The packed-weights buffer: a 128-byte header, then one 64-byte aligned block per expert in the
// layout the header names (the blocks, their panel records and the layouts: kernels/layout.hpp).
//
// Geometry is computed by make_geometry() from the header fields alone; the reader recomputes it
// and compares, so a header can never point outside its buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "common/argument_checks.hpp"
#include "kernels/layout.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

inline constexpr char kPackedMagic[8] = {'W', '4', 'A', '8', 'M', 'O', 'E', '\0'};
inline constexpr size_t kHeaderBytes = 128;
inline constexpr size_t kAlign = 64;

struct PackedHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  uint32_t layout;
  uint32_t role;  // WeightRole
  uint32_t experts;
  uint32_t rows;
  uint32_t cols;
  int32_t group_size;    // -1: channelwise
  uint32_t scale_dtype;  // DType
  uint32_t flags;        // kFlagBias
  uint64_t expert_bytes;
  uint64_t total_bytes;
  uint32_t weight_format;  // WeightFormat
  uint32_t block_rows;     // kBlockRows: w13's parts alternate in blocks of this many rows
  uint64_t panel_bytes;    // bytes per panel record
  uint8_t reserved[kHeaderBytes - 80 - 8];
  uint64_t checksum;  // FNV-1a 64 of the bytes before it
};
static_assert(sizeof(PackedHeader) == kHeaderBytes);

inline constexpr uint32_t kFlagBias = 1u;
// w13 only: each expert block ends with its input order (Geometry::input_order).
inline constexpr uint32_t kFlagInputOrder = 2u;

// Throws Error (naming `argument`) when the sizes overflow or the group size does not fit, or
// for an input order of w2. WeightFormat::int8 takes the layer's K and group size -1 or K, one
// expert of role w2, and returns the geometry of its two int4 planes (Geometry::int8_cols) in a
// layout of nibbles, its own in a layout of bytes (LayoutInfo::int8_bytes), which takes int8
// weights only.
Geometry make_geometry(LayoutId layout, WeightRole role, int64_t experts, int64_t rows,
                       int64_t cols, int group_size, DType scale_dtype, bool has_bias,
                       WeightFormat weight_format, std::string_view argument,
                       bool has_input_order = false);

uint64_t header_checksum(const PackedHeader& header) noexcept;

// Validates magic, version, layout, checksum, dimensions and size; returns the geometry.
Geometry read_geometry(std::span<const uint8_t> packed, std::string_view argument);

// The two packed buffers of a layer belong together: roles, shapes, group size, layout. Returns
// experts, hidden and inter.
ForwardShape check_packed_pair(const Geometry& w13, const Geometry& w2, std::string_view w13_name,
                               std::string_view w2_name);

}  // namespace w4a8moe::detail
