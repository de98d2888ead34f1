// The neondot set's GEMM: `sdot` by element on layout qu4_p8k8, up to 4 activation rows
// (decode).
//
// qu4_p8k8: per 8 columns, 32 bytes: rows 0-3 then rows 4-7, 4 bytes a row; byte j holds column
// j (low nibble) and column 4 + j (high nibble), as w + 8. The low nibbles of 16 bytes are 4 rows
// x 4 columns: one `sdot v.4s, w.16b, a.4b[lane]` adds 4 products to each of 4 output rows, the
// lane picking the activations' 4 columns from one 16-byte load of 16 columns. Per 64 weights
// (8 rows x 8 columns): 2 loads (16 bytes), 4 unpack ops (and, ushr) shared by the rows, and 4
// `sdot` per activation row. The group's sum starts from the quantizer's term -8 * SUM q.
#include <arm_neon.h>

#include "cpu/compiled_isa.hpp"
#include "kernels/arm_neon/neon_common.hpp"
#include "kernels/arm_neondot/neondot_kernels.hpp"

static_assert(
    w4a8moe::detail::compiled_for("neondot"),
    "compile this file with the neondot cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail::neondot {

namespace {

// Columns k..k + 15 of a tile (tile_p8k8): 16 columns of each activation row in one register,
// each `sdot` picking 4 of them by lane.
struct Step {
  template <WeightFormat kFormat, int M, int NP>
  __attribute__((always_inline)) void operator()(const uint8_t* w, int64_t panel_bytes,
                                                 const int8_t* const (&q)[M], int64_t k,
                                                 const ZeroAdjust (&adjust)[NP],
                                                 int32x4_t (&sum)[M][NP][2]) const {
    const uint8x16_t low4 = vdupq_n_u8(0x0f);
    int8x16_t a[M];
    for (int m = 0; m < M; ++m) a[m] = vld1q_s8(q[m] + k);
    for (int p = 0; p < NP; ++p) {
      const uint8_t* wc = w + p * panel_bytes + k * 4;  // two chunks of 8 columns, 64 bytes
      int8x16_t lo[4], hi[4];
      unpack64<kFormat>(wc, low4, adjust[p], lo, hi);
      for (int m = 0; m < M; ++m) {
        int32x4_t* s = sum[m][p];
        s[0] = vdotq_laneq_s32(s[0], lo[0], a[m], 0);
        s[1] = vdotq_laneq_s32(s[1], lo[1], a[m], 0);
        s[0] = vdotq_laneq_s32(s[0], hi[0], a[m], 1);
        s[1] = vdotq_laneq_s32(s[1], hi[1], a[m], 1);
        s[0] = vdotq_laneq_s32(s[0], lo[2], a[m], 2);
        s[1] = vdotq_laneq_s32(s[1], lo[3], a[m], 2);
        s[0] = vdotq_laneq_s32(s[0], hi[2], a[m], 3);
        s[1] = vdotq_laneq_s32(s[1], hi[3], a[m], 3);
      }
    }
  }
};

}  // namespace

void gemm_qa8_qu4p8k8(const GemmArgs& args) {
  // 1 row: four panels per tile (more independent chains); more rows: two.
  gemm_p8k8<kTileM, 4, 2, 16, Step>(args);
}

}  // namespace w4a8moe::detail::neondot
