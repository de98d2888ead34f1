// The tile operations the AMX GEMM uses, in two backends with one interface:
//   AmxTiles   the instructions (ldtilecfg, tileloadd, tilestored, tilezero, tdpbssd),
//   ModelTiles a software model of them, exact to the instruction's semantics, so the GEMM
//              compiled against it runs (and is tested) on CPUs without AMX.
// Tile numbers are template arguments, as the instructions encode them.
//
// Memory: tile loads tell the compiler nothing about what they read (a strided 2-D region has
// no operand form), so the caller puts a compiler barrier (amx_memory_barrier) between writing
// a buffer and loading tiles from it. A tile store names the 1 KiB it writes, so the vector code
// that reads the stored tile is ordered after it; nothing else is clobbered, and the caller's
// f32 sums stay in registers.
#pragma once

#include <cstdint>
#include <cstring>

namespace w4a8moe::detail {

// Palette 1 tile configuration (the 64-byte operand of ldtilecfg).
struct alignas(64) TileConfig {
  uint8_t palette = 0;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of tile i
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

inline void amx_memory_barrier() { __asm__ volatile("" ::: "memory"); }

// -mamx-tile -mamx-int8 in effect (GCC spells the macros __AMX_TILE__, clang __AMXTILE__).
#if (defined(__AMX_TILE__) || defined(__AMXTILE__)) && \
    (defined(__AMX_INT8__) || defined(__AMXINT8__))
#define W4A8MOE_AMX_FLAGS 1
#endif

#if defined(W4A8MOE_AMX_FLAGS)
struct AmxTiles {
  static inline void configure(const TileConfig& c) { __asm__ volatile("ldtilecfg %0" ::"m"(c)); }
  static inline void release() { __asm__ volatile("tilerelease" ::); }
  template <int T>
  static inline void zero() {
    __asm__ volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int T>
  static inline void load(const void* base, int64_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T));
  }
  // Stores 16 rows of 64 bytes, 64 bytes apart (the only store shape the GEMM uses).
  template <int T>
  static inline void store(int32_t (&dst)[256]) {
    __asm__ volatile("tilestored %%tmm%c2, (%1,%3,1)"
                     : "=m"(dst)
                     : "r"(&dst[0]), "i"(T), "r"(int64_t{64}));
  }
  // C += A (s8, rows x 4K) . B (s8, K rows x 4N, VNNI), int32 sums, wrapping
  template <int C, int A, int B>
  static inline void dpbssd() {
    __asm__ volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
};
#endif

// The model: eight tiles of 16 rows x 64 bytes per thread, as the hardware's state. A shape
// the hardware would refuse (#UD) traps.
struct ModelTiles {
  struct State {
    TileConfig config;
    bool configured = false;
    alignas(64) uint8_t tile[8][16][64];
  };
  static State& state() {
    thread_local State s;
    return s;
  }
  static void check(bool ok) {
    if (!ok) __builtin_trap();
  }
  static void configure(const TileConfig& c) {
    check(c.palette == 1);
    for (int t = 0; t < 8; ++t) check(c.rows[t] <= 16 && c.colsb[t] <= 64);
    State& s = state();
    s.config = c;
    s.configured = true;
    std::memset(s.tile, 0, sizeof s.tile);
  }
  static void release() { state().configured = false; }
  template <int T>
  static void zero() {
    State& s = state();
    check(s.configured);
    std::memset(s.tile[T], 0, sizeof s.tile[T]);
  }
  // Rows and bytes past the configured shape read as zero, as on the hardware.
  template <int T>
  static void load(const void* base, int64_t stride) {
    State& s = state();
    check(s.configured && s.config.rows[T] > 0);
    std::memset(s.tile[T], 0, sizeof s.tile[T]);
    for (int r = 0; r < s.config.rows[T]; ++r)
      std::memcpy(s.tile[T][r], static_cast<const uint8_t*>(base) + r * stride, s.config.colsb[T]);
  }
  template <int T>
  static void store(int32_t (&dst)[256]) {
    State& s = state();
    check(s.configured && s.config.rows[T] == 16 && s.config.colsb[T] == 64);
    std::memcpy(dst, s.tile[T], sizeof dst);
  }
  // C[m][n] += SUM_k SUM_j s8(A[m][4k + j]) * s8(B[k][4n + j]), modulo 2^32.
  template <int C, int A, int B>
  static void dpbssd() {
    State& s = state();
    const TileConfig& c = s.config;
    check(s.configured && c.rows[C] == c.rows[A] && c.colsb[C] == c.colsb[B] &&
          c.colsb[A] == 4 * c.rows[B] && c.colsb[C] % 4 == 0);
    for (int m = 0; m < c.rows[A]; ++m)
      for (int n = 0; n < c.colsb[C] / 4; ++n) {
        uint32_t acc;
        std::memcpy(&acc, &s.tile[C][m][4 * n], 4);
        for (int k = 0; k < c.rows[B]; ++k)
          for (int j = 0; j < 4; ++j)
            acc += static_cast<uint32_t>(int32_t{static_cast<int8_t>(s.tile[A][m][4 * k + j])} *
                                         int32_t{static_cast<int8_t>(s.tile[B][k][4 * n + j])});
        std::memcpy(&s.tile[C][m][4 * n], &acc, 4);
      }
  }
};

}  // namespace w4a8moe::detail
