// Shared helpers of the library suites: seeded random cases of the MoE layer in both the
// library's views and the independent reference's plain form, and the comparisons with their
// tolerance formulas.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "reference/reference.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace moe_test {

using w4a8moe::DType;

// A small, fully specified generator (xoshiro256** seeded by splitmix64, with our own
// distributions), so the data of a seed does not depend on the standard library.
class Rng {
 public:
  explicit Rng(uint64_t seed);
  uint64_t next();
  double uniform();                         // [0, 1)
  double uniform(double lo, double hi);     // [lo, hi)
  double normal();                          // N(0, 1)
  int64_t integer(int64_t lo, int64_t hi);  // [lo, hi]

 private:
  uint64_t state_[4];
};

enum class Routing : uint8_t {
  random,       // K distinct experts per token, uniform
  repeated,     // drawn with replacement; token 0 names one expert in all its slots
  skewed,       // slot 0 of every token is expert E - 1 (all tokens on one expert)
  sparse,       // distinct experts from the first half only: the other half gets no tokens
  all_experts,  // K = E: a random permutation per token
};

enum class WeightValues : uint8_t {
  uniform,   // int4 uniform in [-8, 7]
  extremes,  // only -8 and 7
};

struct CaseSpec {
  int64_t tokens = 1, hidden = 256, inter = 128, experts = 4, top_k = 2;
  int group_size = -1;
  DType x_dtype = DType::f32;
  DType scale_dtype = DType::f32;
  DType topk_weights_dtype = DType::f32;
  DType bias_dtype = DType::f32;
  DType ids_dtype = DType::i32;
  w4a8moe::Activation activation = w4a8moe::Activation::silu;
  float alpha = 1.702f, limit = 7.0f;
  bool bias = false;
  bool apply_router_weight_on_input = false;
  bool interleaved = false;  // w13 given as gpt-oss interleaves it
  bool nibbles = false;      // weights given nibble-packed (uint8 [E, N, K/2])
  // MXFP4 weights (group_size must be 32): random e2m1 codes nibble-packed and e8m0 exponents
  // near the int4 cases' scale; the reference gets their meaning as integers 2 * e2m1 with
  // scales 2^(e - 128) (make_case)
  bool mxfp4 = false;
  // int4 with zero points: a random zero point in [-8, 7] per row and group beside the int4
  // values; the reference gets w - z (make_case)
  bool zero_points = false;
  // w13 packed with an input order (PackOptions::input_order): a random permutation of [0, H)
  // per expert, which the reference applies to x itself
  bool input_order = false;
  Routing routing = Routing::random;
  WeightValues weight_values = WeightValues::uniform;
  int64_t x_stride_extra = 0;  // x row stride = H + this (the padding holds NaN)
  uint64_t seed = 1;
};

// "T=64 H=512 I=256 E=8 K=2 g=128 x=bf16 ... seed=7": for SCOPED_TRACE and test names.
std::string describe(const CaseSpec& spec);

// A float tensor in one of the float dtypes: its bytes and the values they hold, as f32.
struct FloatTensor {
  DType dtype = DType::f32;
  std::vector<uint8_t> bytes;
  std::vector<float> values;
};
// Rounds `values` to `dtype` (nearest even, with the reference's conversions).
FloatTensor make_float_tensor(const std::vector<float>& values, DType dtype);
float to_float(const void* data, DType dtype, int64_t i);

struct Case {
  CaseSpec spec;
  moe_ref::Problem problem;  // the same numbers as the views below, as plain floats
  int64_t x_stride = 0;
  FloatTensor x;             // [T, x_stride]
  std::vector<uint8_t> ids;  // [T, K] int32 or int64
  FloatTensor topk_weights;
  std::vector<int8_t> w13, w2;                   // int4 values, w13 in the spec's row layout
  std::vector<uint8_t> w13_nibbles, w2_nibbles;  // mxfp4: the codes
  FloatTensor w13_scale, w2_scale, w13_bias, w2_bias;
  std::vector<uint8_t> w13_exponents, w2_exponents;   // mxfp4: the e8m0 scales
  std::vector<int8_t> w13_zero_point, w2_zero_point;  // zero points: shaped like the scales
  std::vector<int32_t> w13_input_order;               // [E, H] with spec.input_order

  w4a8moe::TensorView x_view() const;
  w4a8moe::TensorView ids_view() const;
  w4a8moe::TensorView topk_weights_view() const;
  w4a8moe::TensorView w13_view() const;  // int8 or nibbles, as the spec says
  w4a8moe::TensorView w2_view() const;
  w4a8moe::TensorView w13_scale_view() const;
  w4a8moe::TensorView w2_scale_view() const;
  w4a8moe::TensorView w13_zero_point_view() const;  // empty without zero points
  w4a8moe::TensorView w2_zero_point_view() const;
  w4a8moe::TensorView w13_bias_view() const;  // empty without bias
  w4a8moe::TensorView w2_bias_view() const;
  w4a8moe::PackOptions pack_options() const;
  w4a8moe::LogicalWeights logical() const;
  w4a8moe::MoeParams params() const;

  // Sets x[t, j] in both forms (rounded to the x dtype).
  void set_x(int64_t t, int64_t j, float value);
};

Case make_case(const CaseSpec& spec);

// Nibble-packs int4 rows (byte j: element 2j low, 2j + 1 high, each stored as value + 8).
std::vector<uint8_t> to_nibbles(const std::vector<int8_t>& values);

struct PackedPair {
  w4a8moe::PackedWeights w13, w2;
};
// Packs for `kernel_set` (empty: the set forward() picks now).
PackedPair pack(const Case& c, const std::string& kernel_set = "");

// An output tensor [T, H] of x's dtype, pre-filled with NaN so that unwritten elements show.
struct Output {
  DType dtype = DType::f32;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> bytes;
  w4a8moe::MutableTensorView view();
  std::vector<float> to_float() const;
};
Output make_output(const Case& c);
Output run_forward(const Case& c, const PackedPair& packed, w4a8moe::Context& context);
Output run_library_reference(const Case& c);
// The same with other weights than the case's (changed to be refused).
Output run_library_reference(const Case& c, const w4a8moe::LogicalWeights& weights);

// ---- comparisons ------------------------------------------------------------------------------
//
// Against the exact reference, per element (t, n) with R = max_n |ref[t, n]|:
//
//   |got - ref| <= (rtol * R + A[t, n]) * (1 + u) + u * |ref| + u_abs
//
//   rtol = kRtolPerSqrtK * sqrt(H + I): f32 rounding of the two dot products (the library sums in
//          f32 what the reference sums exactly or in double; the errors grow like sqrt(length)),
//          of the activation and of the output accumulation. kRtolPerSqrtK = 1e-6 is about 17 f32
//          ulps; the portable kernels measure below 0.5 ulp * sqrt(H + I);
//   u    = the output rounding: 2^-8 for bf16, 2^-11 for f16, 0 for f32 (already in rtol);
//          u_abs = 2^-25 for f16 (half a subnormal step);
//   A    = the reference's requantization allowance: the library computes the intermediate m in
//          f32, the reference in double, so an element of m * s within a hair of a rounding
//          boundary may round the other way, moving y[n] by one step recip_m * s2 * w2[n, j].
//          The reference lists those elements (|m*s| within kBoundaryMargin of a half-integer,
//          or a zero point likewise near) and A sums the steps they could make.
//
// The allowance must stay rare: at most kMaxNearFraction of the intermediate elements (+ a slack
// of kNearSlack for small calls) may be near a boundary, counting equal values with equal row
// scales once (they round together). Else the data, not the code, would be passing the test. With
// the margin of the reference (2e-3 on each side) about 0.4% are.
inline constexpr double kRtolPerSqrtK = 1e-6;  // measured worst: 2.5e-8 (40x margin)
inline constexpr double kMaxNearFraction = 0.01;
inline constexpr double kNearSlack = 8;

struct ExactCheck {
  bool check_magnitude = true;  // require max |ref| in [0.1, 100] (order-one outputs)
  double rtol_per_sqrt_k = kRtolPerSqrtK;
};

// Compares `got` [T, H] (already converted to f32) with the exact reference. Tokens whose input
// row is not finite are skipped.
testing::AssertionResult matches_exact(const Case& c, const std::vector<float>& got,
                                       const moe_ref::ExactResult& ref,
                                       const ExactCheck& check = {});

// Normalised RMS error sqrt(SUM (got - ref)^2 / SUM ref^2) <= max_nrmse.
testing::AssertionResult matches_float(const std::vector<float>& got,
                                       const std::vector<double>& ref, double max_nrmse,
                                       double* nrmse_out = nullptr);

// `out` [rows, cols] of a call whose input row `bad_row` held a non-finite value: that row all
// NaN, every other row finite (the value stays in its row).
void expect_non_finite_only_in_row(const std::vector<float>& out, int64_t cols, int64_t bad_row);

// Passes when `f` throws w4a8moe::Error whose message contains every fragment (the argument's
// name, the problem); fails when it returns, throws something else, or says something else.
testing::AssertionResult throws_error(const std::function<void()>& f,
                                      std::initializer_list<std::string_view> fragments);

// The names the input-checking suites use unqualified: `using namespace moe_test::suite_names;`.
namespace suite_names {
using moe_test::Case;
using moe_test::CaseSpec;
using moe_test::DType;
using moe_test::throws_error;
using w4a8moe::MutableTensorView;
using w4a8moe::TensorView;
}  // namespace suite_names

}  // namespace moe_test
