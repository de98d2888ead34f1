// GGUF files (llama.cpp's model format, versions 2 and 3): a memory-mapped, checked reader.
//
// Layout (little-endian): "GGUF", u32 version, u64 tensor count, u64 metadata count; the metadata
// (string key, u32 value type, value); the tensor infos (string name, u32 n_dims, u64 ne[n_dims],
// u32 ggml type, u64 offset); padding to `general.alignment` (default 32); the data section.
// Strings are a u64 length and that many bytes; arrays a u32 element type, a u64 count and the
// elements. A tensor's ne[0] is its innermost (contiguous) dimension: ne = [H, I, E] is the
// row-major array [E, I, H].
//
// open() checks every count, length and offset against the file before anything is used: a
// hostile or truncated file gives an Error "GGUF file '<path>': <problem>", never a crash or an
// allocation the file's size does not justify. Array values are not copied: an array records
// where its elements are.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "io/ggml_types.hpp"
#include "io/mapped_file.hpp"

namespace w4a8moe::io {

enum class GgufType : uint32_t {
  u8 = 0,
  i8 = 1,
  u16 = 2,
  i16 = 3,
  u32 = 4,
  i32 = 5,
  f32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  u64 = 10,
  i64 = 11,
  f64 = 12,
};
const char* gguf_type_name(GgufType type) noexcept;

inline constexpr int kGgufMaxDims = 4;
inline constexpr uint64_t kGgufDefaultAlignment = 32;

struct GgufValue {
  GgufType type = GgufType::u8;
  // Scalars: integers in `integer` (u64 values above INT64_MAX in `unsigned_big`), floats in
  // `real`, booleans in `integer` (0 or 1), strings in `text`.
  int64_t integer = 0;
  bool unsigned_big = false;
  double real = 0;
  std::string text;
  // Arrays: element type, count, and the file offset of the first element.
  GgufType element_type = GgufType::u8;
  uint64_t count = 0;
  uint64_t offset = 0;

  bool is_integer() const noexcept;  // u8 .. i64 (not bool)
  bool is_float() const noexcept { return type == GgufType::f32 || type == GgufType::f64; }
};

struct GgufTensor {
  std::string name;
  int n_dims = 0;
  std::array<int64_t, kGgufMaxDims> ne{1, 1, 1, 1};  // ne[0] innermost; unused dimensions 1
  uint32_t type = 0;                                 // GgmlType (checked to be known)
  uint64_t offset = 0;                               // in the data section
  uint64_t bytes = 0;
  uint64_t file_offset = 0;
  int64_t rows() const noexcept { return ne[1] * ne[2] * ne[3]; }
  uint64_t row_bytes() const noexcept {
    return rows() == 0 ? 0 : bytes / static_cast<uint64_t>(rows());
  }
};

class GgufFile {
 public:
  // Maps and checks the file; throws Error naming the file and the first problem.
  static GgufFile open(const std::string& path);

  const std::string& path() const noexcept { return file_.path(); }
  uint32_t version() const noexcept { return version_; }
  uint64_t alignment() const noexcept { return alignment_; }
  uint64_t data_offset() const noexcept { return data_offset_; }
  const MappedFile& file() const noexcept { return file_; }

  const std::map<std::string, GgufValue, std::less<>>& metadata() const noexcept { return kv_; }
  const GgufValue* find(std::string_view key) const;
  // Typed lookups: nullopt when the key is absent; Error naming the key when it holds another
  // type (integers of any width convert when the value fits; floats accept integers).
  std::optional<int64_t> get_int(std::string_view key) const;
  std::optional<double> get_float(std::string_view key) const;
  std::optional<bool> get_bool(std::string_view key) const;
  std::optional<std::string> get_string(std::string_view key) const;
  // Elements of an array of numbers (converted to double); Error on another type.
  std::optional<std::vector<double>> get_numbers(std::string_view key) const;

  const std::vector<GgufTensor>& tensors() const noexcept { return tensors_; }
  const GgufTensor* find_tensor(std::string_view name) const;
  const GgufTensor& tensor(std::string_view name) const;  // Error if absent
  std::span<const uint8_t> bytes(const GgufTensor& t) const {
    return file_.range(t.file_offset, t.bytes);
  }

 private:
  MappedFile file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = kGgufDefaultAlignment;
  uint64_t data_offset_ = 0;
  std::map<std::string, GgufValue, std::less<>> kv_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;
};

}  // namespace w4a8moe::io
