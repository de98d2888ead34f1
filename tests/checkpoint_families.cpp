// The rows of the model families the checkpoint suites run (checkpoint_families.hpp).
#include "checkpoint_families.hpp"

#include <gtest/gtest.h>

#include <stdexcept>
#include <utility>

#include "checkpoint_test_util.hpp"

namespace ckpt_test {

namespace {

using namespace w4a8moe;

// DeepSeek-V3's routing: sigmoid scores with a selection bias, 2 of 4 groups by the sum of their
// best two, renormalised and scaled by 2.5.
void deepseek_v3_config(nlohmann::json& config) {
  config["scoring_func"] = "sigmoid";
  config["topk_method"] = "noaux_tc";
  config["n_group"] = 4;
  config["topk_group"] = 2;
  config["routed_scaling_factor"] = 2.5;
  config["norm_topk_prob"] = true;
}

// A row of one layer of the writers' default sizes.
FamilyRow default_sized(const char* name, const RouteSpec& route, std::string arch,
                        std::string model_type) {
  FamilyRow f;
  f.name = name;
  f.route = route;
  f.gguf = GgufSpec{.arch = std::move(arch), .layers = 1};
  f.ct = CtSpec{.model_type = std::move(model_type), .layers = 1};
  return f;
}

std::vector<FamilyRow> make_rows() {
  std::vector<FamilyRow> rows;
  {
    FamilyRow f;
    f.name = "Qwen3Moe";
    f.route = RouteSpec{"softmax", true};
    f.gguf = GgufSpec{.H = 128, .I = 96, .E = 16, .K = 4};
    f.ct = CtSpec{.H = 128, .I = 64, .E = 16, .K = 4};
    rows.push_back(f);
  }
  {
    // gate/up Q4_0 (exact) with down F16 (converted): w13 keeps f16 scales, w2 gets f32 ones;
    // the folder sharded in three
    FamilyRow f;
    f.name = "DeepSeekV3";
    f.route = RouteSpec{"sigmoid", true, 2.5, 4, 2, true};
    f.gguf = GgufSpec{.arch = "deepseek2", .layers = 1, .H = 96, .I = 64, .E = 16, .K = 4};
    f.gguf->types[2] = kTF16;
    f.gguf->selection_bias = true;
    f.gguf_meta = [](GgufWriter& w) {
      w.kv_u32("deepseek2.expert_gating_func", 2);
      w.kv_bool("deepseek2.expert_weights_norm", true);
      w.kv_f32("deepseek2.expert_weights_scale", 2.5f);
      w.kv_u32("deepseek2.expert_group_count", 4);
      w.kv_u32("deepseek2.expert_group_used_count", 2);
    };
    f.gguf_check = [](const io::LayerSource& source, const std::vector<Moe>&) {
      const io::LayerInfo& info = source.info();
      EXPECT_EQ(info.routing.groups, 4);
      EXPECT_EQ(info.routing.groups_used, 2);
      EXPECT_EQ(info.routing.group_score, GroupScore::top2_sum);
      EXPECT_FLOAT_EQ(info.routing.scaling, 2.5f);
      EXPECT_EQ(info.w13_scale_dtype, DType::f16);
      EXPECT_EQ(info.w2_scale_dtype, DType::f32);
    };
    f.ct = CtSpec{.model_type = "deepseek_v3", .shards = 3, .E = 16, .K = 4};
    f.config = deepseek_v3_config;
    f.ct_check = [](const io::LayerSource& source, const std::vector<Moe>&) {
      EXPECT_EQ(source.info().routing.group_score, GroupScore::top2_sum);
      EXPECT_FALSE(source.info().has_shared_expert);
    };
    rows.push_back(f);
  }
  {
    // GGUF: MXFP4 experts (converted), expert and router biases, top-k on the logits then
    // softmax over the chosen, swigluoai
    FamilyRow f;
    f.name = "GptOss";
    f.route = RouteSpec{"softmax_topk", false};
    f.activation = Activation::swigluoai;
    f.gguf = GgufSpec{.arch = "gpt-oss", .layers = 1, .H = 64, .I = 64, .E = 8, .K = 2};
    f.gguf->types[0] = f.gguf->types[1] = f.gguf->types[2] = kTMXFP4;
    f.gguf->expert_bias = f.gguf->router_bias = true;
    f.gguf_check = [](const io::LayerSource& source, const std::vector<Moe>&) {
      EXPECT_TRUE(source.info().expert_bias);
    };
    // the folder as transformers saves it: gate_up_proj [E, H, 2I] with gate and up interleaved,
    // biases, a router bias
    f.ct = CtSpec{.model_type = "gpt_oss", .H = 64, .I = 96, .E = 8, .K = 2, .layers = 1};
    f.ct->fused = "bf16";
    f.ct->expert_bias = f.ct->router_bias = true;
    f.ct_check = [](const io::LayerSource& source, const std::vector<Moe>&) {
      EXPECT_TRUE(source.info().expert_bias);
    };
    rows.push_back(f);
  }
  {
    // the folder as llm-compressor saves it: per-expert pack-quantized modules in feed_forward
    FamilyRow f;
    f.name = "Llama4";
    f.route = RouteSpec{"sigmoid", false};
    f.on_input = true;
    f.gguf = GgufSpec{.arch = "llama4", .layers = 1, .K = 1};
    f.ct = CtSpec{.model_type = "llama4", .E = 4, .K = 1, .layers = 1};
    f.ct_check = [](const io::LayerSource& source, const std::vector<Moe>& truth) {
      EXPECT_EQ(load_all(source).w13, truth.back().w13);
    };
    rows.push_back(f);
  }
  {
    // with a shared expert scaled by sigmoid(x . gate) (GGUF: Q4_0, exact; the folder:
    // int-quantized channelwise), which the routed layer reports and the shared-expert tests open
    FamilyRow f;
    f.name = "Qwen2Moe";
    f.route = RouteSpec{"softmax", false};
    f.gguf = GgufSpec{.arch = "qwen2moe", .H = 96, .I = 64, .E = 8, .K = 4, .Is = 160};
    f.gguf->shared_expert = f.gguf->shared_gate = true;
    f.ct = CtSpec{.model_type = "qwen2_moe", .scheme = "int", .strategy = "channel", .layers = 1};
    f.ct->shared = "shared_expert";
    f.ct->shared_gate = true;
    f.ct->Is = 96;
    f.gguf_check = f.ct_check = [](const io::LayerSource& source, const std::vector<Moe>&) {
      EXPECT_TRUE(source.info().has_shared_expert);
    };
    rows.push_back(f);
  }
  // one layer of the default sizes
  rows.push_back(default_sized("Mixtral", RouteSpec{"softmax", true}, "llama", "mixtral"));
  // block_sparse_moe.experts.J.w1 / w3 / w2
  rows.back().ct = CtSpec{.model_type = "mixtral", .layers = 1, .mixtral_names = true};
  rows.push_back(default_sized("Olmoe", RouteSpec{"softmax", false}, "olmoe", "olmoe"));
  return rows;
}

std::vector<FamilyRow> rows_with(bool (*has)(const FamilyRow&)) {
  std::vector<FamilyRow> out;
  for (const FamilyRow& f : family_rows())
    if (has(f)) out.push_back(f);
  return out;
}

}  // namespace

const std::vector<FamilyRow>& family_rows() {
  static const std::vector<FamilyRow> rows = make_rows();
  return rows;
}

const FamilyRow& family(const std::string& name) {
  for (const FamilyRow& f : family_rows())
    if (f.name == name) return f;
  throw std::runtime_error("no family row " + name);
}

std::vector<FamilyRow> gguf_families() {
  return rows_with([](const FamilyRow& f) { return f.gguf.has_value(); });
}

std::vector<FamilyRow> hf_families() {
  return rows_with([](const FamilyRow& f) { return f.ct.has_value(); });
}

void check_family(const std::string& path, int layer, const FamilyRow& row,
                  const std::function<void(const io::LayerSource&, const std::vector<Moe>&)>& check,
                  const std::vector<Moe>& truth) {
  const std::unique_ptr<io::LayerSource> source = io::open_layer(path, layer, {});
  const io::LayerInfo& info = source->info();
  const Gating gating = row.route.gating == "sigmoid"        ? Gating::sigmoid
                        : row.route.gating == "softmax_topk" ? Gating::softmax_topk
                                                             : Gating::softmax;
  EXPECT_EQ(info.routing.gating, gating);
  EXPECT_EQ(info.routing.renormalize, row.route.renormalize);
  EXPECT_EQ(info.params.activation, row.activation);
  EXPECT_EQ(info.params.apply_router_weight_on_input, row.on_input);
  if (check) check(*source, truth);
  check_layer(path, layer, row.route);
  check_expert_range(path, layer, {1, info.experts - 2});
}

GgufModel family_gguf(const FamilyRow& row) {
  GgufModel g = make_gguf(row.gguf.value());
  if (row.gguf_meta) row.gguf_meta(g.writer);
  return g;
}

CtModel family_ct(const FamilyRow& row) {
  CtModel c = make_ct(row.ct.value());
  if (row.config) row.config(c.writer.config);
  return c;
}

}  // namespace ckpt_test
