// The neon set's GEMM: baseline NEON (no dot product) on layout qu4_p8k8. Widening multiplies:
// `smlal`/`smlal2` multiply 8 offset nibbles (w + 8, 0..15) by 8 s8 activations into int16 lanes, 2
// products per lane per 8 columns; after a block of 32 columns (8 products, |sum| <= 8 * 15 * 128 =
// 15360 < 32767) the lanes are widened and pairwise added into int32 row sums.
//
// qu4_p8k8: per 8 columns, 32 bytes: rows 0-3 then rows 4-7, 4 bytes a row; byte j holds column
// j (low nibble) and column 4 + j (high nibble). The low nibbles of 16 bytes are 4 rows x 4
// columns; a 32-bit broadcast of the activations' 4 columns lines up with them.
#include <arm_neon.h>

#include "cpu/compiled_isa.hpp"
#include "kernels/arm_neon/neon_common.hpp"
#include "kernels/arm_neon/neon_kernels.hpp"
#include "kernels/common/load_unaligned.hpp"

static_assert(w4a8moe::detail::compiled_for("neon"),
              "compile this file with the neon cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail::neon {

namespace {

inline int8x16_t broadcast4(const int8_t* p) {
  return vreinterpretq_s8_s32(vdupq_n_s32(load_unaligned<int32_t>(p)));
}

// int16 lanes (row, column) of two rows -> int32 per row, for rows r..r+3 from two such vectors.
inline int32x4_t row_sums(int16x8_t rows01, int16x8_t rows23) {
  return vpaddq_s32(vpaddlq_s16(rows01), vpaddlq_s16(rows23));
}

// Columns k0..k0 + 31 of a tile (tile_p8k8): per 8 columns two products per int16 lane, then the
// lanes widened into the int32 sums.
struct Step {
  template <WeightFormat kFormat, int M, int NP>
  __attribute__((always_inline)) void operator()(const uint8_t* w, int64_t panel_bytes,
                                                 const int8_t* const (&q)[M], int64_t k0,
                                                 const ZeroAdjust (&adjust)[NP],
                                                 int32x4_t (&sum)[M][NP][2]) const {
    const uint8x16_t low4 = vdupq_n_u8(0x0f);
    int16x8_t acc[M][NP][4];  // rows 0-1, 2-3, 4-5, 6-7
    for (int m = 0; m < M; ++m)
      for (int p = 0; p < NP; ++p)
        for (int i = 0; i < 4; ++i) acc[m][p][i] = vdupq_n_s16(0);
    for (int c = 0; c < 4; ++c) {
      const int64_t k = k0 + 8 * c;
      int8x16_t lo0[NP], hi0[NP], lo1[NP], hi1[NP];
      for (int p = 0; p < NP; ++p) {
        const uint8_t* wc = w + p * panel_bytes + k * 4;
        const uint8x16_t r0 = vld1q_u8(wc), r1 = vld1q_u8(wc + 16);
        lo0[p] = weights_of<kFormat>(vandq_u8(r0, low4), adjust[p].reg[0]);
        hi0[p] = weights_of<kFormat>(vshrq_n_u8(r0, 4), adjust[p].reg[0]);
        lo1[p] = weights_of<kFormat>(vandq_u8(r1, low4), adjust[p].reg[1]);
        hi1[p] = weights_of<kFormat>(vshrq_n_u8(r1, 4), adjust[p].reg[1]);
      }
      for (int m = 0; m < M; ++m) {
        const int8x16_t al = broadcast4(q[m] + k), ah = broadcast4(q[m] + k + 4);
        const int8x8_t al8 = vget_low_s8(al), ah8 = vget_low_s8(ah);
        for (int p = 0; p < NP; ++p) {
          int16x8_t* a = acc[m][p];
          a[0] = vmlal_s8(vmlal_s8(a[0], vget_low_s8(lo0[p]), al8), vget_low_s8(hi0[p]), ah8);
          a[1] = vmlal_high_s8(vmlal_high_s8(a[1], lo0[p], al), hi0[p], ah);
          a[2] = vmlal_s8(vmlal_s8(a[2], vget_low_s8(lo1[p]), al8), vget_low_s8(hi1[p]), ah8);
          a[3] = vmlal_high_s8(vmlal_high_s8(a[3], lo1[p], al), hi1[p], ah);
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int p = 0; p < NP; ++p) {
        sum[m][p][0] = vaddq_s32(sum[m][p][0], row_sums(acc[m][p][0], acc[m][p][1]));
        sum[m][p][1] = vaddq_s32(sum[m][p][1], row_sums(acc[m][p][2], acc[m][p][3]));
      }
  }
};

}  // namespace

void gemm_qa8_qu4p8k8(const GemmArgs& args) {
  // 1 row: two panels per tile (more independent chains); more rows: one.
  gemm_p8k8<kTileM, 2, 1, 32, Step>(args);
}

}  // namespace w4a8moe::detail::neon
