// Kernel set "avx2": `vpmaddubsw` + `vpmaddwd` (no VNNI), built from ymm_kernels.inc.
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "this file must be compiled with -mavx2 -mfma -mf16c"
#endif
#define W4A8MOE_YMM_VNNI 0
#include <immintrin.h>

#include <array>
#include <cassert>
#include <cstring>
#include <utility>

#include "kernels/common/activation_vec.hpp"
#include "kernels/common/prefetch.hpp"
#include "kernels/quant_params.hpp"
#include "kernels/x86_ymm/ymm_kernels.hpp"

namespace w4a8moe::detail::avx2 {
#include "kernels/x86_ymm/ymm_kernels.inc"
}  // namespace w4a8moe::detail::avx2
