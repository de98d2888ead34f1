// Kernel sets "avxvnni" and "avx2": s8 activations times offset int4 weights on layout qu4_p8k8
// (panels of 8 rows), ymm registers. Both are built from ymm_kernels.inc.
#pragma once

#include "kernels/kernel.hpp"

namespace w4a8moe::detail {

namespace avxvnni {
inline constexpr int kTileM = 10;  // 10 vpdpbusd chains (enough in flight for peak), 15 ymm
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
