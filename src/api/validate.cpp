#include "api/validate.hpp"

#include <cmath>
#include <cstdint>
#include <functional>

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

namespace {

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

}  // namespace

// The bytes a tensor spans, (rows - 1) * stride + last dimension elements, must not
// overflow and must fit in the address space from its data pointer: huge or hostile shapes are
// rejected before anything is read or allocated. Negative dimensions are checked elsewhere.
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
  overflow =
      overflow || bytes > static_cast<uint64_t>(PTRDIFF_MAX) ||
      __builtin_add_overflow(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(data)), bytes, &end);
  if (overflow)
    throw Error(cat(name, ": expected a tensor that fits in the address space, got shape ",
                    shape_string(rank, shape), " with row stride ", stride, " of dtype ",
                    dtype_name(dtype)));
}

void require_addressable(const TensorView& t, std::string_view name) {
  require_addressable(t.data, t.dtype, t.rank, t.shape, t.stride(), name);
}

namespace {

void require_positive_dims(const TensorView& t, std::string_view name) {
  for (int k = 0; k < t.rank; ++k)
    if (t.shape[static_cast<size_t>(k)] <= 0)
      throw Error(cat(name, ": expected positive dimensions, got shape ", shape_of(t)));
}

// x, topk_ids, topk_weights and out, against each other; returns T and K.
void check_activations(const TensorView& x, const TensorView& topk_ids,
                       const TensorView& topk_weights, int64_t hidden, int64_t experts,
                       const MutableTensorView& out, ForwardShape& s) {
  // T = 0 (an empty batch) is valid: shapes are still checked, data pointers may be null.
  const bool empty = x.rank == 2 && x.shape[0] == 0;
  if (!empty) require_data(x.data, "x");
  require_float(x.dtype, "x");
  if (x.rank != 2) throw Error(cat("x: expected rank 2 [T, H], got shape ", shape_of(x)));
  if (x.shape[0] < 0 || x.shape[1] < 1)
    throw Error(cat("x: expected shape [T, H] with T >= 0 and H >= 1, got shape ", shape_of(x)));
  if (x.shape[1] != hidden)
    throw Error(cat("x: expected ", hidden, " columns (the weights' hidden size), got shape ",
                    shape_of(x)));
  if (x.row_stride != 0 && x.row_stride < x.shape[1])
    throw Error(cat("x: expected a row stride >= ", x.shape[1], ", got ", x.row_stride));
  require_addressable(x, "x");
  const int64_t tokens = x.shape[0];

  if (!empty) require_data(topk_ids.data, "topk_ids");
  if (topk_ids.dtype != DType::i32 && topk_ids.dtype != DType::i64)
    throw Error(cat("topk_ids: expected dtype i32 or i64, got ", dtype_name(topk_ids.dtype)));
  if (topk_ids.rank != 2 || topk_ids.shape[0] != tokens || topk_ids.shape[1] < 1)
    throw Error(
        cat("topk_ids: expected shape [", tokens, ", K] with K >= 1, got ", shape_of(topk_ids)));
  require_contiguous(topk_ids, "topk_ids");
  const int64_t top_k = topk_ids.shape[1];
  constexpr int64_t kMaxPairs = INT32_MAX;
  if (tokens > kMaxPairs || top_k > kMaxPairs || tokens * top_k > kMaxPairs)
    throw Error(cat("topk_ids: expected at most ", kMaxPairs, " (token, slot) pairs, got ", tokens,
                    " x ", top_k));

  if (!empty) require_data(topk_weights.data, "topk_weights");
  require_float(topk_weights.dtype, "topk_weights");
  require_shape(topk_weights, {tokens, top_k}, "topk_weights");
  require_contiguous(topk_weights, "topk_weights");

  if (!empty) require_data(out.data, "out");
  if (out.dtype != x.dtype)
    throw Error(cat("out: expected dtype ", dtype_name(x.dtype), " (the dtype of x), got ",
                    dtype_name(out.dtype)));
  if (out.rank != 2 || out.shape[0] != tokens || out.shape[1] != hidden)
    throw Error(cat("out: expected shape [", tokens, ", ", hidden, "], got ",
                    shape_string(out.rank, out.shape)));
  if (out.row_stride != 0 && out.row_stride < hidden)
    throw Error(cat("out: expected a row stride >= ", hidden, ", got ", out.row_stride));
  require_addressable(topk_ids, "topk_ids");
  require_addressable(topk_weights, "topk_weights");
  require_addressable(out.data, out.dtype, out.rank, out.shape, out.stride(), "out");

  s.tokens = tokens;
  s.top_k = top_k;
  if (empty) return;

  // out must not overlap the inputs: rows of x are read after rows of out are written.
  const auto range = [](const void* p, int64_t rows, int64_t stride, int64_t cols, DType d) {
    const auto b = reinterpret_cast<uintptr_t>(p);
    return std::pair<uintptr_t, uintptr_t>{
        b, b + static_cast<uintptr_t>(((rows - 1) * stride + cols)) * dtype_bytes(d)};
  };
  const auto o = range(out.data, tokens, out.stride(), hidden, out.dtype);
  const auto overlaps = [&](std::pair<uintptr_t, uintptr_t> r) {
    return r.first < o.second && o.first < r.second;
  };
  if (overlaps(range(x.data, tokens, x.stride(), hidden, x.dtype)))
    throw Error("out: expected a buffer that does not overlap x, got overlapping memory");
  if (overlaps(range(topk_ids.data, tokens, top_k, top_k, topk_ids.dtype)) ||
      overlaps(range(topk_weights.data, tokens, top_k, top_k, topk_weights.dtype)))
    throw Error(
        "out: expected a buffer that does not overlap topk_ids or topk_weights, got "
        "overlapping memory");

  for (int64_t i = 0; i < tokens * top_k; ++i) {
    const int64_t e = load_index(topk_ids.data, topk_ids.dtype, i);
    if (e < 0 || e >= experts)
      throw Error(cat("topk_ids: expected expert ids in [0, ", experts, "), got ", e, " at token ",
                      i / top_k, ", slot ", i % top_k));
  }
}

}  // namespace

WeightInput check_weight_input(const TensorView& w, const TensorView& scale, const TensorView& bias,
                               int group_size, std::string_view w_name, std::string_view scale_name,
                               std::string_view bias_name) {
  WeightInput in;
  require_data(w.data, w_name);
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
  if (group_size != -1 && (group_size <= 0 || group_size % 32 != 0 || in.cols % group_size != 0))
    throw Error(cat("group_size: expected -1 or a multiple of 32 that divides ", in.cols,
                    " (the input dimension of ", w_name, "), got ", group_size));
  in.groups = group_size == -1 ? 1 : in.cols / group_size;

  require_data(scale.data, scale_name);
  require_float(scale.dtype, scale_name);
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

  if (!bias.empty()) {
    require_float(bias.dtype, bias_name);
    require_shape(bias, {in.experts, in.rows}, bias_name);
    require_contiguous(bias, bias_name);
    require_addressable(bias, bias_name);
  }
  return in;
}

void check_params(const MoeParams& p) {
  const auto code = static_cast<int>(p.activation);
  if (code < 0 || code > 4) activation_from_code(code);  // throws the standard message
  if (!std::isfinite(p.alpha)) throw Error(cat("alpha: expected a finite value, got ", p.alpha));
  if (!(p.limit > 0.0f)) throw Error(cat("limit: expected a positive value, got ", p.limit));
}

ForwardShape check_packed_pair(const Geometry& w13, const Geometry& w2, std::string_view w13_name,
                               std::string_view w2_name) {
  if (w13.role != WeightRole::w13)
    throw Error(cat(w13_name, ": expected weights packed as w13, got a buffer packed as w2"));
  if (w2.role != WeightRole::w2)
    throw Error(cat(w2_name, ": expected weights packed as w2, got a buffer packed as w13"));
  if (w13.rows % 2 != 0)
    throw Error(cat(w13_name, ": expected an even number of rows (2I), got ", w13.rows));
  ForwardShape s;
  s.experts = w13.experts;
  s.hidden = w13.cols;
  s.inter = w13.rows / 2;
  if (w2.experts != s.experts || w2.rows != s.hidden || w2.cols != s.inter)
    throw Error(cat(w2_name, ": expected ", s.experts, " experts of [", s.hidden, ", ", s.inter,
                    "] to match ", w13_name, ", got ", w2.experts, " experts of [", w2.rows, ", ",
                    w2.cols, "]"));
  if (w13.group_size != w2.group_size)
    throw Error(cat(w2_name, ": expected group size ", w13.group_size, " (the group size of ",
                    w13_name, "), got ", w2.group_size));
  if (w13.layout != w2.layout)
    throw Error(cat(w2_name, ": expected layout ", layout_name(w13.layout), " (the layout of ",
                    w13_name, "), got ", layout_name(w2.layout)));
  return s;
}

ForwardShape check_forward(const TensorView& x, const TensorView& topk_ids,
                           const TensorView& topk_weights, const Geometry& w13, const Geometry& w2,
                           const MoeParams& params, const MutableTensorView& out) {
  ForwardShape s = check_packed_pair(w13, w2, "w13_packed", "w2_packed");
  check_params(params);
  check_activations(x, topk_ids, topk_weights, s.hidden, s.experts, out, s);
  return s;
}

ForwardShape check_forward_logical(const TensorView& x, const TensorView& topk_ids,
                                   const TensorView& topk_weights, int64_t experts, int64_t hidden,
                                   int64_t inter, const MoeParams& params,
                                   const MutableTensorView& out) {
  ForwardShape s;
  s.experts = experts;
  s.hidden = hidden;
  s.inter = inter;
  check_params(params);
  check_activations(x, topk_ids, topk_weights, hidden, experts, out, s);
  return s;
}

}  // namespace w4a8moe::detail
