// Portable activation quantizer: f32 row -> int8 q with per-row recip and zero point.
#include <cmath>

#include "kernels/quant_params.hpp"
#include "kernels/ref/ref_kernels.hpp"

namespace w4a8moe::detail::ref {

void quantize_qa8(const QuantizeArgs& args) {
  const float* a = args.src;
  float mn = 0.0f, mx = 0.0f;
  bool finite = true;
  for (int64_t k = 0; k < args.cols; ++k) {
    const float v = a[k];
    finite &= std::isfinite(v);
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
  }
  const RowQuantParams p = row_quant_params(mn, mx, finite);
  auto* q = static_cast<int8_t*>(args.dst);
  if (p.finite) {
    for (int64_t k = 0; k < args.cols; ++k)
      q[k] = static_cast<int8_t>(quantize_value(a[k], p.scale, p.zp));
  } else {
    for (int64_t k = 0; k < args.cols; ++k) q[k] = static_cast<int8_t>(p.zp);
  }
  for (int64_t k = args.cols; k < args.cols_padded; ++k) q[k] = static_cast<int8_t>(p.zp);
  publish_row(args, q, p, nullptr);
}

}  // namespace w4a8moe::detail::ref
