// A Hugging Face checkpoint folder's config.json: the language model's keys (a multimodal
// model's text_config, with the root's quantization_config when it has none) and typed lookups.
#pragma once

#include <cstdint>
#include <istream>
#include <nlohmann/json.hpp>
#include <string>

namespace w4a8moe::io {

// Throws Error "checkpoint '<folder>': <problem>".
[[noreturn]] void hf_fail(const std::string& folder, const std::string& problem);

// The JSON in `in`, the folder's file `name`; throws Error naming the folder and the file when it
// is not valid JSON.
nlohmann::json parse_hf_json(const std::string& folder, const char* name, std::istream& in);

class HfConfig {
 public:
  // Reads <folder>/config.json; throws Error naming the folder when it is missing, not a JSON
  // object or has no model_type.
  static HfConfig read(const std::string& folder);

  const std::string& model_type() const noexcept { return model_type_; }
  // The value of a key, or nullptr when absent or null.
  const nlohmann::json* value(const char* key) const;
  // An integer; -1 when absent and not required. Throws Error when absent and required, or not
  // an integer.
  int64_t integer(const char* key, bool required) const;
  // A boolean or number, `fallback` when absent; Error when of another type.
  bool flag(const char* key, bool fallback) const;
  double number(const char* key, double fallback) const;

 private:
  // The value of a key `is` accepts, or `fallback` when absent; Error naming `expected` else.
  template <class T>
  T typed(const char* key, T fallback, bool (nlohmann::json::*is)() const noexcept,
          const char* expected) const;
  std::string folder_;
  nlohmann::json config_;  // config.json (or its text_config)
  std::string model_type_;
};

}  // namespace w4a8moe::io
