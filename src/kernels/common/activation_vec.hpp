// Vectorisable f32 activations (docs/operator.md, "Activations") for the ISA kernel sets: exp, erf
// and tanh by range reduction and polynomials (about 2 ulp for exp, 1.5e-7 absolute for erf), the
// functions of the loops of activate_f32<VecMath>() (common/activation.hpp), which the compiler
// vectorises with the including file's ISA flags and -fno-trapping-math (CMakeLists.txt,
// W4A8MOE_VECTOR_ACTIVATION: without it GCC vectorises them only with AVX-512).
//
// Everything here has internal linkage (anonymous namespace): each ISA translation unit gets its
// own copy compiled with its own flags, so no copy built for a wider ISA can be picked by the
// linker for a narrower one.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/activation.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {
namespace {

inline float bits_to_float(int32_t i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}

// e^x for finite x; clamped below to 0 and above to FLT_MAX-ish (NaN propagates via the
// arithmetic: NaN compares false in the clamps).
inline float vexp(float x) {
  x = x > 88.3762626647949f ? 88.3762626647949f : x;
  x = x < -87.3365447504f ? -87.3365447504f : x;
  // n = nearest integer to x / ln 2, by the 1.5 * 2^23 trick (|x / ln 2| < 2^22 after the clamps):
  // floorf would keep GCC from vectorising the loop unless -fno-trapping-math.
  constexpr float kRound = 12582912.0f;
  float n = (x * 1.44269504088896341f + kRound) - kRound;
  n = n != n ? 0.0f : n;  // NaN: keep the integer conversion defined; r carries the NaN
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  // e^r on [-ln2/2, ln2/2] (Cephes expf polynomial)
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * bits_to_float((static_cast<int32_t>(n) + 127) << 23);
}

inline float vsigmoid(float z) { return 1.0f / (1.0f + vexp(-z)); }

// erf by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7).
inline float verf(float x) {
  const float ax = x < 0.0f ? -x : x;
  const float t = 1.0f / (1.0f + 0.3275911f * ax);
  float p = 1.061405429f;
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  const float y = 1.0f - p * t * vexp(-ax * ax);
  return x < 0.0f ? -y : y;
}

inline float vtanh(float x) { return 1.0f - 2.0f / (vexp(2.0f * x) + 1.0f); }

// The functions activate_f32<VecMath>() (common/activation.hpp) computes with.
struct VecMath {
  static float sigmoid(float z) { return vsigmoid(z); }
  static float erf(float x) { return verf(x); }
  static float tanh(float x) { return vtanh(x); }
  static float clamp(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }
};

}  // namespace
}  // namespace w4a8moe::detail
