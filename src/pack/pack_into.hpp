// The packer's entry below the public pack_w13 / pack_w2 / pack_linear: packing into blocks the
// caller places, so that a buffer assembled from chunks of experts (ExpertPacker) is written
// once, with no chunk buffer copied into it.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>

#include "pack/packed_format.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

// The names errors give the tensors: the role's, or a linear layer's ("w", "w_scale", ...).
struct TensorNames {
  std::string_view w, scale, zero_point, bias;
};
TensorNames names_of(WeightRole role);

// Given the header of the buffer these views pack into (its experts the views' selected
// experts), returns where their expert blocks go (zero-filled, room for header.experts blocks of
// header.expert_bytes); may throw to refuse.
using BlockDestination = std::function<uint8_t*(const PackedHeader& header)>;

// Checks the views and options as pack_w13 / pack_w2 do, then packs the experts' blocks where
// `destination` says.
void pack_into(WeightRole role, const TensorView& w, const TensorView& scale,
               const TensorView& zero_point, const TensorView& bias, const PackOptions& options,
               const TensorNames& names, const BlockDestination& destination);

// The same into a buffer of its own (header and blocks), refused beyond options.memory_limit.
PackedWeights pack(WeightRole role, const TensorView& w, const TensorView& scale,
                   const TensorView& zero_point, const TensorView& bias, const PackOptions& options,
                   const TensorNames& names);

}  // namespace w4a8moe::detail
