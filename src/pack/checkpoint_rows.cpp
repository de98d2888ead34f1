// The decoder of one expert's projection in a checkpoint's own layout (checkpoint_rows.hpp;
// the bits: w4a8moe/checkpoint.hpp and docs/checkpoints.md).
#include "pack/checkpoint_rows.hpp"

#include <bit>
#include <cstring>

#include "common/argument_checks.hpp"
#include "common/format.hpp"
#include "common/numeric.hpp"

namespace w4a8moe::detail {

static_assert(std::endian::native == std::endian::little,
              "GPTQ's and compressed-tensors' words are read as their bytes: a little-endian CPU");

namespace {

uint32_t word_at(const void* base, int64_t i) {
  uint32_t w = 0;
  std::memcpy(&w, static_cast<const uint8_t*>(base) + i * 4, 4);
  return w;
}

bool is_gptq(CheckpointFormat f) {
  return f == CheckpointFormat::gptq || f == CheckpointFormat::gptq_v2;
}

void require_dtype(const TensorView& t, DType want, std::string_view name) {
  if (t.dtype != want)
    throw Error(cat(name, ": expected dtype ", dtype_name(want), ", got ", dtype_name(t.dtype)));
}

// " at [e, a, b]" or " at [a, b]"
std::string at(int64_t expert, int64_t a, int64_t b) {
  return expert < 0 ? cat(" at [", a, ", ", b, "]") : cat(" at [", expert, ", ", a, ", ", b, "]");
}

}  // namespace

void check_checkpoint_projection(const CheckpointProjection& p) {
  const int64_t n = p.rows, k = p.cols, groups = checkpoint_groups(p);
  const CheckpointFormat f = p.format;
  if (f == CheckpointFormat::mxfp4)
    throw Error(cat(p.weight_name, ": mxfp4 codes are packed as they are, not decoded"));
  require_data(p.weight.data, p.weight_name);
  require_dtype(p.weight, DType::i32, p.weight_name);
  require_contiguous(p.weight, p.weight_name);
  if (is_gptq(f))
    require_shape(p.weight, {k / 8, n}, p.weight_name);
  else if (f == CheckpointFormat::awq)
    require_shape(p.weight, {k, n / 8}, p.weight_name);
  else
    require_shape(p.weight, {n, k / 8}, p.weight_name);

  require_data(p.scale.data, p.scale_name);
  require_float(p.scale.dtype, p.scale_name);
  require_contiguous(p.scale, p.scale_name);
  if (f == CheckpointFormat::compressed_tensors) {
    if (groups == 1 && p.scale.rank == 1)
      require_shape(p.scale, {n}, p.scale_name);
    else
      require_shape(p.scale, {n, groups}, p.scale_name);
  } else {
    require_shape(p.scale, {groups, n}, p.scale_name);
  }

  if (!p.zero_point.empty()) {
    require_contiguous(p.zero_point, p.zero_point_name);
    if (f == CheckpointFormat::compressed_tensors && p.zero_point.dtype == DType::i8) {
      require_shape(p.zero_point, {n, groups}, p.zero_point_name);
    } else {
      require_dtype(p.zero_point, DType::i32, p.zero_point_name);
      if (f == CheckpointFormat::compressed_tensors)
        require_shape(p.zero_point, {(n + 7) / 8, groups}, p.zero_point_name);
      else
        require_shape(p.zero_point, {groups, n / 8}, p.zero_point_name);
    }
  }
  if (!p.g_idx.empty()) {
    if (f == CheckpointFormat::awq)
      throw Error(cat(p.g_idx_name, ": AWQ has no act-order, got a g_idx"));
    if (p.g_idx.dtype != DType::i32 && p.g_idx.dtype != DType::i64)
      throw Error(
          cat(p.g_idx_name, ": expected dtype i32 or i64, got ", dtype_name(p.g_idx.dtype)));
    require_shape(p.g_idx, {k}, p.g_idx_name);
  }
}

std::vector<int32_t> checkpoint_group_order(const CheckpointProjection& p) {
  if (p.g_idx.empty()) return {};
  const int64_t cols = p.cols, groups = checkpoint_groups(p);
  const int64_t g = p.group_size == -1 ? cols : p.group_size;
  std::vector<int64_t> count(static_cast<size_t>(groups), 0);
  bool trivial = true;
  for (int64_t k = 0; k < cols; ++k) {
    const int64_t b = load_index(p.g_idx.data, p.g_idx.dtype, k);
    if (b < 0 || b >= groups)
      throw Error(cat(p.g_idx_name, " puts input ", k, " in group ", b, ", outside [0, ", groups,
                      ")", p.expert < 0 ? "" : cat(" (expert ", p.expert, ")")));
    ++count[static_cast<size_t>(b)];
    trivial &= b == k / g;
  }
  if (trivial) return {};
  std::vector<int64_t> next(static_cast<size_t>(groups));
  for (int64_t b = 0; b < groups; ++b) {
    if (count[static_cast<size_t>(b)] != g)
      throw Error(cat(p.g_idx_name, " puts ", count[static_cast<size_t>(b)], " inputs in group ", b,
                      ", expected the group size ", g,
                      p.expert < 0 ? "" : cat(" (expert ", p.expert, ")")));
    next[static_cast<size_t>(b)] = b * g;
  }
  std::vector<int32_t> order(static_cast<size_t>(cols));
  for (int64_t k = 0; k < cols; ++k)
    order[static_cast<size_t>(
        next[static_cast<size_t>(load_index(p.g_idx.data, p.g_idx.dtype, k))]++)] =
        static_cast<int32_t>(k);
  return order;
}

namespace {

int64_t source_row(const int32_t* row_map, int64_t n) {
  return row_map == nullptr ? n : int64_t{row_map[n]};
}

}  // namespace

void decode_checkpoint_weights(const CheckpointProjection& p, const int32_t* row_map,
                               uint8_t* nibbles) {
  const int64_t rows = p.rows, cols = p.cols, row_bytes = cols / 2;
  const CheckpointFormat f = p.format;
  const auto source = [&](int64_t n) { return source_row(row_map, n); };

  // weights: rows of nibbles, value + 8 (GPTQ's unsigned q; compressed-tensors' stored value)
  if (f == CheckpointFormat::compressed_tensors) {  // word [n, k / 8]: the row's own bytes
    for (int64_t n = 0; n < rows; ++n)
      std::memcpy(nibbles + n * row_bytes,
                  static_cast<const uint8_t*>(p.weight.data) + source(n) * row_bytes,
                  static_cast<size_t>(row_bytes));
  } else if (is_gptq(f)) {  // word [k / 8, n]: inputs 8w .. 8w + 7 of row n, four of its bytes
    const auto* qw = static_cast<const uint8_t*>(p.weight.data);
    for (int64_t w = 0; w < cols / 8; ++w)
      for (int64_t n = 0; n < rows; ++n)
        std::memcpy(nibbles + n * row_bytes + 4 * w, qw + (w * rows + source(n)) * 4, 4);
  } else {  // AWQ: word [k, w] holds input k of rows 8w .. 8w + 7 in its nibble order
    const int64_t words = rows / 8;
    std::memset(nibbles, 0, static_cast<size_t>(rows * row_bytes));
    for (int64_t k = 0; k < cols; ++k)
      for (int64_t n = 0; n < rows; ++n) {
        const int64_t s = source(n);
        const uint32_t word = word_at(p.weight.data, k * words + s / 8);
        const auto q =
            static_cast<uint8_t>((word >> (4 * kAwqNibble[static_cast<size_t>(s % 8)])) & 15);
        nibbles[n * row_bytes + k / 2] |= static_cast<uint8_t>(q << (4 * (k % 2)));
      }
  }
}

void sort_checkpoint_columns(const std::vector<int32_t>& order, uint8_t* nibbles, int64_t rows,
                             int64_t cols) {
  const int64_t row_bytes = cols / 2;
  if (!order.empty()) {  // act-order: each row's columns in group order
    std::vector<uint8_t> row(static_cast<size_t>(row_bytes));
    for (int64_t n = 0; n < rows; ++n) {
      uint8_t* dst = nibbles + n * row_bytes;
      std::memcpy(row.data(), dst, row.size());
      std::memset(dst, 0, row.size());
      for (int64_t c = 0; c < cols; ++c) {
        const int32_t k = order[static_cast<size_t>(c)];
        const auto q =
            static_cast<uint8_t>((row[static_cast<size_t>(k / 2)] >> (4 * (k % 2))) & 15);
        dst[c / 2] |= static_cast<uint8_t>(q << (4 * (c % 2)));
      }
    }
  }
}

void decode_checkpoint_scales(const CheckpointProjection& p, const int32_t* row_map,
                              uint8_t* scales, DType scale_dtype) {
  const int64_t rows = p.rows, groups = checkpoint_groups(p);
  const CheckpointFormat f = p.format;
  const auto source = [&](int64_t n) { return source_row(row_map, n); };
  // scales [N, G]: GPTQ and AWQ store them [G, N]
  const size_t sbytes = dtype_bytes(scale_dtype);
  if (p.scale.dtype != scale_dtype && scale_dtype != DType::f32)
    throw Error(cat(p.scale_name, ": expected dtype ", dtype_name(scale_dtype), " or f32, got ",
                    dtype_name(p.scale.dtype)));
  const bool transposed = f != CheckpointFormat::compressed_tensors;
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t b = 0; b < groups; ++b) {
      const int64_t from = transposed ? b * rows + source(n) : source(n) * groups + b;
      const int64_t to = n * groups + b;
      if (p.scale.dtype == scale_dtype)
        std::memcpy(scales + static_cast<size_t>(to) * sbytes,
                    static_cast<const uint8_t*>(p.scale.data) + static_cast<size_t>(from) * sbytes,
                    sbytes);
      else
        store_float(scales, scale_dtype, to, load_float(p.scale.data, p.scale.dtype, from));
    }
}

void decode_checkpoint_zero_points(const CheckpointProjection& p, const int32_t* row_map,
                                   int8_t* zero_points) {
  const int64_t rows = p.rows, groups = checkpoint_groups(p);
  const CheckpointFormat f = p.format;
  const auto source = [&](int64_t n) { return source_row(row_map, n); };
  // zero points [N, G] as w4a8moe's z = zero - 8
  if (p.zero_point.empty())
    throw Error(cat(p.zero_point_name,
                    ": expected the zero points of an asymmetric layer, got "
                    "none"));
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t b = 0; b < groups; ++b) {
      const int64_t s = source(n);
      int zero = 0;  // unsigned, [0, 15]
      if (f == CheckpointFormat::compressed_tensors && p.zero_point.dtype == DType::i8) {
        const int z = static_cast<const int8_t*>(p.zero_point.data)[s * groups + b];
        if (z < -8 || z > 7)
          throw Error(
              cat(p.zero_point_name, " holds ", z, at(p.expert, s, b), ", outside int4 [-8, 7]"));
        zero = z + 8;
      } else if (f == CheckpointFormat::compressed_tensors) {  // eight rows a word, z + 8
        zero = static_cast<int>(
            (word_at(p.zero_point.data, (s / 8) * groups + b) >> (4 * (s % 8))) & 15);
      } else {  // eight outputs a word: GPTQ in order, AWQ in its nibble order
        const int nibble = f == CheckpointFormat::awq ? kAwqNibble[static_cast<size_t>(s % 8)]
                                                      : static_cast<int>(s % 8);
        const int stored = static_cast<int>(
            (word_at(p.zero_point.data, b * (rows / 8) + s / 8) >> (4 * nibble)) & 15);
        zero = stored + (f == CheckpointFormat::gptq ? 1 : 0);
        if (zero > 15)
          throw Error(cat(p.zero_point_name, " stores 15", at(p.expert, b, s),
                          ": zero 16 in a \"gptq\" checkpoint (zeros stored less one), outside "
                          "[0, 15]"));
      }
      zero_points[n * groups + b] = static_cast<int8_t>(zero - 8);
    }
}

void decode_checkpoint_projection(const CheckpointProjection& p, const std::vector<int32_t>& order,
                                  const int32_t* row_map, uint8_t* nibbles, uint8_t* scales,
                                  DType scale_dtype, int8_t* zero_points) {
  decode_checkpoint_weights(p, row_map, nibbles);
  sort_checkpoint_columns(order, nibbles, p.rows, p.cols);
  decode_checkpoint_scales(p, row_map, scales, scale_dtype);
  if (zero_points != nullptr) decode_checkpoint_zero_points(p, row_map, zero_points);
}

}  // namespace w4a8moe::detail
