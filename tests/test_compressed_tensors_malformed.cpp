// Malformed compressed-tensors checkpoints, written by the suite's own writer and then edited,
// rejected with a message naming the folder: config.json problems, missing and misshapen tensors,
// zero points, fused and shared experts, unknown or wrong dtypes, truncated or garbled shards and
// shard indexes that disagree with the files.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "checkpoint_families.hpp"
#include "checkpoint_test_util.hpp"
#include "checkpoint_writers.hpp"

namespace {

using namespace ckpt_test;
using namespace w4a8moe;
using nlohmann::json;
using ::testing::HasSubstr;

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
