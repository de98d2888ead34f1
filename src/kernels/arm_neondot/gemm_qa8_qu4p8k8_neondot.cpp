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
#include "kernels/common/gemm_rows.hpp"

static_assert(
    w4a8moe::detail::compiled_for("neondot"),
    "compile this file with the neondot cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail::neondot {

namespace {

// M activation rows x NP panels of 8 output rows from padded row n0; kFormat: the weights'.
template <int M, int NP, WeightFormat kFormat>
void tile(const GemmArgs& args, int64_t n0) {
  const Geometry& g = *args.geometry;
  const auto panel_bytes = static_cast<int64_t>(g.panel_bytes);  // panel p's record at w + p * it
  const int64_t first_panel = n0 / kPanel;
  const uint8_t* w = g.panel_at(args.expert, first_panel);
  const uint8x16_t low4 = vdupq_n_u8(0x0f);

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
    for (int64_t k = b * g.group_len; k < (b + 1) * g.group_len; k += 16) {
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
    scale_group<M, NP>(g, args.expert, first_panel, b, sum, facc);
  }

  store_tile<M, NP>(args, n0, sum, facc);
}

}  // namespace

void gemm_qa8_qu4p8k8(const GemmArgs& args) {
  // 1 row: four panels per tile (more independent chains); more rows: two.
  gemm_panel_tiles<kTileM, kPanel, 4, 2>(
      args, []<int M, int NP, WeightFormat kFormat>(const GemmArgs& a, int64_t n0) {
        tile<M, NP, kFormat>(a, n0);
      });
}

}  // namespace w4a8moe::detail::neondot
