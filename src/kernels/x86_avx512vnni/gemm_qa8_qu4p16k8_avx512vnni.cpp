// Kernel set "avx512vnni": its GEMM (gemm_zmm_tile.hpp), MXFP4 weights on CPUs with AVX-512 VBMI
// through the variant compiled with it (gemm_qa8_qu4p16k8_avx512vnni_vbmi.cpp).
#include "cpu/compiled_isa.hpp"
#include "kernels/x86_avx512vnni/gemm_zmm_tile.hpp"
#include "w4a8moe/w4a8moe.hpp"

static_assert(
    w4a8moe::detail::compiled_for("avx512vnni"),
    "compile this file with the avx512vnni cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail::avx512vnni {

// Rows per call from which mxfp4 takes `vpermb` (CPUs with VBMI): measured on Zen 4, one row
// ran 13-15% slower with it than with the mask and `vpshufb` (a decode-bound tile of four
// panels), 512 tokens faster; both paths give the same bits (tested), so the choice by rows
// keeps every row's result independent of its call.
constexpr int64_t kPermuteFromRows = 4;

void gemm_qa8_qu4p16k8(const GemmArgs& args) {
  static const bool vbmi = cpu_features().avx512vbmi;
  if (vbmi && args.m >= kPermuteFromRows && args.geometry->weight_format == WeightFormat::mxfp4)
    return gemm_mxfp4_vbmi(args);
  gemm_rows<false>(args);
}

void gemm_mxfp4_shuffle(const GemmArgs& args) { gemm_rows<false>(args); }

}  // namespace w4a8moe::detail::avx512vnni
