#include "pack/packed_format.hpp"

#include <cstring>
#include <limits>
#include <string>

#include "common/checked_math.hpp"
#include "common/format.hpp"
#include "common/numeric.hpp"

namespace w4a8moe::detail {

static size_t align_up(size_t v) { return checked_add(v, kAlign - 1) / kAlign * kAlign; }

// The geometry of checked dimensions in layout `info`.
static Geometry layer_geometry(const LayoutInfo& info, WeightRole role, int64_t experts,
                               int64_t rows, int64_t cols, int group_size, DType scale_dtype,
                               bool has_bias, WeightFormat weight_format, bool has_input_order) {
  Geometry g;
  g.layout = info.id;
  g.role = role;
  g.experts = experts;
  g.rows = rows;
  g.cols = cols;
  g.panel = info.panel;
  g.parts = role == WeightRole::w13 ? 2 : 1;
  g.part_rows = rows / g.parts;
  g.part_rows_padded = (g.part_rows + g.panel - 1) / g.panel * g.panel;
  g.rows_padded = g.parts * g.part_rows_padded;
  g.cols_padded = (cols + kBlock - 1) / kBlock * kBlock;
  g.group_size = group_size;
  g.group_len = group_size < 0 ? g.cols_padded : group_size;
  g.groups = g.cols_padded / g.group_len;
  g.scale_dtype = scale_dtype;
  g.has_bias = has_bias;
  g.weight_format = weight_format;
  g.row_weight_bytes = info.int8_bytes ? g.cols_padded : g.cols_padded / 2;

  g.block_rows = kBlockRows;
  g.panels = g.rows_padded / g.panel;
  // A panel record: sections 16-byte aligned, the record 64-byte aligned.
  const size_t P = static_cast<size_t>(g.panel);
  auto align16 = [](size_t v) { return checked_add(v, size_t{15}) / 16 * 16; };
  g.panel_weight_bytes = checked_mul(P, static_cast<size_t>(g.row_weight_bytes));
  g.panel_scales_offset = align16(g.panel_weight_bytes);
  g.panel_zeros_offset = align16(checked_add(
      g.panel_scales_offset,
      checked_mul(checked_mul(P, static_cast<size_t>(g.groups)), dtype_bytes(scale_dtype))));
  g.panel_correction_offset = align16(checked_add(
      g.panel_zeros_offset, g.has_zeros() ? checked_mul(P, static_cast<size_t>(g.groups)) : 0));
  g.panel_bias_offset = align16(checked_add(g.panel_correction_offset, P * 4));
  g.panel_bytes =
      align_up(has_bias ? checked_add(g.panel_bias_offset, P * 4) : g.panel_bias_offset);
  g.expert_bytes = checked_mul(static_cast<size_t>(g.panels), g.panel_bytes);
  g.has_input_order = has_input_order;
  g.input_order_offset = g.expert_bytes;
  if (has_input_order)
    g.expert_bytes =
        checked_add(g.expert_bytes, align_up(checked_mul(static_cast<size_t>(cols), 4)));
  g.total_bytes =
      checked_add(kHeaderBytes, checked_mul(static_cast<size_t>(experts), g.expert_bytes));
  return g;
}

Geometry make_geometry(LayoutId layout, WeightRole role, int64_t experts, int64_t rows,
                       int64_t cols, int group_size, DType scale_dtype, bool has_bias,
                       WeightFormat weight_format, std::string_view argument,
                       bool has_input_order) {
  const LayoutInfo& info = layout_info(static_cast<uint32_t>(layout), argument);
  if (info.int8_bytes && weight_format != WeightFormat::int8)
    throw Error(cat(argument, ": expected int8 weights for layout ", info.name,
                    " (a layout of int8 bytes), got ", weight_format_name(weight_format),
                    " weights"));
  if (weight_format == WeightFormat::int8) {
    // As bytes, or as two int4 planes of K inputs each in a layout of nibbles
    // (Geometry::int8_cols; docs/packed-format.md, "Weight formats in the records").
    if (role != WeightRole::w2 || experts != 1)
      throw Error(cat(argument,
                      ": expected one expert of role w2 for int8 weights (a linear layer's "
                      "format), got ",
                      experts, " expert(s) of role ", role == WeightRole::w13 ? "w13" : "w2"));
    if (cols < 1 || cols % kBlock != 0 || cols > kMaxInt8Cols)
      throw Error(cat(argument, ": expected an input dimension K that is a multiple of ", kBlock,
                      " in [", kBlock, ", ", kMaxInt8Cols,
                      "] for int8 weights (int32 accumulators), got K = ", cols));
    if (group_size != -1 && group_size != cols)
      throw Error(cat(argument, ": expected group size -1 or K (", cols,
                      ") for int8 weights (one scale per output row), got ", group_size));
    if (!info.int8_bytes) {
      Geometry g =
          make_geometry(layout, role, experts, rows, 2 * cols, static_cast<int>(cols), scale_dtype,
                        has_bias, WeightFormat::int4_zero_point, argument, has_input_order);
      g.int8_cols = cols;
      return g;
    }
    group_size = -1;  // as bytes: the layer's own geometry, one scale per row
  }
  const int64_t u32max = std::numeric_limits<uint32_t>::max();
  if (experts < 1 || experts > u32max || rows < 1 || rows > u32max || cols < 1 || cols > u32max)
    throw Error(cat(argument, ": expected experts, rows and columns in [1, 2^32), got ", experts,
                    " x ", rows, " x ", cols));
  if (cols > kMaxCols)
    throw Error(cat(argument, ": expected at most ", kMaxCols,
                    " input columns (int32 accumulators), got ", cols));
  if (!group_size_fits(group_size, cols))
    throw Error(cat(
        argument, ": expected group size -1 or a multiple of 32 that divides the input dimension ",
        cols, ", got ", group_size));
  if (!is_float_dtype(scale_dtype))
    throw Error(
        cat(argument, ": expected scale dtype f32, bf16 or f16, got ", dtype_name(scale_dtype)));
  if (has_input_order && role != WeightRole::w13)
    throw Error(cat(argument, ": an input order is w13's only (w2's inputs are w13's rows)"));
  if (role == WeightRole::w13 && !is_valid_w13_rows(rows))
    throw Error(cat(argument, ": expected an even number of rows (gate and up, 2I), got ", rows));
  return layer_geometry(info, role, experts, rows, cols, group_size, scale_dtype, has_bias,
                        weight_format, has_input_order);
}

uint64_t header_checksum(const PackedHeader& header) noexcept {
  const auto* p = reinterpret_cast<const uint8_t*>(&header);
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < offsetof(PackedHeader, checksum); ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

Geometry read_geometry(std::span<const uint8_t> packed, std::string_view argument) {
  if (packed.data() == nullptr || packed.size() < kHeaderBytes)
    throw Error(cat(argument, ": expected a packed weight buffer of at least ", kHeaderBytes,
                    " bytes, got ", packed.size(), " bytes"));
  PackedHeader h;
  std::memcpy(&h, packed.data(), sizeof h);
  if (std::memcmp(h.magic, kPackedMagic, sizeof kPackedMagic) != 0)
    throw Error(cat(argument, ": not a w4a8moe packed buffer (bad magic bytes)"));
  if (h.version != kPackedFormatVersion)
    throw Error(cat(argument, ": expected packed format version ", kPackedFormatVersion,
                    ", got version ", h.version, "; repack the weights with this build"));
  if (h.checksum != header_checksum(h))
    throw Error(cat(argument, ": the packed header is corrupted (checksum mismatch)"));
  if (h.header_bytes != kHeaderBytes)
    throw Error(
        cat(argument, ": expected a header of ", kHeaderBytes, " bytes, got ", h.header_bytes));
  layout_info(h.layout, argument);  // throws on an unknown layout
  if (h.role > 1) throw Error(cat(argument, ": invalid weight role ", h.role, " in header"));
  if (h.scale_dtype > static_cast<uint32_t>(DType::f16))
    throw Error(cat(argument, ": invalid scale dtype code ", h.scale_dtype, " in header"));
  if ((h.flags & ~(kFlagBias | kFlagInputOrder)) != 0)
    throw Error(cat(argument, ": unknown header flags ", h.flags));
  if ((h.flags & kFlagInputOrder) != 0 && h.role != static_cast<uint32_t>(WeightRole::w13))
    throw Error(cat(argument, ": a w2 buffer with an input order flag (w13's only) in header"));
  const auto format = static_cast<WeightFormat>(h.weight_format);
  if (!is_known_weight_format(h.weight_format))
    throw Error(cat(argument,
                    ": expected weight format 0 (int4 symmetric), 1 (int4 with zero points), 2 "
                    "(mxfp4) or 3 (int8), got ",
                    h.weight_format, " in header"));
  if (format == WeightFormat::mxfp4 &&
      (h.group_size != 32 || h.scale_dtype != static_cast<uint32_t>(DType::bf16)))
    throw Error(cat(argument, ": expected group size 32 and bf16 scales for mxfp4 weights, got ",
                    "group size ", h.group_size, " and scale dtype code ", h.scale_dtype,
                    " in header"));
  if (format == WeightFormat::int8 && h.group_size != -1)
    throw Error(cat(argument, ": expected group size -1 for int8 weights, got group size ",
                    h.group_size, " in header"));
  if (h.block_rows != kBlockRows)
    throw Error(cat(argument, ": expected blocks of ", kBlockRows, " rows, got ", h.block_rows,
                    " in header"));
  Geometry g =
      make_geometry(static_cast<LayoutId>(h.layout), static_cast<WeightRole>(h.role), h.experts,
                    h.rows, h.cols, h.group_size, static_cast<DType>(h.scale_dtype),
                    (h.flags & kFlagBias) != 0, format, argument, (h.flags & kFlagInputOrder) != 0);
  if (g.expert_bytes != h.expert_bytes || g.total_bytes != h.total_bytes ||
      g.panel_bytes != h.panel_bytes)
    throw Error(cat(argument, ": the header's sizes do not match its dimensions"));
  if (packed.size() != g.total_bytes)
    throw Error(cat(argument, ": expected ", g.total_bytes, " bytes for ", g.experts,
                    " experts of ", g.rows, " x ", g.layer_cols(), ", got ", packed.size(),
                    " bytes (truncated or padded buffer)"));
  return g;
}

ForwardShape check_packed_pair(const Geometry& w13, const Geometry& w2, std::string_view w13_name,
                               std::string_view w2_name) {
  const auto refuse_int8 = [](const Geometry& g, std::string_view name) {
    if (g.int8())
      throw Error(cat(name,
                      ": expected an MoE layer's int4 or mxfp4 weights, got int8 weights (a "
                      "dense linear layer's format: run them with linear())"));
  };
  refuse_int8(w13, w13_name);
  refuse_int8(w2, w2_name);
  if (w13.role != WeightRole::w13)
    throw Error(cat(w13_name, ": expected weights packed as w13, got a buffer packed as w2"));
  if (w2.role != WeightRole::w2)
    throw Error(cat(w2_name, ": expected weights packed as w2, got a buffer packed as w13"));
  if (!is_valid_w13_rows(w13.rows))
    throw Error(cat(w13_name, ": expected an even number of rows (2I), got ", w13.rows));
  ForwardShape s;
  s.experts = w13.experts;
  s.hidden = w13.cols;
  s.inter = w13.rows / 2;
  if (w2.experts != s.experts || w2.rows != s.hidden || w2.cols != s.inter)
    throw Error(cat(w2_name, ": expected ", s.experts, " experts of [", s.hidden, ", ", s.inter,
                    "] to match ", w13_name, ", got ", w2.experts, " experts of [", w2.rows, ", ",
                    w2.cols, "]"));
  if (w13.group_size != w2.group_size)
    throw Error(cat(w2_name, ": expected group size ", w13.group_size, " (the group size of ",
                    w13_name, "), got ", w2.group_size));
  if (w13.layout != w2.layout)
    throw Error(cat(w2_name, ": expected layout ", layout_name(w13.layout), " (the layout of ",
                    w13_name, "), got ", layout_name(w2.layout)));
  return s;
}

}  // namespace w4a8moe::detail
