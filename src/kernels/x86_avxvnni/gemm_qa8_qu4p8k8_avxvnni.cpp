// The avxvnni set's GEMM: gemm_qa8_qu4p8k8_ymm.hpp on ymm `vpdpbusd` (VEX encoding).
#include "cpu/compiled_isa.hpp"
#include "kernels/x86_avxvnni/avxvnni_kernels.hpp"
#include "kernels/x86_ymm/gemm_qa8_qu4p8k8_ymm.hpp"

static_assert(
    w4a8moe::detail::compiled_for("avxvnni"),
    "compile this file with the avxvnni cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail::avxvnni {

void gemm_qa8_qu4p8k8(const GemmArgs& args) { gemm_qa8_qu4p8k8_ymm<true, kTileM>(args); }

}  // namespace w4a8moe::detail::avxvnni
