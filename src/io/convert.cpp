// Row converters of the checkpoint loaders (convert.hpp).
#include "io/convert.hpp"

#include <algorithm>
#include <cmath>

#include "common/format.hpp"
#include "common/numeric.hpp"

namespace w4a8moe::io {

using detail::cat;

ProjectionShape projection_shape(const LayerInfo& info, int which) {
  ProjectionShape p;
  p.rows = which == 2 ? info.hidden : info.inter;
  p.cols = which == 2 ? info.inter : info.hidden;
  p.groups = info.group_size == -1 ? 1 : p.cols / info.group_size;
  return p;
}

void pack_nibbles(const int8_t* values, int64_t n, uint8_t* dst) {
  for (int64_t j = 0; j < n / 2; ++j)
    dst[j] = static_cast<uint8_t>((values[2 * j] + 8) | ((values[2 * j + 1] + 8) << 4));
}

void store_scale(uint8_t* dst, DType dtype, int64_t i, float value) {
  detail::store_float(dst, dtype, i, value);
}

void convert_row(const float* row, int64_t n, int group_size, QuantRule rule, uint8_t* nibbles,
                 float* scales, Conversion& stats, const std::string& what) {
  QuantizedWeights q;
  try {
    q = quantize_weights(TensorView::of(row, DType::f32, {1, 1, n}), group_size, rule);
  } catch (const Error& e) {
    throw Error(cat(what, ": ", e.what()));
  }
  pack_nibbles(q.values.data(), n, nibbles);
  const int64_t g = group_size == -1 ? n : group_size;
  std::copy(q.scales.begin(), q.scales.end(), scales);
  for (int64_t k = 0; k < n; ++k) {
    const double ref = static_cast<double>(row[k]);
    const double got = static_cast<double>(q.values[static_cast<size_t>(k)]) *
                       static_cast<double>(q.scales[static_cast<size_t>(k / g)]);
    const double err = got - ref;
    stats.err_sq += err * err;
    stats.ref_sq += ref * ref;
    stats.max_abs_err = std::max(stats.max_abs_err, std::fabs(err));
  }
  stats.elements += n;
}

void gather_columns(const uint8_t* matrix, DType dtype, int64_t in, int64_t out, int64_t first,
                    int64_t step, int64_t count, float* dst) {
  for (int64_t k = 0; k < in; ++k) {
    const int64_t at = k * out + first;
    for (int64_t r = 0; r < count; ++r)
      dst[r * in + k] = detail::load_float(matrix, dtype, at + r * step);
  }
}

void decode_mxfp4_row(const uint8_t* blocks, const uint8_t* scales, int64_t n, float* dst) {
  static constexpr float kE2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int64_t g = 0; g < n / 32; ++g) {
    const float s = std::ldexp(1.0f, static_cast<int>(scales[g]) - 127);
    for (int64_t b = 0; b < 16; ++b) {
      const uint8_t v = blocks[g * 16 + b];
      dst[g * 32 + 2 * b] = kE2m1[v & 15] * s;
      dst[g * 32 + 2 * b + 1] = kE2m1[v >> 4] * s;
    }
  }
}

}  // namespace w4a8moe::io
