// The routing API against an independent implementation (tests/checkpoint_writers:
// double math, stable sorts): every gating rule of the real models, groups, scaling, ties, NaN,
// and the router matmul; bad configurations rejected with a message.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "checkpoint_writers.hpp"
#include "w4a8moe/routing.hpp"

namespace {

using ::testing::HasSubstr;
using namespace w4a8moe;

// Logits with well separated values (distinct multiples of 1/64, shuffled), so that f32 and
// double agree on every order.
std::vector<float> spaced_logits(int64_t T, int64_t E, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> out(static_cast<size_t>(T * E));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int> v(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e)
      v[static_cast<size_t>(e)] = static_cast<int>(e) - static_cast<int>(E / 2);
    std::shuffle(v.begin(), v.end(), rng);
    for (int64_t e = 0; e < E; ++e)
      out[static_cast<size_t>(t * E + e)] =
          static_cast<float>(v[static_cast<size_t>(e)]) * 3.0f / static_cast<float>(E);
  }
  return out;
}

struct Case {
  const char* name;
  RoutingConfig config;
  ckpt_test::RouteSpec spec;
  bool selection_bias = false;
};

RoutingConfig config(int64_t E, int64_t K, Gating g, bool renorm, float scaling = 1.0f,
                     int64_t groups = 1, int64_t used = 1,
                     GroupScore score = GroupScore::top2_sum) {
  return {E, K, g, renorm, scaling, groups, used, score};  // RoutingConfig's fields in order
}

std::vector<Case> cases() {
  using ckpt_test::RouteSpec;
  return {
      {"qwen3_mixtral", config(128, 8, Gating::softmax, true), RouteSpec{"softmax", true}},
      {"olmoe_qwen2", config(64, 8, Gating::softmax, false), RouteSpec{"softmax", false}},
      {"deepseek_v2", config(160, 6, Gating::softmax, false, 16.0f, 8, 3, GroupScore::max),
       RouteSpec{"softmax", false, 16.0, 8, 3, false}},
      {"deepseek_v3", config(256, 8, Gating::sigmoid, true, 2.5f, 8, 4, GroupScore::top2_sum),
       RouteSpec{"sigmoid", true, 2.5, 8, 4, true}, true},
      {"gpt_oss", config(32, 4, Gating::softmax_topk, false), RouteSpec{"softmax_topk", false}},
      {"llama4", config(16, 1, Gating::sigmoid, false), RouteSpec{"sigmoid", false}},
      {"top_k_equals_e", config(8, 8, Gating::softmax, true), RouteSpec{"softmax", true}},
  };
}

TEST(Routing, MatchesTheIndependentImplementationForEveryModelFamily) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const int64_t T = 37, E = c.config.experts, K = c.config.top_k;
    const std::vector<float> logits = spaced_logits(T, E, 7);
    std::vector<float> bias;
    if (c.selection_bias) {
      // DeepSeek-V3's correction bias: large enough to change choices, multiples of 1/1024
      std::mt19937_64 rng(3);
      for (int64_t e = 0; e < E; ++e)
        bias.push_back(static_cast<float>(static_cast<int>(rng() % 512) - 256) / 1024.0f);
    }
    std::vector<int32_t> ids(static_cast<size_t>(T * K));
    std::vector<float> weights(static_cast<size_t>(T * K));
    route(TensorView::of(logits.data(), DType::f32, {T, E}),
          bias.empty() ? TensorView{} : TensorView::of(bias.data(), DType::f32, {E}), c.config,
          MutableTensorView::of(ids.data(), DType::i32, {T, K}),
          MutableTensorView::of(weights.data(), DType::f32, {T, K}));
    std::vector<int64_t> want_ids;
    std::vector<double> want_w;
    ckpt_test::route_reference(logits, T, E, K, bias, c.spec, want_ids, want_w);
    for (int64_t i = 0; i < T * K; ++i) {
      ASSERT_EQ(ids[static_cast<size_t>(i)], want_ids[static_cast<size_t>(i)])
          << "token " << i / K << " slot " << i % K;
      ASSERT_NEAR(weights[static_cast<size_t>(i)], want_w[static_cast<size_t>(i)],
                  2e-6 * static_cast<double>(c.config.scaling))
          << "token " << i / K << " slot " << i % K;
    }
    // the weights sum to the scaling when renormalised (or softmax over the chosen)
    if (c.config.renormalize || c.config.gating == Gating::softmax_topk) {
      double sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += static_cast<double>(weights[static_cast<size_t>(k)]);
      EXPECT_NEAR(sum, static_cast<double>(c.config.scaling), 1e-5);
    }
  }
}

TEST(Routing, GroupsRestrictTheChoice) {
  // 4 groups of 4 (softmax scores: group scores are sums of probabilities, e^2 + e^2 > e^1.9 +
  // e^1.9 > e^2.5 + e^-4); the best single expert sits in group 3, but groups 0 and 1 have the
  // best top-2 sums: with top2_sum and 2 groups used, expert 12 must not be chosen; with max it
  // must.
  const int64_t E = 16, K = 2;
  std::vector<float> logits(E, -4.0f);
  logits[0] = 2.0f;
  logits[1] = 2.0f;  // group 0: 2 + 2
  logits[4] = 1.9f;
  logits[5] = 1.9f;   // group 1: 1.9 + 1.9
  logits[12] = 2.5f;  // group 3: the best expert, but the worst top-2 sum of probabilities
  std::vector<int32_t> ids(K);
  std::vector<float> w(K);
  route(TensorView::of(logits.data(), DType::f32, {1, E}), {},
        config(E, K, Gating::softmax, false, 1.0f, 4, 2, GroupScore::top2_sum),
        MutableTensorView::of(ids.data(), DType::i32, {1, K}),
        MutableTensorView::of(w.data(), DType::f32, {1, K}));
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 1}));
  route(TensorView::of(logits.data(), DType::f32, {1, E}), {},
        config(E, K, Gating::softmax, false, 1.0f, 4, 2, GroupScore::max),
        MutableTensorView::of(ids.data(), DType::i32, {1, K}),
        MutableTensorView::of(w.data(), DType::f32, {1, K}));
  EXPECT_EQ(ids, (std::vector<int32_t>{12, 0}));
}

TEST(Routing, TiesGoToTheLowestIndexAndNaNRanksLast) {
  const int64_t E = 6, K = 3;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> logits = {1,   2, 2, 1, 2, 0,   // ties: 1, 2, 4
                                     nan, 0, 0, 0, 0, 0,   // a NaN: the ids stay valid
                                     0,   0, 0, 0, 0, 0};  // all equal: 0, 1, 2
  std::vector<int64_t> ids(static_cast<size_t>(3 * K));
  std::vector<float> w(static_cast<size_t>(3 * K));
  route(TensorView::of(logits.data(), DType::f32, {3, E}), {},
        config(E, K, Gating::softmax_topk, false),
        MutableTensorView::of(ids.data(), DType::i64, {3, K}),
        MutableTensorView::of(w.data(), DType::f32, {3, K}));
  EXPECT_EQ(ids, (std::vector<int64_t>{1, 2, 4, 1, 2, 3, 0, 1, 2}));
  EXPECT_FLOAT_EQ(w[0], 1.0f / 3.0f);
  EXPECT_FLOAT_EQ(w[6], 1.0f / 3.0f);
  // softmax over all experts: a NaN logit makes the token's weights NaN, not its ids
  route(TensorView::of(logits.data(), DType::f32, {3, E}), {}, config(E, K, Gating::softmax, false),
        MutableTensorView::of(ids.data(), DType::i64, {3, K}),
        MutableTensorView::of(w.data(), DType::f32, {3, K}));
  for (int64_t k = 0; k < K; ++k) {
    EXPECT_TRUE(std::isnan(w[static_cast<size_t>(K + k)]));
    EXPECT_GE(ids[static_cast<size_t>(K + k)], 0);
    EXPECT_LT(ids[static_cast<size_t>(K + k)], E);
    EXPECT_FALSE(std::isnan(w[static_cast<size_t>(k)])) << "NaN spilled into another token";
  }
}

TEST(Routing, Bf16LogitsAndWeights) {
  const int64_t T = 5, E = 16, K = 4;
  const std::vector<float> logits = spaced_logits(T, E, 11);
  std::vector<uint16_t> bits(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) bits[i] = ckpt_test::bf16_bits(logits[i]);
  std::vector<int32_t> ids(static_cast<size_t>(T * K));
  std::vector<uint16_t> w(static_cast<size_t>(T * K));
  route(TensorView::of(bits.data(), DType::bf16, {T, E}), {}, config(E, K, Gating::softmax, true),
        MutableTensorView::of(ids.data(), DType::i32, {T, K}),
        MutableTensorView::of(w.data(), DType::bf16, {T, K}));
  std::vector<int64_t> want_ids;
  std::vector<double> want_w;
  ckpt_test::route_reference(logits, T, E, K, {}, {"softmax", true}, want_ids, want_w);
  for (int64_t i = 0; i < T * K; ++i) {
    EXPECT_EQ(ids[static_cast<size_t>(i)], want_ids[static_cast<size_t>(i)]);
    EXPECT_NEAR(ckpt_test::from_bf16(w[static_cast<size_t>(i)]), want_w[static_cast<size_t>(i)],
                4e-3);
  }
}

TEST(Routing, RouterLogitsInF32) {
  const int64_t T = 9, H = 200, E = 12;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T * (H + 1))), w(static_cast<size_t>(E * H)),
      b(static_cast<size_t>(E));
  for (float& v : x) v = n(rng);
  for (float& v : w) v = n(rng) * 0.1f;
  for (float& v : b) v = n(rng);
  // bf16 weights, x with a row stride of H + 1
  std::vector<uint16_t> wb(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    wb[i] = ckpt_test::bf16_bits(w[i]);
    w[i] = ckpt_test::from_bf16(wb[i]);
  }
  std::vector<float> xs(static_cast<size_t>(T * H));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      xs[static_cast<size_t>(t * H + h)] = x[static_cast<size_t>(t * (H + 1) + h)];
  std::vector<float> logits(static_cast<size_t>(T * E));
  router_logits(TensorView::of(x.data(), DType::f32, {T, H}, H + 1),
                TensorView::of(wb.data(), DType::bf16, {E, H}),
                TensorView::of(b.data(), DType::f32, {E}),
                MutableTensorView::of(logits.data(), DType::f32, {T, E}));
  const std::vector<double> want = ckpt_test::logits_reference(xs, w, b, T, H, E);
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(logits[i], want[i], 1e-5 * std::sqrt(static_cast<double>(H))) << i;
}

TEST(Routing, RejectsBadArguments) {
  const auto message = [](const RoutingConfig& c) {
    try {
      check_routing_config(c);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_THAT(message(config(8, 9, Gating::softmax, false)), HasSubstr("top_k: expected 1 to 8"));
  EXPECT_THAT(message(config(8, 2, Gating::softmax, false, 1.0f, 3, 1)),
              HasSubstr("groups: expected a divisor of 8"));
  EXPECT_THAT(message(config(8, 4, Gating::softmax, false, 1.0f, 4, 1)),
              HasSubstr("hold fewer than top_k = 4"));
  EXPECT_THAT(message(config(8, 2, Gating::softmax, false, NAN)), HasSubstr("scaling"));
  EXPECT_THAT(message(config(8, 1, static_cast<Gating>(9), false)), HasSubstr("gating"));
  std::vector<float> logits(16);
  std::vector<int32_t> ids(4);
  std::vector<float> w(4);
  try {
    route(TensorView::of(logits.data(), DType::f32, {2, 8}), {},
          config(16, 2, Gating::softmax, false),
          MutableTensorView::of(ids.data(), DType::i32, {2, 2}),
          MutableTensorView::of(w.data(), DType::f32, {2, 2}));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("logits: expected shape [T, 16]"));
  }
  try {
    router_logits(TensorView::of(logits.data(), DType::f32, {2, 8}),
                  TensorView::of(logits.data(), DType::f32, {2, 7}), {},
                  MutableTensorView::of(w.data(), DType::f32, {2, 2}));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("router weight: expected shape [E, 8]"));
  }
}

}  // namespace
