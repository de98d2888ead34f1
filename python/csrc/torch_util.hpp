// What the sources of torch ops (torch_*_ops.cpp) share to turn tensors into library views and
// library errors into torch errors, with the same rules and sentences, and to say that an op has
// no derivative.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Optional.h>
#include <torch/library.h>
#include <torch/version.h>

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <utility>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe_torch::util {

using at::Tensor;

// Runs f; a w4a8moe::Error becomes a torch error with the library's message.
template <class F>
auto translate_errors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const w4a8moe::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

// The torch dtypes the library takes, and its names for them.
inline constexpr std::pair<at::ScalarType, w4a8moe::DType> kDTypes[] = {
    {at::kFloat, w4a8moe::DType::f32}, {at::kBFloat16, w4a8moe::DType::bf16},
    {at::kHalf, w4a8moe::DType::f16},  {at::kChar, w4a8moe::DType::i8},
    {at::kByte, w4a8moe::DType::u8},   {at::kInt, w4a8moe::DType::i32},
    {at::kLong, w4a8moe::DType::i64}};

inline w4a8moe::DType to_dtype(at::ScalarType t, const char* name) {
  for (const auto& [torch_dtype, dtype] : kDTypes)
    if (t == torch_dtype) return dtype;
  TORCH_CHECK(false, name, ": dtype ", t, " is not supported");
}

// Pack options for one role, the weight format read off its scales' dtype: uint8 scales are
// MXFP4's e8m0 exponents (its weights then uint8 e2m1 codes, group 32, as vLLM's and gpt-oss's
// MXFP4 layers hold them), float scales int4's (docs/pytorch.md).
// With zero points (int8, shaped like the scales: AWQ, GPTQ, asymmetric compressed-tensors) the
// weights are int4 with zero points.
inline w4a8moe::PackOptions with_format_of(w4a8moe::PackOptions options, const Tensor& scale,
                                           const c10::optional<Tensor>& zero_point = c10::nullopt) {
  options.weight_format = scale.scalar_type() == at::kByte ? w4a8moe::WeightFormat::mxfp4
                                                           : w4a8moe::WeightFormat::int4_symmetric;
  if (zero_point.has_value() && zero_point->defined())
    options.weight_format = w4a8moe::WeightFormat::int4_zero_point;
  return options;
}

// PackOptions::input_order for w13 from an optional int32 [E, H] tensor (`keep` holds its
// contiguous copy while packing). Meta tensors have no data: a placeholder view that says one is
// given, which is all packed_size() reads.
inline w4a8moe::PackOptions with_input_order(w4a8moe::PackOptions options,
                                             const c10::optional<Tensor>& order, Tensor& keep,
                                             bool meta) {
  if (!order.has_value() || !order->defined()) return options;
  if (meta) {
    static const int32_t placeholder = 0;
    options.input_order = w4a8moe::TensorView::of(
        &placeholder, w4a8moe::DType::i32,
        {order->dim() > 0 ? order->size(0) : 0, order->dim() > 1 ? order->size(1) : 0});
    return options;
  }
  TORCH_CHECK(order->device().is_cpu(), "w13_input_order: expected a CPU tensor, got one on ",
              order->device());
  TORCH_CHECK(order->scalar_type() == at::kInt && order->dim() == 2,
              "w13_input_order: expected an int32 tensor [E, H], got dtype ", order->scalar_type(),
              " and shape ", order->sizes());
  keep = order->contiguous();
  options.input_order =
      w4a8moe::TensorView::of(keep.data_ptr(), w4a8moe::DType::i32, {keep.size(0), keep.size(1)});
  return options;
}

inline void require_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor, got one on ", t.device());
}

// A view of `t` of rank 1 to 3; rows_strided: rank 2 whose rows may be strided (x), copied
// only when the last dimension is strided. `t` becomes the contiguous tensor viewed, which the
// caller keeps alive.
inline w4a8moe::TensorView view_of(Tensor& t, const char* name, bool rows_strided = false) {
  require_cpu(t, name);
  w4a8moe::TensorView v;
  if (rows_strided) {
    TORCH_CHECK(t.dim() == 2, name, ": expected rank 2, got shape ", t.sizes());
    if (t.stride(1) != 1 || (t.size(0) > 1 && t.stride(0) < t.size(1))) t = t.contiguous();
    v.row_stride = t.size(0) > 1 ? t.stride(0) : 0;
  } else {
    TORCH_CHECK(t.dim() >= 1 && t.dim() <= 3, name, ": expected rank 1 to 3, got shape ",
                t.sizes());
    t = t.contiguous();
  }
  v.data = t.data_ptr();
  v.dtype = to_dtype(t.scalar_type(), name);
  v.rank = static_cast<int>(t.dim());
  for (int i = 0; i < v.rank; ++i) v.shape[static_cast<size_t>(i)] = t.size(i);
  return v;
}

inline w4a8moe::MutableTensorView mutable_view_of(Tensor& t) {
  w4a8moe::MutableTensorView v;
  v.data = t.data_ptr();
  v.dtype = to_dtype(t.scalar_type(), "out");
  v.rank = static_cast<int>(t.dim());
  for (int i = 0; i < v.rank; ++i) v.shape[static_cast<size_t>(i)] = t.size(i);
  return v;
}

// The bytes of a contiguous uint8 CPU tensor: packed weights, records, results.
inline std::span<const uint8_t> bytes_of(const Tensor& t, const char* name,
                                         const char* what = "packed weights") {
  require_cpu(t, name);
  TORCH_CHECK(t.scalar_type() == at::kByte, name, ": expected a uint8 tensor of ", what,
              ", got dtype ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor of ", what);
  return {static_cast<const uint8_t*>(t.data_ptr()), static_cast<size_t>(t.nbytes())};
}

// A 1-D uint8 tensor owning a packed buffer.
inline Tensor to_tensor(w4a8moe::PackedWeights packed) {
  auto* holder = new w4a8moe::PackedWeights(std::move(packed));
  const auto bytes = static_cast<int64_t>(holder->size());
  return at::from_blob(
      holder->data(), {bytes}, [holder](void*) { delete holder; },
      at::TensorOptions().dtype(at::kByte));
}

inline w4a8moe::MoeParams moe_params(bool apply_router_weight_on_input, int64_t activation_kind,
                                     double alpha, double limit) {
  w4a8moe::MoeParams p;
  p.activation = w4a8moe::activation_from_code(activation_kind);
  p.alpha = static_cast<float>(alpha);
  p.limit = static_cast<float>(limit);
  p.apply_router_weight_on_input = apply_router_weight_on_input;
  return p;
}

// The ops have no derivative. Torch 1.13 has no fallthrough for AutogradMeta (it has one for
// AutogradCPU), so meta and fake tensors would stop there without one. Torch 2 warns (and will
// fail) when an op without an autograd kernel sees inputs that require grad, e.g. router weights
// of a module being traced: a fallthrough on the Autograd alias key is how an op says it is not
// differentiable (its outputs then do not require grad). Each source of ops registers its ops'
// fallthrough with not_differentiable() in TORCH_LIBRARY_IMPL(w4a8moe, W4A8MOE_TORCH_AUTOGRAD_KEY).
#if TORCH_VERSION_MAJOR < 2
#define W4A8MOE_TORCH_AUTOGRAD_KEY AutogradMeta
#else
#define W4A8MOE_TORCH_AUTOGRAD_KEY Autograd
#endif

inline void not_differentiable(torch::Library& m, std::initializer_list<const char*> ops) {
  for (const char* name : ops) m.impl(name, torch::CppFunction::makeFallthrough());
}

}  // namespace w4a8moe_torch::util
