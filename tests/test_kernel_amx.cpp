// The AMX tile GEMM on both backends (amx and amxemu) against the avx512vnni GEMM, bit for bit:
// int4 symmetric, with zero points and MXFP4, at every call size, group size and scale dtype. x86
// only; a backend whose set this CPU lacks skips.
#include <gtest/gtest.h>

#if defined(__x86_64__)
#include <bit>
#include <cmath>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "common/numeric.hpp"
#include "kernel_test_util.hpp"
#include "kernels/x86_amx/amx_kernels.hpp"
#include "pack/packed_format.hpp"
#include "registry.hpp"

namespace {

using namespace w4a8moe;
using namespace w4a8moe::kernel_tests;
using detail::KernelSet;
using detail::QuantRow;

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
// is the tile GEMM on the software model. A backend without `tiles` takes that GEMM of its set
// from the table: the model sets are built with the tests only (W4A8MOE_MODEL_SETS).
struct TileBackend {
  const char* name;
  const char* set;
  detail::GemmFn tiles = nullptr;
};

class AmxTileGemm : public ::testing::TestWithParam<TileBackend> {};

TEST_P(AmxTileGemm, GivesTheZmmGemmBits) {
  const KernelSet* set = nullptr;
  for (const KernelSet& k : detail::kernel_table())
    if (std::string_view(k.name) == GetParam().set) set = &k;
  if (set == nullptr && GetParam().tiles == nullptr)
    GTEST_SKIP() << "kernel set " << GetParam().set << " is not in this build";
  ASSERT_NE(set, nullptr);
  if (!set->usable(cpu_features()))
    GTEST_SKIP() << "kernel set " << set->name << " is not usable on this CPU ("
                 << cpu_features().summary() << "; AMX " << cpu_features().amx_status << ")";
  check_tile_gemm(GetParam().tiles ? GetParam().tiles : set->gemm_for(detail::kAmxTileM),
                  GetParam().name);
}

std::string backend_name(const ::testing::TestParamInfo<TileBackend>& backend) {
  return backend.param.name;
}

INSTANTIATE_TEST_SUITE_P(, AmxTileGemm,
                         ::testing::Values(TileBackend{"amx", "amx", detail::amx::gemm_tiles},
                                           TileBackend{"amx_split", "amx",
                                                       detail::amx::gemm_qa8_qu4p16k8},
                                           TileBackend{"amxemu", "amxemu", nullptr}),
                         backend_name);

}  // namespace
#endif
