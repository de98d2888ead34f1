// Kernel set "amx": the AMX GEMM (gemm_amx.hpp) on the tile instructions, and the choice between
// it and the zmm GEMM by rows per call.
#include <algorithm>

#include "cpu/compiled_isa.hpp"
#include "kernels/x86_amx/amx_kernels.hpp"
#include "kernels/x86_amx/gemm_amx.hpp"

static_assert(w4a8moe::detail::compiled_for("amx"),
              "compile this file with the amx cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail {

int64_t amx_min_tile_rows(int64_t group_len, bool channelwise, bool only_tile) {
  if (only_tile) {  // the call's one tile: it unpacks every weight panel for its rows alone
    if (channelwise) return 5;
    if (group_len >= 128) return 7;
    if (group_len >= 64) return 8;
    return 13;  // g = 32
  }
  return channelwise || group_len >= 64 ? 3 : 7;
}

namespace amx {

void gemm_tiles(const GemmArgs& args) { amx_gemm<AmxTiles>(args); }

void gemm_qa8_qu4p16k8(const GemmArgs& args) {
  const Geometry& g = *args.geometry;
  int64_t tiles = args.m / 16;
  if (args.m % 16 >= amx_min_tile_rows(g.group_len, g.channelwise(), tiles == 0)) ++tiles;
  const int64_t on_tiles = std::min(args.m, tiles * 16);
  if (on_tiles == 0) {
    amx_zmm_gemm(args);
    return;
  }
  GemmArgs part = args;
  part.m = on_tiles;
  gemm_tiles(part);
  if (on_tiles == args.m) return;
  // the rows past the last full tile: fewer than a tile is worth
  part.m = args.m - on_tiles;
  part.a = args.a + on_tiles;
  part.c = args.c + on_tiles * args.c_stride;
  part.prefetch[0] = part.prefetch[1] = PrefetchRange{};
  amx_zmm_gemm(part);
}

void thread_begin() { amx_configure<AmxTiles>(64); }
void thread_end() { amx_release<AmxTiles>(); }

}  // namespace amx
}  // namespace w4a8moe::detail
