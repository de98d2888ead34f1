// NEON activation (sets neon, neondot, neoni8mm): the portable formulas with vectorisable
// exp/erf/tanh.
#include "cpu/compiled_isa.hpp"
#include "kernels/arm_neon/neon_kernels.hpp"
#include "kernels/common/activation_vec.hpp"

static_assert(w4a8moe::detail::compiled_for("neon"),
              "compile this file with the neon cluster's flags (CMakeLists.txt, src/cpu/isa.hpp)");

namespace w4a8moe::detail::neon {

void activate(const MoeParams& params, const float* gate, const float* up, float* m, int64_t n) {
  activate_f32<VecMath>(params, gate, up, m, n);
}

}  // namespace w4a8moe::detail::neon
