// Fuzz target: the packed buffer header check (inspect_packed) and forward() on fuzzed buffers.
// Input: [flags][w13 size: 3 bytes][w2 size: 3 bytes][w13 bytes][w2 bytes][choices for forward].
// flags bit 0/1: rewrite w13's/w2's header checksum (so that mutated header fields reach the
// deeper checks); bits 2-4: misalign both buffers by that many bytes.
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz_common.hpp"
#include "pack/packed_format.hpp"

namespace {

// A copy of `bytes` at `misalign` bytes past a 64-byte boundary, its header checksum rewritten
// when asked; exactly sized so that reads past the end are seen by AddressSanitizer.
struct Copy {
  std::vector<uint8_t> storage;
  std::span<const uint8_t> bytes;
  Copy(std::span<const uint8_t> in, size_t misalign, bool reseal) : storage(in.size() + misalign) {
    if (!in.empty()) std::memcpy(storage.data() + misalign, in.data(), in.size());
    if (reseal && in.size() >= w4a8moe::detail::kHeaderBytes) {
      w4a8moe::detail::PackedHeader h;
      std::memcpy(&h, storage.data() + misalign, sizeof h);
      h.checksum = w4a8moe::detail::header_checksum(h);
      std::memcpy(storage.data() + misalign, &h, sizeof h);
    }
    bytes = std::span<const uint8_t>(storage).subspan(misalign);
  }
};

}  // namespace

W4A8MOE_FUZZ_TARGET(packed) {
  w4a8moe::fuzz::Reader r(data, size);
  const uint8_t flags = r.u8();
  const auto size24 = [&] {
    const size_t hi = r.u8(), mid = r.u8();
    return (hi << 16) | (mid << 8) | r.u8();
  };
  const size_t w13_size = size24(), w2_size = size24();
  const size_t misalign = (flags >> 2) & 7;
  const Copy w13(r.take(w13_size), misalign, (flags & 1) != 0);
  const Copy w2(r.take(w2_size), misalign, (flags & 2) != 0);
  try {
    w4a8moe::inspect_packed(w13.bytes, "w13");
  } catch (const w4a8moe::Error&) {
  }
  try {
    w4a8moe::inspect_packed(w2.bytes, "w2");
  } catch (const w4a8moe::Error&) {
  }
  try {
    w4a8moe::fuzz::forward_on_one_and_two_threads(w13.bytes, w2.bytes, r);
  } catch (const w4a8moe::Error&) {
  }
  return 0;
}
