// w4a8moe check: what this CPU is, which kernel sets run on it, and whether a configuration is
// supported (exit 0) or not and why (exit 1).
#include <cstdio>
#include <string>

#include "w4a8moe/commands.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::cli {

int check_command(const CheckOptions& o) {
  std::printf("cpu: %s\n", cpu_features().summary().c_str());
  if (cpu_features().arch == "x86_64") std::printf("amx: %s\n", cpu_features().amx_status.c_str());
  std::string sets;
  for (const std::string& s : available_kernel_sets()) sets += (sets.empty() ? "" : ", ") + s;
  std::printf("kernel sets: %s\n", sets.c_str());
  std::printf("active kernel set: %s\n", active_kernel_set().c_str());
  if (!o.has_config) return 0;
  MoeConfig c;
  if (o.dtype == "f32")
    c.x_dtype = DType::f32;
  else if (o.dtype == "bf16")
    c.x_dtype = DType::bf16;
  else if (o.dtype == "f16")
    c.x_dtype = DType::f16;
  else
    throw Error("--dtype: expected f32, bf16 or f16, got '" + o.dtype + "'");
  c.hidden = o.hidden;
  c.inter = o.inter;
  c.experts = o.experts;
  c.top_k = o.top_k;
  c.group_size = o.group;
  c.activation = static_cast<int64_t>(parse_activation(o.activation));
  const Support s = is_supported_config(c);
  std::printf("config: x %s, H %lld, I %lld, E %lld, top-k %lld, group %lld, %s: %s%s\n",
              o.dtype.c_str(), o.hidden, o.inter, o.experts, o.top_k, o.group, o.activation.c_str(),
              s.supported ? "supported" : "not supported: ", s.reason.c_str());
  return s.supported ? 0 : 1;
}

}  // namespace w4a8moe::cli
