// ymm `vpdpbusd` (VEX, AVX-VNNI) where the file is compiled for it, else an exact model of it in
// AVX2 instructions (the avxvnniemu set: the avxvnni GEMM tested on CPUs without AVX-VNNI).
#pragma once

#include <immintrin.h>

namespace w4a8moe::detail {
namespace {

// For each int32 lane i: acc + SUM_j a.u8[4i + j] * b.s8[4i + j] (j = 0..3), wrapping. The model
// widens each byte to 16 bits (even bytes by masking or shifting left then right, odd ones by
// shifting right) and sums the pairs with `vpmaddwd`: u8 x s8 products fit int16 (at most
// 255 * 128 = 32640 in magnitude), and two of them fit int32, so no step saturates and the
// result is the instruction's for any operands.
inline __m256i dpbusd_ymm(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, a, b);
#else
  const __m256i a_even = _mm256_and_si256(a, _mm256_set1_epi16(0x00ff));
  const __m256i a_odd = _mm256_srli_epi16(a, 8);
  const __m256i b_even = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8);
  const __m256i b_odd = _mm256_srai_epi16(b, 8);
  return _mm256_add_epi32(
      acc, _mm256_add_epi32(_mm256_madd_epi16(a_even, b_even), _mm256_madd_epi16(a_odd, b_odd)));
#endif
}

}  // namespace
}  // namespace w4a8moe::detail
