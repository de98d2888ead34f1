// The memory-mapped safetensors reader of checkpoints.
#include "io/mapped_safetensors.hpp"

#include <cstring>

#include "common/format.hpp"

namespace w4a8moe::io {

using detail::cat;

MappedSafetensors MappedSafetensors::open(const std::string& path) {
  MappedSafetensors out(path);
  out.file_ = MappedFile::open(path, "safetensors file");
  const uint64_t file_bytes = out.file_.size();
  check_safetensors_size(path, file_bytes);
  const uint8_t* base = out.file_.data();
  const auto read_exact = [&](void* dst, uint64_t offset, uint64_t bytes, const char* what) {
    if (offset > file_bytes || bytes > file_bytes - offset)
      safetensors_fail(path,
                       cat("could not read ", what, " (", bytes, " bytes at offset ", offset, ")"));
    std::memcpy(dst, base + offset, static_cast<size_t>(bytes));
  };
  SafetensorsHeader parsed = parse_safetensors_header(path, file_bytes, read_exact);
  out.metadata_ = std::move(parsed.metadata);
  for (HeaderEntry& e : parsed.entries)
    out.add(std::move(e.name), MappedTensor{std::move(e.entry), parsed.data_begin + e.begin});
  return out;
}

std::span<const uint8_t> MappedSafetensors::bytes(std::string_view name) const {
  const MappedTensor& t = find(name);
  return file_.range(t.offset, t.entry.size_bytes);
}

void MappedSafetensors::release(std::string_view name) const {
  const MappedTensor& t = find(name);
  file_.release(t.offset, t.entry.size_bytes);
}

}  // namespace w4a8moe::io
