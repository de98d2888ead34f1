// One MoE layer of a GGUF file.
//
// Tensors of layer N ("blk.N."), in GGUF's dimension order (ne[0] innermost):
//   ffn_gate_inp.weight [H, E]        router (f32 math), optional ffn_gate_inp.bias [E]
//   exp_probs_b.bias [E]              DeepSeek-V3's selection (correction) bias, optional
//   ffn_gate_exps.weight [H, I, E]    = row-major [E, I, H]; likewise ffn_up_exps
//   ffn_down_exps.weight [I, H, E]    = row-major [E, H, I]
//   ffn_{gate,up,down}_exps.bias      gpt-oss: [I, E], [I, E], [H, E]
// and the shared expert (LoadOptions::shared_expert; qwen2moe, deepseek2, llama4):
//   ffn_gate_shexp.weight [H, Is], ffn_up_shexp.weight [H, Is], ffn_down_shexp.weight [Is, H]
//   ffn_gate_inp_shexp.weight [H] (or [H, 1]): Qwen2-MoE's gate, out += sigmoid(x . g) * shared(x)
// Metadata "<arch>.": expert_count, expert_used_count, embedding_length,
// expert_feed_forward_length, expert_gating_func (1 softmax, 2 sigmoid, 3 softmax over the chosen
// logits), expert_weights_norm, expert_weights_scale, expert_group_count,
// expert_group_used_count. Where a key is absent the architecture's llama.cpp default applies.
#include <algorithm>
#include <cstring>
#include <functional>
#include <map>

#include "common/format.hpp"
#include "common/numeric.hpp"
#include "io/checkpoint.hpp"
#include "io/convert.hpp"
#include "io/gguf.hpp"
#include "io/gguf_split.hpp"
#include "io/model_family.hpp"

namespace w4a8moe::io {

namespace {

using detail::cat;

enum class Kind { exact_q4_0, exact_mxfp4, convert };

class GgufLayer final : public LayerSource {
 public:
  GgufLayer(const std::string& path, int layer, const LoadOptions& options);
  Router router() const override;
  void load_expert(int64_t e, const ExpertSlot& slot) const override;
  void release_expert(int64_t e) const override;

 private:
  [[noreturn]] void fail(const std::string& problem) const {
    throw Error(cat("GGUF file '", path_, "': ", problem));
  }
  std::string name(const char* suffix) const { return cat("blk.", info_.layer, ".", suffix); }
  const GgufFile& meta() const { return files_.front(); }
  const GgufTensor* find_tensor(const std::string& n) const;
  const GgufFile& owner(const GgufTensor& t) const;  // the file holding t
  std::span<const uint8_t> bytes(const GgufTensor& t) const { return owner(t).bytes(t); }
  const GgufTensor& require(const char* suffix) const;
  const GgufTensor* optional(const char* suffix) const { return find_tensor(name(suffix)); }
  void check_shape(const GgufTensor& t, std::initializer_list<int64_t> ne) const;
  void check_float_type(const GgufTensor& t) const;
  std::vector<float> read_floats(const GgufTensor& t) const;
  void init_routed(const ModelFamily& family);
  void init_shared(const ModelFamily& family);
  // Q4_0 tensors map exactly; others are converted (or refused): sets the group size and the
  // scale dtypes of the three expert tensors.
  void choose_types();
  // Rows [row0, row0 + rows) of expert e of an expert tensor, into nibbles and scales (row r of
  // the slot starts at nibbles + r * cols / 2 and scales + r * groups).
  void load_rows(int which, int64_t e, uint8_t* nibbles, uint8_t* scales, DType scale_dtype,
                 float* bias) const;

  std::string path_;             // as given
  std::vector<GgufFile> files_;  // the metadata file first, then the other splits (if split)
  LoadOptions options_;
  const GgufTensor* experts_[3] = {};  // gate, up, down
  const GgufTensor* bias_[3] = {};
  Kind kind_[3] = {};
  const GgufTensor* router_ = nullptr;  // [H, E]; a shared expert's gate [H] (or none)
  const GgufTensor* router_bias_ = nullptr;
  const GgufTensor* selection_bias_ = nullptr;
};

constexpr const char* kSharedTensors[3] = {"ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                                           "ffn_down_shexp.weight"};

const GgufTensor* GgufLayer::find_tensor(const std::string& n) const {
  for (const GgufFile& f : files_)
    if (const GgufTensor* t = f.find_tensor(n)) return t;
  return nullptr;
}

const GgufFile& GgufLayer::owner(const GgufTensor& t) const {
  const std::less<const GgufTensor*> before;
  for (const GgufFile& f : files_)
    if (!f.tensors().empty() && !before(&t, &f.tensors().front()) &&
        !before(&f.tensors().back(), &t))
      return f;
  fail(cat("tensor '", t.name, "' belongs to no file (internal error)"));
}

const GgufTensor& GgufLayer::require(const char* suffix) const {
  const GgufTensor* t = find_tensor(name(suffix));
  if (t == nullptr) fail(cat("tensor '", name(suffix), "' is missing"));
  return *t;
}

void GgufLayer::check_shape(const GgufTensor& t, std::initializer_list<int64_t> ne) const {
  bool ok = t.n_dims == static_cast<int>(ne.size());
  int i = 0;
  for (const int64_t d : ne) ok = ok && t.ne[static_cast<size_t>(i++)] == d;
  if (ok) return;
  std::string want = "[", got = "[";
  i = 0;
  for (const int64_t d : ne) want += cat(i++ ? ", " : "", d);
  for (int k = 0; k < t.n_dims; ++k) got += cat(k ? ", " : "", t.ne[static_cast<size_t>(k)]);
  fail(cat("tensor '", t.name, "' must have ne ", want, "] (GGUF order, innermost first), got ",
           got, "]"));
}

void GgufLayer::check_float_type(const GgufTensor& t) const {
  const std::optional<GgmlTypeInfo> info = ggml_type_info(t.type);
  if (!info || !info->dequantizable)
    fail(cat("tensor '", t.name, "' has type ", ggml_type_label(t.type),
             ", which w4a8moe cannot read (it reads ", ggml_dequantizable_names(), ")"));
}

std::vector<float> GgufLayer::read_floats(const GgufTensor& t) const {
  check_float_type(t);
  std::vector<float> out(static_cast<size_t>(t.ne[0] * t.rows()));
  const std::span<const uint8_t> data = bytes(t);
  for (int64_t r = 0; r < t.rows(); ++r)
    ggml_dequantize_row(static_cast<GgmlType>(t.type),
                        data.data() + r * static_cast<int64_t>(t.row_bytes()), t.ne[0],
                        out.data() + r * t.ne[0]);
  return out;
}

GgufLayer::GgufLayer(const std::string& path, int layer, const LoadOptions& options)
    : path_(path), options_(options) {
  files_ = open_gguf_model(path);
  const GgufFile& meta_file = meta();
  info_.format = "gguf";
  info_.layer = layer;
  const std::optional<std::string> arch = meta_file.get_string("general.architecture");
  if (!arch) fail("metadata 'general.architecture' is missing");
  info_.model = *arch;
  const ModelFamily* family = family_of_gguf_arch(*arch);
  if (family == nullptr)
    fail(cat("architecture '", *arch, "' is not one whose routing w4a8moe knows (",
             known_gguf_archs(), ")"));
  const std::string blocks_key = cat(*arch, ".block_count");
  if (const std::optional<int64_t> blocks = meta_file.get_int(blocks_key))
    if (layer >= *blocks)
      fail(cat("layer ", layer, " does not exist: the model has ", *blocks, " blocks (", blocks_key,
               ")"));
  if (options.shared_expert) {
    init_shared(*family);
  } else {
    init_routed(*family);
  }
}

void GgufLayer::init_routed(const ModelFamily& family) {
  const GgufFile& meta_file = meta();
  const int layer = info_.layer;
  const auto key = [&](const char* suffix) { return cat(info_.model, ".", suffix); };
  if (find_tensor(name("ffn_gate_exps.weight")) == nullptr) {
    std::string why;
    if (const auto dense = meta_file.get_int(key("leading_dense_block_count"));
        dense && layer < *dense)
      why =
          cat(" (the first ", *dense, " blocks are dense: ", key("leading_dense_block_count"), ")");
    if (find_tensor(name("ffn_gate.0.weight")) != nullptr)
      why =
          " (it stores one tensor per expert, an old GGUF layout w4a8moe does not read; convert "
          "the model again with a current llama.cpp)";
    if (find_tensor(name("ffn_gate_up_exps.weight")) != nullptr)
      why =
          " (it fuses gate and up in one tensor 'ffn_gate_up_exps', a layout w4a8moe does not "
          "read)";
    fail(cat("layer ", layer, " has no MoE experts: tensor '", name("ffn_gate_exps.weight"),
             "' is missing", why));
  }
  static const char* const kExperts[3] = {"ffn_gate_exps.weight", "ffn_up_exps.weight",
                                          "ffn_down_exps.weight"};
  static const char* const kBiases[3] = {"ffn_gate_exps.bias", "ffn_up_exps.bias",
                                         "ffn_down_exps.bias"};
  for (int i = 0; i < 3; ++i) experts_[i] = &require(kExperts[i]);
  const GgufTensor& gate = *experts_[0];
  if (gate.n_dims != 3)
    fail(cat("tensor '", gate.name, "' must have 3 dimensions [H, I, E], got ", gate.n_dims));
  const int64_t H = gate.ne[0], I = gate.ne[1], E = gate.ne[2];
  check_shape(*experts_[1], {H, I, E});
  check_shape(*experts_[2], {I, H, E});
  router_ = &require("ffn_gate_inp.weight");
  check_shape(*router_, {H, E});
  check_float_type(*router_);
  if (H < 2 || I < 2 || E < 1 || H % 2 != 0 || I % 2 != 0)
    fail(cat("tensor '", gate.name, "' has ne [", H, ", ", I, ", ", E,
             "]: w4a8moe needs even, non-zero H and I and at least one expert"));
  info_.hidden = H;
  info_.inter = I;
  info_.experts = E;

  const auto check_meta = [&](const char* suffix, int64_t want, const char* what) {
    if (const std::optional<int64_t> v = meta_file.get_int(key(suffix)); v && *v != want)
      fail(cat("metadata '", key(suffix), "' says ", *v, " but tensor '", gate.name, "' has ", want,
               " ", what));
  };
  check_meta("expert_count", E, "experts");
  check_meta("embedding_length", H, "columns (the hidden size)");
  check_meta("expert_feed_forward_length", I, "rows (the expert intermediate size)");
  const std::optional<int64_t> used = meta_file.get_int(key("expert_used_count"));
  if (!used) fail(cat("metadata '", key("expert_used_count"), "' (experts per token) is missing"));
  if (*used < 1 || *used > E)
    fail(cat("metadata '", key("expert_used_count"), "' must be 1 to ", E, ", got ", *used));
  info_.top_k = *used;

  // Biases: all three or none.
  int biases = 0;
  for (int i = 0; i < 3; ++i) biases += (bias_[i] = optional(kBiases[i])) != nullptr;
  if (biases != 0 && biases != 3)
    fail(cat("layer ", layer, " has ", biases, " of the 3 expert bias tensors (",
             name("ffn_{gate,up,down}_exps.bias"), "): expected all or none"));
  if (biases == 3) {
    check_shape(*bias_[0], {I, E});
    check_shape(*bias_[1], {I, E});
    check_shape(*bias_[2], {H, E});
    for (const GgufTensor* b : bias_) check_float_type(*b);
    info_.expert_bias = true;
  }
  choose_types();

  // Routing.
  RoutingConfig& r = info_.routing;
  r.experts = E;
  r.top_k = info_.top_k;
  r.gating = default_gating(family.router);
  if (const std::optional<int64_t> f = meta_file.get_int(key("expert_gating_func"))) {
    if (*f == 1) {
      r.gating = Gating::softmax;
    } else if (*f == 2) {
      r.gating = Gating::sigmoid;
    } else if (*f == 3) {
      r.gating = Gating::softmax_topk;
    } else {
      fail(cat("metadata '", key("expert_gating_func"), "' is ", *f,
               ", not a gating function w4a8moe knows (1 softmax, 2 sigmoid, 3 softmax over the "
               "chosen)"));
    }
  }
  r.renormalize = family.gguf_renormalize;
  if (const std::optional<bool> norm = meta_file.get_bool(key("expert_weights_norm")))
    r.renormalize = *norm;
  if (const std::optional<double> scale = meta_file.get_float(key("expert_weights_scale"));
      scale && *scale != 0.0)
    r.scaling = static_cast<float>(*scale);
  const std::optional<int64_t> groups = meta_file.get_int(key("expert_group_count"));
  const std::optional<int64_t> groups_used = meta_file.get_int(key("expert_group_used_count"));
  if (groups && *groups > 1) {
    r.groups = *groups;
    r.groups_used = groups_used.value_or(*groups);
    r.group_score = r.gating == Gating::sigmoid ? GroupScore::top2_sum : GroupScore::max;
  }
  try {
    check_routing_config(r);
  } catch (const Error& e) {
    fail(cat("the routing metadata does not fit: ", e.what()));
  }
  if ((router_bias_ = optional("ffn_gate_inp.bias")) != nullptr) {
    check_shape(*router_bias_, {E});
    check_float_type(*router_bias_);
  }
  if ((selection_bias_ = optional("exp_probs_b.bias")) != nullptr) {
    check_shape(*selection_bias_, {E});
    check_float_type(*selection_bias_);
  }
  info_.params.activation = family.activation;
  apply_router_placement(family, info_);
  for (const char* t : kSharedTensors) info_.has_shared_expert |= optional(t) != nullptr;
}

void GgufLayer::init_shared(const ModelFamily& family) {
  const GgufFile& meta_file = meta();
  const auto key = [&](const char* suffix) { return cat(info_.model, ".", suffix); };
  if (optional(kSharedTensors[0]) == nullptr)
    fail(cat("layer ", info_.layer, " has no shared expert: tensor '", name(kSharedTensors[0]),
             "' is missing"));
  for (int i = 0; i < 3; ++i) experts_[i] = &require(kSharedTensors[i]);
  const GgufTensor& gate = *experts_[0];
  if (gate.n_dims != 2)
    fail(cat("tensor '", gate.name, "' must have 2 dimensions [H, I], got ", gate.n_dims));
  const int64_t H = gate.ne[0], I = gate.ne[1];
  check_shape(*experts_[1], {H, I});
  check_shape(*experts_[2], {I, H});
  if (H < 2 || I < 2 || H % 2 != 0 || I % 2 != 0)
    fail(cat("tensor '", gate.name, "' has ne [", H, ", ", I,
             "]: w4a8moe needs even, non-zero H and I"));
  if (const std::optional<int64_t> v = meta_file.get_int(key("embedding_length")); v && *v != H)
    fail(cat("metadata '", key("embedding_length"), "' says ", *v, " but tensor '", gate.name,
             "' has ", H, " columns (the hidden size)"));
  if (const std::optional<int64_t> v = meta_file.get_int(key("expert_shared_feed_forward_length"));
      v && *v != I)
    fail(cat("metadata '", key("expert_shared_feed_forward_length"), "' says ", *v, " but tensor '",
             gate.name, "' has ", I, " rows"));
  info_.hidden = H;
  info_.inter = I;
  info_.experts = 1;
  info_.top_k = 1;
  choose_types();
  RoutingConfig& r = info_.routing;
  r.experts = 1;
  r.top_k = 1;
  r.gating = Gating::sigmoid;
  if ((router_ = optional("ffn_gate_inp_shexp.weight")) != nullptr) {
    if (router_->n_dims == 2) {
      check_shape(*router_, {H, 1});
    } else {
      check_shape(*router_, {H});
    }
    check_float_type(*router_);
    info_.shared_gate = true;
  }
  info_.params.activation = family.activation;
  info_.params.apply_router_weight_on_input = false;
}

void GgufLayer::choose_types() {
  const int64_t H = info_.hidden, I = info_.inter;
  bool any_exact = false;
  conversions_.resize(3);
  for (int i = 0; i < 3; ++i) {
    const GgufTensor& t = *experts_[i];
    const std::optional<GgmlTypeInfo> type = ggml_type_info(t.type);
    conversions_[static_cast<size_t>(i)].tensor = t.name;
    conversions_[static_cast<size_t>(i)].source = type->name;
    if (t.type == static_cast<uint32_t>(GgmlType::q4_0)) {
      kind_[i] = Kind::exact_q4_0;
      any_exact = true;
      continue;
    }
    // MXFP4 packs exactly (WeightFormat::mxfp4) when gate and up are both MXFP4 (w13 has one
    // format); else it is converted with the others
    const auto mxfp4 = [&](int j) {
      return experts_[j]->type == static_cast<uint32_t>(GgmlType::mxfp4);
    };
    if (mxfp4(i) && (i == 2 || (mxfp4(0) && mxfp4(1)))) {
      kind_[i] = Kind::exact_mxfp4;
      any_exact = true;
      continue;
    }
    if (!type->dequantizable)
      fail(cat("tensor '", t.name, "' has type ", type->name,
               ", which w4a8moe cannot convert to int4 (exact: Q4_0, MXFP4; converted: ",
               ggml_dequantizable_names(), ")"));
    if (options_.require_exact)
      fail(cat("tensor '", t.name, "' has type ", type->name,
               ", which w4a8moe does not take exactly (Q4_0 and MXFP4 it does; MXFP4 only with "
               "gate and up both MXFP4); allow the conversion to requantize it"));
    kind_[i] = Kind::convert;
    conversions_[static_cast<size_t>(i)].exact = false;
  }
  info_.group_size = any_exact ? 32 : options_.group_size;
  if (any_exact && options_.group_size != 32 &&
      !std::all_of(kind_, kind_ + 3, [](Kind k) { return k != Kind::convert; }))
    info_.notes.push_back(cat("group size 32 (the exact tensors' blocks) instead of ",
                              options_.group_size,
                              " for the converted tensors, so w13 and w2 share it"));
  const int g = info_.group_size;
  if (!group_size_fits(g, H) || !group_size_fits(g, I))
    fail(cat("group size ", g, " must be -1 or a multiple of 32 dividing H = ", H, " and I = ", I));
  info_.w13_scale_dtype =
      kind_[0] == Kind::exact_q4_0 && kind_[1] == Kind::exact_q4_0 ? DType::f16 : DType::f32;
  info_.w2_scale_dtype = kind_[2] == Kind::exact_q4_0 ? DType::f16 : DType::f32;
  if (kind_[0] == Kind::exact_mxfp4) {  // the e8m0 exponents as they are
    info_.w13_format = WeightFormat::mxfp4;
    info_.w13_scale_dtype = DType::u8;
  }
  if (kind_[2] == Kind::exact_mxfp4) {
    info_.w2_format = WeightFormat::mxfp4;
    info_.w2_scale_dtype = DType::u8;
  }
}

Router GgufLayer::router() const {
  Router out;
  if (router_ != nullptr) out.weight = read_floats(*router_);
  if (router_bias_ != nullptr) out.bias = read_floats(*router_bias_);
  if (selection_bias_ != nullptr) out.selection_bias = read_floats(*selection_bias_);
  return out;
}

void GgufLayer::load_rows(int which, int64_t e, uint8_t* nibbles, uint8_t* scales,
                          DType scale_dtype, float* bias) const {
  const GgufTensor& t = *experts_[which];
  const int64_t cols = t.ne[0], rows = t.ne[1];
  const int g = info_.group_size;
  const int64_t groups = g == -1 ? 1 : cols / g;
  const uint64_t row_bytes = t.row_bytes();
  const uint8_t* base =
      bytes(t).data() + static_cast<uint64_t>(e) * static_cast<uint64_t>(rows) * row_bytes;
  if (kind_[which] == Kind::exact_mxfp4) {
    // block: u8 e (the e8m0 exponent, the packer's scale byte), then 16 bytes: element j in the
    // low nibble of byte j, element j + 16 in the high nibble, as e2m1 codes; the slot wants
    // element 2m low and 2m + 1 high
    for (int64_t n = 0; n < rows; ++n) {
      const uint8_t* src = base + static_cast<uint64_t>(n) * row_bytes;
      uint8_t* dst = nibbles + n * (cols / 2);
      for (int64_t b = 0; b < cols / 32; ++b) {
        const uint8_t* blk = src + b * 17;
        if (blk[0] == 255)
          fail(cat("tensor '", t.name, "' expert ", e, " row ", n, " block ", b,
                   ": e8m0 scale 255 is NaN (OCP MX), which no weight can be"));
        scales[n * groups + b] = blk[0];
        const uint8_t* qs = blk + 1;
        const auto q = [&](int i) { return i < 16 ? (qs[i] & 0x0f) : (qs[i - 16] >> 4); };
        for (int m = 0; m < 16; ++m)
          dst[b * 16 + m] = static_cast<uint8_t>(q(2 * m) | (q(2 * m + 1) << 4));
      }
    }
  } else if (kind_[which] == Kind::exact_q4_0) {
    // block: f16 d, then 16 bytes: element j in the low nibble of byte j, element j + 16 in the
    // high nibble, each stored as q = value + 8 -- exactly the nibble the packer takes.
    for (int64_t n = 0; n < rows; ++n) {
      const uint8_t* src = base + static_cast<uint64_t>(n) * row_bytes;
      uint8_t* dst = nibbles + n * (cols / 2);
      for (int64_t b = 0; b < cols / 32; ++b) {
        const uint8_t* blk = src + b * 18;
        uint16_t d;
        std::memcpy(&d, blk, 2);
        if (scale_dtype == DType::f16) {
          std::memcpy(scales + (n * groups + b) * 2, &d, 2);
        } else {
          store_scale(scales, scale_dtype, n * groups + b, detail::f16_to_f32(d));
        }
        const uint8_t* qs = blk + 2;
        const auto q = [&](int i) { return i < 16 ? (qs[i] & 0x0f) : (qs[i - 16] >> 4); };
        for (int m = 0; m < 16; ++m)
          dst[b * 16 + m] = static_cast<uint8_t>(q(2 * m) | (q(2 * m + 1) << 4));
      }
    }
  } else {
    Conversion stats;
    std::vector<float> row(static_cast<size_t>(cols));
    std::vector<float> row_scales(static_cast<size_t>(groups));
    for (int64_t n = 0; n < rows; ++n) {
      ggml_dequantize_row(static_cast<GgmlType>(t.type),
                          base + static_cast<uint64_t>(n) * row_bytes, cols, row.data());
      convert_row(
          row.data(), cols, g, options_.rule, nibbles + n * (cols / 2), row_scales.data(), stats,
          cat("GGUF file '", owner(t).path(), "': tensor '", t.name, "' expert ", e, " row ", n));
      for (int64_t b = 0; b < groups; ++b)
        store_scale(scales, scale_dtype, n * groups + b, row_scales[static_cast<size_t>(b)]);
    }
    add_conversion(which, stats);
  }
  if (bias != nullptr) {
    const GgufTensor& bt = *bias_[which];
    const uint64_t bias_row_bytes = bt.row_bytes();
    ggml_dequantize_row(static_cast<GgmlType>(bt.type),
                        bytes(bt).data() + static_cast<uint64_t>(e) * bias_row_bytes, bt.ne[0],
                        bias);
  }
}

void GgufLayer::load_expert(int64_t e, const ExpertSlot& slot) const {
  const int64_t H = info_.hidden, I = info_.inter;
  const int g = info_.group_size;
  const int64_t g13 = g == -1 ? 1 : H / g;
  const size_t s13 = dtype_bytes(info_.w13_scale_dtype);
  load_rows(0, e, slot.w13, slot.w13_scale, info_.w13_scale_dtype, slot.w13_bias);
  load_rows(1, e, slot.w13 + I * (H / 2), slot.w13_scale + static_cast<size_t>(I * g13) * s13,
            info_.w13_scale_dtype, slot.w13_bias != nullptr ? slot.w13_bias + I : nullptr);
  load_rows(2, e, slot.w2, slot.w2_scale, info_.w2_scale_dtype, slot.w2_bias);
}

void GgufLayer::release_expert(int64_t e) const {
  for (const GgufTensor* t : experts_) {
    const uint64_t expert_bytes = t->bytes / static_cast<uint64_t>(t->ne[2]);
    owner(*t).file().release(t->file_offset + static_cast<uint64_t>(e) * expert_bytes,
                             expert_bytes);
  }
}

}  // namespace

std::unique_ptr<LayerSource> open_gguf_layer(const std::string& path, int layer,
                                             const LoadOptions& options) {
  return std::make_unique<GgufLayer>(path, layer, options);
}

}  // namespace w4a8moe::io
