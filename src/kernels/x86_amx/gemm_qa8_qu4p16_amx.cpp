// Kernel set "amx": the AMX GEMM (gemm_amx.hpp) on the tile instructions, and the choice between
// it and the zmm GEMM by rows per call.
#if !defined(__AMX_TILE__) || !defined(__AMX_INT8__)
#error "this file must be compiled with -mamx-tile -mamx-int8 (and the AVX-512 flags)"
#endif

#include <algorithm>

#include "kernels/x86_amx/amx_kernels.hpp"
#include "kernels/x86_amx/gemm_amx.hpp"
#include "kernels/x86_avx512vnni/avx512vnni_kernels.hpp"

namespace w4a8moe::detail {

int64_t amx_min_rows(int64_t group_len, bool channelwise) {
  if (channelwise) return 12;
  if (group_len >= 256) return 20;
  if (group_len >= 128) return 24;
  if (group_len >= 64) return 32;
  return kAmxTileM + 1;  // g = 32: the zmm GEMM is as fast or faster at every size
}

namespace amx {

void gemm_tiles(const GemmArgs& args) { amx_gemm<AmxTiles>(args); }

void gemm_qa8_qu4p16(const GemmArgs& args) {
  const Geometry& g = *args.geometry;
  if (args.m >= amx_min_rows(g.group_len, g.channelwise())) return gemm_tiles(args);
  // the zmm GEMM in calls of nearly equal size, at most its tile of 16 rows
  const int64_t calls = (args.m + avx512vnni::kTileM - 1) / avx512vnni::kTileM;
  GemmArgs part = args;
  for (int64_t i = 0, r0 = 0; i < calls; ++i) {
    const int64_t rows = args.m / calls + (i < args.m % calls ? 1 : 0);
    part.m = rows;
    part.a = args.a + r0;
    part.c = args.c + r0 * args.c_stride;
    if (i > 0) part.prefetch[0] = part.prefetch[1] = PrefetchRange{};
    avx512vnni::gemm_qa8_qu4p16(part);
    r0 += rows;
  }
}

void thread_begin() { amx_configure<AmxTiles>(64); }
void thread_end() { amx_release<AmxTiles>(); }

}  // namespace amx
}  // namespace w4a8moe::detail
