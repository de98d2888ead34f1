// pack_w13 / pack_w2 and inspect_packed: what the header says, equivalent inputs giving the same
// bytes, the scale storage option, and bad input refused by the packer. Every kernel set of the
// build packs its own layout. Damaged buffers: test_pack_damage.cpp; MXFP4, zero points and input
// orders: test_pack_formats.cpp.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "pack_test_util.hpp"
#include "reference/reference.hpp"
#include "test_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace {

using moe_test::Case;
using moe_test::CaseSpec;
using moe_test::DType;
using pack_test::Pack;
using pack_test::same_bytes;
using pack_test::small_spec;
using w4a8moe::PackedWeights;
using w4a8moe::TensorView;

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

}  // namespace
