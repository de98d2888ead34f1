// The MoE layer in one op call, router logits in: `moe_routed` chooses each token's experts with
// the library's routing (w4a8moe/routing.hpp: softmax or sigmoid scores, a correction bias that
// steers the choice only, grouped top-k, renormalisation, a scaling factor), the way vLLM's
// routers compute them, into small buffers (ids int32 [T, K], weights f32 [T, K]), then runs
// forward() on them as dynamic_4bit_int_moe_ex does (docs/pytorch.md, "Routing inside the op").
// A fragment of torch_ops.cpp's library `w4a8moe`; library errors become torch errors with the
// library's sentence, and the routing arguments are checked here under the op's own names.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>
#include <torch/version.h>

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "torch_packed_headers.hpp"
#include "torch_threads.hpp"
#include "torch_util.hpp"
#include "w4a8moe/routing.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe_torch {
namespace {

using at::Tensor;
using util::moe_params;
using util::translate_errors;
using util::view_of;

bool is_float(const Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
         t.scalar_type() == at::kHalf;
}

bool has_tensor(const c10::optional<Tensor>& t) { return t.has_value() && t->defined(); }

// The routing arguments, checked under the op's names, as the library's RoutingConfig. `experts`
// is E, from w13_packed's header (CPU) or router_logits' columns (meta), as `experts_from` says.
//
// Softmax with renormalisation and no correction bias takes the weights as the softmax over the
// K chosen logits (Gating::softmax_topk): the same numbers as the softmax over all E renormalised
// over the K (the same experts: the softmax keeps the logits' order, within groups too), computed
// as vLLM's CPU router computes its ungrouped case. A correction bias scores a group by the sum
// of its two best values (DeepSeek-V3's noaux_tc), without one by its best (DeepSeek-V2), as
// vLLM's grouped top-k does.
w4a8moe::RoutingConfig routing_config(int64_t experts, const char* experts_from, int64_t top_k,
                                      const std::string& scoring_func, bool renormalize,
                                      double routed_scaling_factor, int64_t num_expert_group,
                                      int64_t topk_group, bool has_bias) {
  TORCH_CHECK(scoring_func == "softmax" || scoring_func == "sigmoid",
              "scoring_func: expected 'softmax' or 'sigmoid', got '", scoring_func, "'");
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "top_k: expected 1 to ", experts, " (", experts_from,
              "), got ", top_k);
  const auto scaling = static_cast<float>(routed_scaling_factor);
  TORCH_CHECK(std::isfinite(scaling), "routed_scaling_factor: expected a finite float32, got ",
              routed_scaling_factor);
  TORCH_CHECK(num_expert_group >= 1 && experts % num_expert_group == 0,
              "num_expert_group: expected a divisor of ", experts, " (", experts_from, "), got ",
              num_expert_group);
  TORCH_CHECK(topk_group >= 1 && topk_group <= num_expert_group, "topk_group: expected 1 to ",
              num_expert_group, " (num_expert_group), got ", topk_group);
  const int64_t per_group = experts / num_expert_group;
  TORCH_CHECK(topk_group * per_group >= top_k, "topk_group: expected at least ",
              (top_k + per_group - 1) / per_group, " groups of ", per_group,
              " experts, to hold top_k = ", top_k, " experts, got ", topk_group);
  TORCH_CHECK(!has_bias || num_expert_group == 1 || per_group >= 2,
              "num_expert_group: expected groups of 2 experts or more (with "
              "e_score_correction_bias a group scores the sum of its two best), got ",
              num_expert_group, " groups of ", per_group);

  w4a8moe::RoutingConfig c;
  c.experts = experts;
  c.top_k = top_k;
  c.renormalize = renormalize;
  if (scoring_func == "sigmoid") {
    c.gating = w4a8moe::Gating::sigmoid;
  } else if (renormalize && !has_bias) {
    c.gating = w4a8moe::Gating::softmax_topk;  // already sums to 1
    c.renormalize = false;
  } else {
    c.gating = w4a8moe::Gating::softmax;
  }
  c.scaling = scaling;
  c.groups = num_expert_group;
  c.groups_used = topk_group;
  c.group_score = has_bias ? w4a8moe::GroupScore::top2_sum : w4a8moe::GroupScore::max;
  translate_errors([&] { w4a8moe::check_routing_config(c); });
  return c;
}

// Tokens per routing task: route() takes 1-2 us per token at E = 128, so that a task's start
// costs little next to its work.
constexpr int64_t kRouteGrain = 64;

// route() over the tokens, into ids and weights [T, K]. On PyTorch's intra-op threads in chunks
// of rows when the forward runs on them (the default; route() is independent per token, so the
// bits do not depend on the split), else on the calling thread (the library's own threads run
// forward() only, and in a forked child OpenMP's team is not usable: torch_threads.hpp).
void route_tokens(const w4a8moe::TensorView& logits, size_t logit_bytes,
                  const w4a8moe::TensorView& bias, const w4a8moe::RoutingConfig& config,
                  int32_t* ids, float* weights) {
  const int64_t tokens = logits.shape[0], k = config.top_k;
  const auto rows = [&](int64_t begin, int64_t end) {
    w4a8moe::TensorView part = logits;
    part.data = static_cast<const char*>(logits.data) +
                static_cast<size_t>(begin * logits.stride()) * logit_bytes;
    part.shape[0] = end - begin;
    w4a8moe::route(
        part, bias, config,
        w4a8moe::MutableTensorView::of(ids + begin * k, w4a8moe::DType::i32, {end - begin, k}),
        w4a8moe::MutableTensorView::of(weights + begin * k, w4a8moe::DType::f32, {end - begin, k}));
  };
  const bool torch_threads = threads::g_own_threads.load(std::memory_order_relaxed) == 0 &&
                             !threads::g_forked_child.load(std::memory_order_relaxed);
  if (!torch_threads || tokens <= kRouteGrain) return rows(0, tokens);
  rows(0, 0);  // the checks, once, on this thread
  at::parallel_for(0, tokens, kRouteGrain, [&](int64_t begin, int64_t end) { rows(begin, end); });
}

// x [T, H] and router_logits [T, E] of float dtypes, the bias [E]; returns T.
int64_t check_inputs(const Tensor& x, const Tensor& logits, const c10::optional<Tensor>& bias,
                     int64_t hidden, int64_t experts, const char* experts_from) {
  TORCH_CHECK(x.dim() == 2, "x: expected rank 2 [T, H], got shape ", x.sizes());
  TORCH_CHECK(x.size(1) == hidden, "x: expected ", hidden, " columns (hidden_size), got shape ",
              x.sizes());
  TORCH_CHECK(is_float(x), "x: expected dtype float32, bfloat16 or float16, got ", x.scalar_type());
  const int64_t tokens = x.size(0);
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == tokens && logits.size(1) == experts,
              "router_logits: expected shape [", tokens, ", ", experts, "] (T from x, E ",
              experts_from, "), got ", logits.sizes());
  TORCH_CHECK(is_float(logits), "router_logits: expected dtype float32, bfloat16 or float16, got ",
              logits.scalar_type());
  if (has_tensor(bias)) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == experts,
                "e_score_correction_bias: expected shape [", experts, "] (", experts_from,
                "), got ", bias->sizes());
    TORCH_CHECK(is_float(*bias),
                "e_score_correction_bias: expected dtype float32, bfloat16 or float16, got ",
                bias->scalar_type());
  }
  return tokens;
}

// Routes the tokens and runs forward() into out [T, H] (T > 0), the arguments checked.
void route_and_forward(const Tensor& x_in, const Tensor& router_logits,
                       const c10::optional<Tensor>& e_score_correction_bias,
                       const headers::Packed& packed, const w4a8moe::RoutingConfig& config,
                       const w4a8moe::MoeParams& params, Tensor& out) {
  const int64_t tokens = out.size(0), hidden = out.size(1), k = config.top_k;
  Tensor x = x_in, logits = router_logits, bias;
  const w4a8moe::TensorView xv = view_of(x, "x", /*rows_strided=*/true);
  const w4a8moe::TensorView lv = view_of(logits, "router_logits", /*rows_strided=*/true);
  w4a8moe::TensorView bv;
  if (has_tensor(e_score_correction_bias)) {
    bias = *e_score_correction_bias;
    bv = view_of(bias, "e_score_correction_bias");
  }
  const size_t slots = static_cast<size_t>(tokens * k);
  std::vector<int32_t> ids(slots);
  std::vector<float> weights(slots);
  route_tokens(lv, logits.element_size(), bv, config, ids.data(), weights.data());
  const auto ov = w4a8moe::MutableTensorView::of(out.data_ptr(), xv.dtype, {tokens, hidden});
  threads::with_context([&](w4a8moe::Context& context) {
    w4a8moe::forward(context, xv,
                     w4a8moe::TensorView::of(ids.data(), w4a8moe::DType::i32, {tokens, k}),
                     w4a8moe::TensorView::of(weights.data(), w4a8moe::DType::f32, {tokens, k}),
                     packed.w13, packed.w2, params, ov);
  });
}

// The op's kernel for CPU (kMeta false) and Meta: the same checks, in the same order, then on CPU
// the routing and forward(). E is the experts in w13_packed's header on CPU; a meta tensor holds
// no header, so the Meta kernel takes router_logits' columns.
template <bool kMeta>
Tensor moe_routed(const Tensor& x, const Tensor& router_logits, const Tensor& w13_packed,
                  const Tensor& w2_packed, int64_t hidden_size, int64_t intermediate_size,
                  int64_t group_size, bool apply_router_weight_on_input, int64_t activation_kind,
                  double alpha, double limit, int64_t top_k, std::string scoring_func,
                  bool renormalize, double routed_scaling_factor, int64_t num_expert_group,
                  int64_t topk_group, const c10::optional<Tensor>& e_score_correction_bias) {
  return translate_errors([&] {
    const headers::Sizes sizes{hidden_size, intermediate_size, group_size};
    headers::Packed packed{};
    int64_t experts = 0;
    const char* experts_from = nullptr;
    if constexpr (kMeta) {
      headers::check_meta_packed(w13_packed, w2_packed, sizes);
      TORCH_CHECK(router_logits.dim() == 2, "router_logits: expected rank 2 [T, E], got shape ",
                  router_logits.sizes());
      experts = router_logits.size(1);
      experts_from = "the columns of router_logits";
    } else {
      packed = headers::checked_packed(w13_packed, w2_packed, sizes);
      experts = packed.w13_facts.experts;
      experts_from = "the experts in w13_packed";
    }
    const w4a8moe::RoutingConfig config = routing_config(
        experts, experts_from, top_k, scoring_func, renormalize, routed_scaling_factor,
        num_expert_group, topk_group, has_tensor(e_score_correction_bias));
    const int64_t tokens =
        check_inputs(x, router_logits, e_score_correction_bias, hidden_size, experts, experts_from);
    const w4a8moe::MoeParams params =
        moe_params(apply_router_weight_on_input, activation_kind, alpha, limit);
    w4a8moe::check_moe_params(params);
    Tensor out = at::empty({tokens, hidden_size}, x.options());
    if constexpr (!kMeta) {
      if (tokens > 0)
        route_and_forward(x, router_logits, e_score_correction_bias, packed, config, params, out);
    }
    return out;
  });
}

}  // namespace
}  // namespace w4a8moe_torch

// ---------------------------------------------------------------------------------------------
// Registration: a fragment of torch_ops.cpp's library `w4a8moe`

TORCH_LIBRARY_FRAGMENT(w4a8moe, m) {
  m.def(
      "moe_routed(Tensor x, Tensor router_logits, Tensor w13_packed, Tensor w2_packed, "
      "int hidden_size, int intermediate_size, int group_size, "
      "bool apply_router_weight_on_input, int activation_kind, float alpha, float limit, "
      "int top_k, str scoring_func, bool renormalize, float routed_scaling_factor=1.0, "
      "int num_expert_group=1, int topk_group=1, Tensor? e_score_correction_bias=None) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(w4a8moe, CPU, m) { m.impl("moe_routed", &w4a8moe_torch::moe_routed<false>); }

// The shape function: here for torch 1.x; torch 2 takes it from w4a8moe/_fake.py, where the token
// count stays symbolic under torch.compile (as for torch_ops.cpp's forward ops).
#if TORCH_VERSION_MAJOR < 2
TORCH_LIBRARY_IMPL(w4a8moe, Meta, m) { m.impl("moe_routed", &w4a8moe_torch::moe_routed<true>); }
#endif

// Not differentiable: the Autograd fallthrough of every op (torch_util.hpp).
TORCH_LIBRARY_IMPL(w4a8moe, W4A8MOE_TORCH_AUTOGRAD_KEY, m) {
  w4a8moe_torch::util::not_differentiable(m, {"moe_routed"});
}
