// The gated activations (docs/operator.md, "Activations") in f32, as the forward pass computes
// them.
#pragma once

#include <cmath>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

inline float sigmoid(float z) noexcept { return 1.0f / (1.0f + std::exp(-z)); }

inline float clampf(float v, float lo, float hi) noexcept {
  return v < lo ? lo : (v > hi ? hi : v);
}

// m[i] = act(gate[i], up[i]) for i < n.
inline void apply_activation(const MoeParams& p, const float* gate, const float* up, float* m,
                             int64_t n) noexcept {
  const float L = p.limit;
  switch (p.activation) {
    case Activation::swiglustep:
      for (int64_t i = 0; i < n; ++i) {
        const float s = gate[i] * sigmoid(gate[i]);
        m[i] = (s > L ? L : s) * clampf(up[i], -L, L);
      }
      break;
    case Activation::swigluoai:
      for (int64_t i = 0; i < n; ++i) {
        const float gc = gate[i] > L ? L : gate[i];  // NaN propagates
        const float uc = clampf(up[i], -L, L);
        m[i] = (uc + 1.0f) * gc * sigmoid(p.alpha * gc);
      }
      break;
    case Activation::silu:
      for (int64_t i = 0; i < n; ++i) m[i] = gate[i] * sigmoid(gate[i]) * up[i];
      break;
    case Activation::gelu:
      for (int64_t i = 0; i < n; ++i)
        m[i] = 0.5f * gate[i] * (1.0f + std::erf(gate[i] * 0.70710678118654752f)) * up[i];
      break;
    case Activation::gelu_tanh:
      for (int64_t i = 0; i < n; ++i) {
        const float g = gate[i];
        const float inner = 0.79788456080286536f * (g + 0.044715f * g * g * g);
        m[i] = 0.5f * g * (1.0f + std::tanh(inner)) * up[i];
      }
      break;
  }
}

}  // namespace w4a8moe::detail
