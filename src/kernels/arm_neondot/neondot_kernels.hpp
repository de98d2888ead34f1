// Kernel set "neondot": `sdot` (by element) on layout qu4_p8k8, up to 4 rows per call (decode),
// with the neon set's quantizer and activation.
#pragma once

#include "kernels/kernel.hpp"

namespace w4a8moe::detail::neondot {

inline constexpr int64_t kTileM = 4;
void gemm_qa8_qu4p8k8(const GemmArgs& args);

}  // namespace w4a8moe::detail::neondot
