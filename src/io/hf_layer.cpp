// Opening a Hugging Face layer (hf_layer.hpp): where its experts are, how they are stored, the
// sizes, and the checks of the tensors against them.
#include "io/hf_layer.hpp"

#include <vector>

#include "common/format.hpp"
#include "common/numeric.hpp"

namespace w4a8moe::io {

using detail::cat;
using nlohmann::json;

namespace {

constexpr const char* kLayerPrefixes[] = {"model.layers.", "model.language_model.layers.",
                                          "language_model.model.layers."};

}  // namespace

const char* hf_scheme_name(HfScheme s) {
  switch (s) {
    case HfScheme::packed:
      return "pack-quantized int4";
    case HfScheme::int8:
      return "int-quantized int4";
    case HfScheme::dense:
    case HfScheme::fused_float:
      return "dense";
    case HfScheme::fused_mxfp4:
      return "MXFP4";
    case HfScheme::gptq:
      return "GPTQ int4";
    case HfScheme::awq:
      return "AWQ int4";
  }
  return "?";
}

std::string HfLayer::module(int64_t e, int which) const {
  if (!shared_.empty()) return cat(block_, shared_, ".", naming_->proj[which]);
  return cat(block_, "experts.", e, ".", naming_->proj[which]);
}

std::string HfLayer::tensor_name(int64_t e, int which, const char* suffix) const {
  return cat(module(e, which), ".", suffix);
}

std::string HfLayer::fused(int which, const char* suffix) const {
  return cat(block_, "experts.", which == 2 ? "down_proj" : "gate_up_proj", suffix);
}

// Where the layer's experts are: per-expert modules, or the two fused tensors.
void HfLayer::locate_block(int layer) {
  // the family's own naming first, then the others
  std::vector<const HfNaming*> namings;
  if (family_ != nullptr) namings.push_back(family_->naming);
  for (const HfNaming& n : hf_namings())
    if (namings.empty() || namings.front() != &n) namings.push_back(&n);
  for (const char* prefix : kLayerPrefixes)
    for (const HfNaming* n : namings) {
      const std::string block = cat(prefix, layer, ".", n->block);
      const std::string probe = cat(block, "experts.0.", n->proj[0], ".");
      block_ = block;
      naming_ = n;
      if (has(probe + "weight_packed") || has(probe + "weight") || has(probe + "qweight")) return;
      if (has(fused(0, ""))) {
        scheme_ = HfScheme::fused_float;
        return;
      }
      if (has(fused(0, "_blocks"))) {
        scheme_ = HfScheme::fused_mxfp4;
        return;
      }
    }
  std::string why;
  const int64_t dense = config_.integer("first_k_dense_replace", false);
  if (dense > layer) why = cat(" (config.json first_k_dense_replace = ", dense, ": a dense layer)");
  const int64_t layers = config_.integer("num_hidden_layers", false);
  if (layers >= 0 && layer >= layers) why = cat(" (the model has ", layers, " layers)");
  fail(cat("layer ", layer, " has no experts (no 'model.layers.", layer,
           ".mlp.experts.0.gate_proj.weight_packed' or '.weight', nor a fused "
           "'experts.gate_up_proj')",
           why));
}

HfLayer::HfLayer(const std::string& folder, int layer, const LoadOptions& options)
    : folder_(folder),
      options_(options),
      config_(HfConfig::read(folder)),
      tensors_(folder),
      family_(family_of_model_type(config_.model_type())) {
  info_.format = "compressed-tensors";
  info_.layer = layer;
  info_.model = config_.model_type();
  locate_block(layer);
  const auto has_module = [&](int64_t e, const char* suffix) {
    return has(tensor_name(e, 0, suffix));
  };
  for (const char* m : kHfSharedModules) {
    shared_ = m;
    info_.has_shared_expert |=
        has_module(0, "weight_packed") || has_module(0, "weight") || has_module(0, "qweight");
    if (info_.has_shared_expert) break;
  }
  if (!options.shared_expert || !info_.has_shared_expert) shared_.clear();
  if (options.shared_expert) {
    if (!info_.has_shared_expert)
      fail(cat("layer ", layer, " has no shared expert (neither '", block_, kHfSharedModules[0],
               ".", naming_->proj[0], ".weight' nor '", block_, kHfSharedModules[1], ".",
               naming_->proj[0], ".weight' exists)"));
    info_.has_shared_expert = false;  // this source is the shared expert
    scheme_ = HfScheme::dense;        // stored like one routed expert, whatever the experts are
  }
  if (!is_fused()) {
    const std::string gate0 = tensor_name(0, 0, "");
    if (has(gate0 + "qweight")) {
      const json* q = config_.value("quantization_config");
      std::string method = "(none)";
      if (q != nullptr && q->is_object())
        if (const auto m = q->find("quant_method"); m != q->end()) method = m->dump();
      if (method != "\"gptq\"" && method != "\"awq\"")
        fail(cat("tensor '", gate0,
                 "qweight' is GPTQ / AWQ packing but config.json's quantization_config has "
                 "quant_method ",
                 method, ", not \"gptq\" or \"awq\""));
      gptq_ = read_gptq_scheme(folder_, *q);
      scheme_ = gptq_.awq ? HfScheme::awq : HfScheme::gptq;
    } else if (has(gate0 + "weight_packed")) {
      scheme_ = HfScheme::packed;
    } else if (entry(gate0 + "weight").dtype == DType::i8) {
      scheme_ = HfScheme::int8;
    } else {
      scheme_ = HfScheme::dense;
    }
    if (scheme_ == HfScheme::packed || scheme_ == HfScheme::int8) {
      const json* q = config_.value("quantization_config");
      if (q == nullptr || !q->is_object())
        fail(cat("tensor '", gate0, scheme_ == HfScheme::packed ? "weight_packed" : "weight",
                 "' is quantized but config.json has no quantization_config"));
      quantization_ = read_compressed_tensors_scheme(folder_, *q, module(0, 0));
      if (scheme_ == HfScheme::packed && !quantization_.format.empty() &&
          quantization_.format != "pack-quantized")
        fail(cat("config.json quantization_config format is \"", quantization_.format,
                 "\" but the experts are stored as weight_packed (pack-quantized)"));
      if (scheme_ == HfScheme::int8 && !quantization_.format.empty() &&
          quantization_.format != "int-quantized" && quantization_.format != "naive-quantized")
        fail(cat("config.json quantization_config format is \"", quantization_.format,
                 "\" but the experts are stored as int8 'weight' tensors (int-quantized)"));
    } else if (scheme_ == HfScheme::dense && options.require_exact) {
      fail(cat("tensor '", gate0, "weight' is ",
               safetensors_dtype_name(entry(gate0 + "weight").dtype),
               ", which does not map exactly onto int4; allow the conversion to quantize it"));
    }
  } else if (options.require_exact && scheme_ == HfScheme::fused_float) {  // MXFP4 is exact
    const std::string t = fused(0, "");
    fail(cat("tensor '", t, "' is ", safetensors_dtype_name(entry(t).dtype),
             ", which does not map exactly onto int4; allow the conversion to quantize it"));
  }

  read_sizes();
  if (is_fused()) {
    check_fused();
  } else {
    check_modules();
  }
  const int g = info_.group_size;
  const int64_t H = info_.hidden, I = info_.inter;
  if (!group_size_fits(g, H) || !group_size_fits(g, I))
    fail(cat("group size ", g, " must be -1 or a multiple of 32 dividing H = ", H, " and I = ", I));
  read_activation();
  read_routing();
}

// E, K, H and I from config.json (a shared expert: I from its gate projection).
void HfLayer::read_sizes() {
  const int64_t H = config_.integer("hidden_size", true);
  int64_t E = 1, K = 1, I = 0;
  if (!shared_.empty()) {
    // the shared expert's own intermediate size, from its gate projection [I, H(/8)]
    const std::string w0 = tensor_name(0, 0,
                                       scheme_ == HfScheme::packed ? "weight_packed"
                                       : is_gptq()                 ? "qweight"
                                                                   : "weight");
    if (entry(w0).shape.size() != 2) fail(cat("tensor '", w0, "' must have rank 2"));
    // GPTQ / AWQ store [in, out] (packed along one of them)
    I = scheme_ == HfScheme::gptq  ? entry(w0).shape[1]
        : scheme_ == HfScheme::awq ? entry(w0).shape[1] * 8
                                   : entry(w0).shape[0];
    if (const int64_t want = config_.integer("shared_expert_intermediate_size", false);
        want > 0 && want != I)
      fail(cat("config.json shared_expert_intermediate_size is ", want, " but tensor '", w0,
               "' has ", I, " rows"));
  } else {
    E = config_.integer("num_experts", false);
    if (E < 0) E = config_.integer("num_local_experts", false);
    if (E < 0) E = config_.integer("n_routed_experts", false);
    if (E < 1)
      fail(
          "config.json has no number of experts (num_experts, num_local_experts or "
          "n_routed_experts)");
    K = config_.integer("num_experts_per_tok", true);
    I = config_.integer("moe_intermediate_size", false);
    if (I < 0) I = config_.integer("intermediate_size", true);
  }
  if (H < 2 || I < 2 || H % 2 != 0 || I % 2 != 0 || K < 1 || K > E)
    fail(cat("config.json sizes do not fit: hidden_size ", H, ", intermediate size ", I,
             " (both even), num_experts_per_tok ", K, " of ", E, " experts"));
  info_.hidden = H;
  info_.inter = I;
  info_.experts = E;
  info_.top_k = K;
}

// The experts' tensors must back the sizes config.json gives, before anything is allocated from
// them: expert 0's shapes and the last expert's presence; then the group size and scale dtypes
// from expert 0 (every expert is checked when loaded).
void HfLayer::check_modules() {
  if (is_gptq()) {
    check_gptq_modules();
    return;
  }
  const int64_t H = info_.hidden, I = info_.inter, E = info_.experts;
  const char* const weight_suffix = scheme_ == HfScheme::packed ? "weight_packed" : "weight";
  if (shared_.empty() && has(tensor_name(E, 0, weight_suffix)))
    fail(cat("the checkpoint holds more than the ", E, " experts config.json announces (tensor '",
             tensor_name(E, 0, weight_suffix), "' exists)"));
  for (int i = 0; i < 3; ++i) {
    const int64_t rows = i == 2 ? H : I, cols = i == 2 ? I : H;
    const std::string w0 = tensor_name(0, i, weight_suffix);
    if (!has(w0)) fail(cat("tensor '", w0, "' is missing"));
    const std::vector<int64_t> want = scheme_ == HfScheme::packed
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
    conversions_[static_cast<size_t>(i)].exact = scheme_ != HfScheme::dense;
  }
  if (scheme_ == HfScheme::dense) {
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
    if (g == -1 && quantization_.strategy == "group" && quantization_.group_size == cols)
      g = static_cast<int>(cols);
    if (i > 0 && g != group)
      fail(cat("tensor '", s, "' implies group size ", g, " but '",
               tensor_name(0, 0, "weight_scale"), "' implies ", group,
               ": w13 and w2 must share the group size"));
    group = g;
    conversions_[static_cast<size_t>(i)].source =
        cat(hf_scheme_name(scheme_), g == -1 ? " channelwise" : cat(" g", g), ", ",
            safetensors_dtype_name(se.dtype), " scales");
  }
  if (quantization_.strategy == "group" && quantization_.group_size > 0 &&
      quantization_.group_size != group)
    fail(cat("config.json quantization_config says group_size ", quantization_.group_size,
             " but tensor '", tensor_name(0, 0, "weight_scale"), "' has group size ", group));
  if (!group_size_fits(group, H) || !group_size_fits(group, I))
    fail(cat("group size ", group,
             " is not supported: w4a8moe needs a multiple of 32 dividing "
             "H = ",
             H, " and I = ", I));
  info_.group_size = group;
  info_.w13_input_order = quantization_.act_order && group != -1;
  if (info_.w13_input_order)
    info_.notes.push_back(
        "act-order (actorder \"group\"): each expert's gate and up columns sorted by group, with "
        "the order that gathers their inputs; down's order moves the gate and up rows");
  if (!quantization_.symmetric) {
    info_.w13_format = info_.w2_format = WeightFormat::int4_zero_point;
    for (int i = 0; i < 3; ++i) {
      const std::string z = tensor_name(0, i, "weight_zero_point");
      if (!has(z))
        fail(cat("tensor '", z,
                 "' is missing (config.json quantization_config says symmetric: "
                 "false)"));
      conversions_[static_cast<size_t>(i)].source += ", zero points";
    }
  }
  info_.w13_scale_dtype = scale_dtype[0] == scale_dtype[1] ? scale_dtype[0] : DType::f32;
  info_.w2_scale_dtype = scale_dtype[2];
}

std::span<const uint8_t> HfLayer::require(const std::string& name, DType dtype,
                                          const std::vector<int64_t>& shape) const {
  if (!has(name)) fail(cat("tensor '", name, "' is missing"));
  const TensorEntry& t = entry(name);
  if (t.dtype != dtype || t.shape != shape)
    fail(cat("tensor '", name, "' must be ", safetensors_dtype_name(dtype), " ",
             shape_string(shape), ", got ", safetensors_dtype_name(t.dtype), " ",
             shape_string(t.shape)));
  return bytes(name);
}

const TensorEntry& HfLayer::require_float(const std::string& name,
                                          const std::vector<int64_t>& shape) const {
  if (!has(name)) fail(cat("tensor '", name, "' is missing"));
  const TensorEntry& t = entry(name);
  if (!detail::is_float_dtype(t.dtype) || t.shape != shape)
    fail(cat("tensor '", name, "' must be F16, BF16 or F32 ", shape_string(shape), ", got ",
             safetensors_dtype_name(t.dtype), " ", shape_string(t.shape)));
  return t;
}

// GPTQ / AWQ: expert 0's tensors against config.json's sizes and the quantization_config's group
// size, the last expert's presence, the scales' dtypes (gptq_scheme.hpp for the layouts).
void HfLayer::check_gptq_modules() {
  const int64_t H = info_.hidden, I = info_.inter, E = info_.experts;
  const int g = gptq_.group_size;
  if (shared_.empty() && has(tensor_name(E, 0, "qweight")))
    fail(cat("the checkpoint holds more than the ", E, " experts config.json announces (tensor '",
             tensor_name(E, 0, "qweight"), "' exists)"));
  if (!group_size_fits(g, H) || !group_size_fits(g, I))
    fail(cat("config.json quantization_config group_size ", g,
             " is not supported: w4a8moe needs -1 or a multiple of 32 dividing H = ", H,
             " and I = ", I));
  const bool zero_points = gptq_.awq || !gptq_.symmetric;
  conversions_.resize(3);
  DType scale_dtype[3];
  for (int i = 0; i < 3; ++i) {
    const int64_t rows = i == 2 ? H : I, cols = i == 2 ? I : H;
    const int64_t groups = g == -1 ? 1 : cols / g;
    if (rows % 8 != 0)
      fail(cat("GPTQ / AWQ packing needs output sizes that are multiples of 8, got ", rows));
    const std::string w = tensor_name(0, i, "qweight"), s = tensor_name(0, i, "scales");
    require(
        w, DType::i32,
        gptq_.awq ? std::vector<int64_t>{cols, rows / 8} : std::vector<int64_t>{cols / 8, rows});
    require(tensor_name(0, i, "qzeros"), DType::i32, {groups, rows / 8});
    const TensorEntry& se = require_float(s, {groups, rows});
    scale_dtype[i] = se.dtype;
    const std::string last = tensor_name(E - 1, i, "qweight");
    if (!has(last))
      fail(cat("config.json announces ", E, " experts, but tensor '", last, "' is missing"));
    Conversion& c = conversions_[static_cast<size_t>(i)];
    c.tensor = shared_.empty() ? cat(block_, "experts.*.", naming_->proj[i]) : module(0, i);
    c.exact = true;
    c.source = cat(hf_scheme_name(scheme_), g == -1 ? " channelwise" : cat(" g", g), ", ",
                   safetensors_dtype_name(se.dtype), " scales", zero_points ? ", zero points" : "");
  }
  info_.group_size = g;
  if (zero_points) info_.w13_format = info_.w2_format = WeightFormat::int4_zero_point;
  // act-order: w13's columns in each expert's group order, gathered by forward() (w2's order is
  // taken into w13's rows when loading)
  info_.w13_input_order = !gptq_.awq && gptq_.desc_act;
  if (info_.w13_input_order)
    info_.notes.push_back(
        "act-order (desc_act): each expert's gate and up columns sorted by group, with the order "
        "that gathers their inputs; down's order moves the gate and up rows");
  info_.w13_scale_dtype = scale_dtype[0] == scale_dtype[1] ? scale_dtype[0] : DType::f32;
  info_.w2_scale_dtype = scale_dtype[2];
}

void HfLayer::check_fused() {
  const int64_t H = info_.hidden, I = info_.inter, E = info_.experts;
  if (family_ == nullptr || family_->fused == FusedGateUp::unknown)
    fail(cat("model_type '", config_.model_type(), "' stores its experts fused in '", fused(0, ""),
             "', and w4a8moe knows the order of gate and up in that tensor only for ",
             known_fused_layouts()));
  const auto check = [&](const std::string& name, bool float_type, DType dtype,
                         const std::vector<int64_t>& shape) {
    if (!has(name)) fail(cat("tensor '", name, "' is missing"));
    const TensorEntry& t = entry(name);
    const bool dtype_ok = float_type ? detail::is_float_dtype(t.dtype) : t.dtype == dtype;
    if (!dtype_ok || t.shape != shape)
      fail(cat("tensor '", name, "' must be ",
               float_type ? "F32, BF16 or F16" : safetensors_dtype_name(dtype), " ",
               shape_string(shape), " (config.json: H ", H, ", I ", I, ", E ", E, "), got ",
               safetensors_dtype_name(t.dtype), " ", shape_string(t.shape)));
  };
  std::string source;
  if (scheme_ == HfScheme::fused_float) {
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
  const char* const suffix = scheme_ == HfScheme::fused_mxfp4 ? "_blocks" : "";
  const char* const order = family_->fused == FusedGateUp::interleaved ? "interleaved" : "halves";
  conversions_.resize(3);
  const bool mxfp4 = scheme_ == HfScheme::fused_mxfp4;  // taken exactly (WeightFormat::mxfp4)
  for (int i = 0; i < 3; ++i) {
    Conversion& c = conversions_[static_cast<size_t>(i)];
    c.tensor = i == 2 ? fused(2, suffix)
                      : cat(fused(0, suffix), " (", i == 0 ? "gate" : "up", ", ", order, ")");
    c.source = source;
    c.exact = mxfp4;
  }
  if (mxfp4) {
    if (options_.group_size != 32)
      info_.notes.push_back(
          cat("group size 32 (MXFP4's blocks, taken exactly) instead of ", options_.group_size));
    info_.group_size = 32;
    info_.w13_format = info_.w2_format = WeightFormat::mxfp4;
    info_.w13_scale_dtype = info_.w2_scale_dtype = DType::u8;  // the e8m0 exponents
    return;
  }
  info_.group_size = options_.group_size;
  info_.w13_scale_dtype = info_.w2_scale_dtype = DType::f32;
}

std::unique_ptr<LayerSource> open_hf_layer(const std::string& folder, int layer,
                                           const LoadOptions& options) {
  return std::make_unique<HfLayer>(folder, layer, options);
}

}  // namespace w4a8moe::io
