// The copying safetensors reader: every tensor in its own 64-byte aligned buffer.
#include "io/safetensors_file.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <new>
#include <system_error>

#include "common/format.hpp"

namespace w4a8moe::io {

namespace {

using detail::cat;

constexpr size_t kBufferAlign = 64;

uint8_t* aligned_alloc_bytes(size_t bytes) {
  return static_cast<uint8_t*>(
      ::operator new (std::max<size_t>(bytes, 1), std::align_val_t{kBufferAlign}));
}

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  safetensors_fail(path, problem);
}

}  // namespace

void AlignedBufferFree::operator()(uint8_t* p) const noexcept {
  ::operator delete (p, std::align_val_t{kBufferAlign});
}

SafetensorsFile SafetensorsFile::read(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status)) fail(path, "the file does not exist or cannot be accessed");
  if (!fs::is_regular_file(status)) fail(path, "not a regular file");
  const uintmax_t file_bytes = fs::file_size(path, ec);
  if (ec) fail(path, cat("cannot read the file size (", ec.message(), ")"));
  check_safetensors_size(path, file_bytes);

  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "cannot open the file for reading");
  const auto read_exact = [&](void* dst, uint64_t offset, uint64_t bytes, const char* what) {
    in.seekg(static_cast<std::streamoff>(offset));
    in.read(static_cast<char*>(dst), static_cast<std::streamsize>(bytes));
    if (!in || static_cast<uint64_t>(in.gcount()) != bytes)
      fail(path, cat("could not read ", what, " (", bytes, " bytes at offset ", offset, ")"));
  };

  SafetensorsHeader parsed = parse_safetensors_header(path, file_bytes, read_exact);
  SafetensorsFile file(path);
  file.metadata_ = std::move(parsed.metadata);
  std::vector<HeaderEntry>& entries = parsed.entries;
  const uint64_t data_begin = parsed.data_begin;
  for (HeaderEntry& e : entries) {
    CopiedTensor tensor;
    tensor.data.reset(aligned_alloc_bytes(e.entry.size_bytes));
    if (e.entry.size_bytes > 0)
      read_exact(tensor.data.get(), data_begin + e.begin, e.entry.size_bytes,
                 cat("the data of tensor '", short_text(e.name), "'").c_str());
    tensor.entry = std::move(e.entry);
    file.add(std::move(e.name), std::move(tensor));
  }
  return file;
}

std::span<const uint8_t> SafetensorsFile::bytes(std::string_view name) const {
  const CopiedTensor& t = find(name);
  return {t.data.get(), t.entry.size_bytes};
}

TensorView SafetensorsFile::view(std::string_view name) const {
  const CopiedTensor& t = find(name);
  const size_t rank = t.entry.shape.size();
  if (rank < 1 || rank > 3)
    fail(path(), cat("tensor '", name, "' has rank ", rank, " (shape ", shape_string(t.entry.shape),
                     "), but a view needs rank 1 to 3"));
  TensorView v;
  v.data = t.data.get();
  v.dtype = t.entry.dtype;
  v.rank = static_cast<int>(rank);
  std::copy(t.entry.shape.begin(), t.entry.shape.end(), v.shape.begin());
  v.row_stride = 0;
  return v;
}

}  // namespace w4a8moe::io
