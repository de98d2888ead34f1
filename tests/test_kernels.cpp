// Kernel-level tests generated from the registry: one suite per kernel set of the table, named by
// the set (adding a set to the table adds its tests; a set this CPU lacks skips), against the
// portable quantizer and a double-precision evaluation of the GEMM formula, on shapes around panel
// and tile edges and extreme values, and against exact integer sums where float can represent them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "kernels/ref/ref_kernels.hpp"
#if defined(__x86_64__)
#include <bit>

#include "kernels/x86_amx/amx_kernels.hpp"
#include "kernels/x86_avx512vnni/avx512vnni_kernels.hpp"
#endif
#include "kernel_set_test.hpp"
#include "pack/packed_format.hpp"
#include "registry.hpp"

namespace {

using namespace w4a8moe;
using detail::KernelSet;
using detail::QuantRow;
using kernel_tests::KernelSetTest;
using kernel_tests::set_name;
using kernel_tests::table_sets;

class KernelQuantize : public KernelSetTest {};
class KernelGemm : public KernelSetTest {};
INSTANTIATE_TEST_SUITE_P(, KernelQuantize, ::testing::ValuesIn(table_sets()), set_name);
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

// A quantized row as the driver lays it out: cols_padded bytes, then the group terms.
struct QRowBuffer {
  std::vector<int32_t> storage;
  QuantRow row;
};

QRowBuffer quantize(const KernelSet& set, const std::vector<float>& a, int64_t cols_padded,
                    int64_t group_len, int32_t group_term_offset = 8) {
  QRowBuffer b;
  b.storage.assign(static_cast<size_t>(cols_padded / 4 + cols_padded / group_len + 16), 0);
  detail::QuantizeArgs q;
  q.src = a.data();
  q.cols = static_cast<int64_t>(a.size());
  q.cols_padded = cols_padded;
  q.group_len = group_len;
  q.group_term_offset = group_term_offset;
  q.dst = b.storage.data();
  q.row = &b.row;
  set.quantize(q);
  return b;
}

// The arguments of one GEMM call: rows a[0..m) against padded output rows [n0, n1) of the
// packed expert, into out[i * stride + (n - n0)].
detail::GemmArgs gemm_args(const PackedWeights& packed, const detail::Geometry& g,
                           const QuantRow* a, int64_t m, int64_t n0, int64_t n1, float* out,
                           int64_t stride) {
  detail::GemmArgs args;
  args.m = m;
  args.a = a;
  args.expert = packed.bytes().data() + detail::kHeaderBytes;
  args.geometry = &g;
  args.n_begin = n0;
  args.n_end = n1;
  args.c = out;
  args.c_stride = stride;
  return args;
}

// One GEMM call of `set` (the set's GEMM for m rows).
void gemm(const KernelSet& set, const PackedWeights& packed, const detail::Geometry& g,
          const QuantRow* a, int64_t m, int64_t n0, int64_t n1, float* out, int64_t stride) {
  set.gemm(gemm_args(packed, g, a, m, n0, n1, out, stride));
}

std::vector<float> random_row(std::mt19937& rng, int64_t n, int kind) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> a(static_cast<size_t>(n));
  for (auto& v : a) v = nd(rng);
  if (kind == 1)
    for (auto& v : a) v = std::fabs(v) + 0.1f;  // all positive: zp = -128
  if (kind == 2)
    for (auto& v : a) v = -std::fabs(v) - 0.1f;  // all negative: zp = 127
  if (kind == 3)
    for (auto& v : a) v = 0.0f;  // all zero
  if (kind == 4)
    for (auto& v : a) v = 2.5f;                         // constant
  if (kind == 5) a[static_cast<size_t>(n / 2)] = 1e4f;  // one huge outlier
  return a;
}

// One expert's weights for a GEMM test: int4 values [rows, cols], -8 at the multiples of `at_min`
// and 7 at the other multiples of `at_max`; scales [rows, groups] in [0.5, 1.5) / cols; biases
// [rows] in [-0.5, 0.5).
struct GemmWeights {
  int64_t groups;
  std::vector<int8_t> w;
  std::vector<float> s, bias;
};
GemmWeights random_gemm_weights(std::mt19937& rng, int64_t rows, int64_t cols, int group,
                                size_t at_min, size_t at_max) {
  std::uniform_int_distribution<int> wi(-8, 7);
  std::uniform_real_distribution<float> sd(0.5f, 1.5f);
  GemmWeights out;
  out.groups = group < 0 ? 1 : cols / group;
  out.w.resize(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < out.w.size(); ++i)
    out.w[i] = static_cast<int8_t>(i % at_min == 0 ? -8 : (i % at_max == 0 ? 7 : wi(rng)));
  out.s.resize(static_cast<size_t>(rows * out.groups));
  out.bias.resize(static_cast<size_t>(rows));
  for (auto& v : out.s) v = sd(rng) / static_cast<float>(cols);
  for (auto& v : out.bias) v = sd(rng) - 1.0f;
  return out;
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

struct GemmCase {
  int64_t rows, cols;
  int group;
  bool w13;
};

// Double-precision value of the GEMM contract for one output row from the logical weights.
double expected(const std::vector<int8_t>& w, const std::vector<float>& s, int64_t cols,
                int64_t groups, int64_t n, const QuantRow& a, int64_t group_len, double bias) {
  const auto* q = static_cast<const int8_t*>(a.data);
  double sum = 0.0;
  for (int64_t b = 0; b < groups; ++b) {
    int64_t dot = 0;
    for (int64_t k = b * group_len; k < std::min(cols, (b + 1) * group_len); ++k)
      dot += (int64_t{q[k]} - a.zp) * w[static_cast<size_t>(n * cols + k)];
    sum += static_cast<double>(s[static_cast<size_t>(n * groups + b)]) * static_cast<double>(dot);
  }
  return static_cast<double>(a.recip) * sum + bias;
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
    SCOPED_TRACE(std::string(set->name) + " rows " + std::to_string(c.rows) + " cols " +
                 std::to_string(c.cols) + " group " + std::to_string(c.group) +
                 (c.w13 ? " w13" : " w2"));
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

// Integer accumulators compared exactly: with unit scales, recip 1 and no bias, every kernel's
// f32 output is an integer-valued sum that float represents exactly (|sum| < 2^24), so each set
// must give SUM_k (q[k] - zp) * w[n,k] to the last bit, at the extremes of both operands (q at
// -128 and 127 with zero points 0, -128 and 127; weights at -8 and 7), around tile and panel
// edges, up to K = 8192 (255 * 8 * 8192 < 2^24: the largest K at which the test can be exact).
// Rows made by hand in the quantizers' format (int8 q at the extremes 127 and -128, alternating,
// or random; zero points 0, -128 and 127; then -offset * SUM q per group for the weights'
// offset), against `rows` outputs of `packed` whose integer weights are `w` [rows, cols] and
// scales 1: the GEMM must give the exact integer sums, in calls of 1 and of tile_m rows.
void expect_exact_sums(const KernelSet& set, const PackedWeights& packed, const detail::Geometry& g,
                       int64_t rows, const std::vector<int8_t>& w, int64_t cols,
                       std::mt19937& rng) {
  std::uniform_int_distribution<int> qi(-128, 127);
  const int64_t m = set.tile_m;
  std::vector<std::vector<int32_t>> storage;
  std::vector<QuantRow> a;
  for (int64_t r = 0; r < m; ++r) {
    storage.emplace_back(static_cast<size_t>(g.cols_padded / 4 + g.groups + 16), 0);
    auto* q = reinterpret_cast<int8_t*>(storage.back().data());
    const int pattern = static_cast<int>(r % 4);
    for (int64_t k = 0; k < g.cols_padded; ++k)
      q[k] = static_cast<int8_t>(pattern == 0   ? 127
                                 : pattern == 1 ? -128
                                 : pattern == 2 ? (k % 2 ? 127 : -128)
                                                : qi(rng));
    QuantRow row;
    row.data = q;
    row.recip = 1.0f;
    row.zp = r % 3 == 0 ? 0 : (r % 3 == 1 ? -128 : 127);
    if (set.group_terms) {
      auto* terms = reinterpret_cast<int32_t*>(q + g.cols_padded);
      for (int64_t b = 0; b < g.groups; ++b) {
        int32_t sum = 0;
        for (int64_t k = b * g.group_len; k < (b + 1) * g.group_len; ++k) sum += q[k];
        terms[b] = -set.group_term_offset(g) * sum;
      }
      row.group_terms = terms;
    }
    a.push_back(row);
  }
  for (int64_t size : {int64_t{1}, m}) {
    const int64_t width = (rows + 15) / 16 * 16;
    std::vector<float> out(static_cast<size_t>(size * width), NAN);
    gemm(set, packed, g, a.data() + (m - size), size, 0, rows, out.data(), width);
    for (int64_t r = 0; r < size; ++r) {
      const QuantRow& row = a[static_cast<size_t>(m - size + r)];
      const auto* q = static_cast<const int8_t*>(row.data);
      for (int64_t n = 0; n < rows; ++n) {
        int64_t want = 0;
        for (int64_t k = 0; k < cols; ++k)
          want += (int64_t{q[k]} - row.zp) * w[static_cast<size_t>(n * cols + k)];
        ASSERT_EQ(out[static_cast<size_t>(r * width + n)], static_cast<float>(want))
            << "rows " << size << ", row " << r << " (zp " << row.zp << "), output " << n;
      }
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

// One expert's MXFP4 weights for a GEMM test: e2m1 codes nibble-packed [rows, cols / 2] (element
// 2j low), e8m0 exponents [rows, cols / 32]; and what they mean, written here from the OCP
// definition: 2 * e2m1 as integers [rows, cols] and the scales 2^(e - 128) [rows, groups].
struct Mxfp4Weights {
  std::vector<uint8_t> codes, exponents;
  std::vector<int8_t> doubled;
  std::vector<float> s;
};
int e2m1_doubled(int code) {
  const int exponent = (code >> 1) & 3, mantissa = code & 1;
  const int magnitude = exponent == 0 ? mantissa : (2 + mantissa) << (exponent - 1);
  return code & 8 ? -magnitude : magnitude;
}
Mxfp4Weights mxfp4_weights(int64_t rows, int64_t cols, const std::function<int(int64_t)>& code,
                           const std::function<int(int64_t)>& exponent) {
  Mxfp4Weights m;
  m.codes.assign(static_cast<size_t>(rows * cols / 2), 0);
  m.doubled.resize(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows * cols; ++i) {
    const int c = code(i);
    m.codes[static_cast<size_t>(i / 2)] |= static_cast<uint8_t>(i % 2 == 0 ? c : c << 4);
    m.doubled[static_cast<size_t>(i)] = static_cast<int8_t>(e2m1_doubled(c));
  }
  for (int64_t i = 0; i < rows * cols / 32; ++i) {
    const int e = exponent(i);
    m.exponents.push_back(static_cast<uint8_t>(e));
    m.s.push_back(std::ldexp(1.0f, e - 128));
  }
  return m;
}
PackedWeights pack_mxfp4(const Mxfp4Weights& m, int64_t rows, int64_t cols, const KernelSet& set,
                         bool w13, const std::vector<float>* bias = nullptr) {
  PackOptions po;
  po.group_size = 32;
  po.weight_format = WeightFormat::mxfp4;
  po.kernel_set = set.name;
  const TensorView wv = TensorView::of(m.codes.data(), DType::u8, {1, rows, cols / 2});
  const TensorView sv = TensorView::of(m.exponents.data(), DType::u8, {1, rows, cols / 32});
  const TensorView bv = bias ? TensorView::of(bias->data(), DType::f32, {1, rows}) : TensorView{};
  return w13 ? pack_w13(wv, sv, bv, po) : pack_w2(wv, sv, bv, po);
}

TEST(Mxfp4, TheKernelTablesAreTheOcpValues) {
  // e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, doubled
  const int want[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(e2m1_doubled(c), want[c]);
    EXPECT_EQ(detail::kMxfp4Doubled[c], want[c]);
    EXPECT_EQ(int{detail::kMxfp4Unsigned[c]}, want[c] + detail::kMxfp4Offset);
  }
}

// Every block of every part of `packed` (whole, in one call each) against the formula over its
// integer weights w [rows, cols] and scales s [rows, groups], in calls of 1 to tile_m rows;
// max_w bounds |w| (and so the f32 rounding of the group sums).
void expect_formula(const KernelSet& set, const PackedWeights& packed, int64_t cols,
                    const std::vector<int8_t>& w, const std::vector<float>& s,
                    const std::vector<float>& bias, double max_w, std::mt19937& rng) {
  const detail::Geometry g = detail::read_geometry(packed.bytes(), "test");
  for (int64_t m = 1; m <= set.tile_m; ++m) {
    std::vector<QRowBuffer> rows;
    std::vector<QuantRow> a;
    for (int64_t r = 0; r < m; ++r)
      rows.push_back(quantize(set, random_row(rng, cols, static_cast<int>(r % 6)), g.cols_padded,
                              g.group_len, set.group_term_offset(g)));
    for (auto& r : rows) a.push_back(r.row);
    for (int64_t part = 0; part < g.parts; ++part)
      for (int64_t j0 = 0; j0 < g.part_rows; j0 += g.block_rows) {
        const int64_t n0 = g.stored_row(part, j0);
        const int64_t len = std::min(g.part_rows - j0, g.block_len(j0));
        const int64_t width = (len + 15) / 16 * 16;
        std::vector<float> out(static_cast<size_t>(m * width), NAN);
        gemm(set, packed, g, a.data(), m, n0, n0 + len, out.data(), width);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t n = 0; n < len; ++n) {
            const int64_t logical = part * g.part_rows + j0 + n;
            const auto b = static_cast<double>(bias[static_cast<size_t>(logical)]);
            const double want =
                expected(w, s, cols, g.groups, logical, a[static_cast<size_t>(r)], g.group_len, b);
            double mag = std::fabs(b);
            for (int64_t k = 0; k < g.groups; ++k)
              mag += static_cast<double>(a[static_cast<size_t>(r)].recip) * 128.0 * max_w *
                     static_cast<double>(g.group_len) *
                     static_cast<double>(s[static_cast<size_t>(logical * g.groups + k)]) / 16.0;
            ASSERT_NEAR(out[static_cast<size_t>(r * width + n)], want, 1e-6 * mag + 1e-6)
                << "m " << m << " row " << r << " output " << logical;
          }
      }
  }
}

TEST_P(KernelGemm, Mxfp4MatchesTheFormulaAroundTileEdges) {
  std::mt19937 rng(23);
  std::uniform_int_distribution<int> ci(0, 15), ei(122, 130);
  std::uniform_real_distribution<float> bd(-0.5f, 0.5f);
  const KernelSet* set = GetParam();
  for (const GemmCase& c : std::vector<GemmCase>{{1, 32, 32, false},
                                                 {9, 64, 32, false},
                                                 {40, 2048, 32, false},
                                                 {6, 64, 32, true},
                                                 {200, 96, 32, true}}) {
    SCOPED_TRACE(std::string(set->name) + " rows " + std::to_string(c.rows) + " cols " +
                 std::to_string(c.cols) + (c.w13 ? " w13" : " w2"));
    const Mxfp4Weights mw = mxfp4_weights(
        c.rows, c.cols, [&](int64_t) { return ci(rng); }, [&](int64_t) { return ei(rng); });
    std::vector<float> bias(static_cast<size_t>(c.rows));
    for (auto& v : bias) v = bd(rng);
    const PackedWeights packed = pack_mxfp4(mw, c.rows, c.cols, *set, c.w13, &bias);
    const detail::Geometry g = detail::read_geometry(packed.bytes(), "test");
    ASSERT_EQ(g.weight_format, WeightFormat::mxfp4);
    ASSERT_EQ(g.scale_dtype, DType::bf16);
    ASSERT_NO_FATAL_FAILURE(
        expect_formula(*set, packed, c.cols, mw.doubled, mw.s, bias, 12.0, rng));
  }
}

// Codes +-6 (7, 15) and +-4 against activations 127 and -128, scales 2^0 (e = 128): every group
// sum and the result are integers that f32 holds exactly, so the kernel must give them exactly.
TEST_P(KernelGemm, Mxfp4IntegerSumsAreExactAtTheExtremes) {
  std::mt19937 rng(29);
  std::uniform_int_distribution<int> ci(0, 15);
  const int64_t rows = 40, cols = 4096;  // 4096 * 255 * 12 < 2^24
  const KernelSet* set = GetParam();
  const Mxfp4Weights mw = mxfp4_weights(
      rows, cols,
      [&](int64_t i) {
        const int pattern = static_cast<int>((i / cols) % 4);
        return pattern == 0 ? 7 : pattern == 1 ? 15 : pattern == 2 ? (i % 2 ? 7 : 14) : ci(rng);
      },
      [](int64_t) { return 128; });
  const PackedWeights packed = pack_mxfp4(mw, rows, cols, *set, false);
  const detail::Geometry g = detail::read_geometry(packed.bytes(), "test");
  expect_exact_sums(*set, packed, g, rows, mw.doubled, cols, rng);
}

// int4 with zero points for a GEMM test: values w and zero points z (per row and group, or per
// row) in [-8, 7], and what the kernels multiply, w - z [rows, cols].
struct ZeroPointWeights {
  std::vector<int8_t> w, z, diff;
  int64_t groups = 0;
};
ZeroPointWeights zero_point_weights(int64_t rows, int64_t cols, int group,
                                    const std::function<int(int64_t)>& value,
                                    const std::function<int(int64_t)>& zero) {
  ZeroPointWeights zw;
  zw.groups = group < 0 ? 1 : cols / group;
  const int64_t group_len = group < 0 ? cols : group;
  for (int64_t i = 0; i < rows * zw.groups; ++i) zw.z.push_back(static_cast<int8_t>(zero(i)));
  for (int64_t i = 0; i < rows * cols; ++i) {
    zw.w.push_back(static_cast<int8_t>(value(i)));
    const int8_t z = zw.z[static_cast<size_t>(i / cols * zw.groups + i % cols / group_len)];
    zw.diff.push_back(static_cast<int8_t>(zw.w.back() - z));
  }
  return zw;
}
PackedWeights pack_zero_point(const ZeroPointWeights& zw, const std::vector<float>& s, int64_t rows,
                              int64_t cols, int group, const KernelSet& set, bool w13,
                              const std::vector<float>* bias = nullptr) {
  PackOptions po;
  po.group_size = group;
  po.weight_format = WeightFormat::int4_zero_point;
  po.kernel_set = set.name;
  const TensorView wv = TensorView::of(zw.w.data(), DType::i8, {1, rows, cols});
  const TensorView sv = group < 0 ? TensorView::of(s.data(), DType::f32, {1, rows})
                                  : TensorView::of(s.data(), DType::f32, {1, rows, zw.groups});
  const TensorView zv = group < 0 ? TensorView::of(zw.z.data(), DType::i8, {1, rows})
                                  : TensorView::of(zw.z.data(), DType::i8, {1, rows, zw.groups});
  const TensorView bv = bias ? TensorView::of(bias->data(), DType::f32, {1, rows}) : TensorView{};
  return w13 ? pack_w13(wv, sv, zv, bv, po) : pack_w2(wv, sv, zv, bv, po);
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
    SCOPED_TRACE(std::string(set->name) + " rows " + std::to_string(c.rows) + " cols " +
                 std::to_string(c.cols) + " group " + std::to_string(c.group) +
                 (c.w13 ? " w13" : " w2"));
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

#if defined(__x86_64__)
// The avx512vnni set's two MXFP4 paths (the one gemm_qa8_qu4p16k8 takes on CPUs with VBMI, and
// the other) give the same bits at every call size: the same exact sums, scaled the same way.
TEST(Mxfp4Avx512vnni, ShuffleAndPermutePathsGiveTheSameBits) {
  const CpuFeatures& f = cpu_features();
  if (!f.avx512vnni || !f.avx512bw || !f.avx512vbmi)
    GTEST_SKIP() << "needs AVX-512 VNNI and VBMI: " << f.summary();
  const KernelSet& zmm = detail::set_by_name("avx512vnni", "test");
  std::mt19937 rng(31);
  std::uniform_int_distribution<int> ci(0, 15), ei(120, 130);
  const int64_t rows = 72, cols = 512;
  std::vector<float> bias(static_cast<size_t>(rows), 0.25f);
  const PackedWeights packed = pack_mxfp4(
      mxfp4_weights(
          rows, cols, [&](int64_t) { return ci(rng); }, [&](int64_t) { return ei(rng); }),
      rows, cols, zmm, true, &bias);
  const detail::Geometry g = detail::read_geometry(packed.bytes(), "test");
  std::vector<QRowBuffer> buffers;
  std::vector<QuantRow> a;
  for (int64_t r = 0; r < zmm.tile_m; ++r)
    buffers.push_back(quantize(zmm, random_row(rng, cols, static_cast<int>(r % 6)), g.cols_padded,
                               g.group_len, zmm.group_term_offset(g)));
  for (auto& b : buffers) a.push_back(b.row);
  const int64_t width = 80;
  for (int64_t m = 1; m <= zmm.tile_m; ++m) {
    std::vector<float> shuffle(static_cast<size_t>(m * width), NAN), permute = shuffle;
    detail::avx512vnni::gemm_mxfp4_shuffle(
        gemm_args(packed, g, a.data(), m, 0, rows, shuffle.data(), width));
    detail::avx512vnni::gemm_mxfp4_vbmi(
        gemm_args(packed, g, a.data(), m, 0, rows, permute.data(), width));
    for (int64_t r = 0; r < m; ++r)
      for (int64_t n = 0; n < rows; ++n)
        ASSERT_EQ(std::bit_cast<uint32_t>(shuffle[static_cast<size_t>(r * width + n)]),
                  std::bit_cast<uint32_t>(permute[static_cast<size_t>(r * width + n)]))
            << "m " << m << " row " << r << " output " << n;
  }
}

// The AMX tile GEMM on both backends (the instructions where the CPU has them, the software model
// of the tiles on any CPU with AVX-512 VBMI) against the avx512vnni GEMM, bit for bit: the amx
// set switches between the two by rows per call, so they must agree exactly, at every call size,
// every group size (K steps of 32 and 64, groups spanning several steps, channelwise), K not a
// multiple of 64, a last panel that is partial, biases and every scale dtype.
void check_tile_gemm(detail::GemmFn tiles, const char* backend) {
  std::mt19937 rng(23);
  struct Shape {
    int64_t rows, cols;
    int group;
    DType scales;
    bool bias;
    bool mxfp4 = false;        // mxfp4 codes (group 32, bf16 scales 2^(e - 128))
    bool zero_points = false;  // int4 with zero points (f32 scales)
  };
  const Shape shapes[] = {
      {40, 256, 32, DType::bf16, true, true},
      {48, 2048, 32, DType::bf16, false, true},
      {40, 256, 32, DType::bf16, false},
      {40, 256, 64, DType::f32, true},
      {33, 192, 96, DType::f16, false},
      {48, 512, 128, DType::bf16, true},
      {24, 512, 256, DType::f32, false},
      {40, 160, -1, DType::bf16, true},
      {32, 2048, -1, DType::f32, false},
      {16, 2048, 32, DType::f32, true},
      // panels of one group each (a K block of one group, one tile): the scaling side lags
      // several panels behind the unpacking of the next
      {80, 512, 256, DType::f32, false},
      {40, 256, 32, DType::f32, true, false, true},
      {48, 512, 128, DType::f32, false, false, true},
      {40, 160, -1, DType::f32, true, false, true},
  };
  const KernelSet& zmm = detail::set_by_name("avx512vnni", "test");
  for (const Shape& sh : shapes) {
    SCOPED_TRACE(std::string(backend) + " rows " + std::to_string(sh.rows) + " cols " +
                 std::to_string(sh.cols) + " group " + std::to_string(sh.group));
    auto [groups, w, s, bias] = random_gemm_weights(rng, sh.rows, sh.cols, sh.group, 53, 59);
    std::vector<uint16_t> s16(s.size());
    for (size_t i = 0; i < s.size(); ++i) {
      if (sh.scales == DType::bf16) s16[i] = detail::f32_to_bf16(s[i]);
      if (sh.scales == DType::f16) s16[i] = detail::f32_to_f16(s[i]);
    }
    const void* sdata = sh.scales == DType::f32 ? static_cast<const void*>(s.data()) : s16.data();
    PackOptions po;
    po.group_size = sh.group;
    po.kernel_set = "avx512vnni";
    const TensorView sv = sh.group < 0 ? TensorView::of(sdata, sh.scales, {1, sh.rows})
                                       : TensorView::of(sdata, sh.scales, {1, sh.rows, groups});
    const TensorView bv =
        sh.bias ? TensorView::of(bias.data(), DType::f32, {1, sh.rows}) : TensorView{};
    std::uniform_int_distribution<int> ci(0, 15), ei(120, 130), zi(-8, 7);
    const PackedWeights packed =
        sh.mxfp4 ? pack_mxfp4(mxfp4_weights(
                                  sh.rows, sh.cols, [&](int64_t) { return ci(rng); },
                                  [&](int64_t) { return ei(rng); }),
                              sh.rows, sh.cols, zmm, false, sh.bias ? &bias : nullptr)
        : sh.zero_points
            ? pack_zero_point(zero_point_weights(
                                  sh.rows, sh.cols, sh.group,
                                  [&](int64_t i) { return w[static_cast<size_t>(i)]; },
                                  [&](int64_t) { return zi(rng); }),
                              s, sh.rows, sh.cols, sh.group, zmm, false, sh.bias ? &bias : nullptr)
            : pack_w2(TensorView::of(w.data(), DType::i8, {1, sh.rows, sh.cols}), sv, bv, po);
    const detail::Geometry g = detail::read_geometry(packed.bytes(), "test");
    std::vector<QRowBuffer> buffers;
    std::vector<QuantRow> a;
    const int64_t rows = detail::kAmxTileM;
    for (int64_t r = 0; r < rows; ++r)
      buffers.push_back(quantize(zmm, random_row(rng, sh.cols, static_cast<int>(r % 6)),
                                 g.cols_padded, g.group_len, zmm.group_term_offset(g)));
    for (auto& b : buffers) a.push_back(b.row);
    const int64_t width = (sh.rows + 15) / 16 * 16;
    // the zmm reference: one row per call
    std::vector<float> want(static_cast<size_t>(rows * width), NAN);
    for (int64_t r = 0; r < rows; ++r)
      gemm(zmm, packed, g, a.data() + r, 1, 0, sh.rows, want.data() + r * width, width);
    for (int64_t m = 1; m <= rows; ++m) {
      std::vector<float> got(static_cast<size_t>(m * width), NAN);
      tiles(gemm_args(packed, g, a.data(), m, 0, sh.rows, got.data(), width));
      for (int64_t r = 0; r < m; ++r)
        for (int64_t n = 0; n < sh.rows; ++n)
          ASSERT_EQ(std::bit_cast<uint32_t>(got[static_cast<size_t>(r * width + n)]),
                    std::bit_cast<uint32_t>(want[static_cast<size_t>(r * width + n)]))
              << "m " << m << ", row " << r << ", output " << n << ": "
              << got[static_cast<size_t>(r * width + n)] << " vs "
              << want[static_cast<size_t>(r * width + n)];
    }
  }
}

// The backends: the amx set's tile GEMM alone, the amx set's GEMM for more than kAmxSmallMaxM
// rows (tiles for the full 16-row tiles and a worthwhile partial one, the zmm GEMM for the rows
// left: amx_min_tile_rows()), and the amxemu set's GEMM for more than kAmxSmallMaxM rows, which
// is the tile GEMM on the software model.
struct TileBackend {
  const char* name;
  const char* set;
  detail::GemmFn tiles;
};

class AmxTileGemm : public ::testing::TestWithParam<TileBackend> {};

TEST_P(AmxTileGemm, GivesTheZmmGemmBits) {
  const KernelSet* set = nullptr;
  for (const KernelSet& k : detail::kernel_table())
    if (std::string_view(k.name) == GetParam().set) set = &k;
  ASSERT_NE(set, nullptr);
  if (!set->usable(cpu_features()))
    GTEST_SKIP() << "kernel set " << set->name << " is not usable on this CPU ("
                 << cpu_features().summary() << "; AMX " << cpu_features().amx_status << ")";
  check_tile_gemm(GetParam().tiles, GetParam().name);
}

std::string backend_name(const ::testing::TestParamInfo<TileBackend>& backend) {
  return backend.param.name;
}

INSTANTIATE_TEST_SUITE_P(
    , AmxTileGemm,
    ::testing::Values(TileBackend{"amx", "amx", detail::amx::gemm_tiles},
                      TileBackend{"amx_split", "amx", detail::amx::gemm_qa8_qu4p16k8},
                      TileBackend{"amxemu", "amxemu", detail::amxemu::gemm_qa8_qu4p16k8}),
    backend_name);
#endif
