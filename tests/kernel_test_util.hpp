// Helpers of the kernel suites (test_kernels.cpp, test_kernel_mxfp4.cpp, test_kernel_amx.cpp):
// quantized rows as the driver lays them out, one GEMM call, random rows and weights, the
// double-precision value of the GEMM formula, the checks against it and against exact integer
// sums, and MXFP4 and zero-point weights packed for a set. The definitions: kernel_test_util.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernel_set_test.hpp"
#include "kernels/kernel.hpp"
#include "pack/packed_format.hpp"
#include "registry.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::kernel_tests {

// The GEMM suite, one instantiation per kernel set (test_kernels.cpp, which holds the int4 tests;
// the MXFP4 ones: test_kernel_mxfp4.cpp).
class KernelGemm : public KernelSetTest {};

// A quantized row as the driver lays it out: cols_padded bytes, then the group terms.
struct QRowBuffer {
  std::vector<int32_t> storage;
  detail::QuantRow row;
};

QRowBuffer quantize(const detail::KernelSet& set, const std::vector<float>& a, int64_t cols_padded,
                    int64_t group_len, int32_t group_term_offset = 8);

// The arguments of one GEMM call: rows a[0..m) against padded output rows [n0, n1) of the
// packed expert, into out[i * stride + (n - n0)].
detail::GemmArgs gemm_args(const PackedWeights& packed, const detail::Geometry& g,
                           const detail::QuantRow* a, int64_t m, int64_t n0, int64_t n1, float* out,
                           int64_t stride);

// One GEMM call of `set` (the set's GEMM for m rows).
void gemm(const detail::KernelSet& set, const PackedWeights& packed, const detail::Geometry& g,
          const detail::QuantRow* a, int64_t m, int64_t n0, int64_t n1, float* out, int64_t stride);

// A row of n: normal (kind 0), all positive (1), all negative (2), all zero (3), constant (4),
// or normal with one huge outlier (5).
std::vector<float> random_row(std::mt19937& rng, int64_t n, int kind);

// One expert's weights for a GEMM test: int4 values [rows, cols], -8 at the multiples of `at_min`
// and 7 at the other multiples of `at_max`; scales [rows, groups] in [0.5, 1.5) / cols; biases
// [rows] in [-0.5, 0.5).
struct GemmWeights {
  int64_t groups;
  std::vector<int8_t> w;
  std::vector<float> s, bias;
};
GemmWeights random_gemm_weights(std::mt19937& rng, int64_t rows, int64_t cols, int group,
                                size_t at_min, size_t at_max);

struct GemmCase {
  int64_t rows, cols;
  int group;
  bool w13;
};
// "avx2 rows 9 cols 64 group 32 w2": a case of `set`, for SCOPED_TRACE.
std::string describe(const detail::KernelSet& set, const GemmCase& c);

// Double-precision value of the GEMM contract for one output row from the logical weights.
double expected(const std::vector<int8_t>& w, const std::vector<float>& s, int64_t cols,
                int64_t groups, int64_t n, const detail::QuantRow& a, int64_t group_len,
                double bias);

// Integer accumulators compared exactly: with unit scales, recip 1 and no bias, every kernel's
// f32 output is an integer-valued sum that float represents exactly (|sum| < 2^24), so each set
// must give SUM_k (q[k] - zp) * w[n,k] to the last bit, at the extremes of both operands (q at
// -128 and 127 with zero points 0, -128 and 127; weights at -8 and 7), around tile and panel
// edges, up to K = 8192 (255 * 8 * 8192 < 2^24: the largest K at which the test can be exact).
// Rows made by hand in the quantizers' format (int8 q at the extremes 127 and -128, alternating,
// or random; zero points 0, -128 and 127; then -offset * SUM q per group for the weights'
// offset), against `rows` outputs of `packed` whose integer weights are `w` [rows, cols] and
// scales 1: the GEMM must give the exact integer sums, in calls of 1 and of tile_m rows.
void expect_exact_sums(const detail::KernelSet& set, const PackedWeights& packed,
                       const detail::Geometry& g, int64_t rows, const std::vector<int8_t>& w,
                       int64_t cols, std::mt19937& rng);

// Every block of every part of `packed` (whole, in one call each) against the formula over its
// integer weights w [rows, cols] and scales s [rows, groups], in calls of 1 to tile_m rows;
// max_w bounds |w| (and so the f32 rounding of the group sums).
void expect_formula(const detail::KernelSet& set, const PackedWeights& packed, int64_t cols,
                    const std::vector<int8_t>& w, const std::vector<float>& s,
                    const std::vector<float>& bias, double max_w, std::mt19937& rng);

// One expert's MXFP4 weights for a GEMM test: e2m1 codes nibble-packed [rows, cols / 2] (element
// 2j low), e8m0 exponents [rows, cols / 32]; and what they mean, written here from the OCP
// definition: 2 * e2m1 as integers [rows, cols] and the scales 2^(e - 128) [rows, groups].
struct Mxfp4Weights {
  std::vector<uint8_t> codes, exponents;
  std::vector<int8_t> doubled;
  std::vector<float> s;
};
int e2m1_doubled(int code);
Mxfp4Weights mxfp4_weights(int64_t rows, int64_t cols, const std::function<int(int64_t)>& code,
                           const std::function<int(int64_t)>& exponent);
PackedWeights pack_mxfp4(const Mxfp4Weights& m, int64_t rows, int64_t cols,
                         const detail::KernelSet& set, bool w13,
                         const std::vector<float>* bias = nullptr);

// int4 with zero points for a GEMM test: values w and zero points z (per row and group, or per
// row) in [-8, 7], and what the kernels multiply, w - z [rows, cols].
struct ZeroPointWeights {
  std::vector<int8_t> w, z, diff;
  int64_t groups = 0;
};
ZeroPointWeights zero_point_weights(int64_t rows, int64_t cols, int group,
                                    const std::function<int(int64_t)>& value,
                                    const std::function<int(int64_t)>& zero);
PackedWeights pack_zero_point(const ZeroPointWeights& zw, const std::vector<float>& s, int64_t rows,
                              int64_t cols, int group, const detail::KernelSet& set, bool w13,
                              const std::vector<float>* bias = nullptr);

}  // namespace w4a8moe::kernel_tests
