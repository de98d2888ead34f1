// AVX-512 activation quantizer: f32 row -> s8 q, recip, zero point, and per scale group
// -8 * SUM q (the term that turns the dot product with offset weights w + 8 into SUM w * q).

#include <immintrin.h>

#include "cpu/compiled_isa.hpp"
#include "kernels/quant_params.hpp"
#include "kernels/x86_avx512vnni/avx512vnni_kernels.hpp"

static_assert(
    w4a8moe::detail::compiled_for("avx512vnni"),
    "compile this file with the avx512vnni cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail::avx512vnni {

namespace {

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
}

}  // namespace

void quantize_qa8(const QuantizeArgs& args) {
  const float* a = args.src;
  const int64_t cols = args.cols;
  __m512 vmin = _mm512_setzero_ps(), vmax = _mm512_setzero_ps();
  __mmask16 finite = 0xffff;
  for (int64_t k = 0; k < cols; k += 16) {
    const __mmask16 m = tail_mask(cols - k);
    const __m512 v = _mm512_maskz_loadu_ps(m, a + k);
    // finite iff v - v == 0 (NaN and Inf give NaN); masked-off lanes are 0
    finite &= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_EQ_OQ);
    vmin = _mm512_min_ps(vmin, v);
    vmax = _mm512_max_ps(vmax, v);
  }
  alignas(64) float lo[16], hi[16];
  _mm512_store_ps(lo, vmin);
  _mm512_store_ps(hi, vmax);
  const RowQuantParams p = row_quant_params(min_of(lo), max_of(hi), finite == 0xffff);
  auto* q = static_cast<int8_t*>(args.dst);
  const int64_t groups = args.cols_padded / args.group_len;
  auto* terms = reinterpret_cast<int32_t*>(q + args.cols_padded);
  const __m512 scale = _mm512_set1_ps(p.scale);
  const __m512i zp = _mm512_set1_epi32(p.zp);
  const __m512 half = _mm512_set1_ps(0.49999997f);
  const __m512i sign = _mm512_set1_epi32(INT32_MIN);
  for (int64_t b = 0; b < groups; ++b) {
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = b * args.group_len; k < (b + 1) * args.group_len; k += 16) {
      // columns past `cols` (padding) quantize to the zero point: value 0
      const __mmask16 m = k < cols ? tail_mask(cols - k) : __mmask16(0);
      __m512i qi = zp;
      if (p.finite && m != 0) {
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, a + k), scale);
        // round half away from zero: trunc(v + copysign(0.49999997, v)), exact for |v| < 320
        const __m512 bias = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_castps_si512(half), _mm512_and_si512(_mm512_castps_si512(v), sign)));
        qi = _mm512_add_epi32(_mm512_cvttps_epi32(_mm512_add_ps(v, bias)), zp);
        qi =
            _mm512_max_epi32(_mm512_min_epi32(qi, _mm512_set1_epi32(127)), _mm512_set1_epi32(-128));
        qi = _mm512_mask_mov_epi32(zp, m, qi);
      }
      sum = _mm512_add_epi32(sum, qi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(qi));
    }
    alignas(64) int32_t lanes[16];
    _mm512_store_si512(lanes, sum);
    terms[b] = -args.group_term_offset * sum_of(lanes);
  }
  publish_row(args, q, p, terms);
}

}  // namespace w4a8moe::detail::avx512vnni
