// Bad input to every entry point is reported as w4a8moe::Error with a sentence that names the
// argument; bad values in the data (NaN, Inf) never crash and never spill into other tokens; and
// special rows (all zero, constant, one huge outlier, rounding ties) give the contract's result.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "reference/reference.hpp"
#include "test_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace {

using namespace moe_test::suite_names;

CaseSpec small_spec() {  // H 256, I 128, E 4, K 2
  return {.tokens = 6, .group_size = 64, .seed = 31};
}

// A case, its packed weights and a context; `call` runs forward() with the given views, each
// defaulting to the case's own.
class ForwardInput : public testing::Test {
 protected:
  ForwardInput() : case_(moe_test::make_case(small_spec())), packed_(moe_test::pack(case_)) {}

  struct Views {
    TensorView x, ids, weights;
    MutableTensorView out;
    w4a8moe::MoeParams params;
  };
  Views views() {
    out_ = moe_test::make_output(case_);
    return {case_.x_view(), case_.ids_view(), case_.topk_weights_view(), out_.view(),
            case_.params()};
  }
  std::function<void()> call(const Views& v) {
    return [this, v] {
      w4a8moe::forward(context_, v.x, v.ids, v.weights, packed_.w13.bytes(), packed_.w2.bytes(),
                       v.params, v.out);
    };
  }
  std::function<void()> call_reference(const Views& v) {
    return [this, v] {
      w4a8moe::reference_forward(v.x, v.ids, v.weights, case_.logical(), v.params, v.out);
    };
  }
  // Both forward() and reference_forward() reject `v` with a message holding `fragments`.
  void expect_both_reject(const Views& v, std::initializer_list<std::string_view> fragments) {
    EXPECT_TRUE(throws_error(call(v), fragments)) << "forward";
    EXPECT_TRUE(throws_error(call_reference(v), fragments)) << "reference_forward";
  }

  Case case_;
  moe_test::PackedPair packed_;
  w4a8moe::Context context_{2};
  moe_test::Output out_;
};

// ---- ids ---------------------------------------------------------------------------------------

TEST_F(ForwardInput, IdsOutOfRange) {
  for (const DType dt : {DType::i32, DType::i64})
    for (const int64_t bad :
         {int64_t{4}, int64_t{5}, int64_t{-1}, int64_t{-100}, int64_t{1} << 40}) {
      if (dt == DType::i32 && bad > INT32_MAX) continue;
      SCOPED_TRACE(std::string(w4a8moe::dtype_name(dt)) + " id " + std::to_string(bad));
      std::vector<uint8_t> ids(static_cast<size_t>(6 * 2) * w4a8moe::dtype_bytes(dt), 0);
      // a valid id everywhere, the bad one at token 3, slot 1
      if (dt == DType::i32) {
        const auto b = static_cast<int32_t>(bad);
        std::memcpy(ids.data() + 7 * 4, &b, 4);
      } else {
        std::memcpy(ids.data() + 7 * 8, &bad, 8);
      }
      Views v = views();
      v.ids = TensorView::of(ids.data(), dt, {6, 2});
      expect_both_reject(v, {"topk_ids", std::to_string(bad)});
    }
}

TEST_F(ForwardInput, IdsOfAFloatDtype) {
  const std::vector<float> ids(12, 1.0f);
  Views v = views();
  v.ids = TensorView::of(ids.data(), DType::f32, {6, 2});
  expect_both_reject(v, {"topk_ids", "f32"});
  v.ids = TensorView::of(ids.data(), DType::u8, {6, 2});
  expect_both_reject(v, {"topk_ids", "u8"});
}

// ---- shapes and dtypes -------------------------------------------------------------------------

TEST_F(ForwardInput, XShape) {
  Views v = views();
  v.x = TensorView::of(case_.x.bytes.data(), DType::f32, {6 * 256});
  expect_both_reject(v, {"x", "rank"});
  v.x = TensorView::of(case_.x.bytes.data(), DType::f32, {1, 6, 256});
  expect_both_reject(v, {"x", "rank"});
  v.x = TensorView::of(case_.x.bytes.data(), DType::f32, {12, 128});
  expect_both_reject(v, {"x", "256"});
  v.x = TensorView::of(case_.x.bytes.data(), DType::f32, {6, 256}, 200);  // stride < H
  expect_both_reject(v, {"x", "stride"});
  v.x = TensorView::of(case_.x.bytes.data(), DType::i8, {6, 256});
  expect_both_reject(v, {"x", "i8"});
}

TEST_F(ForwardInput, TopkShapes) {
  Views v = views();
  v.ids = TensorView::of(case_.ids.data(), DType::i32, {3, 2});  // T differs from x
  expect_both_reject(v, {"topk_ids", "[3, 2]"});
  v = views();
  v.weights = TensorView::of(case_.topk_weights.bytes.data(), DType::f32, {6, 1});
  expect_both_reject(v, {"topk_weights", "[6, 2]", "[6, 1]"});
  v.weights = TensorView::of(case_.topk_weights.bytes.data(), DType::f32, {12});
  expect_both_reject(v, {"topk_weights"});
  v.weights = TensorView::of(case_.topk_weights.bytes.data(), DType::i32, {6, 2});
  expect_both_reject(v, {"topk_weights", "i32"});
}

TEST_F(ForwardInput, OutShapeAndDtype) {
  std::vector<float> big(7 * 257);
  Views v = views();
  v.out = MutableTensorView::of(big.data(), DType::f32, {6, 257});
  expect_both_reject(v, {"out", "[6, 256]"});
  v.out = MutableTensorView::of(big.data(), DType::f32, {5, 256});
  expect_both_reject(v, {"out", "[6, 256]"});
  v.out = MutableTensorView::of(big.data(), DType::f32, {6 * 256});
  expect_both_reject(v, {"out"});
  v.out = MutableTensorView::of(big.data(), DType::bf16, {6, 256});
  expect_both_reject(v, {"out", "bf16", "f32"});
}

TEST_F(ForwardInput, NullDataPointers) {
  // Each view's data pointer in turn, by its name in the message.
  const std::pair<const char*, void (*)(Views&)> nulls[] = {
      {"x", [](Views& v) { v.x.data = nullptr; }},
      {"topk_ids", [](Views& v) { v.ids.data = nullptr; }},
      {"topk_weights", [](Views& v) { v.weights.data = nullptr; }},
      {"out", [](Views& v) { v.out.data = nullptr; }},
  };
  for (const auto& [name, make_null] : nulls) {
    Views v = views();
    make_null(v);
    expect_both_reject(v, {name, "null"});
  }
  const Views v = views();
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::forward(context_, v.x, v.ids, v.weights, {}, packed_.w2.bytes(), v.params, v.out);
      },
      {"w13_packed"}));
}

TEST_F(ForwardInput, Params) {
  Views v = views();
  v.params.activation = static_cast<w4a8moe::Activation>(5);
  expect_both_reject(v, {"activation", "5"});
  v.params.activation = static_cast<w4a8moe::Activation>(-1);
  expect_both_reject(v, {"activation", "-1"});
  v = views();
  v.params.activation = w4a8moe::Activation::swigluoai;
  v.params.limit = 0.0f;
  expect_both_reject(v, {"limit"});
  v.params.limit = 7.0f;
  v.params.alpha = std::numeric_limits<float>::quiet_NaN();
  expect_both_reject(v, {"alpha"});
}

TEST_F(ForwardInput, TheOutputIsUntouchedWhenTheInputIsRejected) {
  Views v = views();
  v.ids = TensorView::of(case_.ids.data(), DType::i32, {3, 2});
  const std::vector<uint8_t> before = out_.bytes;
  EXPECT_THROW(call(v)(), w4a8moe::Error);
  EXPECT_EQ(out_.bytes, before);
}

TEST(ContextInput, NegativeThreadCount) {
  EXPECT_TRUE(throws_error([] { w4a8moe::Context c(-1); }, {"threads", "-1"}));
}

// ---- activations by code and by name -----------------------------------------------------------

TEST(ActivationInput, CodesAndNames) {
  for (int code = 0; code <= 4; ++code) {
    const w4a8moe::Activation a = w4a8moe::activation_from_code(code);
    EXPECT_EQ(static_cast<int>(a), code);
    EXPECT_EQ(w4a8moe::parse_activation(w4a8moe::activation_name(a)), a);
  }
  EXPECT_EQ(w4a8moe::parse_activation("silu"), w4a8moe::Activation::silu);
  EXPECT_EQ(w4a8moe::parse_activation("gelu_tanh"), w4a8moe::Activation::gelu_tanh);
  EXPECT_EQ(w4a8moe::activation_from_code(1), w4a8moe::Activation::swigluoai);
}

TEST(ActivationInput, UnknownCodesAndNamesAreErrors) {
  for (const int64_t code : {int64_t{5}, int64_t{-1}, int64_t{100}, int64_t{1} << 33}) {
    EXPECT_TRUE(throws_error([&] { w4a8moe::activation_from_code(code); },
                             {"activation", std::to_string(code)}));
  }
  for (const char* name : {"relu", "", "SILU", "silu "}) {
    EXPECT_TRUE(throws_error([&] { w4a8moe::parse_activation(name); },
                             {"activation", "'" + std::string(name) + "'"}));
  }
}

// ---- the packer's input ------------------------------------------------------------------------

TEST(PackerInput, InvalidGroupSizes) {
  const Case c = moe_test::make_case(small_spec());  // H = 256, I = 128
  for (const int g : {0, 16, 33, 48, 96, -2, 512}) {
    SCOPED_TRACE("group size " + std::to_string(g));
    w4a8moe::PackOptions o;
    o.group_size = g;
    // scales shaped as if g were valid (or [E, N, 1]): the group size must be caught first
    const int64_t groups = g > 0 && 256 % g == 0 ? 256 / g : 1;
    std::vector<float> s(static_cast<size_t>(4 * 256 * groups), 0.01f);
    EXPECT_TRUE(throws_error(
        [&] {
          w4a8moe::pack_w13(c.w13_view(), TensorView::of(s.data(), DType::f32, {4, 256, groups}),
                            {}, o);
        },
        {"group", std::to_string(g)}));
    EXPECT_TRUE(throws_error(
        [&] {
          w4a8moe::pack_w2(c.w2_view(), TensorView::of(s.data(), DType::f32, {4, 256, groups}), {},
                           o);
        },
        {"group", std::to_string(g)}));
  }
}

TEST(PackerInput, ScaleAndBiasShapes) {
  const Case c = moe_test::make_case(small_spec());  // g = 64: w13 scale [4, 256, 4]
  w4a8moe::PackOptions o = c.pack_options();
  std::vector<float> s(4 * 256 * 8, 0.01f);
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::pack_w13(c.w13_view(), TensorView::of(s.data(), DType::f32, {4, 256, 8}), {}, o);
      },
      {"w13_scale", "[4, 256, 4]"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::pack_w13(c.w13_view(), TensorView::of(s.data(), DType::i32, {4, 256, 4}), {}, o);
      },
      {"w13_scale", "i32"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::pack_w13(c.w13_view(), c.w13_scale_view(),
                          TensorView::of(s.data(), DType::f32, {4, 255}), o);
      },
      {"w13_bias", "[4, 256]"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::pack_w2(c.w2_view(), TensorView::of(nullptr, DType::f32, {4, 256, 2}), {}, o);
      },
      {"w2_scale", "null"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::pack_w2(TensorView::of(c.w2.data(), DType::f32, {4, 256, 32}), c.w2_scale_view(),
                         {}, o);
      },
      {"w2", "f32"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::pack_w2(TensorView::of(c.w2.data(), DType::i8, {4 * 256, 128}), c.w2_scale_view(),
                         {}, o);
      },
      {"w2", "rank"}));
}

TEST(PackerInput, ReferenceForwardChecksTheLogicalWeights) {
  const Case c = moe_test::make_case(small_spec());
  w4a8moe::LogicalWeights w = c.logical();
  w.group_size = 48;
  EXPECT_TRUE(throws_error([&] { moe_test::run_library_reference(c, w); }, {"group", "48"}));
  w = c.logical();
  w.w2 = TensorView::of(c.w2.data(), DType::i8, {4, 256, 64});  // I = 64 against w13's 128
  EXPECT_TRUE(throws_error([&] { moe_test::run_library_reference(c, w); }, {"w2"}));
}

// ---- bad values in the data, special rows -------------------------------------------------------

// With the active kernel set (CTest runs the suite once per set).
class SpecialRows : public testing::Test {
 protected:
  moe_test::Output run(const Case& c) {
    return moe_test::run_forward(c, moe_test::pack(c), context_);
  }

  // Tokens other than `t` give the same bits as `expected`.
  static void expect_other_rows_equal(const moe_test::Output& got, const moe_test::Output& expected,
                                      int64_t t) {
    const size_t row = static_cast<size_t>(got.cols) * w4a8moe::dtype_bytes(got.dtype);
    for (int64_t r = 0; r < got.rows; ++r) {
      if (r == t) continue;
      EXPECT_EQ(std::memcmp(got.bytes.data() + r * row, expected.bytes.data() + r * row, row), 0)
          << "token " << r << " changed because token " << t << " holds a bad value";
    }
  }

  w4a8moe::Context context_{2};
};

CaseSpec shared_experts_spec(DType x_dtype) {
  CaseSpec s = small_spec();
  s.tokens = 9;
  s.x_dtype = x_dtype;
  s.routing = moe_test::Routing::skewed;  // every token shares expert E - 1
  return s;
}

TEST_F(SpecialRows, NanOrInfInXStaysInItsToken) {
  for (const DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity()}) {
      const CaseSpec spec = shared_experts_spec(dt);
      SCOPED_TRACE(moe_test::describe(spec) + " bad value " + std::to_string(bad));
      Case clean = moe_test::make_case(spec);
      for (int64_t j = 0; j < spec.hidden; ++j) clean.set_x(4, j, 0.0f);
      Case poisoned = clean;
      poisoned.set_x(4, 17, bad);
      const moe_test::Output expected = run(clean);
      const moe_test::Output got = run(poisoned);
      expect_other_rows_equal(got, expected, 4);
      // and the other tokens are right
      const moe_ref::ExactResult ref = moe_ref::exact_forward(poisoned.problem);
      EXPECT_EQ(ref.token_finite[4], 0);
      EXPECT_TRUE(moe_test::matches_exact(poisoned, got.to_float(), ref));
    }
}

TEST_F(SpecialRows, NanRouterWeightStaysInItsToken) {
  const CaseSpec spec = shared_experts_spec(DType::f32);
  Case clean = moe_test::make_case(spec);
  Case poisoned = clean;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(poisoned.topk_weights.bytes.data() + 4 * (2 * 3 + 1), &nan, 4);  // token 3, slot 1
  expect_other_rows_equal(run(poisoned), run(clean), 3);
}

TEST_F(SpecialRows, AllZeroRowGivesTheBiasOnly) {
  // x[t] = 0 quantizes to q = zp everywhere: h = b13 = 0 (no w13 bias), m = act(0, 0) = 0 and
  // y = b2. With router weights 1/2 and 1/4 the result r0 * b2[e0] + r1 * b2[e1] is exact in
  // f32, whatever the order of the sum.
  for (const int g : {-1, 64}) {
    CaseSpec spec = small_spec();
    spec.group_size = g;
    spec.bias = true;
    Case c = moe_test::make_case(spec);
    c.w13_bias.values.assign(c.w13_bias.values.size(), 0.0f);
    c.w13_bias.bytes.assign(c.w13_bias.bytes.size(), 0);
    c.problem.w13_bias = c.w13_bias.values;
    // b2 rounded to bf16 values so that halves and quarters of them add exactly
    c.w2_bias = moe_test::make_float_tensor(c.w2_bias.values, DType::bf16);
    c.w2_bias = moe_test::make_float_tensor(c.w2_bias.values, DType::f32);
    c.problem.w2_bias = c.w2_bias.values;
    const float r[2] = {0.5f, 0.25f};
    for (int64_t t = 0; t < spec.tokens; ++t)
      for (int k = 0; k < 2; ++k) {
        std::memcpy(c.topk_weights.bytes.data() + 4 * (t * 2 + k), &r[k], 4);
        c.topk_weights.values[static_cast<size_t>(t * 2 + k)] = r[k];
        c.problem.topk_weights[static_cast<size_t>(t * 2 + k)] = r[k];
      }
    const int64_t t0 = 2;
    for (int64_t j = 0; j < spec.hidden; ++j) c.set_x(t0, j, 0.0f);
    const std::vector<float> got = run(c).to_float();
    int64_t ids[2];
    for (int k = 0; k < 2; ++k) {
      int32_t id;
      std::memcpy(&id, c.ids.data() + 4 * (t0 * 2 + k), 4);
      ids[k] = id;
    }
    for (int64_t n = 0; n < spec.hidden; ++n) {
      const float expected =
          r[0] * c.w2_bias.values[static_cast<size_t>(ids[0] * spec.hidden + n)] +
          r[1] * c.w2_bias.values[static_cast<size_t>(ids[1] * spec.hidden + n)];
      ASSERT_EQ(got[static_cast<size_t>(t0 * spec.hidden + n)], expected)
          << "g=" << g << " column " << n;
    }
    EXPECT_TRUE(moe_test::matches_exact(c, got, moe_ref::exact_forward(c.problem)));
  }
}

TEST_F(SpecialRows, ConstantRows) {
  for (const float value : {1.0f, -0.75f, 3.0f}) {
    CaseSpec spec = small_spec();
    spec.bias = true;
    Case c = moe_test::make_case(spec);
    for (int64_t j = 0; j < spec.hidden; ++j) c.set_x(1, j, value);
    SCOPED_TRACE("constant " + std::to_string(value));
    EXPECT_TRUE(moe_test::matches_exact(c, run(c).to_float(), moe_ref::exact_forward(c.problem)));
  }
}

TEST_F(SpecialRows, HugeOutlier) {
  // One element 1000 times the others: the rest of the row quantizes to a few levels, and the
  // output grows large (so the order-one check is off); the contract still holds.
  for (const float value : {1000.0f, -1000.0f, 60000.0f}) {
    for (const DType dt : {DType::f32, DType::f16}) {
      if (dt == DType::f16 && value > 1000.0f) continue;  // the output would overflow f16
      CaseSpec spec = small_spec();
      spec.x_dtype = dt;
      Case c = moe_test::make_case(spec);
      c.set_x(3, 100, value);
      SCOPED_TRACE(moe_test::describe(spec) + " outlier " + std::to_string(value));
      moe_test::ExactCheck check;
      check.check_magnitude = false;
      EXPECT_TRUE(
          moe_test::matches_exact(c, run(c).to_float(), moe_ref::exact_forward(c.problem), check));
    }
  }
}

TEST_F(SpecialRows, RoundingTiesGoAwayFromZero) {
  // A row with min -1 and max 127/128 has scale exactly 128 and zero point 0, so the elements
  // (k + 1/2) / 128 sit exactly on rounding ties: half away from zero (the contract) and half to
  // even give different q for every other one.
  CaseSpec spec = small_spec();
  spec.group_size = -1;
  Case c = moe_test::make_case(spec);
  moe_test::Rng rng(5);
  for (int64_t t = 0; t < spec.tokens; ++t) {
    c.set_x(t, 0, -1.0f);
    c.set_x(t, 1, 127.0f / 128.0f);
    for (int64_t j = 2; j < spec.hidden; ++j)
      c.set_x(t, j, (static_cast<float>(rng.integer(-120, 119)) + 0.5f) / 128.0f);
  }
  const moe_ref::QuantRow q = moe_ref::quant_row(std::span<const float>(c.problem.x).first(256));
  ASSERT_EQ(q.scale, 128.0f);
  ASSERT_EQ(q.zp, 0);
  EXPECT_TRUE(moe_test::matches_exact(c, run(c).to_float(), moe_ref::exact_forward(c.problem)));
  // A half-to-even kernel would not pass: the reference with every tie whose away-from-zero
  // result is odd nudged towards zero computes exactly what such a kernel would.
  Case even = c;
  for (float& v : even.problem.x) {
    const double scaled = static_cast<double>(v) * 128.0;  // the tie k + 1/2
    const double away = scaled >= 0.0 ? std::floor(scaled + 0.5) : -std::floor(-scaled + 0.5);
    if (v > -1.0f && v < 127.0f / 128.0f && std::fmod(std::fabs(away), 2.0) == 1.0)
      v = std::nextafter(v, 0.0f);
  }
  EXPECT_FALSE(moe_test::matches_exact(c, run(c).to_float(), moe_ref::exact_forward(even.problem)));
}

}  // namespace

namespace {

// ---- an empty batch
// ------------------------------------------------------------------------------

// T = 0 is a valid call (frameworks run layers on empty batches): no output, no error, and the
// shapes are still checked.
TEST_F(ForwardInput, EmptyBatchIsANoOp) {
  Views v = views();
  const int64_t H = case_.spec.hidden, K = case_.spec.top_k;
  v.x.shape = {0, H, 0};
  v.ids.shape = {0, K, 0};
  v.weights.shape = {0, K, 0};
  v.out.shape = {0, H, 0};
  EXPECT_NO_THROW(call(v)());
  EXPECT_NO_THROW(call_reference(v)());
  for (float value : out_.to_float()) EXPECT_TRUE(std::isnan(value));  // untouched
  v.ids.shape = {0, K + 1, 0};
  expect_both_reject(v, {"topk_weights", "expected shape"});
  const int64_t x_shape[] = {0, H}, ids_shape[] = {0, K};
  const w4a8moe::OutputSpec spec =
      w4a8moe::infer_output(x_shape, w4a8moe::DType::bf16, ids_shape, ids_shape);
  EXPECT_EQ(spec.shape[0], 0);
  EXPECT_EQ(spec.shape[1], H);
}

}  // namespace
