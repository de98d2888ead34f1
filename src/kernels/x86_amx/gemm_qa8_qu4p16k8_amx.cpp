// Kernel set "amx": the AMX GEMM (gemm_amx.hpp) on the tile instructions, and the choice between
// it and the zmm GEMM by rows per call.
#include "cpu/compiled_isa.hpp"
#include "kernels/x86_amx/amx_kernels.hpp"
#include "kernels/x86_amx/gemm_amx.hpp"

static_assert(w4a8moe::detail::compiled_for("amx"),
              "compile this file with the amx cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail {

int64_t amx_min_rows(int64_t group_len, bool channelwise) {
  if (channelwise) return 12;
  if (group_len >= 64) return 13;
  return 26;  // g = 32
}

namespace amx {

void gemm_tiles(const GemmArgs& args) { amx_gemm<AmxTiles>(args); }

void gemm_qa8_qu4p16k8(const GemmArgs& args) {
  const Geometry& g = *args.geometry;
  if (args.m >= amx_min_rows(g.group_len, g.channelwise()))
    gemm_tiles(args);
  else
    amx_zmm_gemm(args);
}

void thread_begin() { amx_configure<AmxTiles>(64); }
void thread_end() { amx_release<AmxTiles>(); }

}  // namespace amx
}  // namespace w4a8moe::detail
