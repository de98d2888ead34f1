// Kernel set "neon": baseline NEON widening multiplies (`smlal`) on layout qu4_p8k8. Its
// quantizer and activation serve all three AArch64 sets (neon, neondot, neoni8mm): they read
// offset nibbles (w + 8, 0..15, which fit s8) and s8 activations, and the quantizer writes the
// group terms -8 * SUM q, so a group's dot product started from its term is SUM w * q.
#pragma once

#include "kernels/kernel.hpp"

namespace w4a8moe::detail::neon {

inline constexpr int64_t kTileM = 4;
// The quantizer of all three Arm sets (s8 q, zero-point tail, group terms).
void quantize_qa8(const QuantizeArgs& args);
void gemm_qa8_qu4p8k8(const GemmArgs& args);
// The activation of all three Arm sets.
void activate(const MoeParams& params, const float* gate, const float* up, float* m, int64_t n);

}  // namespace w4a8moe::detail::neon
