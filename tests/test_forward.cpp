// forward() against the independent exact reference (tests/reference) on a grid of shapes,
// dtypes, activations and routings, the float reference for the cost of int8 activations, the
// library's own reference_forward(), and negative tests that show the comparison can fail.
//
// The tolerance formula is documented at moe_test::matches_exact (test_util.hpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "reference/reference.hpp"
#include "test_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace {

using moe_test::Case;
using moe_test::CaseSpec;
using moe_test::DType;
using moe_test::Routing;
using w4a8moe::Activation;

w4a8moe::Context& shared_context() {
  static w4a8moe::Context context;  // the hardware's thread count
  return context;
}

struct Named {
  std::string name;
  CaseSpec spec;
};

void PrintTo(const Named& n, std::ostream* os) { *os << moe_test::describe(n.spec); }

std::string test_name(const testing::TestParamInfo<Named>& info) {
  std::string s = info.param.name;
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

// Runs forward() with the active kernel set (CTest runs the suite once per set, capping the ISA
// with W4A8MOE_ISA) on the case and compares with the exact reference.
void expect_matches_exact(const CaseSpec& spec) {
  SCOPED_TRACE(moe_test::describe(spec) + " kernel_set=" + w4a8moe::active_kernel_set());
  const Case c = moe_test::make_case(spec);
  const moe_test::PackedPair packed = moe_test::pack(c);
  const moe_test::Output out = moe_test::run_forward(c, packed, shared_context());
  EXPECT_TRUE(moe_test::matches_exact(c, out.to_float(), moe_ref::exact_forward(c.problem)));
}

// ---- the grid of vLLM's dynamic 4-bit int MoE CPU test (OriginalGrid) -------------------------
//
// tokens 1, 2, 64, 128 x (I, H, E, top-k, g) x x dtype f32, bf16, f16.

std::vector<Named> original_grid() {
  struct Shape {
    int64_t inter, hidden, experts, top_k;
    int group;
  };
  const Shape shapes[] = {{256, 512, 8, 2, 128}, {256, 512, 8, 2, 64},  {256, 512, 8, 2, -1},
                          {512, 256, 8, 4, 128}, {512, 512, 8, 2, 128}, {768, 2048, 8, 2, 128},
                          {768, 2048, 16, 4, 64}};
  std::vector<Named> out;
  uint64_t seed = 1000;
  for (const Shape& sh : shapes)
    for (const int64_t tokens : {1, 2, 64, 128})
      for (const DType dt : {DType::f32, DType::bf16, DType::f16}) {
        CaseSpec s{tokens, sh.hidden, sh.inter, sh.experts, sh.top_k, sh.group, dt};
        s.seed = ++seed;
        const std::string g = sh.group < 0 ? "cw" : std::to_string(sh.group);
        // Built with += (GCC 12 reports a false -Wrestrict for "literal" + std::string&&).
        std::string name = "T";
        name += std::to_string(tokens);
        for (const auto& [tag, value] : {std::pair{"_I", sh.inter}, std::pair{"_H", sh.hidden},
                                         std::pair{"_E", sh.experts}, std::pair{"_K", sh.top_k}})
          (name += tag) += std::to_string(value);
        ((name += "_g") += g) += "_";
        name += w4a8moe::dtype_name(dt);
        out.push_back({name, s});
      }
  return out;
}

class OriginalGrid : public testing::TestWithParam<Named> {};

TEST_P(OriginalGrid, MatchesExactReference) { expect_matches_exact(GetParam().spec); }

INSTANTIATE_TEST_SUITE_P(Forward, OriginalGrid, testing::ValuesIn(original_grid()), test_name);

// ---- beyond vLLM's grid -------------------------------------------------------------------------

CaseSpec base(int64_t tokens = 64) {  // K 2
  return {.tokens = tokens, .hidden = 512, .inter = 256, .experts = 8, .group_size = 128};
}

std::vector<Named> feature_grid() {
  std::vector<Named> out;
  uint64_t seed = 5000;
  const auto add = [&](const std::string& name, CaseSpec s) {
    s.seed = ++seed;
    out.push_back({name, s});
  };

  // every activation, in f32 and bf16, groupwise and channelwise
  const std::pair<Activation, const char*> acts[] = {{Activation::swiglustep, "swiglustep"},
                                                     {Activation::swigluoai, "swigluoai"},
                                                     {Activation::silu, "silu"},
                                                     {Activation::gelu, "gelu"},
                                                     {Activation::gelu_tanh, "gelu_tanh"}};
  for (const auto& [act, name] : acts) {
    CaseSpec s = base();
    s.activation = act;
    add(std::string("act_") + name + "_f32", s);
    s.x_dtype = DType::bf16;
    s.group_size = -1;
    add(std::string("act_") + name + "_bf16_channelwise", s);
  }
  {  // non-default alpha and limit, small enough that the clamps bite
    CaseSpec s = base();
    s.activation = Activation::swigluoai;
    s.alpha = 1.25f;
    s.limit = 1.5f;
    add("swigluoai_alpha1_25_limit1_5", s);
    s.activation = Activation::swiglustep;
    s.limit = 0.75f;
    add("swiglustep_limit0_75", s);
  }

  // group sizes
  {
    CaseSpec s = base();
    s.group_size = 32;
    add("g32", s);
    s.hidden = 384;
    s.inter = 192;
    s.group_size = 96;
    add("g96_H384_I192", s);
    s.hidden = 512;
    s.inter = 256;
    s.group_size = 256;
    add("g256", s);
    s.hidden = 1024;
    s.inter = 256;
    s.group_size = 256;
    s.x_dtype = DType::f16;
    add("g256_H1024_f16", s);
  }

  // biases, in each float dtype
  for (const DType d : {DType::f32, DType::bf16, DType::f16}) {
    CaseSpec s = base();
    s.bias = true;
    s.bias_dtype = d;
    add(std::string("bias_") + w4a8moe::dtype_name(d), s);
  }
  {
    CaseSpec s = base();
    s.bias = true;
    s.group_size = -1;
    add("bias_channelwise", s);
  }

  // router weight on the input
  {
    CaseSpec s = base();
    s.apply_router_weight_on_input = true;
    add("router_weight_on_input", s);
    s.bias = true;
    s.x_dtype = DType::bf16;
    s.activation = Activation::swigluoai;
    add("router_weight_on_input_bias_swigluoai_bf16", s);
  }

  // gate/up interleaved (scales and biases interleaved with the rows), nibble-packed input
  {
    CaseSpec s = base();
    s.interleaved = true;
    add("interleaved", s);
    s.bias = true;
    s.group_size = 64;
    s.activation = Activation::swigluoai;
    add("interleaved_bias_g64_swigluoai", s);
    s = base();
    s.nibbles = true;
    add("nibbles", s);
    s.interleaved = true;
    s.bias = true;
    s.group_size = -1;
    add("nibbles_interleaved_bias_channelwise", s);
  }

  // dtypes of ids, scales and router weights
  {
    CaseSpec s = base();
    s.ids_dtype = DType::i64;
    add("ids_i64", s);
    s = base();
    s.scale_dtype = DType::bf16;
    add("scales_bf16", s);
    s.scale_dtype = DType::f16;
    add("scales_f16", s);
    s.group_size = -1;
    add("scales_f16_channelwise", s);
    s = base();
    s.topk_weights_dtype = DType::bf16;
    add("topk_weights_bf16", s);
    s.topk_weights_dtype = DType::f16;
    s.x_dtype = DType::f16;
    add("topk_weights_f16_x_f16", s);
  }

  // routing
  {
    CaseSpec s = base();
    s.routing = Routing::repeated;
    add("repeated_ids", s);
    s = base();
    s.experts = 8;
    s.routing = Routing::all_experts;
    add("top_k_equals_E8", s);
    s.experts = 4;
    s.tokens = 3;
    add("top_k_equals_E4_T3", s);
    s = base();
    s.routing = Routing::sparse;
    add("experts_without_tokens", s);
    s = base(300);
    s.routing = Routing::skewed;
    add("skewed_T300", s);
    s = base();
    s.top_k = 1;
    add("top_k_1", s);
    s = base();
    s.experts = 1;
    s.top_k = 1;
    add("one_expert", s);
  }

  // odd shapes (channelwise: the input dimension need not be a multiple of 32)
  {
    CaseSpec s = base();
    s.group_size = -1;
    s.hidden = 200;
    s.inter = 72;
    add("channelwise_H200_I72", s);
    s.nibbles = true;
    add("channelwise_H200_I72_nibbles", s);
    s.nibbles = false;
    s.hidden = 97;
    s.inter = 45;
    s.x_dtype = DType::bf16;
    add("channelwise_H97_I45_bf16", s);
    s = base();
    s.hidden = 160;
    s.inter = 96;
    s.group_size = 32;
    s.tokens = 5;
    add("g32_H160_I96_T5", s);
  }

  // token counts and x row stride
  {
    CaseSpec s = base(1);
    add("T1", s);
    s = base(300);
    s.x_dtype = DType::bf16;
    add("T300_bf16", s);
    s = base(17);
    s.x_stride_extra = 24;
    add("x_row_stride_H_plus_24", s);
    s.x_dtype = DType::f16;
    s.x_stride_extra = 1;
    add("x_row_stride_H_plus_1_f16", s);
  }

  // extreme weights: only -8 and 7
  {
    CaseSpec s = base();
    s.weight_values = moe_test::WeightValues::extremes;
    add("weights_extremes", s);
    s.nibbles = true;
    s.group_size = -1;
    add("weights_extremes_nibbles_channelwise", s);
  }

  // everything at once
  {
    add("everything_at_once", {.tokens = 33,
                               .hidden = 384,
                               .inter = 192,
                               .experts = 6,
                               .top_k = 3,
                               .group_size = 96,
                               .x_dtype = DType::f16,
                               .scale_dtype = DType::bf16,
                               .topk_weights_dtype = DType::bf16,
                               .bias_dtype = DType::f16,
                               .ids_dtype = DType::i64,
                               .activation = Activation::swigluoai,
                               .alpha = 1.5f,
                               .limit = 5.0f,
                               .bias = true,
                               .apply_router_weight_on_input = true,
                               .interleaved = true,
                               .nibbles = true,
                               .routing = Routing::repeated,
                               .x_stride_extra = 8});
  }
  {  // MXFP4 weights: gpt-oss's shape of layer (interleaved, biases, swigluoai) and plain ones
    CaseSpec s = base();
    s.group_size = 32;
    s.mxfp4 = true;
    add("mxfp4_silu_f32", s);
    s.tokens = 1;
    add("mxfp4_one_token", s);
    s.tokens = 37;
    s.x_dtype = DType::bf16;
    s.activation = Activation::swigluoai;
    s.bias = true;
    s.interleaved = true;
    add("mxfp4_gpt_oss_like_bf16", s);
    s.apply_router_weight_on_input = true;
    s.routing = Routing::repeated;
    add("mxfp4_router_on_input_repeated", s);
  }
  {  // int4 with zero points (AWQ, GPTQ, asymmetric compressed-tensors): groups and channelwise
    CaseSpec s = base();
    s.group_size = 32;
    s.zero_points = true;
    add("zero_points_g32", s);
    s.tokens = 1;
    add("zero_points_one_token", s);
    s.tokens = 29;
    s.group_size = 128;
    s.nibbles = true;
    s.x_dtype = DType::bf16;
    s.scale_dtype = DType::f16;
    add("zero_points_g128_nibbles", s);
    s.group_size = -1;
    s.bias = true;
    s.apply_router_weight_on_input = true;
    s.activation = Activation::gelu;
    add("zero_points_channelwise_router_on_input", s);
  }
  {  // an input order (act-order checkpoints): each expert gathers x by its own permutation
    CaseSpec s = base();
    s.group_size = 32;
    s.input_order = true;
    add("input_order_g32", s);
    s.tokens = 1;
    add("input_order_one_token", s);
    s.tokens = 41;
    s.zero_points = true;
    s.group_size = 128;
    s.x_dtype = DType::bf16;
    s.routing = Routing::repeated;
    add("input_order_zero_points_g128_bf16_repeated", s);
    s.group_size = -1;
    s.zero_points = false;
    s.apply_router_weight_on_input = true;
    s.interleaved = true;
    s.bias = true;
    s.x_stride_extra = 3;
    add("input_order_channelwise_router_on_input_interleaved", s);
    s = base(19);
    s.hidden = 200;
    s.inter = 72;
    s.group_size = -1;
    s.input_order = true;
    add("input_order_H200_I72_padded_columns", s);
  }
  return out;
}

class FeatureGrid : public testing::TestWithParam<Named> {};

TEST_P(FeatureGrid, MatchesExactReference) { expect_matches_exact(GetParam().spec); }

INSTANTIATE_TEST_SUITE_P(Forward, FeatureGrid, testing::ValuesIn(feature_grid()), test_name);

// ---- the float reference: what the int8 activations cost ---------------------------------------
//
// Per-row asymmetric int8 has a step of (max - min) / 255 per row: for N(0, 1) activations about
// 0.026, i.e. a relative RMS noise of about 0.75% on x and 1-1.5% on the heavier-tailed
// intermediate. Measured on this data: 0.9% to 2%. The bound leaves room for that, and no more:
// a missing zero point or a swapped gate/up gives errors of order one.
constexpr double kMaxFloatNrmse = 0.03;

TEST(ForwardFloatReference, Int8ActivationsCostLittle) {
  CaseSpec specs[4];
  specs[0] = base();
  specs[1] = base();
  specs[1].group_size = -1;
  specs[1].activation = Activation::swigluoai;
  specs[1].bias = true;
  specs[2] = base(16);
  specs[2].inter = 768;
  specs[2].hidden = 2048;
  specs[2].x_dtype = DType::bf16;
  specs[3] = base();
  specs[3].activation = Activation::gelu;
  specs[3].apply_router_weight_on_input = true;
  uint64_t seed = 77;
  for (CaseSpec& s : specs) {
    s.seed = ++seed;
    SCOPED_TRACE(moe_test::describe(s));
    const Case c = moe_test::make_case(s);
    const moe_test::Output out = moe_test::run_forward(c, moe_test::pack(c), shared_context());
    EXPECT_TRUE(
        moe_test::matches_float(out.to_float(), moe_ref::float_forward(c.problem), kMaxFloatNrmse));
  }
}

// ---- the library's own reference_forward() against the independent one ------------------------

TEST(LibraryReference, MatchesIndependentReference) {
  std::vector<CaseSpec> specs;
  for (int act = 0; act <= 4; ++act) {
    CaseSpec s = base(8);
    s.activation = static_cast<Activation>(act);
    s.group_size = act % 2 == 0 ? 128 : -1;
    specs.push_back(s);
  }
  {
    CaseSpec s = base(8);
    s.interleaved = true;
    s.bias = true;
    s.bias_dtype = DType::bf16;
    s.x_dtype = DType::bf16;
    s.scale_dtype = DType::f16;
    s.apply_router_weight_on_input = true;
    s.routing = Routing::repeated;
    specs.push_back(s);
    s.nibbles = true;
    s.ids_dtype = DType::i64;
    s.x_stride_extra = 5;
    s.x_dtype = DType::f16;
    specs.push_back(s);
  }
  {
    CaseSpec s = base(4);
    s.hidden = 200;
    s.inter = 72;
    s.group_size = -1;
    specs.push_back(s);
  }
  {  // the library's reference decodes MXFP4 itself (e2m1 codes, e8m0 scales)
    CaseSpec s = base(8);
    s.group_size = 32;
    s.mxfp4 = true;
    s.interleaved = true;
    s.bias = true;
    specs.push_back(s);
  }
  {  // and applies zero points itself
    CaseSpec s = base(8);
    s.group_size = 64;
    s.zero_points = true;
    s.interleaved = true;
    specs.push_back(s);
    s.input_order = true;  // and gathers x by w13's input order
    specs.push_back(s);
  }
  uint64_t seed = 300;
  for (CaseSpec& s : specs) {
    s.seed = ++seed;
    SCOPED_TRACE(moe_test::describe(s));
    const Case c = moe_test::make_case(s);
    const moe_test::Output out = moe_test::run_library_reference(c);
    EXPECT_TRUE(moe_test::matches_exact(c, out.to_float(), moe_ref::exact_forward(c.problem)));
  }
}

// ---- the comparison can fail -------------------------------------------------------------------
//
// Each of these feeds the comparison something wrong and asserts that it says so: a test that
// would pass for a zero output or the wrong activation is not a test.

class ComparisonRejects : public testing::Test {
 protected:
  void SetUp() override {
    spec_ = base(16);
    spec_.bias = true;
    spec_.seed = 4242;
    ASSERT_NO_FATAL_FAILURE(run(spec_));
  }

  // Runs the case of `spec` into case_ and got_, which must pass the comparison.
  void run(const CaseSpec& spec) {
    case_ = moe_test::make_case(spec);
    got_ = moe_test::run_forward(case_, moe_test::pack(case_), shared_context()).to_float();
    ASSERT_TRUE(moe_test::matches_exact(case_, got_, moe_ref::exact_forward(case_.problem)));
  }

  // The exact reference of the same case with one thing changed.
  moe_ref::ExactResult changed(const std::function<void(moe_ref::Problem&)>& change,
                               const moe_ref::ExactOptions& options = {}) {
    moe_ref::Problem p = case_.problem;
    change(p);
    return moe_ref::exact_forward(p, options);
  }

  CaseSpec spec_;
  Case case_;
  std::vector<float> got_;
};

TEST_F(ComparisonRejects, AllZeroOutput) {
  const std::vector<float> zeros(got_.size(), 0.0f);
  EXPECT_FALSE(moe_test::matches_exact(case_, zeros, moe_ref::exact_forward(case_.problem)));
  EXPECT_FALSE(
      moe_test::matches_float(zeros, moe_ref::float_forward(case_.problem), kMaxFloatNrmse));
}

TEST_F(ComparisonRejects, WrongActivation) {
  // The library ran silu. (swiglustep equals silu until its limit clamps: give it a small one.)
  for (const Activation wrong :
       {Activation::gelu, Activation::gelu_tanh, Activation::swigluoai, Activation::swiglustep}) {
    SCOPED_TRACE(w4a8moe::activation_name(wrong));
    EXPECT_FALSE(moe_test::matches_exact(case_, got_, changed([&](moe_ref::Problem& p) {
                                           p.activation = static_cast<int>(wrong);
                                           p.limit = 1.0f;
                                         })));
  }
  // The limit and alpha matter too.
  CaseSpec oai = spec_;
  oai.activation = Activation::swigluoai;
  ASSERT_NO_FATAL_FAILURE(run(oai));
  EXPECT_FALSE(
      moe_test::matches_exact(case_, got_, changed([](moe_ref::Problem& p) { p.alpha = 1.5f; })));
  EXPECT_FALSE(
      moe_test::matches_exact(case_, got_, changed([](moe_ref::Problem& p) { p.limit = 1.0f; })));
}

TEST_F(ComparisonRejects, GeluTanhForExactGelu) {
  // The two GELU forms differ by at most about 2e-4 absolute: the tolerance still tells them
  // apart.
  CaseSpec gelu = spec_;
  gelu.activation = Activation::gelu;
  ASSERT_NO_FATAL_FAILURE(run(gelu));
  EXPECT_FALSE(moe_test::matches_exact(case_, got_, changed([](moe_ref::Problem& p) {
                                         p.activation = static_cast<int>(moe_ref::Act::gelu_tanh);
                                       })));
}

TEST_F(ComparisonRejects, SwappedGateAndUp) {
  moe_ref::ExactOptions swapped;
  swapped.swap_gate_up = true;
  EXPECT_FALSE(
      moe_test::matches_exact(case_, got_, moe_ref::exact_forward(case_.problem, swapped)));
}

TEST_F(ComparisonRejects, InterleavedReadAsHalves) {
  EXPECT_FALSE(moe_test::matches_exact(case_, got_,
                                       changed([](moe_ref::Problem& p) { p.interleaved = true; })));
}

TEST_F(ComparisonRejects, MissingBiasOrRouterWeightOnInput) {
  EXPECT_FALSE(moe_test::matches_exact(case_, got_,
                                       changed([](moe_ref::Problem& p) { p.w2_bias.clear(); })));
  EXPECT_FALSE(moe_test::matches_exact(case_, got_,
                                       changed([](moe_ref::Problem& p) { p.w13_bias.clear(); })));
  EXPECT_FALSE(moe_test::matches_exact(
      case_, got_, changed([](moe_ref::Problem& p) { p.apply_router_weight_on_input = true; })));
}

TEST_F(ComparisonRejects, InputOrderIgnoredOrOneSwap) {
  // w13 packed with input orders, against references that ignore them or swap two inputs of one
  // expert in use
  CaseSpec s = spec_;
  s.input_order = true;
  s.group_size = 32;
  ASSERT_NO_FATAL_FAILURE(run(s));
  EXPECT_FALSE(moe_test::matches_exact(
      case_, got_, changed([](moe_ref::Problem& p) { p.w13_input_order.clear(); })));
  EXPECT_FALSE(
      moe_test::matches_exact(case_, got_, changed([&](moe_ref::Problem& p) {
                                const int64_t e = p.ids[0];
                                std::swap(p.w13_input_order[static_cast<size_t>(e * s.hidden)],
                                          p.w13_input_order[static_cast<size_t>(e * s.hidden + 1)]);
                              })));
}

TEST_F(ComparisonRejects, OneScaleOff) {
  // A single w2 scale of one expert in use 1% off: only that row's outputs change, slightly.
  const int64_t e = case_.problem.ids[0];
  const int64_t groups = case_.spec.inter / case_.spec.group_size;
  EXPECT_FALSE(moe_test::matches_exact(case_, got_, changed([&](moe_ref::Problem& p) {
                                         p.w2_scale[static_cast<size_t>(e * p.hidden * groups)] *=
                                             1.01f;
                                       })));
}

TEST_F(ComparisonRejects, OneElementPerturbed) {
  // 1e-3 on one element (of outputs of order one) without a requantization allowance: far
  // below bf16 resolution, far above f32 rounding.
  const moe_ref::ExactResult ref = moe_ref::exact_forward(case_.problem);
  const auto it = std::find(ref.allowance.begin(), ref.allowance.end(), 0.0);
  ASSERT_NE(it, ref.allowance.end());
  std::vector<float> bad = got_;
  bad[static_cast<size_t>(it - ref.allowance.begin())] += 1e-3f;
  EXPECT_FALSE(moe_test::matches_exact(case_, bad, ref));
  std::vector<float> nan = got_;
  nan[7] = std::nanf("");
  EXPECT_FALSE(moe_test::matches_exact(case_, nan, moe_ref::exact_forward(case_.problem)));
}

TEST_F(ComparisonRejects, OutputsNotOfOrderOne) {
  // Scales 1e-4 times smaller give outputs near 1e-4 (the data of vLLM's test): the helper
  // refuses to call such a comparison a pass, whatever the library returns.
  Case tiny = case_;
  for (float& s : tiny.problem.w2_scale) s *= 1e-4f;
  tiny.problem.w2_bias.assign(tiny.problem.w2_bias.size(), 0.0f);
  const moe_ref::ExactResult ref = moe_ref::exact_forward(tiny.problem);
  std::vector<float> same(ref.out.begin(), ref.out.end());
  EXPECT_FALSE(moe_test::matches_exact(tiny, same, ref));
  moe_test::ExactCheck unchecked;
  unchecked.check_magnitude = false;
  EXPECT_TRUE(moe_test::matches_exact(tiny, same, ref, unchecked));
}

}  // namespace
