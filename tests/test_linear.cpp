// linear() against the independent exact reference (moe_ref::exact_linear) on a grid of shapes,
// weight formats and dtypes; bit-identical results for any thread count; NaN rows kept to their
// row; the checks of pack_linear() and linear(); and a negative test that shows the comparison
// can fail. Run once per kernel set (the ISA cap of the library suites).
//
// Tolerance: |got - ref| <= 1e-6 * sqrt(K) * max_n |ref[t, n]| (f32 sums of K terms; the forward
// suites measured 2.5e-8) plus the rounding of out to bf16 / f16 (half an ulp of |ref|).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "linear_test_util.hpp"
#include "reference/reference.hpp"
#include "test_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace {

using moe_test::DType;
using w4a8moe::WeightFormat;

struct LinearSpec {
  std::string name;
  int64_t tokens, rows, cols;
  int group;  // -1: channel-wise
  WeightFormat format = WeightFormat::int4_symmetric;
  DType dtype = DType::f32;
  bool bias = false, nibbles = false, f32_out = false;
};

// The weights as the packer takes them and as the reference reads them.
struct LinearCase {
  LinearSpec spec;
  moe_test::FloatTensor x;         // [T, K]
  std::vector<int8_t> w;           // int4 values, [N, K] (mxfp4: unused)
  std::vector<uint8_t> codes;      // nibble-packed int4 or e2m1 codes [N, K/2]
  std::vector<float> scale;        // as given: [N, G] (mxfp4: e8m0 exponents, in `exponents`)
  std::vector<uint8_t> exponents;  // mxfp4
  std::vector<int8_t> zero_point;  // int4_zero_point, [N, G]
  moe_test::FloatTensor bias;      // [N] f32
  std::vector<int8_t> ref_w;       // the reference's integer weights [N, K]
  std::vector<float> ref_scale;    // [N, G]
};

// Doubled e2m1 values of the 16 codes (sign in bit 3): 2 * {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
constexpr int8_t kE2m1Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

LinearCase make_linear_case(const LinearSpec& spec) {
  LinearCase c;
  c.spec = spec;
  std::mt19937 gen(static_cast<uint32_t>(spec.rows * 131 + spec.cols * 7 + spec.tokens));
  const int64_t T = spec.tokens, N = spec.rows, K = spec.cols;
  const int64_t g = spec.group < 0 ? K : spec.group, G = K / g;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T * K));
  for (float& v : x) v = normal(gen);
  c.x = moe_test::make_float_tensor(x, spec.dtype);
  c.ref_w.resize(static_cast<size_t>(N * K));
  c.ref_scale.resize(static_cast<size_t>(N * G));
  std::uniform_int_distribution<int> nibble(0, 15), z(-3, 3);
  std::uniform_real_distribution<float> spread(0.75f, 1.25f);
  if (spec.format == WeightFormat::mxfp4) {
    c.codes.assign(static_cast<size_t>(N * K / 2), 0);
    c.exponents.resize(static_cast<size_t>(N * G));
    for (int64_t i = 0; i < N * K; ++i) {
      const int code = nibble(gen);
      c.codes[static_cast<size_t>(i / 2)] |= static_cast<uint8_t>(code << (4 * (i % 2)));
      c.ref_w[static_cast<size_t>(i)] = kE2m1Doubled[code];
    }
    // 2^(e - 127) per 32 inputs, halved for the doubled values: 2^(e - 128); rows of ~1/sqrt(K)
    const int e0 = 127 - 2 - static_cast<int>(std::lround(std::log2(std::sqrt(double(K)))));
    std::uniform_int_distribution<int> e(e0 - 1, e0 + 1);
    for (size_t i = 0; i < c.exponents.size(); ++i) {
      c.exponents[i] = static_cast<uint8_t>(e(gen));
      c.ref_scale[i] = std::ldexp(1.0f, int{c.exponents[i]} - 128);
    }
  } else {
    c.w.resize(static_cast<size_t>(N * K));
    for (int8_t& v : c.w) v = static_cast<int8_t>(nibble(gen) - 8);
    c.codes = moe_test::to_nibbles(c.w);
    c.scale.resize(static_cast<size_t>(N * G));
    for (float& s : c.scale) s = spread(gen) * 2.0f / (7.0f * std::sqrt(static_cast<float>(K)));
    c.scale = moe_test::make_float_tensor(c.scale, spec.dtype).values;  // as the dtype holds it
    if (spec.format == WeightFormat::int4_zero_point) {
      c.zero_point.resize(static_cast<size_t>(N * G));
      for (int8_t& v : c.zero_point) v = static_cast<int8_t>(z(gen));
    }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const size_t i = static_cast<size_t>(n * K + k);
        const int zp = c.zero_point.empty() ? 0 : c.zero_point[static_cast<size_t>(n * G + k / g)];
        c.ref_w[i] = static_cast<int8_t>(c.w[i] - zp);
      }
    c.ref_scale = c.scale;
  }
  std::vector<float> bias(static_cast<size_t>(N));
  for (float& b : bias) b = spec.bias ? 0.1f * normal(gen) : 0.0f;
  c.bias = moe_test::make_float_tensor(bias, DType::f32);
  return c;
}

w4a8moe::PackedWeights pack_case(const LinearCase& c) {
  const LinearSpec& s = c.spec;
  const int64_t G = s.group < 0 ? 1 : s.cols / s.group;
  w4a8moe::PackOptions opt;
  opt.group_size = s.format == WeightFormat::mxfp4 ? 32 : s.group;
  opt.weight_format = s.format;
  using w4a8moe::TensorView;
  const bool packed_codes = s.format == WeightFormat::mxfp4 || s.nibbles;
  const TensorView w = packed_codes
                           ? TensorView::of(c.codes.data(), DType::u8, {s.rows, s.cols / 2})
                           : TensorView::of(c.w.data(), DType::i8, {s.rows, s.cols});
  moe_test::FloatTensor scale_t;
  TensorView scale;
  if (s.format == WeightFormat::mxfp4) {
    scale = TensorView::of(c.exponents.data(), DType::u8, {s.rows, G});
  } else {
    scale_t = moe_test::make_float_tensor(c.scale, s.dtype);
    scale = s.group < 0 ? TensorView::of(scale_t.bytes.data(), s.dtype, {s.rows})
                        : TensorView::of(scale_t.bytes.data(), s.dtype, {s.rows, G});
  }
  const TensorView zp =
      c.zero_point.empty()
          ? TensorView{}
          : (s.group < 0 ? TensorView::of(c.zero_point.data(), DType::i8, {s.rows})
                         : TensorView::of(c.zero_point.data(), DType::i8, {s.rows, G}));
  const TensorView bias =
      s.bias ? TensorView::of(c.bias.bytes.data(), DType::f32, {s.rows}) : TensorView{};
  return w4a8moe::pack_linear(w, scale, zp, bias, opt);
}

std::vector<float> run_linear(const LinearCase& c, const w4a8moe::PackedWeights& packed,
                              w4a8moe::Context& context) {
  const LinearSpec& s = c.spec;
  return linear_test::run_linear(
      context, w4a8moe::TensorView::of(c.x.bytes.data(), s.dtype, {s.tokens, s.cols}),
      packed.bytes(), s.rows, s.f32_out ? DType::f32 : s.dtype);
}

std::vector<double> reference(const LinearCase& c) {
  const LinearSpec& s = c.spec;
  return moe_ref::exact_linear(
      c.x.values, s.tokens, s.cols, c.ref_w, c.ref_scale, s.rows,
      s.format == WeightFormat::mxfp4 ? 32 : s.group,
      s.bias ? std::span<const float>(c.bias.values) : std::span<const float>());
}

testing::AssertionResult matches(const LinearCase& c, const std::vector<float>& got,
                                 const std::vector<double>& ref) {
  const LinearSpec& s = c.spec;
  return linear_test::matches_reference(got, ref, s.tokens, s.rows, s.cols,
                                        s.f32_out ? DType::f32 : s.dtype, 0.1,
                                        [](int64_t, int64_t) { return 0.0; });
}

w4a8moe::Context& shared_context() {
  static w4a8moe::Context context;
  return context;
}

std::vector<LinearSpec> grid() {
  using enum WeightFormat;
  return {
      {"decode_g32", 1, 256, 512, 32},
      {"g128_zero_points_bf16_bias", 37, 320, 256, 128, int4_zero_point, DType::bf16, true},
      {"channelwise_f16_f32_out", 130, 192, 2048, -1, int4_symmetric, DType::f16, false, false,
       true},
      {"mxfp4_bf16_bias", 5, 96, 96, 32, mxfp4, DType::bf16, true},
      {"g64_zero_points_nibbles", 17, 64, 4096, 64, int4_zero_point, DType::f32, false, true},
      {"channelwise_zero_points_rows_not_multiple_of_16", 9, 200, 384, -1, int4_zero_point},
      {"qkv_shape_prefill", 300, 1280, 1024, 128, int4_symmetric, DType::bf16},
  };
}

class LinearGrid : public testing::TestWithParam<LinearSpec> {};

TEST_P(LinearGrid, MatchesExactReference) {
  const LinearCase c = make_linear_case(GetParam());
  const w4a8moe::PackedWeights packed = pack_case(c);
  const w4a8moe::PackedInfo info = packed.info();
  EXPECT_EQ(info.role, w4a8moe::WeightRole::w2);
  EXPECT_EQ(info.experts, 1);
  EXPECT_TRUE(matches(c, run_linear(c, packed, shared_context()), reference(c)));
}

INSTANTIATE_TEST_SUITE_P(Linear, LinearGrid, testing::ValuesIn(grid()),
                         [](const testing::TestParamInfo<LinearSpec>& i) { return i.param.name; });

TEST(Linear, BitIdenticalForAnyThreadCount) {
  const LinearCase c =
      make_linear_case({"threads", 67, 448, 512, 64, WeightFormat::int4_zero_point});
  const w4a8moe::PackedWeights packed = pack_case(c);
  w4a8moe::Context one(1), three(3);
  const std::vector<float> a = run_linear(c, packed, one), b = run_linear(c, packed, three);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

TEST(Linear, ComparisonRejectsAWrongScale) {
  LinearCase c = make_linear_case({"wrong", 4, 128, 256, 32});
  const w4a8moe::PackedWeights packed = pack_case(c);
  const std::vector<float> got = run_linear(c, packed, shared_context());
  c.ref_scale[5] *= 1.1f;  // one group of one row 10% off
  EXPECT_FALSE(matches(c, got, reference(c)));
}

TEST(Linear, NonFiniteRowStaysInItsRow) {
  LinearCase c = make_linear_case({"nan", 3, 64, 128, 32});
  const w4a8moe::PackedWeights packed = pack_case(c);
  c.x.values[128 + 7] = std::numeric_limits<float>::quiet_NaN();
  c.x = moe_test::make_float_tensor(c.x.values, DType::f32);
  const std::vector<float> got = run_linear(c, packed, shared_context());
  moe_test::expect_non_finite_only_in_row(got, 64, 1);
}

class LinearInput : public testing::Test {
 protected:
  LinearInput() : c_(make_linear_case({"input", 4, 128, 256, 32})), packed_(pack_case(c_)) {}
  w4a8moe::TensorView x() const {
    return w4a8moe::TensorView::of(c_.x.bytes.data(), DType::f32, {4, 256});
  }
  LinearCase c_;
  w4a8moe::PackedWeights packed_;
  std::vector<float> out_ = std::vector<float>(4 * 128);
};

TEST_F(LinearInput, ChecksEachArgument) {
  using moe_test::throws_error;
  using w4a8moe::MutableTensorView;
  using w4a8moe::TensorView;
  auto run = [&](const TensorView& x, std::span<const uint8_t> w, const MutableTensorView& out) {
    return [&, x, w, out] { w4a8moe::linear(shared_context(), x, w, out); };
  };
  const MutableTensorView out = MutableTensorView::of(out_.data(), DType::f32, {4, 128});
  EXPECT_TRUE(throws_error(
      run(TensorView::of(c_.x.bytes.data(), DType::f32, {4, 128}), packed_.bytes(), out),
      {"x: expected shape [T, 256]", "[4, 128]"}));
  EXPECT_TRUE(throws_error(
      run(x(), packed_.bytes(), MutableTensorView::of(out_.data(), DType::f32, {4, 64})),
      {"out: expected shape [4, 128]"}));
  EXPECT_TRUE(throws_error(
      run(x(), packed_.bytes(), MutableTensorView::of(out_.data(), DType::f16, {4, 128})),
      {"out: expected dtype f32", "got f16"}));
  EXPECT_TRUE(throws_error(
      run(x(), packed_.bytes(),
          MutableTensorView::of(const_cast<uint8_t*>(c_.x.bytes.data()), DType::f32, {4, 128})),
      {"out:", "overlap x"}));
  // an MoE layer's w13 is not a linear layer's weights
  const moe_test::Case moe = moe_test::make_case({.tokens = 1, .group_size = 32, .seed = 3});
  const moe_test::PackedPair pair = moe_test::pack(moe);
  EXPECT_TRUE(throws_error(run(x(), pair.w13.bytes(), out),
                           {"w_packed: expected a linear layer's weights", "role w13"}));
  std::vector<uint8_t> cut(packed_.bytes().begin(), packed_.bytes().begin() + 100);
  EXPECT_TRUE(throws_error(run(x(), cut, out), {"w_packed"}));
}

TEST_F(LinearInput, PackChecksEachArgument) {
  using moe_test::throws_error;
  using w4a8moe::TensorView;
  w4a8moe::PackOptions opt;
  opt.group_size = 32;
  const moe_test::FloatTensor scale = moe_test::make_float_tensor(c_.scale, DType::f32);
  const TensorView s = TensorView::of(scale.bytes.data(), DType::f32, {128, 8});
  const TensorView w = TensorView::of(c_.w.data(), DType::i8, {128, 256});
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::pack_linear(TensorView::of(c_.w.data(), DType::i8, {1, 128, 256}), s, {}, {}, opt);
      },
      {"w: expected rank 2 [N, K]", "[1, 128, 256]"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::pack_linear(w, TensorView::of(scale.bytes.data(), DType::f32, {128, 4}), {}, {},
                             opt);
      },
      {"w_scale"}));
  const std::vector<int8_t> zp(128 * 8, 0);
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::pack_linear(w, s, TensorView::of(zp.data(), DType::i8, {128, 8}), {}, opt);
      },
      {"w_zero_point"}));
  w4a8moe::PackOptions experts = opt;
  experts.experts = {0};
  EXPECT_TRUE(throws_error([&] { w4a8moe::pack_linear(w, s, {}, {}, experts); },
                           {"PackOptions::experts", "linear"}));
  const std::vector<float> bias(64, 0.0f);
  EXPECT_TRUE(throws_error(
      [&] { w4a8moe::pack_linear(w, s, {}, TensorView::of(bias.data(), DType::f32, {64}), opt); },
      {"w_bias"}));
  std::vector<int8_t> bad = c_.w;
  bad[300] = 9;
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::pack_linear(TensorView::of(bad.data(), DType::i8, {128, 256}), s, {}, {}, opt);
      },
      {"w: expected int4 values in [-8, 7], got 9"}));
}

}  // namespace
