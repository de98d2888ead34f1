// The safetensors writer.
//
// It follows the reference implementation's layout so that any safetensors reader takes its
// files: tensors sorted by element size (largest first) then by name, packed without holes (each
// offset is thus a multiple of its element size), header padded with spaces to 8 bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "io/safetensors_format.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io {

// Collects tensors (copying their bytes) and string metadata, then writes one file.
class SafetensorsWriter {
 public:
  // Throws Error if the name is empty, reserved ("__metadata__") or taken, if a dimension is
  // negative, or if size_bytes differs from product(shape) * dtype_bytes(dtype).
  void add(std::string name, DType dtype, std::vector<int64_t> shape, const void* data,
           size_t size_bytes);
  template <class T>
  void add(std::string name, DType dtype, std::vector<int64_t> shape,
           const std::vector<T>& values) {
    add(std::move(name), dtype, std::move(shape), values.data(), values.size() * sizeof(T));
  }
  void set_metadata(std::string key, std::string value);

  // The whole file as bytes.
  std::vector<uint8_t> serialize() const;
  // Writes to a temporary file next to `path`, then renames it to `path`. Throws Error on
  // failure (and leaves no temporary file behind).
  void write(const std::string& path) const;

 private:
  struct Pending {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  std::vector<Pending> tensors_;
  Metadata metadata_;
};

}  // namespace w4a8moe::io
