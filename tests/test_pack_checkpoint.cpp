// pack_checkpoint_moe and pack_checkpoint_linear (w4a8moe/checkpoint.hpp): each checkpoint
// layout written here from a random case's logical weights by the test's own encoders (the
// inverse of the decoder, written from the formats' descriptions), then packed. Without act-order
// the buffers must be byte for byte those pack_w13 / pack_w2 make of the logical weights; with
// act-order (the inputs of a group in the checkpoint's own order) the output must be bit for bit
// the logical case's and match the exact reference. Hostile tensors are refused by name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "test_util.hpp"
#include "w4a8moe/checkpoint.hpp"

namespace {

using moe_test::Case;
using moe_test::CaseSpec;
using moe_test::DType;
using moe_test::throws_error;
using w4a8moe::CheckpointFormat;
using w4a8moe::CheckpointTensors;
using w4a8moe::PackOptions;
using w4a8moe::TensorView;

// A projection stack in checkpoint form before encoding: unsigned values q = w + 8 [E, N, K],
// scales [E, N, G] (the case's bytes), unsigned zeros [E, N, G] (empty: symmetric), g_idx [E, K]
// (empty: none) and bias bytes [E, N].
struct Logical {
  int64_t experts = 0, rows = 0, cols = 0, groups = 1;
  std::vector<uint8_t> q;
  DType scale_dtype = DType::f32;
  std::vector<uint8_t> scale;
  std::vector<uint8_t> zero;
  std::vector<int32_t> g_idx;
  DType bias_dtype = DType::f32;
  std::vector<uint8_t> bias;
};

// The case's w13 or w2 as stored, with the checkpoint's input k of column c given by cols[e][c]
// (g_idx then says group c / g for it) and checkpoint row rows[e][n] holding logical row n.
Logical logical(const Case& c, bool w13, const std::vector<std::vector<int32_t>>& cols = {},
                const std::vector<std::vector<int32_t>>& rows = {}) {
  const CaseSpec& s = c.spec;
  Logical l;
  l.experts = s.experts;
  l.rows = w13 ? 2 * s.inter : s.hidden;
  l.cols = w13 ? s.hidden : s.inter;
  l.groups = s.group_size == -1 ? 1 : l.cols / s.group_size;
  const int64_t E = l.experts, N = l.rows, K = l.cols, G = l.groups;
  const std::vector<int8_t>& w = w13 ? c.w13 : c.w2;
  const moe_test::FloatTensor& scale = w13 ? c.w13_scale : c.w2_scale;
  const std::vector<int8_t>& zero = w13 ? c.w13_zero_point : c.w2_zero_point;
  const moe_test::FloatTensor& bias = w13 ? c.w13_bias : c.w2_bias;
  const size_t sb = w4a8moe::dtype_bytes(scale.dtype), bb = w4a8moe::dtype_bytes(bias.dtype);
  l.scale_dtype = scale.dtype;
  l.bias_dtype = bias.dtype;
  l.q.resize(static_cast<size_t>(E * N * K));
  l.scale.resize(static_cast<size_t>(E * N * G) * sb);
  if (!zero.empty()) l.zero.resize(static_cast<size_t>(E * N * G));
  if (!bias.bytes.empty()) l.bias.resize(static_cast<size_t>(E * N) * bb);
  if (!cols.empty()) l.g_idx.resize(static_cast<size_t>(E * K));
  const int64_t g = s.group_size == -1 ? K : s.group_size;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n) {
      const int64_t r = rows.empty() ? n : rows[static_cast<size_t>(e)][static_cast<size_t>(n)];
      for (int64_t k = 0; k < K; ++k) {
        const int64_t to = cols.empty() ? k : cols[static_cast<size_t>(e)][static_cast<size_t>(k)];
        l.q[static_cast<size_t>((e * N + r) * K + to)] =
            static_cast<uint8_t>(w[static_cast<size_t>((e * N + n) * K + k)] + 8);
        if (!cols.empty() && n == 0)
          l.g_idx[static_cast<size_t>(e * K + to)] = static_cast<int32_t>(k / g);
      }
      std::copy_n(scale.bytes.begin() + static_cast<ptrdiff_t>((e * N + n) * G * sb), G * sb,
                  l.scale.begin() + static_cast<ptrdiff_t>((e * N + r) * G * sb));
      for (int64_t b = 0; !l.zero.empty() && b < G; ++b)
        l.zero[static_cast<size_t>((e * N + r) * G + b)] =
            static_cast<uint8_t>(zero[static_cast<size_t>((e * N + n) * G + b)] + 8);
      if (!l.bias.empty())
        std::copy_n(bias.bytes.begin() + static_cast<ptrdiff_t>((e * N + n) * bb), bb,
                    l.bias.begin() + static_cast<ptrdiff_t>((e * N + r) * bb));
    }
  return l;
}

// The checkpoint's tensors of a Logical stack, and their views.
struct Encoded {
  std::vector<uint32_t> weight, zero_words;
  std::vector<int8_t> zero_bytes;
  std::vector<uint8_t> scale;
  std::vector<int32_t> g_idx;
  std::vector<uint8_t> bias;
  CheckpointTensors views;
};

uint32_t nibble_word(const uint8_t* q, int64_t step, const int* nibble_of = nullptr) {
  uint32_t word = 0;
  for (int j = 0; j < 8; ++j)
    word |= uint32_t{q[j * step]} << (4 * (nibble_of == nullptr ? j : nibble_of[j]));
  return word;
}

// zero_int8: compressed-tensors' int-quantized zero points (int8 z) instead of packed words.
Encoded encode(const Logical& l, CheckpointFormat f, bool zero_int8 = false) {
  const int64_t E = l.experts, N = l.rows, K = l.cols, G = l.groups;
  const size_t sb = w4a8moe::dtype_bytes(l.scale_dtype);
  const int* awq = w4a8moe::kAwqNibble.data();
  Encoded x;
  const auto q = [&](int64_t e, int64_t n, int64_t k) {
    return &l.q[static_cast<size_t>((e * N + n) * K + k)];
  };
  x.scale.resize(l.scale.size());
  const bool ct = f == CheckpointFormat::compressed_tensors;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t b = 0; b < G; ++b)  // [E, N, G] (compressed-tensors) or [E, G, N]
        std::copy_n(l.scale.begin() + static_cast<ptrdiff_t>(((e * N + n) * G + b) * sb), sb,
                    x.scale.begin() + static_cast<ptrdiff_t>(
                                          (ct ? (e * N + n) * G + b : (e * G + b) * N + n) * sb));
  std::array<int64_t, 3> wshape{}, zshape{};
  if (f == CheckpointFormat::awq) {  // [E, K, N/8], outputs in AWQ's order
    wshape = {E, K, N / 8};
    for (int64_t e = 0; e < E; ++e)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t w = 0; w < N / 8; ++w) x.weight.push_back(nibble_word(q(e, 8 * w, k), K, awq));
  } else if (ct) {  // [E, N, K/8]
    wshape = {E, N, K / 8};
    for (int64_t e = 0; e < E; ++e)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t w = 0; w < K / 8; ++w) x.weight.push_back(nibble_word(q(e, n, 8 * w), 1));
  } else {  // GPTQ [E, K/8, N]
    wshape = {E, K / 8, N};
    for (int64_t e = 0; e < E; ++e)
      for (int64_t w = 0; w < K / 8; ++w)
        for (int64_t n = 0; n < N; ++n) x.weight.push_back(nibble_word(q(e, n, 8 * w), 1));
  }
  if (!l.zero.empty()) {
    const auto z = [&](int64_t e, int64_t n, int64_t b) {
      return l.zero[static_cast<size_t>((e * N + n) * G + b)];
    };
    if (ct && zero_int8) {
      zshape = {E, N, G};
      for (const uint8_t v : l.zero) x.zero_bytes.push_back(static_cast<int8_t>(v - 8));
    } else if (ct) {  // [E, ceil(N/8), G], eight rows a word
      zshape = {E, (N + 7) / 8, G};
      for (int64_t e = 0; e < E; ++e)
        for (int64_t r = 0; r < (N + 7) / 8; ++r)
          for (int64_t b = 0; b < G; ++b) {
            uint32_t word = 0;
            for (int64_t j = 0; j < 8 && 8 * r + j < N; ++j)
              word |= uint32_t{z(e, 8 * r + j, b)} << (4 * j);
            x.zero_words.push_back(word);
          }
    } else {  // [E, G, N/8], eight outputs a word; "gptq" stores zero - 1
      zshape = {E, G, N / 8};
      for (int64_t e = 0; e < E; ++e)
        for (int64_t b = 0; b < G; ++b)
          for (int64_t w = 0; w < N / 8; ++w) {
            uint8_t stored[8];
            for (int j = 0; j < 8; ++j)
              stored[j] =
                  static_cast<uint8_t>(z(e, 8 * w + j, b) - (f == CheckpointFormat::gptq ? 1 : 0));
            x.zero_words.push_back(
                nibble_word(stored, 1, f == CheckpointFormat::awq ? awq : nullptr));
          }
    }
  }
  x.g_idx = l.g_idx;
  x.bias = l.bias;
  x.views.weight = TensorView::of(x.weight.data(), DType::i32, {wshape[0], wshape[1], wshape[2]});
  x.views.scale = ct ? TensorView::of(x.scale.data(), l.scale_dtype, {E, N, G})
                     : TensorView::of(x.scale.data(), l.scale_dtype, {E, G, N});
  if (!x.zero_words.empty())
    x.views.zero_point =
        TensorView::of(x.zero_words.data(), DType::i32, {zshape[0], zshape[1], zshape[2]});
  if (!x.zero_bytes.empty())
    x.views.zero_point =
        TensorView::of(x.zero_bytes.data(), DType::i8, {zshape[0], zshape[1], zshape[2]});
  if (!x.g_idx.empty()) x.views.g_idx = TensorView::of(x.g_idx.data(), DType::i32, {E, K});
  if (!x.bias.empty()) x.views.bias = TensorView::of(x.bias.data(), l.bias_dtype, {E, N});
  return x;
}

PackOptions options_of(const Case& c) {
  PackOptions o;
  o.group_size = c.spec.group_size;
  return o;
}

bool same_bytes(const w4a8moe::PackedWeights& a, const w4a8moe::PackedWeights& b) {
  return a.size() == b.size() && std::equal(a.bytes().begin(), a.bytes().end(), b.bytes().begin());
}

// The checkpoint's tensors pack to the bytes pack_w13 / pack_w2 make of the case's weights.
void expect_packs_like_the_packer(const Case& c, CheckpointFormat format,
                                  const CheckpointTensors& w13, const CheckpointTensors& w2) {
  const w4a8moe::PackedLayer got = w4a8moe::pack_checkpoint_moe(format, w13, w2, options_of(c));
  const moe_test::PackedPair want = moe_test::pack(c);
  EXPECT_TRUE(same_bytes(got.w13, want.w13));
  EXPECT_TRUE(same_bytes(got.w2, want.w2));
}

CaseSpec spec_of(bool zeros, int group, DType scale, bool bias) {
  CaseSpec s;
  s.tokens = 5;
  s.hidden = 128;
  s.inter = 64;
  s.experts = 4;
  s.top_k = 2;
  s.group_size = group;
  s.scale_dtype = scale;
  s.bias = bias;
  s.zero_points = zeros;
  s.seed = 11;
  return s;
}

// ---- exact layouts ---------------------------------------------------------------------------

struct LayoutCase {
  CheckpointFormat format;
  bool zeros;
  int group;
  DType scale;
  bool bias;
  bool zero_int8 = false;
};

class CheckpointLayouts : public testing::TestWithParam<LayoutCase> {};

// GPTQ's "gptq" format stores zero - 1 in four bits: a zero of 0 has no code. Such zero points
// (w4a8moe's -8) become -7 in the case.
Case case_for(const LayoutCase& p) {
  Case c = moe_test::make_case(spec_of(p.zeros, p.group, p.scale, p.bias));
  if (p.format == CheckpointFormat::gptq)
    for (auto* zeros : {&c.w13_zero_point, &c.w2_zero_point})
      for (int8_t& z : *zeros) z = std::max<int8_t>(z, -7);
  return c;
}

TEST_P(CheckpointLayouts, PackTheBytesOfTheLogicalWeights) {
  const LayoutCase& p = GetParam();
  const Case c = case_for(p);
  const Encoded w13 = encode(logical(c, true), p.format, p.zero_int8);
  const Encoded w2 = encode(logical(c, false), p.format, p.zero_int8);
  expect_packs_like_the_packer(c, p.format, w13.views, w2.views);
}

TEST_P(CheckpointLayouts, SelectedExpertsPackLikeThePacker) {
  const LayoutCase& p = GetParam();
  const Case c = case_for(p);
  const Encoded w13 = encode(logical(c, true), p.format, p.zero_int8);
  const Encoded w2 = encode(logical(c, false), p.format, p.zero_int8);
  PackOptions o = options_of(c);
  o.experts = {3, 0};
  const w4a8moe::PackedLayer got = w4a8moe::pack_checkpoint_moe(p.format, w13.views, w2.views, o);
  PackOptions want_options = c.pack_options();
  want_options.experts = {3, 0};
  const auto want = w4a8moe::pack_w13(c.w13_view(), c.w13_scale_view(), c.w13_zero_point_view(),
                                      c.w13_bias_view(), want_options);
  EXPECT_TRUE(same_bytes(got.w13, want));
  EXPECT_EQ(got.w2.info().experts, 2);
}

std::string layout_name(const testing::TestParamInfo<LayoutCase>& info) {
  const LayoutCase& p = info.param;
  std::string name = w4a8moe::checkpoint_format_name(p.format);
  std::replace(name.begin(), name.end(), '-', '_');
  return name + (p.zeros ? "_zeros" : "_sym") + (p.zero_int8 ? "_int8" : "") + "_g" +
         (p.group == -1 ? std::string("channel") : std::to_string(p.group)) + "_" +
         w4a8moe::dtype_name(p.scale) + (p.bias ? "_bias" : "");
}

INSTANTIATE_TEST_SUITE_P(
    Formats, CheckpointLayouts,
    testing::Values(LayoutCase{CheckpointFormat::gptq, true, 32, DType::f16, false},
                    LayoutCase{CheckpointFormat::gptq, false, 64, DType::f32, true},
                    LayoutCase{CheckpointFormat::gptq_v2, true, -1, DType::bf16, false},
                    LayoutCase{CheckpointFormat::awq, true, 32, DType::f16, true},
                    LayoutCase{CheckpointFormat::awq, true, -1, DType::f32, false},
                    LayoutCase{CheckpointFormat::compressed_tensors, false, 32, DType::bf16, false},
                    LayoutCase{CheckpointFormat::compressed_tensors, true, 64, DType::f32, true},
                    LayoutCase{CheckpointFormat::compressed_tensors, true, -1, DType::f16, false},
                    LayoutCase{CheckpointFormat::compressed_tensors, true, 32, DType::f32, false,
                               true}),
    layout_name);

// ---- act-order -------------------------------------------------------------------------------

// A random permutation per expert: the checkpoint's input (or row) of each logical one.
std::vector<std::vector<int32_t>> permutations(int64_t experts, int64_t n, uint64_t seed) {
  moe_test::Rng rng(seed);
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(experts));
  for (auto& p : out) {
    p.resize(static_cast<size_t>(n));
    std::iota(p.begin(), p.end(), 0);
    for (int64_t i = n - 1; i > 0; --i)
      std::swap(p[static_cast<size_t>(i)], p[static_cast<size_t>(rng.integer(0, i))]);
  }
  return out;
}

class CheckpointActOrder : public testing::TestWithParam<CheckpointFormat> {};

// Act-order on both projections. w13: the case's column c multiplies input order[c] with group
// c / g, which the checkpoint stores at input order[c] with that g_idx. w2: the intermediate
// features permuted (w13's gate and up rows with w2's inputs), which leaves the layer's function
// as it was. The packer sorts each group's inputs its own way; a group's sums are integers, so
// the output is bit for bit the logical case's.
TEST_P(CheckpointActOrder, GivesTheLogicalCasesOutput) {
  // (GPTQ's "gptq" format cannot store the case's zero of 0: symmetric there)
  CaseSpec s = spec_of(GetParam() != CheckpointFormat::gptq, 32, DType::f32, true);
  s.input_order = true;  // the case's column c multiplies input order[c], its group c / g
  const Case c = moe_test::make_case(s);
  std::vector<std::vector<int32_t>> p13;
  for (int64_t e = 0; e < s.experts; ++e)
    p13.emplace_back(c.w13_input_order.begin() + e * s.hidden,
                     c.w13_input_order.begin() + (e + 1) * s.hidden);
  const auto p2 = permutations(s.experts, s.inter, 6);
  std::vector<std::vector<int32_t>> rows13(static_cast<size_t>(s.experts));
  for (int64_t e = 0; e < s.experts; ++e)
    for (int half = 0; half < 2; ++half)
      for (int64_t j = 0; j < s.inter; ++j)
        rows13[static_cast<size_t>(e)].push_back(static_cast<int32_t>(
            half * s.inter + p2[static_cast<size_t>(e)][static_cast<size_t>(j)]));
  const Encoded w13 = encode(logical(c, true, p13, rows13), GetParam());
  const Encoded w2 = encode(logical(c, false, p2), GetParam());
  const w4a8moe::PackedLayer got =
      w4a8moe::pack_checkpoint_moe(GetParam(), w13.views, w2.views, options_of(c));
  EXPECT_TRUE(got.w13.info().has_input_order);
  w4a8moe::Context context(2);
  moe_test::PackedPair packed{std::move(const_cast<w4a8moe::PackedLayer&>(got).w13),
                              std::move(const_cast<w4a8moe::PackedLayer&>(got).w2)};
  const moe_test::Output out = moe_test::run_forward(c, packed, context);
  const moe_test::Output want = moe_test::run_forward(c, moe_test::pack(c), context);
  EXPECT_EQ(out.bytes, want.bytes);
  EXPECT_TRUE(moe_test::matches_exact(c, out.to_float(), moe_ref::exact_forward(c.problem)));
}

std::string format_name(const testing::TestParamInfo<CheckpointFormat>& p) {
  std::string name = w4a8moe::checkpoint_format_name(p.param);
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

INSTANTIATE_TEST_SUITE_P(Formats, CheckpointActOrder,
                         testing::Values(CheckpointFormat::gptq, CheckpointFormat::gptq_v2,
                                         CheckpointFormat::compressed_tensors),
                         format_name);

// ---- mxfp4 and dense layers ------------------------------------------------------------------

TEST(CheckpointMxfp4, PacksTheCodesAndExponentsAsTheyAre) {
  CaseSpec s = spec_of(false, 32, DType::f32, true);
  s.mxfp4 = true;
  const Case c = moe_test::make_case(s);
  const auto view = [](const std::vector<uint8_t>& v, int64_t e, int64_t n, int64_t k) {
    return TensorView::of(v.data(), DType::u8, {e, n, k});
  };
  const int64_t E = s.experts, H = s.hidden, I = s.inter;
  CheckpointTensors w13{view(c.w13_nibbles, E, 2 * I, H / 2),
                        view(c.w13_exponents, E, 2 * I, H / 32),
                        {},
                        {},
                        c.w13_bias_view()};
  CheckpointTensors w2{view(c.w2_nibbles, E, H, I / 2),
                       view(c.w2_exponents, E, H, I / 32),
                       {},
                       {},
                       c.w2_bias_view()};
  expect_packs_like_the_packer(c, CheckpointFormat::mxfp4, w13, w2);
}

// Expert 0's w2 as a dense layer [H, I]: the same bytes as pack_linear of its values.
TEST_P(CheckpointLayouts, DenseLayerPacksLikePackLinear) {
  const LayoutCase& p = GetParam();
  const Case c = case_for(p);
  Logical l = logical(c, false);
  l.experts = 1;  // expert 0 only: the first N * K values, N * G scales, ...
  const Encoded x = encode(l, p.format, p.zero_int8);
  const auto drop = [](TensorView v) {  // [1, a, b] -> [a, b]
    if (v.empty()) return v;
    for (int i = 0; i + 1 < v.rank; ++i)
      v.shape[static_cast<size_t>(i)] = v.shape[static_cast<size_t>(i + 1)];
    v.shape[static_cast<size_t>(--v.rank)] = 0;
    return v;
  };
  const CheckpointTensors w{
      drop(x.views.weight), drop(x.views.scale), drop(x.views.zero_point), {}, drop(x.views.bias)};
  const w4a8moe::PackedWeights got = w4a8moe::pack_checkpoint_linear(p.format, w, options_of(c));
  const int64_t N = c.spec.hidden, K = c.spec.inter;
  const int64_t G = p.group == -1 ? 1 : K / p.group;
  const auto first = [&](const TensorView& v, DType dtype) {
    if (v.empty()) return v;
    return p.group == -1 ? TensorView::of(v.data, dtype, {N})
                         : TensorView::of(v.data, dtype, {N, G});
  };
  PackOptions o = options_of(c);
  o.weight_format =
      p.zeros ? w4a8moe::WeightFormat::int4_zero_point : w4a8moe::WeightFormat::int4_symmetric;
  const auto want = w4a8moe::pack_linear(
      TensorView::of(c.w2.data(), DType::i8, {N, K}), first(c.w2_scale_view(), p.scale),
      first(c.w2_zero_point_view(), DType::i8),
      p.bias ? TensorView::of(c.w2_bias.bytes.data(), c.w2_bias.dtype, {N}) : TensorView{}, o);
  EXPECT_TRUE(same_bytes(got, want));
}

// ---- hostile tensors -------------------------------------------------------------------------

class CheckpointRefuses : public testing::Test {
 protected:
  CheckpointRefuses()
      : c(moe_test::make_case(spec_of(true, 32, DType::f32, false))),
        w13(encode(logical(c, true), CheckpointFormat::gptq_v2)),
        w2(encode(logical(c, false), CheckpointFormat::gptq_v2)) {}
  // pack_checkpoint_moe (group size 32 unless `o` sets one) throws an Error holding every
  // fragment: of the fixture's tensors, or of `gate_up` and `down`.
  testing::AssertionResult refuses(std::initializer_list<std::string_view> fragments,
                                   CheckpointFormat f = CheckpointFormat::gptq_v2,
                                   PackOptions o = {}) const {
    return refuses(w13, w2, f, fragments, o);
  }
  static testing::AssertionResult refuses(const Encoded& gate_up, const Encoded& down,
                                          CheckpointFormat f,
                                          std::initializer_list<std::string_view> fragments,
                                          PackOptions o = {}) {
    if (o.group_size == -1) o.group_size = 32;
    return throws_error(
        [&] { (void)w4a8moe::pack_checkpoint_moe(f, gate_up.views, down.views, o); }, fragments);
  }
  Case c;
  Encoded w13, w2;
};

TEST_F(CheckpointRefuses, MisshapenTensorsByName) {
  w13.views.weight.dtype = DType::u8;
  EXPECT_TRUE(refuses({"w13.weight of each expert: expected dtype i32, got u8"}));
  w13.views.weight.dtype = DType::i32;
  w2.views.scale.shape[1] += 1;  // GPTQ's scales [E, G, N]: G = I / 32 = 2
  EXPECT_TRUE(refuses({"w2.scale of each expert: expected shape [2, 128], got [3, 128]"}));
  w2.views.scale.shape[1] -= 1;
  w13.views.zero_point.dtype = DType::i8;
  EXPECT_TRUE(refuses({"w13.zero_point of each expert: expected dtype i32, got i8"}));
  w13.views.zero_point.dtype = DType::i32;
  w13.views.scale.shape[0] = 2;
  EXPECT_TRUE(refuses({"w13.scale: expected 4 experts (the weight's), got 2"}));
  w13.views.scale.shape[0] = 4;
  w2.views.weight.shape[2] -= 8;  // w2's outputs are H: 120 against w13's 128 inputs
  w2.views.scale.shape[2] -= 8;
  w2.views.zero_point.shape[2] -= 1;
  EXPECT_TRUE(refuses({"w2.weight: expected 128 outputs (w13's inputs, H), got 120"}));
}

TEST_F(CheckpointRefuses, GroupIndicesThatAreNotGroups) {
  std::vector<int32_t> g_idx(static_cast<size_t>(4 * 128));
  for (size_t k = 0; k < g_idx.size(); ++k) g_idx[k] = static_cast<int32_t>(k % 128 / 32);
  w13.views.g_idx = TensorView::of(g_idx.data(), DType::i32, {4, 128});
  g_idx[2 * 128 + 5] = 1;  // expert 2: group 0 holds 31 inputs, group 1 33
  EXPECT_TRUE(refuses({"w13.g_idx of each expert puts 31 inputs in group 0",
                       "expected the group "
                       "size 32 (expert 2)"}));
  g_idx[2 * 128 + 5] = 4;
  EXPECT_TRUE(refuses({"w13.g_idx of each expert puts input 5 in group 4, outside [0, 4)"}));
  g_idx[2 * 128 + 5] = 0;
  Encoded awq13 = encode(logical(c, true), CheckpointFormat::awq);
  const Encoded awq2 = encode(logical(c, false), CheckpointFormat::awq);
  awq13.views.g_idx = w13.views.g_idx;
  EXPECT_TRUE(refuses(awq13, awq2, CheckpointFormat::awq,
                      {"w13.g_idx of each expert: AWQ has no act-order, got a g_idx"}));
}

TEST_F(CheckpointRefuses, ZerosACheckpointCannotHold) {
  Case v1 = c;  // zeros of at least 1, stored less one: [0, 14]
  for (auto* zeros : {&v1.w13_zero_point, &v1.w2_zero_point})
    for (int8_t& z : *zeros) z = std::max<int8_t>(z, -7);
  const Encoded v1_13 = encode(logical(v1, true), CheckpointFormat::gptq);
  Encoded v1_2 = encode(logical(v1, false), CheckpointFormat::gptq);
  v1_2.zero_words[3] |= 0xfu;  // output 24 of group 0 stored 15: zero 16
  EXPECT_TRUE(refuses(
      v1_13, v1_2, CheckpointFormat::gptq,
      {"w2.zero_point of each expert stores 15 at [0, 0, 24]: zero 16 in a \"gptq\" checkpoint"}));
  const Encoded ct13 = encode(logical(c, true), CheckpointFormat::compressed_tensors, true);
  Encoded ct2 = encode(logical(c, false), CheckpointFormat::compressed_tensors, true);
  ct2.zero_bytes[7] = 9;
  EXPECT_TRUE(refuses(ct13, ct2, CheckpointFormat::compressed_tensors,
                      {"w2.zero_point of each expert holds 9 at [0, 3, 1], outside int4 [-8, 7]"}));
}

TEST_F(CheckpointRefuses, OptionsTheFormatDecides) {
  PackOptions o;
  o.weight_format = w4a8moe::WeightFormat::int4_zero_point;
  EXPECT_TRUE(refuses({"PackOptions::weight_format: follows from the checkpoint format"},
                      CheckpointFormat::gptq_v2, o));
  o = {};
  o.group_size = 48;
  EXPECT_TRUE(refuses({"PackOptions::group_size: expected -1 or a multiple of 32", "got 48"},
                      CheckpointFormat::gptq_v2, o));
  o = {};
  o.experts = {0, 4};
  EXPECT_TRUE(refuses({"PackOptions::experts: expected indices in [0, 4), got 4"},
                      CheckpointFormat::gptq_v2, o));
  EXPECT_TRUE(throws_error([] { (void)w4a8moe::parse_checkpoint_format("gptq_v3"); },
                           {"format: expected gptq, gptq_v2, awq, compressed-tensors or mxfp4, "
                            "got 'gptq_v3'"}));
}

TEST_F(CheckpointRefuses, ActOrderOfDownWithInterleavedGateAndUp) {
  std::vector<int32_t> g_idx(static_cast<size_t>(4 * 64));
  for (size_t k = 0; k < g_idx.size(); ++k) g_idx[k] = static_cast<int32_t>(1 - k % 64 / 32);
  w2.views.g_idx = TensorView::of(g_idx.data(), DType::i32, {4, 64});
  PackOptions o;
  o.gate_up_layout = w4a8moe::GateUpLayout::interleaved;
  EXPECT_TRUE(refuses({"w2.g_idx: act-order of down's inputs", "gate_up_layout halves"},
                      CheckpointFormat::gptq_v2, o));
}

}  // namespace
