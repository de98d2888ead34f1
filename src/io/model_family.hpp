// What w4a8moe knows about each family of MoE models, in one table that the GGUF loader
// (gguf_layer.cpp) and the Hugging Face loader (hf_layer.cpp) share: the names a family goes by in
// each format, how its router chooses and weighs experts, its experts' activation, how its
// Hugging Face checkpoints name the expert modules and lay out fused gate/up tensors.
//
// A model whose family is not in the table is refused by the GGUF loader (llama.cpp's defaults
// are per architecture) and read by the Hugging Face loader only when config.json states the
// routing itself (docs/checkpoints.md, the routing table).
#pragma once

#include <array>
#include <span>
#include <string>
#include <string_view>

#include "w4a8moe/routing.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io {

// How a family's router turns the logits into the chosen experts and their weights.
enum class RouterKind {
  scores,          // softmax or sigmoid scores, top-k by score (within groups), weights as the
                   // file says (renormalised, scaled)
  logits_softmax,  // gpt-oss: top-k on the logits (router bias included), softmax over the chosen
  logits_sigmoid,  // Llama-4: top-k on the logits, sigmoid of the chosen, applied on the input
};

// Where a Hugging Face checkpoint's expert modules live: "<layer prefix>N.<block>experts.J.<proj>".
struct HfNaming {
  const char* block;    // after "layers.N."
  const char* proj[3];  // gate, up, down
};

// Gate and up in a Hugging Face fused experts.gate_up_proj [E, H, 2I] (x @ W orientation).
enum class FusedGateUp {
  unknown,      // the family does not fuse them (or w4a8moe does not know how)
  interleaved,  // column 2j gate j, 2j + 1 up j (gpt-oss)
  halves,       // columns [0, I) gate, [I, 2I) up (Llama-4)
};

struct ModelFamily {
  const char* gguf_arch;                // GGUF general.architecture
  std::array<const char*, 3> hf_types;  // config.json model_type values (unused ones nullptr)
  RouterKind router;
  // llama.cpp's default when the GGUF metadata has no expert_weights_norm.
  bool gguf_renormalize;
  // transformers' block renormalises the top-k weights whatever norm_topk_prob says (else
  // norm_topk_prob decides, default false).
  bool hf_renormalize_always;
  // swigluoai: gpt-oss's clamped SwiGLU (its config.json hidden_act does not say it); silu: the
  // GGUF default (a Hugging Face config.json's hidden_act decides).
  Activation activation;
  const HfNaming* naming;  // its Hugging Face expert modules
  FusedGateUp fused;       // its Hugging Face fused gate_up_proj
};

// The table, in the order messages list it.
std::span<const ModelFamily> model_families();
// The family of a GGUF architecture or of a config.json model_type, or nullptr.
const ModelFamily* family_of_gguf_arch(std::string_view arch);
const ModelFamily* family_of_model_type(std::string_view model_type);
// "llama, qwen2moe, ...": the GGUF architectures of the table, for messages.
std::string known_gguf_archs();
// "gpt_oss (interleaved) and llama4 (halves)": the families whose fused gate_up_proj w4a8moe reads.
std::string known_fused_layouts();

// The Hugging Face module namings, in the order the loader tries them after the family's own.
std::span<const HfNaming> hf_namings();
// The shared expert's module in the block: "shared_experts" (DeepSeek), "shared_expert"
// (Qwen2-MoE, Llama-4), tried in this order.
inline constexpr std::array<const char*, 2> kHfSharedModules = {"shared_experts", "shared_expert"};

// The gating a router kind implies when the file does not say.
Gating default_gating(RouterKind kind) noexcept;

// Applies the family's router weight placement to a routed layer: Llama-4's router weight
// multiplies the input (params.apply_router_weight_on_input), noted when top-k is not its 1.
struct LayerInfo;
void apply_router_placement(const ModelFamily& family, LayerInfo& info);

}  // namespace w4a8moe::io
