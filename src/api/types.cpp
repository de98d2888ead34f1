// Names and sizes of the public enums, tensor views and the packed-buffer holder.
#include <cstdlib>
#include <new>

#include "common/format.hpp"
#include "common/large_alloc.hpp"
#include "pack/packed_format.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe {

const char* dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::i8:
      return "i8";
    case DType::u8:
      return "u8";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
  }
  return "unknown";
}

size_t dtype_bytes(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::i8:
    case DType::u8:
      return 1;
    case DType::i64:
      return 8;
  }
  return 0;
}

const char* activation_name(Activation kind) noexcept {
  switch (kind) {
    case Activation::swiglustep:
      return "swiglustep";
    case Activation::swigluoai:
      return "swigluoai";
    case Activation::silu:
      return "silu";
    case Activation::gelu:
      return "gelu";
    case Activation::gelu_tanh:
      return "gelu_tanh";
  }
  return "unknown";
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

TensorView TensorView::of(const void* data, DType dtype, std::initializer_list<int64_t> shape,
                          int64_t row_stride) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  if (shape.size() > 3)
    throw Error(detail::cat("TensorView: expected rank 1 to 3, got rank ", shape.size()));
  v.rank = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t d : shape) v.shape[static_cast<size_t>(i++)] = d;
  v.row_stride = row_stride;
  return v;
}

int64_t TensorView::numel() const noexcept {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[static_cast<size_t>(i)];
  return n;
}

MutableTensorView MutableTensorView::of(void* data, DType dtype,
                                        std::initializer_list<int64_t> shape, int64_t row_stride) {
  MutableTensorView v;
  v.data = data;
  v.dtype = dtype;
  if (shape.size() > 3)
    throw Error(detail::cat("MutableTensorView: expected rank 1 to 3, got rank ", shape.size()));
  v.rank = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t d : shape) v.shape[static_cast<size_t>(i++)] = d;
  v.row_stride = row_stride;
  return v;
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

PackedInfo inspect_packed(std::span<const uint8_t> packed, std::string_view argument) {
  const detail::Geometry g = detail::read_geometry(packed, argument);
  PackedInfo info;
  info.version = kPackedFormatVersion;
  info.layout = detail::layout_name(g.layout);
  info.role = g.role;
  info.experts = g.experts;
  info.rows = g.rows;
  info.cols = g.cols;
  info.group_size = g.group_size;
  info.scale_dtype = g.scale_dtype;
  info.has_bias = g.has_bias;
  info.expert_bytes = g.expert_bytes;
  info.total_bytes = g.total_bytes;
  return info;
}

}  // namespace w4a8moe
