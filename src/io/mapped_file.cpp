#include "io/mapped_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "common/format.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io {

namespace {

size_t page_size() {
  static const size_t bytes = [] {
    const long p = ::sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<size_t>(p) : size_t{4096};
  }();
  return bytes;
}

// [offset, offset + bytes) widened to whole pages inside the mapping.
std::pair<uint8_t*, size_t> page_range(uint8_t* base, size_t size, uint64_t offset,
                                       uint64_t bytes) {
  if (base == nullptr || offset >= size || bytes == 0) return {nullptr, 0};
  const uint64_t end = offset + bytes > size ? size : offset + bytes;
  const uint64_t first = offset / page_size() * page_size();
  return {base + first, static_cast<size_t>(end - first)};
}

}  // namespace

MappedFile MappedFile::open(const std::string& path, const char* what) {
  using detail::cat;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    throw Error(cat(what, " '", path, "': cannot open the file (", std::strerror(errno), ")"));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw Error(cat(what, " '", path, "': cannot read the file size (", std::strerror(err), ")"));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(cat(what, " '", path, "': not a regular file"));
  }
  MappedFile file;
  file.path_ = path;
  file.size_ = static_cast<size_t>(st.st_size);
  if (file.size_ > 0) {
    void* p = ::mmap(nullptr, file.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      throw Error(cat(what, " '", path, "': cannot map the file (", std::strerror(err), ")"));
    }
    file.data_ = static_cast<uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file open
  return file;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) ::munmap(data_, size_);
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void MappedFile::will_need(uint64_t offset, uint64_t bytes) const noexcept {
  const auto [p, n] = page_range(data_, size_, offset, bytes);
  if (n > 0) ::madvise(p, n, MADV_WILLNEED);
}

void MappedFile::release(uint64_t offset, uint64_t bytes) const noexcept {
  const auto [p, n] = page_range(data_, size_, offset, bytes);
  // Read-only private mapping never written: MADV_DONTNEED drops the pages from the resident set
  // and a later read maps them again from the page cache (the contents are unchanged).
  if (n > 0) ::madvise(p, n, MADV_DONTNEED);
}

void release_mapped(const uint8_t* data, size_t bytes) noexcept {
  if (data == nullptr || bytes == 0) return;
  // the mapping starts on a page boundary, so the page holding `data` is inside it
  const auto at = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = at / page_size() * page_size();
  ::madvise(reinterpret_cast<void*>(first), static_cast<size_t>(at - first) + bytes, MADV_DONTNEED);
}

}  // namespace w4a8moe::io
