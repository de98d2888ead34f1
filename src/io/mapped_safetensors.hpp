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
#include <vector>

#include "io/mapped_file.hpp"
#include "io/safetensors_format.hpp"

namespace w4a8moe::io {

class MappedSafetensors {
 public:
  // Maps and checks the file; throws Error naming the file and the first problem.
  static MappedSafetensors open(const std::string& path);

  const std::string& path() const noexcept { return file_.path(); }
  bool contains(std::string_view name) const { return tensors_.contains(name); }
  std::vector<std::string> names() const { return tensors_.names(); }  // sorted
  // Throw Error if the file has no tensor of that name.
  const TensorEntry& entry(std::string_view name) const;
  std::span<const uint8_t> bytes(std::string_view name) const;
  void release(std::string_view name) const;
  const Metadata& metadata() const noexcept { return metadata_; }

 private:
  struct Tensor {
    TensorEntry entry;
    uint64_t offset = 0;  // in the file
  };

  MappedFile file_;
  TensorIndex<Tensor> tensors_;
  Metadata metadata_;
};

}  // namespace w4a8moe::io
