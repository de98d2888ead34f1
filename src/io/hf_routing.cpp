// The routing of a Hugging Face layer (hf_layer.hpp): the experts' activation and the router's
// gating from config.json and the model family, and the router tensors.
#include "common/format.hpp"
#include "common/numeric.hpp"
#include "io/hf_layer.hpp"

namespace w4a8moe::io {

using detail::cat;
using nlohmann::json;

void HfLayer::read_activation() {
  if (family_ != nullptr && family_->activation == Activation::swigluoai) {
    // GptOssExperts: clamped SwiGLU, swigluoai of docs/operator.md (config.json's hidden_act
    // does not say it)
    info_.params.activation = Activation::swigluoai;
    info_.params.alpha = static_cast<float>(config_.number("swiglu_alpha", 1.702));
    info_.params.limit = static_cast<float>(config_.number("swiglu_limit", 7.0));
  } else {
    std::string act = "silu";
    if (const json* a = config_.value("hidden_act"); a != nullptr && a->is_string())
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
}

void HfLayer::read_routing() {
  const int64_t H = info_.hidden, E = info_.experts;
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

  if (family_ != nullptr && family_->router != RouterKind::scores) {
    // top-k on the logits: gpt-oss's softmax over the chosen, Llama-4's sigmoid on the input
    r.gating = default_gating(family_->router);
    apply_router_placement(*family_, info_);
  } else {
    std::string scoring = "softmax";
    if (const json* s = config_.value("scoring_func"); s != nullptr && s->is_string())
      scoring = s->get<std::string>();
    if (scoring == "softmax") {
      r.gating = Gating::softmax;
    } else if (scoring == "sigmoid") {
      r.gating = Gating::sigmoid;
    } else {
      fail(cat("config.json scoring_func \"", scoring, "\" is not softmax or sigmoid"));
    }
    if (family_ != nullptr && family_->hf_renormalize_always) {
      r.renormalize = true;
    } else if (family_ != nullptr) {
      r.renormalize = config_.flag("norm_topk_prob", false);
    } else {
      if (config_.value("norm_topk_prob") == nullptr)
        fail(cat("model_type '", config_.model_type(),
                 "' is not one whose routing w4a8moe knows, and config.json has "
                 "no 'norm_topk_prob' to say whether the top-k weights are renormalised"));
      r.renormalize = config_.flag("norm_topk_prob", false);
    }
    r.scaling = static_cast<float>(config_.number("routed_scaling_factor", 1.0));
    if (const json* m = config_.value("topk_method"); m != nullptr && m->is_string())
      topk_method_ = m->get<std::string>();
    if (topk_method_ == "group_limited_greedy" || topk_method_ == "noaux_tc") {
      r.groups = config_.integer("n_group", true);
      r.groups_used = config_.integer("topk_group", true);
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

Router HfLayer::router() const {
  Router out;
  if (!router_name_.empty()) out.weight = tensors_.read_floats(router_name_);
  if (!router_bias_name_.empty()) out.bias = tensors_.read_floats(router_bias_name_);
  if (!selection_bias_name_.empty())
    out.selection_bias = tensors_.read_floats(selection_bias_name_);
  return out;
}

}  // namespace w4a8moe::io
