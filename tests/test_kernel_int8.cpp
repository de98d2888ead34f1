// Kernel-level tests of int8 weights (WeightFormat::int8, pack_linear) in each kernel set's int8
// layout (KernelSet::int8_layout: bytes, qu8_p16k4, on avx512vnni; two int4 planes in the set's
// own layout elsewhere): calls of 1 to 16 rows and the set's largest, over row ranges of odd panel
// counts, one that starts past the first panel and one that ends off a panel edge, against the
// double-precision formula over the quantized rows; and every row the same bits whatever the
// size of its call (the kernel contract).
//
// Tolerance: 2e-6 * recip * s[n] * SUM_k (|q[k]| + |zp|) (|w[n, k]| + 30): the f32 steps of
// the planes (two group sums, the zero-point term subtracted in f32) and of the epilogue; the
// bytes' integer sums are exact. One weight off by one moves an output by recip * s * |q - zp|,
// above the bound at K = 96 for the rows that are not near zero.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
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

W4A8MOE_KERNEL_SET_SUITE(KernelInt8);

struct Int8Layer {
  int64_t rows, cols;
  std::vector<int8_t> w;  // [rows, cols]
  std::vector<float> s;   // [rows]
  PackedWeights packed;
  detail::Geometry g;
};

// Rows n % 5 == 0 all -128, == 1 all 127, the rest uniform in [-128, 127]; scales in
// [0.5, 1.5) / K; packed for `set`.
Int8Layer make_layer(const KernelSet& set, std::mt19937& rng, int64_t rows, int64_t cols) {
  Int8Layer L{rows, cols, {}, {}, {}, {}};
  std::uniform_int_distribution<int> wi(-128, 127);
  std::uniform_real_distribution<float> sd(0.5f, 1.5f);
  L.w.resize(static_cast<size_t>(rows * cols));
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t k = 0; k < cols; ++k)
      L.w[static_cast<size_t>(n * cols + k)] = static_cast<int8_t>(n % 5 == 0   ? -128
                                                                   : n % 5 == 1 ? 127
                                                                                : wi(rng));
  L.s.resize(static_cast<size_t>(rows));
  for (float& v : L.s) v = sd(rng) / static_cast<float>(cols);
  PackOptions po;
  po.weight_format = WeightFormat::int8;
  po.kernel_set = set.name;
  L.packed = pack_linear(TensorView::of(L.w.data(), DType::i8, {rows, cols}),
                         TensorView::of(L.s.data(), DType::f32, {rows}), {}, {}, po);
  L.g = detail::read_geometry(L.packed.bytes(), "test");
  return L;
}

// Calls of 1 to 16 rows (every register tile of the zmm and ymm GEMMs), and the largest two of
// a set whose tile is taller (amx: 128; its software model is slow).
std::vector<int64_t> call_sizes(const KernelSet& set) {
  std::vector<int64_t> m;
  for (int64_t r = 1; r <= std::min<int64_t>(set.tile_m, 16); ++r) m.push_back(r);
  for (const int64_t r : {set.tile_m - 1, set.tile_m})
    if (r > 16) m.push_back(r);
  return m;
}

// Row a of K values quantized by the set as linear() does: as it is, or as [a, a] for the planes.
QRowBuffer quantize_for(const KernelSet& set, const detail::Geometry& g, std::vector<float> a) {
  if (g.int8_planes()) a.insert(a.end(), a.begin(), a.end());
  return quantize(set, a, g.cols_padded, g.group_len, set.group_term_offset(g));
}

TEST_P(KernelInt8, MatchesTheFormulaOnEveryCallSize) {
  const KernelSet& set = *GetParam();
  std::mt19937 rng(17);
  for (const int64_t cols : {int64_t{96}, int64_t{2880}}) {
    const Int8Layer L = make_layer(set, rng, 83, cols);
    const detail::Geometry& g = L.g;
    ASSERT_EQ(g.layout, set.int8_layout);
    ASSERT_EQ(g.int8_planes(),
              !detail::layout_info(static_cast<uint32_t>(g.layout), "test").int8_bytes);
    std::vector<QRowBuffer> rows;
    std::vector<QuantRow> a;
    for (int64_t r = 0; r < set.tile_m; ++r)
      rows.push_back(quantize_for(set, g, random_row(rng, cols, static_cast<int>(r % 6))));
    for (auto& r : rows) a.push_back(r.row);
    const int64_t P = g.panel;
    // 5 panels (an odd count: tiles of two panels and one), from the second panel to off a
    // panel edge, and the whole layer with its padding rows
    for (const auto& [n0, n1] : {std::pair{int64_t{0}, 5 * P}, std::pair{P, L.rows},
                                 std::pair{int64_t{0}, g.rows_padded}}) {
      const int64_t width = (n1 - n0 + P - 1) / P * P;
      for (const int64_t m : call_sizes(set)) {
        SCOPED_TRACE(std::string(set.name) + " K " + std::to_string(cols) + " rows [" +
                     std::to_string(n0) + ", " + std::to_string(n1) + ") m " + std::to_string(m));
        std::vector<float> out(static_cast<size_t>(m * width), NAN);
        gemm(set, L.packed, g, a.data(), m, n0, n1, out.data(), width);
        for (int64_t r = 0; r < m; ++r) {
          const QuantRow& q = a[static_cast<size_t>(r)];
          const auto* qv = static_cast<const int8_t*>(q.data);
          for (int64_t n = n0; n < std::min(n1, L.rows); ++n) {
            double dot = 0, mag = 0;
            for (int64_t k = 0; k < cols; ++k) {
              const double wk = L.w[static_cast<size_t>(n * cols + k)];
              dot += (qv[k] - q.zp) * wk;
              mag += (std::abs(qv[k]) + std::abs(q.zp)) * (std::fabs(wk) + 30.0);
            }
            const double rs =
                static_cast<double>(q.recip) * static_cast<double>(L.s[static_cast<size_t>(n)]);
            const double got = out[static_cast<size_t>(r * width + (n - n0))];
            ASSERT_NEAR(got, rs * dot, 2e-6 * rs * mag + 1e-30) << "row " << r << " output " << n;
          }
        }
      }
    }
  }
}

TEST_P(KernelInt8, EveryRowGetsTheSameBitsWhateverItsCallSize) {
  const KernelSet& set = *GetParam();
  std::mt19937 rng(23);
  const Int8Layer L = make_layer(set, rng, 48, 256);
  const detail::Geometry& g = L.g;
  std::vector<QRowBuffer> rows;
  std::vector<QuantRow> a;
  for (int64_t r = 0; r < set.tile_m; ++r)
    rows.push_back(quantize_for(set, g, random_row(rng, L.cols, static_cast<int>(r % 6))));
  for (auto& r : rows) a.push_back(r.row);
  const int64_t n = L.rows, total = set.tile_m;
  std::vector<float> alone(static_cast<size_t>(total * n));
  for (int64_t r = 0; r < total; ++r)
    gemm(set, L.packed, g, a.data() + r, 1, 0, n, alone.data() + r * n, n);
  for (int64_t m = 2; m <= total; ++m) {
    std::vector<float> together(static_cast<size_t>(m * n));
    gemm(set, L.packed, g, a.data(), m, 0, n, together.data(), n);
    ASSERT_EQ(0, std::memcmp(together.data(), alone.data(), together.size() * sizeof(float)))
        << set.name << ": a call of " << m << " rows changed some row's bits";
  }
}

}  // namespace
