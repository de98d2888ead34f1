// Float weights -> symmetric int4 values and scales, per output row (channelwise) or per group;
// float weights -> int8 values and one scale per output row, for pack_linear's int8 format.
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

#include "api/validate.hpp"
#include "common/format.hpp"
#include "common/numeric.hpp"
#include "thread_pool.hpp"

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

namespace {

constexpr int64_t kQuantizeRows = 64;  // rows per task of quantize_linear_int8

// x rounded to the nearest integer, ties to even, for |x| < 2^22: adding and subtracting
// 1.5 * 2^23 leaves no fraction bits in f32 (the default rounding mode rounds the sum to even).
// Vectorizes at the baseline ISA, where std::nearbyint is a library call.
inline float round_even(float x) noexcept {
  constexpr float kMagic = 0x1.8p23f;
  return (x + kMagic) - kMagic;
}

// Row n of w into f32 (`buf` for bf16 / f16; f32 rows are read in place).
const float* row_f32(const TensorView& w, int64_t n, int64_t K, float* buf) {
  if (w.dtype == DType::f32) return static_cast<const float*>(w.data) + n * K;
  for (int64_t k = 0; k < K; ++k) buf[k] = detail::load_float(w.data, w.dtype, n * K + k);
  return buf;
}

// Quantizes row n; false when it holds NaN or Inf (nothing written).
bool quantize_row_int8(const float* v, int64_t K, int8_t* q, float* scale) {
  // max |v| over the bits: |v| orders as its bit pattern does, and NaN and Inf are the patterns
  // from 0x7f800000 up. An integer maximum vectorizes; a float one would not without fast-math.
  int32_t amax_bits = 0;
  for (int64_t k = 0; k < K; ++k)
    amax_bits = std::max(amax_bits, std::bit_cast<int32_t>(v[k]) & 0x7fffffff);
  if (amax_bits >= 0x7f800000) return false;
  const float s = std::bit_cast<float>(amax_bits) / 127.0f;
  *scale = s;
  if (s == 0.0f) {  // zeros (or values below 127 times the smallest f32)
    std::memset(q, 0, static_cast<size_t>(K));
    return true;
  }
  for (int64_t k = 0; k < K; ++k)
    q[k] = static_cast<int8_t>(std::clamp(round_even(v[k] / s), -127.0f, 127.0f));
  return true;
}

}  // namespace

void quantize_linear_int8(const TensorView& w, const MutableTensorView& values,
                          const MutableTensorView& scales) {
  using detail::cat;
  using detail::shape_string;
  detail::require_data(w.data, "w");
  detail::require_float(w.dtype, "w");
  if (w.rank != 2 || w.shape[0] < 1 || w.shape[1] < 1)
    throw Error(cat("w: expected shape [N, K] with positive sizes, got ", detail::shape_of(w)));
  if (w.row_stride != 0 && w.row_stride != w.shape[1])
    throw Error(cat("w: expected contiguous rows (row stride ", w.shape[1], "), got row stride ",
                    w.row_stride));
  detail::require_addressable(w, "w");
  const int64_t N = w.shape[0], K = w.shape[1];
  if (values.dtype != DType::i8 || values.rank != 2 || values.shape[0] != N ||
      values.shape[1] != K || values.stride() != K)
    throw Error(cat("values: expected contiguous i8 [", N, ", ", K, "], got ",
                    dtype_name(values.dtype), " ", shape_string(values.rank, values.shape),
                    values.rank == 2 && values.stride() != values.shape[1]
                        ? cat(" with row stride ", values.stride())
                        : std::string()));
  if (scales.dtype != DType::f32 || scales.rank != 1 || scales.shape[0] != N)
    throw Error(cat("scales: expected f32 [", N, "], got ", dtype_name(scales.dtype), " ",
                    shape_string(scales.rank, scales.shape)));
  detail::require_data(values.data, "values");
  detail::require_data(scales.data, "scales");
  detail::require_addressable(values.data, values.dtype, values.rank, values.shape, K, "values");

  auto* q = static_cast<int8_t*>(values.data);
  auto* s = static_cast<float*>(scales.data);
  std::atomic<int64_t> first_bad{N};  // the smallest row holding NaN or Inf
  const int64_t tasks = (N + kQuantizeRows - 1) / kQuantizeRows;
  detail::parallel_for(tasks, std::thread::hardware_concurrency(), [&](int64_t task) {
    std::vector<float> buf(w.dtype == DType::f32 ? 0 : static_cast<size_t>(K));
    for (int64_t n = task * kQuantizeRows; n < std::min(N, (task + 1) * kQuantizeRows); ++n) {
      if (quantize_row_int8(row_f32(w, n, K, buf.data()), K, q + n * K, s + n)) continue;
      int64_t seen = first_bad.load();
      while (n < seen && !first_bad.compare_exchange_weak(seen, n)) {
      }
    }
  });
  const int64_t bad = first_bad.load();
  if (bad < N) {
    for (int64_t k = 0; k < K; ++k) {
      const float v = detail::load_float(w.data, w.dtype, bad * K + k);
      if (!std::isfinite(v))
        throw Error(cat("w: expected finite weights, got ", v, " in row ", bad, " (at [", bad, ", ",
                        k, "])"));
    }
  }
}

LinearInt8Weights quantize_linear_int8(const TensorView& w) {
  using detail::cat;
  detail::require_data(w.data, "w");
  if (w.rank != 2 || w.shape[0] < 1 || w.shape[1] < 1)
    throw Error(cat("w: expected shape [N, K] with positive sizes, got ", detail::shape_of(w)));
  detail::require_addressable(w, "w");  // N * K cannot overflow below
  LinearInt8Weights out;
  out.rows = w.shape[0];
  out.cols = w.shape[1];
  try {
    out.values.resize(static_cast<size_t>(out.rows * out.cols));
    out.scales.resize(static_cast<size_t>(out.rows));
  } catch (const std::bad_alloc&) {
    throw Error(cat("w: the output of shape [", out.rows, ", ", out.cols,
                    "] (int8 values and their scales) cannot be allocated"));
  }
  quantize_linear_int8(w, MutableTensorView::of(out.values.data(), DType::i8, {out.rows, out.cols}),
                       MutableTensorView::of(out.scales.data(), DType::f32, {out.rows}));
  return out;
}

}  // namespace w4a8moe
