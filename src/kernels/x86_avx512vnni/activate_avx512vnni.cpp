// AVX-512 activation: the portable formulas with vectorisable exp/erf/tanh.

#include "cpu/compiled_isa.hpp"
#include "kernels/common/activation_vec.hpp"
#include "kernels/x86_avx512vnni/avx512vnni_kernels.hpp"

static_assert(
    w4a8moe::detail::compiled_for("avx512vnni"),
    "compile this file with the avx512vnni cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail::avx512vnni {

void activate(const MoeParams& params, const float* gate, const float* up, float* m, int64_t n) {
  activate_f32<VecMath>(params, gate, up, m, n);
}

}  // namespace w4a8moe::detail::avx512vnni
