// pack_w13 / pack_w2 and inspect_packed: what the header says, equivalent inputs giving the same
// bytes, the scale storage option, and damaged or mismatched buffers rejected with a message by
// inspect_packed() and forward(). Every kernel set of the build packs its own layout.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "pack/packed_format.hpp"
#include "reference/reference.hpp"
#include "test_util.hpp"
#include "w4a8moe/expert_packer.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace {

using moe_test::Case;
using moe_test::CaseSpec;
using moe_test::DType;
using w4a8moe::PackedWeights;
using w4a8moe::TensorView;

bool same_bytes(const PackedWeights& a, const PackedWeights& b) {
  return a.size() == b.size() && std::memcmp(a.bytes().data(), b.bytes().data(), a.size()) == 0;
}

PackedWeights copy_of(std::span<const uint8_t> bytes) {
  PackedWeights p = PackedWeights::allocate(bytes.size());
  std::memcpy(p.data(), bytes.data(), bytes.size());
  return p;
}

CaseSpec small_spec(int group_size = 64) {
  return {.tokens = 5, .experts = 3, .group_size = group_size, .seed = 17};  // H 256, I 128
}

// Packs for the active kernel set (CTest runs the suite once per set, capping the ISA with
// W4A8MOE_ISA).
class Pack : public testing::Test {
 protected:
  static std::string kernel_set() { return w4a8moe::active_kernel_set(); }
  static moe_test::PackedPair pack(const Case& c) { return moe_test::pack(c, kernel_set()); }
};

// ---- the header --------------------------------------------------------------------------------

TEST_F(Pack, HeaderDescribesTheWeights) {
  for (const int g : {-1, 32, 64, 128})
    for (const bool bias : {false, true})
      for (const DType sd : {DType::f32, DType::bf16, DType::f16}) {
        CaseSpec s = small_spec(g);
        s.bias = bias;
        s.scale_dtype = sd;
        SCOPED_TRACE(moe_test::describe(s));
        const Case c = moe_test::make_case(s);
        const moe_test::PackedPair p = pack(c);
        for (const bool is_w13 : {true, false}) {
          const PackedWeights& w = is_w13 ? p.w13 : p.w2;
          const w4a8moe::PackedInfo info = w4a8moe::inspect_packed(w.bytes());
          EXPECT_EQ(info.version, w4a8moe::kPackedFormatVersion);
          EXPECT_FALSE(info.layout.empty());
          EXPECT_EQ(info.role, is_w13 ? w4a8moe::WeightRole::w13 : w4a8moe::WeightRole::w2);
          EXPECT_EQ(info.experts, s.experts);
          EXPECT_EQ(info.rows, is_w13 ? 2 * s.inter : s.hidden);
          EXPECT_EQ(info.cols, is_w13 ? s.hidden : s.inter);
          EXPECT_EQ(info.group_size, g);
          EXPECT_EQ(info.scale_dtype, sd);
          EXPECT_EQ(info.has_bias, bias);
          EXPECT_EQ(info.total_bytes, w.size());
          EXPECT_GT(info.expert_bytes, 0u);
          EXPECT_LE(info.expert_bytes * static_cast<size_t>(s.experts), info.total_bytes);
          EXPECT_EQ(reinterpret_cast<uintptr_t>(w.bytes().data()) % 64, 0u);
          // info() is inspect_packed(bytes())
          const w4a8moe::PackedInfo again = w.info();
          EXPECT_EQ(again.layout, info.layout);
          EXPECT_EQ(again.total_bytes, info.total_bytes);
        }
        EXPECT_EQ(p.w13.info().layout, p.w2.info().layout);
      }
}

TEST(PackLayout, ScalarSetUsesTheRowMajorLayout) {
  const Case c = moe_test::make_case(small_spec());
  EXPECT_EQ(moe_test::pack(c, "scalar").w13.info().layout, "qs4_b32_rowmajor");
}

TEST_F(Pack, IsDeterministic) {
  CaseSpec s = small_spec();
  s.experts = 7;  // more experts than packing threads
  const Case c = moe_test::make_case(s);
  const moe_test::PackedPair a = pack(c), b = pack(c);
  EXPECT_TRUE(same_bytes(a.w13, b.w13));
  EXPECT_TRUE(same_bytes(a.w2, b.w2));
}

// ---- equivalent inputs, identical bytes --------------------------------------------------------

TEST_F(Pack, NibblePackedInputGivesTheSameBytesAsInt8) {
  for (const int g : {-1, 32, 128}) {
    CaseSpec s = small_spec(g);
    s.bias = true;
    SCOPED_TRACE(moe_test::describe(s));
    const Case c = moe_test::make_case(s);
    s.nibbles = true;
    const Case n = moe_test::make_case(s);  // same seed: same values, given as nibbles
    ASSERT_EQ(c.w13, n.w13);
    const moe_test::PackedPair a = pack(c), b = pack(n);
    EXPECT_TRUE(same_bytes(a.w13, b.w13));
    EXPECT_TRUE(same_bytes(a.w2, b.w2));
  }
  // channelwise with input dimensions that are not multiples of 32
  CaseSpec s = small_spec(-1);
  s.hidden = 200;
  s.inter = 72;
  const Case c = moe_test::make_case(s);
  s.nibbles = true;
  const Case n = moe_test::make_case(s);
  const moe_test::PackedPair a = pack(c), b = pack(n);
  EXPECT_TRUE(same_bytes(a.w13, b.w13));
  EXPECT_TRUE(same_bytes(a.w2, b.w2));
}

// Rows of w13 (and of its scales and bias) from interleaved to halves order.
template <class T>
std::vector<T> deinterleave(const std::vector<T>& v, int64_t experts, int64_t inter,
                            int64_t row_len) {
  std::vector<T> out(v.size());
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t n = 0; n < 2 * inter; ++n) {
      const int64_t src = n < inter ? 2 * n : 2 * (n - inter) + 1;
      std::memcpy(&out[static_cast<size_t>((e * 2 * inter + n) * row_len)],
                  &v[static_cast<size_t>((e * 2 * inter + src) * row_len)], sizeof(T) * row_len);
    }
  return out;
}

TEST_F(Pack, InterleavedGateUpGivesTheSameBytesAsHalves) {
  for (const int g : {-1, 64})
    for (const bool nibbles : {false, true}) {
      CaseSpec s = small_spec(g);
      s.bias = true;
      s.interleaved = true;
      s.nibbles = nibbles;
      s.scale_dtype = DType::bf16;
      SCOPED_TRACE(moe_test::describe(s));
      const Case c = moe_test::make_case(s);
      const int64_t E = s.experts, I = s.inter, H = s.hidden;
      const int64_t groups = g < 0 ? 1 : H / g;
      const std::vector<int8_t> w13 = deinterleave(c.w13, E, I, H);
      const std::vector<uint8_t> nib = moe_test::to_nibbles(w13);
      const std::vector<uint8_t> scale = deinterleave(c.w13_scale.bytes, E, I, groups * 2);
      const std::vector<uint8_t> bias = deinterleave(c.w13_bias.bytes, E, I, 4);
      const TensorView w13_view = nibbles ? TensorView::of(nib.data(), DType::u8, {E, 2 * I, H / 2})
                                          : TensorView::of(w13.data(), DType::i8, {E, 2 * I, H});
      const TensorView scale_view =
          g < 0 ? TensorView::of(scale.data(), DType::bf16, {E, 2 * I})
                : TensorView::of(scale.data(), DType::bf16, {E, 2 * I, groups});
      w4a8moe::PackOptions halves = c.pack_options();
      halves.gate_up_layout = w4a8moe::GateUpLayout::halves;
      halves.kernel_set = kernel_set();
      const PackedWeights a = w4a8moe::pack_w13(
          w13_view, scale_view, TensorView::of(bias.data(), DType::f32, {E, 2 * I}), halves);
      EXPECT_TRUE(same_bytes(pack(c).w13, a));
    }
}

// ---- scale storage -----------------------------------------------------------------------------

TEST_F(Pack, ScalesAsGivenKeepTheirDtype) {
  for (const DType sd : {DType::f32, DType::bf16, DType::f16}) {
    CaseSpec s = small_spec();
    s.scale_dtype = sd;
    const moe_test::PackedPair p = pack(moe_test::make_case(s));
    EXPECT_EQ(p.w13.info().scale_dtype, sd);
    EXPECT_EQ(p.w2.info().scale_dtype, sd);
  }
}

TEST_F(Pack, Bf16ScaleStorageEqualsScalesGivenInBf16) {
  for (const int g : {-1, 64})
    for (const DType given : {DType::f32, DType::f16}) {
      CaseSpec s = small_spec(g);
      s.scale_dtype = given;
      SCOPED_TRACE(moe_test::describe(s));
      const Case c = moe_test::make_case(s);
      w4a8moe::PackOptions o = c.pack_options();
      o.kernel_set = kernel_set();
      o.scale_storage = w4a8moe::ScaleStorage::bf16;
      const PackedWeights w13 =
          w4a8moe::pack_w13(c.w13_view(), c.w13_scale_view(), c.w13_bias_view(), o);
      const PackedWeights w2 =
          w4a8moe::pack_w2(c.w2_view(), c.w2_scale_view(), c.w2_bias_view(), o);
      EXPECT_EQ(w13.info().scale_dtype, DType::bf16);
      EXPECT_EQ(w2.info().scale_dtype, DType::bf16);

      // the same scales rounded to bf16 by the caller and given as bf16
      const moe_test::FloatTensor s13 =
          moe_test::make_float_tensor(c.w13_scale.values, DType::bf16);
      const moe_test::FloatTensor s2 = moe_test::make_float_tensor(c.w2_scale.values, DType::bf16);
      TensorView v13 = c.w13_scale_view(), v2 = c.w2_scale_view();
      v13.data = s13.bytes.data();
      v13.dtype = DType::bf16;
      v2.data = s2.bytes.data();
      v2.dtype = DType::bf16;
      o.scale_storage = w4a8moe::ScaleStorage::as_given;
      EXPECT_TRUE(same_bytes(w13, w4a8moe::pack_w13(c.w13_view(), v13, c.w13_bias_view(), o)));
      EXPECT_TRUE(same_bytes(w2, w4a8moe::pack_w2(c.w2_view(), v2, c.w2_bias_view(), o)));

      // and forward with them computes the contract with the rounded scales
      Case rounded = c;
      rounded.problem.w13_scale = s13.values;
      rounded.problem.w2_scale = s2.values;
      w4a8moe::Context context(2);
      moe_test::Output out = moe_test::make_output(c);
      w4a8moe::forward(context, c.x_view(), c.ids_view(), c.topk_weights_view(), w13.bytes(),
                       w2.bytes(), c.params(), out.view());
      EXPECT_TRUE(moe_test::matches_exact(rounded, out.to_float(),
                                          moe_ref::exact_forward(rounded.problem)));
    }
}

// ---- damaged and mismatched buffers ------------------------------------------------------------

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

  // A copy with the header changed and its checksum made valid again, so that the check of the
  // changed field (not the checksum) must catch it.
  PackedWeights with_header(const PackedWeights& w,
                            const std::function<void(w4a8moe::detail::PackedHeader&)>& change) {
    PackedWeights copy = copy_of(w.bytes());
    w4a8moe::detail::PackedHeader h;
    std::memcpy(&h, copy.data(), sizeof h);
    change(h);
    h.checksum = w4a8moe::detail::header_checksum(h);
    std::memcpy(copy.data(), &h, sizeof h);
    return copy;
  }

  Case case_;
  moe_test::PackedPair packed_;
};

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
      with_header(packed_.w13, [](w4a8moe::detail::PackedHeader& x) { x.weight_format = 3; })
          .bytes(),
      true, {"weight format", "int4 symmetric", "int4 with zero points", "mxfp4", "got 3"});
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

// ---- bad input to the packer -------------------------------------------------------------------

TEST(PackInput, Int4ValuesOutOfRangeAreRejected) {
  Case c = moe_test::make_case(small_spec());
  c.w13[123] = 8;
  EXPECT_TRUE(moe_test::throws_error([&] { moe_test::pack(c); }, {"w13", "8"}));
  c = moe_test::make_case(small_spec());
  c.w2[7] = -9;
  EXPECT_TRUE(moe_test::throws_error([&] { moe_test::pack(c); }, {"w2", "-9"}));
}

TEST(PackInput, UnknownKernelSetIsRejected) {
  const Case c = moe_test::make_case(small_spec());
  EXPECT_TRUE(moe_test::throws_error([&] { moe_test::pack(c, "bogus"); }, {"bogus"}));
}

TEST(PackInput, OddRowCountForW13IsRejected) {
  const Case c = moe_test::make_case(small_spec());
  const int64_t E = 3, H = 256;
  const TensorView w = TensorView::of(c.w13.data(), DType::i8, {E, 255, H});
  const TensorView s = TensorView::of(c.w13_scale.bytes.data(), DType::f32, {E, 255, H / 64});
  w4a8moe::PackOptions o;
  o.group_size = 64;
  EXPECT_TRUE(moe_test::throws_error([&] { w4a8moe::pack_w13(w, s, {}, o); }, {"w13", "255"}));
}

// ---- MXFP4 input -------------------------------------------------------------------------------

class Mxfp4Input : public testing::Test {
 protected:
  Case case_ = moe_test::make_case(
      {.tokens = 2, .hidden = 64, .inter = 32, .experts = 2, .group_size = 32, .mxfp4 = true});
};

TEST_F(Mxfp4Input, PacksWithTheFormatRecorded) {
  const moe_test::PackedPair p = pack(case_);
  const w4a8moe::PackedInfo info = w4a8moe::inspect_packed(p.w13.bytes(), "w13_packed");
  EXPECT_EQ(info.weight_format, w4a8moe::WeightFormat::mxfp4);
  EXPECT_EQ(info.scale_dtype, DType::bf16);
  EXPECT_EQ(info.group_size, 32);
  EXPECT_STREQ(w4a8moe::weight_format_name(info.weight_format), "mxfp4");
  // the exponents' 1 byte per 32 become bf16 scales: the size packed_size() predicts
  w4a8moe::PackOptions o = case_.pack_options();
  EXPECT_EQ(w4a8moe::packed_size(w4a8moe::WeightRole::w13, 2, 64, 64, DType::u8, false, o, "w13"),
            p.w13.bytes().size());
  o.group_size = 64;
  EXPECT_TRUE(moe_test::throws_error(
      [&] {
        w4a8moe::packed_size(w4a8moe::WeightRole::w13, 2, 64, 64, DType::u8, false, o, "w13");
      },
      {"w13", "group_size 32 for mxfp4", "got 64"}));
}

TEST_F(Mxfp4Input, RefusesANanScaleByPosition) {
  std::vector<uint8_t> exponents = case_.w2_exponents;
  exponents[5] = 255;  // expert 0, row 2 (I / 32 = 1 group per row), group 0
  const TensorView sv = TensorView::of(exponents.data(), DType::u8, {2, 64, 1});
  EXPECT_TRUE(moe_test::throws_error(
      [&] { w4a8moe::pack_w2(case_.w2_view(), sv, {}, case_.pack_options()); },
      {"w2_scale", "e8m0", "[0, 254]", "got 255 (NaN) at [0, 5, 0]"}));
  w4a8moe::LogicalWeights lw = case_.logical();
  lw.w2_scale = sv;
  moe_test::Output out = moe_test::make_output(case_);
  EXPECT_TRUE(moe_test::throws_error(
      [&] {
        w4a8moe::reference_forward(case_.x_view(), case_.ids_view(), case_.topk_weights_view(), lw,
                                   case_.params(), out.view());
      },
      {"e8m0", "got 255 (NaN)"}));
}

TEST_F(Mxfp4Input, RefusesWhatIsNotMxfp4) {
  w4a8moe::PackOptions o = case_.pack_options();
  const auto pack13 = [&](const TensorView& w, const TensorView& s) {
    return [&, w, s] { w4a8moe::pack_w13(w, s, {}, o); };
  };
  std::vector<int8_t> values(2 * 64 * 64, 0);
  EXPECT_TRUE(moe_test::throws_error(
      pack13(TensorView::of(values.data(), DType::i8, {2, 64, 64}), case_.w13_scale_view()),
      {"w13", "expected dtype u8 (mxfp4 e2m1 codes", "got i8"}));
  std::vector<float> scales(2 * 64 * 2, 1.0f);
  EXPECT_TRUE(moe_test::throws_error(
      pack13(case_.w13_view(), TensorView::of(scales.data(), DType::f32, {2, 64, 2})),
      {"w13_scale", "expected dtype u8 (mxfp4 e8m0 exponents)", "got f32"}));
  EXPECT_TRUE(moe_test::throws_error(
      pack13(case_.w13_view(), TensorView::of(case_.w13_exponents.data(), DType::u8, {2, 64, 3})),
      {"w13_scale", "expected shape [2, 64, 2]"}));
  o.group_size = 64;
  EXPECT_TRUE(moe_test::throws_error(pack13(case_.w13_view(), case_.w13_scale_view()),
                                     {"group_size", "expected 32 for mxfp4", "got 64"}));
  o.group_size = 32;
  o.weight_format = static_cast<w4a8moe::WeightFormat>(3);
  EXPECT_TRUE(moe_test::throws_error(pack13(case_.w13_view(), case_.w13_scale_view()),
                                     {"weight_format", "got 3"}));
}

// ---- int4 with zero points ---------------------------------------------------------------------

class ZeroPointInput : public testing::Test {
 protected:
  Case case_ = moe_test::make_case({.tokens = 3,
                                    .hidden = 64,
                                    .inter = 32,
                                    .experts = 2,
                                    .group_size = 32,
                                    .zero_points = true});
};

TEST_F(ZeroPointInput, PacksWithTheFormatRecorded) {
  const moe_test::PackedPair p = pack(case_);
  const w4a8moe::PackedInfo info = w4a8moe::inspect_packed(p.w13.bytes(), "w13_packed");
  EXPECT_EQ(info.weight_format, w4a8moe::WeightFormat::int4_zero_point);
  EXPECT_STREQ(w4a8moe::weight_format_name(info.weight_format), "int4_zero_point");
  EXPECT_EQ(w4a8moe::packed_size(w4a8moe::WeightRole::w13, 2, 64, 64, DType::f32, false,
                                 case_.pack_options(), "w13"),
            p.w13.bytes().size());
  // the zero points take a section of their own in each panel record, after the scales
  const w4a8moe::detail::Geometry g = w4a8moe::detail::read_geometry(p.w13.bytes(), "w13");
  EXPECT_GE(g.panel_correction_offset,
            g.panel_zeros_offset + static_cast<size_t>(g.panel * g.groups));
  EXPECT_GE(g.panel_zeros_offset,
            g.panel_scales_offset + static_cast<size_t>(g.panel * g.groups) * 4);
}

TEST_F(ZeroPointInput, RefusesAZeroPointOutOfRangeByPosition) {
  std::vector<int8_t> zeros = case_.w2_zero_point;
  zeros[5] = 8;  // expert 0, row 5 (I / 32 = 1 group per row), group 0
  const TensorView zv = TensorView::of(zeros.data(), DType::i8, {2, 64, 1});
  EXPECT_TRUE(moe_test::throws_error(
      [&] {
        w4a8moe::pack_w2(case_.w2_view(), case_.w2_scale_view(), zv, {}, case_.pack_options());
      },
      {"w2_zero_point", "[-8, 7]", "got 8 at [0, 5, 0]"}));
  w4a8moe::LogicalWeights lw = case_.logical();
  lw.w2_zero_point = zv;
  moe_test::Output out = moe_test::make_output(case_);
  EXPECT_TRUE(moe_test::throws_error(
      [&] {
        w4a8moe::reference_forward(case_.x_view(), case_.ids_view(), case_.topk_weights_view(), lw,
                                   case_.params(), out.view());
      },
      {"zero points", "[-8, 7]", "got 8"}));
}

TEST_F(ZeroPointInput, RefusesMissingOrMisshapenZeroPoints) {
  const w4a8moe::PackOptions o = case_.pack_options();
  const auto pack13 = [&](const TensorView& z, const w4a8moe::PackOptions& options) {
    return [&, z, options] {
      w4a8moe::pack_w13(case_.w13_view(), case_.w13_scale_view(), z, {}, options);
    };
  };
  EXPECT_TRUE(moe_test::throws_error(pack13({}, o), {"w13_zero_point"}));
  std::vector<uint8_t> unsigned_zeros(2 * 64 * 2, 8);
  EXPECT_TRUE(moe_test::throws_error(
      pack13(TensorView::of(unsigned_zeros.data(), DType::u8, {2, 64, 2}), o),
      {"w13_zero_point", "expected dtype i8", "got u8"}));
  EXPECT_TRUE(moe_test::throws_error(
      pack13(TensorView::of(case_.w13_zero_point.data(), DType::i8, {2, 64, 1}), o),
      {"w13_zero_point", "expected the shape of w13_scale [2, 64, 2]", "got [2, 64, 1]"}));
  // zero points for weights of another format: refused, not ignored
  w4a8moe::PackOptions symmetric = o;
  symmetric.weight_format = w4a8moe::WeightFormat::int4_symmetric;
  EXPECT_TRUE(
      moe_test::throws_error(pack13(case_.w13_zero_point_view(), symmetric),
                             {"w13_zero_point", "expected no zero points", "int4_symmetric"}));
}

// Zero points of 0 are the symmetric format: the kernels' other path gives the same exact sums,
// scaled the same way, so the forward pass gives the same bits.
TEST_F(ZeroPointInput, ZeroPointsOfZeroGiveTheSymmetricBits) {
  Case zero = case_;
  std::fill(zero.w13_zero_point.begin(), zero.w13_zero_point.end(), int8_t{0});
  std::fill(zero.w2_zero_point.begin(), zero.w2_zero_point.end(), int8_t{0});
  Case symmetric = zero;
  symmetric.spec.zero_points = false;
  w4a8moe::Context context(2);
  const std::vector<float> a = moe_test::run_forward(zero, pack(zero), context).to_float();
  const std::vector<float> b =
      moe_test::run_forward(symmetric, pack(symmetric), context).to_float();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "element " << i;
}

TEST(Mxfp4Support, AsksForGroup32) {
  w4a8moe::MoeConfig c{.hidden = 2880,
                       .inter = 2880,
                       .experts = 32,
                       .top_k = 4,
                       .group_size = 32,
                       .weight_format = w4a8moe::WeightFormat::mxfp4};
  EXPECT_TRUE(w4a8moe::is_supported_config(c).supported);
  c.group_size = 64;
  const w4a8moe::Support no = w4a8moe::is_supported_config(c);
  EXPECT_FALSE(no.supported);
  EXPECT_NE(no.reason.find("group size 32"), std::string::npos) << no.reason;
}

}  // namespace

// ---- an input order (act-order checkpoints) ----------------------------------------------------

class InputOrderInput : public PackedDamage {
 protected:
  void SetUp() override {
    CaseSpec s = small_spec();
    s.input_order = true;
    case_ = moe_test::make_case(s);
    packed_ = pack(case_);
  }
  w4a8moe::PackOptions options() const {
    w4a8moe::PackOptions o = case_.pack_options();
    o.kernel_set = kernel_set();
    return o;
  }
  std::function<void()> pack13(const TensorView& order) const {
    return [this, order] {
      w4a8moe::PackOptions o = options();
      o.input_order = order;
      w4a8moe::pack_w13(case_.w13_view(), case_.w13_scale_view(), {}, o);
    };
  }
};

TEST_F(InputOrderInput, PacksWithTheOrderRecorded) {
  const w4a8moe::PackedInfo info = w4a8moe::inspect_packed(packed_.w13.bytes(), "w13_packed");
  EXPECT_TRUE(info.has_input_order);
  EXPECT_FALSE(w4a8moe::inspect_packed(packed_.w2.bytes(), "w2_packed").has_input_order);
  EXPECT_EQ(w4a8moe::packed_size(w4a8moe::WeightRole::w13, 3, 256, 256, DType::f32, false,
                                 options(), "w13"),
            packed_.w13.size());
  // each expert block ends with its order, int32 per input
  const w4a8moe::detail::Geometry g = w4a8moe::detail::read_geometry(packed_.w13.bytes(), "w13");
  w4a8moe::PackOptions plain = options();
  plain.input_order = {};
  const PackedWeights without =
      w4a8moe::pack_w13(case_.w13_view(), case_.w13_scale_view(), {}, plain);
  EXPECT_EQ(g.expert_bytes, w4a8moe::inspect_packed(without.bytes()).expert_bytes + 256 * 4);
  for (int64_t e = 0; e < 3; ++e) {
    const uint8_t* block =
        packed_.w13.bytes().data() + w4a8moe::detail::kHeaderBytes + e * g.expert_bytes;
    EXPECT_EQ(std::memcmp(g.input_order(block), case_.w13_input_order.data() + e * 256, 256 * 4), 0)
        << "expert " << e;
  }
}

TEST_F(InputOrderInput, TheIdentityOrderGivesTheBitsOfNone) {
  Case identity = case_;
  for (int64_t e = 0; e < 3; ++e)
    for (int32_t c = 0; c < 256; ++c)
      identity.w13_input_order[static_cast<size_t>(e * 256 + c)] = c;
  Case none = identity;
  none.spec.input_order = false;
  w4a8moe::Context context(2);
  const std::vector<float> a = moe_test::run_forward(identity, pack(identity), context).to_float();
  const std::vector<float> b = moe_test::run_forward(none, pack(none), context).to_float();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "element " << i;
}

TEST_F(InputOrderInput, ChunksAndSelectedExpertsPackTheirOwnOrders) {
  // ExpertPacker: two chunks, each with its experts' rows of the order
  w4a8moe::PackOptions o = options();
  o.input_order = {};
  w4a8moe::ExpertPacker packer(w4a8moe::WeightRole::w13, 3, o);
  // case_ is H 256, I 128, g 64: w13 int8 [E, 256, 256], f32 scales [E, 256, 4]
  for (const auto& [e0, n] : {std::pair<int64_t, int64_t>{0, 2}, {2, 1}})
    packer.append(
        TensorView::of(case_.w13.data() + e0 * 256 * 256, DType::i8, {n, 256, 256}),
        TensorView::of(case_.w13_scale.values.data() + e0 * 256 * 4, DType::f32, {n, 256, 4}), {},
        {}, TensorView::of(case_.w13_input_order.data() + e0 * 256, DType::i32, {n, 256}));
  EXPECT_TRUE(same_bytes(std::move(packer).finish(), packed_.w13));
  // PackOptions::experts selects rows of the order with the experts
  w4a8moe::PackOptions some = options();
  some.experts = {2, 0};
  const PackedWeights two = w4a8moe::pack_w13(case_.w13_view(), case_.w13_scale_view(), {}, some);
  const w4a8moe::detail::Geometry g = w4a8moe::detail::read_geometry(two.bytes(), "w13");
  const uint8_t* first = two.bytes().data() + w4a8moe::detail::kHeaderBytes;
  EXPECT_EQ(std::memcmp(g.input_order(first), case_.w13_input_order.data() + 2 * 256, 256 * 4), 0);
}

TEST_F(InputOrderInput, RefusesWhatIsNotAPermutationOrNotW13s) {
  std::vector<int32_t> order = case_.w13_input_order;
  const auto view = [&](DType dtype, std::initializer_list<int64_t> shape) {
    return TensorView::of(order.data(), dtype, shape);
  };
  EXPECT_TRUE(moe_test::throws_error(
      pack13(view(DType::i64, {3, 128})),
      {"PackOptions::input_order", "expected contiguous int32 [3, 256]", "got i64 [3, 128]"}));
  EXPECT_TRUE(moe_test::throws_error(
      pack13(view(DType::i32, {3, 255})),
      {"PackOptions::input_order", "expected contiguous int32 [3, 256]", "got i32 [3, 255]"}));
  order[256 + 7] = 256;
  EXPECT_TRUE(moe_test::throws_error(
      pack13(view(DType::i32, {3, 256})),
      {"PackOptions::input_order", "expected inputs in [0, 256)", "got 256 at [1, 7]"}));
  order[256 + 7] = order[256 + 8];
  EXPECT_TRUE(moe_test::throws_error(
      pack13(view(DType::i32, {3, 256})),
      {"PackOptions::input_order", "permutation of [0, 256)", "twice in row 1"}));
  // w2's inputs are w13's rows: an order for w2 is refused
  w4a8moe::PackOptions o = options();
  o.input_order = case_.pack_options().input_order;
  EXPECT_TRUE(moe_test::throws_error(
      [&] { w4a8moe::pack_w2(case_.w2_view(), case_.w2_scale_view(), {}, o); },
      {"PackOptions::input_order", "expected none for w2"}));
  // a w2 header that says it has one is damaged
  expect_rejected(with_header(packed_.w2,
                              [](w4a8moe::detail::PackedHeader& h) {
                                h.flags |= w4a8moe::detail::kFlagInputOrder;
                              })
                      .bytes(),
                  false, {"input order flag"});
  // the library's reference checks the logical order too
  w4a8moe::LogicalWeights lw = case_.logical();
  lw.w13_input_order = view(DType::i32, {3, 256});
  moe_test::Output out = moe_test::make_output(case_);
  EXPECT_TRUE(moe_test::throws_error(
      [&] {
        w4a8moe::reference_forward(case_.x_view(), case_.ids_view(), case_.topk_weights_view(), lw,
                                   case_.params(), out.view());
      },
      {"w13_input_order", "twice in row 1"}));
}
