// config.json of a Hugging Face checkpoint folder (hf_config.hpp).
#include "io/hf_config.hpp"

#include <filesystem>
#include <fstream>

#include "common/format.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io {

using detail::cat;
using nlohmann::json;

void hf_fail(const std::string& folder, const std::string& problem) {
  throw Error(cat("checkpoint '", folder, "': ", problem));
}

json parse_hf_json(const std::string& folder, const char* name, std::istream& in) {
  try {
    return json::parse(in);
  } catch (const json::parse_error& e) {
    hf_fail(folder, cat(name, " is not valid JSON (error at byte ", e.byte, ")"));
  } catch (const json::exception&) {  // out_of_range: a number such as 1E400
    hf_fail(folder, cat(name, " is not valid JSON (a number out of range)"));
  }
}

HfConfig HfConfig::read(const std::string& folder) {
  HfConfig c;
  c.folder_ = folder;
  std::ifstream in(std::filesystem::path(folder) / "config.json");
  if (!in) hf_fail(folder, "config.json is missing");
  const json root = parse_hf_json(folder, "config.json", in);
  if (!root.is_object()) hf_fail(folder, "config.json is not a JSON object");
  c.config_ = root;
  if (const auto text = root.find("text_config"); text != root.end() && text->is_object()) {
    c.config_ = *text;  // multimodal models keep the language model's keys here
    if (!c.config_.contains("quantization_config") && root.contains("quantization_config"))
      c.config_["quantization_config"] = root["quantization_config"];
  }
  if (const json* t = c.value("model_type"); t != nullptr && t->is_string())
    c.model_type_ = t->get<std::string>();
  else if (const auto rt = root.find("model_type"); rt != root.end() && rt->is_string())
    c.model_type_ = rt->get<std::string>();
  if (c.model_type_.empty()) hf_fail(folder, "config.json has no 'model_type'");
  return c;
}

const json* HfConfig::value(const char* key) const {
  const auto it = config_.find(key);
  return it == config_.end() || it->is_null() ? nullptr : &*it;
}

int64_t HfConfig::integer(const char* key, bool required) const {
  const json* v = value(key);
  if (v == nullptr) {
    if (required) hf_fail(folder_, cat("config.json has no '", key, "'"));
    return -1;
  }
  if (!v->is_number_integer())
    hf_fail(folder_, cat("config.json '", key, "' must be an integer, got ", v->dump()));
  return v->get<int64_t>();
}

template <class T>
T HfConfig::typed(const char* key, T fallback, bool (json::*is)() const noexcept,
                  const char* expected) const {
  const json* v = value(key);
  if (v == nullptr) return fallback;
  if (!(v->*is)())
    hf_fail(folder_, cat("config.json '", key, "' must be ", expected, ", got ", v->dump()));
  return v->get<T>();
}

bool HfConfig::flag(const char* key, bool fallback) const {
  return typed(key, fallback, &json::is_boolean, "true or false");
}

double HfConfig::number(const char* key, double fallback) const {
  return typed(key, fallback, &json::is_number, "a number");
}

}  // namespace w4a8moe::io
