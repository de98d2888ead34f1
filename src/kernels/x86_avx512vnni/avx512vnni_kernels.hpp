// Kernel set "avx512vnni": int8 activations (s8) times offset int4 weights (w + 8, u8) with zmm
// `vpdpbusd`, on layout qu4_p16k8 (panels of 16 rows, one output row per int32 lane).
#pragma once

#include "kernels/kernel.hpp"

namespace w4a8moe::detail::avx512vnni {

inline constexpr int64_t kTileM = 16;

void quantize_qa8(const QuantizeArgs& args);
void gemm_qa8_qu4p16k8(const GemmArgs& args);
void activate(const MoeParams& params, const float* gate, const float* up, float* m, int64_t n);

}  // namespace w4a8moe::detail::avx512vnni
