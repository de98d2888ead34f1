// The AVX-512 VNNI GEMM micro-kernel on layout qu4_p16k8, shared by the set's two files
// (gemm_qa8_qu4p16k8_avx512vnni.cpp; its MXFP4 variant for CPUs with VBMI,
// gemm_qa8_qu4p16k8_avx512vnni_vbmi.cpp): tiles of M activation rows (1..16) x NP panels of 16
// output rows. Per chunk of 8 columns and panel, one 64-byte load holds 16 rows x 8
// offset nibbles; `and 0x0f` and `srl 4, and 0x0f` give the u8 weights of columns k0..k0+3 and
// k0+4..k0+7, each multiplied by 4 broadcast s8 activations with `vpdpbusd`. Every unpacked
// register serves M rows. Per scale group: int32 sums start at the row's group term
// (-8 * SUM q), are converted once and multiplied into f32 accumulators by the 16 row scales.
// int8 weights in layout qu8_p16k4 (a linear layer's) take the same tile: two 64-byte loads per
// 8 columns are the u8 weights w + 128 themselves, channelwise, from terms -128 * SUM q.
//
// Port budget on Intel cores (measured: every 512-bit op here issues on ports 0 and 5, two per
// cycle; `vpsrlw` and `vcvtdq2ps` on port 0 only): per group of 32 columns and M rows, 8M
// `vpdpbusd` + 12 unpack ops + 2M for cvt and FMA + 2 for bf16 scales. M = 16 bounds the
// `vpdpbusd` share at 128 / 174 = 74% of peak (M = 8: 68%); the tile runs near that bound.

#pragma once

#include <immintrin.h>

#include <array>
#include <cassert>

#include "cpu/compiled_isa.hpp"
#include "kernels/common/gemm_rows.hpp"
#include "kernels/common/load_unaligned.hpp"
#include "kernels/common/prefetch.hpp"
#include "kernels/x86_avx512vnni/avx512vnni_kernels.hpp"
#include "kernels/x86_avx512vnni/load_scales_zmm.hpp"

static_assert(w4a8moe::detail::compiled_for_at_least("avx512vnni"),
              "for files compiled with at least the avx512vnni cluster's flags (src/cpu/isa.hpp)");

namespace w4a8moe::detail::avx512vnni {

namespace {

constexpr int64_t kPanel = 16;

// How a tile turns a weight byte's nibbles into u8 weights: int4 (offset nibbles: a mask each);
// int4 with zero points, the same plus 15 - (z + 8) per lane and group (w - z + 15 in [0, 30]:
// two byte adds per chunk, shared by the tile's rows); mxfp4 codes through kMxfp4Unsigned by
// `vpshufb` after the mask (any AVX-512 VNNI CPU), or by `vpermb` (AVX-512 VBMI), which reads only
// 6 index bits and so needs no mask: the table repeated over 64 bytes gives the same instruction
// count as int4.
// int8: bytes w + 128 as stored (layout qu8_p16k4), no decoding.
enum class Decode { int4, int4_zero_point, mxfp4_shuffle, mxfp4_permute, int8 };

// kMxfp4Unsigned in each 128-bit lane (as `vpshufb` reads its table), and so in all 64 bytes.
alignas(64) constexpr auto kMxfp4Lanes = [] {
  std::array<uint8_t, 64> t{};
  for (size_t i = 0; i < t.size(); ++i) t[i] = kMxfp4Unsigned[i % 16];
  return t;
}();

// acc += u8 weights (w) x 4 s8 activations at p broadcast to every lane (the broadcast is a
// load-port uop on x86, so it costs none of the vector ALU ports `vpdpbusd` runs on).
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(load_unaligned<int32_t>(p)));
}

// Output rows [n0, n0 + 16 * NP) of the padded row space. kChunks: chunks of 8 columns per scale
// group when known at compile time (4: group 32), else 0 (read from the geometry). kDecode: how
// the nibbles become u8 weights (mxfp4: 2 * e2m1 + 12, the rows' group terms then being
// -12 * SUM q; zero points: w - z + 15, terms -15 * SUM q; kernels/layout.hpp, kMxfp4Offset and
// kZeroPointOffset).
template <int M, int NP, int kChunks, Decode kDecode = Decode::int4>
void tile(const GemmArgs& args, int64_t n0, Prefetcher& pf) {
  const Geometry& g = *args.geometry;
  const auto panel_bytes = static_cast<int64_t>(g.panel_bytes);  // panel p's record at w + p * it
  const int64_t first_panel = n0 / kPanel;
  const uint8_t* w = g.panel_at(args.expert, first_panel);
  const auto scales = static_cast<int64_t>(g.panel_scales_offset);  // from a record
  const int64_t chunks_per_group = kChunks > 0 ? kChunks : g.group_len / 8;
  // bytes of one panel's 8 columns: 16 rows of 8 nibbles, or of 8 int8 bytes
  constexpr int64_t kChunkBytes = kDecode == Decode::int8 ? 128 : 64;
  const bool channelwise = g.group_size < 0;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i mx_table = _mm512_load_si512(kMxfp4Lanes.data());
  const auto zeros = static_cast<int64_t>(g.panel_zeros_offset);  // from a record

  const int8_t* q[M];
  for (int m = 0; m < M; ++m) q[m] = static_cast<const int8_t*>(args.a[m].data);

  // Small tiles keep separate accumulators for the low and high nibble columns, so that
  // enough independent `vpdpbusd` chains are in flight (latency 5, two per cycle); larger
  // tiles have enough chains already and save the extra add per group.
  constexpr bool kSplit = M * NP < 6;
  // Below 8 rows the f32 sums stay in registers; from 8, they live in an L1-resident array
  // (the FMA takes its addend from memory, so no vector ALU op is added) and the registers go
  // to the int32 sums of more rows, each unpacked weight register serving more of them. (GCC
  // spills such sums anyway at 8 rows, worse than this explicit array.)
  constexpr bool kSumsInMemory = M * NP >= 8;
  __m512 facc[kSumsInMemory ? 1 : M][NP];
  alignas(64) float fmem[kSumsInMemory ? M : 1][NP][kPanel];
  __m512i iacc[M][NP];
  for (int m = 0; m < M; ++m)
    for (int p = 0; p < NP; ++p) {
      if constexpr (kSumsInMemory)
        _mm512_store_ps(fmem[m][p], _mm512_setzero_ps());
      else
        facc[m][p] = _mm512_setzero_ps();
    }

  for (int64_t b = 0; b < g.groups; ++b) {
    __m512i lo_acc[M][NP], hi_acc[M][NP];
    for (int m = 0; m < M; ++m) {
      // the row's group terms follow its cols_padded bytes (see run()): addressed from q[m],
      // so that no register holds a second pointer per row
      const __m512i start =
          _mm512_set1_epi32(load_unaligned<int32_t>(q[m] + g.cols_padded + 4 * b));
      for (int p = 0; p < NP; ++p) {
        lo_acc[m][p] = start;
        if constexpr (kSplit) hi_acc[m][p] = _mm512_setzero_si512();
      }
    }
    const uint8_t* wc = w + b * chunks_per_group * kChunkBytes;
    const int64_t k_begin = b * g.group_len;
    // zero points: 15 - (z + 8) in each byte of a lane, added to its unpacked weights
    __m512i adjust[kDecode == Decode::int4_zero_point ? NP : 1];
    if constexpr (kDecode == Decode::int4_zero_point) {
      for (int p = 0; p < NP; ++p)
        adjust[p] = _mm512_sub_epi8(_mm512_set1_epi8(kZeroPointOffset),
                                    load_zeros_zmm(w + p * panel_bytes + zeros, b * kPanel));
    }
    auto chunk = [&](int64_t c) __attribute__((always_inline)) {
      __m512i lo[NP], hi[NP];
      for (int p = 0; p < NP; ++p) {
        const uint8_t* src = wc + c * kChunkBytes + p * panel_bytes;
        if constexpr (kDecode == Decode::int8) {
          lo[p] = _mm512_loadu_si512(src);
          hi[p] = _mm512_loadu_si512(src + 64);
          continue;
        }
        const __m512i raw = _mm512_loadu_si512(src);
        if constexpr (kDecode == Decode::mxfp4_permute) {
#if defined(__AVX512VBMI__)
          lo[p] = _mm512_permutexvar_epi8(raw, mx_table);
          hi[p] = _mm512_permutexvar_epi8(_mm512_srli_epi16(raw, 4), mx_table);
#endif
        } else {
          lo[p] = _mm512_and_si512(raw, low4);
          hi[p] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
          if constexpr (kDecode == Decode::mxfp4_shuffle) {
            lo[p] = _mm512_shuffle_epi8(mx_table, lo[p]);
            hi[p] = _mm512_shuffle_epi8(mx_table, hi[p]);
          } else if constexpr (kDecode == Decode::int4_zero_point) {
            lo[p] = _mm512_add_epi8(lo[p], adjust[p]);
            hi[p] = _mm512_add_epi8(hi[p], adjust[p]);
          }
        }
      }
      const int64_t k = k_begin + c * 8;
      for (int m = 0; m < M; ++m) {
        for (int p = 0; p < NP; ++p) {
          lo_acc[m][p] = dpbusd_bcast(lo_acc[m][p], lo[p], q[m] + k);
          if constexpr (kSplit)
            hi_acc[m][p] = dpbusd_bcast(hi_acc[m][p], hi[p], q[m] + k + 4);
          else
            lo_acc[m][p] = dpbusd_bcast(lo_acc[m][p], hi[p], q[m] + k + 4);
        }
      }
    };
    if constexpr (kChunks > 0) {
#pragma GCC unroll 16
      for (int c = 0; c < kChunks; ++c) chunk(c);
      pf.advance(NP * kChunks);
    } else if constexpr (kDecode == Decode::int8) {
      // channelwise over K, a multiple of 32: 4 chunks a step, unrolled, no branch among them
      for (int64_t c = 0; c < chunks_per_group; c += 4) {
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) chunk(c + u);
        pf.advance(NP * 4);
      }
    } else {
      // long groups (channelwise: the whole row) report their work every 32 columns, so that the
      // prefetches are spread over the group instead of following it in one burst
      for (int64_t c = 0; c < chunks_per_group; ++c) {
        chunk(c);
        if ((c & 3) == 3) pf.advance(NP * 4);
      }
      pf.advance(NP * (chunks_per_group & 3));
    }
    for (int m = 0; m < M; ++m)
      for (int p = 0; p < NP; ++p)
        iacc[m][p] = kSplit ? _mm512_add_epi32(lo_acc[m][p], hi_acc[m][p]) : lo_acc[m][p];
    if (!channelwise) {
      for (int p = 0; p < NP; ++p) {
        const __m512 s = load_scales_zmm(w + p * panel_bytes + scales, g.scale_dtype, b * kPanel);
        for (int m = 0; m < M; ++m) {
          if constexpr (kSumsInMemory)
            _mm512_store_ps(fmem[m][p], _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][p]), s,
                                                        _mm512_load_ps(fmem[m][p])));
          else
            facc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][p]), s, facc[m][p]);
        }
      }
    }
  }

  // Epilogue: c = recip * (acc - zp * correction) + bias
  const bool has_bias = g.has_bias;
  for (int p = 0; p < NP; ++p) {
    const uint8_t* corr = g.row_correction(args.expert, n0 + p * kPanel);
    const __m512 bias = has_bias ? _mm512_loadu_ps(reinterpret_cast<const float*>(
                                       g.row_bias(args.expert, n0 + p * kPanel)))
                                 : _mm512_setzero_ps();
    if (channelwise) {
      const __m512i wsum = _mm512_loadu_si512(corr);
      const __m512 s = load_scales_zmm(w + p * panel_bytes + scales, g.scale_dtype, 0);
      for (int m = 0; m < M; ++m) {
        const __m512i exact =
            _mm512_sub_epi32(iacc[m][p], _mm512_mullo_epi32(wsum, _mm512_set1_epi32(args.a[m].zp)));
        const __m512 rs = _mm512_mul_ps(_mm512_set1_ps(args.a[m].recip), s);
        _mm512_storeu_ps(args.c + m * args.c_stride + (n0 - args.n_begin) + p * kPanel,
                         _mm512_fmadd_ps(rs, _mm512_cvtepi32_ps(exact), bias));
      }
    } else {
      const __m512 zsum = _mm512_loadu_ps(reinterpret_cast<const float*>(corr));
      for (int m = 0; m < M; ++m) {
        __m512 sum;
        if constexpr (kSumsInMemory)
          sum = _mm512_load_ps(fmem[m][p]);
        else
          sum = facc[m][p];
        const __m512 v =
            _mm512_fnmadd_ps(_mm512_set1_ps(static_cast<float>(args.a[m].zp)), zsum, sum);
        _mm512_storeu_ps(args.c + m * args.c_stride + (n0 - args.n_begin) + p * kPanel,
                         _mm512_fmadd_ps(_mm512_set1_ps(args.a[m].recip), v, bias));
      }
    }
  }
}

template <int M, int NP, int kChunks, Decode kDecode = Decode::int4>
void run_chunks(const GemmArgs& args) {
  for (int m = 0; m < M; ++m)
    assert(reinterpret_cast<const uint8_t*>(args.a[m].group_terms) ==
           static_cast<const uint8_t*>(args.a[m].data) + args.geometry->cols_padded);
  Prefetcher pf(args);
  for_each_panel_tile<kPanel, NP>(
      args, [&]<int P>(int64_t n0) { tile<M, P, kChunks, kDecode>(args, n0, pf); });
}

template <int M, int NP>
void run(const GemmArgs& args) {
  // Group 32 (the common case, and the one where the per-group work weighs most) gets a fully
  // unrolled group body; other group sizes and channelwise scales loop over their chunks.
  if (args.geometry->weight_format == WeightFormat::mxfp4)  // always group 32
    run_chunks<M, NP, 4, Decode::mxfp4_shuffle>(args);
  else if (args.geometry->weight_format == WeightFormat::int8)  // channelwise, bytes
    run_chunks<M, NP, 0, Decode::int8>(args);
  else if (args.geometry->has_zeros())
    args.geometry->group_size == 32 ? run_chunks<M, NP, 4, Decode::int4_zero_point>(args)
                                    : run_chunks<M, NP, 0, Decode::int4_zero_point>(args);
  else if (args.geometry->group_size == 32)
    run_chunks<M, NP, 4>(args);
  else
    run_chunks<M, NP, 0>(args);
}

// The GEMM, one instantiation per row count up to kTileM: 1 row takes four panels per tile, 2
// rows two (more independent chains), 3 to 8 rows two (two weight streams in flight: with one,
// a tile of 8 rows waited on memory, at 8 tokens a dense layer 1.3x (int4) to 1.6x (int8
// bytes) slower than with two; docs/whole-model.md), more rows one. kPermute: mxfp4 weights decoded
// by `vpermb` (only in a file compiled with AVX-512 VBMI), else as run() chooses.
template <bool kPermute>
void gemm_rows(const GemmArgs& args) {
  static constexpr auto kByRows = gemm_by_rows<kTileM>([]<int M>() -> GemmFn {
    constexpr int NP = M <= 2 ? 4 / M : M <= 8 ? 2 : 1;
    if constexpr (kPermute)
      return run_chunks<M, NP, 4, Decode::mxfp4_permute>;
    else
      return run<M, NP>;
  });
  kByRows[static_cast<size_t>(args.m - 1)](args);
}

}  // namespace
}  // namespace w4a8moe::detail::avx512vnni
