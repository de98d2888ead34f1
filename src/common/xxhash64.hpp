// XXH64 (xxHash, 64-bit, by Yann Collet; the published algorithm, seed 0 unless given): the
// checksum of packed weight files. Several GB/s per core, so verifying a file on load costs about
// the time of reading it once. Streaming: update() any number of times, then digest().
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace w4a8moe::detail {

class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed = 0) noexcept
      : v_{seed + kP1 + kP2, seed + kP2, seed, seed - kP1}, seed_(seed) {}

  void update(const void* data, size_t bytes) noexcept {
    const auto* p = static_cast<const uint8_t*>(data);
    total_ += bytes;
    if (buffered_ + bytes < 32) {
      if (bytes > 0) std::memcpy(buffer_ + buffered_, p, bytes);
      buffered_ += bytes;
      return;
    }
    if (buffered_ > 0) {  // complete the pending stripe
      const size_t fill = 32 - buffered_;
      std::memcpy(buffer_ + buffered_, p, fill);
      stripe(buffer_);
      p += fill;
      bytes -= fill;
      buffered_ = 0;
    }
    for (; bytes >= 32; p += 32, bytes -= 32) stripe(p);
    if (bytes > 0) std::memcpy(buffer_, p, bytes);
    buffered_ = bytes;
  }

  uint64_t digest() const noexcept {
    uint64_t h;
    if (total_ >= 32) {
      h = std::rotl(v_[0], 1) + std::rotl(v_[1], 7) + std::rotl(v_[2], 12) + std::rotl(v_[3], 18);
      for (const uint64_t v : v_) h = (h ^ round(0, v)) * kP1 + kP4;
    } else {
      h = seed_ + kP5;
    }
    h += total_;
    const uint8_t* p = buffer_;
    size_t n = buffered_;
    for (; n >= 8; p += 8, n -= 8) h = std::rotl(h ^ round(0, read64(p)), 27) * kP1 + kP4;
    if (n >= 4) {
      h = std::rotl(h ^ (uint64_t{read32(p)} * kP1), 23) * kP2 + kP3;
      p += 4;
      n -= 4;
    }
    for (; n > 0; ++p, --n) h = std::rotl(h ^ (uint64_t{*p} * kP5), 11) * kP1;
    h ^= h >> 33;
    h *= kP2;
    h ^= h >> 29;
    h *= kP3;
    h ^= h >> 32;
    return h;
  }

  static uint64_t of(const void* data, size_t bytes, uint64_t seed = 0) noexcept {
    Xxh64 h(seed);
    h.update(data, bytes);
    return h.digest();
  }

 private:
  static constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull;
  static constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4Full;
  static constexpr uint64_t kP3 = 0x165667B19E3779F9ull;
  static constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ull;
  static constexpr uint64_t kP5 = 0x27D4EB2F165667C5ull;
  static_assert(std::endian::native == std::endian::little, "XXH64 reads little-endian words");

  static uint64_t read64(const uint8_t* p) noexcept {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
  }
  static uint32_t read32(const uint8_t* p) noexcept {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
  static uint64_t round(uint64_t acc, uint64_t input) noexcept {
    return std::rotl(acc + input * kP2, 31) * kP1;
  }
  void stripe(const uint8_t* p) noexcept {
    for (int i = 0; i < 4; ++i) v_[i] = round(v_[i], read64(p + 8 * i));
  }

  uint64_t v_[4];
  uint64_t seed_;
  uint64_t total_ = 0;
  uint8_t buffer_[32] = {};
  size_t buffered_ = 0;
};

}  // namespace w4a8moe::detail
