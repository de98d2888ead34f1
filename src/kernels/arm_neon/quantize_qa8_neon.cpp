// The activation quantizer of the Arm kernel sets (neon, neondot, neoni8mm; baseline NEON):
// f32 row -> s8 q, bit for bit the portable quantizer's values. The row parameters come from the
// shared row_quant_params(); `fcvtas` rounds half away from zero like std::round, and the
// saturating narrows clamp to [-128, 127] as the portable code's float clamp does (|a * s| is at
// most about 255, so the int32 sum cannot overflow). Then the group terms -8 * SUM q per group.
#include <arm_neon.h>

#include <cmath>

#include "cpu/compiled_isa.hpp"
#include "kernels/arm_neon/neon_kernels.hpp"
#include "kernels/quant_params.hpp"

static_assert(w4a8moe::detail::compiled_for("neon"),
              "compile this file with the neon cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail::neon {

namespace {

inline int8x16_t quantize16(const float* a, float32x4_t scale, int32x4_t zp) {
  int32x4_t r[4];
  for (int i = 0; i < 4; ++i)
    r[i] = vaddq_s32(vcvtaq_s32_f32(vmulq_f32(vld1q_f32(a + 4 * i), scale)), zp);
  const int16x8_t lo = vqmovn_high_s32(vqmovn_s32(r[0]), r[1]);
  const int16x8_t hi = vqmovn_high_s32(vqmovn_s32(r[2]), r[3]);
  return vqmovn_high_s16(vqmovn_s16(lo), hi);
}

}  // namespace

void quantize_qa8(const QuantizeArgs& args) {
  const float* a = args.src;
  const int64_t cols = args.cols;
  float32x4_t vmin = vdupq_n_f32(0.0f), vmax = vdupq_n_f32(0.0f);
  uint32x4_t finite = vdupq_n_u32(~0u);
  int64_t k = 0;
  for (; k + 4 <= cols; k += 4) {
    const float32x4_t v = vld1q_f32(a + k);
    finite = vandq_u32(finite, vceqq_f32(vsubq_f32(v, v), vdupq_n_f32(0.0f)));  // NaN, Inf: 0
    vmin = vminq_f32(vmin, v);
    vmax = vmaxq_f32(vmax, v);
  }
  float mn = vminvq_f32(vmin), mx = vmaxvq_f32(vmax);
  bool all_finite = vminvq_u32(finite) != 0;
  for (; k < cols; ++k) {
    all_finite &= std::isfinite(a[k]);
    mn = a[k] < mn ? a[k] : mn;
    mx = a[k] > mx ? a[k] : mx;
  }
  const RowQuantParams p = row_quant_params(mn, mx, all_finite);

  auto* q = static_cast<int8_t*>(args.dst);
  const int64_t groups = args.cols_padded / args.group_len;
  auto* terms = reinterpret_cast<int32_t*>(q + args.cols_padded);
  const int64_t vector_end = p.finite ? cols / 16 * 16 : 0;
  const float32x4_t scale = vdupq_n_f32(p.scale);
  const int32x4_t zp = vdupq_n_s32(p.zp);
  for (int64_t b = 0; b < groups; ++b) {
    int32x4_t sum = vdupq_n_s32(0);
    for (k = b * args.group_len; k < (b + 1) * args.group_len; k += 16) {
      int8x16_t v;
      if (k + 16 <= vector_end) {
        v = quantize16(a + k, scale, zp);
      } else {  // the row's tail, the zero-point padding, or a row holding NaN or Inf
        int8_t t[16];
        for (int64_t i = 0; i < 16; ++i)
          t[i] = static_cast<int8_t>(
              p.finite && k + i < cols ? quantize_value(a[k + i], p.scale, p.zp) : p.zp);
        v = vld1q_s8(t);
      }
      vst1q_s8(q + k, v);
      sum = vpadalq_s16(sum, vpaddlq_s8(v));
    }
    terms[b] = -args.group_term_offset * vaddvq_s32(sum);
  }
  publish_row(args, q, p, terms);
}

}  // namespace w4a8moe::detail::neon
