// The packed-weights buffer: a 128-byte header, then one 64-byte aligned block per expert.
//
//   expert block = [weights][scales][correction][bias]  (each section 64-byte aligned)
//
// weights:    layout-specific (see the layout table in packed_format.cpp)
// scales:     rows x groups, in the stored scale dtype (f32, bf16 or f16)
// correction: one 4-byte value per row for the zero-point term:
//               channelwise: int32  SUM_k w[n,k]
//               groupwise:   f32    SUM_b s[n,b] * SUM_{k in b} w[n,k]   (summed in double)
// bias:       f32 per row, present when the header's bias flag is set
//
// Geometry is computed by make_geometry() from the header fields alone; the reader recomputes it
// and compares, so a header can never point outside its buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

inline constexpr char kPackedMagic[8] = {'W', '4', 'A', '8', 'M', 'O', 'E', '\0'};
inline constexpr size_t kHeaderBytes = 128;
inline constexpr size_t kAlign = 64;
inline constexpr int64_t kBlock = 32;  // K granularity of every layout
// Largest input dimension: keeps every int32 dot product exact (|q * w| <= 1024 per element).
inline constexpr int64_t kMaxCols = int64_t{1} << 20;

enum class LayoutId : uint32_t {
  // Row-major rows of 32-element blocks; block byte i holds element i (low nibble) and element
  // i + 16 (high nibble) as 4-bit two's complement. Read by the portable kernels.
  qs4_b32_rowmajor = 1,
};

const char* layout_name(LayoutId id) noexcept;
bool layout_known(uint32_t id) noexcept;

struct PackedHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  uint32_t layout;
  uint32_t role;  // WeightRole
  uint32_t experts;
  uint32_t rows;
  uint32_t cols;
  int32_t group_size;   // -1: channelwise
  uint32_t scale_dtype; // DType
  uint32_t flags;       // kFlagBias
  uint64_t expert_bytes;
  uint64_t total_bytes;
  uint8_t reserved[kHeaderBytes - 64 - 8];
  uint64_t checksum;  // FNV-1a 64 of the bytes before it
};
static_assert(sizeof(PackedHeader) == kHeaderBytes);

inline constexpr uint32_t kFlagBias = 1u;

// Everything a kernel needs to find its way in one expert block.
struct Geometry {
  LayoutId layout = LayoutId::qs4_b32_rowmajor;
  WeightRole role = WeightRole::w13;
  int64_t experts = 0;
  int64_t rows = 0;        // N
  int64_t cols = 0;        // K (logical)
  int64_t cols_padded = 0; // K rounded up to kBlock
  int group_size = -1;
  int64_t group_len = 0;   // elements per scale group (cols_padded when channelwise)
  int64_t groups = 0;      // scale groups per row
  DType scale_dtype = DType::f32;
  bool has_bias = false;
  int64_t row_weight_bytes = 0;
  size_t weights_offset = 0, scales_offset = 0, correction_offset = 0, bias_offset = 0;
  size_t expert_bytes = 0;
  size_t total_bytes = 0;

  bool channelwise() const noexcept { return group_size < 0; }
};

// Throws Error (naming `argument`) when the sizes overflow or the group size does not fit.
Geometry make_geometry(LayoutId layout, WeightRole role, int64_t experts, int64_t rows,
                       int64_t cols, int group_size, DType scale_dtype, bool has_bias,
                       std::string_view argument);

uint64_t header_checksum(const PackedHeader& header) noexcept;

// Validates magic, version, layout, checksum, dimensions and size; returns the geometry.
Geometry read_geometry(std::span<const uint8_t> packed, std::string_view argument);

}  // namespace w4a8moe::detail
