// The avxvnniemu set's GEMM: the avxvnni GEMM (gemm_qa8_qu4p8k8_ymm.hpp with kVnni) compiled with
// AVX2 only, so that its `vpdpbusd` is the exact AVX2 model (vpdpbusd_ymm.hpp).
#include "cpu/compiled_isa.hpp"
#include "kernels/x86_avxvnni/avxvnni_kernels.hpp"
#include "kernels/x86_ymm/gemm_qa8_qu4p8k8_ymm.hpp"

static_assert(
    w4a8moe::detail::compiled_for("avxvnniemu"),
    "compile this file with the avxvnniemu cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail::avxvnniemu {

void gemm_qa8_qu4p8k8(const GemmArgs& args) { gemm_qa8_qu4p8k8_ymm<true, avxvnni::kTileM>(args); }

}  // namespace w4a8moe::detail::avxvnniemu
