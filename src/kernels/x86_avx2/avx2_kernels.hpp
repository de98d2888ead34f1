// Kernel set "avx2": s8 activations times offset int4 weights on layout qu4_p8k8 (panels of 8
// rows) with AVX2's `vpmaddubsw` + `vpmaddwd` in ymm registers. Its quantizer and activation
// also serve the avxvnni set.
#pragma once

#include "kernels/kernel.hpp"

namespace w4a8moe::detail::avx2 {

inline constexpr int kTileM = 5;  // 5 rows: 80% of its peak hot (8 rows: 74%, more spills)
void quantize_qa8(const QuantizeArgs& args);
void gemm_qa8_qu4p8k8(const GemmArgs& args);
void activate(const MoeParams& params, const float* gate, const float* up, float* m, int64_t n);

}  // namespace w4a8moe::detail::avx2
