// The loader of w4a8moe case files.
#include "io/case_file.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <system_error>
#include <utility>

#include "common/format.hpp"

namespace w4a8moe::io {

namespace {

using detail::cat;

// Strict number parsing for metadata values: the whole string, nothing else.
std::optional<int64_t> parse_int(std::string_view text) {
  int64_t value = 0;
  const char* first = text.data();
  const char* last = first + text.size();
  const auto [ptr, ec] = std::from_chars(first, last, value);
  if (text.empty() || ec != std::errc() || ptr != last) return std::nullopt;
  return value;
}

std::optional<float> parse_float(std::string_view text) {
  float value = 0;
  const char* first = text.data();
  const char* last = first + text.size();
  const auto [ptr, ec] = std::from_chars(first, last, value);
  if (text.empty() || ec != std::errc() || ptr != last || !std::isfinite(value))
    return std::nullopt;
  return value;
}

[[noreturn]] void case_fail(const std::string& path, const std::string& problem) {
  throw Error(cat("case file '", path, "': ", problem));
}

bool is_float(DType d) { return d == DType::f32 || d == DType::bf16 || d == DType::f16; }

// A view of a required (or, with `optional`, possibly absent) tensor, checked for rank and
// dtype class.
TensorView case_tensor(const SafetensorsFile& file, const char* name,
                       std::initializer_list<int> ranks, const char* dtypes_text,
                       bool (*dtype_ok)(DType), bool optional = false) {
  if (!file.contains(name)) {
    if (optional) return {};
    case_fail(file.path(), cat("tensor '", name, "' is missing"));
  }
  const TensorEntry& e = file.entry(name);
  const int rank = static_cast<int>(e.shape.size());
  if (std::find(ranks.begin(), ranks.end(), rank) == ranks.end()) {
    std::string expected;
    for (const int r : ranks) expected += (expected.empty() ? "" : " or ") + std::to_string(r);
    case_fail(file.path(), cat("tensor '", name, "' must have rank ", expected, ", got shape ",
                               shape_string(e.shape)));
  }
  if (!dtype_ok(e.dtype))
    case_fail(file.path(), cat("tensor '", name, "' must have dtype ", dtypes_text, ", got ",
                               safetensors_dtype_name(e.dtype)));
  return file.view(name);
}

const std::string* find_meta(const Metadata& meta, std::string_view key) {
  const auto it = meta.find(key);
  return it == meta.end() ? nullptr : &it->second;
}

}  // namespace

LoadedCase load_case(const std::string& path) {
  LoadedCase c;
  c.file = SafetensorsFile::read(path);
  const SafetensorsFile& f = c.file;

  const auto floats = [](DType d) { return is_float(d); };
  const auto ids = [](DType d) { return d == DType::i32 || d == DType::i64; };
  const auto int4 = [](DType d) { return d == DType::i8 || d == DType::u8; };
  constexpr const char* kFloats = "F32, BF16 or F16";
  constexpr const char* kInt4 = "I8 (values in [-8, 7]) or U8 (nibble-packed)";

  c.x = case_tensor(f, "x", {2}, kFloats, floats);
  c.topk_ids = case_tensor(f, "topk_ids", {2}, "I32 or I64", ids);
  c.topk_weights = case_tensor(f, "topk_weights", {2}, kFloats, floats);
  LogicalWeights& w = c.weights;
  w.w13 = case_tensor(f, "w13", {3}, kInt4, int4);
  w.w13_scale = case_tensor(f, "w13_scale", {2, 3}, kFloats, floats);
  w.w13_bias = case_tensor(f, "w13_bias", {2}, kFloats, floats, /*optional=*/true);
  w.w2 = case_tensor(f, "w2", {3}, kInt4, int4);
  w.w2_scale = case_tensor(f, "w2_scale", {2, 3}, kFloats, floats);
  w.w2_bias = case_tensor(f, "w2_bias", {2}, kFloats, floats, /*optional=*/true);

  const Metadata& meta = f.metadata();
  const std::string* group = find_meta(meta, "group_size");
  if (!group) case_fail(path, "metadata 'group_size' is missing (\"-1\" or a group size)");
  const std::optional<int64_t> g = parse_int(*group);
  if (!g || *g < std::numeric_limits<int>::min() || *g > std::numeric_limits<int>::max())
    case_fail(path,
              cat("metadata 'group_size' must be an integer, got '", short_text(*group), "'"));
  w.group_size = static_cast<int>(*g);

  const std::string* activation = find_meta(meta, "activation");
  if (!activation)
    case_fail(path,
              "metadata 'activation' is missing (silu, swigluoai, swiglustep, gelu or "
              "gelu_tanh)");
  try {
    c.params.activation = parse_activation(*activation);
  } catch (const Error&) {
    case_fail(path, cat("metadata 'activation' must be silu, swigluoai, swiglustep, gelu or "
                        "gelu_tanh, got '",
                        short_text(*activation), "'"));
  }

  for (const auto& [key, target] :
       {std::pair<const char*, float*>{"alpha", &c.params.alpha}, {"limit", &c.params.limit}}) {
    if (const std::string* text = find_meta(meta, key)) {
      const std::optional<float> v = parse_float(*text);
      if (!v)
        case_fail(path, cat("metadata '", key, "' must be a finite number, got '",
                            short_text(*text), "'"));
      *target = *v;
    }
  }
  if (const std::string* text = find_meta(meta, "apply_router_weight_on_input")) {
    if (*text != "true" && *text != "false")
      case_fail(path, cat("metadata 'apply_router_weight_on_input' must be 'true' or 'false', "
                          "got '",
                          short_text(*text), "'"));
    c.params.apply_router_weight_on_input = *text == "true";
  }
  if (const std::string* text = find_meta(meta, "gate_up_layout")) {
    if (*text == "halves") {
      w.gate_up_layout = GateUpLayout::halves;
    } else if (*text == "interleaved") {
      w.gate_up_layout = GateUpLayout::interleaved;
    } else {
      case_fail(path, cat("metadata 'gate_up_layout' must be 'halves' or 'interleaved', got '",
                          short_text(*text), "'"));
    }
  }
  return c;
}

}  // namespace w4a8moe::io
