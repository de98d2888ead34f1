// Scalar conversions between f32 and the 16-bit float formats, and rounding helpers.
// Portable bit manipulation: exact, independent of the compiler's _Float16 support.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

inline float bf16_to_f32(uint16_t h) noexcept { return std::bit_cast<float>(uint32_t{h} << 16); }

// Round to nearest even; NaN stays NaN (quiet).
inline uint16_t f32_to_bf16(float f) noexcept {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) noexcept {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: value = man * 2^-24, exact in f32
    const float v = static_cast<float>(man) * 0x1p-24f;
    return sign ? -v : v;
  }
  return std::bit_cast<float>(bits);
}

// Round to nearest even, overflow to infinity, NaN stays NaN.
inline uint16_t f32_to_f16(float f) noexcept {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520
  if (abs < 0x38800000u) {  // below the smallest normal f16 (2^-14): subnormal or zero
    // value / 2^-24, rounded to nearest even, is the subnormal mantissa
    const float scaled = std::bit_cast<float>(abs) * 0x1p24f;
    const float r = std::nearbyint(scaled);  // default rounding mode: nearest even
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r));
  }
  // normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even
  uint32_t v = abs - (112u << 23);
  v += 0xfffu + ((v >> 13) & 1u);
  return static_cast<uint16_t>(sign | static_cast<uint16_t>(v >> 13));
}

// Element i of a float tensor of dtype f32, bf16 or f16, as f32. Reads through memcpy: tensors
// and packed buffers handed in by callers need not be aligned.
inline float load_float(const void* base, DType dtype, int64_t i) noexcept {
  const auto* bytes = static_cast<const unsigned char*>(base);
  if (dtype == DType::bf16 || dtype == DType::f16) {
    uint16_t h;
    std::memcpy(&h, bytes + i * 2, 2);
    return dtype == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
  }
  float f;
  std::memcpy(&f, bytes + i * 4, 4);
  return f;
}

inline void store_float(void* base, DType dtype, int64_t i, float v) noexcept {
  auto* bytes = static_cast<unsigned char*>(base);
  if (dtype == DType::bf16 || dtype == DType::f16) {
    const uint16_t h = dtype == DType::bf16 ? f32_to_bf16(v) : f32_to_f16(v);
    std::memcpy(bytes + i * 2, &h, 2);
    return;
  }
  std::memcpy(bytes + i * 4, &v, 4);
}

// Element i of an integer tensor of dtype i32 or i64.
inline int64_t load_index(const void* base, DType dtype, int64_t i) noexcept {
  const auto* bytes = static_cast<const unsigned char*>(base);
  if (dtype == DType::i64) {
    int64_t v;
    std::memcpy(&v, bytes + i * 8, 8);
    return v;
  }
  int32_t v;
  std::memcpy(&v, bytes + i * 4, 4);
  return v;
}

inline bool is_float_dtype(DType d) noexcept {
  return d == DType::f32 || d == DType::bf16 || d == DType::f16;
}

}  // namespace w4a8moe::detail
