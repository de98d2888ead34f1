// The GEMM of the ymm kernel sets (avxvnni, avx2) on layout qu4_p8k8, written once as a template
// on the dot product and instantiated by each set's file, compiled with that set's flags
// (internal linkage, so the copies never mix): kVnni true is `vpdpbusd` ymm (VEX, AVX-VNNI; in
// the avxvnniemu set's file, compiled without AVX-VNNI, its exact model: vpdpbusd_ymm.hpp), false
// AVX2's `vpmaddubsw` + `vpmaddwd`. Panels of 8 rows; per chunk of 8 columns one 32-byte
// load holds 8 rows x 8 offset nibbles (w + 8, u8), multiplied by s8 activations. AVX2 needs no
// saturation care: u8 weights are at most 24 (MXFP4: 2 * e2m1 + 12), so a pair of products is at
// most 2 * 24 * 128 = 6144 and two pairs added in int16 stay below 32767.
#pragma once

#include <immintrin.h>

#include <cassert>

#include "kernels/common/gemm_rows.hpp"
#include "kernels/common/load_unaligned.hpp"
#include "kernels/common/prefetch.hpp"
#include "kernels/kernel.hpp"
#include "kernels/x86_ymm/vpdpbusd_ymm.hpp"

namespace w4a8moe::detail {
namespace {

constexpr int64_t kYmmPanel = 8;

// acc_lo += lo * al and acc_hi += hi * ah (4-column groups per int32 lane). VNNI keeps two
// accumulators so that twice as many `vpdpbusd` chains are in flight (latency about 5, two
// per cycle: a chain of two per chunk would halve the rate); AVX2's chain is a 1-cycle add, so
// it sums both into acc_lo.
template <bool kVnni>
inline void dot8(__m256i& acc_lo, __m256i& acc_hi, __m256i lo, __m256i al, __m256i hi, __m256i ah) {
  if constexpr (kVnni) {
    acc_lo = dpbusd_ymm(acc_lo, lo, al);
    acc_hi = dpbusd_ymm(acc_hi, hi, ah);
  } else {
    (void)acc_hi;
    const __m256i pairs =
        _mm256_add_epi16(_mm256_maddubs_epi16(lo, al), _mm256_maddubs_epi16(hi, ah));
    acc_lo = _mm256_add_epi32(acc_lo, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
}

inline __m256 load_scales_ymm(const uint8_t* base, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::bf16:
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + index * 2))),
          16));
    case DType::f16:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + index * 2)));
    default:
      return _mm256_loadu_ps(reinterpret_cast<const float*>(base) + index);
  }
}

// Output rows [n0, n0 + 8 * NP) of the padded row space. kChunks: chunks of 8 columns per scale
// group when known at compile time (4: group 32, fully unrolled), else 0 (read from the
// geometry). kFormat: the weights' format (its nibbles' decoding).
template <bool kVnni, int M, int NP, int kChunks, WeightFormat kFormat>
void ymm_tile(const GemmArgs& args, int64_t n0, Prefetcher& pf) {
  const Geometry& g = *args.geometry;
  const auto panel_bytes = static_cast<int64_t>(g.panel_bytes);  // panel p's record at w + p * it
  const int64_t first_panel = n0 / kYmmPanel;
  const uint8_t* w = g.panel_at(args.expert, first_panel);
  const auto scales = static_cast<int64_t>(g.panel_scales_offset);  // from a record
  const int64_t chunks_per_group = kChunks > 0 ? kChunks : g.group_len / 8;
  // group-32 bodies (kChunks > 0) are never channel-wise: known at compile time, the int32 sums
  // end with their group; as a run-time flag they stayed live across the whole loop for the
  // channel-wise epilogue after it, taking registers from the chunks (int4 tiles 2-7% slower
  // hot on Zen 3, docs/prefill-avx2.md)
  const bool channelwise = kChunks == 0 && g.group_size < 0;
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  // mxfp4: the nibbles are codes, turned into u8 weights 2 * e2m1 + 12 by a `vpshufb` each (the
  // rows' group terms are then -12 * SUM q: kernels/layout.hpp, kMxfp4Offset)
  constexpr bool kMxfp4 = kFormat == WeightFormat::mxfp4;
  const __m256i mx_table = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Unsigned)));
  // int4 with zero points: the chunks multiply the offset nibbles w + 8 as int4's, and each
  // group's sums of a lane start at (z + 8) * -SUM q, the row's group term times the lane's
  // stored zero point (KernelSet::zero_points_at_group_start): SUM q (w + 8) - (z + 8) SUM q is
  // SUM q (w - z), with no work per chunk
  constexpr bool kZeros = kFormat == WeightFormat::int4_zero_point;
  const auto zeros = static_cast<int64_t>(g.panel_zeros_offset);  // from a record

  const int8_t* q[M];
  for (int m = 0; m < M; ++m) q[m] = static_cast<const int8_t*>(args.a[m].data);
  // With few rows, VNNI keeps a second accumulator per row (see dot8) and the f32 sums stay in
  // registers. From 6 rows the tile has enough `vpdpbusd` chains with one accumulator per row,
  // and its f32 sums live in an L1-resident array (the FMA takes its addend from memory, so no
  // vector ALU op is added): the ymm registers then go to the int32 sums of up to kTileM rows,
  // each unpacked weight register serving all of them.
  constexpr bool kSplit = kVnni && M * NP < 6;
  constexpr bool kSumsInMemory = M * NP >= 6;
  __m256 facc[kSumsInMemory ? 1 : M][NP];
  alignas(32) float fmem[kSumsInMemory ? M : 1][NP][kYmmPanel];
  __m256i iacc[M][NP] = {};
  for (int m = 0; m < M; ++m)
    for (int p = 0; p < NP; ++p) {
      if constexpr (kSumsInMemory)
        _mm256_store_ps(fmem[m][p], _mm256_setzero_ps());
      else
        facc[m][p] = _mm256_setzero_ps();
    }

  for (int64_t b = 0; b < g.groups; ++b) {
    __m256i hacc[M][NP];
    __m256i zero_points[kZeros ? NP : 1];
    if constexpr (kZeros) {
      // the panel's 8 stored zero points z + 8 in [0, 15], one per int32 lane
      for (int p = 0; p < NP; ++p)
        zero_points[p] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
            reinterpret_cast<const __m128i*>(w + p * panel_bytes + zeros + b * kYmmPanel)));
    }
    for (int m = 0; m < M; ++m) {
      // the row's group terms follow its cols_padded bytes (kernel.hpp): addressed from q[m],
      // so that no register holds a second pointer per row
      const __m256i start =
          _mm256_set1_epi32(load_unaligned<int32_t>(q[m] + g.cols_padded + 4 * b));
      for (int p = 0; p < NP; ++p) {
        if constexpr (!kZeros) {
          iacc[m][p] = start;
        } else if constexpr (kChunks > 0 && kChunks * 8 * 128 <= 32767) {
          // |SUM q| <= 128 * group fits int16: `vpmaddwd` of (z + 8, 0) by the term's halves
          iacc[m][p] = _mm256_madd_epi16(zero_points[p], start);
        } else {
          iacc[m][p] = _mm256_mullo_epi32(zero_points[p], start);
        }
        if constexpr (kSplit) hacc[m][p] = _mm256_setzero_si256();
      }
    }
    const uint8_t* wc = w + b * chunks_per_group * 32;
    const int64_t k_begin = b * g.group_len;
    auto chunk = [&](int64_t c) __attribute__((always_inline)) {
      __m256i lo[NP], hi[NP];
      for (int p = 0; p < NP; ++p) {
        const __m256i raw =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + c * 32 + p * panel_bytes));
        lo[p] = _mm256_and_si256(raw, low4);
        hi[p] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        if constexpr (kMxfp4) {
          lo[p] = _mm256_shuffle_epi8(mx_table, lo[p]);
          hi[p] = _mm256_shuffle_epi8(mx_table, hi[p]);
        }
      }
      const int64_t k = k_begin + c * 8;
      for (int m = 0; m < M; ++m) {
        const __m256i al = _mm256_set1_epi32(load_unaligned<int32_t>(q[m] + k));
        const __m256i ah = _mm256_set1_epi32(load_unaligned<int32_t>(q[m] + k + 4));
        for (int p = 0; p < NP; ++p) {
          if constexpr (kSplit)
            dot8<kVnni>(iacc[m][p], hacc[m][p], lo[p], al, hi[p], ah);
          else
            dot8<kVnni>(iacc[m][p], iacc[m][p], lo[p], al, hi[p], ah);
          // AVX2 tiles of 4 and 5 rows: each chunk's sum goes into the row's accumulator as
          // written; GCC otherwise reassociates a group's adds into trees whose partial sums
          // spill (4-13% of the hot tile on Zen 4). With 1 or 2 rows those trees are what keeps
          // enough independent work in flight: barred there, the 1-row tile ran 2x slower.
          if constexpr (!kVnni && M >= 3) asm("" : "+x"(iacc[m][p]));
        }
      }
    };
    if constexpr (kChunks > 0) {
#pragma GCC unroll 16
      for (int c = 0; c < kChunks; ++c) chunk(c);
    } else {
      for (int64_t c = 0; c < chunks_per_group; ++c) chunk(c);
    }
    // once per group, also for long ones (channelwise: the whole row): reporting every 32
    // columns, as the zmm tile does, ran the group-128 and channel-wise layers 6-7% slower here
    // (Zen 4, docs/performance.md "Prefill on AMD Zen 4")
    pf.advance(NP * chunks_per_group);
    if constexpr (kSplit)
      for (int m = 0; m < M; ++m)
        for (int p = 0; p < NP; ++p) iacc[m][p] = _mm256_add_epi32(iacc[m][p], hacc[m][p]);
    if (!channelwise) {
      for (int p = 0; p < NP; ++p) {
        const __m256 s =
            load_scales_ymm(w + p * panel_bytes + scales, g.scale_dtype, b * kYmmPanel);
        for (int m = 0; m < M; ++m) {
          if constexpr (kSumsInMemory)
            _mm256_store_ps(fmem[m][p], _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[m][p]), s,
                                                        _mm256_load_ps(fmem[m][p])));
          else
            facc[m][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[m][p]), s, facc[m][p]);
        }
      }
    }
  }

  for (int p = 0; p < NP; ++p) {
    const uint8_t* corr = g.row_correction(args.expert, n0 + p * kYmmPanel);
    const __m256 bias = g.has_bias ? _mm256_loadu_ps(reinterpret_cast<const float*>(
                                         g.row_bias(args.expert, n0 + p * kYmmPanel)))
                                   : _mm256_setzero_ps();
    float* out = args.c + (n0 - args.n_begin) + p * kYmmPanel;
    if (channelwise) {
      const __m256i wsum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr));
      const __m256 s = load_scales_ymm(w + p * panel_bytes + scales, g.scale_dtype, 0);
      for (int m = 0; m < M; ++m) {
        const __m256i exact =
            _mm256_sub_epi32(iacc[m][p], _mm256_mullo_epi32(wsum, _mm256_set1_epi32(args.a[m].zp)));
        const __m256 rs = _mm256_mul_ps(_mm256_set1_ps(args.a[m].recip), s);
        _mm256_storeu_ps(out + m * args.c_stride,
                         _mm256_fmadd_ps(rs, _mm256_cvtepi32_ps(exact), bias));
      }
    } else {
      const __m256 zsum = _mm256_loadu_ps(reinterpret_cast<const float*>(corr));
      for (int m = 0; m < M; ++m) {
        __m256 sum;
        if constexpr (kSumsInMemory)
          sum = _mm256_load_ps(fmem[m][p]);
        else
          sum = facc[m][p];
        const __m256 v =
            _mm256_fnmadd_ps(_mm256_set1_ps(static_cast<float>(args.a[m].zp)), zsum, sum);
        _mm256_storeu_ps(out + m * args.c_stride,
                         _mm256_fmadd_ps(_mm256_set1_ps(args.a[m].recip), v, bias));
      }
    }
  }
}

// always inlined into ymm_run: as a function of its own, GCC kept the 1-row tile's row pointer
// and loop bound on the stack in the runtime-length chunk loop (group 128 and channel-wise 17-24%
// slower hot on Zen 4)
template <bool kVnni, int M, int NP, int kChunks,
          WeightFormat kFormat = WeightFormat::int4_symmetric>
__attribute__((always_inline)) inline void ymm_run_chunks(const GemmArgs& args) {
  for (int m = 0; m < M; ++m)
    assert(reinterpret_cast<const uint8_t*>(args.a[m].group_terms) ==
           static_cast<const uint8_t*>(args.a[m].data) + args.geometry->cols_padded);
  Prefetcher pf(args);
  for_each_panel_tile<kYmmPanel, NP>(
      args, [&]<int P>(int64_t n0) { ymm_tile<kVnni, M, P, kChunks, kFormat>(args, n0, pf); });
}

template <bool kVnni, int M, int NP>
void ymm_run(const GemmArgs& args) {
  // Group 32 (the common case, where the per-group work weighs most) gets a fully unrolled
  // group body; other group sizes and channelwise scales loop over their chunks.
  constexpr WeightFormat kZeros = WeightFormat::int4_zero_point;
  if (args.geometry->weight_format == WeightFormat::mxfp4)  // always group 32
    ymm_run_chunks<kVnni, M, NP, 4, WeightFormat::mxfp4>(args);
  else if (args.geometry->has_zeros())
    args.geometry->group_size == 32 ? ymm_run_chunks<kVnni, M, NP, 4, kZeros>(args)
                                    : ymm_run_chunks<kVnni, M, NP, 0, kZeros>(args);
  else if (args.geometry->group_size == 32)
    ymm_run_chunks<kVnni, M, NP, 4>(args);
  else
    ymm_run_chunks<kVnni, M, NP, 0>(args);
}

// The GEMM of a set with up to kTileM rows per call, one instantiation per row count: 1 and 2
// rows take two panels per tile (more independent chains), the others one.
template <bool kVnni, int kTileM>
void gemm_qa8_qu4p8k8_ymm(const GemmArgs& args) {
  static constexpr auto kByRows =
      gemm_by_rows<kTileM>([]<int M>() -> GemmFn { return ymm_run < kVnni, M, M <= 2 ? 2 : 1 > ; });
  kByRows[static_cast<size_t>(args.m - 1)](args);
}

}  // namespace
}  // namespace w4a8moe::detail
