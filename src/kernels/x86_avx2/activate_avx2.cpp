// AVX2 activation (sets avx2 and avxvnni): the portable formulas with vectorisable exp/erf/tanh.
#include "cpu/compiled_isa.hpp"
#include "kernels/common/activation_vec.hpp"
#include "kernels/x86_avx2/avx2_kernels.hpp"

static_assert(w4a8moe::detail::compiled_for("avx2"),
              "compile this file with the avx2 cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail::avx2 {

void activate(const MoeParams& params, const float* gate, const float* up, float* m, int64_t n) {
  activate_f32<VecMath>(params, gate, up, m, n);
}

}  // namespace w4a8moe::detail::avx2
