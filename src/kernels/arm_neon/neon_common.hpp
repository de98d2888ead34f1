// Helpers of the Arm GEMM kernels: scale loading, the float epilogue (docs/operator.md,
// "Weights and the dot product") and the frame of the qu4_p8k8 tiles around their products.
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

#include "kernels/common/gemm_rows.hpp"
#include "kernels/kernel.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {
namespace {

// Rows per panel of the Arm layouts (qu4_p8k8, qu4_p8k16).
constexpr int64_t kPanel = 8;

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

// int4 with zero points: for one panel and scale group, the byte 15 - (z + 8) of each output
// row wherever the layout keeps that row's weights in the 16-byte registers of 64 weight bytes
// (register i, byte j: row kRows[i][j]). Added to the offset nibbles w + 8 it gives w - z + 15 in
// [0, 30], which the kernels multiply from group terms -15 * SUM q (kernels/layout.hpp,
// kZeroPointOffset): one `tbl` per register and group, one add per unpacked register.
struct ZeroAdjust {
  uint8x16_t reg[4];
};
// qu4_p8k8: per chunk of 32 bytes, rows 0-3 then rows 4-7, 4 bytes each.
alignas(16) constexpr uint8_t kRowsP8k8[4][16] = {{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},
                                                  {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7},
                                                  {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},
                                                  {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7}};
// qu4_p8k16: register i holds row pair (2i, 2i + 1), 8 bytes each.
alignas(16) constexpr uint8_t kRowsP8k16[4][16] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
    {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
    {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7}};

// The adjustment of group b of panel `panel` (kFormat other than int4_zero_point: unused zeros).
template <WeightFormat kFormat>
inline ZeroAdjust zero_adjust(const Geometry& g, const uint8_t* expert, int64_t panel, int64_t b,
                              const uint8_t (&rows)[4][16]) {
  ZeroAdjust a;
  if constexpr (kFormat == WeightFormat::int4_zero_point) {
    const uint8x8_t z = vld1_u8(g.panel_zeros(expert, panel) + b * 8);
    const uint8x16_t table = vcombine_u8(z, z);
    for (int i = 0; i < 4; ++i)
      a.reg[i] = vsubq_u8(vdupq_n_u8(kZeroPointOffset), vqtbl1q_u8(table, vld1q_u8(rows[i])));
  } else {
    for (int i = 0; i < 4; ++i) a.reg[i] = vdupq_n_u8(0);
  }
  return a;
}

// Nibbles (one per byte) as the s8 weights the kernels multiply: offset nibbles (int4: w + 8) as
// they are; with zero points plus their adjustment; mxfp4 codes through a `tbl` of 2 * e2m1 + 12
// (kernels/layout.hpp, kMxfp4Unsigned).
template <WeightFormat kFormat>
inline int8x16_t weights_of(uint8x16_t nibbles, uint8x16_t adjust) {
  if constexpr (kFormat == WeightFormat::mxfp4)
    return vreinterpretq_s8_u8(vqtbl1q_u8(vld1q_u8(kMxfp4Unsigned), nibbles));
  else if constexpr (kFormat == WeightFormat::int4_zero_point)
    return vreinterpretq_s8_u8(vaddq_u8(nibbles, adjust));
  else
    return vreinterpretq_s8_u8(nibbles);
}

// The 64 bytes of nibbles at wc as s8 weights: byte 16 * i + j's low nibble in lane j of lo[i],
// its high nibble in lane j of hi[i].
template <WeightFormat kFormat>
inline void unpack64(const uint8_t* wc, uint8x16_t low4, const ZeroAdjust& adjust,
                     int8x16_t (&lo)[4], int8x16_t (&hi)[4]) {
  for (int i = 0; i < 4; ++i) {
    const uint8x16_t r = vld1q_u8(wc + 16 * i);
    lo[i] = weights_of<kFormat>(vandq_u8(r, low4), adjust.reg[i]);
    hi[i] = weights_of<kFormat>(vshrq_n_u8(r, 4), adjust.reg[i]);
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
  return g.has_bias ? vld1q_f32(reinterpret_cast<const float*>(g.row_bias(expert, n)))
                    : vdupq_n_f32(0.0f);
}

// The sums of a tile of M rows x NP panels of kPanel output rows (two int32x4 halves each): all at
// zero before the first scale group.
template <int M, int NP>
inline void zero_sums(int32x4_t (&sum)[M][NP][2], float32x4_t (&facc)[M][NP][2]) {
  for (int m = 0; m < M; ++m)
    for (int p = 0; p < NP; ++p)
      for (int h = 0; h < 2; ++h) {
        facc[m][p][h] = vdupq_n_f32(0.0f);
        sum[m][p][h] = vdupq_n_s32(0);
      }
}

// Before scale group b: each row's int32 sums start at its group term.
template <int M, int NP>
inline void start_group(const GemmArgs& args, int64_t b, int32x4_t (&sum)[M][NP][2]) {
  for (int m = 0; m < M; ++m) {
    const int32x4_t term = vdupq_n_s32(args.a[m].group_terms[b]);
    for (int p = 0; p < NP; ++p) sum[m][p][0] = sum[m][p][1] = term;
  }
}

// Groupwise: after scale group b, facc += float(sum) * s for every row of a tile of M rows x NP
// panels of 8 output rows (two int32x4 halves each), panels from first_panel of the expert block
// at `expert`. Channelwise: no-op (the sums run on to the epilogue).
template <int M, int NP>
inline void scale_group(const Geometry& g, const uint8_t* expert, int64_t first_panel, int64_t b,
                        const int32x4_t (&sum)[M][NP][2], float32x4_t (&facc)[M][NP][2]) {
  if (g.group_size < 0) return;
  for (int p = 0; p < NP; ++p)
    for (int h = 0; h < 2; ++h) {
      const float32x4_t s =
          load_scales4(g.panel_scales(expert, first_panel + p), g.scale_dtype, b * kPanel + 4 * h);
      for (int m = 0; m < M; ++m)
        facc[m][p][h] = vfmaq_f32(facc[m][p][h], vcvtq_f32_s32(sum[m][p][h]), s);
    }
}

// The epilogue of such a tile from padded row n0: each row's results into args.c.
template <int M, int NP>
inline void store_tile(const GemmArgs& args, int64_t n0, const int32x4_t (&sum)[M][NP][2],
                       const float32x4_t (&facc)[M][NP][2]) {
  const Geometry& g = *args.geometry;
  const int64_t first_panel = n0 / kPanel;
  for (int p = 0; p < NP; ++p)
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n0 + p * kPanel + 4 * h;
      const uint8_t* corr = g.row_correction(args.expert, n);
      const float32x4_t bias = load_bias4(g, args.expert, n);
      float* out = args.c + (n - args.n_begin);
      if (g.group_size < 0) {
        const int32x4_t wsum = vld1q_s32(reinterpret_cast<const int32_t*>(corr));
        const float32x4_t s =
            load_scales4(g.panel_scales(args.expert, first_panel + p), g.scale_dtype, 4 * h);
        for (int m = 0; m < M; ++m)
          vst1q_f32(out + m * args.c_stride,
                    finish_channelwise(sum[m][p][h], vdupq_n_s32(args.a[m].zp),
                                       vdupq_n_f32(args.a[m].recip), wsum, s, bias));
      } else {
        const float32x4_t zsum = vld1q_f32(reinterpret_cast<const float*>(corr));
        for (int m = 0; m < M; ++m)
          vst1q_f32(out + m * args.c_stride,
                    finish_groupwise(facc[m][p][h], vdupq_n_f32(static_cast<float>(args.a[m].zp)),
                                     vdupq_n_f32(args.a[m].recip), zsum, bias));
      }
    }
}

// A tile of M activation rows x NP panels of kPanel output rows on layout qu4_p8k8 from padded
// row n0, around its products: per scale group the sums start at the rows' group terms,
// Step{}.template operator()<kFormat>(w, panel_bytes, q, k, adjust, sum) adds those of columns
// k..k + kStep - 1 (panel p's record at w + p * panel_bytes, activation row m at q[m], adjust:
// each panel's ZeroAdjust), then the group is scaled; the epilogue follows the last group. The
// step's operator() is always_inline, so that the loop holds its code and no call.
template <int M, int NP, WeightFormat kFormat, int kStep, class Step>
void tile_p8k8(const GemmArgs& args, int64_t n0) {
  const Geometry& g = *args.geometry;
  const int64_t first_panel = n0 / kPanel;
  const uint8_t* w = g.panel_at(args.expert, first_panel);
  const auto panel_bytes = static_cast<int64_t>(g.panel_bytes);
  const int8_t* q[M];
  for (int m = 0; m < M; ++m) q[m] = static_cast<const int8_t*>(args.a[m].data);
  float32x4_t facc[M][NP][2];
  int32x4_t sum[M][NP][2];  // rows 0-3 and 4-7 of each panel
  zero_sums<M, NP>(sum, facc);

  for (int64_t b = 0; b < g.groups; ++b) {
    start_group<M, NP>(args, b, sum);
    ZeroAdjust adjust[NP];
    for (int p = 0; p < NP; ++p)
      adjust[p] = zero_adjust<kFormat>(g, args.expert, first_panel + p, b, kRowsP8k8);
    for (int64_t k = b * g.group_len; k < (b + 1) * g.group_len; k += kStep)
      Step{}.template operator()<kFormat>(w, panel_bytes, q, k, adjust, sum);
    scale_group<M, NP>(g, args.expert, first_panel, b, sum, facc);
  }

  store_tile<M, NP>(args, n0, sum, facc);
}

// The GEMM of a set on layout qu4_p8k8 whose tiles are tile_p8k8's around Step, for calls of
// m = 1..kTileM rows: kPanelsOneRow panels per tile for one row, kPanels for more.
template <int kTileM, int kPanelsOneRow, int kPanels, int kStep, class Step>
inline void gemm_p8k8(const GemmArgs& args) {
  gemm_panel_tiles<kTileM, kPanel, kPanelsOneRow, kPanels>(
      args, []<int M, int NP, WeightFormat kFormat>(const GemmArgs& a, int64_t n0) {
        tile_p8k8<M, NP, kFormat, kStep, Step>(a, n0);
      });
}

}  // namespace
}  // namespace w4a8moe::detail
