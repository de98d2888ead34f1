// Streamed packing: each chunk is packed by the ordinary packer straight into its place in the
// buffer of the whole tensor, whose header is the first chunk's with the expert count and size
// of the whole.
#include "w4a8moe/expert_packer.hpp"

#include <cstring>
#include <utility>

#include "common/format.hpp"
#include "pack/pack_into.hpp"
#include "pack/packed_format.hpp"

namespace w4a8moe {

using detail::cat;

namespace {

// A chunk's header in the words of ExpertPacker's errors.
std::string describe(const detail::PackedHeader& h) {
  return cat(h.rows, " x ", h.cols, ", group ", h.group_size, ", scales ",
             dtype_name(static_cast<DType>(h.scale_dtype)),
             (h.flags & detail::kFlagBias) != 0 ? ", bias" : ", no bias",
             (h.flags & detail::kFlagInputOrder) != 0 ? ", input order" : "", ", layout ",
             detail::layout_info(h.layout, "layout").name);
}

}  // namespace

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
  int64_t chunk_experts = 0;
  detail::PackedHeader first;
  static_assert(sizeof first == sizeof first_header_);
  std::memcpy(&first, first_header_, sizeof first);
  // packed straight into the whole buffer, after the experts appended before
  detail::pack_into(
      role_, w, scale, zero_point, bias, options, detail::names_of(role_),
      [&](const detail::PackedHeader& h) -> uint8_t* {
        chunk_experts = h.experts;
        if (appended_ == 0) {
          first = h;
          std::memcpy(first_header_, &h, sizeof h);
          // the whole tensor's geometry (its size, checked for overflow)
          const detail::Geometry g = detail::make_geometry(
              static_cast<detail::LayoutId>(h.layout), role_, experts_, h.rows, h.cols,
              h.group_size, static_cast<DType>(h.scale_dtype), (h.flags & detail::kFlagBias) != 0,
              static_cast<WeightFormat>(h.weight_format), name,
              (h.flags & detail::kFlagInputOrder) != 0);
          if (g.total_bytes > options_.memory_limit)
            throw Error(cat(name, ": the packed buffer needs ", g.total_bytes,
                            " bytes, more than the memory limit of ", options_.memory_limit,
                            " bytes (PackOptions::memory_limit)"));
          packed_ = PackedWeights::allocate(g.total_bytes);
          detail::PackedHeader whole = h;
          whole.experts = static_cast<uint32_t>(experts_);
          whole.total_bytes = g.total_bytes;
          whole.checksum = detail::header_checksum(whole);
          std::memcpy(packed_.data(), &whole, sizeof whole);
        } else if (h.layout != first.layout || h.rows != first.rows || h.cols != first.cols ||
                   h.group_size != first.group_size || h.scale_dtype != first.scale_dtype ||
                   h.flags != first.flags || h.expert_bytes != first.expert_bytes ||
                   h.weight_format != first.weight_format) {
          throw Error(cat(name, ": expected chunks like the first (", describe(first), "), got ",
                          describe(h), " at expert ", appended_));
        }
        return packed_.data() + detail::kHeaderBytes +
               static_cast<size_t>(appended_) * first.expert_bytes;
      });
  appended_ += chunk_experts;
}

PackedWeights ExpertPacker::finish() && {
  if (appended_ != experts_)
    throw Error(cat(role_ == WeightRole::w13 ? "w13" : "w2", ": expected ", experts_,
                    " experts appended before finish(), got ", appended_));
  inspect_packed(packed_.bytes());  // the assembled header checks out
  return std::move(packed_);
}

}  // namespace w4a8moe
