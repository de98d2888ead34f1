// Reading a Hugging Face layer's experts (hf_layer.hpp): per-expert int4 (pack-quantized,
// int-quantized) copied exactly, float ones quantized on load, fused ones a strip of rows at a
// time; and releasing their file pages.
#include <algorithm>
#include <cstring>

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

void HfLayer::load_rows(int which, int64_t e, uint8_t* nibbles, uint8_t* scales,
                        DType scale_dtype) const {
  const ProjectionShape p = projection_shape(info_, which);
  const int64_t rows = p.rows, cols = p.cols, groups = p.groups;
  const int g = info_.group_size;
  const auto require = [&](const std::string& name, DType dtype,
                           const std::vector<int64_t>& shape) -> std::span<const uint8_t> {
    if (!has(name)) fail(cat("tensor '", name, "' is missing"));
    const TensorEntry& t = entry(name);
    if (t.dtype != dtype || t.shape != shape)
      fail(cat("tensor '", name, "' must be ", safetensors_dtype_name(dtype), " ",
               shape_string(shape), ", got ", safetensors_dtype_name(t.dtype), " ",
               shape_string(t.shape)));
    return bytes(name);
  };

  if (scheme_ == HfScheme::dense) {
    load_dense_rows(which, e, nibbles, scales, scale_dtype);
    return;
  }

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
  if (has(tensor_name(e, which, "weight_zero_point")))
    fail(cat("tensor '", tensor_name(e, which, "weight_zero_point"),
             "' exists: asymmetric weights (a zero point) are not supported"));
  if (has(tensor_name(e, which, "weight_g_idx")))
    fail(cat("tensor '", tensor_name(e, which, "weight_g_idx"),
             "' exists: activation reordering (act-order) is not supported"));
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
  load_rows(0, e, slot.w13, slot.w13_scale, info_.w13_scale_dtype);
  load_rows(1, e, up, up_scales, info_.w13_scale_dtype);
  load_rows(2, e, slot.w2, slot.w2_scale, info_.w2_scale_dtype);
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
    for (const char* suffix : {"weight_packed", "weight", "weight_scale"}) {
      const std::string name = tensor_name(e, which, suffix);
      if (has(name)) tensors_.release(name);
    }
}

}  // namespace w4a8moe::io
