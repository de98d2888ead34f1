// The portable kernel set ("scalar"): plain C++ that the compiler may auto-vectorise. It is the
// fallback on every CPU and the generic twin that the ISA-specific sets are tested against.
#pragma once

#include "kernels/kernel.hpp"

namespace w4a8moe::detail::ref {

inline constexpr int64_t kTileM = 4;

void quantize_qa8(const QuantizeArgs& args);
// Layout qs4_b32_rowmajor, int8 activations, up to kTileM rows per call.
void gemm_qa8_qs4b32rowmajor(const GemmArgs& args);
void activate(const MoeParams& params, const float* gate, const float* up, float* m, int64_t n);

}  // namespace w4a8moe::detail::ref
