// The quantization_config of a GPTQ or AWQ checkpoint (gptq_scheme.hpp).
#include "io/gptq_scheme.hpp"

#include "common/format.hpp"
#include "io/hf_config.hpp"

namespace w4a8moe::io {

using detail::cat;
using nlohmann::json;

GptqScheme read_gptq_scheme(const std::string& folder, const json& q) {
  GptqScheme out;
  const auto field = [&](const char* key) -> const json* {
    const auto it = q.find(key);
    return it == q.end() || it->is_null() ? nullptr : &*it;
  };
  const auto text = [&](const char* key, const char* fallback) {
    const json* v = field(key);
    if (v == nullptr) return std::string(fallback);
    if (!v->is_string())
      hf_fail(folder,
              cat("config.json quantization_config ", key, " must be a string, got ", v->dump()));
    return v->get<std::string>();
  };
  const std::string method = text("quant_method", "");
  out.awq = method == "awq";
  const auto flag = [&](const char* key, bool fallback) {
    const json* v = field(key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean())
      hf_fail(folder, cat("config.json quantization_config ", key, " must be true or false, got ",
                          v->dump()));
    return v->get<bool>();
  };
  const json* bits = field(out.awq ? "w_bit" : "bits");
  if (bits == nullptr) bits = field("bits");
  if (bits == nullptr || !bits->is_number_integer() || bits->get<int>() != 4)
    hf_fail(folder, cat("config.json quantization_config (", method, "): bits must be 4, got ",
                        bits == nullptr ? std::string("(none)") : bits->dump()));
  const json* group = field(out.awq ? "q_group_size" : "group_size");
  if (group == nullptr) group = field("group_size");
  if (group == nullptr || !group->is_number_integer() ||
      (group->get<int>() != -1 && group->get<int>() < 1))
    hf_fail(folder, cat("config.json quantization_config (", method,
                        "): group_size must be -1 or positive, got ",
                        group == nullptr ? std::string("(none)") : group->dump()));
  out.group_size = group->get<int>();
  if (out.awq) {
    const std::string version = text("version", "gemm");
    if (version != "gemm" && version != "GEMM")
      hf_fail(folder, cat("config.json quantization_config: AWQ version \"", version,
                          "\" is not read (w4a8moe reads the \"gemm\" packing)"));
    if (!flag("zero_point", true))
      hf_fail(folder,
              "config.json quantization_config: AWQ without zero points (zero_point: false) is not "
              "read");
    return out;
  }
  out.symmetric = flag("sym", true);
  out.desc_act = flag("desc_act", false);
  const std::string format = text("checkpoint_format", "gptq");
  if (format != "gptq" && format != "gptq_v2")
    hf_fail(folder, cat("config.json quantization_config: GPTQ checkpoint_format \"", format,
                        "\" is not read (w4a8moe reads \"gptq\" and \"gptq_v2\")"));
  out.zeros_minus_one = format == "gptq";
  return out;
}

}  // namespace w4a8moe::io
