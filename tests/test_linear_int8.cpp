// linear() on int8 weights (WeightFormat::int8, pack_linear) against the independent exact
// reference (moe_ref::exact_linear over the int8 values themselves: plain double arithmetic of
// the quantized rows of x times the int8 weights and their row scales), on a grid of K (32,
// 2880, 4096), N (odd, not a multiple of any panel) and T (1, 3, 17, 130), weights at the int8
// extremes, and x rows that are zero, constant or hold one large outlier; the packed header; the
// errors of bad input and of forward() on an int8 buffer; quantize_linear_int8() against a plain
// loop. Run once per kernel set (the ISA cap of the library suites).
//
// Tolerance: that of test_linear.cpp, 1e-6 * sqrt(K) * max_n |ref[t, n]| (f32 sums of K terms)
// (the bound of the planes; the avx512vnni set's bytes sum exact integers)
// plus the rounding of out to bf16 / f16, plus 1e-6 * recip * |zp| * s[n] * SUM_k (|w| + 30):
// int8 weights are summed per plane in f32 (a plane is a scale group of K), each plane's sum
// taken over the raw q and the zero-point term zp * correction subtracted after, both terms of
// at most that size (16 |h| + l <= |w| + 30), so a row of x with a large zero point (an all-zero
// row: zp 127, recip 1) cancels them in f32. A wrong plane mapping (the low nibbles' zero point,
// the high nibbles' scale) moves outputs by whole multiples of s * SUM x: far outside it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "linear_test_util.hpp"
#include "pack/packed_format.hpp"
#include "pack_test_util.hpp"
#include "reference/reference.hpp"
#include "registry.hpp"
#include "test_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace {

using moe_test::DType;
using moe_test::throws_error;
using pack_test::with_header;
using w4a8moe::MutableTensorView;
using w4a8moe::TensorView;
using w4a8moe::WeightFormat;

struct Int8Spec {
  std::string name;
  int64_t tokens, rows, cols;
  DType dtype = DType::f32;        // of x (and out unless f32_out)
  DType scale_dtype = DType::f32;  // of the scales as given
  bool bias = false, f32_out = false;
};

// gtest prints a failing case by its name
void PrintTo(const Int8Spec& spec, std::ostream* os) { *os << spec.name; }

struct Int8Case {
  Int8Spec spec;
  moe_test::FloatTensor x;      // [T, K]
  std::vector<int8_t> w;        // [N, K] in [-128, 127]
  moe_test::FloatTensor scale;  // [N], as the scale dtype holds it
  moe_test::FloatTensor bias;   // [N] f32
};

// Rows n % 8 == 0 all -128, == 1 all 127, == 2 alternating -128 / 127, the rest uniform in
// [-128, 127]; scales make outputs of order one. x: normal; with T >= 3, row 0 all zero, row 1
// constant, row 2 one outlier 40 standard deviations out.
Int8Case make_int8_case(const Int8Spec& spec, uint64_t seed = 7) {
  Int8Case c;
  c.spec = spec;
  moe_test::Rng rng(seed + static_cast<uint64_t>(spec.rows * 131 + spec.cols * 7 + spec.tokens));
  const int64_t T = spec.tokens, N = spec.rows, K = spec.cols;
  std::vector<float> x(static_cast<size_t>(T * K));
  for (float& v : x) v = static_cast<float>(rng.normal());
  if (T >= 3) {
    std::fill(x.begin(), x.begin() + K, 0.0f);
    std::fill(x.begin() + K, x.begin() + 2 * K, 0.75f);
    x[static_cast<size_t>(2 * K + K / 3)] = 40.0f;
  }
  c.x = moe_test::make_float_tensor(x, spec.dtype);
  c.w.resize(static_cast<size_t>(N * K));
  std::vector<float> scale(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    double sumsq = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t v = n % 8 == 0   ? -128
                        : n % 8 == 1 ? 127
                        : n % 8 == 2 ? (k % 2 == 0 ? -128 : 127)
                                     : rng.integer(-128, 127);
      c.w[static_cast<size_t>(n * K + k)] = static_cast<int8_t>(v);
      sumsq += static_cast<double>(v * v);
    }
    // |out| ~ s * sqrt(SUM w^2) for normal x
    scale[static_cast<size_t>(n)] =
        static_cast<float>(rng.uniform(0.75, 1.25) / std::sqrt(std::max(sumsq, 1.0)));
  }
  c.scale = moe_test::make_float_tensor(scale, spec.scale_dtype);
  std::vector<float> bias(static_cast<size_t>(N));
  for (float& b : bias) b = spec.bias ? static_cast<float>(0.1 * rng.normal()) : 0.0f;
  c.bias = moe_test::make_float_tensor(bias, DType::f32);
  return c;
}

w4a8moe::PackOptions int8_options(int group_size = -1) {
  w4a8moe::PackOptions opt;
  opt.weight_format = WeightFormat::int8;
  opt.group_size = group_size;
  return opt;
}

// The packed size of an int8 layer of N x K in layout qu8_p16k4, scales of `sbytes` bytes, no
// bias: panels of 16 rows, each 16 K weight bytes, 16 scales and 16 int32 sums (each section
// 16-byte aligned, the record 64-byte aligned), after the 128-byte header.
size_t bytes_layout_size(int64_t N, int64_t K, int64_t sbytes) {
  const auto a16 = [](int64_t v) { return (v + 15) / 16 * 16; };
  const int64_t record = (a16(a16(16 * K) + 16 * sbytes) + 64 + 63) / 64 * 64;
  return static_cast<size_t>(128 + (N + 15) / 16 * record);
}

bool bytes_layout(const w4a8moe::PackedWeights& packed) {
  return packed.info().layout == "qu8_p16k4";
}

// The active kernel set packs int8 weights as bytes (its int8 layout is one of bytes).
bool active_set_packs_bytes() {
  const w4a8moe::detail::KernelSet& set = w4a8moe::detail::active_set();
  return w4a8moe::detail::layout_info(static_cast<uint32_t>(set.int8_layout), "test").int8_bytes;
}

w4a8moe::PackedWeights pack_int8(const Int8Case& c, int group_size = -1) {
  const Int8Spec& s = c.spec;
  return w4a8moe::pack_linear(
      TensorView::of(c.w.data(), DType::i8, {s.rows, s.cols}),
      TensorView::of(c.scale.bytes.data(), s.scale_dtype, {s.rows}), {},
      s.bias ? TensorView::of(c.bias.bytes.data(), DType::f32, {s.rows}) : TensorView{},
      int8_options(group_size));
}

std::vector<float> run(const Int8Case& c, std::span<const uint8_t> packed,
                       w4a8moe::Context& context) {
  const Int8Spec& s = c.spec;
  return linear_test::run_linear(context,
                                 TensorView::of(c.x.bytes.data(), s.dtype, {s.tokens, s.cols}),
                                 packed, s.rows, s.f32_out ? DType::f32 : s.dtype);
}

// The int8 matmul in double: moe_ref::exact_linear over the int8 values, one scale per row.
std::vector<double> reference(const Int8Case& c, std::span<const int8_t> w) {
  const Int8Spec& s = c.spec;
  return moe_ref::exact_linear(
      c.x.values, s.tokens, s.cols, w, c.scale.values, s.rows, -1,
      s.bias ? std::span<const float>(c.bias.values) : std::span<const float>());
}

testing::AssertionResult matches(const Int8Case& c, const std::vector<float>& got,
                                 const std::vector<double>& ref) {
  const Int8Spec& s = c.spec;
  std::vector<double> wabs(static_cast<size_t>(s.rows));  // s[n] * SUM_k (|w| + 30)
  for (int64_t n = 0; n < s.rows; ++n) {
    double sum = 0.0;
    for (int64_t k = 0; k < s.cols; ++k)
      sum += std::abs(int{c.w[static_cast<size_t>(n * s.cols + k)]}) + 30;
    wabs[static_cast<size_t>(n)] =
        std::fabs(static_cast<double>(c.scale.values[static_cast<size_t>(n)])) * sum;
  }
  std::vector<double> zterm(static_cast<size_t>(s.tokens));  // 1e-6 * recip * |zp| of row t
  for (int64_t t = 0; t < s.tokens; ++t) {
    const moe_ref::QuantRow qr = moe_ref::quant_row(
        std::span<const float>(c.x.values)
            .subspan(static_cast<size_t>(t * s.cols), static_cast<size_t>(s.cols)));
    zterm[static_cast<size_t>(t)] = 1e-6 * static_cast<double>(qr.recip) * std::abs(qr.zp);
  }
  return linear_test::matches_reference(
      got, ref, s.tokens, s.rows, s.cols, s.f32_out ? DType::f32 : s.dtype, 0.3,
      [&](int64_t t, int64_t n) {
        return zterm[static_cast<size_t>(t)] * wabs[static_cast<size_t>(n)];
      });
}

w4a8moe::Context& shared_context() {
  static w4a8moe::Context context;
  return context;
}

std::vector<Int8Spec> grid() {
  return {
      {"k32_t1", 1, 77, 32},
      {"k32_t130_bf16_bias", 130, 45, 32, DType::bf16, DType::bf16, true},
      {"k2880_t3_f16_f32_out", 3, 203, 2880, DType::f16, DType::f16, false, true},
      {"k2880_t17_bias", 17, 333, 2880, DType::f32, DType::f32, true},
      {"k2880_t130_bf16_f32_scales", 130, 259, 2880, DType::bf16, DType::f32},
      {"k4096_t1_bf16", 1, 517, 4096, DType::bf16, DType::bf16},
      {"k4096_t17_f16_bias", 17, 91, 4096, DType::f16, DType::f16, true},
      {"k4096_t130", 130, 130, 4096},
  };
}

class LinearInt8Grid : public testing::TestWithParam<Int8Spec> {};

TEST_P(LinearInt8Grid, MatchesExactReference) {
  const Int8Case c = make_int8_case(GetParam());
  const w4a8moe::PackedWeights packed = pack_int8(c);
  EXPECT_TRUE(matches(c, run(c, packed.bytes(), shared_context()), reference(c, c.w)));
}

INSTANTIATE_TEST_SUITE_P(LinearInt8, LinearInt8Grid, testing::ValuesIn(grid()),
                         [](const testing::TestParamInfo<Int8Spec>& i) { return i.param.name; });

TEST(LinearInt8, HeaderSaysInt8) {
  const Int8Case c = make_int8_case({"header", 1, 70, 2880, DType::bf16, DType::bf16, true});
  const w4a8moe::PackedWeights packed = pack_int8(c);
  const w4a8moe::PackedInfo info = packed.info();
  EXPECT_EQ(info.weight_format, WeightFormat::int8);
  EXPECT_STREQ(w4a8moe::weight_format_name(info.weight_format), "int8");
  EXPECT_EQ(info.role, w4a8moe::WeightRole::w2);
  EXPECT_EQ(info.experts, 1);
  EXPECT_EQ(info.rows, 70);
  EXPECT_EQ(info.cols, 2880);  // the layer's K, not the planes' 2K
  EXPECT_EQ(info.group_size, -1);
  EXPECT_EQ(info.scale_dtype, DType::bf16);
  EXPECT_TRUE(info.has_bias);
  EXPECT_EQ(info.version, w4a8moe::kPackedFormatVersion);
  EXPECT_EQ(w4a8moe::packed_size(w4a8moe::WeightRole::w2, 1, 70, 2880, DType::bf16, true,
                                 int8_options(), "w"),
            packed.size());
  // group size K is the same layer as -1, to the byte
  const w4a8moe::PackedWeights by_k = pack_int8(c, 2880);
  ASSERT_EQ(by_k.size(), packed.size());
  EXPECT_EQ(0, std::memcmp(by_k.bytes().data(), packed.bytes().data(), packed.size()));
}

// The largest K with the int32 sums at their bounds: rows of x constant (every q 127, or every
// q -128) against weight rows all 127, all -128 and alternating, scales making outputs of order
// one. As bytes, SUM (w + 128) q reaches 255 * 127 * 2^15 and the row's term 128 * 128 * 2^15.
TEST(LinearInt8, LargestKSumsStayExact) {
  const int64_t T = 2, N = 4, K = w4a8moe::detail::kMaxInt8Cols;
  Int8Case c = make_int8_case({"largest_k", T, N, K});
  std::vector<float> x(static_cast<size_t>(T * K), 0.75f);
  std::fill(x.begin() + K, x.end(), -0.75f);
  c.x = moe_test::make_float_tensor(x, DType::f32);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      c.w[static_cast<size_t>(n * K + k)] = static_cast<int8_t>(n == 0   ? 127
                                                                : n == 1 ? -128
                                                                : n == 2 ? (k % 2 == 0 ? 127 : -128)
                                                                         : -127);
  const std::vector<float> scale(static_cast<size_t>(N),
                                 static_cast<float>(1.0 / (0.75 * 128.0 * static_cast<double>(K))));
  c.scale = moe_test::make_float_tensor(scale, DType::f32);
  const w4a8moe::PackedWeights packed = pack_int8(c);
  EXPECT_TRUE(matches(c, run(c, packed.bytes(), shared_context()), reference(c, c.w)));
}

// Scales of every dtype, stored as given or rounded to bf16 (ScaleStorage::bf16): against the
// reference over the scales as stored (a packer that did not round would be 2^-9 off).
TEST(LinearInt8, ScaleStorage) {
  for (const DType sd : {DType::f32, DType::bf16, DType::f16})
    for (const bool to_bf16 : {false, true}) {
      Int8Case c = make_int8_case({"scales", 5, 40, 256, DType::f32, sd});
      w4a8moe::PackOptions opt = int8_options();
      if (to_bf16) opt.scale_storage = w4a8moe::ScaleStorage::bf16;
      const w4a8moe::PackedWeights packed =
          w4a8moe::pack_linear(TensorView::of(c.w.data(), DType::i8, {40, 256}),
                               TensorView::of(c.scale.bytes.data(), sd, {40}), {}, {}, opt);
      if (to_bf16)
        for (float& v : c.scale.values)
          v = w4a8moe::detail::bf16_to_f32(w4a8moe::detail::f32_to_bf16(v));
      SCOPED_TRACE(std::string(w4a8moe::dtype_name(sd)) + (to_bf16 ? " stored as bf16" : ""));
      EXPECT_EQ(packed.info().scale_dtype, to_bf16 ? DType::bf16 : sd);
      EXPECT_TRUE(matches(c, run(c, packed.bytes(), shared_context()), reference(c, c.w)));
    }
}

// A header relabelled (its checksum made valid again) is refused, not misread.
TEST(LinearInt8, DamagedHeaderRefused) {
  const Int8Case c = make_int8_case({"damage", 1, 40, 256});
  const w4a8moe::PackedWeights packed = pack_int8(c);
  const w4a8moe::PackedWeights as_zero_points =
      with_header(packed, [](w4a8moe::detail::PackedHeader& h) { h.weight_format = 1; });
  if (bytes_layout(packed)) {
    EXPECT_TRUE(throws_error(
        [&] { w4a8moe::inspect_packed(as_zero_points.bytes(), "w_packed"); },
        {"w_packed: expected int8 weights for layout qu8_p16k4", "got int4_zero_point weights"}));
  } else {
    EXPECT_TRUE(throws_error([&] { w4a8moe::inspect_packed(as_zero_points.bytes(), "w_packed"); },
                             {"w_packed", "sizes do not match"}));
  }
  const w4a8moe::PackedWeights grouped =
      with_header(packed, [](w4a8moe::detail::PackedHeader& h) { h.group_size = 256; });
  EXPECT_TRUE(
      throws_error([&] { w4a8moe::inspect_packed(grouped.bytes(), "w_packed"); },
                   {"w_packed: expected group size -1 for int8 weights, got group size 256"}));
  // the layout relabelled between bytes and nibbles: the sizes no longer match
  const w4a8moe::PackedWeights other_layout =
      with_header(packed, [&](w4a8moe::detail::PackedHeader& h) {
        h.layout =
            static_cast<uint32_t>(bytes_layout(packed) ? w4a8moe::detail::LayoutId::qu4_p16k8
                                                       : w4a8moe::detail::LayoutId::qu8_p16k4);
      });
  EXPECT_TRUE(throws_error([&] { w4a8moe::inspect_packed(other_layout.bytes(), "w_packed"); },
                           {"w_packed", "sizes do not match"}));
  const w4a8moe::PackedWeights as_w13 = with_header(packed, [](w4a8moe::detail::PackedHeader& h) {
    h.role = static_cast<uint32_t>(w4a8moe::WeightRole::w13);
  });
  EXPECT_TRUE(throws_error([&] { w4a8moe::inspect_packed(as_w13.bytes(), "w_packed"); },
                           {"w_packed: expected one expert of role w2 for int8 weights"}));
}

TEST(LinearInt8, BitIdenticalForAnyThreadCount) {
  const Int8Case c = make_int8_case({"threads", 67, 301, 512, DType::bf16, DType::bf16, true});
  const w4a8moe::PackedWeights packed = pack_int8(c);
  w4a8moe::Context one(1), three(3);
  const std::vector<float> a = run(c, packed.bytes(), one), b = run(c, packed.bytes(), three);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

// The comparison sees a change of one unit in one row's weights (the low nibbles' step).
TEST(LinearInt8, ComparisonRejectsAOneStepChange) {
  const Int8Case c = make_int8_case({"wrong", 5, 96, 2880});
  const w4a8moe::PackedWeights packed = pack_int8(c);
  const std::vector<float> got = run(c, packed.bytes(), shared_context());
  ASSERT_TRUE(matches(c, got, reference(c, c.w)));
  std::vector<int8_t> w = c.w;
  for (int64_t k = 0; k < 2880; ++k) {  // row 5: uniform values
    int8_t& v = w[static_cast<size_t>(5 * 2880 + k)];
    v = static_cast<int8_t>(v == 127 ? 126 : v + 1);
  }
  EXPECT_FALSE(matches(c, got, reference(c, w)));
}

TEST(LinearInt8, NonFiniteRowStaysInItsRow) {
  Int8Case c = make_int8_case({"nan", 3, 40, 64});
  const w4a8moe::PackedWeights packed = pack_int8(c);
  c.x.values[64 + 9] = std::numeric_limits<float>::infinity();
  c.x = moe_test::make_float_tensor(c.x.values, DType::f32);
  const std::vector<float> got = run(c, packed.bytes(), shared_context());
  moe_test::expect_non_finite_only_in_row(got, 40, 1);
}

class LinearInt8Input : public testing::Test {
 protected:
  LinearInt8Input() : c_(make_int8_case({"input", 2, 64, 256})) {}
  TensorView w() const { return TensorView::of(c_.w.data(), DType::i8, {64, 256}); }
  TensorView s() const { return TensorView::of(c_.scale.bytes.data(), DType::f32, {64}); }
  Int8Case c_;
};

TEST_F(LinearInt8Input, PackChecksEachArgument) {
  const auto opt = int8_options();
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::pack_linear(TensorView::of(c_.w.data(), DType::i8, {64, 100}), s(), {}, {}, opt);
      },
      {"w: expected an input dimension K that is a multiple of 32", "int8", "got K = 100"}));
  const std::vector<int8_t> wide(32800, 1);
  const std::vector<float> one(1, 1.0f);
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::pack_linear(TensorView::of(wide.data(), DType::i8, {1, 32800}),
                             TensorView::of(one.data(), DType::f32, {1}), {}, {}, opt);
      },
      {"w: expected an input dimension K", "[32, 32768]", "got K = 32800"}));
  EXPECT_TRUE(throws_error([&] { w4a8moe::pack_linear(w(), s(), {}, {}, int8_options(128)); },
                           {"group_size: expected -1 or K (256) for int8 weights", "got 128"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::pack_linear(w(), TensorView::of(c_.scale.bytes.data(), DType::f32, {32, 2}), {},
                             {}, opt);
      },
      {"w_scale: expected shape [1, 64]", "[1, 32, 2]"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::pack_linear(w(), TensorView::of(c_.scale.bytes.data(), DType::f32, {63}), {}, {},
                             opt);
      },
      {"w_scale: expected shape [1, 64]", "[1, 63]"}));
  EXPECT_TRUE(throws_error(
      [&] { w4a8moe::pack_linear(w(), TensorView::of(c_.w.data(), DType::i8, {64}), {}, {}, opt); },
      {"w_scale: expected dtype", "got i8"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::pack_linear(TensorView::of(c_.w.data(), DType::u8, {64, 256}), s(), {}, {}, opt);
      },
      {"w: expected dtype i8 (int8 weights), got u8"}));
  const std::vector<int8_t> zp(64, 0);
  EXPECT_TRUE(throws_error(
      [&] { w4a8moe::pack_linear(w(), s(), TensorView::of(zp.data(), DType::i8, {64}), {}, opt); },
      {"w_zero_point: expected no zero points for int8 weights"}));
  // as two int4 planes, 16 s (the high nibbles' scale) must fit the scale dtype: f16 holds up
  // to 65504; as bytes, s itself is stored
  std::vector<float> big(64, 1.0f);
  big[9] = 5000.0f;
  const moe_test::FloatTensor big16 = moe_test::make_float_tensor(big, DType::f16);
  const auto pack_big = [&] {
    return w4a8moe::pack_linear(w(), TensorView::of(big16.bytes.data(), DType::f16, {64}), {}, {},
                                opt);
  };
  if (active_set_packs_bytes()) {
    const w4a8moe::PackedWeights packed = pack_big();  // s stored as given
    EXPECT_EQ(packed.info().layout, "qu8_p16k4");
    EXPECT_EQ(packed.info().scale_dtype, DType::f16);
  } else {
    EXPECT_TRUE(
        throws_error(pack_big, {"w_scale: expected scales s whose 16 s", "f16", "5000 at [9]"}));
  }
}

// Each set packs int8 weights in its own int8 layout (AVX-512 VNNI: bytes, qu8_p16k4; the
// others: two int4 planes in the set's layout), which linear() runs on the same set.
TEST(LinearInt8, LayoutOfTheActiveSet) {
  const Int8Case c = make_int8_case({"layout", 1, 16, 64});
  const w4a8moe::PackedWeights packed = pack_int8(c);
  const std::string set = w4a8moe::active_kernel_set();
  const bool bytes = active_set_packs_bytes();
  EXPECT_EQ(bytes, set == "avx512vnni");
  EXPECT_EQ(bytes_layout(packed), bytes) << set << " packed layout " << packed.info().layout;
  EXPECT_EQ(w4a8moe::kernel_set_for_layout(packed.info().layout), set);
  if (bytes) {
    EXPECT_EQ(packed.size(), bytes_layout_size(16, 64, 4));
  }
}

// A buffer of int8 bytes under an ISA cap whose sets do not read them: refused by name.
TEST(LinearInt8, BytesLayoutRefusedBelowItsSet) {
  const std::vector<std::string> sets = w4a8moe::available_kernel_sets();
  const std::string active = w4a8moe::active_kernel_set();
  if (std::find(sets.begin(), sets.end(), "avx512vnni") == sets.end() || active == "avx512vnni" ||
      active == "amx")
    GTEST_SKIP() << "needs a cap below avx512vnni on a CPU with it (active: " << active << ")";
  const Int8Case c = make_int8_case({"capped", 2, 16, 64});
  w4a8moe::PackOptions opt = int8_options();
  opt.kernel_set = "avx512vnni";
  const w4a8moe::PackedWeights packed =
      w4a8moe::pack_linear(TensorView::of(c.w.data(), DType::i8, {16, 64}),
                           TensorView::of(c.scale.bytes.data(), DType::f32, {16}), {}, {}, opt);
  ASSERT_EQ(packed.info().layout, "qu8_p16k4");
  EXPECT_TRUE(throws_error([&] { (void)run(c, packed.bytes(), shared_context()); },
                           {"w_packed: the packed layout qu8_p16k4 has no kernel set usable",
                            "repack the weights for this machine"}));
}

TEST_F(LinearInt8Input, LinearTakesKColumns) {
  const w4a8moe::PackedWeights packed = pack_int8(c_);
  std::vector<float> x(2 * 512, 0.5f), out(2 * 64);
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::linear(shared_context(), TensorView::of(x.data(), DType::f32, {2, 512}),
                        packed.bytes(), MutableTensorView::of(out.data(), DType::f32, {2, 64}));
      },
      {"x: expected shape [T, 256]", "[2, 512]"}));
}

TEST_F(LinearInt8Input, ExpertsRefuseInt8) {
  const moe_test::Case moe = moe_test::make_case({.tokens = 2, .group_size = -1, .seed = 5});
  const moe_test::PackedPair pair = moe_test::pack(moe);
  const w4a8moe::PackedWeights int8 = pack_int8(c_);
  moe_test::Output out = moe_test::make_output(moe);
  w4a8moe::Context& ctx = shared_context();
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::forward(ctx, moe.x_view(), moe.ids_view(), moe.topk_weights_view(),
                         pair.w13.bytes(), int8.bytes(), moe.params(), out.view());
      },
      {"w2_packed: expected an MoE layer's int4 or mxfp4 weights, got int8 weights", "linear()"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::forward(ctx, moe.x_view(), moe.ids_view(), moe.topk_weights_view(), int8.bytes(),
                         pair.w2.bytes(), moe.params(), out.view());
      },
      {"w13_packed: expected an MoE layer's int4 or mxfp4 weights, got int8 weights"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::pack_w2(TensorView::of(c_.w.data(), DType::i8, {1, 64, 256}),
                         TensorView::of(c_.scale.bytes.data(), DType::f32, {1, 64}), {},
                         int8_options());
      },
      {"PackOptions::weight_format: expected int4_symmetric, int4_zero_point or mxfp4",
       "got int8"}));
  w4a8moe::MoeConfig config{.hidden = 256, .inter = 128, .experts = 4, .top_k = 2};
  config.weight_format = WeightFormat::int8;
  const w4a8moe::Support support = w4a8moe::is_supported_config(config);
  EXPECT_FALSE(support.supported);
  EXPECT_NE(support.reason.find("int8"), std::string::npos) << support.reason;
}

// ---- quantize_linear_int8 against a plain loop ---------------------------------------------

// scale = max|w| / 127 in f32, q = nearest integer of w / scale, ties to even (std::nearbyint
// in the default rounding mode), in [-127, 127].
void plain_quantize(const std::vector<float>& w, int64_t N, int64_t K, std::vector<int8_t>& q,
                    std::vector<float>& s) {
  q.assign(static_cast<size_t>(N * K), 0);
  s.assign(static_cast<size_t>(N), 0.0f);
  for (int64_t n = 0; n < N; ++n) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k)
      amax = std::max(amax, std::fabs(w[static_cast<size_t>(n * K + k)]));
    const float scale = amax / 127.0f;
    s[static_cast<size_t>(n)] = scale;
    if (scale == 0.0f) continue;
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::nearbyint(w[static_cast<size_t>(n * K + k)] / scale);
      q[static_cast<size_t>(n * K + k)] = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
    }
  }
}

TEST(QuantizeLinearInt8, MatchesAPlainLoop) {
  const int64_t N = 203, K = 300;  // several tasks of rows
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    moe_test::Rng rng(11);
    std::vector<float> w(static_cast<size_t>(N * K));
    for (float& v : w) v = static_cast<float>(0.02 * rng.normal());
    std::fill(w.begin() + 3 * K, w.begin() + 4 * K, 0.0f);  // an all-zero row
    w[static_cast<size_t>(7 * K + 5)] = 3.0f;               // one outlier
    const moe_test::FloatTensor t = moe_test::make_float_tensor(w, dtype);
    const w4a8moe::LinearInt8Weights got =
        w4a8moe::quantize_linear_int8(TensorView::of(t.bytes.data(), dtype, {N, K}));
    std::vector<int8_t> q;
    std::vector<float> s;
    plain_quantize(t.values, N, K, q, s);
    EXPECT_EQ(got.rows, N);
    EXPECT_EQ(got.cols, K);
    EXPECT_EQ(got.values, q) << w4a8moe::dtype_name(dtype);
    EXPECT_EQ(got.scales, s) << w4a8moe::dtype_name(dtype);
    EXPECT_EQ(got.scales[3], 0.0f);
  }
}

TEST(QuantizeLinearInt8, RoundsHalfToEven) {
  // scale 1 exactly (max 127): the quotients are the values themselves
  std::vector<float> w(32, 0.0f);
  const float given[] = {127.0f, 0.5f, 1.5f, 2.5f, -2.5f, -0.5f, 126.5f, -127.0f};
  std::copy(std::begin(given), std::end(given), w.begin());
  const w4a8moe::LinearInt8Weights got =
      w4a8moe::quantize_linear_int8(TensorView::of(w.data(), DType::f32, {1, 32}));
  EXPECT_EQ(got.scales[0], 1.0f);
  const int8_t want[] = {127, 0, 2, 2, -2, 0, 126, -127};
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(got.values[i], want[i]) << i;
}

TEST(QuantizeLinearInt8, NonFiniteNamesTheFirstRow) {
  const int64_t N = 300, K = 64;
  std::vector<float> w(static_cast<size_t>(N * K), 0.25f);
  w[static_cast<size_t>(250 * K + 3)] = std::numeric_limits<float>::quiet_NaN();
  w[static_cast<size_t>(131 * K + 17)] = -std::numeric_limits<float>::infinity();
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::quantize_linear_int8(TensorView::of(w.data(), DType::f32, {N, K}));
      },
      {"w: expected finite weights", "-inf in row 131", "[131, 17]"}));
  std::vector<int8_t> q(static_cast<size_t>(N * K));
  std::vector<float> s(static_cast<size_t>(N));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::quantize_linear_int8(TensorView::of(w.data(), DType::f32, {N, K}),
                                      MutableTensorView::of(q.data(), DType::i8, {N, K - 1}),
                                      MutableTensorView::of(s.data(), DType::f32, {N}));
      },
      {"values: expected contiguous i8 [300, 64]"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::quantize_linear_int8(TensorView::of(q.data(), DType::i8, {N, K}));
      },
      {"w: expected dtype f32, bf16 or f16", "i8"}));
}

// Float weights -> quantize_linear_int8 -> pack_linear -> linear(): the layer of the quantized
// weights (exact reference), within the int8 rounding of the float layer.
TEST(QuantizeLinearInt8, QuantizedLayerRuns) {
  Int8Case c = make_int8_case({"float", 2, 150, 1024});  // normal rows of x only
  moe_test::Rng rng(3);
  std::vector<float> wf(static_cast<size_t>(150 * 1024));
  for (float& v : wf) v = static_cast<float>(rng.normal() / 32.0);
  const w4a8moe::LinearInt8Weights q =
      w4a8moe::quantize_linear_int8(TensorView::of(wf.data(), DType::f32, {150, 1024}));
  c.w = q.values;
  c.scale = moe_test::make_float_tensor(q.scales, DType::f32);
  const w4a8moe::PackedWeights packed = pack_int8(c);
  const std::vector<float> got = run(c, packed.bytes(), shared_context());
  EXPECT_TRUE(matches(c, got, reference(c, c.w)));
  // against the float layer (unquantized weights and x): the int8 activations dominate
  std::vector<double> ref(got.size());
  for (int64_t t = 0; t < 2; ++t)
    for (int64_t n = 0; n < 150; ++n) {
      double y = 0.0;
      for (int64_t k = 0; k < 1024; ++k)
        y += static_cast<double>(c.x.values[static_cast<size_t>(t * 1024 + k)]) *
             static_cast<double>(wf[static_cast<size_t>(n * 1024 + k)]);
      ref[static_cast<size_t>(t * 150 + n)] = y;
    }
  EXPECT_TRUE(moe_test::matches_float(got, ref, 0.03));
}

}  // namespace
