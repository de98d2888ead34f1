// The AMX GEMM on layout qu4_p16k8, written once against a tile backend (tile_ops.hpp) and
// compiled per backend: gemm_qa8_qu4p16_amx.cpp (the instructions), gemm_qa8_qu4p16_amxemu.cpp
// (the software model). Internal linkage throughout, so the two copies never mix.
//
// Operands (docs/amx.md): the A tile holds 16 activation rows as the quantizer's int8 (staged to
// one stride), the B tile 16 outputs of the weights as s8 in the VNNI order `tdpbssd` reads (row
// r: columns 4r..4r+3 of each of the 16 outputs). In qu4_p16k8 one 64-byte chunk of a panel is
// exactly two such rows in offset nibbles: `vpermb` with a table of (j & 15) - 8 turns the low
// nibbles into the first and, after `vpmultishiftqb` moves the high nibbles down, the second.
//
// Blocking: K in blocks of 128-256 columns, whose staged rows and unpacked weights stay in L1;
// per block and panel of 16 outputs the weights are unpacked once into an L1 buffer and read by
// every 16-row tile of the call, the next panel's unpacking spread over the current panel's
// groups; with scale groups all (panel, tile) pairs of a block run as one pipeline of groups;
// each tile's running sums live in a per-call buffer between blocks.
//
// Results equal the avx512vnni GEMM's to the bit (the set switches between the two by rows per
// call, and a row's result must not depend on its call): `tdpbssd` gives each scale group's
// SUM q * w exactly, the integer the zmm GEMM gets as SUM (q + 128) * w - 128 * SUM w; it is
// converted, multiplied by the group's scales and added in ascending group order, and the
// epilogue is the same arithmetic. Channelwise: one sum over K, corrected in int32 by zp * SUM w.
//
// Tiles: 0-3 int32 sums (16 x 16; scale groups take them in rotation, a group's sums being
// stored and scaled in f32 three groups after its `tdpbssd` were issued, so that the AVX-512
// scaling overlaps the tile unit's work); 4, 5 activations (16 rows x kStep bytes); 6, 7 weights
// (kStep / 4 rows x 64 bytes). kStep = 32 when the group length is an odd multiple of 32 (g = 32:
// a group is half a tile's depth), else 64.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cassert>
#include <cstdlib>
#include <memory>
#include <utility>

#include "cpu/compiled_isa.hpp"
#include "kernels/common/prefetch.hpp"
#include "kernels/x86_amx/tile_ops.hpp"
#include "kernels/x86_avx512vnni/avx512vnni_kernels.hpp"
#include "kernels/x86_avx512vnni/load_scales_zmm.hpp"

static_assert(w4a8moe::detail::compiled_for_at_least("amxemu"),
              "for files compiled with at least the amxemu cluster's flags (src/cpu/isa.hpp)");

namespace w4a8moe::detail {
namespace {

constexpr int64_t kAmxPanel = 16;

// The f32 sums of a 16 x 16 tile (one zmm per row) are only ever passed to these functions, never
// captured by a lambda, and indexed only by the constants of a pack: so the compiler keeps them
// in registers (an array whose address a closure holds, or that a loop indexes before
// unrolling, lives on the stack, and every group's FMA goes through memory).
template <int... R>
__attribute__((always_inline)) inline void rows_load(__m512 (&f)[16], const float* src, bool zero,
                                                     std::integer_sequence<int, R...>) {
  ((f[R] = zero ? _mm512_setzero_ps() : _mm512_load_ps(src + R * 16)), ...);
}
template <int... R>
__attribute__((always_inline)) inline void rows_store(const __m512 (&f)[16], float* dst,
                                                      std::integer_sequence<int, R...>) {
  (_mm512_store_ps(dst + R * 16, f[R]), ...);
}
// f += (the group sums c, as f32) * the group's scales s, row by row.
template <int... R>
__attribute__((always_inline)) inline void rows_accumulate(__m512 (&f)[16], const int32_t* c,
                                                           __m512 s,
                                                           std::integer_sequence<int, R...>) {
  ((f[R] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + R * 16)), s, f[R])), ...);
}
constexpr auto kRows16 = std::make_integer_sequence<int, 16>();

TileConfig amx_config(int k_step) {
  TileConfig c;
  c.palette = 1;
  for (int t = 0; t < 4; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  for (int t = 4; t < 6; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = static_cast<uint16_t>(k_step);
  }
  for (int t = 6; t < 8; ++t) {
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
  std::unique_ptr<uint8_t, Free> a, w, group, acc;
  size_t a_bytes = 0, w_bytes = 0, group_bytes = 0, acc_bytes = 0;

  static uint8_t* grow(std::unique_ptr<uint8_t, Free>& p, size_t& have, size_t want) {
    if (want > have) {
      p.reset();
      const size_t bytes = (want + 63) / 64 * 64;
      p.reset(static_cast<uint8_t*>(std::aligned_alloc(64, bytes)));
      have = p == nullptr ? 0 : bytes;
    }
    return p.get();
  }
};

AmxBuffers& amx_buffers() {
  thread_local AmxBuffers b;
  return b;
}

// Columns [k0, k0 + len) of the call's int8 rows, `stride` bytes apart (tile loads read rows at
// one stride; the quantizer's rows are apart). The rows past the call's, to a multiple of 16, are
// zeroed once per call by amx_zero_pad_rows.
void amx_stage_block(const GemmArgs& args, int64_t k0, int64_t len, int64_t stride, uint8_t* a) {
  // vector copies: len is a multiple of 32, and a call of memcpy per short row costs more than it
  // moves
  for (int64_t r = 0; r < args.m; ++r) {
    const uint8_t* src = static_cast<const uint8_t*>(args.a[r].data) + k0;
    uint8_t* dst = a + r * stride;
    int64_t k = 0;
    for (; k + 64 <= len; k += 64) _mm512_storeu_si512(dst + k, _mm512_loadu_si512(src + k));
    if (k < len)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k)));
  }
}

// Zeroes the first `len` columns of the rows past the call's, to a multiple of 16 (every block
// stages the same real rows over them and leaves these).
void amx_zero_pad_rows(const GemmArgs& args, int64_t len, int64_t stride, uint8_t* a) {
  const int64_t rows16 = (args.m + 15) / 16 * 16;
  for (int64_t r = args.m; r < rows16; ++r)
    for (int64_t k = 0; k < len; k += 32)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + r * stride + k), _mm256_setzero_si256());
}

// One step at column k: the A tile of parity P (rows at a, a_stride apart) times
// the B tile of parity P (the unpacked VNNI rows at w) into sum tile C.
template <class Tiles, int C, int P>
__attribute__((always_inline)) inline void amx_step(const uint8_t* a, int64_t a_stride,
                                                    const uint8_t* w, int64_t k) {
  Tiles::template load<4 + P>(a + k, a_stride);
  Tiles::template load<6 + P>(w + k * 16, 64);
  Tiles::template dpbssd<C, 4 + P, 6 + P>();
}

// Unpacks columns [k0, k0 + len) of one panel of 16 outputs at a time, in steps of any number of
// 64-byte chunks, so that the tile GEMM can spread the next panel's unpacking over the current
// panel's groups (one call for a whole panel leaves the tile unit idle for its duration). Per
// panel: the weights as s8 VNNI rows (w + (k - k0) * 16 for column k, a multiple of 4), and per
// scale group of the block the scales as f32 (channelwise: none; the epilogue reads the panel's
// scales).
class AmxUnpacker {
 public:
  AmxUnpacker(const Geometry& g, const uint8_t* expert, int64_t first_panel, Prefetcher& pf)
      : g_(g), expert_(expert), first_panel_(first_panel), pf_(pf) {}

  // Starts panel p (of the call) of the block [k0, k0 + len) into w and scale; its scales now.
  void begin(int64_t p, int64_t k0, int64_t len, uint8_t* w, float* scale) {
    const int64_t panel = first_panel_ + p;
    src_ = g_.panel_at(expert_, panel) + k0 / 8 * 64;
    zeros_ = g_.panel_zeros(expert_, panel);
    col_ = k0;
    dst_ = w;
    left_ = len / 8;
    pf_.advance(left_);  // the next task's lines due for this panel block's chunks
    if (g_.group_size < 0) return;
    for (int64_t b = k0 / g_.group_len; b < (k0 + len) / g_.group_len; ++b)
      _mm512_store_ps(
          scale + (b - k0 / g_.group_len) * 16,
          load_scales_zmm(g_.panel_scales(expert_, panel), g_.scale_dtype, b * kAmxPanel));
  }
  // The next n chunks (16 outputs x 8 columns each), or what is left of them.
  __attribute__((always_inline)) void step(int64_t n) {
    alignas(64) static constexpr int8_t kTable[64] = {
        -8, -7, -6, -5, -4, -3, -2, -1, 0,  1,  2,  3,  4,  5,  6,  7,  -8, -7, -6, -5, -4, -3,
        -2, -1, 0,  1,  2,  3,  4,  5,  6,  7,  -8, -7, -6, -5, -4, -3, -2, -1, 0,  1,  2,  3,
        4,  5,  6,  7,  -8, -7, -6, -5, -4, -3, -2, -1, 0,  1,  2,  3,  4,  5,  6,  7};
    // byte j of each qword from bits 8j + 4 on: the high nibble in bits 0-3 (what vpermb reads
    // above them is ignored by the table's period of 16); a shuffle, not a shift, so that it
    // does not take the FP port the f32 scaling needs
    const __m512i high = _mm512_set1_epi64(0x3C342C241C140C04);
    // mxfp4 codes: 2 * e2m1(code), the same four times (kernels/layout.hpp)
    alignas(64) static constexpr auto kMxfp4Table = [] {
      std::array<int8_t, 64> t{};
      for (size_t i = 0; i < t.size(); ++i) t[i] = kMxfp4Doubled[i % 16];
      return t;
    }();
    // int4 with zero points: the nibble w + 8 itself (j & 15), less z + 8 in each byte of its
    // output's dword lane (the group's zeros spread by vpshufb): w - z in [-15, 15]
    alignas(64) static constexpr auto kNibbleTable = [] {
      std::array<int8_t, 64> t{};
      for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int8_t>(i % 16);
      return t;
    }();
    const bool has_zeros = g_.has_zeros();
    const __m512i table =
        _mm512_load_si512(g_.weight_format == WeightFormat::mxfp4 ? kMxfp4Table.data()
                          : has_zeros                             ? kNibbleTable.data()
                                                                  : kTable);
    n = std::min(n, left_);
    // locals: the stores below may alias any byte, members would be reloaded after each
    const uint8_t* src = src_;
    uint8_t* dst = dst_;
    int64_t zeros_group = -1;
    __m512i z = _mm512_setzero_si512();
    for (int64_t c = 0; c < n; ++c) {
      if (has_zeros) {
        const int64_t b = (col_ + c * 8) / g_.group_len;
        if (b != zeros_group) {
          zeros_group = b;
          z = load_zeros_zmm(zeros_, b * kAmxPanel);
        }
      }
      const __m512i raw = _mm512_loadu_si512(src + c * 64);
      __m512i lo = _mm512_permutexvar_epi8(raw, table);
      __m512i hi = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(high, raw), table);
      if (has_zeros) {
        lo = _mm512_sub_epi8(lo, z);
        hi = _mm512_sub_epi8(hi, z);
      }
      _mm512_store_si512(dst + c * 128, lo);
      _mm512_store_si512(dst + c * 128 + 64, hi);
    }
    src_ = src + n * 64;
    dst_ = dst + n * 128;
    col_ += n * 8;
    left_ -= n;
  }
  void finish() { step(left_); }

 private:
  const Geometry& g_;
  const uint8_t* expert_;
  int64_t first_panel_;
  Prefetcher& pf_;
  const uint8_t* src_ = nullptr;
  const uint8_t* zeros_ = nullptr;  // the panel's zero points (int4_zero_point)
  uint8_t* dst_ = nullptr;
  int64_t col_ = 0;  // the column of the next chunk
  int64_t left_ = 0;
};

// One 16-row tile against one unpacked panel block of `len` columns, channelwise: one int32
// sum over K, kept in `acc` between blocks (`first` starts it at zero).
template <class Tiles, int kStep>
void amx_channelwise_block(const uint8_t* a, int64_t a_stride, const uint8_t* w, int64_t len,
                           int32_t (&acc)[256], bool first) {
  auto step = [&]<int P>(int64_t k) __attribute__((always_inline)) {
    amx_step<Tiles, 0, P>(a, a_stride, w, k);
  };
  if (first)
    Tiles::template zero<0>();
  else
    Tiles::template load<0>(acc, 64);
  int64_t k = 0;
  for (; k + 2 * kStep <= len; k += 2 * kStep) {
    step.template operator()<0>(k);
    step.template operator()<1>(k + kStep);
  }
  if (k < len) step.template operator()<0>(k);
  Tiles::template store<0>(acc);
}

// The unpacked block of one panel: weights (VNNI rows) and per scale group the scales.
struct AmxPanelBlock {
  const uint8_t* w;
  const float* scale;
};

// The scaling side of the group pipeline runs this many groups behind the issuing side, so it may
// still read the scales of that many panels back (of one group each) while the next panel's are
// written: the scales of panel p live in slot p % kAmxScaleBuffers.
constexpr int kAmxScaleLag = 4;
constexpr int64_t kAmxScaleBuffers = kAmxScaleLag + 2;

// One K block of `len` columns with scale groups: every (panel, 16-row tile) pair of the call,
// panel by panel, as one pipeline of groups that never drains between pairs. Group i goes to
// sum tile i % 4; its sums are stored kLag groups after its `tdpbssd` were issued (the tile
// unit has finished them by then) and scaled in f32 one group later still (a vector load right
// behind a tile store of the same line waits for the store to complete), so that the tile unit,
// the tile stores and the f32 work overlap, across pairs as within them. The f32 sums of a
// pair live in registers from its first group's scaling to its last, and in `acc` (index t *
// panels + p) between blocks; `first` starts them at zero. begin_unpack(p) starts panel p's block
// in `unpacker` (panel 0 is started by the caller); each issued group of panel p unpacks a share
// of panel p + 1, whose buffers are not those that the groups in flight still read;
// block(p) gives panel p's buffers.
template <class Tiles, int kStep, int kSteps, class BeginUnpack, class Block>
void amx_groups_block(const Geometry& g, const uint8_t* a, int64_t a_stride, int64_t tiles,
                      int64_t panels, int64_t len, int32_t (*acc)[256], bool first,
                      int32_t (*c_ring)[256], AmxUnpacker& unpacker, BeginUnpack&& begin_unpack,
                      Block&& block) {
  const int64_t steps = kSteps > 0 ? kSteps : g.group_len / kStep;
  const int64_t groups = len / g.group_len, total = groups * tiles * panels;
  const int64_t chunks_per_issue = (len / 8 + groups * tiles - 1) / (groups * tiles);
  constexpr int kLag = 3;
  static_assert(kLag + 1 == kAmxScaleLag);

  // the issuing side: pair (t, p), group b of it
  struct Cursor {
    int64_t t = 0, p = 0, b = 0;
  };
  Cursor in, out;
  AmxPanelBlock in_block = block(0), out_block = in_block;
  const uint8_t* in_a = a;
  auto issue = [&]<int C>() __attribute__((always_inline)) {
    if (in.b == 0 && in.t == 0) {
      unpacker.finish();
      amx_memory_barrier();  // the unpacked block is in memory before tiles load it
      if (in.p + 1 < panels) begin_unpack(in.p + 1);
    }
    unpacker.step(chunks_per_issue);
    auto step = [&]<int P>(int64_t k) __attribute__((always_inline)) {
      amx_step<Tiles, C, P>(in_a, a_stride, in_block.w, k);
    };
    Tiles::template zero<C>();
    const int64_t k0 = in.b * (kSteps > 0 ? kSteps * kStep : g.group_len);
    if constexpr (kSteps == 1) {
      step.template operator()<C % 2>(k0);
    } else if constexpr (kSteps == 2) {
      step.template operator()<C % 2>(k0);
      step.template operator()<1 - C % 2>(k0 + kStep);
    } else {
      int64_t s = 0;
      for (; s + 2 <= steps; s += 2) {
        step.template operator()<C % 2>(k0 + s * kStep);
        step.template operator()<1 - C % 2>(k0 + (s + 1) * kStep);
      }
      if (s < steps) step.template operator()<C % 2>(k0 + s * kStep);
    }
    if (++in.b == groups) {
      in.b = 0;
      if (++in.t == tiles) {
        in.t = 0;
        ++in.p;
        if (in.p < panels) in_block = block(in.p);
      }
      in_a = a + in.t * 16 * a_stride;
    }
  };
  // the scaling side: group b of pair (t, p), from c_ring[C]
  auto accumulate = [&](__m512(&f)[16], const int32_t* c) __attribute__((always_inline)) {
    if (out.b == 0)
      rows_load(f, reinterpret_cast<const float*>(acc[out.t * panels + out.p]), first, kRows16);
    rows_accumulate(f, c, _mm512_load_ps(out_block.scale + out.b * 16), kRows16);
    if (++out.b == groups) {
      rows_store(f, reinterpret_cast<float*>(acc[out.t * panels + out.p]), kRows16);
      out.b = 0;
      if (++out.t == tiles) {
        out.t = 0;
        ++out.p;
        if (out.p < panels) out_block = block(out.p);
      }
    }
  };
  // slot i: issue group i, store group i - kLag, scale group i - kLag - 1
  auto slot = [&]<int T, bool kAll>(__m512(&f)[16], int64_t i) __attribute__((always_inline)) {
    constexpr int kStored = (T + 4 - kLag) % 4, kScaled = (T + 3 - kLag) % 4;
    if (kAll || i < total) issue.template operator()<T>();
    if (kAll || (i >= kLag && i - kLag < total)) Tiles::template store<kStored>(c_ring[kStored]);
    if (kAll || (i > kLag && i - kLag - 1 < total)) accumulate(f, c_ring[kScaled]);
  };
  __m512 f[16];
  int64_t i = 0;
  auto four = [&]<bool kAll>() __attribute__((always_inline)) {
    slot.template operator()<0, kAll>(f, i);
    slot.template operator()<1, kAll>(f, i + 1);
    slot.template operator()<2, kAll>(f, i + 2);
    slot.template operator()<3, kAll>(f, i + 3);
    i += 4;
  };
  four.template operator()<false>();  // i = 0..3 (kLag + 1 <= 4)
  // four advances i
  while (i + 4 <= total) four.template operator()<true>();
  while (i <= total + kLag) four.template operator()<false>();
}

// The epilogue of one 16-row tile at output n0, from its sums, as the avx512vnni GEMM's:
// scale groups: c = recip * (sum - zp * correction) + bias;
// channelwise:  c = (recip * s) * (sum - zp * SUM w) + bias.
template <bool kChannelwise>
void amx_epilogue(const GemmArgs& args, int64_t n0, int64_t r0, int64_t rows,
                  const int32_t (&acc)[256], const float* channel_scale) {
  const Geometry& g = *args.geometry;
  const uint8_t* corr = g.row_correction(args.expert, n0);
  const __m512 bias =
      g.has_bias ? _mm512_loadu_ps(reinterpret_cast<const float*>(g.row_bias(args.expert, n0)))
                 : _mm512_setzero_ps();
  float* out = args.c + r0 * args.c_stride + (n0 - args.n_begin);
  if constexpr (kChannelwise) {
    const __m512i wsum = _mm512_loadu_si512(corr);
    const __m512 s = _mm512_load_ps(channel_scale);
    for (int64_t r = 0; r < rows; ++r) {
      const QuantRow& q = args.a[r0 + r];
      const __m512i exact = _mm512_sub_epi32(_mm512_load_si512(acc + r * 16),
                                             _mm512_mullo_epi32(wsum, _mm512_set1_epi32(q.zp)));
      const __m512 rs = _mm512_mul_ps(_mm512_set1_ps(q.recip), s);
      _mm512_storeu_ps(out + r * args.c_stride,
                       _mm512_fmadd_ps(rs, _mm512_cvtepi32_ps(exact), bias));
    }
  } else {
    const __m512 zsum = _mm512_loadu_ps(reinterpret_cast<const float*>(corr));
    const float* accf = reinterpret_cast<const float*>(acc);
    for (int64_t r = 0; r < rows; ++r) {
      const QuantRow& q = args.a[r0 + r];
      const __m512 v = _mm512_fnmadd_ps(_mm512_set1_ps(static_cast<float>(q.zp)), zsum,
                                        _mm512_load_ps(accf + r * 16));
      _mm512_storeu_ps(out + r * args.c_stride, _mm512_fmadd_ps(_mm512_set1_ps(q.recip), v, bias));
    }
  }
}

// Blocks of K: A holds the block's columns of every row, each panel's unpacked block is written
// once and read by every 16-row tile, and all of them stay in L1. Measured (docs/amx.md): 256
// columns up to 32 rows, 128 from 64 rows (kABlockBytes / rows, within those bounds); a tile load
// that misses L1 takes twice as long, and longer blocks fill it.
constexpr int64_t kABlockBytes = 8 * 1024;
constexpr int64_t kMinBlock = 128, kMaxBlock = 256;

// False when this thread's buffers cannot be had (the caller then runs the zmm GEMM).
template <class Tiles, int kStep, int kSteps, bool kChannelwise>
bool amx_gemm_shaped(const GemmArgs& args) {
  const Geometry& g = *args.geometry;
  AmxBuffers& buf = amx_buffers();
  const int64_t cols = g.cols_padded;
  const int64_t rows16 = (args.m + 15) / 16 * 16, tiles = rows16 / 16;
  const int64_t panels = (args.n_end - args.n_begin + kAmxPanel - 1) / kAmxPanel;
  const int64_t want = std::clamp<int64_t>(kABlockBytes / rows16 / 64 * 64, kMinBlock, kMaxBlock);
  const int64_t block =
      kChannelwise ? std::min(cols, want) : g.group_len * std::max<int64_t>(1, want / g.group_len);
  const int64_t a_stride = block + 64;  // a large power of two would put all rows in two sets
  const int64_t block_groups = kChannelwise ? 1 : block / g.group_len;
  uint8_t* a = AmxBuffers::grow(buf.a, buf.a_bytes, static_cast<size_t>(rows16 * a_stride));
  // two panels' blocks: the next panel is unpacked while the tiles of this one run, so that tile
  // loads do not read lines that vector stores have just written (tile loads take no store
  // forwarding)
  const size_t w_bytes = static_cast<size_t>(block * 16),
               group_bytes = static_cast<size_t>(block_groups * 64);
  uint8_t* w_base = AmxBuffers::grow(buf.w, buf.w_bytes, 2 * w_bytes);
  // kAmxScaleBuffers panels' scales: the scaling side lags the tiles by kAmxScaleLag groups,
  // which may span that many panels of one group each, and the next panel's are being written
  uint8_t* group_base =
      AmxBuffers::grow(buf.group, buf.group_bytes, kAmxScaleBuffers * group_bytes);
  auto* acc = reinterpret_cast<int32_t(*)[256]>(
      AmxBuffers::grow(buf.acc, buf.acc_bytes, static_cast<size_t>(tiles * panels) * 1024));
  if (a == nullptr || w_base == nullptr || group_base == nullptr || acc == nullptr) return false;
  amx_configure<Tiles>(kStep);
  // The group sums' way from the tiles to the vector code. In this frame, not in the per-thread
  // buffers: code built position-independent reaches thread-local storage through a call, and
  // the compiler re-derives such an address inside the loop, with a vzeroupper and the spill of
  // every live zmm register around each derivation.
  alignas(64) int32_t c_ring[4][256];
  amx_zero_pad_rows(args, block, a_stride, a);

  Prefetcher pf(args);
  const int64_t first_panel = args.n_begin / kAmxPanel;
  AmxUnpacker unpacker(g, args.expert, first_panel, pf);
  auto half = [&](int64_t p) { return static_cast<size_t>(p & 1); };
  auto scale_slot = [&](int64_t p) { return static_cast<size_t>(p % kAmxScaleBuffers); };
  auto scale_of = [&](int64_t p) {
    return reinterpret_cast<float*>(group_base + scale_slot(p) * group_bytes);
  };
  for (int64_t k0 = 0; k0 < cols; k0 += block) {
    const int64_t len = std::min(block, cols - k0);
    amx_stage_block(args, k0, len, a_stride, a);
    auto begin_unpack = [&](int64_t p) {
      unpacker.begin(p, k0, len, w_base + half(p) * w_bytes, scale_of(p));
    };
    begin_unpack(0);
    if constexpr (kChannelwise) {
      for (int64_t p = 0; p < panels; ++p) {
        unpacker.finish();
        if (p + 1 < panels) {
          begin_unpack(p + 1);
          unpacker.finish();
        }
        amx_memory_barrier();  // the staged rows and the unpacked block are in memory
        for (int64_t t = 0; t < tiles; ++t)
          amx_channelwise_block<Tiles, kStep>(a + t * 16 * a_stride, a_stride,
                                              w_base + half(p) * w_bytes, len, acc[t * panels + p],
                                              k0 == 0);
      }
    } else {
      amx_groups_block<Tiles, kStep, kSteps>(
          g, a, a_stride, tiles, panels, len, acc, k0 == 0, c_ring, unpacker,
          begin_unpack, [&](int64_t p) __attribute__((always_inline)) {
            return AmxPanelBlock{w_base + half(p) * w_bytes, scale_of(p)};
          });
    }
  }
  // channelwise: the panel's scales, once per panel
  alignas(64) float channel_scale[16];
  for (int64_t p = 0; p < panels; ++p) {
    if constexpr (kChannelwise)
      _mm512_store_ps(channel_scale, load_scales_zmm(g.panel_scales(args.expert, first_panel + p),
                                                     g.scale_dtype, 0));
    for (int64_t t = 0; t < tiles; ++t)
      amx_epilogue<kChannelwise>(args, args.n_begin + p * kAmxPanel, t * 16,
                                 std::min<int64_t>(16, args.m - t * 16), acc[t * panels + p],
                                 channel_scale);
  }
  return true;
}

// The zmm GEMM over the call's rows, in calls of nearly equal size of at most its 16-row tile.
void amx_zmm_gemm(const GemmArgs& args) {
  const RowTiles calls(args.m, avx512vnni::kTileM);
  GemmArgs part = args;
  for (int64_t i = 0; i < calls.count; ++i) {
    part.m = calls.size(i);
    part.a = args.a + calls.start(i);
    part.c = args.c + calls.start(i) * args.c_stride;
    if (i > 0) part.prefetch[0] = part.prefetch[1] = PrefetchRange{};
    avx512vnni::gemm_qa8_qu4p16k8(part);
  }
}

template <class Tiles>
bool amx_gemm_dispatch(const GemmArgs& args) {
  assert(args.m >= 1 && args.n_begin % kAmxPanel == 0);
  const Geometry& g = *args.geometry;
  if (g.group_size < 0) {
    if (g.cols_padded % 64 == 0) return amx_gemm_shaped<Tiles, 64, 0, true>(args);
    return amx_gemm_shaped<Tiles, 32, 0, true>(args);
  }
  if (g.group_len == 32) return amx_gemm_shaped<Tiles, 32, 1, false>(args);
  if (g.group_len == 64) return amx_gemm_shaped<Tiles, 64, 1, false>(args);
  if (g.group_len == 128) return amx_gemm_shaped<Tiles, 64, 2, false>(args);
  if (g.group_len % 64 == 0) return amx_gemm_shaped<Tiles, 64, 0, false>(args);
  return amx_gemm_shaped<Tiles, 32, 0, false>(args);
}

// The tile GEMM; the zmm GEMM (same bits) if this thread's buffers cannot be allocated.
template <class Tiles>
void amx_gemm(const GemmArgs& args) {
  if (!amx_gemm_dispatch<Tiles>(args)) amx_zmm_gemm(args);
}

}  // namespace
}  // namespace w4a8moe::detail
