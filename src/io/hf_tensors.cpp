// The safetensors files of a Hugging Face checkpoint folder (hf_tensors.hpp).
#include "io/hf_tensors.hpp"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/format.hpp"
#include "common/numeric.hpp"
#include "io/hf_config.hpp"

namespace w4a8moe::io {

using detail::cat;
using nlohmann::json;
namespace fs = std::filesystem;

HfTensors::HfTensors(std::string folder) : folder_(std::move(folder)) {
  const fs::path index = fs::path(folder_) / "model.safetensors.index.json";
  if (fs::exists(index)) {
    std::ifstream in(index);
    const json j = parse_hf_json(folder_, "model.safetensors.index.json", in);
    const auto map = j.find("weight_map");
    if (!j.is_object() || map == j.end() || !map->is_object())
      hf_fail(folder_, "model.safetensors.index.json has no 'weight_map' object");
    for (const auto& [tensor, file] : map->items()) {
      if (!file.is_string())
        hf_fail(folder_, cat("model.safetensors.index.json maps '", tensor, "' to ", file.dump(),
                             ", not a file name"));
      const std::string f = file.get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
        hf_fail(folder_, cat("model.safetensors.index.json maps '", tensor, "' to '", f,
                             "', not a file of the folder"));
      weight_map_.emplace(tensor, f);
    }
    if (weight_map_.empty())
      hf_fail(folder_, "model.safetensors.index.json has an empty weight_map");
  } else if (fs::exists(fs::path(folder_) / "model.safetensors")) {
    single_file_ = "model.safetensors";
  } else {
    hf_fail(folder_, "neither model.safetensors nor model.safetensors.index.json is there");
  }
}

bool HfTensors::has(const std::string& name) const {
  if (!weight_map_.empty()) return weight_map_.count(name) != 0;
  return shard_of(name).contains(name);
}

const MappedSafetensors& HfTensors::shard_of(const std::string& name) const {
  std::string file = single_file_;
  if (!weight_map_.empty()) {
    const auto it = weight_map_.find(name);
    if (it == weight_map_.end())
      hf_fail(folder_, cat("tensor '", name, "' is missing (not in model.safetensors.index.json)"));
    file = it->second;
  }
  std::lock_guard lock(mutex_);
  auto& slot = shards_[file];
  if (!slot)
    slot = std::make_unique<MappedSafetensors>(
        MappedSafetensors::open((fs::path(folder_) / file).string()));
  if (!weight_map_.empty() && !slot->contains(name))
    hf_fail(folder_, cat("tensor '", name, "' is listed in model.safetensors.index.json under '",
                         file, "', which does not hold it"));
  return *slot;
}

std::vector<float> HfTensors::read_floats(const std::string& name) const {
  const MappedSafetensors& f = shard_of(name);
  if (!f.contains(name)) hf_fail(folder_, cat("tensor '", name, "' is missing"));
  const TensorEntry& e = f.entry(name);
  if (!detail::is_float_dtype(e.dtype))
    hf_fail(folder_, cat("tensor '", name, "' must be F32, BF16 or F16, got ",
                         safetensors_dtype_name(e.dtype)));
  const std::span<const uint8_t> b = f.bytes(name);
  std::vector<float> out(b.size() / dtype_bytes(e.dtype));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = detail::load_float(b.data(), e.dtype, static_cast<int64_t>(i));
  return out;
}

}  // namespace w4a8moe::io
