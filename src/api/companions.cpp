// The capability check and shape inference (docs/operator.md, "Companions"): no data, no
// computation; and the kernel set that reads a layout.
#include <string>
#include <string_view>

#include "common/argument_checks.hpp"
#include "common/format.hpp"
#include "common/numeric.hpp"
#include "pack/packed_format.hpp"
#include "registry.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe {

Support is_supported_config(const MoeConfig& c) noexcept {
  try {
    using detail::cat;
    auto no = [](std::string reason) { return Support{false, std::move(reason)}; };
    if (!detail::is_float_dtype(c.x_dtype))
      return no(cat("x dtype ", dtype_name(c.x_dtype),
                    " is not supported; use f32, bf16 or f16 activations"));
    if (c.hidden < 1 || c.inter < 1 || c.experts < 1 || c.top_k < 1)
      return no(cat("hidden (", c.hidden, "), intermediate (", c.inter, "), experts (", c.experts,
                    ") and top_k (", c.top_k, ") must all be positive"));
    if (c.hidden > detail::kMaxCols || c.inter > detail::kMaxCols)
      return no(cat("hidden (", c.hidden, ") and intermediate (", c.inter, ") sizes above ",
                    detail::kMaxCols, " are not supported"));
    if (c.experts > UINT32_MAX || 2 * c.inter > UINT32_MAX)
      return no(cat("experts (", c.experts, ") and 2 x intermediate must fit in 32 bits"));
    if (c.local_experts < 0 || c.local_experts > c.experts)
      return no(cat("local experts (", c.local_experts, ") must be 0 (all) or 1 to experts (",
                    c.experts, "): a process holds some of the layer's experts"));
    if (!is_valid_activation_code(c.activation))
      return no(cat("activation code ", c.activation,
                    " is unknown; use 0 swiglustep, 1 swigluoai, 2 silu, 3 gelu or 4 gelu_tanh"));
    if (c.group_size != -1) {
      if (!is_valid_group_size(c.group_size))
        return no(cat("group size ", c.group_size,
                      " is not supported; use -1 (channelwise) or a multiple of 32"));
      if (!group_size_fits(c.group_size, c.hidden) || !group_size_fits(c.group_size, c.inter))
        return no(cat("group size ", c.group_size, " must divide both hidden (", c.hidden,
                      ") and intermediate (", c.inter,
                      ") sizes; use a divisor of both or -1 (channelwise)"));
    }
    if (!detail::is_known_weight_format(static_cast<uint32_t>(c.weight_format)))
      return no(cat("weight format ", static_cast<uint32_t>(c.weight_format),
                    " is unknown; use 0 int4_symmetric, 1 int4_zero_point or 2 mxfp4"));
    if (c.weight_format == WeightFormat::int8)
      return no(
          "weight format int8 is a dense linear layer's (pack_linear and linear()), not an "
          "MoE layer's; use int4_symmetric, int4_zero_point or mxfp4");
    if (c.weight_format == WeightFormat::mxfp4 && c.group_size != 32)
      return no(cat("mxfp4 weights have one scale per 32 elements: use group size 32, not ",
                    c.group_size));
    (void)detail::active_set();  // a portable set always exists
    return Support{true, {}};
  } catch (const std::exception& e) {
    return Support{false, e.what()};
  } catch (...) {
    return Support{false, "unexpected failure while checking the configuration"};
  }
}

std::string kernel_set_for_layout(std::string_view layout) {
  for (const detail::KernelSet& k : detail::kernel_table())
    for (const detail::LayoutId id : {k.layout, k.int8_layout})
      if (layout == detail::layout_name(id)) return detail::set_for_layout(id, "layout").name;
  throw Error(
      detail::cat("layout: expected the layout of a kernel set of this build, got '", layout, "'"));
}

void check_moe_params(const MoeParams& params) { detail::check_params(params); }

OutputSpec infer_output(std::span<const int64_t> x_shape, DType x_dtype,
                        std::span<const int64_t> topk_ids_shape,
                        std::span<const int64_t> topk_weights_shape) {
  using detail::cat;
  auto str = [](std::span<const int64_t> s) {
    std::string r = "[";
    for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + "]";
  };
  if (!detail::is_float_dtype(x_dtype))
    throw Error(cat("x: expected dtype f32, bf16 or f16, got ", dtype_name(x_dtype)));
  if (x_shape.size() != 2 || x_shape[0] < 0 || x_shape[1] < 1)
    throw Error(cat("x: expected shape [T, H] with T >= 0 and H >= 1, got ", str(x_shape)));
  if (topk_ids_shape.size() != 2 || topk_ids_shape[0] != x_shape[0] || topk_ids_shape[1] < 1)
    throw Error(cat("topk_ids: expected shape [", x_shape[0], ", K], got ", str(topk_ids_shape)));
  if (topk_weights_shape.size() != 2 || topk_weights_shape[0] != topk_ids_shape[0] ||
      topk_weights_shape[1] != topk_ids_shape[1])
    throw Error(cat("topk_weights: expected shape ", str(topk_ids_shape), ", got ",
                    str(topk_weights_shape)));
  return OutputSpec{{x_shape[0], x_shape[1]}, x_dtype};
}

}  // namespace w4a8moe
