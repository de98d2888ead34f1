// Packing from a checkpoint's own quantized layouts as torch ops (namespace `w4a8moe`; the
// layouts: w4a8moe/checkpoint.hpp and docs/checkpoints.md). The tensors go in as the file or an
// engine's loader holds them; the library decodes and packs them expert by expert.
//
//   pack_checkpoint_moe(format, w13_weight, w13_scale, w2_weight, w2_scale, group_size,
//                       w13_zero_point, w2_zero_point, w13_g_idx, w2_g_idx, w13_bias, w2_bias,
//                       gate_up_layout, kernel_set, experts) -> (w13_packed, w2_packed)
//   pack_checkpoint_linear(format, weight, scale, group_size, zero_point, g_idx, bias,
//                          kernel_set) -> w_packed
//
// format: "gptq", "gptq_v2", "awq", "compressed-tensors" or "mxfp4". The packed size depends on
// g_idx's values (an input order is kept only for act-order), so these ops have no Meta kernel
// here: torch 2 gets fake kernels with a data-dependent size (w4a8moe/_fake.py). No derivative.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/library.h>
#include <torch/version.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "torch_util.hpp"
#include "w4a8moe/checkpoint.hpp"

namespace w4a8moe_torch {
namespace {

using at::Tensor;
using OptionalTensor = c10::optional<Tensor>;
using util::to_tensor;
using util::translate_errors;
using util::view_of;

// The tensors viewed, kept alive (contiguous copies where a tensor is strided) while packing.
struct Views {
  std::vector<Tensor> keep;
  Views() { keep.reserve(12); }
  w4a8moe::TensorView operator()(const Tensor& t, const char* name) {
    keep.push_back(t);
    return view_of(keep.back(), name);
  }
  w4a8moe::TensorView operator()(const OptionalTensor& t, const char* name) {
    return t.has_value() && t->defined() ? (*this)(*t, name) : w4a8moe::TensorView{};
  }
};

w4a8moe::PackOptions checkpoint_options(int64_t group_size, const std::string& kernel_set) {
  TORCH_CHECK(group_size >= INT32_MIN && group_size <= INT32_MAX,
              "group_size: expected -1 or a multiple of 32, got ", group_size);
  w4a8moe::PackOptions o;
  o.group_size = static_cast<int>(group_size);
  o.kernel_set = kernel_set;
  return o;
}

std::tuple<Tensor, Tensor> pack_checkpoint_moe_cpu(
    const std::string& format, const Tensor& w13_weight, const Tensor& w13_scale,
    const Tensor& w2_weight, const Tensor& w2_scale, int64_t group_size,
    const OptionalTensor& w13_zero_point, const OptionalTensor& w2_zero_point,
    const OptionalTensor& w13_g_idx, const OptionalTensor& w2_g_idx, const OptionalTensor& w13_bias,
    const OptionalTensor& w2_bias, const std::string& gate_up_layout, const std::string& kernel_set,
    const c10::optional<std::vector<int64_t>>& experts) {
  return translate_errors([&] {
    const auto f = w4a8moe::parse_checkpoint_format(format);
    w4a8moe::PackOptions o = checkpoint_options(group_size, kernel_set);
    if (gate_up_layout == "interleaved")
      o.gate_up_layout = w4a8moe::GateUpLayout::interleaved;
    else
      TORCH_CHECK(gate_up_layout == "halves",
                  "gate_up_layout: expected 'halves' or 'interleaved', got '", gate_up_layout, "'");
    if (experts.has_value())
      for (const int64_t e : *experts) {
        TORCH_CHECK(e >= 0 && e <= INT32_MAX, "experts: expected expert indices, got ", e);
        o.experts.push_back(static_cast<int32_t>(e));
      }
    Views v;
    const w4a8moe::CheckpointTensors w13{v(w13_weight, "w13.weight"), v(w13_scale, "w13.scale"),
                                         v(w13_zero_point, "w13.zero_point"),
                                         v(w13_g_idx, "w13.g_idx"), v(w13_bias, "w13.bias")};
    const w4a8moe::CheckpointTensors w2{v(w2_weight, "w2.weight"), v(w2_scale, "w2.scale"),
                                        v(w2_zero_point, "w2.zero_point"), v(w2_g_idx, "w2.g_idx"),
                                        v(w2_bias, "w2.bias")};
    w4a8moe::PackedLayer layer = w4a8moe::pack_checkpoint_moe(f, w13, w2, o);
    return std::make_tuple(to_tensor(std::move(layer.w13)), to_tensor(std::move(layer.w2)));
  });
}

Tensor pack_checkpoint_linear_cpu(const std::string& format, const Tensor& weight,
                                  const Tensor& scale, int64_t group_size,
                                  const OptionalTensor& zero_point, const OptionalTensor& g_idx,
                                  const OptionalTensor& bias, const std::string& kernel_set) {
  return translate_errors([&] {
    const auto f = w4a8moe::parse_checkpoint_format(format);
    Views v;
    const w4a8moe::CheckpointTensors w{v(weight, "w.weight"), v(scale, "w.scale"),
                                       v(zero_point, "w.zero_point"), v(g_idx, "w.g_idx"),
                                       v(bias, "w.bias")};
    return to_tensor(
        w4a8moe::pack_checkpoint_linear(f, w, checkpoint_options(group_size, kernel_set)));
  });
}

}  // namespace
}  // namespace w4a8moe_torch

TORCH_LIBRARY_FRAGMENT(w4a8moe, m) {
  m.def(
      "pack_checkpoint_moe(str format, Tensor w13_weight, Tensor w13_scale, Tensor w2_weight, "
      "Tensor w2_scale, int group_size, Tensor? w13_zero_point=None, "
      "Tensor? w2_zero_point=None, Tensor? w13_g_idx=None, Tensor? w2_g_idx=None, "
      "Tensor? w13_bias=None, Tensor? w2_bias=None, str gate_up_layout=\"halves\", "
      "str kernel_set=\"\", int[]? experts=None) -> (Tensor, Tensor)");
  m.def(
      "pack_checkpoint_linear(str format, Tensor weight, Tensor scale, int group_size, "
      "Tensor? zero_point=None, Tensor? g_idx=None, Tensor? bias=None, "
      "str kernel_set=\"\") -> Tensor");
}

TORCH_LIBRARY_IMPL(w4a8moe, CPU, m) {
  m.impl("pack_checkpoint_moe", &w4a8moe_torch::pack_checkpoint_moe_cpu);
  m.impl("pack_checkpoint_linear", &w4a8moe_torch::pack_checkpoint_linear_cpu);
}

// Not differentiable: the Autograd fallthrough of every op (torch_util.hpp).
TORCH_LIBRARY_IMPL(w4a8moe, W4A8MOE_TORCH_AUTOGRAD_KEY, m) {
  w4a8moe_torch::util::not_differentiable(m, {"pack_checkpoint_moe", "pack_checkpoint_linear"});
}
