// Kernel set "amx": the AMX GEMM (gemm_amx.hpp) on the tile instructions.
#if !defined(__AMX_TILE__) || !defined(__AMX_INT8__)
#error "this file must be compiled with -mamx-tile -mamx-int8 (and the AVX-512 flags)"
#endif

#include "kernels/x86_amx/amx_kernels.hpp"
#include "kernels/x86_amx/gemm_amx.hpp"

namespace w4a8moe::detail::amx {

void gemm_qa8_qu4p16(const GemmArgs& args) { amx_gemm<AmxTiles>(args); }
void thread_begin() { amx_configure<AmxTiles>(64); }
void thread_end() { amx_release<AmxTiles>(); }

}  // namespace w4a8moe::detail::amx
