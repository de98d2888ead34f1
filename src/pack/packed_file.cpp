// Packed weight files: save_packed() writes a layer's two packed buffers so that a crash
// never leaves a partial file under the final name; PackedFile maps (or copies) such a file and
// verifies every byte of it before handing out the buffers.
//
// File layout (little-endian):
//   [0, 256)          FileHeader below; bytes [256, 4096) are zero
//   [4096, ...)       the w13 packed buffer (its own 128-byte header, then the experts)
//   [w2_offset, end)  the w2 packed buffer, w2_offset = w13's end rounded up to 4096 (zero gap)
// payload_checksum is XXH64 (seed 0) of bytes [4096, end); header_checksum is XXH64 of the
// header's bytes before that field.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

#include "common/argument_checks.hpp"
#include "common/checked_math.hpp"
#include "common/format.hpp"
#include "common/xxhash64.hpp"
#include "pack/packed_format.hpp"
#include "registry.hpp"

namespace w4a8moe {

namespace detail {
namespace {

constexpr char kFileMagic[8] = {'W', '4', 'A', '8', 'P', 'K', 'F', '\0'};
constexpr size_t kFileHeaderBytes = 4096;  // also the alignment of both buffers in the file
constexpr uint32_t kChecksumXxh64 = 1;
constexpr uint32_t kMetaParams = 1u;  // meta_flags: activation, alpha, limit, router side present

struct FileHeader {
  char magic[8];
  uint32_t file_version;
  uint32_t header_bytes;
  uint32_t format_version;  // of both packed buffers
  uint32_t layout;          // LayoutId of both packed buffers
  uint64_t file_bytes;
  uint64_t w13_offset, w13_bytes;
  uint64_t w2_offset, w2_bytes;
  uint64_t experts, hidden, inter;
  int32_t group_size;
  uint32_t checksum_kind;
  uint64_t payload_checksum;
  uint32_t meta_flags;
  int32_t activation;
  float alpha, limit;
  uint32_t router_on_input;
  uint32_t reserved0;
  int64_t top_k;
  uint8_t reserved[112];
  uint64_t header_checksum;
};
static_assert(sizeof(FileHeader) == 256);
static_assert(offsetof(FileHeader, header_checksum) == 248);

uint64_t header_checksum(const FileHeader& h) noexcept {
  return Xxh64::of(&h, offsetof(FileHeader, header_checksum));
}

uint64_t round_up(uint64_t v, uint64_t to) { return checked_add(v, to - 1) / to * to; }

std::string reason(int error) { return std::error_code(error, std::generic_category()).message(); }

std::string where(const std::string& path) { return cat("packed file '", path, "'"); }

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw Error(cat(where(path), ": ", problem));
}

class Fd {
 public:
  explicit Fd(int fd = -1) noexcept : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const noexcept { return fd_; }
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }
  // close() reports delayed write errors (NFS); the caller throws on false.
  bool close_checked() noexcept {
    const int fd = fd_;
    fd_ = -1;
    return fd < 0 || ::close(fd) == 0;
  }

 private:
  int fd_;
};

void write_all(int fd, const uint8_t* data, size_t bytes, uint64_t offset,
               const std::string& path) {
  while (bytes > 0) {
    const ssize_t n =
        ::pwrite(fd, data, std::min(bytes, size_t{1} << 30), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(path,
           cat("cannot write ", bytes, " bytes at offset ", offset, " (", reason(errno), ")"));
    }
    data += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

// Removes a temporary name unless released (on every failure path after it was created).
class TempName {
 public:
  TempName() = default;
  ~TempName() {
    if (!name_.empty()) ::unlink(name_.c_str());
  }
  TempName(const TempName&) = delete;
  TempName& operator=(const TempName&) = delete;
  void set(std::string name) { name_ = std::move(name); }
  const std::string& name() const noexcept { return name_; }
  void release() noexcept { name_.clear(); }

 private:
  std::string name_;
};

std::string temp_name(const std::string& path) {
  static std::atomic<unsigned> counter{0};
  return cat(path, ".tmp.", ::getpid(), ".", counter++);
}

}  // namespace
}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Writing

void save_packed(const std::string& path, std::span<const uint8_t> w13_packed,
                 std::span<const uint8_t> w2_packed, const PackedFileMeta& meta) {
  using namespace detail;
  const Geometry g13 = read_geometry(w13_packed, "w13_packed");
  const Geometry g2 = read_geometry(w2_packed, "w2_packed");
  const ForwardShape s = check_packed_pair(g13, g2, "w13_packed", "w2_packed");
  if (meta.has_params) check_params(meta.params);
  if (meta.top_k < 0 || meta.top_k > s.experts)
    throw Error(cat("meta.top_k: expected 0 (unknown) or a count in [1, ", s.experts,
                    "] (the experts), got ", meta.top_k));
  if (path.empty()) throw Error("path: expected a file name, got an empty string");

  FileHeader h{};
  std::memcpy(h.magic, kFileMagic, sizeof h.magic);
  h.file_version = kPackedFileVersion;
  h.header_bytes = kFileHeaderBytes;
  h.format_version = kPackedFormatVersion;
  h.layout = static_cast<uint32_t>(g13.layout);
  h.w13_offset = kFileHeaderBytes;
  h.w13_bytes = w13_packed.size();
  h.w2_offset = round_up(checked_add(h.w13_offset, h.w13_bytes), kFileHeaderBytes);
  h.w2_bytes = w2_packed.size();
  h.file_bytes = checked_add(h.w2_offset, h.w2_bytes);
  h.experts = static_cast<uint64_t>(s.experts);
  h.hidden = static_cast<uint64_t>(s.hidden);
  h.inter = static_cast<uint64_t>(s.inter);
  h.group_size = g13.group_size;
  h.checksum_kind = kChecksumXxh64;
  if (meta.has_params) {
    h.meta_flags = kMetaParams;
    h.activation = static_cast<int32_t>(meta.params.activation);
    h.alpha = meta.params.alpha;
    h.limit = meta.params.limit;
    h.router_on_input = meta.params.apply_router_weight_on_input ? 1u : 0u;
  }
  h.top_k = meta.top_k;
  const size_t gap = static_cast<size_t>(h.w2_offset - (h.w13_offset + h.w13_bytes));
  const uint8_t zeros[kFileHeaderBytes] = {};
  Xxh64 sum;
  sum.update(w13_packed.data(), w13_packed.size());
  sum.update(zeros, gap);
  sum.update(w2_packed.data(), w2_packed.size());
  h.payload_checksum = sum.digest();
  h.header_checksum = header_checksum(h);

  namespace fs = std::filesystem;
  const fs::path parent = fs::path(path).parent_path();
  const std::string dir = parent.empty() ? std::string(".") : parent.string();

  // An unnamed file in the target directory (O_TMPFILE) gets a name only once it is complete;
  // file systems without O_TMPFILE get a temporary name, removed on failure.
  TempName temp;
  Fd fd(::open(dir.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, 0644));
  const bool unnamed = fd.get() >= 0;
  if (!unnamed) {
    const int e = errno;
    if (e != EOPNOTSUPP && e != EISDIR && e != EINVAL)
      fail(path, cat("cannot create a file in directory '", dir, "' (", reason(e), ")"));
    for (int attempt = 0; attempt < 100 && fd.get() < 0; ++attempt) {
      std::string name = temp_name(path);
      fd.reset(::open(name.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644));
      if (fd.get() >= 0) {
        temp.set(std::move(name));
      } else if (errno != EEXIST) {
        fail(path, cat("cannot create temporary file '", name, "' (", reason(errno), ")"));
      }
    }
    if (fd.get() < 0) fail(path, "cannot find an unused temporary file name");
  }

  uint8_t header_page[kFileHeaderBytes] = {};
  std::memcpy(header_page, &h, sizeof h);
  write_all(fd.get(), header_page, sizeof header_page, 0, path);
  write_all(fd.get(), w13_packed.data(), w13_packed.size(), h.w13_offset, path);
  write_all(fd.get(), zeros, gap, h.w13_offset + h.w13_bytes, path);
  write_all(fd.get(), w2_packed.data(), w2_packed.size(), h.w2_offset, path);
  if (::fsync(fd.get()) != 0)
    fail(path, cat("cannot flush the file to disk (", reason(errno), ")"));

  if (unnamed) {  // give the complete file a temporary name next to its final one
    const std::string proc = cat("/proc/self/fd/", fd.get());
    for (int attempt = 0; attempt < 100 && temp.name().empty(); ++attempt) {
      std::string name = temp_name(path);
      if (::linkat(AT_FDCWD, proc.c_str(), AT_FDCWD, name.c_str(), AT_SYMLINK_FOLLOW) == 0) {
        temp.set(std::move(name));
      } else if (errno != EEXIST) {
        fail(path, cat("cannot name the written file '", name, "' (", reason(errno), ")"));
      }
    }
    if (temp.name().empty()) fail(path, "cannot find an unused temporary file name");
  }
  if (!fd.close_checked()) fail(path, cat("cannot close the written file (", reason(errno), ")"));
  if (::rename(temp.name().c_str(), path.c_str()) != 0)
    fail(path, cat("cannot rename '", temp.name(), "' to it (", reason(errno), ")"));
  temp.release();
  // Make the rename durable. Some file systems cannot fsync a directory (EINVAL): the data is
  // safe then, only the name may revert to the old file after a power loss.
  Fd dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.get() >= 0 && ::fsync(dir_fd.get()) != 0 && errno != EINVAL)
    fail(path, cat("cannot flush directory '", dir, "' to disk (", reason(errno), ")"));
}

// ---------------------------------------------------------------------------------------------
// Reading

struct PackedFile::Impl {
  std::string path;
  PackedFileInfo info;
  const uint8_t* base = nullptr;
  size_t bytes = 0;
  void* mapping = nullptr;  // munmap'ed on destruction
  void* copy = nullptr;     // freed on destruction
  std::span<const uint8_t> w13, w2;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    if (mapping != nullptr) ::munmap(mapping, bytes);
    std::free(copy);
  }
};

namespace detail {
namespace {

// Every check on the bytes in memory (mapped or copied): the header, the offsets, the layout
// against this CPU, the payload checksum, the two buffers and their agreement.
void verify(PackedFile::Impl& f, const PackedFileOptions& options) {
  const std::string& path = f.path;
  FileHeader h;
  std::memcpy(&h, f.base, sizeof h);
  if (std::memcmp(h.magic, kFileMagic, sizeof kFileMagic) != 0)
    fail(path, "not a w4a8moe packed weights file (bad magic bytes)");
  if (h.file_version != kPackedFileVersion)
    fail(path, cat("expected file version ", kPackedFileVersion, ", got version ", h.file_version,
                   " (another release of w4a8moe); repack the weights with `w4a8moe pack`"));
  if (h.header_checksum != header_checksum(h))
    fail(path, "the header is corrupted (checksum mismatch)");
  if (h.header_bytes != kFileHeaderBytes)
    fail(path, cat("expected a header of ", kFileHeaderBytes, " bytes, got ", h.header_bytes));
  if (h.format_version != kPackedFormatVersion)
    fail(path, cat("expected packed format version ", kPackedFormatVersion, ", got version ",
                   h.format_version, "; repack the weights with `w4a8moe pack`"));
  if (h.checksum_kind != kChecksumXxh64)
    fail(path, cat("expected checksum kind ", kChecksumXxh64, " (XXH64), got ", h.checksum_kind));
  if ((h.meta_flags & ~kMetaParams) != 0) fail(path, cat("unknown header flags ", h.meta_flags));
  for (size_t i = 0; i < sizeof h.reserved; ++i)
    if (h.reserved[i] != 0 || h.reserved0 != 0) fail(path, "reserved header bytes are not zero");
  for (size_t i = sizeof h; i < kFileHeaderBytes; ++i)
    if (f.base[i] != 0) fail(path, cat("header byte ", i, " (padding) is not zero"));
  if (h.file_bytes != f.bytes)
    fail(path, cat("the header says the file has ", h.file_bytes, " bytes, it has ", f.bytes,
                   " (truncated, or appended to)"));
  uint64_t w13_end = 0, w2_end = 0;
  if (h.w13_offset != kFileHeaderBytes || h.w2_offset % kFileHeaderBytes != 0 ||
      __builtin_add_overflow(h.w13_offset, h.w13_bytes, &w13_end) || w13_end > h.w2_offset ||
      h.w2_offset - w13_end >= kFileHeaderBytes ||
      __builtin_add_overflow(h.w2_offset, h.w2_bytes, &w2_end) || w2_end != h.file_bytes)
    fail(path, cat("the buffer offsets and sizes (w13 at ", h.w13_offset, ", ", h.w13_bytes,
                   " bytes; w2 at ", h.w2_offset, ", ", h.w2_bytes,
                   " bytes) do not fit the file layout"));

  // Cheap checks before the expensive one: can this machine run the layout at all?
  const LayoutInfo& layout = layout_info(h.layout, where(path));
  try {
    set_for_layout(layout.id, where(path));
  } catch (const Error&) {
    std::string readers;
    for (const KernelSet& k : kernel_table())
      if (k.reads(layout.id)) readers += cat(readers.empty() ? "" : ", ", k.name);
    fail(path, cat("packed for layout ", layout.name, " (kernel set ",
                   readers.empty() ? std::string("none in this build") : readers,
                   "), which this CPU cannot run within the ISA cap (active kernel set ",
                   active_set().name, "); repack the weights on this machine with `w4a8moe pack`"));
  }

  const uint64_t payload = options.verify_checksum
                               ? Xxh64::of(f.base + kFileHeaderBytes, f.bytes - kFileHeaderBytes)
                               : h.payload_checksum;
  if (payload != h.payload_checksum)
    fail(path, cat("the payload checksum ", payload, " does not match the header's ",
                   h.payload_checksum, " (the file is corrupted or was modified after writing)"));

  f.w13 = {f.base + h.w13_offset, static_cast<size_t>(h.w13_bytes)};
  f.w2 = {f.base + h.w2_offset, static_cast<size_t>(h.w2_bytes)};
  for (size_t i = static_cast<size_t>(w13_end); i < h.w2_offset; ++i)
    if (f.base[i] != 0) fail(path, cat("gap byte ", i, " between the buffers is not zero"));
  const Geometry g13 = read_geometry(f.w13, cat(where(path), ", w13"));
  const Geometry g2 = read_geometry(f.w2, cat(where(path), ", w2"));
  const ForwardShape s =
      check_packed_pair(g13, g2, cat(where(path), ", w13"), cat(where(path), ", w2"));
  if (g13.layout != layout.id || static_cast<uint64_t>(s.experts) != h.experts ||
      static_cast<uint64_t>(s.hidden) != h.hidden || static_cast<uint64_t>(s.inter) != h.inter ||
      g13.group_size != h.group_size)
    fail(path, cat("the header (", h.experts, " experts, H ", h.hidden, ", I ", h.inter, ", group ",
                   h.group_size, ", layout ", layout.name, ") does not match its buffers (",
                   s.experts, " experts, H ", s.hidden, ", I ", s.inter, ", group ", g13.group_size,
                   ", layout ", layout_name(g13.layout), ")"));

  PackedFileInfo& info = f.info;
  info.file_version = h.file_version;
  info.w13 = inspect_packed(f.w13);
  info.w2 = inspect_packed(f.w2);
  info.experts = s.experts;
  info.hidden = s.hidden;
  info.inter = s.inter;
  info.group_size = g13.group_size;
  info.file_bytes = f.bytes;
  info.checksum = h.payload_checksum;
  info.checksum_verified = options.verify_checksum;
  info.mapped = f.mapping != nullptr;
  if (h.top_k < 0 || h.top_k > s.experts)
    fail(path, cat("expected a recorded top-k in [0, ", s.experts, "], got ", h.top_k));
  info.meta.top_k = h.top_k;
  if ((h.meta_flags & kMetaParams) != 0) {
    if (h.activation < 0 || h.activation > 4 || h.router_on_input > 1 || !std::isfinite(h.alpha) ||
        !(h.limit > 0.0f))
      fail(path, cat("invalid recorded model settings (activation code ", h.activation, ", alpha ",
                     h.alpha, ", limit ", h.limit, ", router side ", h.router_on_input, ")"));
    info.meta.has_params = true;
    info.meta.params.activation = static_cast<Activation>(h.activation);
    info.meta.params.alpha = h.alpha;
    info.meta.params.limit = h.limit;
    info.meta.params.apply_router_weight_on_input = h.router_on_input == 1;
  }
}

}  // namespace
}  // namespace detail

PackedFile::PackedFile() = default;
PackedFile::~PackedFile() = default;
PackedFile::PackedFile(PackedFile&&) noexcept = default;
PackedFile& PackedFile::operator=(PackedFile&&) noexcept = default;

PackedFile PackedFile::open(const std::string& path, const PackedFileOptions& options) {
  using namespace detail;
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) fail(path, cat("cannot open the file (", reason(errno), ")"));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail(path, cat("cannot read its size (", reason(errno), ")"));
  if (!S_ISREG(st.st_mode)) fail(path, "not a regular file");
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < kFileHeaderBytes)
    fail(path, cat("the file has ", size, " bytes, fewer than the ", kFileHeaderBytes,
                   "-byte header (truncated, or not a packed weights file)"));
  if (size > static_cast<uint64_t>(PTRDIFF_MAX)) fail(path, cat("the file is too large to load"));
  impl->bytes = static_cast<size_t>(size);

  if (options.copy) {
    if (impl->bytes > options.memory_limit)
      fail(path, cat("the file has ", impl->bytes, " bytes, more than the memory limit of ",
                     options.memory_limit, " bytes (PackedFileOptions::memory_limit)"));
    impl->copy = std::aligned_alloc(kFileHeaderBytes, round_up(impl->bytes, kFileHeaderBytes));
    if (impl->copy == nullptr) fail(path, cat("cannot allocate ", impl->bytes, " bytes"));
    auto* dst = static_cast<uint8_t*>(impl->copy);
    size_t done = 0;
    while (done < impl->bytes) {
      const ssize_t n = ::pread(fd.get(), dst + done, std::min(impl->bytes - done, size_t{1} << 30),
                                static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail(path, cat("cannot read the file (", reason(errno), ")"));
      if (n == 0)
        fail(path, cat("the file shrank while it was read (", done, " of ", impl->bytes,
                       " bytes): it changed during loading"));
      done += static_cast<size_t>(n);
    }
    impl->base = dst;
  } else {
    void* map = ::mmap(nullptr, impl->bytes, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (map == MAP_FAILED) fail(path, cat("cannot map the file (", reason(errno), ")"));
    impl->mapping = map;
    impl->base = static_cast<const uint8_t*>(map);
    if (options.verify_checksum) ::madvise(map, impl->bytes, MADV_WILLNEED);
  }
  fd.reset();
  verify(*impl, options);
  PackedFile file;
  file.impl_ = std::move(impl);
  return file;
}

std::span<const uint8_t> PackedFile::w13() const noexcept {
  return impl_ ? impl_->w13 : std::span<const uint8_t>{};
}

std::span<const uint8_t> PackedFile::w2() const noexcept {
  return impl_ ? impl_->w2 : std::span<const uint8_t>{};
}

const PackedFileInfo& PackedFile::info() const noexcept {
  static const PackedFileInfo empty{};
  return impl_ ? impl_->info : empty;
}

const std::string& PackedFile::path() const noexcept {
  static const std::string empty;
  return impl_ ? impl_->path : empty;
}

}  // namespace w4a8moe
