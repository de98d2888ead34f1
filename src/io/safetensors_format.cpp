// The safetensors header: dtype names and the checks of every entry against the file.
#include "io/safetensors_format.hpp"

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

#include "common/format.hpp"

namespace w4a8moe::io {

namespace {

using detail::cat;
using nlohmann::json;

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypeNames[] = {
    {DType::f32, "F32"}, {DType::bf16, "BF16"}, {DType::f16, "F16"}, {DType::i8, "I8"},
    {DType::u8, "U8"},   {DType::i32, "I32"},   {DType::i64, "I64"},
};

// A value for a message: short scalars and flat arrays as JSON text, other values described.
// (Never dump() a nested value: nlohmann's dump recurses, and a hostile header nests deeply.)
std::string json_excerpt(const json& value) {
  constexpr size_t kMaxChars = 40;
  if (value.is_string()) {
    std::string s = value.get<std::string>();
    if (s.size() > kMaxChars) s = s.substr(0, kMaxChars) + "...";
    return json(s).dump(-1, ' ', true, json::error_handler_t::replace);
  }
  if (value.is_array() && value.size() <= kMaxRank &&
      std::all_of(value.begin(), value.end(),
                  [](const json& v) { return v.is_number() || v.is_boolean() || v.is_null(); }))
    return value.dump();
  if (value.is_array()) return cat("an array of ", value.size(), " elements");
  if (value.is_object()) return cat("an object of ", value.size(), " members");
  return value.dump();  // a number, a boolean or null
}

// A non-negative JSON integer, or nullopt (floats, negatives, other types).
std::optional<uint64_t> as_count(const json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer() && value.get<int64_t>() >= 0)
    return static_cast<uint64_t>(value.get<int64_t>());
  return std::nullopt;
}

Metadata parse_metadata(const std::string& path, const json& value) {
  Metadata out;
  if (value.is_null()) return out;
  if (!value.is_object())
    safetensors_fail(path,
                     cat("'__metadata__' must be an object of strings, got ", json_excerpt(value)));
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string())
      safetensors_fail(
          path, cat("metadata '", short_text(key), "' must be a string, got ", json_excerpt(item)));
    out.emplace(key, item.get<std::string>());
  }
  return out;
}

}  // namespace

std::string shape_string(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i != 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string short_text(std::string_view text) {
  constexpr size_t kMaxChars = 60;
  return text.size() <= kMaxChars ? std::string(text)
                                  : cat(text.substr(0, kMaxChars), "... (", text.size(), " bytes)");
}

void safetensors_fail(const std::string& path, const std::string& problem) {
  throw Error(cat("safetensors file '", path, "': ", problem));
}

void check_safetensors_size(const std::string& path, uint64_t file_bytes) {
  if (file_bytes == 0) safetensors_fail(path, "the file is empty");
  if (file_bytes < 8)
    safetensors_fail(
        path, cat("the file is ", file_bytes, " bytes, shorter than the 8-byte header length"));
}

namespace {

// Checks one tensor entry of the header against the data region's size.
HeaderEntry parse_entry(const std::string& path, const std::string& name, const json& value,
                        uint64_t data_bytes) {
  const std::string what = cat("tensor '", short_text(name), "'");
  if (!value.is_object())
    safetensors_fail(path, cat(what, " must be a JSON object, got ", json_excerpt(value)));
  HeaderEntry out;
  out.name = name;

  const auto dtype_it = value.find("dtype");
  if (dtype_it == value.end()) safetensors_fail(path, cat(what, " has no 'dtype'"));
  if (!dtype_it->is_string())
    safetensors_fail(path,
                     cat(what, " has a 'dtype' that is not a string: ", json_excerpt(*dtype_it)));
  const std::string& dtype_text = dtype_it->get_ref<const std::string&>();
  const std::optional<DType> dtype = parse_safetensors_dtype(dtype_text);
  if (!dtype)
    safetensors_fail(path, cat(what, " has unsupported dtype '", short_text(dtype_text),
                               "' (w4a8moe reads F32, BF16, F16, I8, U8, I32 and I64)"));
  out.entry.dtype = *dtype;

  const auto shape_it = value.find("shape");
  if (shape_it == value.end()) safetensors_fail(path, cat(what, " has no 'shape'"));
  if (!shape_it->is_array())
    safetensors_fail(path,
                     cat(what, " has a 'shape' that is not an array: ", json_excerpt(*shape_it)));
  if (shape_it->size() > kMaxRank)
    safetensors_fail(path,
                     cat(what, " has rank ", shape_it->size(), ", more than the limit ", kMaxRank));
  uint64_t numel = 1;
  bool overflow = false;
  for (const json& dim : *shape_it) {
    if (dim.is_number_integer() && !dim.is_number_unsigned() && dim.get<int64_t>() < 0)
      safetensors_fail(path, cat(what, " has a negative dimension ", dim.get<int64_t>(),
                                 " in its shape ", json_excerpt(*shape_it)));
    const std::optional<uint64_t> n = as_count(dim);
    if (!n)
      safetensors_fail(
          path, cat(what, " has a shape dimension that is not an integer: ", json_excerpt(dim)));
    if (*n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      safetensors_fail(path, cat(what, " has a shape dimension ", *n, " that is too large"));
    out.entry.shape.push_back(static_cast<int64_t>(*n));
    overflow = overflow || __builtin_mul_overflow(numel, *n, &numel);
  }
  uint64_t size_bytes = 0;
  overflow = overflow || __builtin_mul_overflow(numel, dtype_bytes(*dtype), &size_bytes);
  // A zero dimension makes the product 0 whatever overflowed before it.
  const bool has_zero =
      std::find(out.entry.shape.begin(), out.entry.shape.end(), 0) != out.entry.shape.end();
  if (has_zero) {
    size_bytes = 0;
  } else if (overflow || size_bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    safetensors_fail(path, cat(what, " has shape ", shape_string(out.entry.shape),
                               " whose size in bytes overflows 64 bits"));
  }

  const auto offsets_it = value.find("data_offsets");
  if (offsets_it == value.end()) safetensors_fail(path, cat(what, " has no 'data_offsets'"));
  if (!offsets_it->is_array() || offsets_it->size() != 2)
    safetensors_fail(
        path, cat(what, " must have 'data_offsets' [begin, end], got ", json_excerpt(*offsets_it)));
  const std::optional<uint64_t> begin = as_count((*offsets_it)[0]);
  const std::optional<uint64_t> end = as_count((*offsets_it)[1]);
  if (!begin || !end)
    safetensors_fail(path, cat(what, " has 'data_offsets' that are not non-negative integers: ",
                               json_excerpt(*offsets_it)));
  if (*begin > *end)
    safetensors_fail(path, cat(what, " has data_offsets begin ", *begin, " after its end ", *end));
  if (*end > data_bytes)
    safetensors_fail(path,
                     cat(what, " has data_offsets end ", *end, " past the end of the data region (",
                         data_bytes, " bytes): the file is truncated or the offsets are wrong"));
  if (*end - *begin != size_bytes)
    safetensors_fail(path, cat(what, " has data_offsets [", *begin, ", ", *end, "] holding ",
                               *end - *begin, " bytes, but shape ", shape_string(out.entry.shape),
                               " of dtype ", dtype_text, " needs ", size_bytes, " bytes"));
  out.entry.size_bytes = static_cast<size_t>(size_bytes);
  out.begin = *begin;
  return out;
}

}  // namespace

const char* safetensors_dtype_name(DType dtype) noexcept {
  for (const DTypeName& d : kDTypeNames)
    if (d.dtype == dtype) return d.name;
  return "?";
}

std::optional<DType> parse_safetensors_dtype(std::string_view name) noexcept {
  for (const DTypeName& d : kDTypeNames)
    if (name == d.name) return d.dtype;
  return std::nullopt;
}

// Reads the header length and the JSON header through `read_exact` and checks every entry
// against the file (shared by the copying reader and the mapped one).
SafetensorsHeader parse_safetensors_header(const std::string& path, uint64_t file_bytes,
                                           const ReadExact& read_exact) {
  uint8_t length_bytes[8];
  read_exact(length_bytes, 0, 8, "the header length");
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | length_bytes[i];
  if (header_bytes < 2)
    safetensors_fail(path, cat("header length ", header_bytes, " is too small for a JSON object"));
  if (header_bytes > kMaxHeaderBytes)
    safetensors_fail(path, cat("header length ", header_bytes, " exceeds the limit of ",
                               kMaxHeaderBytes, " bytes"));
  if (header_bytes > file_bytes - 8)
    safetensors_fail(path, cat("header length ", header_bytes, " runs past the end of the file (",
                               file_bytes, " bytes)"));
  const uint64_t data_begin = 8 + header_bytes;
  const uint64_t data_bytes = file_bytes - data_begin;

  std::string header_text(static_cast<size_t>(header_bytes), '\0');
  read_exact(header_text.data(), 8, header_bytes, "the JSON header");
  // nlohmann stops at a NUL byte as at the end of input: reject it, or the rest would be ignored.
  if (const size_t nul = header_text.find('\0'); nul != std::string::npos)
    safetensors_fail(path, cat("the header is not valid JSON (a NUL byte at byte ", nul, " of ",
                               header_bytes, ")"));
  json header;
  try {
    header = json::parse(header_text);
  } catch (const json::parse_error& e) {
    safetensors_fail(path, cat("the header is not valid JSON (error at byte ", e.byte, " of ",
                               header_bytes, ")"));
  } catch (const json::out_of_range&) {  // found by fuzzing: a number such as 1E400
    safetensors_fail(path, "the header is not valid JSON (a number out of range)");
  }
  if (!header.is_object())
    safetensors_fail(path, cat("the header is not a JSON object but ", json_excerpt(header)));

  SafetensorsHeader out;
  out.data_begin = data_begin;
  std::vector<HeaderEntry>& entries = out.entries;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      out.metadata = parse_metadata(path, value);
    } else {
      entries.push_back(parse_entry(path, key, value, data_bytes));
    }
  }
  // Tensors may not share bytes (as in the reference implementation): without this check a small
  // file could name the same bytes many times over and make the reader allocate without bound.
  std::vector<const HeaderEntry*> by_offset;
  for (const HeaderEntry& e : entries)
    if (e.entry.size_bytes > 0) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const HeaderEntry* a, const HeaderEntry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const HeaderEntry& prev = *by_offset[i - 1];
    const HeaderEntry& cur = *by_offset[i];
    if (cur.begin < prev.begin + prev.entry.size_bytes)
      safetensors_fail(path, cat("tensor '", short_text(cur.name), "' (bytes ", cur.begin, " to ",
                                 cur.begin + cur.entry.size_bytes, ") overlaps tensor '",
                                 short_text(prev.name), "' (bytes ", prev.begin, " to ",
                                 prev.begin + prev.entry.size_bytes, ") in the data region"));
  }
  return out;
}

}  // namespace w4a8moe::io
