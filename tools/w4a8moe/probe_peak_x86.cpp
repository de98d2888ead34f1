// Peak int8 multiply-accumulate probes, one per x86 kernel set: 12 independent accumulator
// chains of the set's core instruction(s) on register operands (no memory traffic).
//   avx512vnni: vpdpbusd zmm (64 MAC)       avxvnni: vpdpbusd ymm (32 MAC)
//   avx2:       vpmaddubsw + vpmaddwd + vpaddd ymm (32 MAC), the cheapest exact u8 x s8 -> s32
//               sequence without VNNI
//   amx:        tdpbusd on full tiles (16 x 64 u8 by 64 x 16 s8 into 16 x 16 int32: 16384 MAC),
//               four independent accumulator tiles from two A and two B tiles
// Each function is compiled for its ISA through a target attribute and only called when the
// registry finds its kernel set usable (probe.cpp).
#include <immintrin.h>

#include <cstdint>

#include "w4a8moe/probe.hpp"

namespace w4a8moe::cli::x86 {

namespace {
volatile int32_t g_sink;
}

#define W4A8MOE_CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

__attribute__((target("avx512f,avx512bw,avx512vnni"))) double macs_avx512vnni(int64_t iters) {
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
#define DECL(i) __m512i acc##i = _mm512_set1_epi32(i);
#define STEP(i) acc##i = _mm512_dpbusd_epi32(acc##i, a, b);
  W4A8MOE_CHAINS(DECL)
  for (int64_t it = 0; it < iters; ++it) {
    W4A8MOE_CHAINS(STEP)
    __asm__ volatile(""
                     : "+v"(acc0), "+v"(acc1), "+v"(acc2), "+v"(acc3), "+v"(acc4), "+v"(acc5),
                       "+v"(acc6), "+v"(acc7), "+v"(acc8), "+v"(acc9), "+v"(acc10), "+v"(acc11));
  }
  __m512i s = _mm512_add_epi32(acc0, acc11);
#define SUM(i) s = _mm512_add_epi32(s, acc##i);
  W4A8MOE_CHAINS(SUM)
  alignas(64) int32_t out[16];
  _mm512_store_si512(out, s);
  g_sink = out[0];
#undef DECL
#undef STEP
#undef SUM
  return static_cast<double>(iters) * 12.0 * 64.0;
}

__attribute__((target("avx2,avxvnni"))) double macs_avxvnni(int64_t iters) {
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
#define DECL(i) __m256i acc##i = _mm256_set1_epi32(i);
#define STEP(i) acc##i = _mm256_dpbusd_avx_epi32(acc##i, a, b);
  W4A8MOE_CHAINS(DECL)
  for (int64_t it = 0; it < iters; ++it) {
    W4A8MOE_CHAINS(STEP)
    __asm__ volatile(""
                     : "+x"(acc0), "+x"(acc1), "+x"(acc2), "+x"(acc3), "+x"(acc4), "+x"(acc5),
                       "+x"(acc6), "+x"(acc7), "+x"(acc8), "+x"(acc9), "+x"(acc10), "+x"(acc11));
  }
  __m256i s = _mm256_add_epi32(acc0, acc11);
#define SUM(i) s = _mm256_add_epi32(s, acc##i);
  W4A8MOE_CHAINS(SUM)
  alignas(32) int32_t out[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(out), s);
  g_sink = out[0];
#undef DECL
#undef STEP
#undef SUM
  return static_cast<double>(iters) * 12.0 * 32.0;
}

// Assembly: the products do not depend on the accumulators, so a compiler would hoist them.
// The sequence is the AVX2 kernel's: two `vpmaddubsw` (u8 x s8 pairs to int16) summed in int16
// (safe: weights are at most 15, so 4 products stay below 2^15), one `vpmaddwd` by ones to int32,
// one `vpaddd`: 5 instructions per 64 MACs per 32-byte lane set, 4 independent chains.
__attribute__((target("avx2"))) double macs_avx2(int64_t iters) {
  for (int64_t it = 0; it < iters; ++it) {
    __asm__ volatile(
        "vpmaddubsw %%ymm13, %%ymm12, %%ymm4\n\t"
        "vpmaddubsw %%ymm13, %%ymm12, %%ymm5\n\t"
        "vpmaddubsw %%ymm13, %%ymm12, %%ymm6\n\t"
        "vpmaddubsw %%ymm13, %%ymm12, %%ymm7\n\t"
        "vpmaddubsw %%ymm13, %%ymm12, %%ymm8\n\t"
        "vpmaddubsw %%ymm13, %%ymm12, %%ymm9\n\t"
        "vpmaddubsw %%ymm13, %%ymm12, %%ymm10\n\t"
        "vpmaddubsw %%ymm13, %%ymm12, %%ymm11\n\t"
        "vpaddw %%ymm5, %%ymm4, %%ymm4\n\t"
        "vpaddw %%ymm7, %%ymm6, %%ymm6\n\t"
        "vpaddw %%ymm9, %%ymm8, %%ymm8\n\t"
        "vpaddw %%ymm11, %%ymm10, %%ymm10\n\t"
        "vpmaddwd %%ymm14, %%ymm4, %%ymm4\n\t"
        "vpmaddwd %%ymm14, %%ymm6, %%ymm6\n\t"
        "vpmaddwd %%ymm14, %%ymm8, %%ymm8\n\t"
        "vpmaddwd %%ymm14, %%ymm10, %%ymm10\n\t"
        "vpaddd %%ymm4, %%ymm0, %%ymm0\n\t"
        "vpaddd %%ymm6, %%ymm1, %%ymm1\n\t"
        "vpaddd %%ymm8, %%ymm2, %%ymm2\n\t"
        "vpaddd %%ymm10, %%ymm3, %%ymm3\n\t" ::
            : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
              "xmm10", "xmm11");
  }
  return static_cast<double>(iters) * 4.0 * 64.0;
}

// The tile configuration is per thread: loaded on entry, released on exit (each call runs for
// about a millisecond, so the two instructions cost nothing measurable).
__attribute__((target("amx-tile,amx-int8"))) double macs_amx(int64_t iters) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  } config;
  alignas(64) static uint8_t operand[16 * 64];  // zeros: the values do not change the timing
  alignas(64) int32_t out[16 * 16];
  _tile_loadconfig(&config);
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t it = 0; it < iters; ++it) {
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  g_sink = out[0];
  return static_cast<double>(iters) * 4.0 * 16384.0;
}

}  // namespace w4a8moe::cli::x86
