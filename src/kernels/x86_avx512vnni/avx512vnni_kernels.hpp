// Kernel set "avx512vnni": int8 activations (s8) times offset int4 weights (w + 8, u8) with zmm
// `vpdpbusd`, on layout qu4_p16k8 (panels of 16 rows, one output row per int32 lane), and int8
// weights as bytes (w + 128, u8) on layout qu8_p16k4.
#pragma once

#include "kernels/kernel.hpp"

namespace w4a8moe::detail::avx512vnni {

inline constexpr int64_t kTileM = 16;

void quantize_qa8(const QuantizeArgs& args);
void gemm_qa8_qu4p16k8(const GemmArgs& args);
// Its two MXFP4 paths, which gemm_qa8_qu4p16k8 chooses between by the CPU (the tests compare
// them): `vpshufb` after a mask, and `vpermb` (CPUs with AVX-512 VBMI only).
void gemm_mxfp4_shuffle(const GemmArgs& args);
void gemm_mxfp4_vbmi(const GemmArgs& args);
void activate(const MoeParams& params, const float* gate, const float* up, float* m, int64_t n);

}  // namespace w4a8moe::detail::avx512vnni
