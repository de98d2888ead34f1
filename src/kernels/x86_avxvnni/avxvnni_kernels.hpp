// Kernel set "avxvnni": the avx2 set's quantizer, activation and layout (qu4_p8k8), with a GEMM
// on ymm `vpdpbusd` (VEX encoding).
#pragma once

#include "kernels/kernel.hpp"

namespace w4a8moe::detail::avxvnni {

// 12 rows: the best measured (hot micro-kernel 74-80% of the 1-thread peak; 10 rows 72%, 16 rows
// 66%; the whole layer at 512 tokens 4% faster than with 10), although 12 int32 sums, two
// unpacked weights, the nibble mask and two broadcasts are one more than the 16 ymm registers.
inline constexpr int kTileM = 12;
void gemm_qa8_qu4p8k8(const GemmArgs& args);

}  // namespace w4a8moe::detail::avxvnni
