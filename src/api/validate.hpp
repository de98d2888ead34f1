// The checks of forward() and reference_forward(), over the shared argument checks: one place
// rejects bad input, with a sentence that names the argument, what was expected and what came.
#pragma once

#include <string_view>

#include "common/argument_checks.hpp"
#include "pack/packed_format.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

// Checks x, ids, weights and out against each other and the packed geometries, every id in
// range, the params. Throws Error on the first problem.
ForwardShape check_forward(const TensorView& x, const TensorView& topk_ids,
                           const TensorView& topk_weights, const Geometry& w13, const Geometry& w2,
                           const MoeParams& params, const MutableTensorView& out);

// The same checks against logical weights (reference_forward).
ForwardShape check_forward_logical(const TensorView& x, const TensorView& topk_ids,
                                   const TensorView& topk_weights, int64_t experts, int64_t hidden,
                                   int64_t inter, const MoeParams& params,
                                   const MutableTensorView& out);

}  // namespace w4a8moe::detail
