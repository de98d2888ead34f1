// Packing the other weight formats and an input order: MXFP4 (the format recorded, a NaN exponent
// refused by position, wrong dtypes, shapes and group sizes refused, is_supported_config asking
// for group 32), int4 with zero points, and act-order input orders (recorded per expert, chunks
// and selected experts packing their own, anything not a permutation refused).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "pack/packed_format.hpp"
#include "pack_test_util.hpp"
#include "test_util.hpp"
#include "w4a8moe/expert_packer.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace {

using moe_test::Case;
using moe_test::CaseSpec;
using moe_test::DType;
using pack_test::PackedDamage;
using pack_test::same_bytes;
using pack_test::small_spec;
using pack_test::with_header;
using w4a8moe::PackedWeights;
using w4a8moe::TensorView;

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
  EXPECT_TRUE(moe_test::throws_error([&] { moe_test::run_library_reference(case_, lw); },
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
  o.weight_format = static_cast<w4a8moe::WeightFormat>(4);
  EXPECT_TRUE(moe_test::throws_error(pack13(case_.w13_view(), case_.w13_scale_view()),
                                     {"weight_format", "got 4"}));
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
  EXPECT_TRUE(moe_test::throws_error([&] { moe_test::run_library_reference(case_, lw); },
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
  EXPECT_TRUE(moe_test::throws_error([&] { moe_test::run_library_reference(case_, lw); },
                                     {"w13_input_order", "twice in row 1"}));
}

}  // namespace
