// Helpers of the packing suites (test_pack.cpp, test_pack_damage.cpp, test_pack_formats.cpp; the
// relabelled headers of test_linear_int8.cpp): byte comparison and copies of packed buffers, a
// copy with its header changed, the small case they pack, the fixture packing for the active
// kernel set, and the one that damages buffers and expects them refused.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

#include "pack/packed_format.hpp"
#include "test_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace pack_test {

inline bool same_bytes(const w4a8moe::PackedWeights& a, const w4a8moe::PackedWeights& b) {
  return a.size() == b.size() && std::memcmp(a.bytes().data(), b.bytes().data(), a.size()) == 0;
}

inline w4a8moe::PackedWeights copy_of(std::span<const uint8_t> bytes) {
  w4a8moe::PackedWeights p = w4a8moe::PackedWeights::allocate(bytes.size());
  std::memcpy(p.data(), bytes.data(), bytes.size());
  return p;
}

// A copy with the header changed and its checksum made valid again, so that the check of the
// changed field (not the checksum) must catch it.
inline w4a8moe::PackedWeights with_header(
    const w4a8moe::PackedWeights& w,
    const std::function<void(w4a8moe::detail::PackedHeader&)>& change) {
  w4a8moe::PackedWeights copy = copy_of(w.bytes());
  w4a8moe::detail::PackedHeader h;
  std::memcpy(&h, copy.data(), sizeof h);
  change(h);
  h.checksum = w4a8moe::detail::header_checksum(h);
  std::memcpy(copy.data(), &h, sizeof h);
  return copy;
}

inline moe_test::CaseSpec small_spec(int group_size = 64) {
  return {.tokens = 5, .experts = 3, .group_size = group_size, .seed = 17};  // H 256, I 128
}

// Packs for the active kernel set (CTest runs the suite once per set, capping the ISA with
// W4A8MOE_ISA).
class Pack : public testing::Test {
 protected:
  static std::string kernel_set() { return w4a8moe::active_kernel_set(); }
  static moe_test::PackedPair pack(const moe_test::Case& c) {
    return moe_test::pack(c, kernel_set());
  }
};

class PackedDamage : public Pack {
 protected:
  void SetUp() override {
    case_ = moe_test::make_case(small_spec());
    packed_ = pack(case_);
  }

  // inspect_packed and forward (as w13 or as w2) both reject `bytes` naming the argument.
  void expect_rejected(std::span<const uint8_t> bytes, bool as_w13,
                       std::initializer_list<std::string_view> fragments) {
    EXPECT_TRUE(
        moe_test::throws_error([&] { w4a8moe::inspect_packed(bytes, "buffer"); }, fragments));
    EXPECT_TRUE(
        moe_test::throws_error([&] { w4a8moe::inspect_packed(bytes, "buffer"); }, {"buffer"}));
    const auto run = [&] {
      w4a8moe::Context context(1);
      moe_test::Output out = moe_test::make_output(case_);
      w4a8moe::forward(context, case_.x_view(), case_.ids_view(), case_.topk_weights_view(),
                       as_w13 ? bytes : packed_.w13.bytes(), as_w13 ? packed_.w2.bytes() : bytes,
                       case_.params(), out.view());
    };
    EXPECT_TRUE(moe_test::throws_error(run, fragments));
    EXPECT_TRUE(moe_test::throws_error(run, {as_w13 ? "w13_packed" : "w2_packed"}));
  }

  moe_test::Case case_;
  moe_test::PackedPair packed_;
};

}  // namespace pack_test
