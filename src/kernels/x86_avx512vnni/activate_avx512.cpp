// AVX-512 activation: the portable formulas with vectorisable exp/erf/tanh.
#if !defined(__AVX512F__)
#error "this file must be compiled with -mavx512f"
#endif

#include "kernels/common/activation_vec.hpp"
#include "kernels/x86_avx512vnni/avx512vnni_kernels.hpp"

namespace w4a8moe::detail::avx512vnni {

void activate(const MoeParams& params, const float* gate, const float* up, float* m, int64_t n) {
  activate_vec(params, gate, up, m, n);
}

}  // namespace w4a8moe::detail::avx512vnni
