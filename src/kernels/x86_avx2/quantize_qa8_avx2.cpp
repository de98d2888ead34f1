// AVX2 activation quantizer (sets avx2 and avxvnni): f32 row -> s8 q, recip, zero point, and
// per scale group -8 * SUM q (the term that turns the dot product with offset weights w + 8
// into SUM w * q).
#include <immintrin.h>

#include "cpu/compiled_isa.hpp"
#include "kernels/quant_params.hpp"
#include "kernels/x86_avx2/avx2_kernels.hpp"

static_assert(w4a8moe::detail::compiled_for("avx2"),
              "compile this file with the avx2 cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail::avx2 {

namespace {

inline __m256i tail_mask(int64_t left) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(left < 8 ? left : 8)), idx);
}

}  // namespace

void quantize_qa8(const QuantizeArgs& args) {
  const float* a = args.src;
  const int64_t cols = args.cols;
  __m256 vmin = _mm256_setzero_ps(), vmax = _mm256_setzero_ps();
  int finite = 1;
  for (int64_t k = 0; k < cols; k += 8) {
    const __m256 v = _mm256_maskload_ps(a + k, tail_mask(cols - k));  // masked lanes read as 0
    const __m256 d = _mm256_sub_ps(v, v);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_EQ_OQ)) == 0xff;
    vmin = _mm256_min_ps(vmin, v);
    vmax = _mm256_max_ps(vmax, v);
  }
  alignas(32) float lo[8], hi[8];
  _mm256_store_ps(lo, vmin);
  _mm256_store_ps(hi, vmax);
  const RowQuantParams p = row_quant_params(min_of(lo), max_of(hi), finite != 0);
  auto* q = static_cast<int8_t*>(args.dst);
  const int64_t groups = args.cols_padded / args.group_len;
  auto* terms = reinterpret_cast<int32_t*>(q + args.cols_padded);
  const __m256 scale = _mm256_set1_ps(p.scale);
  const __m256i zp = _mm256_set1_epi32(p.zp);
  const __m256 half = _mm256_set1_ps(0.49999997f);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
  const __m256i pick = _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
  for (int64_t b = 0; b < groups; ++b) {
    __m256i sum = _mm256_setzero_si256();
    for (int64_t k = b * args.group_len; k < (b + 1) * args.group_len; k += 8) {
      __m256i qi = zp;
      if (p.finite && k < cols) {
        const __m256i m = tail_mask(cols - k);
        const __m256 v = _mm256_mul_ps(_mm256_maskload_ps(a + k, m), scale);
        const __m256 bias = _mm256_or_ps(half, _mm256_and_ps(v, sign));
        qi = _mm256_add_epi32(_mm256_cvttps_epi32(_mm256_add_ps(v, bias)), zp);
        qi =
            _mm256_max_epi32(_mm256_min_epi32(qi, _mm256_set1_epi32(127)), _mm256_set1_epi32(-128));
        qi = _mm256_blendv_epi8(zp, qi, m);
      }
      sum = _mm256_add_epi32(sum, qi);
      const __m256i w16 = _mm256_packs_epi32(qi, qi);  // 8 values fit int8: packs do not clip
      const __m256i w8 = _mm256_packs_epi16(w16, w16);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k),
                       _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(w8, pick)));
    }
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sum);
    terms[b] = -args.group_term_offset * sum_of(lanes);
  }
  publish_row(args, q, p, terms);
}

}  // namespace w4a8moe::detail::avx2
