// The neoni8mm set's GEMM: `smmla` tiles of up to 8 activation rows x 8 output rows on layout
// qu4_p8k16 (prefill), one activation row by `sdot` on the same layout (decode).
//
// qu4_p8k16: panels of 8 rows; per 16 columns a chunk of 64 bytes, 16 bytes per row pair
// (2r, 2r + 1): byte 8 * i + j holds w[2r + i][k + j] + 8 (low nibble) and w[2r + i][k + 8 + j]
// + 8 (high nibble). So the low nibbles of one 16-byte load are the 2x8 right operand of
// `smmla` for columns k..k+7 and the high nibbles that for k+8..k+15. The left operand is two
// activation rows x 8 columns (zip of two row loads). `smmla` adds the 2x2 block
// [row a x out n, row a x out n+1; row a+1 x out n, ...], exact in int32.
//
// Per 64 weights (8 output rows x 8 columns) and 8 activation rows: 2 loads (16 bytes), 4 unpack
// ops (and, ushr), 16 `smmla` (2 per activation row), and 4 activation loads + 4 zips shared by
// the 8 output rows of the panel.
#include <arm_neon.h>

#include "cpu/compiled_isa.hpp"
#include "kernels/arm_neon/neon_common.hpp"
#include "kernels/arm_neoni8mm/neoni8mm_kernels.hpp"
#include "kernels/common/gemm_rows.hpp"
#include "kernels/common/load_unaligned.hpp"

static_assert(
    w4a8moe::detail::compiled_for("neoni8mm"),
    "compile this file with the neoni8mm cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail::neoni8mm {

namespace {

inline int8x16_t broadcast8(const int8_t* p) {
  return vreinterpretq_s8_s64(vdupq_n_s64(load_unaligned<int64_t>(p)));
}

// [v0, v1] -> [v0, v1, v0, v1] (the 2x2 block's column pattern) from 4 column values.
inline float32x4_t cols01(float32x4_t v) { return vcombine_f32(vget_low_f32(v), vget_low_f32(v)); }
inline float32x4_t cols23(float32x4_t v) {
  return vcombine_f32(vget_high_f32(v), vget_high_f32(v));
}
inline int32x4_t cols01(int32x4_t v) { return vcombine_s32(vget_low_s32(v), vget_low_s32(v)); }
inline int32x4_t cols23(int32x4_t v) { return vcombine_s32(vget_high_s32(v), vget_high_s32(v)); }

// One activation row x NP panels by `sdot`: the row's 8 columns broadcast twice line up with a
// row pair's 2 x 8 columns; lanes (out n, columns 0-3), (out n, 4-7), (out n + 1, 0-3), ...
template <int NP, WeightFormat kFormat>
void tile_row(const GemmArgs& args, int64_t n0) {
  const Geometry& g = *args.geometry;
  const auto panel_bytes = static_cast<int64_t>(g.panel_bytes);  // panel p's record at w + p * it
  const int64_t first_panel = n0 / kPanel;
  const uint8_t* w = g.panel_at(args.expert, first_panel);
  const auto scales = static_cast<int64_t>(g.panel_scales_offset);  // from a record
  const bool channelwise = g.group_size < 0;
  const uint8x16_t low4 = vdupq_n_u8(0x0f);
  const QuantRow& a = args.a[0];
  const auto* q = static_cast<const int8_t*>(a.data);

  float32x4_t facc[NP][2];
  int32x4_t sum[NP][2];
  for (int p = 0; p < NP; ++p) {
    facc[p][0] = facc[p][1] = vdupq_n_f32(0.0f);
    sum[p][0] = sum[p][1] = vdupq_n_s32(0);
  }
  for (int64_t b = 0; b < g.groups; ++b) {
    int32x4_t acc[NP][4];
    for (int p = 0; p < NP; ++p)
      for (int c = 0; c < 4; ++c) acc[p][c] = vdupq_n_s32(0);
    ZeroAdjust adjust[NP];
    for (int p = 0; p < NP; ++p)
      adjust[p] = zero_adjust<kFormat>(g, args.expert, first_panel + p, b, kRowsP8k16);
    for (int64_t k = b * g.group_len; k < (b + 1) * g.group_len; k += 16) {
      const int8x16_t alo = broadcast8(q + k), ahi = broadcast8(q + k + 8);
      for (int p = 0; p < NP; ++p) {
        const uint8_t* wc = w + p * panel_bytes + k * 4;
        for (int c = 0; c < 4; ++c) {
          const uint8x16_t r = vld1q_u8(wc + 16 * c);
          acc[p][c] =
              vdotq_s32(acc[p][c], weights_of<kFormat>(vandq_u8(r, low4), adjust[p].reg[c]), alo);
          acc[p][c] =
              vdotq_s32(acc[p][c], weights_of<kFormat>(vshrq_n_u8(r, 4), adjust[p].reg[c]), ahi);
        }
      }
    }
    const int32x4_t term = vdupq_n_s32(a.group_terms[b]);
    for (int p = 0; p < NP; ++p) {
      sum[p][0] = vaddq_s32(vpaddq_s32(acc[p][0], acc[p][1]), term);
      sum[p][1] = vaddq_s32(vpaddq_s32(acc[p][2], acc[p][3]), term);
      if (!channelwise)
        for (int h = 0; h < 2; ++h)
          facc[p][h] = vfmaq_f32(
              facc[p][h], vcvtq_f32_s32(sum[p][h]),
              load_scales4(w + p * panel_bytes + scales, g.scale_dtype, b * kPanel + 4 * h));
    }
  }

  for (int p = 0; p < NP; ++p)
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n0 + p * kPanel + 4 * h;
      const uint8_t* corr = g.row_correction(args.expert, n);
      const float32x4_t bias = load_bias4(g, args.expert, n);
      float* out = args.c + (n - args.n_begin);
      if (channelwise) {
        const int32x4_t wsum = vld1q_s32(reinterpret_cast<const int32_t*>(corr));
        const float32x4_t s = load_scales4(w + p * panel_bytes + scales, g.scale_dtype, 4 * h);
        vst1q_f32(out, finish_channelwise(sum[p][h], vdupq_n_s32(a.zp), vdupq_n_f32(a.recip), wsum,
                                          s, bias));
      } else {
        const float32x4_t zsum = vld1q_f32(reinterpret_cast<const float*>(corr));
        vst1q_f32(out, finish_groupwise(facc[p][h], vdupq_n_f32(static_cast<float>(a.zp)),
                                        vdupq_n_f32(a.recip), zsum, bias));
      }
    }
}

// MP pairs of activation rows (the last row repeated when m is odd) x one panel by `smmla`.
// Block (i, c): rows 2i, 2i + 1 x output rows n0 + 2c, n0 + 2c + 1.
template <int MP, WeightFormat kFormat>
void tile_pairs(const GemmArgs& args, int64_t n0) {
  const Geometry& g = *args.geometry;
  const int64_t panel = n0 / kPanel;
  const uint8_t* w = g.panel_at(args.expert, panel);
  const uint8_t* scales = g.panel_scales(args.expert, panel);
  const bool channelwise = g.group_size < 0;
  const uint8x16_t low4 = vdupq_n_u8(0x0f);
  const int64_t m = args.m;
  const QuantRow* rows[2 * MP];
  for (int64_t r = 0; r < 2 * MP; ++r) rows[r] = &args.a[r < m ? r : m - 1];

  float32x4_t facc[MP][4];
  int32x4_t sum[MP][4];
  for (int i = 0; i < MP; ++i)
    for (int c = 0; c < 4; ++c) {
      facc[i][c] = vdupq_n_f32(0.0f);
      sum[i][c] = vdupq_n_s32(0);
    }
  for (int64_t b = 0; b < g.groups; ++b) {
    const ZeroAdjust adjust = zero_adjust<kFormat>(g, args.expert, panel, b, kRowsP8k16);
    for (int i = 0; i < MP; ++i) {
      const int32x4_t term = vcombine_s32(vdup_n_s32(rows[2 * i]->group_terms[b]),
                                          vdup_n_s32(rows[2 * i + 1]->group_terms[b]));
      for (int c = 0; c < 4; ++c) sum[i][c] = term;
    }
    for (int64_t k = b * g.group_len; k < (b + 1) * g.group_len; k += 16) {
      // The 8 weight operands first, then one row pair at a time: 16 accumulators + 8 weights +
      // 4 activation registers fit the 32 vector registers without spilling (GCC: with its
      // scheduling before register allocation off, see CMakeLists.txt).
      const uint8_t* wc = w + k * 4;
      int8x16_t lo[4], hi[4];
      unpack64<kFormat>(wc, low4, adjust, lo, hi);
      for (int i = 0; i < MP; ++i) {
        const int64x2_t r0 =
            vreinterpretq_s64_s8(vld1q_s8(static_cast<const int8_t*>(rows[2 * i]->data) + k));
        const int64x2_t r1 =
            vreinterpretq_s64_s8(vld1q_s8(static_cast<const int8_t*>(rows[2 * i + 1]->data) + k));
        const int8x16_t alo = vreinterpretq_s8_s64(vzip1q_s64(r0, r1));
        const int8x16_t ahi = vreinterpretq_s8_s64(vzip2q_s64(r0, r1));
        for (int c = 0; c < 4; ++c) {
          sum[i][c] = vmmlaq_s32(sum[i][c], alo, lo[c]);
          sum[i][c] = vmmlaq_s32(sum[i][c], ahi, hi[c]);
        }
      }
    }
    if (!channelwise) {
      const int64_t at = b * kPanel;
      const float32x4_t s0 = load_scales4(scales, g.scale_dtype, at);
      const float32x4_t s1 = load_scales4(scales, g.scale_dtype, at + 4);
      const float32x4_t s[4] = {cols01(s0), cols23(s0), cols01(s1), cols23(s1)};
      for (int i = 0; i < MP; ++i)
        for (int c = 0; c < 4; ++c)
          facc[i][c] = vfmaq_f32(facc[i][c], vcvtq_f32_s32(sum[i][c]), s[c]);
    }
  }

  const uint8_t* corr = g.row_correction(args.expert, n0);
  const float32x4_t b0 = load_bias4(g, args.expert, n0), b1 = load_bias4(g, args.expert, n0 + 4);
  const float32x4_t bias[4] = {cols01(b0), cols23(b0), cols01(b1), cols23(b1)};
  float32x4_t s[4];
  int32x4_t wsum[4];
  float32x4_t zsum[4];
  if (channelwise) {
    const float32x4_t s0 = load_scales4(scales, g.scale_dtype, 0);
    const float32x4_t s1 = load_scales4(scales, g.scale_dtype, 4);
    const int32x4_t w0 = vld1q_s32(reinterpret_cast<const int32_t*>(corr));
    const int32x4_t w1 = vld1q_s32(reinterpret_cast<const int32_t*>(corr) + 4);
    s[0] = cols01(s0), s[1] = cols23(s0), s[2] = cols01(s1), s[3] = cols23(s1);
    wsum[0] = cols01(w0), wsum[1] = cols23(w0), wsum[2] = cols01(w1), wsum[3] = cols23(w1);
  } else {
    const float32x4_t z0 = vld1q_f32(reinterpret_cast<const float*>(corr));
    const float32x4_t z1 = vld1q_f32(reinterpret_cast<const float*>(corr) + 4);
    zsum[0] = cols01(z0), zsum[1] = cols23(z0), zsum[2] = cols01(z1), zsum[3] = cols23(z1);
  }
  float* out = args.c + (n0 - args.n_begin);
  for (int i = 0; i < MP; ++i) {
    const QuantRow& r0 = *rows[2 * i];
    const QuantRow& r1 = *rows[2 * i + 1];
    const float32x4_t recip = vcombine_f32(vdup_n_f32(r0.recip), vdup_n_f32(r1.recip));
    float32x4_t o[4];
    for (int c = 0; c < 4; ++c) {
      if (channelwise) {
        const int32x4_t zp = vcombine_s32(vdup_n_s32(r0.zp), vdup_n_s32(r1.zp));
        o[c] = finish_channelwise(sum[i][c], zp, recip, wsum[c], s[c], bias[c]);
      } else {
        const float32x4_t zp = vcombine_f32(vdup_n_f32(static_cast<float>(r0.zp)),
                                            vdup_n_f32(static_cast<float>(r1.zp)));
        o[c] = finish_groupwise(facc[i][c], zp, recip, zsum[c], bias[c]);
      }
    }
    float* row0 = out + 2 * i * args.c_stride;
    vst1q_f32(row0, vcombine_f32(vget_low_f32(o[0]), vget_low_f32(o[1])));
    vst1q_f32(row0 + 4, vcombine_f32(vget_low_f32(o[2]), vget_low_f32(o[3])));
    if (2 * i + 1 < m) {
      float* row1 = row0 + args.c_stride;
      vst1q_f32(row1, vcombine_f32(vget_high_f32(o[0]), vget_high_f32(o[1])));
      vst1q_f32(row1 + 4, vcombine_f32(vget_high_f32(o[2]), vget_high_f32(o[3])));
    }
  }
}

template <int MP, WeightFormat kFormat>
void run_pairs(const GemmArgs& args) {
  for (int64_t n = args.n_begin; n < args.n_end; n += kPanel) tile_pairs<MP, kFormat>(args, n);
}

template <WeightFormat kFormat>
void gemm(const GemmArgs& args) {
  switch (args.m) {
    case 1:
      return for_each_panel_tile<kPanel, 2>(
          args, [&]<int NP>(int64_t n0) { tile_row<NP, kFormat>(args, n0); });
    case 2:
      return run_pairs<1, kFormat>(args);
    case 3:
    case 4:
      return run_pairs<2, kFormat>(args);
    case 5:
    case 6:
      return run_pairs<3, kFormat>(args);
    default:
      return run_pairs<4, kFormat>(args);
  }
}

}  // namespace

void gemm_qa8_qu4p8k16(const GemmArgs& args) {
  switch (args.geometry->weight_format) {
    case WeightFormat::mxfp4:
      return gemm<WeightFormat::mxfp4>(args);
    case WeightFormat::int4_zero_point:
      return gemm<WeightFormat::int4_zero_point>(args);
    default:
      return gemm<WeightFormat::int4_symmetric>(args);
  }
}

}  // namespace w4a8moe::detail::neoni8mm
