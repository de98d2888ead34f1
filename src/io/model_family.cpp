// The table of model families (model_family.hpp).
#include "io/model_family.hpp"

#include "common/format.hpp"
#include "io/checkpoint.hpp"

namespace w4a8moe::io {

namespace {

using detail::cat;

constexpr HfNaming kNamings[] = {
    {"mlp.", {"gate_proj", "up_proj", "down_proj"}},
    {"block_sparse_moe.", {"w1", "w3", "w2"}},                 // Mixtral
    {"feed_forward.", {"gate_proj", "up_proj", "down_proj"}},  // Llama-4
};
constexpr const HfNaming* kMlp = &kNamings[0];
constexpr const HfNaming* kSparseMoe = &kNamings[1];
constexpr const HfNaming* kFeedForward = &kNamings[2];

constexpr RouterKind kScores = RouterKind::scores;
constexpr Activation kSilu = Activation::silu;
constexpr FusedGateUp kUnfused = FusedGateUp::unknown;

// gguf_arch, hf_types, router, gguf_renormalize, hf_renormalize_always, activation, naming, fused
constexpr ModelFamily kFamilies[] = {
    {"llama", {"mixtral"}, kScores, true, true, kSilu, kSparseMoe, kUnfused},  // Mixtral
    {"qwen2moe", {"qwen2_moe"}, kScores, false, false, kSilu, kMlp, kUnfused},
    {"qwen3moe", {"qwen3_moe"}, kScores, true, false, kSilu, kMlp, kUnfused},
    {"qwen3vlmoe", {"qwen3_vl_moe"}, kScores, true, false, kSilu, kMlp, kUnfused},
    {"olmoe", {"olmoe"}, kScores, false, false, kSilu, kMlp, kUnfused},
    // DeepSeek-V2, -V3 and Kimi-K2 (DeepSeek-V3's architecture)
    {"deepseek2",
     {"deepseek_v2", "deepseek_v3", "kimi_k2"},
     kScores,
     false,
     false,
     kSilu,
     kMlp,
     kUnfused},
    {"gpt-oss",
     {"gpt_oss"},
     RouterKind::logits_softmax,
     false,
     false,
     Activation::swigluoai,
     kMlp,
     FusedGateUp::interleaved},
    {"llama4",
     {"llama4", "llama4_text"},
     RouterKind::logits_sigmoid,
     false,
     false,
     kSilu,
     kFeedForward,
     FusedGateUp::halves},
};

}  // namespace

std::span<const ModelFamily> model_families() { return kFamilies; }

const ModelFamily* family_of_gguf_arch(std::string_view arch) {
  for (const ModelFamily& f : kFamilies)
    if (arch == f.gguf_arch) return &f;
  return nullptr;
}

const ModelFamily* family_of_model_type(std::string_view model_type) {
  for (const ModelFamily& f : kFamilies)
    for (const char* t : f.hf_types)
      if (t != nullptr && model_type == t) return &f;
  return nullptr;
}

std::string known_gguf_archs() {
  std::string s;
  for (const ModelFamily& f : kFamilies) s += cat(s.empty() ? "" : ", ", f.gguf_arch);
  return s;
}

std::string known_fused_layouts() {
  std::string s;
  for (const ModelFamily& f : kFamilies)
    if (f.fused != FusedGateUp::unknown)
      s += cat(s.empty() ? "" : " and ", f.hf_types[0], " (",
               f.fused == FusedGateUp::interleaved ? "interleaved" : "halves", ")");
  return s;
}

std::span<const HfNaming> hf_namings() { return kNamings; }

Gating default_gating(RouterKind kind) noexcept {
  switch (kind) {
    case RouterKind::scores:
      return Gating::softmax;
    case RouterKind::logits_softmax:
      return Gating::softmax_topk;
    case RouterKind::logits_sigmoid:
      return Gating::sigmoid;
  }
  return Gating::softmax;
}

void apply_router_placement(const ModelFamily& family, LayerInfo& info) {
  const bool on_input = family.router == RouterKind::logits_sigmoid;
  info.params.apply_router_weight_on_input = on_input;
  if (on_input && info.top_k != 1)
    info.notes.push_back(cat("the router weight is applied on the input with top-k ", info.top_k,
                             " (Llama-4 uses 1)"));
}

}  // namespace w4a8moe::io
