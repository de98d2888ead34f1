// Streamed packing: pack a weight tensor a chunk of experts at a time, so that a loader
// holds the unpacked weights of one chunk only, never the whole layer.
//
//   ExpertPacker packer(WeightRole::w13, E, options);
//   for (each chunk of experts, in order) packer.append(w13_chunk, scale_chunk, bias_chunk);
//   PackedWeights w13 = std::move(packer).finish();
//
// The result is byte for byte what pack_w13 / pack_w2 return for the whole tensor.
#pragma once

#include <cstdint>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe {

class ExpertPacker {
 public:
  // `experts`: the total E; options as for pack_w13 / pack_w2.
  ExpertPacker(WeightRole role, int64_t experts, PackOptions options);

  // The next w.shape[0] experts, in the views pack_w13 / pack_w2 take (E = the chunk's experts).
  // Throws Error when a chunk's dimensions, group size, scale dtype or bias presence differ from
  // the first chunk's, or when the chunks hold more experts than announced.
  void append(const TensorView& w, const TensorView& scale, const TensorView& bias);
  // The same with zero points (PackOptions::weight_format int4_zero_point).
  void append(const TensorView& w, const TensorView& scale, const TensorView& zero_point,
              const TensorView& bias);
  // The same with the chunk's input order (w13 only, PackOptions::input_order's rows of these
  // experts; empty: none): every chunk has one or none does.
  void append(const TensorView& w, const TensorView& scale, const TensorView& zero_point,
              const TensorView& bias, const TensorView& input_order);

  int64_t experts() const noexcept { return experts_; }
  int64_t appended() const noexcept { return appended_; }
  // Bytes of the finished buffer (0 before the first chunk).
  size_t total_bytes() const noexcept { return packed_.size(); }

  // Throws Error unless all `experts` were appended.
  PackedWeights finish() &&;

 private:
  WeightRole role_;
  int64_t experts_;
  PackOptions options_;
  int64_t appended_ = 0;
  PackedWeights packed_;
  // The first chunk's header, in the packed format's own layout (src/pack/packed_format.hpp).
  alignas(8) unsigned char first_header_[128] = {};
};

}  // namespace w4a8moe
