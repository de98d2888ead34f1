// The interface between the forward driver and the micro-kernels: one argument struct per call.
//
// A kernel set (see registry.hpp) is a quantizer, a GEMM micro-kernel and the packed layout they
// read. Kernels assume their arguments are valid (debug-checked); the API validates.
//
// Contract shared by every GEMM kernel: the result of a row does not depend on which other rows
// share its call, nor on the row range [n_begin, n_end) it is computed in. This makes the forward
// pass bit-identical for any thread count and any tiling of the work.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/layout.hpp"

namespace w4a8moe::detail {

// One quantized activation row: `data` holds cols_padded bytes in the kernel set's activation
// format (int8 q for the portable set), and the value of element k is (q[k] - zp) * recip.
struct QuantRow {
  const void* data = nullptr;
  float recip = 1.0f;
  int32_t zp = 0;
  // Sets reading offset weights (int4: w + 8; mxfp4: 2 * e2m1 + 12): -offset * SUM_{k in b} q[k]
  // per scale group b (QuantizeArgs::group_term_offset, the offset of the weights the row
  // meets), so that a group's dot product of the offset weights and q, started from this value,
  // is SUM w * q. Else null.
  // Every quantizer writes them right after the row's cols_padded bytes (group_terms ==
  // data + cols_padded): kernels may address them from `data` (debug-checked).
  const int32_t* group_terms = nullptr;
};

struct QuantizeArgs {
  const float* src = nullptr;  // `cols` f32 values
  int64_t cols = 0;
  int64_t cols_padded = 0;        // multiple of kBlock; the tail is written as the zero point
  int64_t group_len = 0;          // scale group length (cols_padded when channelwise)
  int32_t group_term_offset = 8;  // of the weights the row is for (group_term_offset(Geometry))
  void* dst = nullptr;            // cols_padded bytes, then (if the set wants them) the group terms
  QuantRow* row = nullptr;        // receives recip, zp, data (= dst) and group_terms
};

// n rows in ceil(n / tile) tiles whose sizes differ by at most one: 20 rows with tile 16 make
// 10 + 10, not 16 + 4, so that no tile runs a narrow kernel that shares each unpacked weight
// register among few rows. Tile i starts at row start(i).
struct RowTiles {
  int64_t count, base, extra;
  RowTiles(int64_t n, int64_t tile)
      : count((n + tile - 1) / tile), base(count ? n / count : 0), extra(count ? n % count : 0) {}
  int64_t size(int64_t i) const { return base + (i < extra ? 1 : 0); }
  int64_t start(int64_t i) const { return i * base + (i < extra ? i : extra); }
};

inline constexpr int64_t kMaxTileM = 128;  // upper bound of every kernel set's tile_m

// A byte range to bring towards the L2 cache while a kernel computes (the weights of the next
// task of the calling thread, so that its first tile does not wait for DRAM).
struct PrefetchRange {
  const uint8_t* begin = nullptr;
  int64_t lines = 0;  // 64-byte lines
};

struct GemmArgs {
  int64_t m = 0;                    // activation rows, 1 <= m <= the kernel set's tile_m
  const QuantRow* a = nullptr;      // m rows
  const uint8_t* expert = nullptr;  // start of the expert block in the packed buffer
  const Geometry* geometry = nullptr;
  // Padded output rows [n_begin, n_end) of this expert; n_begin is a multiple of the panel.
  int64_t n_begin = 0, n_end = 0;
  // c[i * c_stride + (n - n_begin)] for row i of a. The kernel may write up to
  // round_up(n_end - n_begin, panel) columns; those past n_end - n_begin are unspecified.
  float* c = nullptr;
  int64_t c_stride = 0;
  uint32_t flags = 0;  // zero (reserved)
  // Optional: up to two ranges prefetched while the call computes, spread evenly over the
  // call's work (kernels/common/prefetch.hpp); kernels may ignore them (the portable set does).
  PrefetchRange prefetch[2];
};

// c = recip * (SUM_b s[n,b] * SUM_{k in b} q[k] * w[n,k] - zp * correction[n]) + bias[n]
using QuantizeFn = void (*)(const QuantizeArgs&);
using GemmFn = void (*)(const GemmArgs&);
// m[i] = act(gate[i], up[i]) for i < n (docs/operator.md, "Activations"), f32.
using ActivateFn = void (*)(const MoeParams& params, const float* gate, const float* up, float* m,
                            int64_t n);

}  // namespace w4a8moe::detail
