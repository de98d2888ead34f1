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

#include "pack/packed_format.hpp"

namespace w4a8moe::detail {

// One quantized activation row: `data` holds cols_padded bytes in the kernel set's activation
// format (int8 q for the portable set), and the value of element k is (q[k] - zp) * recip.
struct QuantRow {
  const void* data = nullptr;
  float recip = 1.0f;
  int32_t zp = 0;
};

struct QuantizeArgs {
  const float* src = nullptr;  // `cols` f32 values
  int64_t cols = 0;
  int64_t cols_padded = 0;     // multiple of kBlock; the tail is written as the zero point
  void* dst = nullptr;         // cols_padded bytes
  QuantRow* row = nullptr;     // receives recip and zp (and dst as data)
};

inline constexpr int64_t kMaxTileM = 8;  // upper bound of every kernel set's tile_m

struct GemmArgs {
  int64_t m = 0;                    // activation rows, 1 <= m <= the kernel set's tile_m
  const QuantRow* a = nullptr;      // m rows
  const uint8_t* expert = nullptr;  // start of the expert block in the packed buffer
  const Geometry* geometry = nullptr;
  int64_t n_begin = 0, n_end = 0;   // output rows [n_begin, n_end) of this expert
  float* c = nullptr;               // c[i * c_stride + (n - n_begin)] for row i of a
  int64_t c_stride = 0;
  uint32_t flags = 0;               // zero (reserved)
};

// c = recip * (SUM_b s[n,b] * SUM_{k in b} q[k] * w[n,k] - zp * correction[n]) + bias[n]
using QuantizeFn = void (*)(const QuantizeArgs&);
using GemmFn = void (*)(const GemmArgs&);

}  // namespace w4a8moe::detail
