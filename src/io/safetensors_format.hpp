// The safetensors format: dtype names, the checked header, and the tensor index both readers
// (safetensors_file.hpp copies, mapped_safetensors.hpp maps) build from it.
//
// The format: an 8-byte little-endian header length N, N bytes of JSON, then the data region.
// The JSON maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative
// to the data region) and may hold "__metadata__", a string -> string map.
//
// The header is checked field by field against the file before any data is touched: a hostile
// file can only produce an Error "safetensors file '<path>': <problem>".
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io {

// Limits of the reader: a header this long is no tensor index, and ranks stay small.
inline constexpr uint64_t kMaxHeaderBytes = 100u * 1000u * 1000u;
inline constexpr size_t kMaxRank = 8;

// "F32", "BF16", "F16", "I8", "U8", "I32", "I64" <-> DType.
const char* safetensors_dtype_name(DType dtype) noexcept;
std::optional<DType> parse_safetensors_dtype(std::string_view name) noexcept;

using Metadata = std::map<std::string, std::string, std::less<>>;

struct TensorEntry {
  DType dtype = DType::f32;
  std::vector<int64_t> shape;  // rank 0 to kMaxRank
  size_t size_bytes = 0;       // product(shape) * dtype_bytes(dtype)
};

// "[2, 3]".
std::string shape_string(std::span<const int64_t> shape);
// A name or value from the file, cut short for a message.
std::string short_text(std::string_view text);
// Throws Error "safetensors file '<path>': <problem>".
[[noreturn]] void safetensors_fail(const std::string& path, const std::string& problem);

// Throws Error unless a file of `file_bytes` bytes can hold the 8-byte header length.
void check_safetensors_size(const std::string& path, uint64_t file_bytes);

struct HeaderEntry {
  std::string name;
  TensorEntry entry;
  uint64_t begin = 0;  // in the data region
};

struct SafetensorsHeader {
  uint64_t data_begin = 0;  // file offset of the data region
  std::vector<HeaderEntry> entries;
  Metadata metadata;
};

// Copies `bytes` bytes at file offset `offset` to dst, or throws Error naming `what`.
using ReadExact = std::function<void(void* dst, uint64_t offset, uint64_t bytes, const char* what)>;

// Reads the header length and the JSON header of a file of `file_bytes` bytes (checked size)
// through `read_exact`, and checks every entry against the data region: dtype, shape, offsets
// within the region and matching the shape, no two tensors sharing bytes.
SafetensorsHeader parse_safetensors_header(const std::string& path, uint64_t file_bytes,
                                           const ReadExact& read_exact);

// What both readers answer from the checked header (Tensor has a TensorEntry `entry`): the file's
// path, its tensors by name and its metadata. The readers derive from it and add the bytes.
template <class Tensor>
class TensorIndex {
 public:
  const std::string& path() const noexcept { return path_; }
  bool contains(std::string_view name) const { return tensors_.find(name) != tensors_.end(); }
  std::vector<std::string> names() const {  // sorted
    std::vector<std::string> out;
    out.reserve(tensors_.size());
    for (const auto& item : tensors_) out.push_back(item.first);
    return out;
  }
  // Throws Error if the file has no tensor of that name.
  const TensorEntry& entry(std::string_view name) const { return find(name).entry; }
  const Metadata& metadata() const noexcept { return metadata_; }

 protected:
  explicit TensorIndex(std::string path = {}) : path_(std::move(path)) {}
  void add(std::string name, Tensor tensor) {
    tensors_.emplace(std::move(name), std::move(tensor));
  }
  // Throws Error if the file has no tensor of that name.
  const Tensor& find(std::string_view name) const {
    const auto it = tensors_.find(name);
    if (it == tensors_.end())
      safetensors_fail(path_, "there is no tensor '" + std::string(name) + "'");
    return it->second;
  }

  Metadata metadata_;

 private:
  std::string path_;
  std::map<std::string, Tensor, std::less<>> tensors_;
};

}  // namespace w4a8moe::io
