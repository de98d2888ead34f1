// The case-file loader (io/case_file.hpp): a valid case and its defaults, and every missing or
// malformed tensor and metadata entry rejected with a message that names the file.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "io/case_file.hpp"
#include "io/safetensors_writer.hpp"
#include "safetensors_test_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io {
namespace {

using safetensors_test::SafetensorsTest;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------------------------
// Case loader

class CaseLoaderTest : public SafetensorsTest {
 protected:
  // A case with tiny tensors (the loader does not cross-check shapes; pack and forward do).
  SafetensorsWriter valid_case(const std::string& skip_tensor = "",
                               const std::string& skip_key = "") {
    SafetensorsWriter w;
    const auto add = [&](const std::string& name, DType dtype, std::vector<int64_t> shape) {
      if (name == skip_tensor) return;
      size_t bytes = dtype_bytes(dtype);
      for (int64_t d : shape) bytes *= static_cast<size_t>(d);
      const std::vector<uint8_t> zeros(bytes, 0);
      w.add(name, dtype, std::move(shape), zeros);
    };
    add("x", DType::bf16, {2, 64});
    add("topk_ids", DType::i64, {2, 2});
    add("topk_weights", DType::f32, {2, 2});
    add("w13", DType::u8, {3, 64, 32});
    add("w13_scale", DType::bf16, {3, 64, 2});
    add("w2", DType::i8, {3, 64, 32});
    add("w2_scale", DType::f32, {3, 64});
    const std::vector<std::pair<std::string, std::string>> meta = {
        {"group_size", "32"},
        {"activation", "swigluoai"},
        {"alpha", "1.5"},
        {"limit", "6.25"},
        {"gate_up_layout", "interleaved"},
        {"apply_router_weight_on_input", "true"}};
    for (const auto& [key, value] : meta)
      if (key != skip_key) w.set_metadata(key, value);
    return w;
  }

  std::string load_error(const SafetensorsWriter& w) {
    const std::string file = path("case.safetensors");
    w.write(file);
    try {
      load_case(file);
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(file));
      return e.what();
    }
    ADD_FAILURE() << "load_case did not throw";
    return "";
  }
};

TEST_F(CaseLoaderTest, LoadsAValidCase) {
  const std::string file = path("case.safetensors");
  valid_case().write(file);
  LoadedCase loaded = load_case(file);
  const LoadedCase c = std::move(loaded);  // views survive a move
  EXPECT_EQ(c.x.dtype, DType::bf16);
  EXPECT_EQ(c.x.rank, 2);
  EXPECT_EQ(c.x.shape[1], 64);
  EXPECT_EQ(c.x.data, c.file.bytes("x").data());
  EXPECT_EQ(c.topk_ids.dtype, DType::i64);
  EXPECT_EQ(c.topk_weights.dtype, DType::f32);
  EXPECT_EQ(c.weights.w13.dtype, DType::u8);
  EXPECT_EQ(c.weights.w13.shape[2], 32);
  EXPECT_EQ(c.weights.w13_scale.rank, 3);
  EXPECT_EQ(c.weights.w2.dtype, DType::i8);
  EXPECT_EQ(c.weights.w2_scale.rank, 2);
  EXPECT_TRUE(c.weights.w13_bias.empty());
  EXPECT_TRUE(c.weights.w2_bias.empty());
  EXPECT_EQ(c.weights.group_size, 32);
  EXPECT_EQ(c.weights.gate_up_layout, GateUpLayout::interleaved);
  EXPECT_EQ(c.params.activation, Activation::swigluoai);
  EXPECT_EQ(c.params.alpha, 1.5f);
  EXPECT_EQ(c.params.limit, 6.25f);
  EXPECT_TRUE(c.params.apply_router_weight_on_input);
  const PackOptions options = c.pack_options();
  EXPECT_EQ(options.group_size, 32);
  EXPECT_EQ(options.gate_up_layout, GateUpLayout::interleaved);
}

TEST_F(CaseLoaderTest, DefaultsForOptionalMetadataAndBiases) {
  SafetensorsWriter w = valid_case("", "alpha");
  w.set_metadata("group_size", "-1");
  w.set_metadata("activation", "gelu_tanh");
  w.set_metadata("apply_router_weight_on_input", "false");
  w.add("w13_bias", DType::f32, {3, 64}, std::vector<float>(3 * 64, 0.0f));
  w.add("w2_bias", DType::f16, {3, 64}, std::vector<uint16_t>(3 * 64, 0));
  const std::string file = path("case.safetensors");
  w.write(file);
  const LoadedCase c = load_case(file);
  EXPECT_EQ(c.weights.group_size, -1);
  EXPECT_EQ(c.params.activation, Activation::gelu_tanh);
  EXPECT_EQ(c.params.alpha, MoeParams{}.alpha);
  EXPECT_FALSE(c.params.apply_router_weight_on_input);
  EXPECT_FALSE(c.weights.w13_bias.empty());
  EXPECT_EQ(c.weights.w2_bias.dtype, DType::f16);

  SafetensorsWriter minimal = valid_case("", "gate_up_layout");
  minimal.write(file);
  EXPECT_EQ(load_case(file).weights.gate_up_layout, GateUpLayout::halves);
}

TEST_F(CaseLoaderTest, MissingTensor) {
  for (const char* name : {"x", "topk_ids", "topk_weights", "w13", "w13_scale", "w2", "w2_scale"}) {
    SCOPED_TRACE(name);
    EXPECT_THAT(load_error(valid_case(name)),
                HasSubstr(std::string("tensor '") + name + "' is missing"));
  }
}

TEST_F(CaseLoaderTest, MissingRequiredMetadata) {
  EXPECT_THAT(load_error(valid_case("", "group_size")),
              HasSubstr("metadata 'group_size' is missing"));
  EXPECT_THAT(load_error(valid_case("", "activation")),
              HasSubstr("metadata 'activation' is missing"));
}

TEST_F(CaseLoaderTest, BadGroupSize) {
  for (const char* text : {"12x", "", " 128", "128 ", "1.5", "+128", "0x80", "99999999999"}) {
    SCOPED_TRACE(text);
    SafetensorsWriter w = valid_case();
    w.set_metadata("group_size", text);
    EXPECT_THAT(
        load_error(w),
        HasSubstr(std::string("metadata 'group_size' must be an integer, got '") + text + "'"));
  }
}

TEST_F(CaseLoaderTest, UnknownActivation) {
  SafetensorsWriter w = valid_case();
  w.set_metadata("activation", "relu");
  const std::string msg = load_error(w);
  EXPECT_THAT(msg, HasSubstr("metadata 'activation'"));
  EXPECT_THAT(msg, HasSubstr("relu"));
}

TEST_F(CaseLoaderTest, BadOptionalMetadata) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"alpha", "abc"},
      {"alpha", "1.5x"},
      {"alpha", "nan"},
      {"limit", "inf"},
      {"limit", ""},
      {"apply_router_weight_on_input", "yes"},
      {"apply_router_weight_on_input", "1"},
      {"gate_up_layout", "halfs"}};
  for (const auto& [key, value] : bad) {
    SCOPED_TRACE(key + "=" + value);
    SafetensorsWriter w = valid_case();
    w.set_metadata(key, value);
    const std::string msg = load_error(w);
    EXPECT_THAT(msg, HasSubstr("metadata '" + key + "'"));
    EXPECT_THAT(msg, HasSubstr("got '" + value + "'"));
  }
}

TEST_F(CaseLoaderTest, WrongIdsDType) {
  SafetensorsWriter w = valid_case("topk_ids");
  w.add("topk_ids", DType::f32, {2, 2}, std::vector<float>(4, 0.0f));
  EXPECT_THAT(load_error(w), HasSubstr("tensor 'topk_ids' must have dtype I32 or I64, got F32"));
}

TEST_F(CaseLoaderTest, WrongWeightDTypeAndRank) {
  SafetensorsWriter w = valid_case("w13");
  w.add("w13", DType::i32, {3, 64, 8}, std::vector<int32_t>(3 * 64 * 8, 0));
  EXPECT_THAT(load_error(w), HasSubstr("tensor 'w13' must have dtype I8"));

  SafetensorsWriter r = valid_case("x");
  r.add("x", DType::f32, {128}, std::vector<float>(128, 0.0f));
  EXPECT_THAT(load_error(r), HasSubstr("tensor 'x' must have rank 2, got shape [128]"));

  SafetensorsWriter s = valid_case("w2_scale");
  s.add("w2_scale", DType::f32, {192}, std::vector<float>(192, 0.0f));
  EXPECT_THAT(load_error(s), HasSubstr("tensor 'w2_scale' must have rank 2 or 3"));
}

TEST_F(CaseLoaderTest, MalformedFileNamesTheFile) {
  const std::string file = path("case.safetensors");
  write_raw(file, make_bytes("{oops", 0));
  try {
    load_case(file);
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(file));
    EXPECT_THAT(e.what(), HasSubstr("not valid JSON"));
  }
}

}  // namespace
}  // namespace w4a8moe::io
