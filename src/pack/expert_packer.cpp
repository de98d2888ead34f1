// Streamed packing: each chunk is packed by the ordinary packer, then its expert blocks
// are copied into the buffer of the whole tensor, whose header is the chunk's with the expert
// count and size of the whole.
#include "w4a8moe/expert_packer.hpp"

#include <cstring>
#include <utility>

#include "common/format.hpp"
#include "pack/packed_format.hpp"

namespace w4a8moe {

using detail::cat;

ExpertPacker::ExpertPacker(WeightRole role, int64_t experts, PackOptions options)
    : role_(role), experts_(experts), options_(std::move(options)) {
  if (role != WeightRole::w13 && role != WeightRole::w2) throw Error("role: expected w13 or w2");
  if (experts < 1) throw Error(cat("experts: expected at least 1, got ", experts));
  // Later chunks must be packed for the layout of the first, even if the ISA cap changes.
  if (options_.kernel_set.empty()) options_.kernel_set = active_kernel_set();
}

void ExpertPacker::append(const TensorView& w, const TensorView& scale, const TensorView& bias) {
  append(w, scale, TensorView{}, bias);
}

void ExpertPacker::append(const TensorView& w, const TensorView& scale,
                          const TensorView& zero_point, const TensorView& bias) {
  append(w, scale, zero_point, bias, options_.input_order);
}

void ExpertPacker::append(const TensorView& w, const TensorView& scale,
                          const TensorView& zero_point, const TensorView& bias,
                          const TensorView& input_order) {
  const char* name = role_ == WeightRole::w13 ? "w13" : "w2";
  if (w.rank >= 1 && w.shape[0] > experts_ - appended_)
    throw Error(cat(name, ": expected at most ", experts_ - appended_, " more experts (of ",
                    experts_, "), got a chunk of ", w.shape[0]));
  PackOptions options = options_;
  options.input_order = input_order;
  const PackedWeights chunk = role_ == WeightRole::w13
                                  ? pack_w13(w, scale, zero_point, bias, options)
                                  : pack_w2(w, scale, zero_point, bias, options);
  const PackedInfo info = chunk.info();
  if (appended_ == 0) {
    first_ = info;
    // the whole tensor's geometry (its size, checked for overflow)
    const detail::Geometry g =
        detail::make_geometry(detail::read_geometry(chunk.bytes(), name).layout, role_, experts_,
                              info.rows, info.cols, info.group_size, info.scale_dtype,
                              info.has_bias, info.weight_format, name, info.has_input_order);
    packed_ = PackedWeights::allocate(g.total_bytes);
    detail::PackedHeader h;
    std::memcpy(&h, chunk.bytes().data(), sizeof h);
    h.experts = static_cast<uint32_t>(experts_);
    h.total_bytes = g.total_bytes;
    h.checksum = detail::header_checksum(h);
    std::memcpy(packed_.data(), &h, sizeof h);
  } else if (info.layout != first_.layout || info.rows != first_.rows || info.cols != first_.cols ||
             info.group_size != first_.group_size || info.scale_dtype != first_.scale_dtype ||
             info.has_bias != first_.has_bias || info.expert_bytes != first_.expert_bytes ||
             info.has_input_order != first_.has_input_order) {
    throw Error(
        cat(name, ": expected chunks like the first (", first_.rows, " x ", first_.cols, ", group ",
            first_.group_size, ", scales ", dtype_name(first_.scale_dtype),
            first_.has_bias ? ", bias" : ", no bias", first_.has_input_order ? ", input order" : "",
            ", layout ", first_.layout, "), got ", info.rows, " x ", info.cols, ", group ",
            info.group_size, ", scales ", dtype_name(info.scale_dtype),
            info.has_bias ? ", bias" : ", no bias", info.has_input_order ? ", input order" : "",
            ", layout ", info.layout, " at expert ", appended_));
  }
  const size_t block_bytes = static_cast<size_t>(info.experts) * info.expert_bytes;
  std::memcpy(
      packed_.data() + detail::kHeaderBytes + static_cast<size_t>(appended_) * info.expert_bytes,
      chunk.bytes().data() + detail::kHeaderBytes, block_bytes);
  appended_ += info.experts;
}

PackedWeights ExpertPacker::finish() && {
  if (appended_ != experts_)
    throw Error(cat(role_ == WeightRole::w13 ? "w13" : "w2", ": expected ", experts_,
                    " experts appended before finish(), got ", appended_));
  inspect_packed(packed_.bytes());  // the assembled header checks out
  return std::move(packed_);
}

}  // namespace w4a8moe
