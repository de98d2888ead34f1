// Argument checks shared by the public entry points: one place rejects bad input, with a
// sentence that names the argument, what was expected and what came.
#pragma once

#include <string>
#include <string_view>

#include "pack/packed_format.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

std::string shape_string(int rank, const std::array<int64_t, 3>& shape);

// Logical shape of one weight tensor as given to the packer or the reference.
struct WeightInput {
  int64_t experts = 0, rows = 0, cols = 0;
  bool nibbles = false;  // uint8 [E, N, K/2]
  int64_t groups = 0;    // scale columns (1 when channelwise)
};

// w [E, N, K] i8 or [E, N, K/2] u8, scale [E, N, K/g] or [E, N], bias empty or [E, N].
WeightInput check_weight_input(const TensorView& w, const TensorView& scale, const TensorView& bias,
                               int group_size, std::string_view w_name, std::string_view scale_name,
                               std::string_view bias_name);

void check_params(const MoeParams& params);

// Throws Error naming `name` unless the bytes the tensor spans ((rows - 1) * stride +
// last dimension, times the element size) can be counted without overflow and fit in the address
// space from its data pointer. Negative dimensions pass here (other checks name them).
void require_addressable(const void* data, DType dtype, int rank,
                         const std::array<int64_t, 3>& shape, int64_t stride,
                         std::string_view name);
void require_addressable(const TensorView& t, std::string_view name);

struct ForwardShape {
  int64_t tokens = 0, hidden = 0, inter = 0, experts = 0, top_k = 0;
};

// The two packed buffers of a layer belong together: roles, shapes, group size, layout. Returns
// experts, hidden and inter.
ForwardShape check_packed_pair(const Geometry& w13, const Geometry& w2, std::string_view w13_name,
                               std::string_view w2_name);

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
