// The helpers of the kernel suites (kernel_test_util.hpp): quantized rows, GEMM calls, random
// rows and weights, the GEMM formula in double and the checks against it, MXFP4 and zero-point
// weights packed for a kernel set.
#include "kernel_test_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

namespace w4a8moe::kernel_tests {

using detail::KernelSet;
using detail::QuantRow;

QRowBuffer quantize(const KernelSet& set, const std::vector<float>& a, int64_t cols_padded,
                    int64_t group_len, int32_t group_term_offset) {
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

std::string describe(const KernelSet& set, const GemmCase& c) {
  return std::string(set.name) + " rows " + std::to_string(c.rows) + " cols " +
         std::to_string(c.cols) + " group " + std::to_string(c.group) + (c.w13 ? " w13" : " w2");
}

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
                         bool w13, const std::vector<float>* bias) {
  PackOptions po;
  po.group_size = 32;
  po.weight_format = WeightFormat::mxfp4;
  po.kernel_set = set.name;
  const TensorView wv = TensorView::of(m.codes.data(), DType::u8, {1, rows, cols / 2});
  const TensorView sv = TensorView::of(m.exponents.data(), DType::u8, {1, rows, cols / 32});
  const TensorView bv = bias ? TensorView::of(bias->data(), DType::f32, {1, rows}) : TensorView{};
  return w13 ? pack_w13(wv, sv, bv, po) : pack_w2(wv, sv, bv, po);
}

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
                              const std::vector<float>* bias) {
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

}  // namespace w4a8moe::kernel_tests
