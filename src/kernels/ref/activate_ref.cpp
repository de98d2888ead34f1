// Portable activation: the libm functions of docs/operator.md, "Activations", in f32.
#include "common/activation.hpp"
#include "kernels/ref/ref_kernels.hpp"

namespace w4a8moe::detail::ref {

void activate(const MoeParams& params, const float* gate, const float* up, float* m, int64_t n) {
  activate_f32<LibmMath>(params, gate, up, m, n);
}

}  // namespace w4a8moe::detail::ref
