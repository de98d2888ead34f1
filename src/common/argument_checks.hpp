// Argument checks shared by every component that takes tensors from a caller: the packer, the
// packed-file loader and the API entry points. Each names the argument, what was expected and
// what came, in one sentence (Error). Below api/ and pack/, so that neither includes the other.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

std::string shape_string(int rank, const std::array<int64_t, 3>& shape);
std::string shape_of(const TensorView& t);

void require_data(const void* data, std::string_view name);
void require_float(DType d, std::string_view name);
void require_shape(const TensorView& t, std::initializer_list<int64_t> want, std::string_view name);
void require_contiguous(const TensorView& t, std::string_view name);
void require_positive_dims(const TensorView& t, std::string_view name);

// Throws Error naming `name` unless the bytes the tensor spans ((rows - 1) * stride +
// last dimension, times the element size) can be counted without overflow and fit in the address
// space from its data pointer. Negative dimensions pass here (other checks name them).
void require_addressable(const void* data, DType dtype, int rank,
                         const std::array<int64_t, 3>& shape, int64_t stride,
                         std::string_view name);
void require_addressable(const TensorView& t, std::string_view name);

// Logical shape of one weight tensor as given to the packer or the reference.
struct WeightInput {
  int64_t experts = 0, rows = 0, cols = 0;
  bool nibbles = false;  // uint8 [E, N, K/2]
  int64_t groups = 0;    // scale columns (1 when channelwise)
};

// 0 int4_symmetric, 1 int4_zero_point, 2 mxfp4 or 3 int8 (dense linear layers only).
constexpr bool is_known_weight_format(uint32_t code) noexcept { return code <= 3; }
// The experts' formats: int8 is a dense linear layer's (pack_linear, linear()) only. Throws
// Error naming `name` for int8.
void require_expert_format(WeightFormat format, std::string_view name);

// int4_symmetric and int4_zero_point: w [E, N, K] i8 or [E, N, K/2] u8, scale [E, N, K/g] or [E, N]
// in a float dtype. mxfp4: w [E, N, K/2] u8 codes, scale [E, N, K/32] u8 exponents, group_size 32
// (the exponents' values are checked by the packer). bias empty or [E, N]. int4_zero_point:
// zero_point i8 shaped like the scale (its values are checked by the packer); for the other formats
// zero_point must be empty. int8: w [E, N, K] i8 with K a multiple of 32, scale as channelwise
// int4's, group_size -1 or K, no zero points.
// An input order (PackOptions::input_order, LogicalWeights::w13_input_order): empty, or w13's
// contiguous int32 [experts, cols] with each row a permutation of [0, cols); Error naming `name`.
void check_input_order(const TensorView& order, WeightRole role, int64_t experts, int64_t cols,
                       std::string_view name);

WeightInput check_weight_input(const TensorView& w, const TensorView& scale,
                               const TensorView& zero_point, const TensorView& bias, int group_size,
                               std::string_view w_name, std::string_view scale_name,
                               std::string_view zero_point_name, std::string_view bias_name,
                               WeightFormat format);

// The activation and its parameters (also recorded in packed weight files).
void check_params(const MoeParams& params);

// The sizes of one forward call.
struct ForwardShape {
  int64_t tokens = 0, hidden = 0, inter = 0, experts = 0, top_k = 0;
};

}  // namespace w4a8moe::detail
