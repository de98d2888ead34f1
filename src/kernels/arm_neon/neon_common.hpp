// Helpers of the Arm GEMM kernels: scale loading and the float epilogue of SPEC section 6.
// Internal linkage (anonymous namespace): each Arm translation unit gets its own copy compiled
// with its own flags. The including file includes <arm_neon.h> first.
//
// Every kernel computes each output element with the same float operations, whatever its tile:
//   groupwise:   facc = fma(float(group sum), s, facc) per group in order, then
//                out = fma(recip, facc - zp * zsum (fused), bias)
//   channelwise: out = fma(recip * s, float(sum - zp * wsum), bias)  (integer sum exact)
// so a row's result does not depend on which rows or columns share its call.
#pragma once

#include <cstdint>

#include "kernels/kernel.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {
namespace {

// Four consecutive scales from element `index` on, in the stored dtype.
inline float32x4_t load_scales4(const uint8_t* base, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::bf16:
      return vreinterpretq_f32_u32(
          vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(base) + index), 16));
    case DType::f16:
      return vcvt_f32_f16(vld1_f16(reinterpret_cast<const float16_t*>(base) + index));
    default:
      return vld1q_f32(reinterpret_cast<const float*>(base) + index);
  }
}

// zp and recip are per lane (a row's values broadcast, or two rows' values for 2x2 blocks).
inline float32x4_t finish_groupwise(float32x4_t facc, float32x4_t zp, float32x4_t recip,
                                    float32x4_t zsum, float32x4_t bias) {
  return vfmaq_f32(bias, recip, vfmsq_f32(facc, zp, zsum));
}

inline float32x4_t finish_channelwise(int32x4_t sum, int32x4_t zp, float32x4_t recip,
                                      int32x4_t wsum, float32x4_t s, float32x4_t bias) {
  return vfmaq_f32(bias, vmulq_f32(recip, s), vcvtq_f32_s32(vmlsq_s32(sum, wsum, zp)));
}

inline float32x4_t load_bias4(const Geometry& g, const uint8_t* expert, int64_t n) {
  return g.has_bias ? vld1q_f32(reinterpret_cast<const float*>(expert + g.bias_offset) + n)
                    : vdupq_n_f32(0.0f);
}

}  // namespace
}  // namespace w4a8moe::detail
