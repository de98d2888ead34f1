// Kernel-level MXFP4 tests: the kernels' e2m1 tables against the OCP values, and each kernel set's
// GEMM on MXFP4 weights (one suite per set of the table, named by it; a set this CPU lacks skips)
// against a double-precision evaluation of the formula around tile edges and against exact
// integer sums at the extremes; on x86, the avx512vnni set's two MXFP4 paths against each other.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernel_set_test.hpp"
#include "kernel_test_util.hpp"
#include "pack/packed_format.hpp"
#include "registry.hpp"
#if defined(__x86_64__)
#include <bit>

#include "kernels/x86_avx512vnni/avx512vnni_kernels.hpp"
#endif

namespace {

using namespace w4a8moe;
using namespace w4a8moe::kernel_tests;
using detail::KernelSet;
using detail::QuantRow;

TEST(Mxfp4, TheKernelTablesAreTheOcpValues) {
  // e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, doubled
  const int want[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(e2m1_doubled(c), want[c]);
    EXPECT_EQ(detail::kMxfp4Doubled[c], want[c]);
    EXPECT_EQ(int{detail::kMxfp4Unsigned[c]}, want[c] + detail::kMxfp4Offset);
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
    SCOPED_TRACE(describe(*set, c));
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
#endif

}  // namespace
