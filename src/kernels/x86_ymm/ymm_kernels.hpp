// Kernel sets "avxvnni" and "avx2": s8 activations times offset int4 weights on layout qu4_p8k8
// (panels of 8 rows), ymm registers. Both are built from ymm_kernels.inc.
#pragma once

#include "kernels/kernel.hpp"

namespace w4a8moe::detail {

namespace avxvnni {
// 12 rows: the best measured (hot micro-kernel 74-80% of the 1-thread peak; 10 rows 72%, 16 rows
// 66%; the whole layer at 512 tokens 4% faster than with 10), although 12 int32 sums, two
// unpacked weights, the nibble mask and two broadcasts are one more than the 16 ymm registers.
inline constexpr int kTileM = 12;
void quantize_qa8(const QuantizeArgs& args);
void gemm_qa8_qu4p8(const GemmArgs& args);
void activate(const MoeParams& params, const float* gate, const float* up, float* m, int64_t n);
}  // namespace avxvnni

namespace avx2 {
inline constexpr int kTileM = 5;  // 5 rows: 80% of its peak hot (8 rows: 74%, more spills)
void quantize_qa8(const QuantizeArgs& args);
void gemm_qa8_qu4p8(const GemmArgs& args);
void activate(const MoeParams& params, const float* gate, const float* up, float* m, int64_t n);
}  // namespace avx2

}  // namespace w4a8moe::detail
