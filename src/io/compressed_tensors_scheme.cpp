// The quantization_config of a compressed-tensors checkpoint (compressed_tensors_scheme.hpp).
#include "io/compressed_tensors_scheme.hpp"

#include <utility>
#include <vector>

#include "common/format.hpp"
#include "io/hf_config.hpp"

namespace w4a8moe::io {

using detail::cat;
using nlohmann::json;

CompressedTensorsScheme read_compressed_tensors_scheme(const std::string& folder, const json& q,
                                                       const std::string& module) {
  CompressedTensorsScheme out;
  const auto method = q.find("quant_method");
  if (method == q.end() || !method->is_string() ||
      method->get<std::string>() != "compressed-tensors")
    hf_fail(folder,
            cat("config.json quantization_config has quant_method ",
                method == q.end() ? std::string("(none)") : method->dump(),
                ": w4a8moe reads \"compressed-tensors\" checkpoints (and unquantized ones)"));
  if (const auto f = q.find("format"); f != q.end() && f->is_string())
    out.format = f->get<std::string>();
  const auto groups = q.find("config_groups");
  if (groups == q.end() || !groups->is_object() || groups->empty())
    hf_fail(folder, "config.json quantization_config has no config_groups");
  // The expert projections' group: the only group with weights; else the first whose targets
  // name "Linear" or expert 0's gate projection module; else, when every group with weights says
  // the same about them, any ("re:" targets are not evaluated: w4a8moe has no Python regexes).
  // The tensors' own shapes are checked against the choice.
  std::vector<std::pair<std::string, const json*>> with_weights;
  for (const auto& [gname, group] : groups->items()) {
    const auto w = group.find("weights");
    if (group.is_object() && w != group.end() && w->is_object())
      with_weights.emplace_back(gname, &group);
  }
  if (with_weights.empty())
    hf_fail(folder, "config.json quantization_config has no config group with 'weights'");
  const json* chosen = with_weights.size() == 1 ? with_weights.front().second : nullptr;
  for (size_t i = 0; chosen == nullptr && i < with_weights.size(); ++i) {
    const json& group = *with_weights[i].second;
    const auto targets = group.find("targets");
    if (targets == group.end() || !targets->is_array()) continue;
    for (const json& t : *targets)
      if (t.is_string() && (t.get<std::string>() == "Linear" || t.get<std::string>() == module))
        chosen = &group;
  }
  if (chosen == nullptr) {
    const auto settings = [](const json& group) {
      json s = group.at("weights");
      s.erase("observer");
      s.erase("observer_kwargs");
      return s.dump();
    };
    for (const auto& [gname, group] : with_weights)
      if (settings(*group) != settings(*with_weights.front().second))
        hf_fail(folder, cat("config.json quantization_config groups '", with_weights.front().first,
                            "' and '", gname,
                            "' quantize weights differently, and w4a8moe cannot tell "
                            "which one targets '",
                            module, "' (it does not evaluate \"re:\" targets)"));
    chosen = with_weights.front().second;
  }
  if (const auto f = chosen->find("format"); f != chosen->end() && f->is_string())
    out.format = f->get<std::string>();
  const auto w = chosen->find("weights");
  if (w == chosen->end() || !w->is_object())
    hf_fail(folder, "config.json quantization_config: the experts' config group has no 'weights'");
  const auto get = [&](const char* k) -> const json* {
    const auto it = w->find(k);
    return it == w->end() || it->is_null() ? nullptr : &*it;
  };
  const json* bits = get("num_bits");
  if (bits == nullptr || !bits->is_number_integer() || bits->get<int>() != 4)
    hf_fail(folder, cat("config.json quantization_config: weights num_bits must be 4, got ",
                        bits == nullptr ? std::string("(none)") : bits->dump(),
                        " (int4 weights are what w4a8moe runs without loss)"));
  if (const json* type = get("type");
      type != nullptr && (!type->is_string() || type->get<std::string>() != "int"))
    hf_fail(folder, cat("config.json quantization_config: weights type must be \"int\", got ",
                        type->dump()));
  if (const json* sym = get("symmetric"); sym != nullptr) {
    if (!sym->is_boolean())
      hf_fail(folder, cat("config.json quantization_config: weights symmetric must be true or "
                          "false, got ",
                          sym->dump()));
    out.symmetric = sym->get<bool>();
  }
  if (const json* strategy = get("strategy"); strategy != nullptr && strategy->is_string())
    out.strategy = strategy->get<std::string>();
  if (out.strategy != "group" && out.strategy != "channel" && out.strategy != "tensor")
    hf_fail(
        folder,
        cat("config.json quantization_config: weights strategy must be group, channel or tensor, "
            "got \"",
            out.strategy, "\""));
  if (const json* gs = get("group_size"); gs != nullptr && gs->is_number_integer())
    out.group_size = gs->get<int>();
  // actorder "group" scatters the groups over the inputs (weight_g_idx); "weight" reorders
  // only while quantizing and saves contiguous groups
  if (const json* order = get("actorder");
      order != nullptr && order->is_string() && order->get<std::string>() == "group")
    out.act_order = true;
  return out;
}

}  // namespace w4a8moe::io
