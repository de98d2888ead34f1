// The layouts the kernels read: one expert block of packed weights, its panel records and the
// order of their bytes (the packed buffer around the blocks, its header and its checks:
// pack/packed_format.hpp; docs/packed-format.md).
//
//   expert block = [panel record 0][panel record 1]...      (each record 64-byte aligned)
//   panel record = [weights][scales][zeros][correction][bias]   (each section 16-byte aligned)
//
// A panel is P stored rows (the layout's panel height). Its record holds everything a kernel
// reads for those rows, so a run of consecutive panels is one contiguous run of memory.
//
// Rows are stored in "parts" (w13: gate then up; w2: one part), each padded with zero rows to a
// multiple of P. w13's parts alternate in blocks of kBlockRows rows: [gate rows 0..63][up rows
// 0..63][gate rows 64..127][up rows 64..127]..., the last block of each part as long as what is
// left of it (a multiple of P). A phase-1 task of the forward pass (gate and up rows of one
// block) thus reads one run. Stored row of row j of part p: Geometry::stored_row(p, j).
//
// weights:    P rows in the layout's order (LayoutId below)
// scales:     for group b and lane r: element b * P + r, in the stored scale dtype (f32, bf16
//             or f16)
// zeros:      int4_zero_point only: for group b and lane r, byte b * P + r holds z + 8 in
//             [0, 15], the zero point beside the weights' w + 8
// correction: one 4-byte value per lane for the activations' zero-point term, over the
//             weights' integer values w (int4_zero_point: w - z; mxfp4: 2 * e2m1):
//               channelwise: int32  SUM_k w[n,k]
//               groupwise:   f32    SUM_b s[n,b] * SUM_{k in b} w[n,k]   (summed in double)
// bias:       f32 per lane, present when the packed header's bias flag is set
// input order (w13, the header's input-order flag): after the records, int32 [K] per expert
// (64-byte aligned)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

inline constexpr int64_t kBlock = kGroupBlock;  // K granularity of every layout
// Largest input dimension: keeps every int32 sum exact in all kernels (|u * q| <= 30 * 128 =
// 3840 per element for the unsigned weights u of the int4 and mxfp4 formats, and 2^16 * 3840 <
// 2^31; int8 bytes below).
inline constexpr int64_t kMaxCols = int64_t{1} << 16;
// int8 weights: two int4 inputs per input in the layouts of int4 nibbles (Geometry::int8_cols);
// in a layout of bytes, |(w + 128) * q| <= 255 * 128 per element and the rows' terms 128 SUM q:
// 2^15 * (255 + 128) * 128 < 2^31 as well.
inline constexpr int64_t kMaxInt8Cols = kMaxCols / 2;
// The offset that makes int8 weights unsigned in the layouts of bytes: w + 128 in [0, 255].
inline constexpr int32_t kInt8Offset = 128;

// MXFP4: 2 * e2m1(code) for each 4-bit code (bit 3 the sign), an integer in [-12, 12].
inline constexpr int8_t kMxfp4Doubled[16] = {0, 1,  2,  3,  4,  6,  8,  12,
                                             0, -1, -2, -3, -4, -6, -8, -12};
// The offset that makes them unsigned for the kernels that read offset weights (int4: 8).
inline constexpr int32_t kMxfp4Offset = 12;
// 2 * e2m1(code) + kMxfp4Offset for each code, in [0, 24]: the u8 weights of those kernels.
alignas(16) inline constexpr uint8_t kMxfp4Unsigned[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                                           12, 11, 10, 9,  8,  6,  4,  0};
// int4 with zero points: the kernels that read offset weights multiply w - z + 15 in [0, 30]
// (the nibble w + 8 plus 7 - z, per lane and group), their rows' group terms -15 * SUM q, unless
// their set starts the groups from the zero points instead (KernelSet::group_term_offset).
inline constexpr int32_t kZeroPointOffset = 15;
// Rows of each w13 part per block of the stored order (a multiple of every panel height).
inline constexpr int64_t kBlockRows = 64;

enum class LayoutId : uint32_t {
  // Row-major rows of 32-element blocks; block byte i holds element i (low nibble) and element
  // i + 16 (high nibble) as 4-bit two's complement. Read by the portable kernels.
  qs4_b32_rowmajor = 1,
  // Panels of P rows; per 8 input columns k0..k0+7 one chunk of 4P bytes; row r of the panel
  // owns bytes 4r..4r+3, byte j holding w[k0 + j] + 8 (low nibble) and w[k0 + 4 + j] + 8 (high
  // nibble). Lanes of a vector register are output rows; `vpdpbusd` takes 4 columns per lane.
  qu4_p16k8 = 2,  // P = 16: one zmm register per chunk (AVX-512 VNNI)
  qu4_p8k8 = 3,   // P = 8: one ymm register per chunk (AVX-VNNI, AVX2); Arm neon, neondot
  // Arm i8mm. Panels of 8 rows; per 16 input columns k0..k0+15 one chunk of 64 bytes, 16
  // per row pair (2i, 2i+1): byte 8 * r + j (r = 0, 1) holds w[2i + r][k0 + j] + 8 (low nibble)
  // and w[2i + r][k0 + 8 + j] + 8 (high nibble): each nibble half is a 2x8 `smmla` operand.
  qu4_p8k16 = 16,  // P = 8 (neoni8mm)
  // int8 weights (a linear layer's format) as bytes. Panels of 16 rows; per 4 input columns
  // k0..k0+3 one chunk of 64 bytes; row r of the panel owns bytes 4r..4r+3, byte j holding
  // w[k0 + j] + 128 (kInt8Offset): one `vpdpbusd` operand per chunk, no unpacking (AVX-512 VNNI).
  qu8_p16k4 = 17,
};

struct LayoutInfo {
  LayoutId id;
  const char* name;
  int64_t panel;        // P
  bool offset_nibbles;  // nibbles hold w + 8 (else two's complement)
  bool int8_bytes;      // int8 weights only, one byte each (else 4-bit values, two a byte)
};

// The layout's description; throws Error naming `argument` if unknown.
const LayoutInfo& layout_info(uint32_t id, std::string_view argument);
const char* layout_name(LayoutId id) noexcept;

// Everything a kernel needs to find its way in one expert block.
struct Geometry {
  LayoutId layout = LayoutId::qs4_b32_rowmajor;
  WeightRole role = WeightRole::w13;
  int64_t experts = 0;
  int64_t rows = 0;              // N (logical)
  int64_t cols = 0;              // K (logical)
  int64_t panel = 1;             // P
  int64_t parts = 1;             // 2 for w13 (gate, up), 1 for w2
  int64_t part_rows = 0;         // logical rows of one part
  int64_t part_rows_padded = 0;  // part_rows rounded up to P
  int64_t rows_padded = 0;       // parts * part_rows_padded
  int64_t cols_padded = 0;       // K rounded up to kBlock
  int group_size = -1;
  int64_t group_len = 0;  // elements per scale group (cols_padded when channelwise)
  int64_t groups = 0;     // scale groups per row
  DType scale_dtype = DType::f32;
  // How the stored nibbles read: int4_symmetric as the layout says; int4_zero_point the same,
  // less the group's zero point (the zeros section); mxfp4 in every layout the e2m1 code itself,
  // whose value kernels take from kMxfp4Doubled (kMxfp4Offset more in the layouts of offset
  // nibbles), with scales 2^(e - 128).
  WeightFormat weight_format = WeightFormat::int4_symmetric;
  // int8 (a linear layer's format) in a layout of nibbles: the layer's K, and everything else
  // above is the geometry of the int4 layer with zero points the kernels read: 2K inputs
  // (cols), two groups of K (group_size K), the high nibbles w >> 4 with zero point 0 and scale
  // 16 s, then the low nibbles (w & 15) - 8 with zero point -8 and scale s ("the planes"). The
  // header records the layer: K, group size -1, format int8. 0 for the other formats, and for
  // int8 in a layout of bytes (LayoutInfo::int8_bytes), whose geometry is the layer's own:
  // weight_format int8, K columns, channelwise.
  int64_t int8_cols = 0;
  bool has_bias = false;
  // w13 with an input order: after the panel records, int32 [cols] per expert, the input that
  // packed column c multiplies (a permutation of [0, cols): act-order checkpoints, whose scale
  // groups are contiguous only in that order); forward() gathers each row of x by it.
  bool has_input_order = false;
  size_t input_order_offset = 0;  // in the expert block
  int64_t row_weight_bytes = 0;
  int64_t block_rows = kBlockRows;  // rows of each part per block of the stored order
  int64_t panels = 0;               // rows_padded / P: records per expert
  // A panel record: weights at 0 (panel_weight_bytes), then scales, correction and bias.
  size_t panel_weight_bytes = 0, panel_scales_offset = 0, panel_zeros_offset = 0,
         panel_correction_offset = 0, panel_bias_offset = 0;
  size_t panel_bytes = 0;  // the record's size, a multiple of 64
  size_t expert_bytes = 0;
  size_t total_bytes = 0;

  bool channelwise() const noexcept { return group_size < 0; }
  // A linear layer's int8 weights, in either form; int8_planes(): as two int4 planes.
  bool int8() const noexcept { return int8_planes() || weight_format == WeightFormat::int8; }
  bool int8_planes() const noexcept { return int8_cols != 0; }
  // The layer as the header records it and inspect_packed() reports it: x's columns, the group
  // size and the format the caller gave.
  int64_t layer_cols() const noexcept { return int8_planes() ? int8_cols : cols; }
  int layer_group_size() const noexcept { return int8() ? -1 : group_size; }
  WeightFormat layer_format() const noexcept { return int8() ? WeightFormat::int8 : weight_format; }
  // The offset of the unsigned weights the kernels of offset layouts multiply: the quantizer's
  // group terms for rows meeting these weights are -offset * SUM q (QuantRow::group_terms).
  // A kernel set may start zero-point groups otherwise: KernelSet::group_term_offset.
  int32_t group_term_offset() const noexcept {
    return weight_format == WeightFormat::mxfp4             ? kMxfp4Offset
           : weight_format == WeightFormat::int4_zero_point ? kZeroPointOffset
           : weight_format == WeightFormat::int8            ? kInt8Offset
                                                            : 8;
  }
  bool has_zeros() const noexcept { return weight_format == WeightFormat::int4_zero_point; }
  // Rows of part `part` in the block that starts at part row b0 (a multiple of block_rows).
  int64_t block_len(int64_t b0) const noexcept {
    return b0 + block_rows <= part_rows_padded ? block_rows : part_rows_padded - b0;
  }
  // Stored row of row j of part `part` (j < part_rows_padded).
  int64_t stored_row(int64_t part, int64_t j) const noexcept {
    const int64_t b0 = j / block_rows * block_rows;
    return b0 * parts + part * block_len(b0) + (j - b0);
  }
  // Stored row of logical row n (halves order: gate rows, then up rows).
  int64_t padded_row(int64_t n) const noexcept { return stored_row(n / part_rows, n % part_rows); }
  // Panel q's record in an expert block, and its sections (Byte: uint8_t or const uint8_t).
  template <class Byte>
  Byte* panel_at(Byte* expert, int64_t q) const noexcept {
    return expert + static_cast<size_t>(q) * panel_bytes;
  }
  template <class Byte>
  Byte* panel_scales(Byte* expert, int64_t q) const noexcept {
    return panel_at(expert, q) + panel_scales_offset;
  }
  template <class Byte>
  Byte* panel_zeros(Byte* expert, int64_t q) const noexcept {
    return panel_at(expert, q) + panel_zeros_offset;
  }
  // The correction (bias) of stored row n; the rest of its panel's lanes follow it.
  template <class Byte>
  Byte* row_correction(Byte* expert, int64_t n) const noexcept {
    return panel_at(expert, n / panel) + panel_correction_offset +
           static_cast<size_t>(n % panel) * 4;
  }
  template <class Byte>
  Byte* input_order(Byte* expert) const noexcept {
    return expert + input_order_offset;
  }
  template <class Byte>
  Byte* row_bias(Byte* expert, int64_t n) const noexcept {
    return panel_at(expert, n / panel) + panel_bias_offset + static_cast<size_t>(n % panel) * 4;
  }
};

}  // namespace w4a8moe::detail
