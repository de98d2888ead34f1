// Damaged and mismatched packed buffers rejected with a message by inspect_packed() and forward():
// magic, version, the layout record's fields, flipped header bytes, truncation, swapped roles and
// mismatched dimensions; the stored order of w13; a misaligned copy giving the same result.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "pack/packed_format.hpp"
#include "pack_test_util.hpp"
#include "test_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace {

using moe_test::Case;
using moe_test::CaseSpec;
using pack_test::copy_of;
using pack_test::PackedDamage;
using pack_test::small_spec;
using pack_test::with_header;
using w4a8moe::PackedWeights;

TEST_F(PackedDamage, IntactBuffersAreAccepted) {
  EXPECT_NO_THROW(w4a8moe::inspect_packed(packed_.w13.bytes()));
  w4a8moe::Context context(1);
  EXPECT_NO_THROW(moe_test::run_forward(case_, packed_, context));
}

TEST_F(PackedDamage, WrongMagic) {
  PackedWeights bad = copy_of(packed_.w13.bytes());
  bad.data()[0] ^= 0x20;
  expect_rejected(bad.bytes(), true, {"magic"});
}

TEST_F(PackedDamage, WrongVersion) {
  for (const uint32_t version : {0u, w4a8moe::kPackedFormatVersion + 1, 0xffffffffu}) {
    const PackedWeights bad =
        with_header(packed_.w2, [&](w4a8moe::detail::PackedHeader& h) { h.version = version; });
    expect_rejected(bad.bytes(), false, {"version", std::to_string(version)});
  }
}

// A buffer of the first format version (separate weight, scale, correction and bias sections
// per expert) is refused by name, not read as panel records.
TEST_F(PackedDamage, FirstFormatVersionIsRefusedByName) {
  const PackedWeights old =
      with_header(packed_.w13, [](w4a8moe::detail::PackedHeader& h) { h.version = 1; });
  expect_rejected(old.bytes(), true, {"version 2", "got version 1", "repack"});
}

TEST_F(PackedDamage, LayoutRecordFields) {
  const w4a8moe::detail::Geometry g = w4a8moe::detail::read_geometry(packed_.w13.bytes(), "w13");
  w4a8moe::detail::PackedHeader h;
  std::memcpy(&h, packed_.w13.bytes().data(), sizeof h);
  EXPECT_EQ(h.weight_format, 0u);
  EXPECT_EQ(h.block_rows, 64u);
  EXPECT_EQ(h.panel_bytes, g.panel_bytes);
  EXPECT_EQ(g.panel_bytes % 64, 0u);
  EXPECT_EQ(g.expert_bytes, static_cast<size_t>(g.panels) * g.panel_bytes);
  expect_rejected(
      with_header(packed_.w13, [](w4a8moe::detail::PackedHeader& x) { x.weight_format = 4; })
          .bytes(),
      true, {"weight format", "int4 symmetric", "int4 with zero points", "mxfp4", "int8", "got 4"});
  // int8 (a linear layer's format) under an MoE buffer's header: its group size gives it away
  expect_rejected(
      with_header(packed_.w13, [](w4a8moe::detail::PackedHeader& x) { x.weight_format = 3; })
          .bytes(),
      true, {"expected group size -1 for int8 weights"});
  // a zero-point buffer's records hold a section more: relabelled, the sizes give it away
  // (unless the records' 64-byte alignment absorbs the section; then it reads in bounds)
  const w4a8moe::detail::Geometry zg = w4a8moe::detail::make_geometry(
      g.layout, g.role, g.experts, g.rows, g.cols, g.group_size, g.scale_dtype, g.has_bias,
      w4a8moe::WeightFormat::int4_zero_point, "w13");
  if (zg.panel_bytes != g.panel_bytes)
    expect_rejected(
        with_header(packed_.w13, [](w4a8moe::detail::PackedHeader& x) { x.weight_format = 1; })
            .bytes(),
        true, {"sizes do not match"});
  // mxfp4 is only ever group 32 with bf16 scales: a header that says otherwise is damaged
  expect_rejected(
      with_header(packed_.w2, [](w4a8moe::detail::PackedHeader& x) { x.weight_format = 2; })
          .bytes(),
      false, {"group size 32 and bf16 scales for mxfp4", "got group size"});
  expect_rejected(
      with_header(packed_.w2, [](w4a8moe::detail::PackedHeader& x) { x.block_rows = 32; }).bytes(),
      false, {"blocks of 64 rows", "got 32"});
  expect_rejected(
      with_header(packed_.w2, [](w4a8moe::detail::PackedHeader& x) { x.panel_bytes += 64; })
          .bytes(),
      false, {"sizes do not match"});
}

// The stored order of w13: gate and up alternate in blocks of 64 rows, the last block of each
// part as long as what is left of it; every stored row holds exactly one logical row.
TEST(PackedGeometry, StoredRowsAlternateGateAndUpInBlocks) {
  for (const auto layout :
       {w4a8moe::detail::LayoutId::qs4_b32_rowmajor, w4a8moe::detail::LayoutId::qu4_p16k8,
        w4a8moe::detail::LayoutId::qu4_p8k8}) {
    for (const int64_t inter : {int64_t{8}, int64_t{64}, int64_t{100}, int64_t{768}}) {
      const w4a8moe::detail::Geometry g = w4a8moe::detail::make_geometry(
          layout, w4a8moe::WeightRole::w13, 1, 2 * inter, 64, 32, w4a8moe::DType::bf16, false,
          w4a8moe::WeightFormat::int4_symmetric, "w13");
      std::vector<int> seen(static_cast<size_t>(g.rows_padded), 0);
      for (int64_t n = 0; n < 2 * inter; ++n) {
        const int64_t pr = g.padded_row(n);
        ASSERT_GE(pr, 0);
        ASSERT_LT(pr, g.rows_padded);
        ++seen[static_cast<size_t>(pr)];
        const int64_t part = n / inter, j = n % inter, b0 = j / 64 * 64;
        // the block's gate rows, then its up rows, one run
        EXPECT_EQ(pr, 2 * b0 + part * g.block_len(b0) + (j - b0)) << "inter " << inter;
      }
      for (const int count : seen) EXPECT_LE(count, 1);
      EXPECT_EQ(g.stored_row(1, 0), inter >= 64 ? 64 : g.part_rows_padded);
    }
  }
}

TEST_F(PackedDamage, FlippedHeaderByte) {
  // Every byte of the header before the checksum: the checksum (or a field check) catches it.
  for (size_t i = 0; i < offsetof(w4a8moe::detail::PackedHeader, checksum); ++i) {
    SCOPED_TRACE("header byte " + std::to_string(i));
    PackedWeights bad = copy_of(packed_.w13.bytes());
    bad.data()[i] ^= 0x01;
    EXPECT_TRUE(moe_test::throws_error([&] { w4a8moe::inspect_packed(bad.bytes(), "buffer"); },
                                       {"buffer"}));
  }
  PackedWeights bad = copy_of(packed_.w13.bytes());
  bad.data()[40] ^= 0x10;  // inside the header, not in the magic
  expect_rejected(bad.bytes(), true, {"corrupt"});
}

TEST_F(PackedDamage, UnknownLayoutOrRole) {
  const PackedWeights layout =
      with_header(packed_.w13, [](w4a8moe::detail::PackedHeader& h) { h.layout = 99; });
  expect_rejected(layout.bytes(), true, {"layout", "99"});
  const PackedWeights role =
      with_header(packed_.w13, [](w4a8moe::detail::PackedHeader& h) { h.role = 7; });
  expect_rejected(role.bytes(), true, {"role"});
}

TEST_F(PackedDamage, TruncatedOrPadded) {
  const std::span<const uint8_t> full = packed_.w13.bytes();
  const PackedWeights shorter = copy_of(full.first(full.size() - 1));
  expect_rejected(shorter.bytes(), true, {std::to_string(full.size())});
  PackedWeights longer = PackedWeights::allocate(full.size() + 1);
  std::memcpy(longer.data(), full.data(), full.size());
  expect_rejected(longer.bytes(), true, {std::to_string(full.size())});
  const PackedWeights header_only = copy_of(full.first(64));
  expect_rejected(header_only.bytes(), true, {"bytes"});
  expect_rejected({}, true, {"bytes"});
}

TEST_F(PackedDamage, RolesSwapped) {
  w4a8moe::Context context(1);
  moe_test::Output out = moe_test::make_output(case_);
  const auto run = [&](std::span<const uint8_t> w13, std::span<const uint8_t> w2) {
    return [&, w13, w2] {
      w4a8moe::forward(context, case_.x_view(), case_.ids_view(), case_.topk_weights_view(), w13,
                       w2, case_.params(), out.view());
    };
  };
  EXPECT_TRUE(
      moe_test::throws_error(run(packed_.w2.bytes(), packed_.w13.bytes()), {"w13_packed", "w2"}));
  EXPECT_TRUE(
      moe_test::throws_error(run(packed_.w13.bytes(), packed_.w13.bytes()), {"w2_packed", "w13"}));
}

TEST_F(PackedDamage, MismatchedDimensions) {
  w4a8moe::Context context(1);
  const auto forward_with = [&](const Case& x_case, const moe_test::PackedPair& w13_from,
                                const moe_test::PackedPair& w2_from) {
    return [&] {
      moe_test::Output out = moe_test::make_output(x_case);
      w4a8moe::forward(context, x_case.x_view(), x_case.ids_view(), x_case.topk_weights_view(),
                       w13_from.w13.bytes(), w2_from.w2.bytes(), x_case.params(), out.view());
    };
  };
  CaseSpec s = small_spec();
  s.hidden = 512;  // H differs
  const moe_test::PackedPair other_h = pack(moe_test::make_case(s));
  s = small_spec();
  s.inter = 64;  // I differs
  const moe_test::PackedPair other_i = pack(moe_test::make_case(s));
  s = small_spec();
  s.experts = 4;  // E differs
  const moe_test::PackedPair other_e = pack(moe_test::make_case(s));
  s = small_spec(128);  // group size differs
  const moe_test::PackedPair other_g = pack(moe_test::make_case(s));

  EXPECT_TRUE(moe_test::throws_error(forward_with(case_, packed_, other_h), {"w2_packed"}));
  EXPECT_TRUE(moe_test::throws_error(forward_with(case_, packed_, other_i), {"w2_packed"}));
  EXPECT_TRUE(moe_test::throws_error(forward_with(case_, packed_, other_e), {"w2_packed"}));
  EXPECT_TRUE(
      moe_test::throws_error(forward_with(case_, packed_, other_g), {"w2_packed", "group"}));
  // x with H = 256 against weights of H = 512
  EXPECT_TRUE(moe_test::throws_error(forward_with(case_, other_h, other_h), {"x", "512"}));
}

TEST_F(PackedDamage, MisalignedCopyGivesTheSameResult) {
  // The packed bytes may be copied anywhere (a file, a torch tensor): forward() must not assume
  // the 64-byte alignment of PackedWeights.
  w4a8moe::Context context(2);
  const moe_test::Output expected = moe_test::run_forward(case_, packed_, context);
  std::vector<uint8_t> w13(packed_.w13.size() + 3), w2(packed_.w2.size() + 5);
  std::memcpy(w13.data() + 3, packed_.w13.bytes().data(), packed_.w13.size());
  std::memcpy(w2.data() + 5, packed_.w2.bytes().data(), packed_.w2.size());
  moe_test::Output out = moe_test::make_output(case_);
  w4a8moe::forward(context, case_.x_view(), case_.ids_view(), case_.topk_weights_view(),
                   std::span<const uint8_t>(w13).subspan(3),
                   std::span<const uint8_t>(w2).subspan(5), case_.params(), out.view());
  EXPECT_EQ(out.bytes, expected.bytes);
}

}  // namespace
