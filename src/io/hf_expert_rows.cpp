// Reading a Hugging Face layer's experts (hf_layer.hpp): per-expert int4 (pack-quantized,
// int-quantized, with or without zero points) copied exactly, float ones quantized on load, fused
// ones a strip of rows at a time; and releasing their file pages.
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/format.hpp"
#include "common/numeric.hpp"
#include "io/convert.hpp"
#include "io/hf_layer.hpp"

namespace w4a8moe::io {

namespace {

using detail::cat;

// Output rows decoded and converted at a time from a fused [in, out] tensor.
constexpr int64_t kStripRows = 32;

}  // namespace

// Returns the act-order column order applied (empty: none), as group_order().
std::vector<int32_t> HfLayer::load_rows(int which, int64_t e, uint8_t* nibbles, uint8_t* scales,
                                        DType scale_dtype, int8_t* zero_points) const {
  const ProjectionShape p = projection_shape(info_, which);
  const int64_t rows = p.rows, cols = p.cols, groups = p.groups;
  const int g = info_.group_size;
  if (scheme_ == HfScheme::dense) {
    load_dense_rows(which, e, nibbles, scales, scale_dtype);
    return {};
  }
  if (is_gptq()) return load_gptq_rows(which, e, nibbles, scales, scale_dtype, zero_points);

  // scales: as stored (a widening to f32 when gate and up differ), channel [N, 1] or [N] or
  // one per tensor (broadcast to every row: the same values)
  const std::string scale_name = tensor_name(e, which, "weight_scale");
  if (!has(scale_name)) fail(cat("tensor '", scale_name, "' is missing"));
  const TensorEntry& se = entry(scale_name);
  const int64_t scale_count = g == -1 ? rows : rows * groups;
  int64_t stored = 1;
  for (const int64_t d : se.shape) stored *= d;
  const bool per_tensor = g == -1 && stored == 1;
  if (!detail::is_float_dtype(se.dtype) || (stored != scale_count && !per_tensor) ||
      (g != -1 && se.shape != std::vector<int64_t>{rows, groups}))
    fail(cat("tensor '", scale_name, "' must be float ",
             g == -1 ? shape_string(std::vector<int64_t>{rows, 1})
                     : shape_string(std::vector<int64_t>{rows, groups}),
             ", got ", safetensors_dtype_name(se.dtype), " ", shape_string(se.shape)));
  const std::span<const uint8_t> sb = bytes(scale_name);
  for (int64_t i = 0; i < scale_count; ++i) {
    const int64_t src = per_tensor ? 0 : i;
    if (se.dtype == scale_dtype) {
      std::memcpy(scales + i * static_cast<int64_t>(dtype_bytes(scale_dtype)),
                  sb.data() + src * static_cast<int64_t>(dtype_bytes(se.dtype)),
                  dtype_bytes(se.dtype));
    } else if (scale_dtype == DType::f32) {
      store_scale(scales, scale_dtype, i, detail::load_float(sb.data(), se.dtype, src));
    } else {
      fail(cat("tensor '", scale_name, "' is ", safetensors_dtype_name(se.dtype),
               " but expert 0's scales are ", dtype_name(scale_dtype)));
    }
  }

  if (scheme_ == HfScheme::packed) {
    const std::string shape_name = tensor_name(e, which, "weight_shape");
    if (!has(shape_name)) fail(cat("tensor '", shape_name, "' is missing"));
    const TensorEntry& she = entry(shape_name);
    if ((she.dtype != DType::i64 && she.dtype != DType::i32) ||
        she.shape != std::vector<int64_t>{2})
      fail(cat("tensor '", shape_name, "' must be I64 or I32 [2], got ",
               safetensors_dtype_name(she.dtype), " ", shape_string(she.shape)));
    const std::span<const uint8_t> shb = bytes(shape_name);
    const int64_t n0 = detail::load_index(shb.data(), she.dtype, 0);
    const int64_t n1 = detail::load_index(shb.data(), she.dtype, 1);
    if (n0 != rows || n1 != cols)
      fail(cat("tensor '", shape_name, "' says [", n0, ", ", n1, "], expected [", rows, ", ", cols,
               "] from config.json"));
    // cols is a multiple of 32 (the group-size check), so the words hold no padding
    const std::span<const uint8_t> wb =
        require(tensor_name(e, which, "weight_packed"), DType::i32, {rows, cols / 8});
    std::memcpy(nibbles, wb.data(), wb.size());
  } else {
    const std::string name = tensor_name(e, which, "weight");
    const std::span<const uint8_t> wb = require(name, DType::i8, {rows, cols});
    const auto* v = reinterpret_cast<const int8_t*>(wb.data());
    for (int64_t i = 0; i < rows * cols; ++i)
      if (v[i] < -8 || v[i] > 7)
        fail(cat("tensor '", name, "' holds ", int{v[i]}, " at [", i / cols, ", ", i % cols,
                 "], outside int4 [-8, 7]"));
    pack_nibbles(v, rows * cols, nibbles);
  }
  load_zero_points(which, e, zero_points);
  // actorder "group": weight_g_idx as GPTQ's g_idx
  const detail::CheckpointProjection cp = projection(which, e, "weight_g_idx");
  std::vector<int32_t> order;
  decoded([&] { order = detail::checkpoint_group_order(cp); });
  check_order(which, e, "weight_g_idx", order);
  detail::sort_checkpoint_columns(order, nibbles, rows, cols);
  return order;
}

// Act-order (an order not empty) is w13's only when the layer has an input order
// (LayerInfo::w13_input_order), else the file contradicts its config.
void HfLayer::check_order(int which, int64_t e, const char* g_idx,
                          const std::vector<int32_t>& order) const {
  if (order.empty() || which == 2 || info_.w13_input_order) return;
  fail(cat("tensor '", tensor_name(e, which, g_idx),
           "' permutes the inputs (act-order) but config.json quantization_config says ",
           is_gptq() ? "desc_act: false" : "no actorder \"group\""));
}

// The library's view of projection `which` of expert e: its sizes, and its g_idx (checked here
// as a file's tensor) when the file has one (g_idx: the tensor's suffix; nullptr: none read). The
// caller sets the format and the other views.
detail::CheckpointProjection HfLayer::projection(int which, int64_t e, const char* g_idx) const {
  const ProjectionShape p = projection_shape(info_, which);
  detail::CheckpointProjection cp;
  cp.rows = p.rows;
  cp.cols = p.cols;
  cp.group_size = info_.group_size;
  if (g_idx == nullptr) return cp;
  const std::string name = tensor_name(e, which, g_idx);
  cp.g_idx_name = cat("tensor '", name, "'");
  if (has(name)) {
    const TensorEntry& t = entry(name);
    if ((t.dtype != DType::i32 && t.dtype != DType::i64) || t.shape != std::vector<int64_t>{p.cols})
      fail(cat("tensor '", name, "' must be I32 or I64 ",
               shape_string(std::vector<int64_t>{p.cols}), ", got ",
               safetensors_dtype_name(t.dtype), " ", shape_string(t.shape)));
    cp.g_idx = TensorView::of(bytes(name).data(), t.dtype, {p.cols});
  }
  return cp;
}

// The library's errors about a tensor's values, as this checkpoint's.
void HfLayer::decoded(const std::function<void()>& decode) const {
  try {
    decode();
  } catch (const Error& error) {
    fail(error.what());
  }
}

// compressed-tensors' weight_zero_point of projection `which` of expert e, one per scale: packed
// like the weights but along the rows (pack-quantized: I32 [ceil(rows / 8), groups], element
// (r, b) in bits 4 (r % 8) of word [r / 8, b], stored z + 8), or int8 [rows, groups]
// (int-quantized), or one for the tensor. Into `out` for asymmetric schemes; symmetric ones may
// carry all-zero zero points (older writers), which are checked and dropped.
void HfLayer::load_zero_points(int which, int64_t e, int8_t* out) const {
  const std::string name = tensor_name(e, which, "weight_zero_point");
  if (!has(name)) {
    if (!quantization_.symmetric)
      fail(cat("tensor '", name,
               "' is missing (config.json quantization_config says symmetric: false)"));
    return;
  }
  const ProjectionShape p = projection_shape(info_, which);
  const int64_t rows = p.rows, groups = info_.group_size == -1 ? 1 : p.groups;
  const TensorEntry& t = entry(name);
  int64_t stored = 1;
  for (const int64_t d : t.shape) stored *= d;
  const bool packed =
      t.dtype == DType::i32 && t.shape == std::vector<int64_t>{(rows + 7) / 8, groups};
  const bool bytes_per_value =
      t.dtype == DType::i8 &&
      (t.shape == std::vector<int64_t>{rows, groups} ||
       (groups == 1 && (t.shape == std::vector<int64_t>{rows} || stored == 1)));
  if (!packed && !bytes_per_value)
    fail(cat("tensor '", name, "' must be I32 ",
             shape_string(std::vector<int64_t>{(rows + 7) / 8, groups}),
             " (packed along the rows) or I8 ", shape_string(std::vector<int64_t>{rows, groups}),
             ", got ", safetensors_dtype_name(t.dtype), " ", shape_string(t.shape)));
  // the library's decoder for the forms it knows (I32 packed, I8 [rows, groups]); the I8 forms
  // of one value per row or per tensor here
  std::vector<int8_t> z(static_cast<size_t>(rows * groups));
  const std::span<const uint8_t> b = bytes(name);
  if (packed || t.shape == std::vector<int64_t>{rows, groups}) {
    detail::CheckpointProjection cp = projection(which, e, nullptr);
    cp.format = CheckpointFormat::compressed_tensors;
    cp.zero_point = TensorView::of(b.data(), t.dtype, {t.shape[0], t.shape[1]});
    cp.zero_point_name = cat("tensor '", name, "'");
    decoded([&] { detail::decode_checkpoint_zero_points(cp, nullptr, z.data()); });
  } else {
    for (int64_t i = 0; i < rows * groups; ++i) {
      const int8_t v = reinterpret_cast<const int8_t*>(b.data())[stored == 1 ? 0 : i];
      if (v < -8 || v > 7)
        fail(cat("tensor '", name, "' holds ", int{v}, " at [", i / groups, ", ", i % groups,
                 "], outside int4 [-8, 7]"));
      z[static_cast<size_t>(i)] = v;
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t v = z[static_cast<size_t>(r * groups + g)];
      if (!quantization_.symmetric)
        out[r * groups + g] = v;
      else if (v != 0)
        fail(cat("tensor '", name, "' holds zero point ", int{v}, " at [", r, ", ", g,
                 "] but config.json quantization_config says symmetric weights"));
    }
}

// GPTQ / AWQ (gptq_scheme.hpp): the [in, out] packing transposed to rows of nibbles q (w4a8moe's
// w + 8 is GPTQ's unsigned q), the [groups, out] scales and zeros to [out, groups]. Act-order
// (a g_idx other than k / g): the columns in group_order(), which is returned (else empty); the
// scales and zeros, indexed by group, stay.
std::vector<int32_t> HfLayer::load_gptq_rows(int which, int64_t e, uint8_t* nibbles,
                                             uint8_t* scales, DType scale_dtype,
                                             int8_t* zero_points) const {
  const ProjectionShape p = projection_shape(info_, which);
  const int64_t rows = p.rows, cols = p.cols, words = rows / 8;
  const int64_t groups = info_.group_size == -1 ? 1 : p.groups;
  const bool awq = gptq_.awq;
  const std::string qweight = tensor_name(e, which, "qweight");
  const uint8_t* qw =
      require(qweight, DType::i32,
              awq ? std::vector<int64_t>{cols, words} : std::vector<int64_t>{cols / 8, rows})
          .data();
  const std::string qzeros = tensor_name(e, which, "qzeros");
  const uint8_t* qz = require(qzeros, DType::i32, {groups, words}).data();
  const std::string scale_name = tensor_name(e, which, "scales");
  const TensorEntry& se = require_float(scale_name, {groups, rows});
  if (se.dtype != scale_dtype && scale_dtype != DType::f32)
    fail(cat("tensor '", scale_name, "' is ", safetensors_dtype_name(se.dtype),
             " but expert 0's scales are ", dtype_name(scale_dtype)));
  // the values, through the library's decoder of these layouts (w4a8moe/checkpoint.hpp)
  detail::CheckpointProjection cp = projection(which, e, "g_idx");
  cp.format = awq                     ? CheckpointFormat::awq
              : gptq_.zeros_minus_one ? CheckpointFormat::gptq
                                      : CheckpointFormat::gptq_v2;
  cp.weight = TensorView::of(qw, DType::i32, {awq ? cols : cols / 8, awq ? words : rows});
  cp.weight_name = cat("tensor '", qweight, "'");
  cp.scale = TensorView::of(bytes(scale_name).data(), se.dtype, {groups, rows});
  cp.zero_point = TensorView::of(qz, DType::i32, {groups, words});
  cp.zero_point_name = cat("tensor '", qzeros, "'");
  std::vector<int8_t> zeros(static_cast<size_t>(rows * groups));
  std::vector<int32_t> order;
  decoded([&] {
    order = detail::checkpoint_group_order(cp);
    detail::decode_checkpoint_projection(cp, order, nullptr, nibbles, scales, scale_dtype,
                                         zeros.data());
  });
  for (int64_t b = 0; b < groups; ++b)
    for (int64_t n = 0; n < rows; ++n) {
      const int8_t z = zeros[static_cast<size_t>(n * groups + b)];
      if (zero_points != nullptr)
        zero_points[n * groups + b] = z;
      else if (z != 0)
        fail(cat("tensor '", qzeros, "' holds zero ", z + 8, " at [", b, ", ", n,
                 "] but config.json quantization_config says sym: true (every zero 8)"));
    }
  check_order(which, e, "g_idx", order);
  if (const std::string name = tensor_name(e, which, "bias"); has(name))
    fail(cat("tensor '", name, "' exists: the experts' projections have no bias in w4a8moe"));
  return order;
}

void HfLayer::load_fused_rows(int which, int64_t e, uint8_t* nibbles, uint8_t* scales,
                              DType scale_dtype, float* bias) const {
  const int64_t H = info_.hidden, I = info_.inter;
  const ProjectionShape p = projection_shape(info_, which);
  const int64_t rows = p.rows, cols = p.cols, groups = p.groups;
  const int64_t outs = which == 2 ? H : 2 * I;  // columns of the fused [in, out] matrix
  const int g = info_.group_size;
  const std::string& what = conversions_[static_cast<size_t>(which)].tensor;
  Conversion stats;
  std::vector<float> strip(static_cast<size_t>(kStripRows * cols));
  std::vector<float> row_scales(static_cast<size_t>(groups));
  const auto convert = [&](const float* row, int64_t n) {
    convert_row(row, cols, g, options_.rule, nibbles + n * (cols / 2), row_scales.data(), stats,
                cat("checkpoint '", folder_, "': tensor '", what, "' expert ", e, " row ", n));
    for (int64_t s = 0; s < groups; ++s)
      store_scale(scales, scale_dtype, n * groups + s, row_scales[static_cast<size_t>(s)]);
  };
  if (scheme_ == HfScheme::fused_float) {
    const std::string name = fused(which, "");
    const DType dtype = entry(name).dtype;
    const uint8_t* matrix =
        bytes(name).data() + static_cast<size_t>(e * cols * outs) * dtype_bytes(dtype);
    const int64_t step = which != 2 && family_->fused == FusedGateUp::interleaved ? 2 : 1;
    for (int64_t r0 = 0; r0 < rows; r0 += kStripRows) {
      const int64_t count = std::min(kStripRows, rows - r0);
      gather_columns(matrix, dtype, cols, outs, fused_column(which, r0), step, count, strip.data());
      for (int64_t r = 0; r < count; ++r) convert(strip.data() + r * cols, r0 + r);
    }
    add_conversion(which, stats);
  } else {
    // MXFP4, exactly: a block's 16 bytes hold elements 2j (low nibble) and 2j + 1 (high), the
    // order of the slot's nibbles, and its scale is the e8m0 exponent the packer takes
    const uint8_t* blocks = bytes(fused(which, "_blocks")).data();
    const uint8_t* block_scales = bytes(fused(which, "_scales")).data();
    const int64_t blocks_per_row = cols / 32;
    for (int64_t n = 0; n < rows; ++n) {
      const int64_t at = (e * outs + fused_column(which, n)) * blocks_per_row;
      std::memcpy(nibbles + n * (cols / 2), blocks + at * 16, static_cast<size_t>(cols / 2));
      for (int64_t b = 0; b < blocks_per_row; ++b) {
        if (block_scales[at + b] == 255)
          fail(cat("tensor '", fused(which, "_scales"), "' expert ", e, " row ",
                   fused_column(which, n), " block ", b,
                   ": e8m0 scale 255 is NaN (OCP MX), which no weight can be"));
        scales[n * blocks_per_row + b] = block_scales[at + b];
      }
    }
  }
  if (bias != nullptr) {
    const std::string name = fused(which, "_bias");
    const DType dtype = entry(name).dtype;
    const uint8_t* b = bytes(name).data();
    for (int64_t r = 0; r < rows; ++r)
      bias[r] = detail::load_float(b, dtype, e * outs + fused_column(which, r));
  }
}

// A float [rows, cols] tensor of expert e, quantized on load.
void HfLayer::load_dense_rows(int which, int64_t e, uint8_t* nibbles, uint8_t* scales,
                              DType scale_dtype) const {
  const ProjectionShape p = projection_shape(info_, which);
  const int64_t rows = p.rows, cols = p.cols, groups = p.groups;
  const int g = info_.group_size;
  const std::string name = tensor_name(e, which, "weight");
  if (!has(name)) fail(cat("tensor '", name, "' is missing"));
  const TensorEntry& t = entry(name);
  if (!detail::is_float_dtype(t.dtype) || t.shape != std::vector<int64_t>{rows, cols})
    fail(cat("tensor '", name, "' must be a float ", shape_string(std::vector<int64_t>{rows, cols}),
             ", got ", safetensors_dtype_name(t.dtype), " ", shape_string(t.shape)));
  const std::span<const uint8_t> b = bytes(name);
  Conversion stats;
  std::vector<float> row(static_cast<size_t>(cols)), row_scales(static_cast<size_t>(groups));
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t k = 0; k < cols; ++k)
      row[static_cast<size_t>(k)] = detail::load_float(b.data(), t.dtype, n * cols + k);
    convert_row(row.data(), cols, g, options_.rule, nibbles + n * (cols / 2), row_scales.data(),
                stats, cat("checkpoint '", folder_, "': tensor '", name, "' row ", n));
    for (int64_t s = 0; s < groups; ++s)
      store_scale(scales, scale_dtype, n * groups + s, row_scales[static_cast<size_t>(s)]);
  }
  add_conversion(which, stats);
}

void HfLayer::load_expert(int64_t e, const ExpertSlot& slot) const {
  const int64_t H = info_.hidden, I = info_.inter;
  const int g = info_.group_size;
  const int64_t g13 = g == -1 ? 1 : H / g;
  const size_t s13 = dtype_bytes(info_.w13_scale_dtype);
  uint8_t* const up = slot.w13 + I * (H / 2);
  uint8_t* const up_scales = slot.w13_scale + static_cast<size_t>(I * g13) * s13;
  if (is_fused()) {
    load_fused_rows(0, e, slot.w13, slot.w13_scale, info_.w13_scale_dtype, slot.w13_bias);
    load_fused_rows(1, e, up, up_scales, info_.w13_scale_dtype,
                    slot.w13_bias != nullptr ? slot.w13_bias + I : nullptr);
    load_fused_rows(2, e, slot.w2, slot.w2_scale, info_.w2_scale_dtype, slot.w2_bias);
    return;
  }
  int8_t* const up_zero_points =
      slot.w13_zero_point != nullptr ? slot.w13_zero_point + I * g13 : nullptr;
  // Act-order: w13's input order is its gate's group order (up's must be the same: one order
  // serves both); down's group order sorts its inputs, the intermediate, so w13's gate and up
  // rows (scales, zero points) move with them and no order is needed at run time.
  const std::vector<int32_t> gate_order =
      load_rows(0, e, slot.w13, slot.w13_scale, info_.w13_scale_dtype, slot.w13_zero_point);
  const std::vector<int32_t> up_order =
      load_rows(1, e, up, up_scales, info_.w13_scale_dtype, up_zero_points);
  const char* g_idx = is_gptq() ? "g_idx" : "weight_g_idx";
  if (gate_order != up_order)
    fail(cat("tensors '", tensor_name(e, 0, g_idx), "' and '", tensor_name(e, 1, g_idx),
             "' order the inputs differently: w13's gate and up share one input order"));
  if (slot.w13_input_order != nullptr)
    for (int64_t c = 0; c < H; ++c)
      slot.w13_input_order[c] =
          gate_order.empty() ? static_cast<int32_t>(c) : gate_order[static_cast<size_t>(c)];
  const std::vector<int32_t> down_order =
      load_rows(2, e, slot.w2, slot.w2_scale, info_.w2_scale_dtype, slot.w2_zero_point);
  if (down_order.empty()) return;
  // w13 row j of each part becomes row down_order[j]
  const size_t scale_bytes = static_cast<size_t>(g13) * dtype_bytes(info_.w13_scale_dtype);
  const auto permute = [&](uint8_t* base, size_t row_bytes) {
    std::vector<uint8_t> old(base, base + static_cast<size_t>(2 * I) * row_bytes);
    for (int64_t part = 0; part < 2; ++part)
      for (int64_t j = 0; j < I; ++j)
        std::memcpy(
            base + static_cast<size_t>(part * I + j) * row_bytes,
            old.data() +
                static_cast<size_t>(part * I + down_order[static_cast<size_t>(j)]) * row_bytes,
            row_bytes);
  };
  permute(slot.w13, static_cast<size_t>(H / 2));
  permute(slot.w13_scale, scale_bytes);
  if (slot.w13_zero_point != nullptr)
    permute(reinterpret_cast<uint8_t*>(slot.w13_zero_point), static_cast<size_t>(g13));
}

void HfLayer::release_expert(int64_t e) const {
  if (is_fused()) {
    // expert e's part of each fused [E, ...] tensor
    for (const int which : {0, 2})
      for (const char* suffix : {"", "_blocks", "_scales", "_bias"}) {
        const std::string name = fused(which, suffix);
        if (!has(name)) continue;
        const std::span<const uint8_t> b = bytes(name);
        const size_t per_expert = b.size() / static_cast<size_t>(info_.experts);
        release_mapped(b.data() + static_cast<size_t>(e) * per_expert, per_expert);
      }
    return;
  }
  for (int which = 0; which < 3; ++which)
    for (const char* suffix : {"weight_packed", "weight", "weight_scale", "weight_zero_point",
                               "weight_g_idx", "qweight", "qzeros", "scales", "g_idx"}) {
      const std::string name = tensor_name(e, which, suffix);
      if (has(name)) tensors_.release(name);
    }
}

}  // namespace w4a8moe::io
