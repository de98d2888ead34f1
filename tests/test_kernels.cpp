// Kernel-level tests generated from the registry: one suite per kernel set of the table, named by
// the set (adding a set to the table adds its tests; a set this CPU lacks skips), against the
// portable quantizer and a double-precision evaluation of the GEMM formula, on shapes around panel
// and tile edges and extreme values, and against exact integer sums where float can represent them;
// int4 symmetric and with zero points (MXFP4: test_kernel_mxfp4.cpp; the AMX tiles:
// test_kernel_amx.cpp). The helpers: kernel_test_util.hpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernel_set_test.hpp"
#include "kernel_test_util.hpp"
#include "pack/packed_format.hpp"
#include "registry.hpp"

namespace {

using namespace w4a8moe;
using namespace w4a8moe::kernel_tests;
using detail::KernelSet;
using detail::QuantRow;

W4A8MOE_KERNEL_SET_SUITE(KernelQuantize);
INSTANTIATE_TEST_SUITE_P(, KernelGemm, ::testing::ValuesIn(table_sets()), set_name);

// The table lists exactly the sets the build compiles (W4A8MOE_KERNEL_SETS of CMakeLists.txt,
// which the per-set CTest runs use).
TEST(KernelTable, ListsTheSetsTheBuildCompiles) {
  std::vector<std::string> built, table;
  std::string list = W4A8MOE_KERNEL_SETS;
  for (size_t at = 0; at != std::string::npos;) {
    const size_t comma = list.find(',', at);
    built.push_back(list.substr(at, comma == std::string::npos ? comma : comma - at));
    at = comma == std::string::npos ? comma : comma + 1;
  }
  for (const KernelSet& k : detail::kernel_table()) table.emplace_back(k.name);
  std::sort(built.begin(), built.end());
  std::sort(table.begin(), table.end());
  EXPECT_EQ(table, built);
}

TEST_P(KernelQuantize, MatchesThePortableQuantizerExactly) {
  std::mt19937 rng(11);
  const KernelSet& portable = detail::kernel_table().back();  // the table ends with it
  ASSERT_STREQ(portable.name, "scalar");
  const KernelSet* set = GetParam();
  for (int64_t cols : {1, 7, 8, 15, 16, 17, 31, 32, 33, 100, 768, 2049}) {
    const int64_t padded = (cols + 31) / 32 * 32;
    for (int64_t group_len : {int64_t{32}, padded}) {
      if (padded % group_len != 0) continue;
      for (int kind = 0; kind < 6; ++kind) {
        SCOPED_TRACE(std::string(set->name) + " cols " + std::to_string(cols) + " group " +
                     std::to_string(group_len) + " kind " + std::to_string(kind));
        const std::vector<float> a = random_row(rng, cols, kind);
        const QRowBuffer got = quantize(*set, a, padded, group_len);
        const QRowBuffer want = quantize(portable, a, padded, group_len);
        EXPECT_EQ(got.row.zp, want.row.zp);
        EXPECT_EQ(std::memcmp(&got.row.recip, &want.row.recip, 4), 0);
        const auto* gq = static_cast<const int8_t*>(got.row.data);
        const auto* wq = static_cast<const int8_t*>(want.row.data);
        for (int64_t k = 0; k < padded; ++k) ASSERT_EQ(gq[k], wq[k]) << "column " << k;
        if (set->group_terms) {
          ASSERT_NE(got.row.group_terms, nullptr);
          for (int64_t b = 0; b < padded / group_len; ++b) {
            int32_t sum = 0;
            for (int64_t k = b * group_len; k < (b + 1) * group_len; ++k) sum += gq[k];
            EXPECT_EQ(got.row.group_terms[b], -8 * sum) << "group " << b;
          }
        }
      }
    }
  }
}

TEST_P(KernelQuantize, NonFiniteRowsPoisonOnlyTheirScale) {
  const KernelSet* set = GetParam();
  SCOPED_TRACE(set->name);
  std::vector<float> a(40, 1.0f);
  a[3] = NAN;
  QRowBuffer b = quantize(*set, a, 64, 32);
  EXPECT_TRUE(std::isnan(b.row.recip));
  a[3] = INFINITY;
  b = quantize(*set, a, 64, 32);
  EXPECT_TRUE(std::isnan(b.row.recip));
}

TEST_P(KernelGemm, MatchesTheFormulaAroundTileEdges) {
  std::mt19937 rng(5);
  const std::vector<GemmCase> cases = {
      {1, 32, 32, false},    {7, 64, 32, false},    {8, 96, 32, false},    {9, 64, 64, false},
      {15, 256, 128, false}, {16, 32, -1, false},   {17, 40, -1, false},   {31, 2048, 32, false},
      {33, 96, 96, false},   {64, 256, 256, false}, {100, 200, -1, false}, {6, 64, 32, true},
      {34, 64, -1, true},    {48, 2048, 64, true},  {200, 64, 32, true},   {264, 96, -1, true},
  };
  const KernelSet* set = GetParam();
  for (const GemmCase& c : cases) {
    SCOPED_TRACE(describe(*set, c));
    auto [groups, w, s, bias] = random_gemm_weights(rng, c.rows, c.cols, c.group, 97, 89);
    PackOptions po;
    po.group_size = c.group;
    po.kernel_set = set->name;
    const TensorView wv = TensorView::of(w.data(), DType::i8, {1, c.rows, c.cols});
    const TensorView sv = c.group < 0 ? TensorView::of(s.data(), DType::f32, {1, c.rows})
                                      : TensorView::of(s.data(), DType::f32, {1, c.rows, groups});
    const TensorView bv = TensorView::of(bias.data(), DType::f32, {1, c.rows});
    const PackedWeights packed = c.w13 ? pack_w13(wv, sv, bv, po) : pack_w2(wv, sv, bv, po);
    const detail::Geometry g = detail::read_geometry(packed.bytes(), "test");
    ASSERT_EQ(g.layout, set->layout);

    for (int64_t m = 1; m <= set->tile_m; ++m) {
      std::vector<QRowBuffer> rows;
      for (int64_t r = 0; r < m; ++r)
        rows.push_back(quantize(*set, random_row(rng, c.cols, static_cast<int>(r % 6)),
                                g.cols_padded, g.group_len));
      std::vector<QuantRow> a;
      for (auto& r : rows) a.push_back(r.row);
      // every block of every part of the stored rows (one run each), in two calls when it is
      // long enough
      for (int64_t part = 0; part < g.parts; ++part)
        for (int64_t j0 = 0; j0 < g.part_rows; j0 += g.block_rows) {
          const int64_t begin = g.stored_row(part, j0);
          const int64_t len = std::min(g.part_rows - j0, g.block_len(j0));
          const int64_t split = len > 32 ? 32 : len;
          for (auto [n0, n1] :
               {std::pair{begin, begin + split}, std::pair{begin + split, begin + len}}) {
            if (n0 >= n1) continue;
            const int64_t width = (n1 - n0 + 15) / 16 * 16;
            std::vector<float> out(static_cast<size_t>(m * width), NAN);
            gemm(*set, packed, g, a.data(), m, n0, n1, out.data(), width);
            for (int64_t r = 0; r < m; ++r) {
              for (int64_t n = n0; n < n1; ++n) {
                const int64_t logical = part * g.part_rows + j0 + (n - begin);
                const double want =
                    expected(w, s, c.cols, groups, logical, a[static_cast<size_t>(r)], g.group_len,
                             static_cast<double>(bias[static_cast<size_t>(logical)]));
                // f32 rounding of the group sums and the epilogue: a few ulp of the magnitude of
                // the terms, which is at most recip * sum|s * dot| + |bias|.
                double mag = std::fabs(static_cast<double>(bias[static_cast<size_t>(logical)]));
                for (int64_t b = 0; b < groups; ++b)
                  mag += static_cast<double>(a[static_cast<size_t>(r)].recip) * 128.0 * 8.0 *
                         static_cast<double>(g.group_len) *
                         static_cast<double>(s[static_cast<size_t>(logical * groups + b)]) / 16.0;
                const double got =
                    static_cast<double>(out[static_cast<size_t>(r * width + (n - n0))]);
                ASSERT_NEAR(got, want, 1e-6 * mag + 1e-6)
                    << "m " << m << " row " << r << " output " << n;
              }
            }
          }
        }
    }
  }
}

// The kernel contract (kernel.hpp): a row's result does not depend on which other rows share its
// call, so that the forward pass is bit-identical whatever the tiling. Every set's calls of every
// size up to its tile (each size its own register tile, some with f32 sums in memory) must give
// each row the bits it gets alone.
TEST_P(KernelGemm, EveryRowGetsTheSameBitsWhateverItsCallSize) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> wi(-8, 7);
  std::uniform_real_distribution<float> sd(0.5f, 1.5f);
  const int64_t rows = 48, cols = 256;
  const KernelSet* set = GetParam();
  for (const int64_t group : {int64_t{32}, int64_t{128}, int64_t{-1}}) {
    SCOPED_TRACE(std::string(set->name) + " group " + std::to_string(group));
    const int64_t groups = group < 0 ? 1 : cols / group;
    std::vector<int8_t> w(static_cast<size_t>(rows * cols));
    for (auto& v : w) v = static_cast<int8_t>(wi(rng));
    std::vector<float> s(static_cast<size_t>(rows * groups));
    for (auto& v : s) v = sd(rng) / static_cast<float>(cols);
    PackOptions po;
    po.group_size = group;
    po.kernel_set = set->name;
    const TensorView sv = group < 0 ? TensorView::of(s.data(), DType::f32, {1, rows})
                                    : TensorView::of(s.data(), DType::f32, {1, rows, groups});
    const PackedWeights packed =
        pack_w2(TensorView::of(w.data(), DType::i8, {1, rows, cols}), sv, {}, po);
    const detail::Geometry g = detail::read_geometry(packed.bytes(), "test");
    const int64_t total = set->tile_m;
    std::vector<QRowBuffer> buffers;
    std::vector<QuantRow> a;
    for (int64_t r = 0; r < total; ++r)
      buffers.push_back(quantize(*set, random_row(rng, cols, static_cast<int>(r % 6)),
                                 g.cols_padded, g.group_len));
    for (auto& b : buffers) a.push_back(b.row);
    // all rows [r0, r0 + m) in one call, into out at their own row
    auto run = [&](int64_t r0, int64_t m, std::vector<float>& out) {
      gemm(*set, packed, g, a.data() + r0, m, 0, rows, out.data() + r0 * rows, rows);
    };
    std::vector<float> alone(static_cast<size_t>(total * rows));
    for (int64_t r = 0; r < total; ++r) run(r, 1, alone);
    for (int64_t size = 2; size <= total; ++size) {
      std::vector<float> together(alone.size(), NAN);
      for (int64_t r0 = 0; r0 < total; r0 += size) run(r0, std::min(size, total - r0), together);
      ASSERT_EQ(std::memcmp(together.data(), alone.data(), alone.size() * 4), 0)
          << "calls of " << size << " rows";
    }
  }
}

TEST_P(KernelGemm, IntegerSumsAreExactAtTheExtremes) {
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> wi(-8, 7);
  struct Shape {
    int64_t cols, group;
  };
  const int64_t rows = 40;  // 2.5 panels of 16, 5 of 8
  const KernelSet* set = GetParam();
  for (const Shape sh : {Shape{32, 32}, Shape{96, 32}, Shape{8192, 32}, Shape{8192, 128},
                         Shape{256, -1}, Shape{8192, -1}}) {
    SCOPED_TRACE(std::string(set->name) + " cols " + std::to_string(sh.cols) + " group " +
                 std::to_string(sh.group));
    const int64_t groups = sh.group < 0 ? 1 : sh.cols / sh.group;
    std::vector<int8_t> w(static_cast<size_t>(rows * sh.cols));
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t k = 0; k < sh.cols; ++k) {
        const int pattern = static_cast<int>(n % 4);
        w[static_cast<size_t>(n * sh.cols + k)] =
            static_cast<int8_t>(pattern == 0   ? -8
                                : pattern == 1 ? 7
                                : pattern == 2 ? (k % 2 ? 7 : -8)
                                               : wi(rng));
      }
    std::vector<float> ones(static_cast<size_t>(rows * groups), 1.0f);
    PackOptions po;
    po.group_size = sh.group;
    po.kernel_set = set->name;
    const TensorView sv = sh.group < 0 ? TensorView::of(ones.data(), DType::f32, {1, rows})
                                       : TensorView::of(ones.data(), DType::f32, {1, rows, groups});
    const PackedWeights packed =
        pack_w2(TensorView::of(w.data(), DType::i8, {1, rows, sh.cols}), sv, {}, po);
    const detail::Geometry g = detail::read_geometry(packed.bytes(), "test");

    ASSERT_NO_FATAL_FAILURE(expect_exact_sums(*set, packed, g, rows, w, sh.cols, rng));
  }
}

TEST_P(KernelGemm, ZeroPointMatchesTheFormulaAroundTileEdges) {
  std::mt19937 rng(37);
  std::uniform_int_distribution<int> wi(-8, 7);
  const KernelSet* set = GetParam();
  for (const GemmCase& c : std::vector<GemmCase>{{1, 32, 32, false},
                                                 {9, 64, 32, false},
                                                 {17, 256, 128, false},
                                                 {40, 2048, 32, false},
                                                 {33, 192, 64, false},
                                                 {20, 96, -1, false},
                                                 {6, 64, 32, true},
                                                 {34, 64, -1, true},
                                                 {200, 96, 32, true}}) {
    SCOPED_TRACE(describe(*set, c));
    auto [groups, w, s, bias] = random_gemm_weights(rng, c.rows, c.cols, c.group, 97, 89);
    const ZeroPointWeights zw = zero_point_weights(
        c.rows, c.cols, c.group, [&](int64_t i) { return w[static_cast<size_t>(i)]; },
        [&](int64_t) { return wi(rng); });
    const PackedWeights packed =
        pack_zero_point(zw, s, c.rows, c.cols, c.group, *set, c.w13, &bias);
    ASSERT_EQ(packed.info().weight_format, WeightFormat::int4_zero_point);
    ASSERT_NO_FATAL_FAILURE(expect_formula(*set, packed, c.cols, zw.diff, s, bias, 15.0, rng));
  }
}

// Zero points at both ends (stored 0 and 15) against values at both ends: w - z from -15 to 15,
// with unit scales, so the kernel must give each integer sum exactly.
TEST_P(KernelGemm, ZeroPointIntegerSumsAreExactAtTheExtremes) {
  std::mt19937 rng(41);
  std::uniform_int_distribution<int> wi(-8, 7);
  const int64_t rows = 40;
  const KernelSet* set = GetParam();
  for (const auto& [cols, group] :
       {std::pair<int64_t, int>{96, 32}, {4096, 32}, {4096, 128}, {4096, -1}}) {
    SCOPED_TRACE(std::string(set->name) + " cols " + std::to_string(cols) + " group " +
                 std::to_string(group));
    const ZeroPointWeights zw = zero_point_weights(
        rows, cols, group,
        [&](int64_t i) {
          const int pattern = static_cast<int>((i / cols) % 4);
          return pattern == 0 ? -8 : pattern == 1 ? 7 : pattern == 2 ? (i % 2 ? 7 : -8) : wi(rng);
        },
        [&](int64_t i) { return i % 3 == 0   ? 7
                                : i % 3 == 1 ? -8
                                             : wi(rng); });
    const std::vector<float> ones(static_cast<size_t>(rows * zw.groups), 1.0f);
    const PackedWeights packed = pack_zero_point(zw, ones, rows, cols, group, *set, false);
    const detail::Geometry g = detail::read_geometry(packed.bytes(), "test");
    ASSERT_NO_FATAL_FAILURE(expect_exact_sums(*set, packed, g, rows, zw.diff, cols, rng));
  }
}
}  // namespace
