// The AMX GEMM on layout qu4_p16k8, written once against a tile backend (tile_ops.hpp) and
// compiled per backend: gemm_qa8_qu4p16_amx.cpp (the instructions), gemm_qa8_qu4p16_amxemu.cpp
// (the software model). Internal linkage throughout, so the two copies never mix.
//
// Operands (docs/kernels.md, "amx"): the A tile holds 16 activation rows as u8 (q + 128, staged
// from the int8 rows with one XOR), the B tile 16 output rows of the weights as s8 in the VNNI
// order `tdpbusd` reads (row r: columns 4r..4r+3 of each of the 16 outputs). In qu4_p16k8 one
// 64-byte chunk of a panel is exactly two such rows in offset nibbles: `vpermb` with a table of
// (j & 15) - 8 turns the low nibbles into the first and, after a shift, the high nibbles into the
// second. Weights are unpacked once per panel and call into an L1/L2 buffer and reused by every
// 16-row tile of the call.
//
// Results equal the avx512vnni GEMM's to the bit (the set switches between the two by rows per
// call, and a row's result must not depend on its call): each scale group's int32 sum is
// SUM (q + 128) * w started from -128 * SUM w (a per-group, per-output vector made while
// unpacking, loaded into the accumulator tile with stride 0), which is SUM q * w exactly; it is
// converted and multiplied by the group's scales in the same order, and the epilogue is the same
// arithmetic. Channelwise: one sum over K, corrected in int32 by (128 + zp) * SUM w.
//
// Tiles: 0, 1 int32 sums (16 x 16, alternating by group so that one group's store and f32
// scaling overlap the next group's `tdpbusd`); 2, 3 activations (16 rows x kStep bytes); 4, 5
// weights (kStep / 4 rows x 64 bytes). kStep = 32 when the group length is an odd multiple of 32
// (g = 32: a group is half a tile's depth), else 64.
#pragma once

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__) || \
    !defined(__AVX512VBMI__)
#error "the AMX GEMM needs -mavx512f -mavx512bw -mavx512vnni -mavx512vbmi"
#endif

#include <immintrin.h>

#include <cassert>
#include <cstdlib>
#include <memory>

#include "kernels/common/prefetch.hpp"
#include "kernels/x86_amx/tile_ops.hpp"

namespace w4a8moe::detail {
namespace {

constexpr int64_t kAmxPanel = 16;

TileConfig amx_config(int k_step) {
  TileConfig c;
  c.palette = 1;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  for (int t = 2; t < 4; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = static_cast<uint16_t>(k_step);
  }
  for (int t = 4; t < 6; ++t) {
    c.rows[t] = static_cast<uint8_t>(k_step / 4);
    c.colsb[t] = 64;
  }
  return c;
}

// The configuration this thread has loaded for this backend (0: none).
thread_local int t_amx_k_step = 0;

template <class Tiles>
void amx_configure(int k_step) {
  if (t_amx_k_step != k_step) {
    const TileConfig c = amx_config(k_step);
    Tiles::configure(c);
    t_amx_k_step = k_step;
  }
}

template <class Tiles>
void amx_release() {
  if (t_amx_k_step != 0) {
    Tiles::release();
    t_amx_k_step = 0;
  }
}

// Per-thread buffers of the GEMM, grown on demand and kept for the thread's life.
struct AmxBuffers {
  struct Free {
    void operator()(uint8_t* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> a, w, group;
  size_t a_bytes = 0, w_bytes = 0, group_bytes = 0;
  alignas(64) int32_t c[2][16 * 16];

  static uint8_t* grow(std::unique_ptr<uint8_t, Free>& p, size_t& have, size_t want) {
    if (want > have) {
      p.reset();
      const size_t bytes = (want + 63) / 64 * 64;
      p.reset(static_cast<uint8_t*>(std::aligned_alloc(64, bytes)));
      if (p == nullptr) std::abort();  // a few MiB at most (64 rows x 64 Ki columns)
      have = bytes;
    }
    return p.get();
  }
};

AmxBuffers& amx_buffers() {
  thread_local AmxBuffers b;
  return b;
}

inline __m512 amx_load_scales(const uint8_t* base, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::bf16:
      return _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + index * 2))),
          16));
    case DType::f16:
      return _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + index * 2)));
    default:
      return _mm512_loadu_ps(reinterpret_cast<const float*>(base) + index);
  }
}

// The rows of the call as u8 (q + 128), a_stride bytes apart, padded with zero rows to a
// multiple of 16.
void amx_stage_rows(const GemmArgs& args, int64_t cols, int64_t a_stride, uint8_t* a) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t rows16 = (args.m + 15) / 16 * 16;
  for (int64_t r = 0; r < args.m; ++r) {
    const auto* src = static_cast<const uint8_t*>(args.a[r].data);
    uint8_t* dst = a + r * a_stride;
    int64_t k = 0;
    for (; k + 64 <= cols; k += 64)
      _mm512_storeu_si512(dst + k, _mm512_xor_si512(_mm512_loadu_si512(src + k), flip));
    if (k < cols) {  // cols is a multiple of 32
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k),
                          _mm256_xor_si256(v, _mm512_castsi512_si256(flip)));
    }
  }
  for (int64_t r = args.m; r < rows16; ++r) std::memset(a + r * a_stride, 0, static_cast<size_t>(cols));
}

// One panel of 16 outputs: the weights as s8 VNNI rows (w + k * 16 for column k, a multiple of
// 4), and per scale group the accumulator start -128 * SUM w (int32 x 16) and the scales as f32.
void amx_unpack_panel(const Geometry& g, const uint8_t* panel_weights, const uint8_t* scales,
                      int64_t panel, uint8_t* w, int32_t* start, float* scale, Prefetcher& pf) {
  alignas(64) static constexpr int8_t kTable[64] = {
      -8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3,
      -2, -1, 0,  1,  2,  3,  4,  5,  6, 7, -8, -7, -6, -5, -4, -3, -2, -1, 0, 1,
      2,  3,  4,  5,  6,  7,  -8, -7, -6, -5, -4, -3, -2, -1, 0,  1,  2,  3, 4, 5, 6, 7};
  const __m512i table = _mm512_load_si512(kTable);
  const __m512i u128 = _mm512_set1_epi8(static_cast<char>(0x80));
  const bool channelwise = g.group_size < 0;
  const int64_t chunks_per_group = g.group_len / 8;
  for (int64_t b = 0; b < g.groups; ++b) {
    __m512i sum = _mm512_setzero_si512();
    for (int64_t c = b * chunks_per_group; c < (b + 1) * chunks_per_group; ++c) {
      const __m512i raw = _mm512_loadu_si512(panel_weights + c * 64);
      const __m512i lo = _mm512_permutexvar_epi8(raw, table);
      const __m512i hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(raw, 4), table);
      _mm512_store_si512(w + c * 128, lo);
      _mm512_store_si512(w + c * 128 + 64, hi);
      if (!channelwise) sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum, u128, lo), u128, hi);
    }
    pf.step(chunks_per_group);
    if (!channelwise) {
      _mm512_store_si512(start + b * 16, _mm512_sub_epi32(_mm512_setzero_si512(), sum));
      _mm512_store_ps(scale + b * 16,
                      amx_load_scales(scales, g.scale_dtype, (panel * g.groups + b) * kAmxPanel));
    }
  }
  if (channelwise)
    _mm512_store_ps(scale, amx_load_scales(scales, g.scale_dtype, panel * kAmxPanel));
}

// One 16-row tile (rows [r0, r0 + rows) of the call) against one unpacked panel at output n0.
template <class Tiles, int kStep, bool kChannelwise>
void amx_tile(const GemmArgs& args, int64_t n0, int64_t r0, int64_t rows, const uint8_t* a,
              int64_t a_stride, const uint8_t* w, const int32_t* start, const float* scale,
              AmxBuffers& buf) {
  const Geometry& g = *args.geometry;
  const int64_t steps = g.group_len / kStep;
  // one step of depth kStep at column k into sum tile C, with operand tiles of parity P
  auto step = [&]<int C, int P>(int64_t k) __attribute__((always_inline)) {
    Tiles::template load<2 + P>(a + k, a_stride);
    Tiles::template load<4 + P>(w + k * 16, 64);
    Tiles::template dpbusd<C, 2 + P, 4 + P>();
  };
  auto group = [&]<int C>(int64_t b) __attribute__((always_inline)) {
    if constexpr (kChannelwise)
      Tiles::template zero<C>();
    else
      Tiles::template load<C>(start + b * 16, 0);
    const int64_t k0 = b * g.group_len;
    int64_t s = 0;
    for (; s + 2 <= steps; s += 2) {
      step.template operator()<C, C>(k0 + s * kStep);
      step.template operator()<C, 1 - C>(k0 + (s + 1) * kStep);
    }
    if (s < steps) step.template operator()<C, C>(k0 + s * kStep);
  };

  const uint8_t* corr = args.expert + g.correction_offset + n0 * 4;
  const __m512 bias =
      g.has_bias
          ? _mm512_loadu_ps(reinterpret_cast<const float*>(args.expert + g.bias_offset) + n0)
          : _mm512_setzero_ps();
  float* out = args.c + r0 * args.c_stride + (n0 - args.n_begin);

  if constexpr (kChannelwise) {
    group.template operator()<0>(0);
    Tiles::template store<0>(buf.c[0], 64);
    const __m512i wsum = _mm512_loadu_si512(corr);
    const __m512 s = _mm512_load_ps(scale);
    for (int64_t r = 0; r < rows; ++r) {
      const QuantRow& q = args.a[r0 + r];
      const __m512i exact = _mm512_sub_epi32(_mm512_load_si512(buf.c[0] + r * 16),
                                             _mm512_mullo_epi32(wsum, _mm512_set1_epi32(q.zp + 128)));
      const __m512 rs = _mm512_mul_ps(_mm512_set1_ps(q.recip), s);
      _mm512_storeu_ps(out + r * args.c_stride, _mm512_fmadd_ps(rs, _mm512_cvtepi32_ps(exact), bias));
    }
  } else {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    auto scale_group = [&]<int C>(int64_t b) __attribute__((always_inline)) {
      Tiles::template store<C>(buf.c[C], 64);
      const __m512 s = _mm512_load_ps(scale + b * 16);
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(buf.c[C] + r * 16)), s, acc[r]);
    };
    const int64_t groups = g.groups;
    group.template operator()<0>(0);
    int64_t b = 1;
    for (; b + 1 < groups; b += 2) {
      group.template operator()<1>(b);
      scale_group.template operator()<0>(b - 1);
      group.template operator()<0>(b + 1);
      scale_group.template operator()<1>(b);
    }
    if (b < groups) {
      group.template operator()<1>(b);
      scale_group.template operator()<0>(b - 1);
      scale_group.template operator()<1>(b);
    } else {
      scale_group.template operator()<0>(b - 1);
    }
    // c = recip * (acc - zp * correction) + bias, as the avx512vnni epilogue
    const __m512 zsum = _mm512_loadu_ps(reinterpret_cast<const float*>(corr));
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      if (r < rows) {
        const QuantRow& q = args.a[r0 + r];
        const __m512 v = _mm512_fnmadd_ps(_mm512_set1_ps(static_cast<float>(q.zp)), zsum, acc[r]);
        _mm512_storeu_ps(out + r * args.c_stride, _mm512_fmadd_ps(_mm512_set1_ps(q.recip), v, bias));
      }
    }
  }
}

template <class Tiles, int kStep, bool kChannelwise>
void amx_gemm_shaped(const GemmArgs& args) {
  const Geometry& g = *args.geometry;
  AmxBuffers& buf = amx_buffers();
  const int64_t cols = g.cols_padded;
  // rows one line longer than the columns: tile loads at a stride of a large power of two would
  // map all 16 rows onto two L1 sets
  const int64_t a_stride = cols + 64;
  const int64_t rows16 = (args.m + 15) / 16 * 16;
  uint8_t* a = AmxBuffers::grow(buf.a, buf.a_bytes, static_cast<size_t>(rows16 * a_stride));
  uint8_t* w = AmxBuffers::grow(buf.w, buf.w_bytes, static_cast<size_t>(cols * 16));
  uint8_t* per_group =
      AmxBuffers::grow(buf.group, buf.group_bytes, static_cast<size_t>(g.groups * 128));
  auto* start = reinterpret_cast<int32_t*>(per_group);
  auto* scale = reinterpret_cast<float*>(per_group + g.groups * 64);
  amx_stage_rows(args, cols, a_stride, a);
  amx_configure<Tiles>(kStep);

  Prefetcher pf(args);
  const int64_t panel_bytes = kAmxPanel * g.row_weight_bytes;
  const uint8_t* scales = args.expert + g.scales_offset;
  for (int64_t n0 = args.n_begin; n0 < args.n_end; n0 += kAmxPanel) {
    const int64_t panel = n0 / kAmxPanel;
    amx_unpack_panel(g, args.expert + g.weights_offset + panel * panel_bytes, scales, panel, w,
                     start, scale, pf);
    for (int64_t r0 = 0; r0 < args.m; r0 += 16)
      amx_tile<Tiles, kStep, kChannelwise>(args, n0, r0, std::min<int64_t>(16, args.m - r0),
                                           a + r0 * a_stride, a_stride, w, start, scale, buf);
  }
}

template <class Tiles>
void amx_gemm(const GemmArgs& args) {
  assert(args.m >= 1 && args.n_begin % kAmxPanel == 0);
  const Geometry& g = *args.geometry;
  const bool channelwise = g.group_size < 0;
  if (g.group_len % 64 == 0) {
    if (channelwise)
      amx_gemm_shaped<Tiles, 64, true>(args);
    else
      amx_gemm_shaped<Tiles, 64, false>(args);
  } else {
    if (channelwise)
      amx_gemm_shaped<Tiles, 32, true>(args);
    else
      amx_gemm_shaped<Tiles, 32, false>(args);
  }
}

}  // namespace
}  // namespace w4a8moe::detail
