// The AArch64 kernel sets, best first:
//   neoni8mm  `smmla` 2x8x2 tiles on layout qu4_p8k16 (row pairs of 8-row panels, 16 columns per
//             chunk), up to 8 activation rows per call; one row by `sdot` on the same layout
//   neondot   `sdot` (by element) on layout qu4_p8k8, up to 4 rows: decode
//   neon      baseline NEON widening multiplies (`smlal`) on layout qu4_p8k8
// All three read offset nibbles (w + 8, 0..15, which fit s8) and s8 activations, and share one
// quantizer (baseline NEON) that writes the group terms -8 * SUM q, so a group's dot product
// started from its term is SUM w * q. Each set is compiled in its own folder with its own flags.
#pragma once

#include "kernels/kernel.hpp"

namespace w4a8moe::detail {

namespace neon {
inline constexpr int64_t kTileM = 4;
// The quantizer of all three Arm sets (s8 q, zero-point tail, group terms).
void quantize_qa8(const QuantizeArgs& args);
void gemm_qa8_qu4p8(const GemmArgs& args);
void activate(const MoeParams& params, const float* gate, const float* up, float* m, int64_t n);
}  // namespace neon

namespace neondot {
inline constexpr int64_t kTileM = 4;
void gemm_qa8_qu4p8(const GemmArgs& args);
void activate(const MoeParams& params, const float* gate, const float* up, float* m, int64_t n);
}  // namespace neondot

namespace neoni8mm {
inline constexpr int64_t kTileM = 8;
void gemm_qa8_qu4p8k16(const GemmArgs& args);
void activate(const MoeParams& params, const float* gate, const float* up, float* m, int64_t n);
}  // namespace neoni8mm

}  // namespace w4a8moe::detail
