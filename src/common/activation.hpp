// The gated activations (docs/operator.md, "Activations"): in f32 as the kernel sets compute
// them, and in double for the references over the logical weights.
#pragma once

#include <algorithm>
#include <cmath>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

// The f32 functions of the portable kernel set: libm's.
struct LibmMath {
  static float sigmoid(float z) noexcept { return 1.0f / (1.0f + std::exp(-z)); }
  static float erf(float x) noexcept { return std::erf(x); }
  static float tanh(float x) noexcept { return std::tanh(x); }
  static float clamp(float v, float lo, float hi) noexcept {
    return v < lo ? lo : (v > hi ? hi : v);
  }
};

// m[i] = act(gate[i], up[i]) for i < n in f32, the formulas written once over Math's sigmoid,
// erf, tanh and clamp: LibmMath for the portable set, the vectorisable forms of
// kernels/common/activation_vec.hpp for the ISA sets (an instantiation there has internal
// linkage, as its Math type has).
template <class Math>
inline void activate_f32(const MoeParams& p, const float* gate, const float* up, float* m,
                         int64_t n) noexcept {
  const float L = p.limit, alpha = p.alpha;
  switch (p.activation) {
    case Activation::swiglustep:
      for (int64_t i = 0; i < n; ++i) {
        const float s = gate[i] * Math::sigmoid(gate[i]);
        m[i] = (s > L ? L : s) * Math::clamp(up[i], -L, L);
      }
      break;
    case Activation::swigluoai:
      for (int64_t i = 0; i < n; ++i) {
        const float gc = gate[i] > L ? L : gate[i];  // NaN propagates
        m[i] = (Math::clamp(up[i], -L, L) + 1.0f) * gc * Math::sigmoid(alpha * gc);
      }
      break;
    case Activation::silu:
      for (int64_t i = 0; i < n; ++i) m[i] = gate[i] * Math::sigmoid(gate[i]) * up[i];
      break;
    case Activation::gelu:
      for (int64_t i = 0; i < n; ++i)
        m[i] = 0.5f * gate[i] * (1.0f + Math::erf(gate[i] * 0.70710678118654752f)) * up[i];
      break;
    case Activation::gelu_tanh:
      for (int64_t i = 0; i < n; ++i) {
        const float g = gate[i];
        m[i] = 0.5f * g * (1.0f + Math::tanh(0.79788456080286536f * (g + 0.044715f * g * g * g))) *
               up[i];
      }
      break;
  }
}

// act(g, u) in double: the form of the references over the logical weights (reference_forward()
// and the checkpoint loaders' float reference). The tests' own reference is separate on purpose.
inline double activation_f64(const MoeParams& p, double g, double u) noexcept {
  const double L = static_cast<double>(p.limit);
  auto sigmoid_f64 = [](double z) { return 1.0 / (1.0 + std::exp(-z)); };
  switch (p.activation) {
    case Activation::swiglustep:
      return std::min(g * sigmoid_f64(g), L) * std::clamp(u, -L, L);
    case Activation::swigluoai: {
      const double gc = std::min(g, L), uc = std::clamp(u, -L, L);
      return (uc + 1.0) * gc * sigmoid_f64(static_cast<double>(p.alpha) * gc);
    }
    case Activation::silu:
      return g * sigmoid_f64(g) * u;
    case Activation::gelu:
      return 0.5 * g * (1.0 + std::erf(g / std::sqrt(2.0))) * u;
    case Activation::gelu_tanh: {
      const double c = std::sqrt(2.0 / 3.14159265358979323846);
      return 0.5 * g * (1.0 + std::tanh(c * (g + 0.044715 * g * g * g))) * u;
    }
  }
  return 0.0;
}

}  // namespace w4a8moe::detail
