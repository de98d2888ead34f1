// The avx512vnni set's GEMM on MXFP4 weights for CPUs with AVX-512 VBMI (gemm_zmm_tile.hpp,
// Decode::mxfp4_permute): compiled with the set's flags and -mavx512vbmi, called only where the
// CPU has VBMI (gemm_qa8_qu4p16k8_avx512vnni.cpp).
#include "cpu/compiled_isa.hpp"
#include "kernels/x86_avx512vnni/gemm_zmm_tile.hpp"

static_assert(w4a8moe::detail::compiled_for("amxemu"),
              "compile this file with the avx512vnni cluster's flags and -mavx512vbmi (the "
              "amxemu cluster's; CMakeLists.txt)");

namespace w4a8moe::detail::avx512vnni {

void gemm_mxfp4_vbmi(const GemmArgs& args) { gemm_rows<true>(args); }

}  // namespace w4a8moe::detail::avx512vnni
