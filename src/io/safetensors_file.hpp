// The copying safetensors reader (case files, inputs).
//
// It checks every field against the file before it touches the data (safetensors_format.hpp), and
// copies each tensor into its own 64-byte aligned buffer, so a view never depends on the alignment
// of the bytes in the file and a hostile file can only produce an Error naming the file and the
// problem.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "io/safetensors_format.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io {

// Frees a CopiedTensor's buffer (aligned operator new).
struct AlignedBufferFree {
  void operator()(uint8_t* p) const noexcept;
};
// A tensor read into memory: its entry and its own 64-byte aligned copy of the bytes.
struct CopiedTensor {
  TensorEntry entry;
  std::unique_ptr<uint8_t, AlignedBufferFree> data;
};

// A safetensors file read into memory and checked. path(), contains(), names(), entry() and
// metadata(): TensorIndex.
class SafetensorsFile : public TensorIndex<CopiedTensor> {
 public:
  SafetensorsFile() = default;  // no file, no tensors
  // Reads and checks the whole file; throws Error naming the file and the first problem.
  static SafetensorsFile read(const std::string& path);

  // The bytes / view of a tensor; throw Error if the file has no tensor of that name.
  std::span<const uint8_t> bytes(std::string_view name) const;  // 64-byte aligned
  // A contiguous view; throws Error unless the rank is 1 to 3.
  TensorView view(std::string_view name) const;

 private:
  explicit SafetensorsFile(const std::string& path) : TensorIndex(path) {}
};

}  // namespace w4a8moe::io
