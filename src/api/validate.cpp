// The checks of forward() and reference_forward(): activations, ids, router weights and out
// against each other and the weights' shapes.
#include "api/validate.hpp"

#include <cmath>
#include <cstdint>
#include <functional>

#include "common/format.hpp"
#include "common/numeric.hpp"

namespace w4a8moe::detail {

namespace {

// out against x and the shapes, and that it overlaps none of the inputs.
void check_out(const TensorView& x, const TensorView& topk_ids, const TensorView& topk_weights,
               const MutableTensorView& out, bool f32_out, int64_t tokens, int64_t hidden) {
  const bool empty = tokens == 0;
  const int64_t top_k = topk_ids.shape[1];
  if (!empty) require_data(out.data, "out");
  if (out.dtype != x.dtype && !(f32_out && out.dtype == DType::f32))
    throw Error(cat("out: expected dtype ", dtype_name(x.dtype), " (the dtype of x)",
                    f32_out ? " or f32" : "", ", got ", dtype_name(out.dtype)));
  if (out.rank != 2 || out.shape[0] != tokens || out.shape[1] != hidden)
    throw Error(cat("out: expected shape [", tokens, ", ", hidden, "], got ",
                    shape_string(out.rank, out.shape)));
  if (out.row_stride != 0 && out.row_stride < hidden)
    throw Error(cat("out: expected a row stride >= ", hidden, ", got ", out.row_stride));
  require_addressable(out.data, out.dtype, out.rank, out.shape, out.stride(), "out");
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
}

// x, topk_ids, topk_weights and out, against each other; returns T and K.
// `out` null: no output to check. f32_out: out may be f32 whatever x's dtype.
void check_activations(const TensorView& x, const TensorView& topk_ids,
                       const TensorView& topk_weights, int64_t hidden, int64_t experts,
                       const MutableTensorView* out_view, bool f32_out, ForwardShape& s) {
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

  require_addressable(topk_ids, "topk_ids");
  require_addressable(topk_weights, "topk_weights");
  s.tokens = tokens;
  s.top_k = top_k;
  if (out_view != nullptr) check_out(x, topk_ids, topk_weights, *out_view, f32_out, tokens, hidden);
  if (empty) return;
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    const int64_t e = load_index(topk_ids.data, topk_ids.dtype, i);
    if (e < 0 || e >= experts)
      throw Error(cat("topk_ids: expected expert ids in [0, ", experts, "), got ", e, " at token ",
                      i / top_k, ", slot ", i % top_k));
  }
}

}  // namespace

ForwardShape check_forward(const TensorView& x, const TensorView& topk_ids,
                           const TensorView& topk_weights, const Geometry& w13, const Geometry& w2,
                           const MoeParams& params, const MutableTensorView& out,
                           const ForwardRules& rules) {
  ForwardShape s = check_packed_pair(w13, w2, "w13_packed", "w2_packed");
  check_params(params);
  check_activations(x, topk_ids, topk_weights, s.hidden,
                    rules.id_experts >= 0 ? rules.id_experts : s.experts, &out, rules.f32_out, s);
  return s;
}

ForwardShape check_tokens(const TensorView& x, const TensorView& topk_ids,
                          const TensorView& topk_weights, int64_t hidden, int64_t experts) {
  ForwardShape s;
  s.experts = experts;
  s.hidden = hidden;
  check_activations(x, topk_ids, topk_weights, hidden, experts, nullptr, false, s);
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
  check_activations(x, topk_ids, topk_weights, hidden, experts, &out, false, s);
  return s;
}

}  // namespace w4a8moe::detail
