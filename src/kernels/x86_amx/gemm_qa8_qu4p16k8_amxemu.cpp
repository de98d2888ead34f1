// Kernel set "amxemu": the AMX GEMM (gemm_amx.hpp) on the software model of the tiles, for
// testing the kernel on CPUs without AMX.
#include "cpu/compiled_isa.hpp"
#include "kernels/x86_amx/amx_kernels.hpp"
#include "kernels/x86_amx/gemm_amx.hpp"

static_assert(
    w4a8moe::detail::compiled_for("amxemu"),
    "compile this file with the amxemu cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail::amxemu {

void gemm_qa8_qu4p16k8(const GemmArgs& args) { amx_gemm<ModelTiles>(args); }
void thread_begin() { amx_configure<ModelTiles>(64); }
void thread_end() { amx_release<ModelTiles>(); }

}  // namespace w4a8moe::detail::amxemu
