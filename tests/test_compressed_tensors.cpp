// compressed-tensors checkpoints, written by the suite's own writer: the pack-quantized
// word layout (compressed-tensors' pack_to_int32), int4 values and scales read back exactly
// (pack-quantized, int-quantized, group and channel strategies), dense BF16 weights quantized on
// load, sharded folders, fused experts (gpt-oss, Llama-4), shared experts, and whole layers of
// every model family against the independent references. Malformed checkpoints:
// test_compressed_tensors_malformed.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint_families.hpp"
#include "checkpoint_test_util.hpp"
#include "checkpoint_writers.hpp"

namespace {

using namespace ckpt_test;
using namespace w4a8moe;
using ::testing::HasSubstr;

std::vector<uint16_t> bits16(const std::vector<uint8_t>& bytes) {
  std::vector<uint16_t> out(bytes.size() / 2);
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

// The loaded int4 values and bf16 scales are the writer's truth `m`, bit for bit.
void expect_as_written(const Loaded& w, const Moe& m) {
  EXPECT_EQ(w.w13, m.w13);
  EXPECT_EQ(w.w2, m.w2);
  EXPECT_EQ(bits16(w.w13_scale_bytes), bf16_of(m.w13_s));
  EXPECT_EQ(bits16(w.w2_scale_bytes), bf16_of(m.w2_s));
}

TEST(CompressedTensors, PackQuantizedWordLayout) {
  // compressed-tensors' pack_to_int32: add 8, element i of a group of eight in bits 4i (least
  // significant first)
  std::vector<int8_t> v = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<int32_t> words = pack_int4_words(v, 1, 16);
  EXPECT_EQ(static_cast<uint32_t>(words[0]), 0x76543210u);
  EXPECT_EQ(static_cast<uint32_t>(words[1]), 0xfedcba98u);
}

TEST(CompressedTensors, PackQuantizedReadsBackExactly) {
  TempDir dir;
  CtSpec spec;
  spec.H = 96;
  CtModel c = make_ct(spec);
  c.writer.write(dir / "ckpt");
  const auto source = io::open_layer(dir / "ckpt", 1, {});
  const io::LayerInfo& info = source->info();
  EXPECT_EQ(info.group_size, 32);
  EXPECT_EQ(info.w13_scale_dtype, DType::bf16);
  EXPECT_EQ(info.inter, 64) << "moe_intermediate_size, not intermediate_size";
  for (const io::Conversion& conv : source->conversions()) {
    EXPECT_TRUE(conv.exact);
    EXPECT_EQ(conv.source, "pack-quantized int4 g32, BF16 scales");
  }
  const Loaded w = load_all(*source);
  const Moe& m = c.layers[1];
  expect_as_written(w, m);
}

TEST(CompressedTensors, IntQuantizedChannelwiseReadsBackExactly) {
  TempDir dir;
  CtSpec spec{.scheme = "int", .strategy = "channel", .layers = 1};
  CtModel c = make_ct(spec);
  c.writer.write(dir / "ckpt");
  const auto source = io::open_layer(dir / "ckpt", 0, {});
  EXPECT_EQ(source->info().group_size, -1);
  EXPECT_EQ(source->conversions()[0].source, "int-quantized int4 channelwise, BF16 scales");
  const Loaded w = load_all(*source);
  expect_as_written(w, c.layers[0]);
  check_layer(dir / "ckpt", 0, RouteSpec{"softmax", true});
}

// The loaded experts are what quantize_weights (group 32, rule q4_0) makes of the file's values
// (`dense`: per expert and projection, [N, K] with rows = outputs).
void expect_quantized_from(const Loaded& w, const std::vector<std::vector<float>>& dense, int64_t E,
                           int64_t H, int64_t I) {
  for (int64_t e = 0; e < E; ++e)
    for (int which = 0; which < 3; ++which) {
      SCOPED_TRACE(::testing::Message() << "expert " << e << " projection " << which);
      const std::vector<float>& file = dense[static_cast<size_t>(e * 3 + which)];
      const int64_t rows = which == 2 ? H : I, cols = which == 2 ? I : H;
      const QuantizedWeights q = quantize_weights(
          TensorView::of(file.data(), DType::f32, {1, rows, cols}), 32, QuantRule::q4_0);
      const int64_t first = which == 2 ? e * H : e * 2 * I + (which == 1 ? I : 0);
      const std::vector<int8_t>& v = which == 2 ? w.w2 : w.w13;
      const std::vector<float>& s = which == 2 ? w.w2_s : w.w13_s;
      EXPECT_TRUE(std::equal(q.values.begin(), q.values.end(), v.begin() + first * cols));
      EXPECT_TRUE(std::equal(q.scales.begin(), q.scales.end(), s.begin() + first * (cols / 32)));
    }
}

TEST(CompressedTensors, DenseBf16IsQuantizedOnLoad) {
  TempDir dir;
  CtSpec spec{.scheme = "bf16", .E = 2, .layers = 1};
  CtModel c = make_ct(spec);
  c.writer.write(dir / "ckpt");
  const auto source = io::open_layer(dir / "ckpt", 0, {});
  expect_quantized_from(load_all(*source), c.dense, spec.E, spec.H, spec.I);
  for (const io::Conversion& conv : source->conversions()) {
    EXPECT_FALSE(conv.exact);
    EXPECT_EQ(conv.source, "BF16");
    EXPECT_GT(conv.relative_rms(), 0.01);
    EXPECT_LT(conv.relative_rms(), 0.2);
  }
  EXPECT_THAT(exact_error(dir / "ckpt", 0),
              HasSubstr("gate_proj.weight' is BF16, which does not map exactly onto int4"));
}

TEST(CompressedTensors, DenseF16AndF32AreQuantizedOnLoad) {
  for (const char* scheme : {"f16", "f32"}) {
    SCOPED_TRACE(scheme);
    TempDir dir;
    CtSpec spec{.scheme = scheme, .E = 3, .layers = 1};
    CtModel c = make_ct(spec);
    c.writer.write(dir / "ckpt");
    const auto source = io::open_layer(dir / "ckpt", 0, {});
    EXPECT_EQ(source->conversions()[0].source, std::string(scheme) == "f16" ? "F16" : "F32");
    expect_quantized_from(load_all(*source), c.dense, spec.E, spec.H, spec.I);
    check_layer(dir / "ckpt", 0, RouteSpec{"softmax", true});
  }
}

// A one-layer checkpoint (H 128, I 96) of each quantized scheme (pack-quantized, int-quantized)
// and strategy (group, channel), symmetric or not, written to a fresh folder:
// check(strategy, model, checkpoint folder).
template <class Check>
void for_each_scheme_and_strategy(bool asymmetric, const Check& check) {
  for (const char* scheme : {"packed", "int"})
    for (const char* strategy : {"group", "channel"}) {
      SCOPED_TRACE(::testing::Message() << scheme << " " << strategy);
      TempDir dir;
      const CtSpec spec{.scheme = scheme,
                        .strategy = strategy,
                        .H = 128,
                        .I = 96,
                        .layers = 1,
                        .asymmetric = asymmetric};
      CtModel c = make_ct(spec);
      c.writer.write(dir / "ckpt");
      check(std::string(strategy), c, dir / "ckpt");
    }
}

TEST(CompressedTensors, EveryFormatAndStrategyReadsBackExactly) {
  for_each_scheme_and_strategy(
      false, [](const std::string& strategy, const CtModel& c, const std::string& ckpt) {
        const auto source = io::open_layer(ckpt, 0, {});
        EXPECT_EQ(source->info().group_size, strategy == "group" ? 32 : -1);
        const Loaded w = load_all(*source);
        expect_as_written(w, c.layers[0]);
        check_layer(ckpt, 0, RouteSpec{"softmax", true});
      });
}

TEST(CompressedTensors, ZeroPointsReadBackExactlyAndRun) {
  // symmetric: false: weight_zero_point packed along the rows (pack-quantized) or int8
  // (int-quantized), element (q - z) * scale taken as int4 with zero points, zero points -8 and 7
  // among them
  for_each_scheme_and_strategy(
      true, [](const std::string&, const CtModel& c, const std::string& ckpt) {
        const auto source = open_exact(ckpt, 0);
        const io::LayerInfo& info = source->info();
        EXPECT_EQ(info.w13_format, WeightFormat::int4_zero_point);
        EXPECT_EQ(info.w2_format, WeightFormat::int4_zero_point);
        for (const io::Conversion& conv : source->conversions()) {
          EXPECT_TRUE(conv.exact);
          EXPECT_THAT(conv.source, HasSubstr(", zero points"));
        }
        const Loaded w = load_all(*source);
        const Moe& m = c.layers[0];
        EXPECT_EQ(w.w13_z, m.w13_z);
        EXPECT_EQ(w.w2_z, m.w2_z);
        Moe less = m;  // the loaded values are value - z
        for (auto [v, z] : {std::pair{&less.w13, &m.w13_z}, std::pair{&less.w2, &m.w2_z}})
          for (size_t i = 0; i < v->size(); ++i)
            (*v)[i] = static_cast<int8_t>((*v)[i] - (*z)[i / (v->size() / z->size())]);
        expect_as_written(w, less);
        check_layer(ckpt, 0, RouteSpec{"softmax", true});
      });
}

TEST(CompressedTensors, GroupAsLongAsTheRowIsOneScalePerRow) {
  // I = 32 = group_size: compressed-tensors writes the down projection's group scales as
  // [H, 1], which is one group of the whole row, not channel-wise scales of another group size.
  TempDir dir;
  CtSpec spec;
  spec.layers = 1;
  spec.I = 32;
  CtModel c = make_ct(spec);
  c.writer.write(dir / "ckpt");
  const auto source = io::open_layer(dir / "ckpt", 0, {});
  EXPECT_EQ(source->info().group_size, 32);
  const Loaded w = load_all(*source);
  EXPECT_EQ(w.w2, c.layers[0].w2);
  EXPECT_EQ(bits16(w.w2_scale_bytes), bf16_of(c.layers[0].w2_s));
  check_layer(dir / "ckpt", 0, RouteSpec{"softmax", true});
}

// ---------------------------------------------------------------------------------------------
// Experts fused in gate_up_proj / down_proj (gpt-oss, Llama-4)

TEST(CompressedTensors, GptOssFusedBf16Experts) {
  // gate_up_proj [E, H, 2I] with gate and up interleaved, biases, a router bias, clamped SwiGLU
  TempDir dir;
  CtSpec spec = family("GptOss").ct.value();
  CtModel c = make_ct(spec);
  c.writer.write(dir / "ckpt");
  const auto source = io::open_layer(dir / "ckpt", 0, {});
  const io::LayerInfo& info = source->info();
  EXPECT_EQ(info.params.activation, Activation::swigluoai);
  EXPECT_FLOAT_EQ(info.params.alpha, 1.702f);
  EXPECT_FLOAT_EQ(info.params.limit, 7.0f);
  EXPECT_EQ(info.routing.gating, Gating::softmax_topk);
  EXPECT_TRUE(info.expert_bias);
  const std::vector<io::Conversion> conv = source->conversions();
  EXPECT_EQ(conv[0].tensor, "model.layers.0.mlp.experts.gate_up_proj (gate, interleaved)");
  EXPECT_EQ(conv[1].tensor, "model.layers.0.mlp.experts.gate_up_proj (up, interleaved)");
  EXPECT_EQ(conv[2].tensor, "model.layers.0.mlp.experts.down_proj");
  for (const io::Conversion& k : conv) {
    EXPECT_FALSE(k.exact);
    EXPECT_EQ(k.source, "BF16");
  }
  const Loaded w = load_all(*source);
  expect_quantized_from(w, c.dense, spec.E, spec.H, spec.I);
  EXPECT_EQ(w.b13, c.layers[0].b13);
  EXPECT_EQ(w.b2, c.layers[0].b2);
  EXPECT_EQ(source->router().bias, c.layers[0].router_bias);
  for (const io::Conversion& k : source->conversions()) EXPECT_GT(k.relative_rms(), 0.01);
  // routing, forward and a range of experts: CtFamily/GptOss
}

TEST(CompressedTensors, GptOssMxfp4Experts) {
  // as gpt-oss ships: gate_up_proj_blocks / _scales, one row per output (interleaved)
  TempDir dir;
  CtSpec spec = family("GptOss").ct.value();
  spec.fused = "mxfp4";
  spec.H = 96;
  spec.I = 64;
  spec.E = 4;
  CtModel c = make_ct(spec);
  c.writer.write(dir / "ckpt");
  // taken exactly (WeightFormat::mxfp4), also where --exact is asked for
  const auto source = open_exact(dir / "ckpt", 0);
  const io::LayerInfo& info = source->info();
  EXPECT_EQ(info.w13_format, WeightFormat::mxfp4);
  EXPECT_EQ(info.w2_format, WeightFormat::mxfp4);
  EXPECT_EQ(info.group_size, 32);
  EXPECT_EQ(source->conversions()[0].tensor,
            "model.layers.0.mlp.experts.gate_up_proj_blocks (gate, interleaved)");
  for (const io::Conversion& conv : source->conversions()) {
    EXPECT_EQ(conv.source, "MXFP4");
    EXPECT_TRUE(conv.exact);
  }
  // what was loaded means exactly what the file says (c.dense: its values, decoded by the
  // writer): 2 * e2m1 * 2^(e - 128) = e2m1 * 2^(e - 127), element for element
  const Loaded w = load_all(*source);
  const int64_t E = spec.E, H = spec.H, I = spec.I;
  for (int64_t e = 0; e < E; ++e)
    for (int which = 0; which < 3; ++which) {
      const std::vector<float>& file = c.dense[static_cast<size_t>(e * 3 + which)];
      const int64_t rows = which == 2 ? H : I, cols = which == 2 ? I : H;
      const int64_t first = which == 2 ? e * H : e * 2 * I + (which == 1 ? I : 0);
      const std::vector<int8_t>& v = which == 2 ? w.w2 : w.w13;
      const std::vector<float>& s = which == 2 ? w.w2_s : w.w13_s;
      for (int64_t n = 0; n < rows; ++n)
        for (int64_t k = 0; k < cols; ++k)
          ASSERT_EQ(static_cast<float>(v[static_cast<size_t>((first + n) * cols + k)]) *
                        s[static_cast<size_t>((first + n) * (cols / 32) + k / 32)],
                    file[static_cast<size_t>(n * cols + k)])
              << "expert " << e << " projection " << which << " [" << n << ", " << k << "]";
    }
  EXPECT_EQ(w.b13, c.layers[0].b13);
  check_layer(dir / "ckpt", 0, RouteSpec{"softmax_topk", false});
  check_expert_range(dir / "ckpt", 0, {3, 1});
}

TEST(CompressedTensors, Llama4FusedExpertsAndSharedExpert) {
  // language_model.model.layers.N.feed_forward: gate_up_proj halves, top-1 sigmoid router
  // weight applied on the input, and the shared expert (bf16, I) added as is
  TempDir dir;
  CtSpec spec = family("Llama4").ct.value();
  spec.fused = "bf16";
  spec.shared = "shared_expert";
  spec.layers = 2;
  spec.I = spec.Is = 96;
  CtModel c = make_ct(spec);
  c.writer.write(dir / "ckpt");
  const auto source = io::open_layer(dir / "ckpt", 1, {});
  const io::LayerInfo& info = source->info();
  EXPECT_EQ(info.model, "llama4_text");
  EXPECT_TRUE(info.params.apply_router_weight_on_input);
  EXPECT_EQ(info.routing.gating, Gating::sigmoid);
  EXPECT_TRUE(info.has_shared_expert);
  EXPECT_EQ(source->conversions()[1].tensor,
            "language_model.model.layers.1.feed_forward.experts.gate_up_proj (up, halves)");
  std::vector<std::vector<float>> layer1(c.dense.begin() + spec.E * 3, c.dense.end());
  expect_quantized_from(load_all(*source), layer1, spec.E, spec.H, spec.I);
  check_layer(dir / "ckpt", 1, RouteSpec{"sigmoid", false});
  check_shared(dir / "ckpt", 1, {});
}

// ---------------------------------------------------------------------------------------------
// Whole layers of every model family against the independent references (checkpoint_families)

class CtFamily : public ::testing::TestWithParam<FamilyRow> {};

TEST_P(CtFamily, LayerRoutesAndRunsAsTheModel) {
  const FamilyRow& row = GetParam();
  TempDir dir;
  write_and_check_family(family_ct(row), dir / "ckpt", row, row.ct_check);
}

INSTANTIATE_TEST_SUITE_P(Families, CtFamily, ::testing::ValuesIn(hf_families()), family_test_name);

// ---------------------------------------------------------------------------------------------
// Shared experts

TEST(CompressedTensors, DeepSeekV3SharedExpertsAddedAsIs) {
  // mlp.shared_experts (pack-quantized like the experts, I = 2 x 64): weight 1 for every token
  TempDir dir;
  CtSpec spec = family("DeepSeekV3").ct.value();
  spec.shards = 2;
  spec.shared = "shared_experts";
  CtModel c = make_ct(spec);
  family("DeepSeekV3").config(c.writer.config);
  c.writer.write(dir / "ckpt");
  EXPECT_TRUE(io::open_layer(dir / "ckpt", 1, {})->info().has_shared_expert);
  io::LoadOptions options;
  options.shared_expert = true;
  const auto shared = io::open_layer(dir / "ckpt", 1, options);
  EXPECT_EQ(shared->info().inter, 128);
  EXPECT_EQ(shared->conversions()[0].tensor, "model.layers.1.mlp.shared_experts.gate_proj");
  EXPECT_EQ(shared->conversions()[0].source, "pack-quantized int4 g32, BF16 scales");
  const Loaded w = load_all(*shared);
  expect_as_written(w, c.shared[1]);
  check_shared(dir / "ckpt", 1, {});
}

TEST(CompressedTensors, Qwen2MoeSharedExpertWithItsGate) {
  // mlp.shared_expert (int-quantized, channelwise) scaled by sigmoid(x . shared_expert_gate)
  TempDir dir;
  CtModel c = family_ct(family("Qwen2Moe"));  // the routed layer: CtFamily/Qwen2Moe
  c.writer.write(dir / "ckpt");
  io::LoadOptions options;
  options.shared_expert = true;
  const Loaded w = load_all(*io::open_layer(dir / "ckpt", 0, options));
  EXPECT_EQ(w.w13, c.shared[0].w13);
  EXPECT_EQ(bits16(w.w2_scale_bytes), bf16_of(c.shared[0].w2_s));
  check_shared(dir / "ckpt", 0, c.shared[0].router);
}

}  // namespace
