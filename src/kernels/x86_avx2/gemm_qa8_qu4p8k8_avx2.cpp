// The avx2 set's GEMM: gemm_qa8_qu4p8k8_ymm.hpp on `vpmaddubsw` + `vpmaddwd`.
#include "cpu/compiled_isa.hpp"
#include "kernels/x86_avx2/avx2_kernels.hpp"
#include "kernels/x86_ymm/gemm_qa8_qu4p8k8_ymm.hpp"

static_assert(w4a8moe::detail::compiled_for("avx2"),
              "compile this file with the avx2 cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail::avx2 {

void gemm_qa8_qu4p8k8(const GemmArgs& args) { gemm_qa8_qu4p8k8_ymm<false, kTileM>(args); }

}  // namespace w4a8moe::detail::avx2
