// One MoE layer of a Hugging Face checkpoint folder: compressed-tensors int4
// ("pack-quantized" or "int-quantized") or plain F16/BF16/F32 weights, in one safetensors file or
// sharded with model.safetensors.index.json, plus config.json.
//
// Per expert J of layer N (prefix "model.layers.N.mlp.experts.J." for Qwen/OLMoE/DeepSeek,
// "model.layers.N.block_sparse_moe.experts.J." with w1/w3/w2 for Mixtral,
// "...layers.N.feed_forward.experts.J." for Llama-4 as llm-compressor saves it):
//   {gate,up,down}_proj.weight_packed  I32 [N, K/8]: eight 4-bit values per word, element 8w + i
//                                      in bits 4i..4i+3 (least significant first), stored as
//                                      value + 8 (offset binary); little-endian words, so the
//                                      bytes are exactly w4a8moe's nibble-packed layout
//   {gate,up,down}_proj.weight_shape   I64/I32 [2] = [N, K]
//   {gate,up,down}_proj.weight_scale   [N, K/g] (strategy group) or [N, 1] (channel); value =
//                                      q * scale (symmetric: no zero point)
//   or .weight I8 [N, K] with values in [-8, 7] ("int-quantized"), or .weight F16/BF16/F32 (not
//   quantized: converted on load).
// This follows compressed-tensors' pack_to_int32 / unpack_from_int32 (pack-quantized compressor):
// offset = 1 << (num_bits - 1) is added before packing, shifts are 4 * i for i = 0..7.
//
// Experts fused in two tensors for all E (transformers' GptOssExperts and Llama4TextExperts), in
// the x @ W orientation [E, in, out], converted on load:
//   experts.gate_up_proj [E, H, 2I]    gpt-oss: gate and up INTERLEAVED along the last dimension
//                                      (column 2j gate j, 2j + 1 up j); Llama-4: CONCATENATED
//                                      halves (columns [0, I) gate, [I, 2I) up)
//   experts.down_proj [E, I, H]
//   experts.gate_up_proj_bias [E, 2I], experts.down_proj_bias [E, H]   gpt-oss (same columns)
//   or, as gpt-oss ships them, MXFP4 "<name>_blocks" U8 [E, out, in/32, 16] and "<name>_scales"
//   U8 [E, out, in/32] (one row per output, decode_mxfp4_row).
// Routers: "<block>gate.weight" [E, H] (gpt-oss, Llama-4: "<block>router.weight", gpt-oss with
// "router.bias" [E] added to the logits); DeepSeek-V3's "gate.e_score_correction_bias" [E].
// Shared experts (LoadOptions::shared_expert): "<block>shared_experts.{gate,up,down}_proj"
// (DeepSeek), "<block>shared_expert.*" with "<block>shared_expert_gate.weight" [1, H] (Qwen2-MoE),
// "feed_forward.shared_expert.*" (Llama-4), each stored like one routed expert.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "common/format.hpp"
#include "common/numeric.hpp"
#include "io/checkpoint.hpp"
#include "io/convert.hpp"
#include "io/mapped_file.hpp"
#include "io/safetensors.hpp"

namespace w4a8moe::io {

namespace {

using detail::cat;
using nlohmann::json;
namespace fs = std::filesystem;

enum class Scheme { packed, int8, dense, fused_float, fused_mxfp4 };

const char* scheme_name(Scheme s) {
  switch (s) {
    case Scheme::packed:
      return "pack-quantized int4";
    case Scheme::int8:
      return "int-quantized int4";
    case Scheme::dense:
    case Scheme::fused_float:
      return "dense";
    case Scheme::fused_mxfp4:
      return "MXFP4";
  }
  return "?";
}

// Names of a model family's MoE block and projections.
struct Naming {
  const char* block;    // after "layers.N."
  const char* proj[3];  // gate, up, down
};
constexpr Naming kNamings[] = {
    {"mlp.", {"gate_proj", "up_proj", "down_proj"}},
    {"block_sparse_moe.", {"w1", "w3", "w2"}},
    {"feed_forward.", {"gate_proj", "up_proj", "down_proj"}},
};
constexpr const char* kLayerPrefixes[] = {"model.layers.", "model.language_model.layers.",
                                          "language_model.model.layers."};
constexpr const char* kSharedModules[] = {"shared_experts", "shared_expert"};
// Output rows decoded and converted at a time from a fused [in, out] tensor.
constexpr int64_t kStripRows = 32;

class CompressedTensorsLayer final : public LayerSource {
 public:
  CompressedTensorsLayer(const std::string& folder, int layer, const LoadOptions& options);
  Router router() const override;
  void load_expert(int64_t e, const ExpertSlot& slot) const override;
  void release_expert(int64_t e) const override;

 private:
  [[noreturn]] void fail(const std::string& problem) const {
    throw Error(cat("checkpoint '", folder_, "': ", problem));
  }
  const json* config_value(const char* key) const;
  int64_t config_int(const char* key, bool required) const;
  // The module of projection `which` of expert e (or of the shared expert).
  std::string module(int64_t e, int which) const {
    if (!shared_.empty()) return cat(block_, shared_, ".", naming_->proj[which]);
    return cat(block_, "experts.", e, ".", naming_->proj[which]);
  }
  std::string tensor_name(int64_t e, int which, const char* suffix) const {
    return cat(module(e, which), ".", suffix);
  }
  // A fused tensor of the layer: "gate_up_proj", "down_proj_bias", "gate_up_proj_blocks", ...
  std::string fused(int which, const char* suffix) const {
    return cat(block_, "experts.", which == 2 ? "down_proj" : "gate_up_proj", suffix);
  }
  bool has(const std::string& name) const;
  const MappedSafetensors& shard_of(const std::string& name) const;
  const TensorEntry& entry(const std::string& name) const { return shard_of(name).entry(name); }
  std::span<const uint8_t> bytes(const std::string& name) const {
    return shard_of(name).bytes(name);
  }
  std::vector<float> read_floats(const std::string& name) const;
  void read_config();
  void read_index();
  void read_quantization(const json& q);
  void locate_block(int layer);
  void check_modules();  // per-expert (or shared) tensors: shapes, group size, scale dtypes
  void check_fused();    // fused tensors: shapes and dtypes
  void read_routing();
  void load_rows(int which, int64_t e, uint8_t* nibbles, uint8_t* scales, DType scale_dtype) const;
  void load_fused_rows(int which, int64_t e, uint8_t* nibbles, uint8_t* scales, DType scale_dtype,
                       float* bias) const;
  // The column of the fused [in, out] matrix holding output row r of projection `which`.
  int64_t fused_column(int which, int64_t r) const {
    if (which == 2) return r;
    return interleaved_ ? 2 * r + which : which * info_.inter + r;
  }

  std::string folder_;
  LoadOptions options_;
  json config_;  // config.json (or its text_config)
  std::string model_type_;
  std::map<std::string, std::string> weight_map_;  // tensor -> shard file (sharded checkpoints)
  std::string single_file_;                        // the file of unsharded checkpoints
  mutable std::mutex shard_mutex_;
  mutable std::map<std::string, std::unique_ptr<MappedSafetensors>> shards_;
  std::string block_;   // e.g. "model.layers.3.mlp."
  std::string shared_;  // the shared expert's module in the block ("shared_experts"), if opened
  const Naming* naming_ = nullptr;
  Scheme scheme_ = Scheme::dense;
  bool interleaved_ = false;  // fused gate_up: interleaved (gpt-oss) or halves (Llama-4)
  std::string router_name_, router_bias_name_, selection_bias_name_;
  std::string topk_method_ = "greedy";
  // quantization_config of the weights (pack-quantized / int-quantized)
  std::string format_;
  int config_group_size_ = 0;  // 0: not given
  std::string strategy_;
};

const json* CompressedTensorsLayer::config_value(const char* key) const {
  const auto it = config_.find(key);
  return it == config_.end() || it->is_null() ? nullptr : &*it;
}

int64_t CompressedTensorsLayer::config_int(const char* key, bool required) const {
  const json* v = config_value(key);
  if (v == nullptr) {
    if (required) fail(cat("config.json has no '", key, "'"));
    return -1;
  }
  if (!v->is_number_integer())
    fail(cat("config.json '", key, "' must be an integer, got ", v->dump()));
  return v->get<int64_t>();
}

bool CompressedTensorsLayer::has(const std::string& name) const {
  if (!weight_map_.empty()) return weight_map_.count(name) != 0;
  return shard_of(name).contains(name);
}

const MappedSafetensors& CompressedTensorsLayer::shard_of(const std::string& name) const {
  std::string file = single_file_;
  if (!weight_map_.empty()) {
    const auto it = weight_map_.find(name);
    if (it == weight_map_.end())
      fail(cat("tensor '", name, "' is missing (not in model.safetensors.index.json)"));
    file = it->second;
  }
  std::lock_guard lock(shard_mutex_);
  auto& slot = shards_[file];
  if (!slot)
    slot = std::make_unique<MappedSafetensors>(
        MappedSafetensors::open((fs::path(folder_) / file).string()));
  if (!weight_map_.empty() && !slot->contains(name))
    fail(cat("tensor '", name, "' is listed in model.safetensors.index.json under '", file,
             "', which does not hold it"));
  return *slot;
}

std::vector<float> CompressedTensorsLayer::read_floats(const std::string& name) const {
  const MappedSafetensors& f = shard_of(name);
  if (!f.contains(name)) fail(cat("tensor '", name, "' is missing"));
  const TensorEntry& e = f.entry(name);
  if (!detail::is_float_dtype(e.dtype))
    fail(
        cat("tensor '", name, "' must be F32, BF16 or F16, got ", safetensors_dtype_name(e.dtype)));
  const std::span<const uint8_t> b = f.bytes(name);
  std::vector<float> out(b.size() / dtype_bytes(e.dtype));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = detail::load_float(b.data(), e.dtype, static_cast<int64_t>(i));
  return out;
}

void CompressedTensorsLayer::read_quantization(const json& q) {
  const auto method = q.find("quant_method");
  if (method == q.end() || !method->is_string() ||
      method->get<std::string>() != "compressed-tensors")
    fail(cat("config.json quantization_config has quant_method ",
             method == q.end() ? std::string("(none)") : method->dump(),
             ": w4a8moe reads \"compressed-tensors\" checkpoints (and unquantized ones)"));
  if (const auto f = q.find("format"); f != q.end() && f->is_string())
    format_ = f->get<std::string>();
  const auto groups = q.find("config_groups");
  if (groups == q.end() || !groups->is_object() || groups->empty())
    fail("config.json quantization_config has no config_groups");
  // The expert projections' group: the only group with weights; else the first whose targets
  // name "Linear" or expert 0's gate projection module; else, when every group with weights says
  // the same about them, any ("re:" targets are not evaluated: w4a8moe has no Python regexes).
  // The tensors' own shapes are checked against the choice.
  const std::string module = this->module(0, 0);
  std::vector<std::pair<std::string, const json*>> with_weights;
  for (const auto& [gname, group] : groups->items()) {
    const auto w = group.find("weights");
    if (group.is_object() && w != group.end() && w->is_object())
      with_weights.emplace_back(gname, &group);
  }
  if (with_weights.empty())
    fail("config.json quantization_config has no config group with 'weights'");
  const json* chosen = with_weights.size() == 1 ? with_weights.front().second : nullptr;
  for (size_t i = 0; chosen == nullptr && i < with_weights.size(); ++i) {
    const json& group = *with_weights[i].second;
    const auto targets = group.find("targets");
    if (targets == group.end() || !targets->is_array()) continue;
    for (const json& t : *targets)
      if (t.is_string() && (t.get<std::string>() == "Linear" || t.get<std::string>() == module))
        chosen = &group;
  }
  if (chosen == nullptr) {
    const auto settings = [](const json& group) {
      json s = group.at("weights");
      s.erase("observer");
      s.erase("observer_kwargs");
      return s.dump();
    };
    for (const auto& [gname, group] : with_weights)
      if (settings(*group) != settings(*with_weights.front().second))
        fail(cat("config.json quantization_config groups '", with_weights.front().first, "' and '",
                 gname,
                 "' quantize weights differently, and w4a8moe cannot tell "
                 "which one targets '",
                 module, "' (it does not evaluate \"re:\" targets)"));
    chosen = with_weights.front().second;
  }
  if (const auto f = chosen->find("format"); f != chosen->end() && f->is_string())
    format_ = f->get<std::string>();
  const auto w = chosen->find("weights");
  if (w == chosen->end() || !w->is_object())
    fail("config.json quantization_config: the experts' config group has no 'weights'");
  const auto get = [&](const char* k) -> const json* {
    const auto it = w->find(k);
    return it == w->end() || it->is_null() ? nullptr : &*it;
  };
  const json* bits = get("num_bits");
  if (bits == nullptr || !bits->is_number_integer() || bits->get<int>() != 4)
    fail(cat("config.json quantization_config: weights num_bits must be 4, got ",
             bits == nullptr ? std::string("(none)") : bits->dump(),
             " (int4 weights are what w4a8moe runs without loss)"));
  if (const json* type = get("type");
      type != nullptr && (!type->is_string() || type->get<std::string>() != "int"))
    fail(cat("config.json quantization_config: weights type must be \"int\", got ", type->dump()));
  if (const json* sym = get("symmetric");
      sym != nullptr && (!sym->is_boolean() || !sym->get<bool>()))
    fail(
        "config.json quantization_config: asymmetric weights (a zero point) are not supported; "
        "w4a8moe's int4 weights are symmetric");
  if (const json* strategy = get("strategy"); strategy != nullptr && strategy->is_string())
    strategy_ = strategy->get<std::string>();
  if (strategy_ != "group" && strategy_ != "channel" && strategy_ != "tensor")
    fail(
        cat("config.json quantization_config: weights strategy must be group, channel or tensor, "
            "got \"",
            strategy_, "\""));
  if (const json* gs = get("group_size"); gs != nullptr && gs->is_number_integer())
    config_group_size_ = gs->get<int>();
  if (const json* order = get("actorder");
      order != nullptr && order->is_string() && order->get<std::string>() == "group")
    fail(
        "config.json quantization_config: actorder \"group\" (a permutation of the input "
        "columns, weight_g_idx) is not supported");
}

void CompressedTensorsLayer::read_config() {
  const fs::path path = fs::path(folder_) / "config.json";
  std::ifstream in(path);
  if (!in) fail("config.json is missing");
  json root;
  try {
    root = json::parse(in);
  } catch (const json::parse_error& e) {
    fail(cat("config.json is not valid JSON (error at byte ", e.byte, ")"));
  } catch (const json::exception&) {  // out_of_range: a number such as 1E400
    fail("config.json is not valid JSON (a number out of range)");
  }
  if (!root.is_object()) fail("config.json is not a JSON object");
  config_ = root;
  if (const auto text = root.find("text_config"); text != root.end() && text->is_object()) {
    config_ = *text;  // multimodal models keep the language model's keys here
    if (!config_.contains("quantization_config") && root.contains("quantization_config"))
      config_["quantization_config"] = root["quantization_config"];
  }
  if (const json* t = config_value("model_type"); t != nullptr && t->is_string())
    model_type_ = t->get<std::string>();
  else if (const auto rt = root.find("model_type"); rt != root.end() && rt->is_string())
    model_type_ = rt->get<std::string>();
  if (model_type_.empty()) fail("config.json has no 'model_type'");
}

void CompressedTensorsLayer::read_index() {
  const fs::path index = fs::path(folder_) / "model.safetensors.index.json";
  if (fs::exists(index)) {
    std::ifstream in(index);
    json j;
    try {
      j = json::parse(in);
    } catch (const json::parse_error& e) {
      fail(cat("model.safetensors.index.json is not valid JSON (error at byte ", e.byte, ")"));
    } catch (const json::exception&) {  // out_of_range: a number such as 1E400
      fail("model.safetensors.index.json is not valid JSON (a number out of range)");
    }
    const auto map = j.find("weight_map");
    if (!j.is_object() || map == j.end() || !map->is_object())
      fail("model.safetensors.index.json has no 'weight_map' object");
    for (const auto& [tensor, file] : map->items()) {
      if (!file.is_string())
        fail(cat("model.safetensors.index.json maps '", tensor, "' to ", file.dump(),
                 ", not a file name"));
      const std::string f = file.get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
        fail(cat("model.safetensors.index.json maps '", tensor, "' to '", f,
                 "', not a file of the folder"));
      weight_map_.emplace(tensor, f);
    }
    if (weight_map_.empty()) fail("model.safetensors.index.json has an empty weight_map");
  } else if (fs::exists(fs::path(folder_) / "model.safetensors")) {
    single_file_ = "model.safetensors";
  } else {
    fail("neither model.safetensors nor model.safetensors.index.json is there");
  }
}

// Where the layer's experts are: per-expert modules, or the two fused tensors.
void CompressedTensorsLayer::locate_block(int layer) {
  for (const char* prefix : kLayerPrefixes)
    for (const Naming& n : kNamings) {
      const std::string block = cat(prefix, layer, ".", n.block);
      const std::string probe = cat(block, "experts.0.", n.proj[0], ".");
      block_ = block;
      naming_ = &n;
      if (has(probe + "weight_packed") || has(probe + "weight")) return;
      if (has(fused(0, ""))) {
        scheme_ = Scheme::fused_float;
        return;
      }
      if (has(fused(0, "_blocks"))) {
        scheme_ = Scheme::fused_mxfp4;
        return;
      }
    }
  std::string why;
  const int64_t dense = config_int("first_k_dense_replace", false);
  if (dense > layer) why = cat(" (config.json first_k_dense_replace = ", dense, ": a dense layer)");
  const int64_t layers = config_int("num_hidden_layers", false);
  if (layers >= 0 && layer >= layers) why = cat(" (the model has ", layers, " layers)");
  fail(cat("layer ", layer, " has no experts (no 'model.layers.", layer,
           ".mlp.experts.0.gate_proj.weight_packed' or '.weight', nor a fused "
           "'experts.gate_up_proj')",
           why));
}

CompressedTensorsLayer::CompressedTensorsLayer(const std::string& folder, int layer,
                                               const LoadOptions& options)
    : folder_(folder), options_(options) {
  info_.format = "compressed-tensors";
  info_.layer = layer;
  read_config();
  info_.model = model_type_;
  read_index();
  locate_block(layer);
  const auto has_module = [&](int64_t e, const char* suffix) {
    return has(tensor_name(e, 0, suffix));
  };
  for (const char* m : kSharedModules) {
    shared_ = m;
    info_.has_shared_expert |= has_module(0, "weight_packed") || has_module(0, "weight");
    if (info_.has_shared_expert) break;
  }
  if (!options.shared_expert || !info_.has_shared_expert) shared_.clear();
  if (options.shared_expert) {
    if (!info_.has_shared_expert)
      fail(cat("layer ", layer, " has no shared expert (neither '", block_, kSharedModules[0], ".",
               naming_->proj[0], ".weight' nor '", block_, kSharedModules[1], ".", naming_->proj[0],
               ".weight' exists)"));
    info_.has_shared_expert = false;  // this source is the shared expert
    scheme_ = Scheme::dense;          // stored like one routed expert, whatever the experts are
  }
  const bool is_fused = scheme_ == Scheme::fused_float || scheme_ == Scheme::fused_mxfp4;

  if (!is_fused) {
    const std::string gate0 = tensor_name(0, 0, "");
    if (has(gate0 + "weight_packed")) {
      scheme_ = Scheme::packed;
    } else if (entry(gate0 + "weight").dtype == DType::i8) {
      scheme_ = Scheme::int8;
    } else {
      scheme_ = Scheme::dense;
    }
    if (scheme_ != Scheme::dense) {
      const json* q = config_value("quantization_config");
      if (q == nullptr || !q->is_object())
        fail(cat("tensor '", gate0, scheme_ == Scheme::packed ? "weight_packed" : "weight",
                 "' is quantized but config.json has no quantization_config"));
      read_quantization(*q);
      if (scheme_ == Scheme::packed && !format_.empty() && format_ != "pack-quantized")
        fail(cat("config.json quantization_config format is \"", format_,
                 "\" but the experts are stored as weight_packed (pack-quantized)"));
      if (scheme_ == Scheme::int8 && !format_.empty() && format_ != "int-quantized" &&
          format_ != "naive-quantized")
        fail(cat("config.json quantization_config format is \"", format_,
                 "\" but the experts are stored as int8 'weight' tensors (int-quantized)"));
    } else if (options.require_exact) {
      fail(cat("tensor '", gate0, "weight' is ",
               safetensors_dtype_name(entry(gate0 + "weight").dtype),
               ", which does not map exactly onto int4; allow the conversion to quantize it"));
    }
  } else if (options.require_exact) {
    const std::string t = fused(0, scheme_ == Scheme::fused_mxfp4 ? "_blocks" : "");
    fail(cat("tensor '", t, "' is ",
             scheme_ == Scheme::fused_mxfp4 ? "MXFP4" : safetensors_dtype_name(entry(t).dtype),
             ", which does not map exactly onto int4; allow the conversion to quantize it"));
  }

  // Sizes.
  const int64_t H = config_int("hidden_size", true);
  int64_t E = 1, K = 1, I = 0;
  if (!shared_.empty()) {
    // the shared expert's own intermediate size, from its gate projection [I, H(/8)]
    const std::string w0 =
        tensor_name(0, 0, scheme_ == Scheme::packed ? "weight_packed" : "weight");
    if (entry(w0).shape.size() != 2) fail(cat("tensor '", w0, "' must have rank 2"));
    I = entry(w0).shape[0];
    if (const int64_t want = config_int("shared_expert_intermediate_size", false);
        want > 0 && want != I)
      fail(cat("config.json shared_expert_intermediate_size is ", want, " but tensor '", w0,
               "' has ", I, " rows"));
  } else {
    E = config_int("num_experts", false);
    if (E < 0) E = config_int("num_local_experts", false);
    if (E < 0) E = config_int("n_routed_experts", false);
    if (E < 1)
      fail(
          "config.json has no number of experts (num_experts, num_local_experts or "
          "n_routed_experts)");
    K = config_int("num_experts_per_tok", true);
    I = config_int("moe_intermediate_size", false);
    if (I < 0) I = config_int("intermediate_size", true);
  }
  if (H < 2 || I < 2 || H % 2 != 0 || I % 2 != 0 || K < 1 || K > E)
    fail(cat("config.json sizes do not fit: hidden_size ", H, ", intermediate size ", I,
             " (both even), num_experts_per_tok ", K, " of ", E, " experts"));
  info_.hidden = H;
  info_.inter = I;
  info_.experts = E;
  info_.top_k = K;
  if (is_fused) {
    check_fused();
  } else {
    check_modules();
  }
  const int g = info_.group_size;
  if (!group_size_fits(g, H) || !group_size_fits(g, I))
    fail(cat("group size ", g, " must be -1 or a multiple of 32 dividing H = ", H, " and I = ", I));
  read_routing();
}

// The experts' tensors must back the sizes config.json gives, before anything is allocated from
// them: expert 0's shapes and the last expert's presence; then the group size and scale dtypes
// from expert 0 (every expert is checked when loaded).
void CompressedTensorsLayer::check_modules() {
  const int64_t H = info_.hidden, I = info_.inter, E = info_.experts;
  const char* const weight_suffix = scheme_ == Scheme::packed ? "weight_packed" : "weight";
  if (shared_.empty() && has(tensor_name(E, 0, weight_suffix)))
    fail(cat("the checkpoint holds more than the ", E, " experts config.json announces (tensor '",
             tensor_name(E, 0, weight_suffix), "' exists)"));
  for (int i = 0; i < 3; ++i) {
    const int64_t rows = i == 2 ? H : I, cols = i == 2 ? I : H;
    const std::string w0 = tensor_name(0, i, weight_suffix);
    if (!has(w0)) fail(cat("tensor '", w0, "' is missing"));
    const std::vector<int64_t> want = scheme_ == Scheme::packed
                                          ? std::vector<int64_t>{rows, (cols + 7) / 8}
                                          : std::vector<int64_t>{rows, cols};
    if (entry(w0).shape != want)
      fail(cat("tensor '", w0, "' has ",
               entry(w0).shape.size() == 2
                   ? cat("shape [", entry(w0).shape[0], ", ", entry(w0).shape[1], "]")
                   : cat("rank ", entry(w0).shape.size()),
               ", but ", shared_.empty() ? "config.json's sizes" : "the shared expert's sizes",
               " (H ", H, ", I ", I, ") need [", want[0], ", ", want[1], "]"));
    const std::string last = tensor_name(E - 1, i, weight_suffix);
    if (!has(last))
      fail(cat("config.json announces ", E, " experts, but tensor '", last, "' is missing"));
  }

  conversions_.resize(3);
  for (int i = 0; i < 3; ++i) {
    conversions_[static_cast<size_t>(i)].tensor =
        shared_.empty() ? cat(block_, "experts.*.", naming_->proj[i]) : module(0, i);
    conversions_[static_cast<size_t>(i)].exact = scheme_ != Scheme::dense;
  }
  if (scheme_ == Scheme::dense) {
    const DType d = entry(tensor_name(0, 0, "weight")).dtype;
    for (Conversion& c : conversions_) c.source = safetensors_dtype_name(d);
    info_.group_size = options_.group_size;
    info_.w13_scale_dtype = info_.w2_scale_dtype = DType::f32;
    return;
  }
  DType scale_dtype[3];
  int group = 0;
  for (int i = 0; i < 3; ++i) {
    const std::string s = tensor_name(0, i, "weight_scale");
    if (!has(s)) fail(cat("tensor '", s, "' is missing"));
    const TensorEntry& se = entry(s);
    if (!detail::is_float_dtype(se.dtype))
      fail(
          cat("tensor '", s, "' must be F32, BF16 or F16, got ", safetensors_dtype_name(se.dtype)));
    scale_dtype[i] = se.dtype;
    const int64_t cols = i == 2 ? I : H;
    const int64_t rows = i == 2 ? H : I;
    int g = -1;
    if (se.shape.size() == 2 && se.shape[0] == rows && se.shape[1] > 1 && cols % se.shape[1] == 0)
      g = static_cast<int>(cols / se.shape[1]);
    else if (!((se.shape.size() == 2 && se.shape[0] == rows && se.shape[1] == 1) ||
               (se.shape.size() == 1 && se.shape[0] == rows) ||
               (se.shape.size() <= 1 && (se.shape.empty() || se.shape[0] == 1))))
      fail(cat("tensor '", s, "' has a shape that fits neither group nor channel scales of a [",
               rows, ", ", cols, "] weight"));
    // One scale per row is also one group of the whole row: compressed-tensors writes [rows, 1]
    // for strategy "group" when group_size equals the row length (e.g. g = I for w2).
    if (g == -1 && strategy_ == "group" && config_group_size_ == cols) g = static_cast<int>(cols);
    if (i > 0 && g != group)
      fail(cat("tensor '", s, "' implies group size ", g, " but '",
               tensor_name(0, 0, "weight_scale"), "' implies ", group,
               ": w13 and w2 must share the group size"));
    group = g;
    conversions_[static_cast<size_t>(i)].source =
        cat(scheme_name(scheme_), g == -1 ? " channelwise" : cat(" g", g), ", ",
            safetensors_dtype_name(se.dtype), " scales");
  }
  if (strategy_ == "group" && config_group_size_ > 0 && config_group_size_ != group)
    fail(cat("config.json quantization_config says group_size ", config_group_size_,
             " but tensor '", tensor_name(0, 0, "weight_scale"), "' has group size ", group));
  if (!group_size_fits(group, H) || !group_size_fits(group, I))
    fail(cat("group size ", group,
             " is not supported: w4a8moe needs a multiple of 32 dividing "
             "H = ",
             H, " and I = ", I));
  info_.group_size = group;
  info_.w13_scale_dtype = scale_dtype[0] == scale_dtype[1] ? scale_dtype[0] : DType::f32;
  info_.w2_scale_dtype = scale_dtype[2];
}

void CompressedTensorsLayer::check_fused() {
  const int64_t H = info_.hidden, I = info_.inter, E = info_.experts;
  if (model_type_ == "gpt_oss") {
    interleaved_ = true;
  } else if (model_type_ == "llama4" || model_type_ == "llama4_text") {
    interleaved_ = false;
  } else {
    fail(cat("model_type '", model_type_, "' stores its experts fused in '", fused(0, ""),
             "', and w4a8moe knows the order of gate and up in that tensor only for gpt_oss "
             "(interleaved) and llama4 (halves)"));
  }
  const auto shape_text = [](const std::vector<int64_t>& s) {
    std::string t = "[";
    for (size_t i = 0; i < s.size(); ++i) t += cat(i ? ", " : "", s[i]);
    return t + "]";
  };
  const auto check = [&](const std::string& name, bool float_type, DType dtype,
                         const std::vector<int64_t>& shape) {
    if (!has(name)) fail(cat("tensor '", name, "' is missing"));
    const TensorEntry& t = entry(name);
    const bool dtype_ok = float_type ? detail::is_float_dtype(t.dtype) : t.dtype == dtype;
    if (!dtype_ok || t.shape != shape)
      fail(cat("tensor '", name, "' must be ",
               float_type ? "F32, BF16 or F16" : safetensors_dtype_name(dtype), " ",
               shape_text(shape), " (config.json: H ", H, ", I ", I, ", E ", E, "), got ",
               safetensors_dtype_name(t.dtype), " ", shape_text(t.shape)));
  };
  std::string source;
  if (scheme_ == Scheme::fused_float) {
    check(fused(0, ""), true, DType::f32, {E, H, 2 * I});
    check(fused(2, ""), true, DType::f32, {E, I, H});
    source = safetensors_dtype_name(entry(fused(0, "")).dtype);
    if (entry(fused(2, "")).dtype != entry(fused(0, "")).dtype)
      source += cat(" (down_proj ", safetensors_dtype_name(entry(fused(2, "")).dtype), ")");
  } else {
    if (H % 32 != 0 || I % 32 != 0)
      fail(cat("MXFP4 experts need H and I multiples of 32 (its block), got H ", H, ", I ", I));
    check(fused(0, "_blocks"), false, DType::u8, {E, 2 * I, H / 32, 16});
    check(fused(0, "_scales"), false, DType::u8, {E, 2 * I, H / 32});
    check(fused(2, "_blocks"), false, DType::u8, {E, H, I / 32, 16});
    check(fused(2, "_scales"), false, DType::u8, {E, H, I / 32});
    source = "MXFP4";
  }
  const bool bias13 = has(fused(0, "_bias")), bias2 = has(fused(2, "_bias"));
  if (bias13 != bias2)
    fail(cat("tensor '", bias13 ? fused(2, "_bias") : fused(0, "_bias"),
             "' is missing (the experts have biases for one projection only)"));
  if (bias13) {
    check(fused(0, "_bias"), true, DType::f32, {E, 2 * I});
    check(fused(2, "_bias"), true, DType::f32, {E, H});
    info_.expert_bias = true;
  }
  const char* const suffix = scheme_ == Scheme::fused_mxfp4 ? "_blocks" : "";
  const char* const order = interleaved_ ? "interleaved" : "halves";
  conversions_.resize(3);
  for (int i = 0; i < 3; ++i) {
    Conversion& c = conversions_[static_cast<size_t>(i)];
    c.tensor = i == 2 ? fused(2, suffix)
                      : cat(fused(0, suffix), " (", i == 0 ? "gate" : "up", ", ", order, ")");
    c.source = source;
    c.exact = false;
  }
  info_.group_size = options_.group_size;
  info_.w13_scale_dtype = info_.w2_scale_dtype = DType::f32;
}

void CompressedTensorsLayer::read_routing() {
  const int64_t H = info_.hidden, E = info_.experts;
  const std::string& mt = model_type_;
  const auto flag = [&](const char* key, bool fallback) {
    const json* v = config_value(key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean())
      fail(cat("config.json '", key, "' must be true or false, got ", v->dump()));
    return v->get<bool>();
  };
  const auto number = [&](const char* key, double fallback) {
    const json* v = config_value(key);
    if (v == nullptr) return fallback;
    if (!v->is_number()) fail(cat("config.json '", key, "' must be a number, got ", v->dump()));
    return v->get<double>();
  };

  // Activation.
  if (mt == "gpt_oss") {
    // GptOssExperts: clamped SwiGLU, swigluoai of docs/operator.md (config.json's hidden_act
    // does not say it)
    info_.params.activation = Activation::swigluoai;
    info_.params.alpha = static_cast<float>(number("swiglu_alpha", 1.702));
    info_.params.limit = static_cast<float>(number("swiglu_limit", 7.0));
  } else {
    std::string act = "silu";
    if (const json* a = config_value("hidden_act"); a != nullptr && a->is_string())
      act = a->get<std::string>();
    if (act == "silu" || act == "swish") {
      info_.params.activation = Activation::silu;
    } else if (act == "gelu") {
      info_.params.activation = Activation::gelu;
    } else if (act == "gelu_pytorch_tanh" || act == "gelu_new") {
      info_.params.activation = Activation::gelu_tanh;
    } else {
      fail(cat("config.json hidden_act \"", act, "\" is not silu, gelu or gelu_pytorch_tanh"));
    }
  }

  RoutingConfig& r = info_.routing;
  r.experts = E;
  r.top_k = info_.top_k;
  if (!shared_.empty()) {
    // every token; Qwen2-MoE scales the output by sigmoid(x . shared_expert_gate)
    r.gating = Gating::sigmoid;
    const std::string gate = cat(block_, "shared_expert_gate.weight");
    if (has(gate)) {
      const TensorEntry& ge = entry(gate);
      if (!detail::is_float_dtype(ge.dtype) ||
          (ge.shape != std::vector<int64_t>{1, H} && ge.shape != std::vector<int64_t>{H}))
        fail(cat("tensor '", gate, "' must be a float [1, ", H, "] tensor, got ",
                 safetensors_dtype_name(ge.dtype), " of rank ", ge.shape.size()));
      router_name_ = gate;
      info_.shared_gate = true;
    }
    return;
  }

  if (mt == "gpt_oss") {  // top-k on the logits (router bias included), softmax over the chosen
    r.gating = Gating::softmax_topk;
  } else if (mt == "llama4" || mt == "llama4_text") {  // top-k on the logits, sigmoid, on the input
    r.gating = Gating::sigmoid;
    info_.params.apply_router_weight_on_input = true;
    if (info_.top_k != 1)
      info_.notes.push_back(cat("the router weight is applied on the input with top-k ",
                                info_.top_k, " (Llama-4 uses 1)"));
  } else {
    std::string scoring = "softmax";
    if (const json* s = config_value("scoring_func"); s != nullptr && s->is_string())
      scoring = s->get<std::string>();
    if (scoring == "softmax") {
      r.gating = Gating::softmax;
    } else if (scoring == "sigmoid") {
      r.gating = Gating::sigmoid;
    } else {
      fail(cat("config.json scoring_func \"", scoring, "\" is not softmax or sigmoid"));
    }
    if (mt == "mixtral") {
      r.renormalize = true;
    } else if (mt == "qwen2_moe" || mt == "qwen3_moe" || mt == "qwen3_vl_moe" || mt == "olmoe" ||
               mt == "deepseek_v2" || mt == "deepseek_v3" || mt == "kimi_k2") {
      r.renormalize = flag("norm_topk_prob", false);
    } else {
      if (config_value("norm_topk_prob") == nullptr)
        fail(cat("model_type '", mt,
                 "' is not one whose routing w4a8moe knows, and config.json has "
                 "no 'norm_topk_prob' to say whether the top-k weights are renormalised"));
      r.renormalize = flag("norm_topk_prob", false);
    }
    r.scaling = static_cast<float>(number("routed_scaling_factor", 1.0));
    if (const json* m = config_value("topk_method"); m != nullptr && m->is_string())
      topk_method_ = m->get<std::string>();
    if (topk_method_ == "group_limited_greedy" || topk_method_ == "noaux_tc") {
      r.groups = config_int("n_group", true);
      r.groups_used = config_int("topk_group", true);
      r.group_score = topk_method_ == "noaux_tc" ? GroupScore::top2_sum : GroupScore::max;
    } else if (topk_method_ != "greedy") {
      fail(cat("config.json topk_method \"", topk_method_,
               "\" is not greedy, group_limited_greedy "
               "or noaux_tc"));
    }
  }
  try {
    check_routing_config(r);
  } catch (const Error& e) {
    fail(cat("the routing in config.json does not fit: ", e.what()));
  }

  // The router: "gate" (most models) or "router" (gpt-oss, Llama-4).
  for (const char* name : {"gate", "router"})
    if (has(cat(block_, name, ".weight"))) {
      router_name_ = cat(block_, name, ".weight");
      router_bias_name_ = cat(block_, name, ".bias");
      break;
    }
  if (router_name_.empty()) fail(cat("tensor '", block_, "gate.weight' (the router) is missing"));
  const TensorEntry& re = entry(router_name_);
  if (!detail::is_float_dtype(re.dtype) || re.shape != std::vector<int64_t>{E, H})
    fail(cat("tensor '", router_name_, "' must be a float [", E, ", ", H, "] tensor, got ",
             safetensors_dtype_name(re.dtype), " of rank ", re.shape.size()));
  if (has(router_bias_name_)) {
    const TensorEntry& be = entry(router_bias_name_);
    if (!detail::is_float_dtype(be.dtype) || be.shape != std::vector<int64_t>{E})
      fail(cat("tensor '", router_bias_name_, "' must be a float [", E, "] tensor"));
  } else {
    router_bias_name_.clear();
  }
  const std::string bias = cat(block_, "gate.e_score_correction_bias");
  if (has(bias)) {
    const TensorEntry& be = entry(bias);
    if (!detail::is_float_dtype(be.dtype) || be.shape != std::vector<int64_t>{E})
      fail(cat("tensor '", bias, "' must be a float [", E, "] tensor"));
    selection_bias_name_ = bias;
  } else if (topk_method_ == "noaux_tc") {
    fail(cat("tensor '", bias, "' is missing (topk_method noaux_tc needs the correction bias)"));
  }
}

Router CompressedTensorsLayer::router() const {
  Router out;
  if (!router_name_.empty()) out.weight = read_floats(router_name_);
  if (!router_bias_name_.empty()) out.bias = read_floats(router_bias_name_);
  if (!selection_bias_name_.empty()) out.selection_bias = read_floats(selection_bias_name_);
  return out;
}

void CompressedTensorsLayer::load_rows(int which, int64_t e, uint8_t* nibbles, uint8_t* scales,
                                       DType scale_dtype) const {
  const int64_t rows = which == 2 ? info_.hidden : info_.inter;
  const int64_t cols = which == 2 ? info_.inter : info_.hidden;
  const int g = info_.group_size;
  const int64_t groups = g == -1 ? 1 : cols / g;
  const auto shape_text = [](const std::vector<int64_t>& s) {
    std::string t = "[";
    for (size_t i = 0; i < s.size(); ++i) t += cat(i ? ", " : "", s[i]);
    return t + "]";
  };
  const auto require = [&](const std::string& name, DType dtype,
                           const std::vector<int64_t>& shape) -> std::span<const uint8_t> {
    if (!has(name)) fail(cat("tensor '", name, "' is missing"));
    const TensorEntry& t = entry(name);
    if (t.dtype != dtype || t.shape != shape)
      fail(cat("tensor '", name, "' must be ", safetensors_dtype_name(dtype), " ",
               shape_text(shape), ", got ", safetensors_dtype_name(t.dtype), " ",
               shape_text(t.shape)));
    return bytes(name);
  };

  if (scheme_ == Scheme::dense) {
    const std::string name = tensor_name(e, which, "weight");
    if (!has(name)) fail(cat("tensor '", name, "' is missing"));
    const TensorEntry& t = entry(name);
    if (!detail::is_float_dtype(t.dtype) || t.shape != std::vector<int64_t>{rows, cols})
      fail(cat("tensor '", name, "' must be a float ", shape_text({rows, cols}), ", got ",
               safetensors_dtype_name(t.dtype), " ", shape_text(t.shape)));
    const std::span<const uint8_t> b = bytes(name);
    Conversion stats;
    std::vector<float> row(static_cast<size_t>(cols)), row_scales(static_cast<size_t>(groups));
    for (int64_t n = 0; n < rows; ++n) {
      for (int64_t k = 0; k < cols; ++k)
        row[static_cast<size_t>(k)] = detail::load_float(b.data(), t.dtype, n * cols + k);
      convert_row(row.data(), cols, g, options_.rule, nibbles + n * (cols / 2), row_scales.data(),
                  stats, cat("checkpoint '", folder_, "': tensor '", name, "' row ", n));
      for (int64_t s = 0; s < groups; ++s)
        store_scale(scales, scale_dtype, n * groups + s, row_scales[static_cast<size_t>(s)]);
    }
    add_conversion(which, stats);
    return;
  }

  // scales: as stored (a widening to f32 when gate and up differ), channel [N, 1] or [N] or
  // one per tensor (broadcast to every row: the same values)
  const std::string scale_name = tensor_name(e, which, "weight_scale");
  if (!has(scale_name)) fail(cat("tensor '", scale_name, "' is missing"));
  const TensorEntry& se = entry(scale_name);
  const int64_t scale_count = g == -1 ? rows : rows * groups;
  int64_t stored = 1;
  for (const int64_t d : se.shape) stored *= d;
  const bool per_tensor = g == -1 && stored == 1;
  if (!detail::is_float_dtype(se.dtype) || (stored != scale_count && !per_tensor) ||
      (g != -1 && se.shape != std::vector<int64_t>{rows, groups}))
    fail(cat("tensor '", scale_name, "' must be float ",
             g == -1 ? shape_text({rows, 1}) : shape_text({rows, groups}), ", got ",
             safetensors_dtype_name(se.dtype), " ", shape_text(se.shape)));
  const std::span<const uint8_t> sb = bytes(scale_name);
  for (int64_t i = 0; i < scale_count; ++i) {
    const int64_t src = per_tensor ? 0 : i;
    if (se.dtype == scale_dtype) {
      std::memcpy(scales + i * static_cast<int64_t>(dtype_bytes(scale_dtype)),
                  sb.data() + src * static_cast<int64_t>(dtype_bytes(se.dtype)),
                  dtype_bytes(se.dtype));
    } else if (scale_dtype == DType::f32) {
      store_scale(scales, scale_dtype, i, detail::load_float(sb.data(), se.dtype, src));
    } else {
      fail(cat("tensor '", scale_name, "' is ", safetensors_dtype_name(se.dtype),
               " but expert 0's scales are ", dtype_name(scale_dtype)));
    }
  }

  if (scheme_ == Scheme::packed) {
    const std::string shape_name = tensor_name(e, which, "weight_shape");
    if (!has(shape_name)) fail(cat("tensor '", shape_name, "' is missing"));
    const TensorEntry& she = entry(shape_name);
    if ((she.dtype != DType::i64 && she.dtype != DType::i32) ||
        she.shape != std::vector<int64_t>{2})
      fail(cat("tensor '", shape_name, "' must be I64 or I32 [2], got ",
               safetensors_dtype_name(she.dtype), " ", shape_text(she.shape)));
    const std::span<const uint8_t> shb = bytes(shape_name);
    const int64_t n0 = detail::load_index(shb.data(), she.dtype, 0);
    const int64_t n1 = detail::load_index(shb.data(), she.dtype, 1);
    if (n0 != rows || n1 != cols)
      fail(cat("tensor '", shape_name, "' says [", n0, ", ", n1, "], expected [", rows, ", ", cols,
               "] from config.json"));
    // cols is a multiple of 32 (the group-size check), so the words hold no padding
    const std::span<const uint8_t> wb =
        require(tensor_name(e, which, "weight_packed"), DType::i32, {rows, cols / 8});
    std::memcpy(nibbles, wb.data(), wb.size());
  } else {
    const std::string name = tensor_name(e, which, "weight");
    const std::span<const uint8_t> wb = require(name, DType::i8, {rows, cols});
    const auto* v = reinterpret_cast<const int8_t*>(wb.data());
    for (int64_t i = 0; i < rows * cols; ++i)
      if (v[i] < -8 || v[i] > 7)
        fail(cat("tensor '", name, "' holds ", int{v[i]}, " at [", i / cols, ", ", i % cols,
                 "], outside int4 [-8, 7]"));
    pack_nibbles(v, rows * cols, nibbles);
  }
  if (has(tensor_name(e, which, "weight_zero_point")))
    fail(cat("tensor '", tensor_name(e, which, "weight_zero_point"),
             "' exists: asymmetric weights (a zero point) are not supported"));
  if (has(tensor_name(e, which, "weight_g_idx")))
    fail(cat("tensor '", tensor_name(e, which, "weight_g_idx"),
             "' exists: activation reordering (act-order) is not supported"));
}

void CompressedTensorsLayer::load_fused_rows(int which, int64_t e, uint8_t* nibbles,
                                             uint8_t* scales, DType scale_dtype,
                                             float* bias) const {
  const int64_t H = info_.hidden, I = info_.inter;
  const int64_t rows = which == 2 ? H : I, cols = which == 2 ? I : H;
  const int64_t outs = which == 2 ? H : 2 * I;  // columns of the fused [in, out] matrix
  const int g = info_.group_size;
  const int64_t groups = g == -1 ? 1 : cols / g;
  const std::string& what = conversions_[static_cast<size_t>(which)].tensor;
  Conversion stats;
  std::vector<float> strip(static_cast<size_t>(kStripRows * cols));
  std::vector<float> row_scales(static_cast<size_t>(groups));
  const auto convert = [&](const float* row, int64_t n) {
    convert_row(row, cols, g, options_.rule, nibbles + n * (cols / 2), row_scales.data(), stats,
                cat("checkpoint '", folder_, "': tensor '", what, "' expert ", e, " row ", n));
    for (int64_t s = 0; s < groups; ++s)
      store_scale(scales, scale_dtype, n * groups + s, row_scales[static_cast<size_t>(s)]);
  };
  if (scheme_ == Scheme::fused_float) {
    const std::string name = fused(which, "");
    const DType dtype = entry(name).dtype;
    const uint8_t* matrix =
        bytes(name).data() + static_cast<size_t>(e * cols * outs) * dtype_bytes(dtype);
    const int64_t step = which != 2 && interleaved_ ? 2 : 1;
    for (int64_t r0 = 0; r0 < rows; r0 += kStripRows) {
      const int64_t count = std::min(kStripRows, rows - r0);
      gather_columns(matrix, dtype, cols, outs, fused_column(which, r0), step, count, strip.data());
      for (int64_t r = 0; r < count; ++r) convert(strip.data() + r * cols, r0 + r);
    }
  } else {
    const uint8_t* blocks = bytes(fused(which, "_blocks")).data();
    const uint8_t* block_scales = bytes(fused(which, "_scales")).data();
    const int64_t blocks_per_row = cols / 32;
    for (int64_t n = 0; n < rows; ++n) {
      const int64_t at = (e * outs + fused_column(which, n)) * blocks_per_row;
      decode_mxfp4_row(blocks + at * 16, block_scales + at, cols, strip.data());
      convert(strip.data(), n);
    }
  }
  add_conversion(which, stats);
  if (bias != nullptr) {
    const std::string name = fused(which, "_bias");
    const DType dtype = entry(name).dtype;
    const uint8_t* b = bytes(name).data();
    for (int64_t r = 0; r < rows; ++r)
      bias[r] = detail::load_float(b, dtype, e * outs + fused_column(which, r));
  }
}

void CompressedTensorsLayer::load_expert(int64_t e, const ExpertSlot& slot) const {
  const int64_t H = info_.hidden, I = info_.inter;
  const int g = info_.group_size;
  const int64_t g13 = g == -1 ? 1 : H / g;
  const size_t s13 = dtype_bytes(info_.w13_scale_dtype);
  uint8_t* const up = slot.w13 + I * (H / 2);
  uint8_t* const up_scales = slot.w13_scale + static_cast<size_t>(I * g13) * s13;
  if (scheme_ == Scheme::fused_float || scheme_ == Scheme::fused_mxfp4) {
    load_fused_rows(0, e, slot.w13, slot.w13_scale, info_.w13_scale_dtype, slot.w13_bias);
    load_fused_rows(1, e, up, up_scales, info_.w13_scale_dtype,
                    slot.w13_bias != nullptr ? slot.w13_bias + I : nullptr);
    load_fused_rows(2, e, slot.w2, slot.w2_scale, info_.w2_scale_dtype, slot.w2_bias);
    return;
  }
  load_rows(0, e, slot.w13, slot.w13_scale, info_.w13_scale_dtype);
  load_rows(1, e, up, up_scales, info_.w13_scale_dtype);
  load_rows(2, e, slot.w2, slot.w2_scale, info_.w2_scale_dtype);
}

void CompressedTensorsLayer::release_expert(int64_t e) const {
  if (scheme_ == Scheme::fused_float || scheme_ == Scheme::fused_mxfp4) {
    // expert e's part of each fused [E, ...] tensor
    for (const int which : {0, 2})
      for (const char* suffix : {"", "_blocks", "_scales", "_bias"}) {
        const std::string name = fused(which, suffix);
        if (!has(name)) continue;
        const std::span<const uint8_t> b = bytes(name);
        const size_t per_expert = b.size() / static_cast<size_t>(info_.experts);
        release_mapped(b.data() + static_cast<size_t>(e) * per_expert, per_expert);
      }
    return;
  }
  for (int which = 0; which < 3; ++which)
    for (const char* suffix : {"weight_packed", "weight", "weight_scale"}) {
      const std::string name = tensor_name(e, which, suffix);
      if (has(name)) shard_of(name).release(name);
    }
}

}  // namespace

std::unique_ptr<LayerSource> open_compressed_tensors_layer(const std::string& folder, int layer,
                                                           const LoadOptions& options) {
  return std::make_unique<CompressedTensorsLayer>(folder, layer, options);
}

}  // namespace w4a8moe::io
