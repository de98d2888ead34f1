// The PyTorch binding: the w4a8moe library as torch ops (namespace `w4a8moe`), with CPU kernels
// and Meta kernels (shapes and dtypes only, for meta tensors, FakeTensorMode and graph capture).
// The Python package loads this module with torch.ops.load_library: no Python headers, no
// pybind11. Every library error (w4a8moe::Error) is raised as a torch error (RuntimeError in
// Python) carrying the library's sentence.
//
// Ops (schemas at the registration, end of file):
//   dynamic_4bit_int_moe          vLLM's CPU op's schema and meaning
//   dynamic_4bit_int_moe_ex       the same plus alpha and limit (SWIGLUOAI / SWIGLUSTEP)
//   convert_to_w4a8_int8_moe_format     logical int4 weights -> (w13_packed, w2_packed) uint8
//   convert_to_w4a8_int8_moe_format_ex  the same plus gate/up layout, scale storage, kernel set
//   packed_info                   the decoded header of a packed tensor
//   is_supported_config, set_num_threads, get_num_threads, active_kernel_set,
//   available_kernel_sets, set_isa_cap, cpu_features
// Fragments of the same library: torch_routed_ops.cpp (moe_routed: router logits in, the top-k
// inside the op), torch_ep_ops.cpp (expert parallelism), torch_linear_ops.cpp (dense layers).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

// Only the public API: the meta kernel of the packing op asks the library for the packed size
// (w4a8moe::packed_size, the packer's own geometry), so the two can never disagree.
#include "torch_packed_headers.hpp"
#include "torch_threads.hpp"
#include "torch_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe_torch {
namespace {

using at::Tensor;
using w4a8moe::DType;

using util::bytes_of;
using util::moe_params;
using util::to_dtype;
using util::to_tensor;
using util::translate_errors;
using util::view_of;
using util::with_format_of;
using util::with_input_order;

// ---------------------------------------------------------------------------------------------
// The forward op

using headers::Sizes;

// Shape and dtype checks shared by the CPU and the Meta kernels; returns the output's shape.
std::array<int64_t, 2> infer_output(const Tensor& x, const Tensor& topk_ids,
                                    const Tensor& topk_weights, const Sizes& s,
                                    int64_t activation_kind) {
  return translate_errors([&] {
    w4a8moe::activation_from_code(activation_kind);
    TORCH_CHECK(x.dim() == 2, "x: expected rank 2 [T, H], got shape ", x.sizes());
    TORCH_CHECK(x.size(1) == s.hidden, "x: expected ", s.hidden,
                " columns (hidden_size), got shape ", x.sizes());
    TORCH_CHECK(topk_weights.scalar_type() == at::kFloat ||
                    topk_weights.scalar_type() == at::kBFloat16 ||
                    topk_weights.scalar_type() == at::kHalf,
                "topk_weights: expected dtype float32, bfloat16 or float16, got ",
                topk_weights.scalar_type());
    TORCH_CHECK(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong,
                "topk_ids: expected dtype int32 or int64, got ", topk_ids.scalar_type());
    if (x.size(0) == 0) {  // an empty batch: nothing to compute
      TORCH_CHECK(
          topk_ids.dim() == 2 && topk_ids.size(0) == 0 && topk_weights.sizes() == topk_ids.sizes(),
          "topk_ids, topk_weights: expected shape [0, K] for an empty x, got ", topk_ids.sizes(),
          " and ", topk_weights.sizes());
      return std::array<int64_t, 2>{0, s.hidden};
    }
    const auto spec = w4a8moe::infer_output(x.sizes().vec(), to_dtype(x.scalar_type(), "x"),
                                            topk_ids.sizes().vec(), topk_weights.sizes().vec());
    return spec.shape;
  });
}

// The original op's schema (dynamic_4bit_int_moe): the _ex op with the default alpha and limit.
template <Tensor (*Ex)(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       int64_t, int64_t, int64_t, bool, int64_t, double, double)>
Tensor with_default_alpha_limit(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                                const Tensor& w13_packed, const Tensor& w2_packed,
                                int64_t hidden_size, int64_t intermediate_size, int64_t group_size,
                                bool apply_router_weight_on_input, int64_t activation_kind) {
  const w4a8moe::MoeParams defaults;
  return Ex(x, topk_ids, topk_weights, w13_packed, w2_packed, hidden_size, intermediate_size,
            group_size, apply_router_weight_on_input, activation_kind,
            static_cast<double>(defaults.alpha), static_cast<double>(defaults.limit));
}

Tensor moe_ex_cpu(const Tensor& x_in, const Tensor& topk_ids_in, const Tensor& topk_weights_in,
                  const Tensor& w13_packed, const Tensor& w2_packed, int64_t hidden_size,
                  int64_t intermediate_size, int64_t group_size, bool apply_router_weight_on_input,
                  int64_t activation_kind, double alpha, double limit) {
  const Sizes sizes{hidden_size, intermediate_size, group_size};
  return translate_errors([&] {
    const headers::Packed packed = headers::checked_packed(w13_packed, w2_packed, sizes);
    const auto shape = infer_output(x_in, topk_ids_in, topk_weights_in, sizes, activation_kind);
    Tensor out = at::empty({shape[0], shape[1]}, x_in.options());
    if (shape[0] == 0) return out;

    Tensor x = x_in;
    Tensor topk_ids = topk_ids_in.contiguous();
    Tensor topk_weights = topk_weights_in.contiguous();
    const w4a8moe::MoeParams params =
        moe_params(apply_router_weight_on_input, activation_kind, alpha, limit);
    const w4a8moe::TensorView xv = view_of(x, "x", /*rows_strided=*/true);
    const w4a8moe::TensorView ids = view_of(topk_ids, "topk_ids");
    const w4a8moe::TensorView weights = view_of(topk_weights, "topk_weights");
    const auto ov = w4a8moe::MutableTensorView::of(out.data_ptr(), xv.dtype, {shape[0], shape[1]});

    threads::with_context([&](w4a8moe::Context& context) {
      w4a8moe::forward(context, xv, ids, weights, packed.w13, packed.w2, params, ov);
    });
    return out;
  });
}

#if TORCH_VERSION_MAJOR < 2  // torch 2: w4a8moe/_fake.py
Tensor moe_ex_meta(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                   const Tensor& w13_packed, const Tensor& w2_packed, int64_t hidden_size,
                   int64_t intermediate_size, int64_t group_size, bool apply_router_weight_on_input,
                   int64_t activation_kind, double alpha, double limit) {
  const Sizes sizes{hidden_size, intermediate_size, group_size};
  headers::check_meta_packed(w13_packed, w2_packed, sizes);
  const auto shape = infer_output(x, topk_ids, topk_weights, sizes, activation_kind);
  translate_errors([&] {
    w4a8moe::check_moe_params(
        moe_params(apply_router_weight_on_input, activation_kind, alpha, limit));
  });
  return at::empty({shape[0], shape[1]}, x.options());
}

#endif

// ---------------------------------------------------------------------------------------------
// The packing op

w4a8moe::PackOptions pack_options(int64_t group_size, const std::string& gate_up_layout,
                                  const std::string& scale_storage, const std::string& kernel_set) {
  w4a8moe::PackOptions o;
  TORCH_CHECK(group_size >= INT32_MIN && group_size <= INT32_MAX,
              "group_size: expected -1 or a multiple of 32, got ", group_size);
  o.group_size = static_cast<int>(group_size);
  if (gate_up_layout == "halves")
    o.gate_up_layout = w4a8moe::GateUpLayout::halves;
  else if (gate_up_layout == "interleaved")
    o.gate_up_layout = w4a8moe::GateUpLayout::interleaved;
  else
    TORCH_CHECK(false, "gate_up_layout: expected 'halves' or 'interleaved', got '", gate_up_layout,
                "'");
  if (scale_storage == "as_given")
    o.scale_storage = w4a8moe::ScaleStorage::as_given;
  else if (scale_storage == "bf16")
    o.scale_storage = w4a8moe::ScaleStorage::bf16;
  else
    TORCH_CHECK(false, "scale_storage: expected 'as_given' or 'bf16', got '", scale_storage, "'");
  o.kernel_set = kernel_set;
  return o;
}

// w13 [E, 2I, H] and w2 [E, H, I] (int8), or nibble-packed uint8 with half the last dimension.
struct LogicalShape {
  int64_t experts, hidden, inter;
};

LogicalShape check_weight_shapes(const Tensor& w13, const Tensor& w2) {
  for (const auto& [t, name] : {std::pair{&w13, "w13_weight"}, std::pair{&w2, "w2_weight"}}) {
    TORCH_CHECK(t->dim() == 3, name, ": expected rank 3, got shape ", t->sizes());
    TORCH_CHECK(t->scalar_type() == at::kChar || t->scalar_type() == at::kByte, name,
                ": expected dtype int8 (int4 values) or uint8 (nibble-packed), got ",
                t->scalar_type());
  }
  const auto cols = [](const Tensor& t) {
    return t.size(2) * (t.scalar_type() == at::kByte ? 2 : 1);
  };
  TORCH_CHECK(w4a8moe::is_valid_w13_rows(w13.size(1)),
              "w13_weight: expected an even number of rows (2I), got shape ", w13.sizes());
  const LogicalShape s{w13.size(0), cols(w13), w13.size(1) / 2};
  TORCH_CHECK(w2.size(0) == s.experts && w2.size(1) == s.hidden && cols(w2) == s.inter,
              "w2_weight: expected ", s.experts, " experts of [", s.hidden, ", ", s.inter,
              "] (from w13_weight ", w13.sizes(), "), got shape ", w2.sizes(),
              w2.scalar_type() == at::kByte ? " (nibble-packed)" : "");
  return s;
}

// The arguments of the _ex op, the weights' shapes checked and the pack options built.
struct PackArgs {
  const Tensor& w13_weight;
  const Tensor& w2_weight;
  const Tensor& w13_weight_scale;
  const Tensor& w2_weight_scale;
  const c10::optional<Tensor>& w13_bias;
  const c10::optional<Tensor>& w2_bias;
  const c10::optional<Tensor>& w13_zero_point;
  const c10::optional<Tensor>& w2_zero_point;
  const c10::optional<Tensor>& w13_input_order;
  LogicalShape shape;
  w4a8moe::PackOptions options;
};

// The _ex op; `Pack` packs (CPU) or gives the packed sizes (meta).
template <std::tuple<Tensor, Tensor> (*Pack)(const PackArgs&)>
std::tuple<Tensor, Tensor> pack_ex(const Tensor& w13_weight, const Tensor& w2_weight,
                                   const Tensor& w13_weight_scale, const Tensor& w2_weight_scale,
                                   int64_t group_size, const c10::optional<Tensor>& w13_bias,
                                   const c10::optional<Tensor>& w2_bias, std::string gate_up_layout,
                                   std::string scale_storage, std::string kernel_set,
                                   const c10::optional<Tensor>& w13_weight_zero_point,
                                   const c10::optional<Tensor>& w2_weight_zero_point,
                                   const c10::optional<Tensor>& w13_input_order) {
  return translate_errors([&] {
    const LogicalShape s = check_weight_shapes(w13_weight, w2_weight);
    return Pack(PackArgs{w13_weight, w2_weight, w13_weight_scale, w2_weight_scale, w13_bias,
                         w2_bias, w13_weight_zero_point, w2_weight_zero_point, w13_input_order, s,
                         pack_options(group_size, gate_up_layout, scale_storage, kernel_set)});
  });
}

std::tuple<Tensor, Tensor> pack_on_cpu(const PackArgs& a) {
  // Views of contiguous copies (no copy when already contiguous), alive until packing ends.
  std::vector<Tensor> keep;
  auto view = [&](const Tensor& t, const char* name) {
    keep.push_back(t.contiguous());
    return view_of(keep.back(), name);
  };
  auto optional_view = [&](const c10::optional<Tensor>& t, const char* name) {
    return t.has_value() && t->defined() ? view(*t, name) : w4a8moe::TensorView{};
  };
  keep.reserve(8);
  const auto w13 = view(a.w13_weight, "w13_weight");
  const auto s13 = view(a.w13_weight_scale, "w13_weight_scale");
  const auto z13 = optional_view(a.w13_zero_point, "w13_weight_zero_point");
  const auto b13 = optional_view(a.w13_bias, "w13_bias");
  const auto w2 = view(a.w2_weight, "w2_weight");
  const auto s2 = view(a.w2_weight_scale, "w2_weight_scale");
  const auto z2 = optional_view(a.w2_zero_point, "w2_weight_zero_point");
  const auto b2 = optional_view(a.w2_bias, "w2_bias");
  Tensor order;
  Tensor p13 = to_tensor(w4a8moe::pack_w13(
      w13, s13, z13, b13,
      with_input_order(with_format_of(a.options, a.w13_weight_scale, a.w13_zero_point),
                       a.w13_input_order, order, false)));
  w4a8moe::PackOptions w2_options = with_format_of(a.options, a.w2_weight_scale, a.w2_zero_point);
  w2_options.gate_up_layout = w4a8moe::GateUpLayout::halves;
  Tensor p2 = to_tensor(w4a8moe::pack_w2(w2, s2, z2, b2, w2_options));
  return std::make_tuple(p13, p2);
}

// The packed sizes from shapes and dtypes alone.
std::tuple<Tensor, Tensor> packed_sizes(const PackArgs& a) {
  const LogicalShape& s = a.shape;
  auto bytes = [&](w4a8moe::WeightRole role, int64_t rows, int64_t cols, const Tensor& scale,
                   const c10::optional<Tensor>& zero_point, const c10::optional<Tensor>& bias,
                   const char* name) {
    const DType given = to_dtype(scale.scalar_type(), name);
    const bool has_bias = bias.has_value() && bias->defined();
    Tensor unused;
    const w4a8moe::PackOptions options = with_input_order(
        with_format_of(a.options, scale, zero_point),
        role == w4a8moe::WeightRole::w13 ? a.w13_input_order : c10::nullopt, unused, true);
    return static_cast<int64_t>(
        w4a8moe::packed_size(role, s.experts, rows, cols, given, has_bias, options, name));
  };
  const auto o = a.w13_weight.options().dtype(at::kByte);
  return std::make_tuple(
      at::empty({bytes(w4a8moe::WeightRole::w13, 2 * s.inter, s.hidden, a.w13_weight_scale,
                       a.w13_zero_point, a.w13_bias, "w13_weight_scale")},
                o),
      at::empty({bytes(w4a8moe::WeightRole::w2, s.hidden, s.inter, a.w2_weight_scale,
                       a.w2_zero_point, a.w2_bias, "w2_weight_scale")},
                o));
}

// The original op's schema (convert_to_w4a8_int8_moe_format): the _ex op with halves, the scales
// as given and the kernel set forward() picks.
template <std::tuple<Tensor, Tensor> (*Ex)(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
    const c10::optional<Tensor>&, const c10::optional<Tensor>&, std::string, std::string,
    std::string, const c10::optional<Tensor>&, const c10::optional<Tensor>&,
    const c10::optional<Tensor>&)>
std::tuple<Tensor, Tensor> with_default_pack_options(
    const Tensor& w13_weight, const Tensor& w2_weight, const Tensor& w13_weight_scale,
    const Tensor& w2_weight_scale, int64_t group_size, const c10::optional<Tensor>& w13_bias,
    const c10::optional<Tensor>& w2_bias) {
  return Ex(w13_weight, w2_weight, w13_weight_scale, w2_weight_scale, group_size, w13_bias, w2_bias,
            "halves", "as_given", "", c10::nullopt, c10::nullopt, c10::nullopt);
}

// ---------------------------------------------------------------------------------------------
// Companions

using InfoTuple = std::tuple<int64_t, std::string, std::string, int64_t, int64_t, int64_t, int64_t,
                             std::string, bool, int64_t, int64_t, std::string, bool>;

InfoTuple packed_info_cpu(const Tensor& packed) {
  return translate_errors([&] {
    const auto i = w4a8moe::inspect_packed(bytes_of(packed, "packed"), "packed");
    return InfoTuple{i.version,
                     i.layout,
                     i.role == w4a8moe::WeightRole::w13 ? "w13" : "w2",
                     i.experts,
                     i.rows,
                     i.cols,
                     i.group_size,
                     w4a8moe::dtype_name(i.scale_dtype),
                     i.has_bias,
                     static_cast<int64_t>(i.expert_bytes),
                     static_cast<int64_t>(i.total_bytes),
                     w4a8moe::weight_format_name(i.weight_format),
                     i.has_input_order};
  });
}

InfoTuple packed_info_meta(const Tensor&) {
  TORCH_CHECK(false,
              "packed: packed_info reads the packed header, and a meta or fake tensor has no "
              "data; pass hidden_size, intermediate_size and group_size explicitly");
}

std::tuple<bool, std::string> is_supported_config(at::ScalarType dtype, int64_t hidden_size,
                                                  int64_t intermediate_size, int64_t num_experts,
                                                  int64_t top_k, int64_t group_size,
                                                  int64_t activation_kind) {
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf)
    return {false, std::string("x dtype ") + c10::toString(dtype) +
                       " is not supported; use float32, bfloat16 or float16 activations"};
  const w4a8moe::MoeConfig c{
      to_dtype(dtype, "dtype"), hidden_size, intermediate_size, num_experts, top_k, group_size,
      activation_kind};
  const w4a8moe::Support s = w4a8moe::is_supported_config(c);
  return {s.supported, s.reason};
}

void set_num_threads(int64_t threads) {
  constexpr int kMax = w4a8moe::Context::kMaxThreads;
  TORCH_CHECK(threads >= 0 && threads <= kMax,
              "threads: expected 0 (PyTorch's intra-op threads) or a count in [1, ", kMax,
              "], got ", threads);
  threads::g_own_threads.store(threads, std::memory_order_relaxed);
}

int64_t get_num_threads() { return threads::wanted_threads(); }

int64_t torch_threads_used() { return threads::g_torch_threads_used.load(); }

std::string active_kernel_set() { return w4a8moe::active_kernel_set(); }

std::vector<std::string> available_kernel_sets() { return w4a8moe::available_kernel_sets(); }

void set_isa_cap(std::string name) {
  translate_errors([&] { w4a8moe::set_isa_cap(name); });
}

std::string cpu_features() { return w4a8moe::cpu_features().summary(); }

// The kernels of one dispatch key (CPU, Meta): each _ex op, and the original schema on top of it.
template <auto MoeEx>
void impl_forward_ops(torch::Library& m) {
  m.impl("dynamic_4bit_int_moe", &with_default_alpha_limit<MoeEx>);
  m.impl("dynamic_4bit_int_moe_ex", MoeEx);
}

template <auto PackEx, auto Info>
void impl_packing_ops(torch::Library& m) {
  m.impl("convert_to_w4a8_int8_moe_format", &with_default_pack_options<PackEx>);
  m.impl("convert_to_w4a8_int8_moe_format_ex", PackEx);
  m.impl("packed_info", Info);
}

}  // namespace
}  // namespace w4a8moe_torch

// ---------------------------------------------------------------------------------------------
// Registration

TORCH_LIBRARY(w4a8moe, m) {
  m.def(
      "dynamic_4bit_int_moe(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_packed, "
      "Tensor w2_packed, int hidden_size, int intermediate_size, int group_size, "
      "bool apply_router_weight_on_input, int activation_kind) -> Tensor");
  m.def(
      "dynamic_4bit_int_moe_ex(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_packed, "
      "Tensor w2_packed, int hidden_size, int intermediate_size, int group_size, "
      "bool apply_router_weight_on_input, int activation_kind, float alpha=1.702, "
      "float limit=7.0) -> Tensor");
  m.def(
      "convert_to_w4a8_int8_moe_format(Tensor w13_weight, Tensor w2_weight, "
      "Tensor w13_weight_scale, Tensor w2_weight_scale, int group_size, Tensor? w13_bias=None, "
      "Tensor? w2_bias=None) -> (Tensor, Tensor)");
  m.def(
      "convert_to_w4a8_int8_moe_format_ex(Tensor w13_weight, Tensor w2_weight, "
      "Tensor w13_weight_scale, Tensor w2_weight_scale, int group_size, Tensor? w13_bias=None, "
      "Tensor? w2_bias=None, str gate_up_layout=\"halves\", str scale_storage=\"as_given\", "
      "str kernel_set=\"\", Tensor? w13_weight_zero_point=None, "
      "Tensor? w2_weight_zero_point=None, Tensor? w13_input_order=None) -> (Tensor, Tensor)");
  m.def(
      "packed_info(Tensor packed) -> (int version, str layout, str role, int experts, int rows, "
      "int cols, int group_size, str scale_dtype, bool has_bias, int expert_bytes, "
      "int total_bytes, str weight_format, bool has_input_order)");
  m.def(
      "is_supported_config(ScalarType dtype, int hidden_size, int intermediate_size, "
      "int num_experts, int top_k, int group_size, int activation_kind) -> (bool, str)",
      &w4a8moe_torch::is_supported_config);
  m.def("set_num_threads(int threads) -> ()", &w4a8moe_torch::set_num_threads);
  m.def("get_num_threads() -> int", &w4a8moe_torch::get_num_threads);
  m.def("_torch_threads_used() -> int", &w4a8moe_torch::torch_threads_used);
  m.def("active_kernel_set() -> str", &w4a8moe_torch::active_kernel_set);
  m.def("available_kernel_sets() -> str[]", &w4a8moe_torch::available_kernel_sets);
  m.def("set_isa_cap(str name) -> ()", &w4a8moe_torch::set_isa_cap);
  m.def("cpu_features() -> str", &w4a8moe_torch::cpu_features);
}

TORCH_LIBRARY_IMPL(w4a8moe, CPU, m) {
  w4a8moe_torch::impl_forward_ops<&w4a8moe_torch::moe_ex_cpu>(m);
  w4a8moe_torch::impl_packing_ops<&w4a8moe_torch::pack_ex<&w4a8moe_torch::pack_on_cpu>,
                                  &w4a8moe_torch::packed_info_cpu>(m);
}

// The forward ops' shape functions: here for torch 1.x; torch 2 gets them from Python
// (w4a8moe/_fake.py, torch.library.register_fake, which also serves meta tensors), where the
// token count can stay symbolic under torch.compile: these C++ ones read concrete sizes, which
// would specialise a compiled graph to one batch size.
#if TORCH_VERSION_MAJOR < 2
TORCH_LIBRARY_IMPL(w4a8moe, Meta, m) {
  w4a8moe_torch::impl_forward_ops<&w4a8moe_torch::moe_ex_meta>(m);
}
#endif

TORCH_LIBRARY_IMPL(w4a8moe, Meta, m) {
  w4a8moe_torch::impl_packing_ops<&w4a8moe_torch::pack_ex<&w4a8moe_torch::packed_sizes>,
                                  &w4a8moe_torch::packed_info_meta>(m);
}

// The ops have no derivative (torch_util.hpp says why every op registers this fallthrough).
TORCH_LIBRARY_IMPL(w4a8moe, W4A8MOE_TORCH_AUTOGRAD_KEY, m) {
  w4a8moe_torch::util::not_differentiable(
      m, {"dynamic_4bit_int_moe", "dynamic_4bit_int_moe_ex", "convert_to_w4a8_int8_moe_format",
          "convert_to_w4a8_int8_moe_format_ex", "packed_info"});
}
