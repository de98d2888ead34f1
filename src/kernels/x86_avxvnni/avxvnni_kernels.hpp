// Kernel sets "avxvnni" and "avxvnniemu": the avx2 set's quantizer, activation and layout
// (qu4_p8k8), with a GEMM on ymm `vpdpbusd` (VEX encoding).
//
// "avxvnni" runs the instruction; "avxvnniemu" is the same GEMM compiled with AVX2 only, on an
// exact model of the instruction (x86_ymm/vpdpbusd_ymm.hpp), so that the avxvnni tiles (up to
// 12 rows, split accumulators, f32 sums in L1) are tested on every AVX2 machine. The model is
// chosen only when the ISA cap names it (W4A8MOE_ISA=avxvnniemu).
#pragma once

#include "kernels/kernel.hpp"

namespace w4a8moe::detail {

namespace avxvnni {
// 12 rows: the best measured (hot micro-kernel 74-80% of the 1-thread peak; 10 rows 72%, 16 rows
// 66%; the whole layer at 512 tokens 4% faster than with 10), although 12 int32 sums, two
// unpacked weights, the nibble mask and two broadcasts are one more than the 16 ymm registers.
inline constexpr int kTileM = 12;
void gemm_qa8_qu4p8k8(const GemmArgs& args);
}  // namespace avxvnni

namespace avxvnniemu {
void gemm_qa8_qu4p8k8(const GemmArgs& args);
}  // namespace avxvnniemu

}  // namespace w4a8moe::detail
