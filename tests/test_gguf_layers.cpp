// GGUF layers: converted types within their error bounds, MXFP4 taken exactly, the refusals of
// --exact and of types w4a8moe cannot convert, whole layers of every model family against the
// independent references (checkpoint_families), ranges of experts, shared experts, and models
// split in several files.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint_families.hpp"
#include "checkpoint_test_util.hpp"
#include "checkpoint_writers.hpp"
#include "io/checkpoint.hpp"
#include "io/ggml_types.hpp"

namespace {

using namespace ckpt_test;
using namespace w4a8moe;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------------------------
// Conversions

TEST(Gguf, ConvertedTypesStayWithinOneQuantizationStep) {
  for (const uint32_t type :
       {kTF32, kTF16, kTBF16, kTQ8_0, kTQ4_1, kTQ5_0, kTQ4_K, kTQ5_K, kTQ6_K}) {
    SCOPED_TRACE(io::ggml_type_label(type));
    TempDir dir;
    GgufSpec spec{.layers = 1, .H = 256, .I = 256, .E = 2};
    spec.types[0] = spec.types[1] = spec.types[2] = type;
    GgufModel g = make_gguf(spec);
    g.writer.write(dir / "m.gguf");
    const auto source = io::open_layer(dir / "m.gguf", 0, {});
    EXPECT_EQ(source->info().w13_scale_dtype, DType::f32);
    const Loaded w = load_all(*source);
    for (int which = 0; which < 3; ++which) {
      // the file's values [E, rows, cols] vs the loaded int4 * scale
      const std::vector<float>& file = g.floats[which][0];
      double err_sq = 0, ref_sq = 0;
      for (int64_t e = 0; e < spec.E; ++e)
        for (int64_t r = 0; r < 256; ++r)
          for (int64_t k = 0; k < 256; ++k) {
            const int64_t row = which == 2 ? e * 256 + r : e * 512 + (which == 1 ? 256 : 0) + r;
            const auto li = static_cast<size_t>(row * 256 + k);
            const std::vector<int8_t>& v = which == 2 ? w.w2 : w.w13;
            const std::vector<float>& s = which == 2 ? w.w2_s : w.w13_s;
            const double scale = static_cast<double>(s[static_cast<size_t>(row * 8 + k / 32)]);
            const double got = v[li] * scale;
            const double want =
                static_cast<double>(file[static_cast<size_t>((e * 256 + r) * 256 + k)]);
            // q4_0 rule: step |s|; the largest positive value may clamp from 8 to 7: one step
            ASSERT_LE(std::fabs(got - want), std::fabs(scale) * (1 + 1e-6) + 1e-12)
                << "tensor " << which << " expert " << e << " [" << r << ", " << k << "]";
            err_sq += (got - want) * (got - want);
            ref_sq += want * want;
          }
      const io::Conversion c = source->conversions()[static_cast<size_t>(which)];
      EXPECT_FALSE(c.exact);
      EXPECT_EQ(c.source, io::ggml_type_label(type));
      EXPECT_NEAR(c.relative_rms(), std::sqrt(err_sq / ref_sq), 1e-3 * std::sqrt(err_sq / ref_sq));
      EXPECT_GT(c.relative_rms(), 0.0);
      EXPECT_LT(c.relative_rms(), 0.2);
    }
  }
}

// MXFP4 (gpt-oss GGUFs) packs as itself: the loaded codes and exponents mean exactly the file's
// values, with --exact too. Gate and up must both be MXFP4 for w13 to be (else the MXFP4 one of
// them is converted like any other type), down goes its own way.
TEST(Gguf, Mxfp4IsTakenExactly) {
  struct Mix {
    uint32_t gate, up, down;
    bool w13_exact, w2_exact;
  };
  for (const Mix mix :
       {Mix{kTMXFP4, kTMXFP4, kTMXFP4, true, true}, Mix{kTQ8_0, kTMXFP4, kTMXFP4, false, true},
        Mix{kTMXFP4, kTMXFP4, kTQ4_0, true, true}}) {
    SCOPED_TRACE(io::ggml_type_label(mix.gate) + "/" + io::ggml_type_label(mix.up) + "/" +
                 io::ggml_type_label(mix.down));
    TempDir dir;
    GgufSpec spec{.layers = 1, .H = 256, .I = 128, .E = 4};
    spec.types[0] = mix.gate;
    spec.types[1] = mix.up;
    spec.types[2] = mix.down;
    GgufModel g = make_gguf(spec);
    g.writer.write(dir / "m.gguf");
    io::LoadOptions options;
    options.require_exact = mix.w13_exact && mix.w2_exact;
    const auto source = io::open_layer(dir / "m.gguf", 0, options);
    const io::LayerInfo& info = source->info();
    EXPECT_EQ(info.group_size, 32);
    EXPECT_EQ(info.w13_format == WeightFormat::mxfp4, mix.gate == kTMXFP4 && mix.up == kTMXFP4);
    EXPECT_EQ(info.w2_format == WeightFormat::mxfp4, mix.down == kTMXFP4);
    const Loaded w = load_all(*source);
    for (int which = 0; which < 3; ++which) {
      const bool exact = which == 2 ? mix.w2_exact : mix.w13_exact;
      EXPECT_EQ(source->conversions()[static_cast<size_t>(which)].exact, exact) << which;
      const uint32_t type = which == 0 ? mix.gate : which == 1 ? mix.up : mix.down;
      if (!exact || type != kTMXFP4) continue;  // Q4_0's exactness is tested above
      const std::vector<float>& file = g.floats[which][0];
      const int64_t rows = which == 2 ? 256 : 128, cols = which == 2 ? 128 : 256;
      for (int64_t e = 0; e < spec.E; ++e)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < cols; ++k) {
            const int64_t row = which == 2 ? e * 256 + r : e * 256 + (which == 1 ? 128 : 0) + r;
            const std::vector<int8_t>& v = which == 2 ? w.w2 : w.w13;
            const std::vector<float>& sc = which == 2 ? w.w2_s : w.w13_s;
            ASSERT_EQ(static_cast<float>(v[static_cast<size_t>(row * cols + k)]) *
                          sc[static_cast<size_t>(row * (cols / 32) + k / 32)],
                      file[static_cast<size_t>((e * rows + r) * cols + k)])
                << "tensor " << which << " expert " << e << " [" << r << ", " << k << "]";
          }
    }
    check_layer(dir / "m.gguf", 0, RouteSpec{"softmax", true});
  }
}

TEST(Gguf, RefusesConversionsWhenExactIsRequiredAndTypesItCannotConvert) {
  TempDir dir;
  GgufSpec spec{.layers = 1, .H = 256, .I = 256};
  spec.types[2] = kTQ8_0;
  make_gguf(spec).writer.write(dir / "q8.gguf");
  EXPECT_THAT(exact_error(dir / "q8.gguf", 0),
              HasSubstr("tensor 'blk.0.ffn_down_exps.weight' has type Q8_0, which w4a8moe "
                        "does not take exactly (Q4_0 and MXFP4 it does"));
  spec.types[2] = kTIQ2_XXS;
  make_gguf(spec).writer.write(dir / "iq2.gguf");
  EXPECT_THAT(error_of([&] { io::open_layer(dir / "iq2.gguf", 0, {}); }),
              HasSubstr("tensor 'blk.0.ffn_down_exps.weight' has type IQ2_XXS, which w4a8moe "
                        "cannot convert"));
}

// ---------------------------------------------------------------------------------------------
// Whole layers of every model family against the independent references (checkpoint_families)

class GgufFamily : public ::testing::TestWithParam<FamilyRow> {};

TEST_P(GgufFamily, LayerRoutesAndRunsAsTheModel) {
  const FamilyRow& row = GetParam();
  TempDir dir;
  write_and_check_family(family_gguf(row), dir / "m.gguf", row, row.gguf_check);
}

INSTANTIATE_TEST_SUITE_P(Families, GgufFamily, ::testing::ValuesIn(gguf_families()),
                         family_test_name);

TEST(Gguf, ExpertRangesPackTheirBlocksAndAreChecked) {
  TempDir dir;
  GgufSpec spec;
  spec.layers = 1;
  spec.E = 6;
  spec.types[1] = kTQ8_0;  // converted: only the range's rows
  make_gguf(spec).writer.write(dir / "m.gguf");
  check_expert_range(dir / "m.gguf", 0, {0, 1});
  check_expert_range(dir / "m.gguf", 0, {5, 1});
  check_expert_range(dir / "m.gguf", 0, {2, -1});
  check_expert_range(dir / "m.gguf", 0, {0, 6});
  const auto range_error = [&](io::ExpertRange range) {
    io::LoadOptions options;
    options.experts = range;
    return error_of([&] { io::open_layer(dir / "m.gguf", 0, options); });
  };
  EXPECT_EQ(range_error({4, 3}),
            "LoadOptions::experts: expected a range [first, first + count) within the layer's "
            "experts [0, 6) with count >= 1 (or -1: to the last), got first 4, count 3");
  EXPECT_THAT(range_error({-1, 2}), HasSubstr("got first -1, count 2"));
  EXPECT_THAT(range_error({0, 0}), HasSubstr("got first 0, count 0"));
  EXPECT_THAT(range_error({6, -1}), HasSubstr("within the layer's experts [0, 6)"));
  // a shared-expert source is one expert
  io::LoadOptions shared;
  shared.shared_expert = true;
  GgufSpec with_shared = spec;
  with_shared.shared_expert = true;
  make_gguf(with_shared).writer.write(dir / "s.gguf");
  check_expert_range(dir / "s.gguf", 0, {0, 1}, shared);
  shared.experts = {1, 1};
  EXPECT_THAT(error_of([&] { io::open_layer(dir / "s.gguf", 0, shared); }),
              HasSubstr("within the layer's experts [0, 1)"));
}

// ---------------------------------------------------------------------------------------------
// Shared experts

TEST(Gguf, Qwen2MoeSharedExpertWithItsGate) {
  // the shared expert (Q4_0: exact) whose output is scaled by sigmoid(x . ffn_gate_inp_shexp);
  // the routed layer: GgufFamily/Qwen2Moe
  TempDir dir;
  GgufModel g = family_gguf(family("Qwen2Moe"));
  g.writer.write(dir / "q2.gguf");
  io::LoadOptions options;
  options.shared_expert = true;
  const auto shared = io::open_layer(dir / "q2.gguf", 1, options);
  const io::LayerInfo& info = shared->info();
  EXPECT_EQ(info.hidden, 96);
  EXPECT_EQ(info.inter, 160);
  EXPECT_FALSE(info.has_shared_expert);
  EXPECT_EQ(info.w13_scale_dtype, DType::f16);
  ASSERT_EQ(shared->conversions().size(), 3u);
  EXPECT_EQ(shared->conversions()[0].tensor, "blk.1.ffn_gate_shexp.weight");
  EXPECT_EQ(shared->conversions()[2].tensor, "blk.1.ffn_down_shexp.weight");
  for (const io::Conversion& c : shared->conversions()) EXPECT_TRUE(c.exact) << c.tensor;
  const Loaded w = load_all(*shared);
  EXPECT_EQ(w.w13, g.shared[1].w13);
  EXPECT_EQ(w.w2, g.shared[1].w2);
  for (size_t i = 0; i < w.w13_s.size(); ++i)
    ASSERT_EQ(f16_bits(w.w13_s[i]), f16_bits(g.shared[1].w13_s[i])) << i;
  check_shared(dir / "q2.gguf", 1, g.shared[1].router);
}

TEST(Gguf, DeepSeek2SharedExpertConvertedAndAddedAsIs) {
  // no gate: weight 1 for every token; Q8_0 / F16 / BF16 tensors converted with their error
  TempDir dir;
  GgufSpec spec{.arch = "deepseek2", .layers = 1, .H = 64, .I = 64, .E = 8, .K = 2, .Is = 128};
  spec.shared_expert = true;
  spec.shared_types[0] = kTQ8_0;
  spec.shared_types[1] = kTF16;
  spec.shared_types[2] = kTBF16;
  GgufModel g = make_gguf(spec);
  g.writer.write(dir / "ds.gguf");
  io::LoadOptions options;
  options.shared_expert = true;
  const auto shared = io::open_layer(dir / "ds.gguf", 0, options);
  EXPECT_FALSE(shared->info().shared_gate);
  EXPECT_EQ(shared->info().w13_scale_dtype, DType::f32);
  const Loaded w = load_all(*shared);
  const char* const types[3] = {"Q8_0", "F16", "BF16"};
  for (int which = 0; which < 3; ++which) {
    const io::Conversion c = shared->conversions()[static_cast<size_t>(which)];
    EXPECT_FALSE(c.exact);
    EXPECT_EQ(c.source, types[which]);
    EXPECT_GT(c.relative_rms(), 0.0);
    EXPECT_LT(c.relative_rms(), 0.2);
    // the loaded values are quantize_weights of the file's values
    const std::vector<float>& file = g.shared_floats[which][0];
    const int64_t rows = which == 2 ? 64 : 128, cols = which == 2 ? 128 : 64;
    const QuantizedWeights q = quantize_weights(
        TensorView::of(file.data(), DType::f32, {1, rows, cols}), 32, QuantRule::q4_0);
    const int64_t first = which == 1 ? 128 : 0;
    const std::vector<int8_t>& v = which == 2 ? w.w2 : w.w13;
    const std::vector<float>& sc = which == 2 ? w.w2_s : w.w13_s;
    EXPECT_TRUE(std::equal(q.values.begin(), q.values.end(), v.begin() + first * cols)) << which;
    EXPECT_TRUE(std::equal(q.scales.begin(), q.scales.end(), sc.begin() + first * (cols / 32)))
        << which;
  }
  check_shared(dir / "ds.gguf", 0, {});
  EXPECT_THAT(exact_error(dir / "ds.gguf", 0, options),
              HasSubstr("tensor 'blk.0.ffn_gate_shexp.weight' has type Q8_0, which w4a8moe "
                        "does not take exactly"));
}

TEST(Gguf, SharedExpertMissingOrMalformed) {
  TempDir dir;
  GgufSpec spec{.layers = 1, .H = 64, .I = 64, .E = 4};
  io::LoadOptions options;
  options.shared_expert = true;
  make_gguf(spec).writer.write(dir / "none.gguf");
  EXPECT_FALSE(io::open_layer(dir / "none.gguf", 0, {})->info().has_shared_expert);
  EXPECT_THAT(error_of([&] { io::open_layer(dir / "none.gguf", 0, options); }),
              HasSubstr("layer 0 has no shared expert: tensor 'blk.0.ffn_gate_shexp.weight' is "
                        "missing"));
  const Moe sh = make_moe(64, 96, 1, 1, 5);
  const auto with = [&](std::vector<int64_t> down_ne, uint32_t feed_forward) {
    GgufModel g = make_gguf(spec);
    g.writer.kv_u32("qwen3moe.expert_shared_feed_forward_length", feed_forward);
    g.writer.tensor("blk.0.ffn_gate_shexp.weight", kTQ4_0, {64, 96}, q4_0_tensor(sh, 0));
    g.writer.tensor("blk.0.ffn_up_shexp.weight", kTQ4_0, {64, 96}, q4_0_tensor(sh, 1));
    g.writer.tensor("blk.0.ffn_down_shexp.weight", kTQ4_0, std::move(down_ne), q4_0_tensor(sh, 2));
    g.writer.write(dir / "sh.gguf");
    return error_of([&] { io::open_layer(dir / "sh.gguf", 0, options); });
  };
  EXPECT_EQ(with({96, 64}, 96), "(no error)");
  EXPECT_THAT(with({96, 64}, 128),
              HasSubstr("metadata 'qwen3moe.expert_shared_feed_forward_length' says 128 but "
                        "tensor 'blk.0.ffn_gate_shexp.weight' has 96 rows"));
  EXPECT_THAT(with({64, 96}, 96),
              HasSubstr("tensor 'blk.0.ffn_down_shexp.weight' must have ne "
                        "[96, 64] (GGUF order, innermost first), got [64, 96]"));
}

TEST(Gguf, SplitModel) {
  // three files as gguf-split writes them; any of them names the model
  TempDir dir;
  GgufSpec spec;
  spec.layers = 3;
  const std::vector<GgufWriter> parts = make_gguf(spec).writer.split(3);
  for (int i = 0; i < 3; ++i)
    parts[static_cast<size_t>(i)].write(dir /
                                        ("m-0000" + std::to_string(i + 1) + "-of-00003.gguf"));
  check_layer(dir / "m-00002-of-00003.gguf", 2, RouteSpec{"softmax", true});
  check_layer(dir / "m-00001-of-00003.gguf", 0, RouteSpec{"softmax", true});
  std::filesystem::remove(dir / "m-00003-of-00003.gguf");
  EXPECT_THAT(error_of([&] { io::open_layer(dir / "m-00001-of-00003.gguf", 1, {}); }),
              HasSubstr("m-00003-of-00003.gguf': cannot open the file"));
  std::filesystem::rename(dir / "m-00002-of-00003.gguf", dir / "m.gguf");
  EXPECT_THAT(error_of([&] { io::open_layer(dir / "m.gguf", 1, {}); }),
              HasSubstr("metadata 'split.count' says the model is split in 3 files, but the name "
                        "does not end in -NNNNN-of-3.gguf"));
}

}  // namespace
