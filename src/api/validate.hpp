// The checks of forward() and reference_forward(), over the shared argument checks: one place
// rejects bad input, with a sentence that names the argument, what was expected and what came.
#pragma once

#include <string_view>

#include "common/argument_checks.hpp"
#include "pack/packed_format.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

// What forward_local() relaxes: ids name id_experts experts (-1: the packed experts), and out
// may be f32 whatever x's dtype.
struct ForwardRules {
  int64_t id_experts = -1;
  bool f32_out = false;
};

// Checks x, ids, weights and out against each other and the packed geometries, every id in
// range, the params. Throws Error on the first problem.
ForwardShape check_forward(const TensorView& x, const TensorView& topk_ids,
                           const TensorView& topk_weights, const Geometry& w13, const Geometry& w2,
                           const MoeParams& params, const MutableTensorView& out,
                           const ForwardRules& rules = {});

// x, ids and weights alone (no weights, no output): the tokens a process dispatches.
ForwardShape check_tokens(const TensorView& x, const TensorView& topk_ids,
                          const TensorView& topk_weights, int64_t hidden, int64_t experts);

// The same checks against logical weights (reference_forward).
ForwardShape check_forward_logical(const TensorView& x, const TensorView& topk_ids,
                                   const TensorView& topk_weights, int64_t experts, int64_t hidden,
                                   int64_t inter, const MoeParams& params,
                                   const MutableTensorView& out);

}  // namespace w4a8moe::detail
