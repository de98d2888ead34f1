// Helpers of the linear suites (test_linear.cpp: int4 and MXFP4 weights; test_linear_int8.cpp):
// one linear() call read back as f32, and the comparison with the exact reference.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "test_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace linear_test {

// linear() of x [T, K] by `packed` into an output [T, rows] of `out_dtype`, read back as f32.
inline std::vector<float> run_linear(w4a8moe::Context& context, const w4a8moe::TensorView& x,
                                     std::span<const uint8_t> packed, int64_t rows,
                                     w4a8moe::DType out_dtype) {
  const int64_t tokens = x.shape[0];
  std::vector<uint8_t> out(static_cast<size_t>(tokens * rows) * w4a8moe::dtype_bytes(out_dtype));
  w4a8moe::linear(context, x, packed,
                  w4a8moe::MutableTensorView::of(out.data(), out_dtype, {tokens, rows}));
  std::vector<float> got(static_cast<size_t>(tokens * rows));
  for (size_t i = 0; i < got.size(); ++i)
    got[i] = moe_test::to_float(out.data(), out_dtype, static_cast<int64_t>(i));
  return got;
}

// got [T, N] against the exact reference ref, element (t, n):
//   |got - ref| <= 1e-6 * sqrt(K) * max_n |ref[t, n]| + u * |ref| + allowance(t, n) + 2^-24
// with u the rounding of the output dtype (2^-8 bf16, 2^-11 f16, 0 f32). The largest finite |ref|
// must lie in [min_magnitude, 100]: outputs of order one.
inline testing::AssertionResult matches_reference(
    const std::vector<float>& got, const std::vector<double>& ref, int64_t tokens, int64_t rows,
    int64_t cols, w4a8moe::DType out_dtype, double min_magnitude,
    const std::function<double(int64_t t, int64_t n)>& allowance) {
  using w4a8moe::DType;
  const double u = out_dtype == DType::bf16 ? 0x1p-8 : out_dtype == DType::f16 ? 0x1p-11 : 0.0;
  const double rtol = 1e-6 * std::sqrt(static_cast<double>(cols));
  double max_abs = 0.0;
  for (const double r : ref) max_abs = std::max(max_abs, std::isfinite(r) ? std::fabs(r) : 0.0);
  if (!(max_abs >= min_magnitude && max_abs <= 100.0))
    return testing::AssertionFailure() << "max |ref| " << max_abs << ": not of order one";
  for (int64_t t = 0; t < tokens; ++t) {
    double row_max = 0.0;
    for (int64_t n = 0; n < rows; ++n)
      row_max = std::max(row_max, std::fabs(ref[static_cast<size_t>(t * rows + n)]));
    for (int64_t n = 0; n < rows; ++n) {
      const size_t i = static_cast<size_t>(t * rows + n);
      const double bound = rtol * row_max + u * std::fabs(ref[i]) + allowance(t, n) + 0x1p-24;
      if (!(std::fabs(static_cast<double>(got[i]) - ref[i]) <= bound))
        return testing::AssertionFailure()
               << "out[" << t << ", " << n << "] = " << got[i] << ", reference " << ref[i]
               << " (bound " << bound << ")";
    }
  }
  return testing::AssertionSuccess();
}

}  // namespace linear_test
