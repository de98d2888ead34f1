// Names and sizes of the public enums, tensor views and the packed-buffer holder.
#include <cstddef>
#include <cstdlib>
#include <iterator>
#include <new>

#include "common/format.hpp"
#include "common/large_alloc.hpp"
#include "pack/packed_format.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe {

namespace {

// names[code] for an enum whose codes run from 0; `unknown` for any other value.
template <class Enum, size_t N>
const char* name_by_code(Enum value, const char* const (&names)[N], const char* unknown) noexcept {
  const auto code = static_cast<size_t>(value);
  return code < N ? names[code] : unknown;
}

}  // namespace

const char* dtype_name(DType dtype) noexcept {
  static constexpr const char* kNames[] = {"f32", "bf16", "f16", "i8", "u8", "i32", "i64"};
  return name_by_code(dtype, kNames, "unknown");
}

size_t dtype_bytes(DType dtype) noexcept {
  static constexpr size_t kBytes[] = {4, 2, 2, 1, 1, 4, 8};  // by DType code, as above
  const auto code = static_cast<size_t>(dtype);
  return code < std::size(kBytes) ? kBytes[code] : 0;
}

const char* activation_name(Activation kind) noexcept {
  static constexpr const char* kNames[] = {"swiglustep", "swigluoai", "silu", "gelu", "gelu_tanh"};
  return name_by_code(kind, kNames, "unknown");
}

Activation parse_activation(std::string_view name) {
  for (int code = 0; code < kActivationCount; ++code)
    if (name == activation_name(static_cast<Activation>(code)))
      return static_cast<Activation>(code);
  throw Error(
      detail::cat("activation: expected one of silu, swigluoai, swiglustep, gelu, "
                  "gelu_tanh, got '",
                  name, "'"));
}

Activation activation_from_code(int64_t code) {
  if (!is_valid_activation_code(code))
    throw Error(
        detail::cat("activation: expected a code in [0, 4] (0 swiglustep, 1 swigluoai, "
                    "2 silu, 3 gelu, 4 gelu_tanh), got ",
                    code));
  return static_cast<Activation>(code);
}

namespace {

// TensorView::of and MutableTensorView::of: `what` names the view in the error.
template <class View, class Data>
View make_view(Data data, DType dtype, std::initializer_list<int64_t> shape, int64_t row_stride,
               const char* what) {
  View v;
  v.data = data;
  v.dtype = dtype;
  if (shape.size() > 3)
    throw Error(detail::cat(what, ": expected rank 1 to 3, got rank ", shape.size()));
  v.rank = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t d : shape) v.shape[static_cast<size_t>(i++)] = d;
  v.row_stride = row_stride;
  return v;
}

}  // namespace

TensorView TensorView::of(const void* data, DType dtype, std::initializer_list<int64_t> shape,
                          int64_t row_stride) {
  return make_view<TensorView>(data, dtype, shape, row_stride, "TensorView");
}

int64_t TensorView::numel() const noexcept {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[static_cast<size_t>(i)];
  return n;
}

MutableTensorView MutableTensorView::of(void* data, DType dtype,
                                        std::initializer_list<int64_t> shape, int64_t row_stride) {
  return make_view<MutableTensorView>(data, dtype, shape, row_stride, "MutableTensorView");
}

void PackedWeights::Free::operator()(uint8_t* p) const noexcept { std::free(p); }

PackedWeights PackedWeights::allocate(size_t bytes) {
  PackedWeights w;
  const size_t rounded = detail::large_alloc_size(bytes, detail::kAlign);
  if (rounded == 0) throw Error("PackedWeights: size overflow");
  auto* p = static_cast<uint8_t*>(detail::large_alloc(bytes, detail::kAlign));
  if (p == nullptr)  // a message naming the need, not std::bad_alloc
    throw Error(detail::cat("PackedWeights: cannot allocate ", rounded, " bytes"));
  std::fill(p, p + rounded, uint8_t{0});
  w.data_.reset(p);
  w.size_ = bytes;
  return w;
}

PackedInfo PackedWeights::info() const { return inspect_packed(bytes()); }

const char* weight_format_name(WeightFormat format) noexcept {
  switch (format) {
    case WeightFormat::int4_symmetric:
      return "int4_symmetric";
    case WeightFormat::int4_zero_point:
      return "int4_zero_point";
    case WeightFormat::mxfp4:
      return "mxfp4";
    case WeightFormat::int8:
      return "int8";
  }
  return "unknown";
}

PackedInfo inspect_packed(std::span<const uint8_t> packed, std::string_view argument) {
  const detail::Geometry g = detail::read_geometry(packed, argument);
  // PackedInfo's fields in order, each the geometry's of the same name (the layer's, for int8).
  return {kPackedFormatVersion,
          detail::layout_name(g.layout),
          g.role,
          g.experts,
          g.rows,
          g.layer_cols(),
          g.layer_group_size(),
          g.layer_format(),
          g.scale_dtype,
          g.has_bias,
          g.expert_bytes,
          g.total_bytes,
          g.has_input_order};
}

}  // namespace w4a8moe
