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
#include <vector>

#include "io/safetensors_format.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io {

// A safetensors file read into memory and checked.
class SafetensorsFile {
 public:
  // Reads and checks the whole file; throws Error naming the file and the first problem.
  static SafetensorsFile read(const std::string& path);

  const std::string& path() const noexcept { return tensors_.path(); }
  bool contains(std::string_view name) const { return tensors_.contains(name); }
  std::vector<std::string> names() const { return tensors_.names(); }  // sorted
  // The entry / bytes / view of a tensor; throw Error if the file has no tensor of that name.
  const TensorEntry& entry(std::string_view name) const;
  std::span<const uint8_t> bytes(std::string_view name) const;  // 64-byte aligned
  // A contiguous view; throws Error unless the rank is 1 to 3.
  TensorView view(std::string_view name) const;
  const Metadata& metadata() const noexcept { return metadata_; }

 private:
  struct AlignedFree {
    void operator()(uint8_t* p) const noexcept;
  };
  struct Tensor {
    TensorEntry entry;
    std::unique_ptr<uint8_t, AlignedFree> data;
  };

  TensorIndex<Tensor> tensors_;
  Metadata metadata_;
};

}  // namespace w4a8moe::io
