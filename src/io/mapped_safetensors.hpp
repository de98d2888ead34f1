// The memory-mapped safetensors reader (checkpoints).
//
// The same checks as SafetensorsFile::read (safetensors_format.hpp), but the data stays in the
// file: bytes() points into a read-only mapping (aligned only as the file's offsets are), and
// release() drops a tensor's pages from the resident set once it was consumed, so a loader streams
// a large checkpoint.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "io/mapped_file.hpp"
#include "io/safetensors_format.hpp"

namespace w4a8moe::io {

// A tensor of a mapped file: its entry and the file offset of its bytes.
struct MappedTensor {
  TensorEntry entry;
  uint64_t offset = 0;
};

// path(), contains(), names(), entry() and metadata(): TensorIndex.
class MappedSafetensors : public TensorIndex<MappedTensor> {
 public:
  MappedSafetensors() = default;  // no file, no tensors
  // Maps and checks the file; throws Error naming the file and the first problem.
  static MappedSafetensors open(const std::string& path);

  // Throw Error if the file has no tensor of that name.
  std::span<const uint8_t> bytes(std::string_view name) const;
  void release(std::string_view name) const;

 private:
  explicit MappedSafetensors(const std::string& path) : TensorIndex(path) {}

  MappedFile file_;
};

}  // namespace w4a8moe::io
