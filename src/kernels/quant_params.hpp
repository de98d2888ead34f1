// The per-row parameters of dynamic int8 activation quantization (the "qai8dx" scheme):
// asymmetric, whole row, zero point nudged to an integer. Every quantizer kernel computes its
// scale and zero point with this function so that all kernel sets agree bit for bit.
// Internal linkage (anonymous namespace): included by translation units built for different ISAs.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels/kernel.hpp"

namespace w4a8moe::detail {
namespace {

struct RowQuantParams {
  float scale;  // 255 / (max - min)
  float recip;  // 1 / scale
  int32_t zp;   // in [-128, 127]
  bool finite;  // false: the row holds NaN or Inf; quantize to zp and poison recip with NaN
};

inline float round_half_even(float v) noexcept {
  const float f = std::floor(v);
  const float d = v - f;
  if (d > 0.5f) return f + 1.0f;
  if (d < 0.5f) return f;
  return std::fmod(f, 2.0f) == 0.0f ? f : f + 1.0f;
}

// mn = min(0, min a), mx = max(0, max a) over finite rows.
inline RowQuantParams row_quant_params(float mn, float mx, bool finite) noexcept {
  RowQuantParams p{};
  if (!finite) {
    p.scale = 1.0f;
    p.recip = NAN;
    p.zp = 0;
    p.finite = false;
    return p;
  }
  const float qmin = -128.0f, qmax = 127.0f;
  p.scale = (mx == mn) ? 1.0f : (qmax - qmin) / (mx - mn);
  // A range below 255 / FLT_MAX (about 7e-37) would give an infinite scale: such a row is
  // quantized with scale 1, i.e. to zero, instead of producing NaN.
  if (!(p.scale <= 3.4028234e38f)) p.scale = 1.0f;
  p.recip = 1.0f / p.scale;
  const float dmin = mn * p.scale, dmax = mx * p.scale;
  float zf = (qmin + dmin) + (qmax + dmax) > 0.0f ? qmin - dmin : qmax - dmax;
  zf = zf < qmin ? qmin : (zf > qmax ? qmax : zf);
  p.zp = static_cast<int32_t>(round_half_even(zf));
  p.finite = true;
  return p;
}

// q = clamp(round_half_away(a * scale) + zp, -128, 127); a is finite and |a * scale| <= 255.
inline int32_t quantize_value(float a, float scale, int32_t zp) noexcept {
  float v = std::round(a * scale) + static_cast<float>(zp);
  v = v < -128.0f ? -128.0f : (v > 127.0f ? 127.0f : v);
  return static_cast<int32_t>(v);
}

// The lanes of a vector register stored to memory, reduced in lane order (once per row or
// scale group, so through memory: GCC 12's _mm512_reduce_min_ps trips -Wmaybe-uninitialized
// inside its own header).
template <size_t N>
inline float min_of(const float (&t)[N]) {
  float r = t[0];
  for (size_t i = 1; i < N; ++i) r = t[i] < r ? t[i] : r;
  return r;
}

template <size_t N>
inline float max_of(const float (&t)[N]) {
  float r = t[0];
  for (size_t i = 1; i < N; ++i) r = t[i] > r ? t[i] : r;
  return r;
}

template <size_t N>
inline int32_t sum_of(const int32_t (&t)[N]) {
  int32_t r = 0;
  for (size_t i = 0; i < N; ++i) r += t[i];
  return r;
}

// What a quantizer reports of its row (terms: the group terms after the row, or null).
inline void publish_row(const QuantizeArgs& args, const int8_t* q, const RowQuantParams& p,
                        const int32_t* terms) {
  args.row->data = q;
  args.row->recip = p.recip;
  args.row->zp = p.zp;
  args.row->group_terms = terms;
}

}  // namespace
}  // namespace w4a8moe::detail
