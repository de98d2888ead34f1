// Fuzz target: the packed weight file loader (PackedFile::open, mapped and copied) and forward()
// on the buffers of a file it accepted. Input: [flags][file bytes].
// flags bit 0: rewrite the file header's checksum; bit 1: rewrite the payload checksum (so that
// mutated fields and payloads reach the deeper checks); bit 2: open a copy without verifying the
// checksum (the buffers' own checks must still hold).
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/xxhash64.hpp"
#include "fuzz_common.hpp"

W4A8MOE_FUZZ_TARGET(packed_file) {
  if (size == 0) return 0;
  const uint8_t flags = data[0];
  std::vector<uint8_t> bytes(data + 1, data + size);
  constexpr size_t kHeader = 4096, kPayloadSumAt = 96, kHeaderSumAt = 248;
  if ((flags & 2) != 0 && bytes.size() >= kHeader) {
    const uint64_t sum = w4a8moe::detail::Xxh64::of(bytes.data() + kHeader, bytes.size() - kHeader);
    std::memcpy(bytes.data() + kPayloadSumAt, &sum, 8);
  }
  if ((flags & 1) != 0 && bytes.size() >= kHeaderSumAt + 8) {
    const uint64_t sum = w4a8moe::detail::Xxh64::of(bytes.data(), kHeaderSumAt);
    std::memcpy(bytes.data() + kHeaderSumAt, &sum, 8);
  }
  const w4a8moe::fuzz::MemFile file(bytes);
  w4a8moe::PackedFileOptions options;
  options.copy = (flags & 4) != 0;
  options.verify_checksum = (flags & 4) == 0;
  options.memory_limit = size_t{64} << 20;
  try {
    const w4a8moe::PackedFile f = w4a8moe::PackedFile::open(file.path(), options);
    w4a8moe::fuzz::Reader r(data, size);
    w4a8moe::fuzz::forward_on_one_and_two_threads(f.w13(), f.w2(), r);
  } catch (const w4a8moe::Error&) {
  }
  return 0;
}
