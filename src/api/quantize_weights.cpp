// Float weights -> symmetric int4 values and scales, per output row (channelwise) or per group.
#include <cmath>
#include <new>

#include "api/validate.hpp"
#include "common/format.hpp"
#include "common/numeric.hpp"

namespace w4a8moe {

QuantizedWeights quantize_weights(const TensorView& w, int group_size, QuantRule rule) {
  using detail::cat;
  if (w.data == nullptr) throw Error("w: expected a data pointer, got null");
  if (!detail::is_float_dtype(w.dtype))
    throw Error(cat("w: expected dtype f32, bf16 or f16, got ", dtype_name(w.dtype)));
  if (w.rank != 3 || w.shape[0] < 1 || w.shape[1] < 1 || w.shape[2] < 1)
    throw Error(cat("w: expected shape [E, N, K] with positive sizes, got ",
                    detail::shape_string(w.rank, w.shape)));
  if (w.row_stride != 0 && w.row_stride != w.shape[2])
    throw Error(cat("w: expected a contiguous tensor, got row stride ", w.row_stride));
  detail::require_addressable(w, "w");  // E * N * K cannot overflow below
  const int64_t E = w.shape[0], N = w.shape[1], K = w.shape[2];
  if (group_size != -1 && (group_size <= 0 || K % group_size != 0))
    throw Error(cat("group_size: expected -1 or a positive divisor of ", K, ", got ", group_size));
  if (rule != QuantRule::absmax7 && rule != QuantRule::q4_0)
    throw Error("rule: expected absmax7 or q4_0");
  const int64_t g = group_size == -1 ? K : group_size;
  QuantizedWeights out;
  out.shape = {E, N, K};
  out.group_size = group_size;
  try {
    out.values.resize(static_cast<size_t>(E * N * K));
    out.scales.resize(static_cast<size_t>(E * N * (K / g)));
  } catch (const std::bad_alloc&) {
    throw Error(cat("w: the output of shape [", E, ", ", N, ", ", K, "] (", E * N * K,
                    " int4 values and their scales) cannot be allocated"));
  }
  for (int64_t row = 0; row < E * N; ++row) {
    for (int64_t b = 0; b < K / g; ++b) {
      const int64_t k0 = row * K + b * g;
      float amax = 0.0f, extreme = 0.0f;
      for (int64_t k = k0; k < k0 + g; ++k) {
        const float v = detail::load_float(w.data, w.dtype, k);
        if (!std::isfinite(v))
          throw Error(cat("w: expected finite values, got ", v, " at flat index ", k));
        if (std::fabs(v) > amax) {
          amax = std::fabs(v);
          extreme = v;
        }
      }
      // absmax7: s = max|w| / 7 -> values in [-7, 7]; q4_0: s = extreme / -8, so the extreme
      // maps to -8 exactly and the opposite side reaches at most 7 after rounding and clamping.
      const float s = rule == QuantRule::absmax7 ? amax / 7.0f : extreme / -8.0f;
      const float inv = s != 0.0f ? 1.0f / s : 0.0f;
      out.scales[static_cast<size_t>(row * (K / g) + b)] = s;
      for (int64_t k = k0; k < k0 + g; ++k) {
        const float q = std::round(detail::load_float(w.data, w.dtype, k) * inv);
        out.values[static_cast<size_t>(k)] =
            static_cast<int8_t>(std::fmin(7.0f, std::fmax(-8.0f, q)));
      }
    }
  }
  return out;
}

}  // namespace w4a8moe
