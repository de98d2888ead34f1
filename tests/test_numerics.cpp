// The library's scalar conversions (src/common/numeric.hpp) against the reference's independent
// ones: every 16-bit pattern one way, many f32 values the other way, and the edge cases named.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/numeric.hpp"
#include "reference/reference.hpp"
#include "test_util.hpp"

namespace {

namespace lib = w4a8moe::detail;

bool same_float(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);  // +0 and -0 differ
}

// Equal bits, or both NaN (the NaN payload is not part of the contract).
bool same_bf16(uint16_t a, uint16_t b) {
  const bool nan_a = (a & 0x7fff) > 0x7f80, nan_b = (b & 0x7fff) > 0x7f80;
  return nan_a || nan_b ? nan_a && nan_b : a == b;
}
bool same_f16(uint16_t a, uint16_t b) {
  const bool nan_a = (a & 0x7fff) > 0x7c00, nan_b = (b & 0x7fff) > 0x7c00;
  return nan_a || nan_b ? nan_a && nan_b : a == b;
}

TEST(Numerics, Bf16ToF32MatchesReferenceForEveryPattern) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const auto b = static_cast<uint16_t>(h);
    ASSERT_TRUE(same_float(lib::bf16_to_f32(b), moe_ref::bf16_to_f32(b)))
        << "bf16 0x" << std::hex << h;
  }
}

TEST(Numerics, F16ToF32MatchesReferenceForEveryPattern) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const auto b = static_cast<uint16_t>(h);
    ASSERT_TRUE(same_float(lib::f16_to_f32(b), moe_ref::f16_to_f32(b)))
        << "f16 0x" << std::hex << h;
  }
}

TEST(Numerics, SixteenBitRoundTripIsExactForEveryFinitePattern) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const auto b = static_cast<uint16_t>(h);
    if ((b & 0x7fff) <= 0x7f80) {
      ASSERT_EQ(lib::f32_to_bf16(lib::bf16_to_f32(b)), b) << "bf16 0x" << std::hex << h;
    }
    if ((b & 0x7fff) <= 0x7c00) {
      ASSERT_EQ(lib::f32_to_f16(lib::f16_to_f32(b)), b) << "f16 0x" << std::hex << h;
    }
  }
}

// f32 values that sit on and next to every 16-bit rounding boundary: for each 16-bit pattern,
// the exact midpoint to the next pattern and its two f32 neighbours, plus the pattern itself.
TEST(Numerics, F32ToSixteenBitMatchesReferenceAroundEveryBoundary) {
  int64_t checked = 0;
  for (uint32_t h = 0; h <= 0x7fff; ++h) {
    for (const bool negative : {false, true}) {
      const uint16_t sign = negative ? 0x8000 : 0;
      const auto b = static_cast<uint16_t>(h | sign);
      // bf16 midpoints: the pattern's f32 bits plus half a bf16 step (0x8000)
      const uint32_t bits = static_cast<uint32_t>(b) << 16;
      for (const uint32_t v : {bits, bits + 0x7fffu, bits + 0x8000u, bits + 0x8001u}) {
        const float f = std::bit_cast<float>(v);
        ASSERT_TRUE(same_bf16(lib::f32_to_bf16(f), moe_ref::f32_to_bf16(f)))
            << "f32 0x" << std::hex << v << " (" << f << "): library 0x" << lib::f32_to_bf16(f)
            << ", reference 0x" << moe_ref::f32_to_bf16(f);
        ++checked;
      }
      // f16 midpoints: halfway to the next pattern, and its neighbours in f32
      if (h < 0x7c00) {
        const float lo = moe_ref::f16_to_f32(b);
        const float hi = moe_ref::f16_to_f32(static_cast<uint16_t>(b + 1));
        const float mid = static_cast<float>((static_cast<double>(lo) + static_cast<double>(hi)) /
                                             2.0);  // exact in f32
        for (const float f : {lo, std::nextafter(mid, lo), mid, std::nextafter(mid, hi)}) {
          ASSERT_TRUE(same_f16(lib::f32_to_f16(f), moe_ref::f32_to_f16(f)))
              << "f32 " << f << " (0x" << std::hex << std::bit_cast<uint32_t>(f) << "): library 0x"
              << lib::f32_to_f16(f) << ", reference 0x" << moe_ref::f32_to_f16(f);
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 400000);
}

TEST(Numerics, F32ToSixteenBitMatchesReferenceOnRandomBitPatterns) {
  moe_test::Rng rng(20240601);
  for (int i = 0; i < 2000000; ++i) {
    const auto bits = static_cast<uint32_t>(rng.next());
    const float f = std::bit_cast<float>(bits);
    ASSERT_TRUE(same_bf16(lib::f32_to_bf16(f), moe_ref::f32_to_bf16(f)))
        << "f32 0x" << std::hex << bits;
    ASSERT_TRUE(same_f16(lib::f32_to_f16(f), moe_ref::f32_to_f16(f)))
        << "f32 0x" << std::hex << bits;
  }
}

// A random f32 whose exponent is where f16 is normal or subnormal (random bit patterns are mostly
// outside it); `bits` gets its bit pattern.
float random_float_in_f16_range(moe_test::Rng& rng, uint32_t& bits) {
  const uint32_t exponent = static_cast<uint32_t>(rng.integer(127 - 30, 127 + 16)) << 23;
  bits = (static_cast<uint32_t>(rng.next()) & 0x807fffffu) | exponent;
  return std::bit_cast<float>(bits);
}

TEST(Numerics, F32ToSixteenBitMatchesReferenceInTheF16Range) {
  moe_test::Rng rng(7);
  for (int i = 0; i < 1000000; ++i) {
    uint32_t bits = 0;
    const float f = random_float_in_f16_range(rng, bits);
    ASSERT_TRUE(same_f16(lib::f32_to_f16(f), moe_ref::f32_to_f16(f)))
        << "f32 0x" << std::hex << bits << " (" << f << ")";
  }
}

#if defined(__aarch64__)  // GCC 12 has no _Float16 in C++ on AArch64; __fp16 is IEEE there
#define W4A8MOE_COMPILER_F16 __fp16
#elif defined(__FLT16_MAX__)
#define W4A8MOE_COMPILER_F16 _Float16
#endif
#ifdef W4A8MOE_COMPILER_F16
// A third opinion for f16: the compiler's own _Float16 conversion (IEEE round to nearest even).
TEST(Numerics, ReferenceF16AgreesWithCompilerFloat16) {
  moe_test::Rng rng(99);
  for (int i = 0; i < 1000000; ++i) {
    uint32_t bits = 0;
    const float f = random_float_in_f16_range(rng, bits);
    const auto h = static_cast<W4A8MOE_COMPILER_F16>(f);
    ASSERT_EQ(moe_ref::f32_to_f16(f), std::bit_cast<uint16_t>(h)) << "f32 0x" << std::hex << bits;
    ASSERT_TRUE(same_float(moe_ref::f16_to_f32(std::bit_cast<uint16_t>(h)), static_cast<float>(h)));
  }
}
#endif

TEST(Numerics, RoundsToNearestEvenOnTies) {
  // 1 + 2^-8 is halfway between bf16 1 and 1 + 2^-7: ties go to the even mantissa (1).
  EXPECT_EQ(lib::f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
  EXPECT_EQ(lib::f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
  EXPECT_EQ(lib::f32_to_f16(1.0f + 0x1p-11f), 0x3c00);
  EXPECT_EQ(lib::f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);
  // f16 subnormal ties: 0.5 and 1.5 times 2^-24
  EXPECT_EQ(lib::f32_to_f16(0x1p-25f), 0x0000);
  EXPECT_EQ(lib::f32_to_f16(1.5f * 0x1p-24f), 0x0002);
  EXPECT_EQ(lib::f32_to_f16(-0x1p-25f), 0x8000);
}

TEST(Numerics, NanStaysNanAndInfinityStaysInfinity) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const float snan = std::bit_cast<float>(0x7f800001u);  // payload only in the low bits
  for (const float f : {nan, -nan, snan}) {
    EXPECT_TRUE(std::isnan(lib::bf16_to_f32(lib::f32_to_bf16(f)))) << f;
    EXPECT_TRUE(std::isnan(lib::f16_to_f32(lib::f32_to_f16(f)))) << f;
  }
  EXPECT_EQ(lib::f32_to_bf16(inf), 0x7f80);
  EXPECT_EQ(lib::f32_to_bf16(-inf), 0xff80);
  EXPECT_EQ(lib::f32_to_f16(inf), 0x7c00);
  EXPECT_EQ(lib::f32_to_f16(-inf), 0xfc00);
  EXPECT_TRUE(std::isnan(lib::f16_to_f32(0x7e00)));
  EXPECT_TRUE(std::isnan(lib::f16_to_f32(0x7c01)));
  EXPECT_EQ(lib::f16_to_f32(0xfc00), -inf);
}

TEST(Numerics, OverflowGoesToInfinity) {
  EXPECT_EQ(lib::f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(lib::f32_to_f16(65519.99f), 0x7bff);
  EXPECT_EQ(lib::f32_to_f16(65520.0f), 0x7c00);  // the midpoint to 65536 rounds to even: inf
  EXPECT_EQ(lib::f32_to_f16(-1e6f), 0xfc00);
  EXPECT_EQ(lib::f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(lib::f32_to_bf16(std::bit_cast<float>(0x7f7f7fffu)), 0x7f7f);
  EXPECT_EQ(lib::f32_to_bf16(std::bit_cast<float>(0x7f7f8000u)), 0x7f80);
}

TEST(Numerics, SubnormalsConvert) {
  EXPECT_EQ(lib::f16_to_f32(0x0001), 0x1p-24f);
  EXPECT_EQ(lib::f16_to_f32(0x03ff), 1023 * 0x1p-24f);
  EXPECT_EQ(lib::f32_to_f16(0x1p-24f), 0x0001);
  EXPECT_EQ(lib::f32_to_f16(1023 * 0x1p-24f), 0x03ff);
  EXPECT_EQ(lib::f32_to_f16(1023.5f * 0x1p-24f), 0x0400);  // rounds up into the normals
  EXPECT_EQ(lib::f32_to_f16(0x1p-26f), 0x0000);
  EXPECT_EQ(lib::f32_to_f16(-0.0f), 0x8000);
  const float f32_subnormal = std::bit_cast<float>(0x00012345u);
  EXPECT_EQ(lib::f32_to_bf16(f32_subnormal), 0x0001);
  EXPECT_EQ(lib::bf16_to_f32(0x0001), std::bit_cast<float>(0x00010000u));
}

TEST(Numerics, LoadAndStoreFloatUseTheConversions) {
  const uint16_t b = 0x4049;  // bf16 3.140625
  const uint16_t h = 0x4248;  // f16 3.140625
  EXPECT_EQ(lib::load_float(&b, w4a8moe::DType::bf16, 0), 3.140625f);
  EXPECT_EQ(lib::load_float(&h, w4a8moe::DType::f16, 0), 3.140625f);
  uint16_t out = 0;
  lib::store_float(&out, w4a8moe::DType::bf16, 0, 3.14159265f);
  EXPECT_EQ(out, moe_ref::f32_to_bf16(3.14159265f));
  lib::store_float(&out, w4a8moe::DType::f16, 0, 3.14159265f);
  EXPECT_EQ(out, moe_ref::f32_to_f16(3.14159265f));
  const int64_t ids64[2] = {5, -3};
  const int32_t ids32[2] = {7, -1};
  EXPECT_EQ(lib::load_index(ids64, w4a8moe::DType::i64, 1), -3);
  EXPECT_EQ(lib::load_index(ids32, w4a8moe::DType::i32, 1), -1);
}

}  // namespace
