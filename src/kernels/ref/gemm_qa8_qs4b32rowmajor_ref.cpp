// Portable GEMM micro-kernel on layout qs4_b32_rowmajor: up to kTileM int8 activation rows
// share each unpacked 32-weight block.
#include <cstring>

#include "common/numeric.hpp"
#include "kernels/ref/ref_kernels.hpp"

namespace w4a8moe::detail::ref {

namespace {

// 16 bytes -> 32 int4 values: byte i holds element i (low nibble), element i + 16 (high nibble).
inline void unpack_block(const uint8_t* src, int8_t* w) noexcept {
  for (int i = 0; i < 16; ++i) {
    w[i] = static_cast<int8_t>(static_cast<int8_t>(src[i] << 4) >> 4);
    w[i + 16] = static_cast<int8_t>(static_cast<int8_t>(src[i]) >> 4);
  }
}

// (int4 with zero points: the same values, less the group's zero point.)
// The same for mxfp4 codes: 2 * e2m1(code) (the scales hold 2^(e - 128)).
inline void unpack_block_mxfp4(const uint8_t* src, int8_t* w) noexcept {
  for (int i = 0; i < 16; ++i) {
    w[i] = kMxfp4Doubled[src[i] & 0x0f];
    w[i + 16] = kMxfp4Doubled[src[i] >> 4];
  }
}

inline int32_t dot32(const int8_t* q, const int8_t* w) noexcept {
  int32_t s = 0;
  for (int i = 0; i < 32; ++i) s += int32_t{q[i]} * int32_t{w[i]};
  return s;
}

}  // namespace

void gemm_qa8_qs4b32rowmajor(const GemmArgs& args) {
  const Geometry& g = *args.geometry;
  const int64_t m = args.m;
  const int64_t blocks_per_group = g.group_len / kBlock;
  const int8_t* q[kTileM] = {};
  for (int64_t r = 0; r < m; ++r) q[r] = static_cast<const int8_t*>(args.a[r].data);

  const bool mxfp4 = g.weight_format == WeightFormat::mxfp4;
  alignas(64) int8_t w[kBlock];
  for (int64_t n = args.n_begin; n < args.n_end; ++n) {
    // one row per panel record (P = 1)
    const uint8_t* wrow = g.panel_at(args.expert, n);
    const uint8_t* scales = g.panel_scales(args.expert, n);
    const uint8_t* zeros = g.panel_zeros(args.expert, n);  // int4_zero_point: z + 8 per group
    float acc[kTileM] = {};
    int32_t dot[kTileM] = {};
    for (int64_t b = 0; b < g.groups; ++b) {
      int32_t gdot[kTileM] = {};
      const int z = g.has_zeros() ? zeros[b] - 8 : 0;
      for (int64_t blk = 0; blk < blocks_per_group; ++blk) {
        const int64_t block = b * blocks_per_group + blk;
        if (mxfp4)
          unpack_block_mxfp4(wrow + block * (kBlock / 2), w);
        else
          unpack_block(wrow + block * (kBlock / 2), w);
        if (z != 0)  // w - z in [-15, 15]
          for (int i = 0; i < kBlock; ++i) w[i] = static_cast<int8_t>(w[i] - z);
        for (int64_t r = 0; r < m; ++r) gdot[r] += dot32(q[r] + block * kBlock, w);
      }
      if (g.channelwise()) {
        for (int64_t r = 0; r < m; ++r) dot[r] = gdot[r];
      } else {
        const float s = load_float(scales, g.scale_dtype, b);
        for (int64_t r = 0; r < m; ++r) acc[r] += s * static_cast<float>(gdot[r]);
      }
    }
    float b_n = 0.0f;
    if (g.has_bias) std::memcpy(&b_n, g.row_bias(args.expert, n), 4);
    float* c = args.c + (n - args.n_begin);
    if (g.channelwise()) {
      int32_t wsum;
      std::memcpy(&wsum, g.row_correction(args.expert, n), 4);
      const float s = load_float(scales, g.scale_dtype, 0);
      for (int64_t r = 0; r < m; ++r) {
        const int64_t exact = int64_t{dot[r]} - int64_t{args.a[r].zp} * wsum;
        c[r * args.c_stride] = args.a[r].recip * s * static_cast<float>(exact) + b_n;
      }
    } else {
      float zsum;
      std::memcpy(&zsum, g.row_correction(args.expert, n), 4);
      for (int64_t r = 0; r < m; ++r) {
        const float zterm = static_cast<float>(args.a[r].zp) * zsum;
        c[r * args.c_stride] = args.a[r].recip * (acc[r] - zterm) + b_n;
      }
    }
  }
}

}  // namespace w4a8moe::detail::ref
