// compressed-tensors checkpoints, written by the suite's own writer: the pack-quantized
// word layout (compressed-tensors' pack_to_int32), int4 values and scales read back exactly
// (pack-quantized, int-quantized, group and channel strategies), dense BF16 weights quantized on
// load, sharded folders, whole layers of three model families against the independent references,
// and malformed checkpoints rejected with a message naming the folder.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>

#include "checkpoint_families.hpp"
#include "checkpoint_test_util.hpp"
#include "checkpoint_writers.hpp"

namespace {

using namespace ckpt_test;
using namespace w4a8moe;
using nlohmann::json;
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

TEST(CompressedTensors, EveryFormatAndStrategyReadsBackExactly) {
  for (const char* scheme : {"packed", "int"})
    for (const char* strategy : {"group", "channel"}) {
      SCOPED_TRACE(::testing::Message() << scheme << " " << strategy);
      TempDir dir;
      CtSpec spec{.scheme = scheme, .strategy = strategy, .H = 128, .I = 96, .layers = 1};
      CtModel c = make_ct(spec);
      c.writer.write(dir / "ckpt");
      const auto source = io::open_layer(dir / "ckpt", 0, {});
      EXPECT_EQ(source->info().group_size, std::string(strategy) == "group" ? 32 : -1);
      const Loaded w = load_all(*source);
      expect_as_written(w, c.layers[0]);
      check_layer(dir / "ckpt", 0, RouteSpec{"softmax", true});
    }
}

TEST(CompressedTensors, ZeroPointsReadBackExactlyAndRun) {
  // symmetric: false: weight_zero_point packed along the rows (pack-quantized) or int8
  // (int-quantized), element (q - z) * scale taken as int4 with zero points, zero points -8 and 7
  // among them
  for (const char* scheme : {"packed", "int"})
    for (const char* strategy : {"group", "channel"}) {
      SCOPED_TRACE(::testing::Message() << scheme << " " << strategy);
      TempDir dir;
      CtSpec spec{.scheme = scheme,
                  .strategy = strategy,
                  .H = 128,
                  .I = 96,
                  .layers = 1,
                  .asymmetric = true};
      CtModel c = make_ct(spec);
      c.writer.write(dir / "ckpt");
      const auto source = open_exact(dir / "ckpt", 0);
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
      check_layer(dir / "ckpt", 0, RouteSpec{"softmax", true});
    }
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

// ---------------------------------------------------------------------------------------------
// Malformed checkpoints

class CtMalformed : public ::testing::Test {
 protected:
  // The message of loading layer 0 (open and pack) of the checkpoint `c` writes.
  std::string error(CtModel c, const std::function<void(CtModel&)>& edit = {}) {
    if (edit) edit(c);
    const std::string folder = dir_ / ("ckpt" + std::to_string(count_++));
    c.writer.write(folder);
    const std::string m = error_of([&] {
      const auto source = io::open_layer(folder, 0, {});
      io::pack_layer(*source, 1);
    });
    if (m != "(no error)") {
      EXPECT_THAT(m, HasSubstr(folder)) << "the message must name the checkpoint";
    }
    return m;
  }
  // Edits: tensor `name` removed, or (re)written as `shape` elements that all hold `value`.
  static std::function<void(CtModel&)> erased(const std::string& name) {
    return [name](CtModel& c) { c.writer.tensors.erase(name); };
  }
  template <class T>
  static std::function<void(CtModel&)> filled(const std::string& name, DType dtype,
                                              const std::vector<int64_t>& shape, T value) {
    return [=](CtModel& c) {
      int64_t n = 1;
      for (const int64_t d : shape) n *= d;
      c.writer.add(name, dtype, shape, std::vector<T>(static_cast<size_t>(n), value));
    };
  }
  // The weights entry of the checkpoint's one quantization config group.
  static json& group_weights(CtModel& c) {
    return c.writer.config["quantization_config"]["config_groups"]["group_0"]["weights"];
  }
  CtModel base(const std::string& scheme = "packed") {
    CtSpec spec{.scheme = scheme, .E = 4, .layers = 1};
    return make_ct(spec);
  }
  TempDir dir_;
  int count_ = 0;
};

TEST_F(CtMalformed, TheValidCheckpointLoads) { EXPECT_EQ(error(base()), "(no error)"); }

TEST_F(CtMalformed, ConfigProblems) {
  const std::string folder = dir_ / "empty";
  std::filesystem::create_directories(folder);
  EXPECT_THAT(error_of([&] { io::open_layer(folder, 0, {}); }),
              HasSubstr("config.json is missing"));
  { std::ofstream(folder + "/config.json") << "{\"model_type\": "; }
  EXPECT_THAT(error_of([&] { io::open_layer(folder, 0, {}); }),
              HasSubstr("config.json is not valid JSON"));
  // a number beyond a double's range (nlohmann throws out_of_range, not parse_error)
  { std::ofstream(folder + "/config.json") << "{\"model_type\": \"qwen3_moe\", \"x\": 1E400}"; }
  EXPECT_THAT(error_of([&] { io::open_layer(folder, 0, {}); }),
              HasSubstr("config.json is not valid JSON (a number out of range)"));
  {
    std::ofstream(folder + "/model.safetensors.index.json")
        << "{\"weight_map\": {}, \"n\": -1e999}";
  }
  { std::ofstream(folder + "/config.json") << "{\"model_type\": \"qwen3_moe\"}"; }
  EXPECT_THAT(error_of([&] { io::open_layer(folder, 0, {}); }),
              HasSubstr("model.safetensors.index.json is not valid JSON (a number out of range)"));
  std::filesystem::remove(folder + "/model.safetensors.index.json");
  EXPECT_THAT(error_of([&] { io::open_layer(folder, 0, {}); }),
              HasSubstr("neither model.safetensors nor model.safetensors.index.json"));
  EXPECT_THAT(error(base(), [](CtModel& c) { group_weights(c)["symmetric"] = false; }),
              HasSubstr("gate_proj.weight_zero_point' is missing (config.json "
                        "quantization_config says symmetric: false)"));
  EXPECT_THAT(error(base(), [](CtModel& c) { group_weights(c)["symmetric"] = "no"; }),
              HasSubstr("weights symmetric must be true or false, got \"no\""));
  EXPECT_THAT(error(base(), [](CtModel& c) { group_weights(c)["num_bits"] = 8; }),
              HasSubstr("weights num_bits must be 4, got 8"));
  EXPECT_THAT(
      error(base(),
            [](CtModel& c) { c.writer.config["quantization_config"]["quant_method"] = "gptq"; }),
      HasSubstr("quant_method \"gptq\""));
  EXPECT_THAT(error(base(), [](CtModel& c) { group_weights(c)["group_size"] = 64; }),
              HasSubstr("says group_size 64 but tensor"));
  EXPECT_THAT(error(base(),
                    [](CtModel& c) {
                      c.writer.config["model_type"] = "fancy_moe";
                      c.writer.config.erase("norm_topk_prob");
                    }),
              HasSubstr("model_type 'fancy_moe' is not one whose routing w4a8moe knows"));
  EXPECT_THAT(error(base(), [](CtModel& c) { c.writer.config["hidden_size"] = 128; }),
              HasSubstr("gate_proj.weight_packed' has shape [64, 8], but config.json's sizes (H "
                        "128, I 64) need [64, 16]"));
  EXPECT_THAT(error(base(), [](CtModel& c) { c.writer.config["num_experts"] = 5; }),
              HasSubstr("config.json announces 5 experts, but tensor "
                        "'model.layers.0.mlp.experts.4.gate_proj.weight_packed' is missing"));
  EXPECT_THAT(error(base(), [](CtModel& c) { c.writer.config["num_experts"] = 3; }),
              HasSubstr("holds more than the 3 experts config.json announces"));
  EXPECT_THAT(error(base(),
                    [](CtModel& c) {
                      c.writer.config["topk_method"] = "noaux_tc";
                      c.writer.config["n_group"] = 2;
                      c.writer.config["topk_group"] = 1;
                    }),
              HasSubstr("gate.e_score_correction_bias' is missing"));
  // several config groups: the one targeting "Linear" applies; regex targets are not evaluated
  const auto two_groups = [](CtModel& c, const char* first_target) {
    json& groups = c.writer.config["quantization_config"]["config_groups"];
    groups["group_0"]["targets"] = {first_target};
    groups["group_1"] = groups["group_0"];
    groups["group_1"]["targets"] = {"re:.*self_attn.*"};
    groups["group_1"]["weights"]["group_size"] = 128;
  };
  EXPECT_EQ(error(base(), [&](CtModel& c) { two_groups(c, "Linear"); }), "(no error)");
  EXPECT_THAT(error(base(), [&](CtModel& c) { two_groups(c, "re:.*mlp.experts.*"); }),
              HasSubstr("groups 'group_0' and 'group_1' quantize weights differently"));
  EXPECT_THAT(error(base(), [](CtModel& c) { c.writer.config["hidden_act"] = "relu"; }),
              HasSubstr("hidden_act \"relu\""));
}

TEST_F(CtMalformed, TensorProblems) {
  const std::string p = "model.layers.0.mlp.experts.3.down_proj.";
  EXPECT_THAT(error(base(), erased(p + "weight_packed")),
              HasSubstr("tensor '" + p + "weight_packed' is missing"));
  EXPECT_THAT(
      error(base(),
            [&](CtModel& c) {
              c.writer.add(p + "weight_shape", DType::i64, {2}, std::vector<int64_t>{64, 32});
            }),
      HasSubstr("tensor '" + p + "weight_shape' says [64, 32], expected [64, 64]"));
  // symmetric checkpoints may carry zero points (older writers) only when they are all 0
  EXPECT_EQ(error(base(), filled(p + "weight_zero_point", DType::i32, {8, 2},
                                 static_cast<int32_t>(0x88888888u))),
            "(no error)");
  EXPECT_THAT(error(base(), filled(p + "weight_zero_point", DType::i32, {8, 2}, int32_t{0x11})),
              HasSubstr("weight_zero_point' holds zero point -7 at [0, 0] but config.json "
                        "quantization_config says symmetric weights"));
  EXPECT_THAT(error(base(), filled(p + "weight_zero_point", DType::i32, {64, 1}, int32_t{0})),
              HasSubstr("weight_zero_point' must be I32 [8, 2] (packed along the rows) or I8 "
                        "[64, 2], got I32 [64, 1]"));
  const auto asymmetric = [](const std::string& scheme) {
    return make_ct(CtSpec{.scheme = scheme, .E = 4, .layers = 1, .asymmetric = true});
  };
  EXPECT_EQ(error(asymmetric("int")), "(no error)");
  EXPECT_THAT(
      error(asymmetric("int"), filled(p + "weight_zero_point", DType::i8, {64, 2}, int8_t{8})),
      HasSubstr("tensor '" + p + "weight_zero_point' holds 8 at [0, 0], outside int4 [-8, 7]"));
  EXPECT_THAT(error(asymmetric("packed"), erased(p + "weight_zero_point")),
              HasSubstr("tensor '" + p +
                        "weight_zero_point' is missing (config.json "
                        "quantization_config says symmetric: false)"));
  EXPECT_THAT(error(base(), filled(p + "weight_scale", DType::bf16, {64, 1}, uint16_t{0x3f80})),
              HasSubstr("tensor '" + p + "weight_scale' must be float [64, 2], got BF16 [64, 1]"));
  EXPECT_THAT(error(base(), filled("model.layers.0.mlp.experts.0.down_proj.weight_scale",
                                   DType::bf16, {64, 1}, uint16_t{0x3f80})),
              HasSubstr("implies group size -1"));
  EXPECT_THAT(error(base("int"),
                    [&](CtModel& c) {
                      std::vector<int8_t> v(64 * 64, 1);
                      v[5] = 9;
                      c.writer.add(p + "weight", DType::i8, {64, 64}, v);
                    }),
              HasSubstr("tensor '" + p + "weight' holds 9 at [0, 5], outside int4 [-8, 7]"));
  {  // a weight_g_idx that permutes the inputs needs actorder "group"
    const std::string gate = "model.layers.0.mlp.experts.3.gate_proj.";
    std::vector<int32_t> g(64);
    for (int k = 0; k < 64; ++k) g[static_cast<size_t>(k)] = k % 2;
    EXPECT_THAT(
        error(base(),
              [&](CtModel& c) { c.writer.add(gate + "weight_g_idx", DType::i32, {64}, g); }),
        HasSubstr("tensor '" + gate +
                  "weight_g_idx' permutes the inputs (act-order) but config.json "
                  "quantization_config says no actorder \"group\""));
  }
  EXPECT_THAT(error(base(), erased("model.layers.0.mlp.gate.weight")),
              HasSubstr("tensor 'model.layers.0.mlp.gate.weight' (the router) is missing"));
}

TEST_F(CtMalformed, FusedAndSharedExpertProblems) {
  const auto fused = [](const std::string& type) {
    CtSpec spec = family("GptOss").ct.value();
    spec.fused = type;
    spec.router_bias = false;
    spec.H = spec.I = 64;
    spec.E = 4;
    return make_ct(spec);
  };
  const std::string p = "model.layers.0.mlp.experts.";
  EXPECT_EQ(error(fused("bf16")), "(no error)");
  EXPECT_EQ(error(fused("mxfp4")), "(no error)");
  EXPECT_THAT(error(fused("bf16"), [](CtModel& c) { c.writer.config["model_type"] = "qwen3_moe"; }),
              HasSubstr("model_type 'qwen3_moe' stores its experts fused in '" + p +
                        "gate_up_proj', and w4a8moe knows the order of gate and up in that "
                        "tensor only for gpt_oss (interleaved) and llama4 (halves)"));
  EXPECT_THAT(error(fused("bf16"), [](CtModel& c) { c.writer.config["intermediate_size"] = 32; }),
              HasSubstr("tensor '" + p +
                        "gate_up_proj' must be F32, BF16 or F16 [4, 64, 64] (config.json: H 64, I "
                        "32, E 4), got BF16 [4, 64, 128]"));
  EXPECT_THAT(error(fused("bf16"), filled(p + "down_proj", DType::i8, {4, 64, 64}, int8_t{1})),
              HasSubstr("tensor '" + p + "down_proj' must be F32, BF16 or F16 [4, 64, 64]"));
  EXPECT_THAT(error(fused("bf16"), erased(p + "down_proj_bias")),
              HasSubstr("tensor '" + p +
                        "down_proj_bias' is missing (the experts have biases for one projection "
                        "only)"));
  EXPECT_THAT(
      error(fused("mxfp4"), filled(p + "down_proj_scales", DType::u8, {4, 64, 1}, uint8_t{127})),
      HasSubstr("tensor '" + p +
                "down_proj_scales' must be U8 [4, 64, 2] (config.json: H 64, I 64, E 4), "
                "got U8 [4, 64, 1]"));
  EXPECT_THAT(error(fused("mxfp4"),
                    filled(p + "gate_up_proj_scales", DType::u8, {4, 128, 2}, uint8_t{255})),
              HasSubstr("tensor '" + p +
                        "gate_up_proj_scales' expert 0 row 0 block 0: e8m0 "
                        "scale 255 is NaN (OCP MX), which no weight can be"));
  // the shared expert
  const std::string folder = dir_ / "noshared";
  base().writer.write(folder);
  io::LoadOptions shared;
  shared.shared_expert = true;
  EXPECT_THAT(error_of([&] { io::open_layer(folder, 0, shared); }),
              HasSubstr("layer 0 has no shared expert (neither "
                        "'model.layers.0.mlp.shared_experts.gate_proj.weight' nor "
                        "'model.layers.0.mlp.shared_expert.gate_proj.weight' exists)"));
  CtSpec spec{.model_type = "qwen2_moe",
              .E = 4,
              .layers = 1,
              .shared = "shared_expert",
              .shared_gate = true};
  CtModel q = make_ct(spec);
  q.writer.config["shared_expert_intermediate_size"] = 64;
  q.writer.add("model.layers.0.mlp.shared_expert_gate.weight", DType::bf16, {2, 64},
               std::vector<uint16_t>(128, 0x3f80));
  q.writer.write(dir_ / "q2");
  EXPECT_THAT(error_of([&] { io::open_layer(dir_ / "q2", 0, shared); }),
              HasSubstr("config.json shared_expert_intermediate_size is 64 but tensor "
                        "'model.layers.0.mlp.shared_expert.gate_proj.weight_packed' has 128 rows"));
  q.writer.config.erase("shared_expert_intermediate_size");
  q.writer.write(dir_ / "q2");
  EXPECT_THAT(error_of([&] { io::open_layer(dir_ / "q2", 0, shared); }),
              HasSubstr("tensor 'model.layers.0.mlp.shared_expert_gate.weight' must be a float "
                        "[1, 64] tensor"));
}

TEST_F(CtMalformed, UnknownOrWrongDtypes) {
  // a dtype the safetensors reader does not know (an FP8 checkpoint), named with its file
  const std::string folder = dir_ / "fp8";
  std::filesystem::create_directories(folder);
  CtModel c = base("bf16");
  { std::ofstream(folder + "/config.json") << c.writer.config.dump(); }
  const std::string header =
      "{\"model.layers.0.mlp.experts.0.gate_proj.weight\": {\"dtype\": \"F8_E4M3\", \"shape\": "
      "[64, 64], \"data_offsets\": [0, 4096]}}";
  std::string file(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(file.data(), &n, 8);
  file += header + std::string(4096, '\0');
  { std::ofstream(folder + "/model.safetensors", std::ios::binary) << file; }
  const std::string fp8 = error_of([&] { io::open_layer(folder, 0, {}); });
  EXPECT_THAT(fp8, HasSubstr("model.safetensors"));
  EXPECT_THAT(fp8, HasSubstr("unsupported dtype 'F8_E4M3'"));
  // a known dtype that is neither int4 values nor floats
  const std::string p = "model.layers.0.mlp.experts.2.up_proj.weight";
  EXPECT_THAT(error(base("bf16"),
                    [&](CtModel& m) {
                      m.writer.add(p, DType::i32, {64, 64}, std::vector<int32_t>(64 * 64, 1));
                    }),
              HasSubstr("tensor '" + p + "' must be a float [64, 64], got I32 [64, 64]"));
}

TEST_F(CtMalformed, TruncatedOrGarbledShards) {
  CtModel c = base();
  c.writer.shards = 2;
  const std::string folder = dir_ / "cut";
  c.writer.write(folder);
  const std::string shard = folder + "/model-00002-of-00002.safetensors";
  const auto size = std::filesystem::file_size(shard);
  std::filesystem::resize_file(shard, size - 100);
  const std::string cut = error_of([&] { io::pack_layer(*io::open_layer(folder, 0, {}), 1); });
  EXPECT_THAT(cut, HasSubstr("model-00002-of-00002.safetensors"));
  EXPECT_THAT(cut, HasSubstr("past the end"));
  { std::ofstream(shard, std::ios::trunc) << "not a safetensors file at all"; }
  EXPECT_THAT(error_of([&] { io::pack_layer(*io::open_layer(folder, 0, {}), 1); }),
              HasSubstr("model-00002-of-00002.safetensors"));
}

TEST_F(CtMalformed, ShardProblems) {
  CtModel c = base();
  c.writer.shards = 2;
  const std::string folder = dir_ / "sharded";
  c.writer.write(folder);
  // a shard the index names is gone
  std::filesystem::remove(folder + "/model-00002-of-00002.safetensors");
  EXPECT_THAT(error_of([&] { io::pack_layer(*io::open_layer(folder, 0, {}), 1); }),
              HasSubstr("model-00002-of-00002.safetensors': cannot open the file"));
  // the index sends a tensor to a shard that does not hold it
  c.writer.write(folder);
  std::ifstream in(folder + "/model.safetensors.index.json");
  json index = json::parse(in);
  for (auto& [name, file] : index["weight_map"].items())
    if (name.find("experts.2.up_proj.weight_packed") != std::string::npos)
      file = file == "model-00001-of-00002.safetensors" ? "model-00002-of-00002.safetensors"
                                                        : "model-00001-of-00002.safetensors";
  std::ofstream(folder + "/model.safetensors.index.json") << index.dump();
  EXPECT_THAT(
      error_of([&] { io::pack_layer(*io::open_layer(folder, 0, {}), 1); }),
      HasSubstr("experts.2.up_proj.weight_packed' is listed in model.safetensors.index.json"));
  std::ofstream(folder + "/model.safetensors.index.json") << "{\"weight_map\": {\"a\": \"../x\"}}";
  EXPECT_THAT(error_of([&] { io::open_layer(folder, 0, {}); }),
              HasSubstr("not a file of the folder"));
}

}  // namespace
