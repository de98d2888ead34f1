// Kernel set "neoni8mm": `smmla` 2x8x2 tiles on layout qu4_p8k16 (row pairs of 8-row panels, 16
// columns per chunk), up to 8 activation rows per call, one row by `sdot` on the same layout;
// with the neon set's quantizer and activation.
#pragma once

#include "kernels/kernel.hpp"

namespace w4a8moe::detail::neoni8mm {

inline constexpr int64_t kTileM = 8;
void gemm_qa8_qu4p8k16(const GemmArgs& args);

}  // namespace w4a8moe::detail::neoni8mm
