// 16 stored weight scales as f32 in a zmm register, and 16 zero points spread over their lanes
// (internal linkage: included by the AVX-512 kernel files, each compiled with its own flags).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu/compiled_isa.hpp"
#include "kernels/common/spread_zeros.hpp"
#include "w4a8moe/w4a8moe.hpp"

static_assert(w4a8moe::detail::compiled_for_at_least("avx512vnni"),
              "for files compiled with at least the avx512vnni cluster's flags (src/cpu/isa.hpp)");

namespace w4a8moe::detail {
namespace {

// Scales index..index + 15 of the scale section at `base`, stored as `dtype` (f32, bf16, f16).
inline __m512 load_scales_zmm(const uint8_t* base, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::bf16:
      return _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + index * 2))),
          16));
    case DType::f16:
      return _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + index * 2)));
    default:
      return _mm512_loadu_ps(reinterpret_cast<const float*>(base) + index);
  }
}

// Zero points index..index + 15 of the zeros section at `base` (z + 8, one per output row), each
// in the 4 bytes of its row's dword lane.
inline __m512i load_zeros_zmm(const uint8_t* base, int64_t index) {
  return _mm512_shuffle_epi8(
      _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + index))),
      _mm512_load_si512(kSpreadZeros.data()));
}

}  // namespace
}  // namespace w4a8moe::detail
