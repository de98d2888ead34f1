// Argument checks shared by the packer, the packed-file loader and the API entry points.
#include "common/argument_checks.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/format.hpp"
#include "common/numeric.hpp"

namespace w4a8moe::detail {

std::string shape_string(int rank, const std::array<int64_t, 3>& shape) {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[static_cast<size_t>(i)]);
  }
  return s + "]";
}

std::string shape_of(const TensorView& t) { return shape_string(t.rank, t.shape); }

void require_data(const void* data, std::string_view name) {
  if (data == nullptr) throw Error(cat(name, ": expected a data pointer, got null"));
}

void require_float(DType d, std::string_view name) {
  if (!is_float_dtype(d))
    throw Error(cat(name, ": expected dtype f32, bf16 or f16, got ", dtype_name(d)));
}

void require_shape(const TensorView& t, std::initializer_list<int64_t> want,
                   std::string_view name) {
  std::array<int64_t, 3> w{};
  int i = 0;
  for (int64_t d : want) w[static_cast<size_t>(i++)] = d;
  bool ok = t.rank == static_cast<int>(want.size());
  for (int k = 0; ok && k < t.rank; ++k)
    ok = t.shape[static_cast<size_t>(k)] == w[static_cast<size_t>(k)];
  if (!ok) throw Error(cat(name, ": expected shape ", shape_string(i, w), ", got ", shape_of(t)));
}

void require_contiguous(const TensorView& t, std::string_view name) {
  if (t.row_stride != 0 && t.row_stride != t.shape[static_cast<size_t>(t.rank - 1)])
    throw Error(cat(name, ": expected a contiguous tensor (row stride ",
                    t.shape[static_cast<size_t>(t.rank - 1)], "), got row stride ", t.row_stride));
}

// No 64-bit platform the library runs on maps user memory at or above 2^57 (x86-64 with 5-level
// paging: 2^56; AArch64: 2^52 at most): a view that ends there cannot be real.
constexpr uint64_t kAddressSpaceEnd = uint64_t{1} << 57;

// The bytes a tensor spans, (rows - 1) * stride + last dimension elements, must not
// overflow and must fit in the address space from its data pointer: huge or hostile shapes are
// rejected before anything is read or allocated (an output sized from a view that claims 2^62
// bytes would otherwise be allocated first). Negative dimensions are checked elsewhere.
void require_addressable(const void* data, DType dtype, int rank,
                         const std::array<int64_t, 3>& shape, int64_t stride,
                         std::string_view name) {
  if (rank < 1) return;
  uint64_t rows = 1;
  bool overflow = false;
  for (int k = 0; k + 1 < rank; ++k) {
    const int64_t d = shape[static_cast<size_t>(k)];
    if (d < 0) return;
    overflow = overflow || __builtin_mul_overflow(rows, static_cast<uint64_t>(d), &rows);
  }
  const int64_t last = shape[static_cast<size_t>(rank - 1)];
  if (last < 0 || stride < 0) return;
  uint64_t span = 0;
  if (rows > 0 && last > 0) {
    overflow = overflow || __builtin_mul_overflow(rows - 1, static_cast<uint64_t>(stride), &span);
    overflow = overflow || __builtin_add_overflow(span, static_cast<uint64_t>(last), &span);
  }
  uint64_t bytes = 0;
  overflow = overflow || __builtin_mul_overflow(span, uint64_t{dtype_bytes(dtype)}, &bytes);
  uint64_t end = 0;
  overflow = overflow || bytes > static_cast<uint64_t>(PTRDIFF_MAX) ||
             __builtin_add_overflow(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(data)), bytes,
                                    &end) ||
             end > kAddressSpaceEnd;
  if (overflow)
    throw Error(cat(name, ": expected a tensor that fits in the address space, got shape ",
                    shape_string(rank, shape), " with row stride ", stride, " of dtype ",
                    dtype_name(dtype)));
}

void require_addressable(const TensorView& t, std::string_view name) {
  require_addressable(t.data, t.dtype, t.rank, t.shape, t.stride(), name);
}

void require_positive_dims(const TensorView& t, std::string_view name) {
  for (int k = 0; k < t.rank; ++k)
    if (t.shape[static_cast<size_t>(k)] <= 0)
      throw Error(cat(name, ": expected positive dimensions, got shape ", shape_of(t)));
}

WeightInput check_weight_input(const TensorView& w, const TensorView& scale,
                               const TensorView& zero_point, const TensorView& bias, int group_size,
                               std::string_view w_name, std::string_view scale_name,
                               std::string_view zero_point_name, std::string_view bias_name,
                               WeightFormat format) {
  WeightInput in;
  const bool mxfp4 = format == WeightFormat::mxfp4;
  const bool int8 = format == WeightFormat::int8;
  if (!is_known_weight_format(static_cast<uint32_t>(format)))
    throw Error(
        cat("weight_format: expected int4_symmetric (0), int4_zero_point (1), mxfp4 (2) or int8 "
            "(3), got ",
            static_cast<uint32_t>(format)));
  require_data(w.data, w_name);
  if (mxfp4 && w.dtype != DType::u8)
    throw Error(cat(w_name, ": expected dtype u8 (mxfp4 e2m1 codes, two per byte), got ",
                    dtype_name(w.dtype)));
  if (int8 && w.dtype != DType::i8)
    throw Error(cat(w_name, ": expected dtype i8 (int8 weights), got ", dtype_name(w.dtype)));
  if (w.dtype != DType::i8 && w.dtype != DType::u8)
    throw Error(cat(w_name, ": expected dtype i8 (int4 values) or u8 (nibble-packed), got ",
                    dtype_name(w.dtype)));
  if (w.rank != 3) throw Error(cat(w_name, ": expected rank 3, got shape ", shape_of(w)));
  require_positive_dims(w, w_name);
  require_contiguous(w, w_name);
  require_addressable(w, w_name);  // also bounds shape[2] * 2 below
  in.experts = w.shape[0];
  in.rows = w.shape[1];
  in.nibbles = w.dtype == DType::u8;
  if (in.nibbles && w.shape[2] > INT64_MAX / 2)
    throw Error(cat(w_name, ": expected at most ", INT64_MAX / 2,
                    " nibble-packed bytes per row, got shape ", shape_of(w)));
  in.cols = in.nibbles ? w.shape[2] * 2 : w.shape[2];
  if (int8) {  // one scale per output row: the group size -1 or K (taken as -1)
    if (in.cols % kGroupBlock != 0)
      throw Error(cat(w_name, ": expected an input dimension K that is a multiple of ", kGroupBlock,
                      " for int8 weights, got K = ", in.cols));
    if (group_size != -1 && group_size != in.cols)
      throw Error(cat("group_size: expected -1 or K (", in.cols,
                      ") for int8 weights (one scale per output row), got ", group_size));
    group_size = -1;
  }
  if (!group_size_fits(group_size, in.cols))
    throw Error(cat("group_size: expected -1 or a multiple of 32 that divides ", in.cols,
                    " (the input dimension of ", w_name, "), got ", group_size));
  if (mxfp4 && group_size != 32)
    throw Error(
        cat("group_size: expected 32 for mxfp4 weights (one e8m0 scale per 32), got ", group_size));
  in.groups = group_size == -1 ? 1 : in.cols / group_size;

  require_data(scale.data, scale_name);
  if (mxfp4) {
    if (scale.dtype != DType::u8)
      throw Error(cat(scale_name, ": expected dtype u8 (mxfp4 e8m0 exponents), got ",
                      dtype_name(scale.dtype)));
  } else {
    require_float(scale.dtype, scale_name);
  }
  if (group_size == -1) {
    if (!(scale.rank == 2 && scale.shape[0] == in.experts && scale.shape[1] == in.rows) &&
        !(scale.rank == 3 && scale.shape[0] == in.experts && scale.shape[1] == in.rows &&
          scale.shape[2] == 1))
      throw Error(cat(scale_name, ": expected shape [", in.experts, ", ", in.rows,
                      "] for channelwise scales, got ", shape_of(scale)));
  } else {
    require_shape(scale, {in.experts, in.rows, in.groups}, scale_name);
  }
  require_contiguous(scale, scale_name);
  require_addressable(scale, scale_name);

  if (format == WeightFormat::int4_zero_point) {
    require_data(zero_point.data, zero_point_name);
    if (zero_point.dtype != DType::i8)
      throw Error(cat(zero_point_name, ": expected dtype i8 (int4 zero points in [-8, 7]), got ",
                      dtype_name(zero_point.dtype)));
    if (zero_point.rank != scale.rank ||
        !std::equal(scale.shape.begin(), scale.shape.begin() + scale.rank,
                    zero_point.shape.begin()))
      throw Error(cat(zero_point_name, ": expected the shape of ", scale_name, " ", shape_of(scale),
                      ", got ", shape_of(zero_point)));
    require_contiguous(zero_point, zero_point_name);
    require_addressable(zero_point, zero_point_name);
  } else if (!zero_point.empty()) {
    throw Error(cat(zero_point_name, ": expected no zero points for ", weight_format_name(format),
                    " weights (weight_format int4_zero_point takes them), got shape ",
                    shape_of(zero_point)));
  }

  if (!bias.empty()) {
    require_float(bias.dtype, bias_name);
    require_shape(bias, {in.experts, in.rows}, bias_name);
    require_contiguous(bias, bias_name);
    require_addressable(bias, bias_name);
  }
  return in;
}

void require_expert_format(WeightFormat format, std::string_view name) {
  if (format == WeightFormat::int8)
    throw Error(cat(name,
                    ": expected int4_symmetric, int4_zero_point or mxfp4 for an MoE layer's "
                    "experts, got int8 (a dense linear layer's format: pack_linear and linear())"));
}

void check_params(const MoeParams& p) {
  const auto code = static_cast<int>(p.activation);
  if (!is_valid_activation_code(code)) activation_from_code(code);  // throws the standard message
  if (!std::isfinite(p.alpha)) throw Error(cat("alpha: expected a finite value, got ", p.alpha));
  if (!(p.limit > 0.0f)) throw Error(cat("limit: expected a positive value, got ", p.limit));
}

void check_input_order(const TensorView& order, WeightRole role, int64_t experts, int64_t cols,
                       std::string_view name) {
  if (order.empty()) return;
  if (role != WeightRole::w13)
    throw Error(cat(name,
                    ": expected none for w2 (an input order is w13's: w2's inputs "
                    "are w13's rows, whose order the caller chooses)"));
  if (order.dtype != DType::i32 || order.rank != 2 || order.shape[0] != experts ||
      order.shape[1] != cols || order.stride() != cols)
    throw Error(cat(name, ": expected contiguous int32 [", experts, ", ", cols,
                    "] (the experts and inputs of w13), got ", dtype_name(order.dtype), " ",
                    shape_of(order),
                    order.rank == 2 && order.stride() != order.shape[1]
                        ? cat(" with row stride ", order.stride())
                        : std::string()));
  const auto* v = static_cast<const int32_t*>(order.data);
  std::vector<uint8_t> seen(static_cast<size_t>(cols));
  for (int64_t e = 0; e < experts; ++e) {
    std::fill(seen.begin(), seen.end(), uint8_t{0});
    for (int64_t c = 0; c < cols; ++c) {
      const int32_t i = v[e * cols + c];
      if (i < 0 || i >= cols)
        throw Error(
            cat(name, ": expected inputs in [0, ", cols, "), got ", i, " at [", e, ", ", c, "]"));
      if (seen[static_cast<size_t>(i)]++ != 0)
        throw Error(cat(name, ": expected each row a permutation of [0, ", cols, "), got input ", i,
                        " twice in row ", e));
    }
  }
}

}  // namespace w4a8moe::detail
