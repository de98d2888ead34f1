// A read-only memory map of a whole file (checkpoints are read in place, not copied).
//
// Checkpoint loaders stream: they read one expert's bytes, convert and pack them, then call
// release() on the range, which drops those pages from the process's resident memory (they stay
// in the page cache), so the peak resident memory is the packed layer plus one chunk, not the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace w4a8moe::io {

class MappedFile {
 public:
  MappedFile() = default;
  // Maps `path` read-only; throws Error "<what> '<path>': <problem>" (what = e.g. "GGUF file").
  static MappedFile open(const std::string& path, const char* what);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const noexcept { return path_; }
  size_t size() const noexcept { return size_; }
  const uint8_t* data() const noexcept { return data_; }
  std::span<const uint8_t> bytes() const noexcept { return {data_, size_}; }
  // The caller checked offset + bytes <= size().
  std::span<const uint8_t> range(uint64_t offset, uint64_t bytes) const noexcept {
    return {data_ + offset, static_cast<size_t>(bytes)};
  }
  // Advises the kernel that [offset, offset + bytes) is read next (sequentially) / no longer
  // needed (its pages leave this process's resident set). Both are hints; errors are ignored.
  void will_need(uint64_t offset, uint64_t bytes) const noexcept;
  void release(uint64_t offset, uint64_t bytes) const noexcept;

 private:
  std::string path_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// The same hint for [data, data + bytes), a range inside a live MappedFile's mapping (a part of a
// tensor the caller holds a span of, e.g. one expert of a fused [E, ...] tensor).
void release_mapped(const uint8_t* data, size_t bytes) noexcept;

}  // namespace w4a8moe::io
