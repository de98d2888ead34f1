// The companions of the forward pass (docs/operator.md, "Companions"): the capability check,
// shape inference, float-weight quantization, and the CPU / kernel-set queries with the ISA cap.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cpu/cpu_features.hpp"
#include "test_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace {

using moe_test::DType;
using moe_test::throws_error;
using w4a8moe::MoeConfig;

// ---- is_supported_config
// -------------------------------------------------------------------------

MoeConfig good_config() {
  return {.x_dtype = DType::bf16,
          .hidden = 2048,
          .inter = 768,
          .experts = 128,
          .top_k = 8,
          .group_size = 128,
          .activation = 2};
}

TEST(SupportedConfig, SupportedConfigsSayYesWithoutAReason) {
  for (const DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const int64_t g : {int64_t{-1}, int64_t{32}, int64_t{64}, int64_t{128}, int64_t{256}})
      for (int64_t act = 0; act <= 4; ++act) {
        MoeConfig c = good_config();
        c.x_dtype = dt;
        c.group_size = g;
        c.activation = act;
        const w4a8moe::Support s = w4a8moe::is_supported_config(c);
        EXPECT_TRUE(s.supported) << s.reason;
        EXPECT_TRUE(s.reason.empty()) << s.reason;
      }
  MoeConfig odd = good_config();  // channelwise with sizes that are not multiples of 32
  odd.hidden = 200;
  odd.inter = 72;
  odd.group_size = -1;
  EXPECT_TRUE(w4a8moe::is_supported_config(odd).supported);
  MoeConfig g96 = good_config();
  g96.hidden = 384;
  g96.inter = 192;
  g96.group_size = 96;
  EXPECT_TRUE(w4a8moe::is_supported_config(g96).supported);
}

// No, with a sentence that mentions each of `fragments`.
testing::AssertionResult says_no(const MoeConfig& c,
                                 std::initializer_list<std::string_view> fragments) {
  const w4a8moe::Support s = w4a8moe::is_supported_config(c);
  if (s.supported) return testing::AssertionFailure() << "said yes";
  if (s.reason.size() < 20) return testing::AssertionFailure() << "reason too short: " << s.reason;
  for (const std::string_view f : fragments)
    if (s.reason.find(f) == std::string::npos)
      return testing::AssertionFailure() << "reason \"" << s.reason << "\" lacks \"" << f << "\"";
  return testing::AssertionSuccess() << s.reason;
}

TEST(SupportedConfig, UnsupportedConfigsSayNoWithAReason) {
  MoeConfig c = good_config();
  c.activation = 5;
  EXPECT_TRUE(says_no(c, {"activation", "5"}));
  c.activation = -1;
  EXPECT_TRUE(says_no(c, {"activation", "-1"}));

  for (const int64_t g : {int64_t{0}, int64_t{16}, int64_t{33}, int64_t{48}, int64_t{-2}}) {
    c = good_config();
    c.group_size = g;
    EXPECT_TRUE(says_no(c, {"group", std::to_string(g)}));
  }
  c = good_config();
  c.hidden = 2048 + 64;  // not divisible by 128
  EXPECT_TRUE(says_no(c, {"group", "128", "2112"}));
  c = good_config();
  c.inter = 768 + 64;
  EXPECT_TRUE(says_no(c, {"group", "128", "832"}));

  for (int dim = 0; dim < 4; ++dim) {
    c = good_config();
    int64_t* fields[] = {&c.hidden, &c.inter, &c.experts, &c.top_k};
    *fields[dim] = 0;
    EXPECT_TRUE(says_no(c, {"0"})) << "dimension " << dim;
    *fields[dim] = -3;
    EXPECT_TRUE(says_no(c, {"-3"})) << "dimension " << dim;
  }

  for (const DType dt : {DType::i8, DType::u8, DType::i32, DType::i64}) {
    c = good_config();
    c.x_dtype = dt;
    EXPECT_TRUE(says_no(c, {w4a8moe::dtype_name(dt)}));
  }
}

TEST(SupportedConfig, NeverThrows) {
  // Every field out of range.
  MoeConfig c{
      static_cast<DType>(200), INT64_MAX, INT64_MIN, INT64_MAX, INT64_MAX, INT64_MIN, INT64_MAX};
  EXPECT_NO_THROW({
    const w4a8moe::Support s = w4a8moe::is_supported_config(c);
    EXPECT_FALSE(s.supported);
    EXPECT_FALSE(s.reason.empty());
  });
  c = good_config();
  c.hidden = int64_t{1} << 40;
  c.inter = int64_t{1} << 40;
  c.group_size = -1;
  EXPECT_NO_THROW(EXPECT_FALSE(w4a8moe::is_supported_config(c).supported));
}

TEST(SupportedConfig, AgreesWithWhatTheLibraryAccepts) {
  // A supported config (g = 96, not a power of two) packs and runs.
  const moe_test::CaseSpec spec{
      .tokens = 2, .hidden = 384, .inter = 192, .experts = 2, .top_k = 1, .group_size = 96};
  MoeConfig c{DType::f32, spec.hidden, spec.inter, spec.experts, spec.top_k, spec.group_size};
  ASSERT_TRUE(w4a8moe::is_supported_config(c).supported);
  const moe_test::Case cs = moe_test::make_case(spec);
  w4a8moe::Context context(1);
  EXPECT_NO_THROW(moe_test::run_forward(cs, moe_test::pack(cs), context));
}

// ---- infer_output -----------------------------------------------------------------------------

TEST(InferOutput, ShapeAndDtypeOfX) {
  for (const DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const int64_t x[] = {37, 2048}, ids[] = {37, 8}, w[] = {37, 8};
    const w4a8moe::OutputSpec o = w4a8moe::infer_output(x, dt, ids, w);
    EXPECT_EQ(o.shape[0], 37);
    EXPECT_EQ(o.shape[1], 2048);
    EXPECT_EQ(o.dtype, dt);
  }
}

TEST(InferOutput, MismatchesThrow) {
  const int64_t x[] = {4, 64}, ids[] = {4, 2}, w[] = {4, 2};
  const int64_t ids_t[] = {5, 2}, w_k[] = {4, 3}, rank1[] = {4}, rank3[] = {1, 4, 64};
  EXPECT_TRUE(throws_error([&] { w4a8moe::infer_output(x, DType::f32, ids_t, w); },
                           {"topk_ids", "[5, 2]"}));
  EXPECT_TRUE(throws_error([&] { w4a8moe::infer_output(x, DType::f32, ids, w_k); },
                           {"topk_weights", "[4, 3]"}));
  EXPECT_TRUE(throws_error([&] { w4a8moe::infer_output(rank1, DType::f32, ids, w); }, {"x"}));
  EXPECT_TRUE(throws_error([&] { w4a8moe::infer_output(rank3, DType::f32, ids, w); }, {"x"}));
  EXPECT_TRUE(throws_error([&] { w4a8moe::infer_output(x, DType::i8, ids, w); }, {"x", "i8"}));
  EXPECT_TRUE(
      throws_error([&] { w4a8moe::infer_output(x, DType::f32, rank1, rank1); }, {"topk_ids"}));
}

// ---- quantize_weights ---------------------------------------------------------------------------

struct FloatWeights {
  std::vector<float> values;
  int64_t e, n, k;
  w4a8moe::TensorView view() const {
    return w4a8moe::TensorView::of(values.data(), DType::f32, {e, n, k});
  }
};

FloatWeights random_weights(int64_t e, int64_t n, int64_t k, uint64_t seed) {
  moe_test::Rng rng(seed);
  FloatWeights w{std::vector<float>(static_cast<size_t>(e * n * k)), e, n, k};
  for (float& v : w.values) v = static_cast<float>(rng.normal() * 0.02);
  w.values[5] = 0.5f;     // a positive extreme in the first group
  w.values[70] = -0.75f;  // a negative extreme in the third group (k = 64, g = 32)
  return w;
}

TEST(QuantizeWeights, Absmax7) {
  const FloatWeights w = random_weights(2, 3, 64, 1);
  for (const int g : {-1, 32}) {
    SCOPED_TRACE("group size " + std::to_string(g));
    const w4a8moe::QuantizedWeights q = w4a8moe::quantize_weights(w.view(), g);
    const int64_t len = g < 0 ? w.k : g, groups = w.k / len;
    ASSERT_EQ(q.values.size(), w.values.size());
    ASSERT_EQ(q.scales.size(), static_cast<size_t>(w.e * w.n * groups));
    EXPECT_EQ(q.group_size, g);
    EXPECT_EQ(q.shape[0], w.e);
    EXPECT_EQ(q.shape[1], w.n);
    EXPECT_EQ(q.shape[2], w.k);
    for (int64_t row = 0; row < w.e * w.n; ++row)
      for (int64_t b = 0; b < groups; ++b) {
        float amax = 0.0f;
        for (int64_t k = b * len; k < (b + 1) * len; ++k)
          amax = std::max(amax, std::fabs(w.values[static_cast<size_t>(row * w.k + k)]));
        const float s = q.scales[static_cast<size_t>(row * groups + b)];
        EXPECT_FLOAT_EQ(s, amax / 7.0f) << "row " << row << " group " << b;
        for (int64_t k = b * len; k < (b + 1) * len; ++k) {
          const auto i = static_cast<size_t>(row * w.k + k);
          EXPECT_GE(q.values[i], -7);
          EXPECT_LE(q.values[i], 7);
          EXPECT_LE(std::fabs(static_cast<float>(q.values[i]) * s - w.values[i]),
                    s / 2 * (1 + 1e-6f))
              << "element " << i;
        }
      }
  }
}

TEST(QuantizeWeights, Q4_0UsesMinusEight) {
  const FloatWeights w = random_weights(1, 4, 64, 2);
  for (const int g : {-1, 32}) {
    SCOPED_TRACE("group size " + std::to_string(g));
    const w4a8moe::QuantizedWeights q =
        w4a8moe::quantize_weights(w.view(), g, w4a8moe::QuantRule::q4_0);
    const int64_t len = g < 0 ? w.k : g, groups = w.k / len;
    for (int64_t row = 0; row < w.n; ++row)
      for (int64_t b = 0; b < groups; ++b) {
        // the element of largest magnitude, with its sign
        float extreme = 0.0f;
        for (int64_t k = b * len; k < (b + 1) * len; ++k) {
          const float v = w.values[static_cast<size_t>(row * w.k + k)];
          if (std::fabs(v) > std::fabs(extreme)) extreme = v;
        }
        const float s = q.scales[static_cast<size_t>(row * groups + b)];
        EXPECT_FLOAT_EQ(s, extreme / -8.0f);
        bool has_minus_eight = false;
        for (int64_t k = b * len; k < (b + 1) * len; ++k) {
          const auto i = static_cast<size_t>(row * w.k + k);
          EXPECT_GE(q.values[i], -8);
          EXPECT_LE(q.values[i], 7);
          has_minus_eight |= q.values[i] == -8;
          // rounding error, except where +8 had to clamp to 7 (one full step)
          const float err = std::fabs(static_cast<float>(q.values[i]) * s - w.values[i]);
          const bool clamped = w.values[i] / s > 7.5f;
          EXPECT_LE(err, std::fabs(s) * (clamped ? 1.0f : 0.5f) * (1 + 1e-6f)) << "element " << i;
        }
        EXPECT_TRUE(has_minus_eight) << "row " << row << " group " << b;
      }
  }
}

TEST(QuantizeWeights, AllZeroGroupAndOtherDtypes) {
  FloatWeights w = random_weights(1, 2, 64, 3);
  std::fill(w.values.begin() + 64, w.values.end(), 0.0f);  // row 1 all zero
  const w4a8moe::QuantizedWeights q = w4a8moe::quantize_weights(w.view(), 32);
  for (size_t i = 64; i < 128; ++i) EXPECT_EQ(q.values[i], 0);
  for (const float s : q.scales) EXPECT_TRUE(std::isfinite(s));

  // bf16 input gives the same result as the same values in f32
  const moe_test::FloatTensor b = moe_test::make_float_tensor(w.values, DType::bf16);
  const FloatWeights wf{b.values, 1, 2, 64};
  const w4a8moe::QuantizedWeights from_bf16 = w4a8moe::quantize_weights(
      w4a8moe::TensorView::of(b.bytes.data(), DType::bf16, {1, 2, 64}), 32);
  const w4a8moe::QuantizedWeights from_f32 = w4a8moe::quantize_weights(wf.view(), 32);
  EXPECT_EQ(from_bf16.values, from_f32.values);
  EXPECT_EQ(from_bf16.scales, from_f32.scales);
}

TEST(QuantizeWeights, QuantizedWeightsPackAndRun) {
  // quantize_weights' output feeds pack_w13/pack_w2 directly
  const int64_t E = 2, H = 128, I = 64;
  moe_test::Rng rng(4);
  std::vector<float> w13(static_cast<size_t>(E * 2 * I * H)), w2(static_cast<size_t>(E * H * I));
  for (float& v : w13) v = static_cast<float>(rng.normal() * 0.05);
  for (float& v : w2) v = static_cast<float>(rng.normal() * 0.05);
  const w4a8moe::QuantizedWeights q13 =
      w4a8moe::quantize_weights(w4a8moe::TensorView::of(w13.data(), DType::f32, {E, 2 * I, H}), 32);
  const w4a8moe::QuantizedWeights q2 =
      w4a8moe::quantize_weights(w4a8moe::TensorView::of(w2.data(), DType::f32, {E, H, I}), 32);
  w4a8moe::PackOptions o;
  o.group_size = 32;
  EXPECT_NO_THROW({
    w4a8moe::pack_w13(w4a8moe::TensorView::of(q13.values.data(), DType::i8, {E, 2 * I, H}),
                      w4a8moe::TensorView::of(q13.scales.data(), DType::f32, {E, 2 * I, H / 32}),
                      {}, o);
    w4a8moe::pack_w2(w4a8moe::TensorView::of(q2.values.data(), DType::i8, {E, H, I}),
                     w4a8moe::TensorView::of(q2.scales.data(), DType::f32, {E, H, I / 32}), {}, o);
  });
}

TEST(QuantizeWeights, BadInput) {
  const FloatWeights w = random_weights(1, 2, 64, 5);
  EXPECT_TRUE(throws_error([&] { w4a8moe::quantize_weights(w.view(), 48); }, {"group", "48"}));
  EXPECT_TRUE(throws_error([&] { w4a8moe::quantize_weights(w.view(), 0); }, {"group", "0"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::quantize_weights(w4a8moe::TensorView::of(w.values.data(), DType::i8, {1, 2, 64}),
                                  32);
      },
      {"w", "i8"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::quantize_weights(w4a8moe::TensorView::of(nullptr, DType::f32, {1, 2, 64}), 32);
      },
      {"w", "null"}));
  FloatWeights bad = w;
  bad.values[9] = std::nanf("");
  EXPECT_TRUE(throws_error([&] { w4a8moe::quantize_weights(bad.view(), 32); }, {"w", "nan"}));
}

// ---- CPU features and kernel sets
// ------------------------------------------------------------------

TEST(KernelSetQueries, ScalarIsAlwaysAvailableAndLast) {
  const std::vector<std::string> sets = w4a8moe::available_kernel_sets();
  ASSERT_FALSE(sets.empty());
  EXPECT_EQ(sets.back(), "scalar");
  EXPECT_FALSE(w4a8moe::cpu_features().arch.empty());
  EXPECT_FALSE(w4a8moe::cpu_features().summary().empty());
}

TEST(KernelSetQueries, IsaCapSelectsEachSet) {
  const std::string before = w4a8moe::active_kernel_set();
  for (const std::string& name : w4a8moe::available_kernel_sets()) {
    w4a8moe::set_isa_cap(name);
    EXPECT_EQ(w4a8moe::active_kernel_set(), name);
  }
  w4a8moe::set_isa_cap("");
  EXPECT_EQ(w4a8moe::active_kernel_set(), w4a8moe::available_kernel_sets().front());
  w4a8moe::set_isa_cap(before);  // under W4A8MOE_ISA, the cap the environment asked for
  EXPECT_EQ(w4a8moe::active_kernel_set(), before);
}

TEST(KernelSetQueries, UnknownCapThrows) {
  const std::string before = w4a8moe::active_kernel_set();
  EXPECT_TRUE(throws_error([] { w4a8moe::set_isa_cap("bogus"); }, {"bogus", "scalar"}));
  EXPECT_EQ(w4a8moe::active_kernel_set(), before);
}

TEST(KernelSetQueries, DtypeAndActivationNames) {
  EXPECT_STREQ(w4a8moe::dtype_name(DType::bf16), "bf16");
  EXPECT_EQ(w4a8moe::dtype_bytes(DType::f32), 4u);
  EXPECT_EQ(w4a8moe::dtype_bytes(DType::f16), 2u);
  EXPECT_EQ(w4a8moe::dtype_bytes(DType::i64), 8u);
  EXPECT_STREQ(w4a8moe::activation_name(w4a8moe::Activation::gelu_tanh), "gelu_tanh");
}

}  // namespace

// What `w4a8moe check` and CpuFeatures::amx_status say when AMX is not usable: the first of the
// three conditions that fails, in words.
TEST(CpuFeaturesAmx, StatusNamesTheFirstMissingCondition) {
  using w4a8moe::detail::amx_status;
  EXPECT_EQ(amx_status(true, true, true), "usable");
  EXPECT_NE(amx_status(false, true, true).find("the CPU has no AMX-TILE and AMX-INT8"),
            std::string::npos);
  EXPECT_NE(amx_status(false, false, false).find("the CPU has no"), std::string::npos);
  EXPECT_NE(amx_status(true, false, true).find("the OS does not enable the tile state"),
            std::string::npos);
  EXPECT_NE(amx_status(true, true, false).find("tile data permission"), std::string::npos);
  const w4a8moe::CpuFeatures& f = w4a8moe::cpu_features();
  EXPECT_EQ(f.amx_int8, f.amx_status == "usable") << f.amx_status;
}
