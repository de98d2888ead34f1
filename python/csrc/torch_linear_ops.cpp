// The dense linear layer of the library as torch ops (namespace `w4a8moe`): the int4 (or MXFP4)
// layers of a checkpoint that are not experts (attention projections, shared experts), for
// engines without an int4 kernel on a CPU (docs/pytorch.md, "Dense linear layers").
//
//   pack_linear(weight, weight_scale, group_size, bias, weight_zero_point, kernel_set) -> Tensor
//       weight int8 [N, K] in [-8, 7] or nibble-packed uint8 [N, K/2] (mxfp4: e2m1 codes, with
//       uint8 e8m0 scales, group 32); weight_scale [N, K/g] or [N]; zero points int8 shaped like
//       the scales (int4 with zero points); bias [N]. Returns the packed uint8 buffer.
//   pack_linear_int8(weight, weight_scale, bias, kernel_set) -> Tensor
//       int8 weights per output channel: weight int8 [N, K] (K a multiple of 32), weight_scale
//       [N] float32 / bfloat16 / float16, bias [N]. Returns the packed uint8 buffer.
//   quantize_linear_int8(weight) -> (Tensor, Tensor)
//       float weights [N, K] -> int8 values [N, K] and float32 scales [N] (symmetric,
//       max|w| / 127, rounded half to even), pack_linear_int8's arguments.
//   linear(x, w_packed, out_features) -> Tensor
//       x [..., K] float32 / bfloat16 / float16; out [..., N] of x's dtype: x W^T + bias, each
//       row of x quantized per row to int8 as the MoE op does.
//
// CPU kernels, Meta kernels for the packing ops (the size from the library's packed_size) and,
// on torch 1.x, for linear and quantize_linear_int8 (torch 2: w4a8moe/_fake.py); no
// derivative.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>
#include <torch/version.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "torch_threads.hpp"
#include "torch_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe_torch {
namespace {

using at::Tensor;

using util::bytes_of;
using util::to_dtype;
using util::to_tensor;
using util::translate_errors;
using util::view_of;
using util::with_format_of;

// weight [N, K] int8 or [N, K/2] uint8: returns (N, K).
std::pair<int64_t, int64_t> linear_shape(const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2,
              "weight: expected rank 2 [N, K] (or [N, K/2] nibble-packed), got "
              "shape ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kChar || weight.scalar_type() == at::kByte,
              "weight: expected dtype int8 (int4 values) or uint8 (nibble-packed, or mxfp4 "
              "codes), got ",
              weight.scalar_type());
  return {weight.size(0), weight.size(1) * (weight.scalar_type() == at::kByte ? 2 : 1)};
}

w4a8moe::PackOptions linear_options(int64_t group_size, const Tensor& weight_scale,
                                    const c10::optional<Tensor>& zero_point,
                                    const std::string& kernel_set) {
  TORCH_CHECK(group_size >= INT32_MIN && group_size <= INT32_MAX,
              "group_size: expected -1 or a multiple of 32, got ", group_size);
  w4a8moe::PackOptions o;
  o.group_size = static_cast<int>(group_size);
  o.kernel_set = kernel_set;
  return with_format_of(o, weight_scale, zero_point);
}

Tensor pack_linear_cpu(const Tensor& weight, const Tensor& weight_scale, int64_t group_size,
                       const c10::optional<Tensor>& bias,
                       const c10::optional<Tensor>& weight_zero_point, std::string kernel_set) {
  return translate_errors([&] {
    linear_shape(weight);
    std::vector<Tensor> keep;
    keep.reserve(4);
    auto view = [&](const Tensor& t, const char* name) {
      keep.push_back(t.contiguous());
      return view_of(keep.back(), name);
    };
    auto optional_view = [&](const c10::optional<Tensor>& t, const char* name) {
      return t.has_value() && t->defined() ? view(*t, name) : w4a8moe::TensorView{};
    };
    const auto w = view(weight, "weight");
    const auto s = view(weight_scale, "weight_scale");
    const auto z = optional_view(weight_zero_point, "weight_zero_point");
    const auto b = optional_view(bias, "bias");
    return to_tensor(w4a8moe::pack_linear(
        w, s, z, b, linear_options(group_size, weight_scale, weight_zero_point, kernel_set)));
  });
}

Tensor pack_linear_meta(const Tensor& weight, const Tensor& weight_scale, int64_t group_size,
                        const c10::optional<Tensor>& bias,
                        const c10::optional<Tensor>& weight_zero_point, std::string kernel_set) {
  return translate_errors([&] {
    const auto [rows, cols] = linear_shape(weight);
    const size_t bytes = w4a8moe::packed_size(
        w4a8moe::WeightRole::w2, 1, rows, cols,
        to_dtype(weight_scale.scalar_type(), "weight_scale"), bias.has_value() && bias->defined(),
        linear_options(group_size, weight_scale, weight_zero_point, kernel_set), "weight");
    return at::empty({static_cast<int64_t>(bytes)}, weight.options().dtype(at::kByte));
  });
}

// weight int8 [N, K] of the int8 format: returns (N, K).
std::pair<int64_t, int64_t> int8_shape(const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight: expected rank 2 [N, K], got shape ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kChar, "weight: expected dtype int8 (int8 weights), got ",
              weight.scalar_type());
  return {weight.size(0), weight.size(1)};
}

w4a8moe::PackOptions int8_options(const std::string& kernel_set) {
  w4a8moe::PackOptions o;
  o.weight_format = w4a8moe::WeightFormat::int8;
  o.kernel_set = kernel_set;
  return o;
}

Tensor pack_linear_int8_cpu(const Tensor& weight, const Tensor& weight_scale,
                            const c10::optional<Tensor>& bias, std::string kernel_set) {
  return translate_errors([&] {
    int8_shape(weight);
    Tensor w = weight, s = weight_scale, b;
    const auto wv = view_of(w, "weight");
    const auto sv = view_of(s, "weight_scale");
    w4a8moe::TensorView bv;
    if (bias.has_value() && bias->defined()) {
      b = *bias;
      bv = view_of(b, "bias");
    }
    return to_tensor(w4a8moe::pack_linear(wv, sv, {}, bv, int8_options(kernel_set)));
  });
}

Tensor pack_linear_int8_meta(const Tensor& weight, const Tensor& weight_scale,
                             const c10::optional<Tensor>& bias, std::string kernel_set) {
  return translate_errors([&] {
    const auto [rows, cols] = int8_shape(weight);
    const size_t bytes = w4a8moe::packed_size(w4a8moe::WeightRole::w2, 1, rows, cols,
                                              to_dtype(weight_scale.scalar_type(), "weight_scale"),
                                              bias.has_value() && bias->defined(),
                                              int8_options(kernel_set), "weight");
    return at::empty({static_cast<int64_t>(bytes)}, weight.options().dtype(at::kByte));
  });
}

void check_float_weight(const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight: expected rank 2 [N, K], got shape ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16 ||
                  weight.scalar_type() == at::kHalf,
              "weight: expected dtype float32, bfloat16 or float16, got ", weight.scalar_type());
}

std::tuple<Tensor, Tensor> quantize_linear_int8_cpu(const Tensor& weight) {
  return translate_errors([&] {
    check_float_weight(weight);
    Tensor w = weight;
    const auto wv = view_of(w, "weight");
    Tensor values = at::empty(w.sizes(), w.options().dtype(at::kChar));
    Tensor scales = at::empty({w.size(0)}, w.options().dtype(at::kFloat));
    if (w.numel() > 0)
      w4a8moe::quantize_linear_int8(
          wv,
          w4a8moe::MutableTensorView::of(values.data_ptr(), w4a8moe::DType::i8,
                                         {w.size(0), w.size(1)}),
          w4a8moe::MutableTensorView::of(scales.data_ptr(), w4a8moe::DType::f32, {w.size(0)}));
    else
      scales.zero_();
    return std::make_tuple(values, scales);
  });
}

#if TORCH_VERSION_MAJOR < 2  // torch 2: w4a8moe/_fake.py
std::tuple<Tensor, Tensor> quantize_linear_int8_meta(const Tensor& weight) {
  check_float_weight(weight);
  return std::make_tuple(at::empty(weight.sizes(), weight.options().dtype(at::kChar)),
                         at::empty({weight.size(0)}, weight.options().dtype(at::kFloat)));
}
#endif

// x [..., K] -> the output's shape [..., N].
std::vector<int64_t> linear_output(const Tensor& x, int64_t out_features) {
  TORCH_CHECK(x.dim() >= 1, "x: expected rank 1 or more [..., K], got a scalar");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              "x: expected dtype float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(out_features >= 1, "out_features: expected a positive value, got ", out_features);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out_features;
  return shape;
}

Tensor linear_cpu(const Tensor& x_in, const Tensor& w_packed, int64_t out_features) {
  return translate_errors([&] {
    const auto w = bytes_of(w_packed, "w_packed");
    const w4a8moe::PackedInfo info = w4a8moe::inspect_packed(w, "w_packed");
    TORCH_CHECK(info.role == w4a8moe::WeightRole::w2 && info.experts == 1,
                "w_packed: expected a linear layer's weights (pack_linear), got ", info.experts,
                " expert(s) packed as ", info.role == w4a8moe::WeightRole::w13 ? "w13" : "w2");
    TORCH_CHECK(out_features == info.rows, "out_features: expected ", info.rows,
                " (the rows of w_packed), got ", out_features);
    const std::vector<int64_t> shape = linear_output(x_in, out_features);
    TORCH_CHECK(x_in.size(-1) == info.cols, "x: expected ", info.cols,
                " columns (the inputs of w_packed), got shape ", x_in.sizes());
    Tensor out = at::empty(shape, x_in.options());
    const int64_t tokens = x_in.numel() / info.cols;
    if (tokens == 0) return out;
    Tensor x = x_in.reshape({tokens, info.cols});
    const w4a8moe::TensorView xv = view_of(x, "x", /*rows_strided=*/true);
    const auto ov =
        w4a8moe::MutableTensorView::of(out.data_ptr(), xv.dtype, {tokens, out_features});
    threads::with_context([&](w4a8moe::Context& context) { w4a8moe::linear(context, xv, w, ov); });
    return out;
  });
}

#if TORCH_VERSION_MAJOR < 2  // torch 2: w4a8moe/_fake.py
Tensor linear_meta(const Tensor& x, const Tensor& w_packed, int64_t out_features) {
  TORCH_CHECK(w_packed.scalar_type() == at::kByte,
              "w_packed: expected a uint8 tensor of packed weights, got ", w_packed.scalar_type());
  return at::empty(linear_output(x, out_features), x.options());
}
#endif

}  // namespace
}  // namespace w4a8moe_torch

TORCH_LIBRARY_FRAGMENT(w4a8moe, m) {
  m.def(
      "pack_linear(Tensor weight, Tensor weight_scale, int group_size, Tensor? bias=None, "
      "Tensor? weight_zero_point=None, str kernel_set=\"\") -> Tensor");
  m.def(
      "pack_linear_int8(Tensor weight, Tensor weight_scale, Tensor? bias=None, "
      "str kernel_set=\"\") -> Tensor");
  m.def("quantize_linear_int8(Tensor weight) -> (Tensor, Tensor)");
  m.def("linear(Tensor x, Tensor w_packed, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(w4a8moe, CPU, m) {
  m.impl("pack_linear", &w4a8moe_torch::pack_linear_cpu);
  m.impl("pack_linear_int8", &w4a8moe_torch::pack_linear_int8_cpu);
  m.impl("quantize_linear_int8", &w4a8moe_torch::quantize_linear_int8_cpu);
  m.impl("linear", &w4a8moe_torch::linear_cpu);
}

TORCH_LIBRARY_IMPL(w4a8moe, Meta, m) {
  m.impl("pack_linear", &w4a8moe_torch::pack_linear_meta);
  m.impl("pack_linear_int8", &w4a8moe_torch::pack_linear_int8_meta);
#if TORCH_VERSION_MAJOR < 2
  m.impl("quantize_linear_int8", &w4a8moe_torch::quantize_linear_int8_meta);
  m.impl("linear", &w4a8moe_torch::linear_meta);
#endif
}

// Not differentiable: the Autograd fallthrough of every op (torch_util.hpp).
TORCH_LIBRARY_IMPL(w4a8moe, W4A8MOE_TORCH_AUTOGRAD_KEY, m) {
  w4a8moe_torch::util::not_differentiable(
      m, {"pack_linear", "pack_linear_int8", "quantize_linear_int8", "linear"});
}
