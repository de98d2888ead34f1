// The loops every panel GEMM shares around its register tile: the output rows of a call in
// tiles of panels, and one instantiation of the GEMM per number of activation rows
// (internal linkage: included by ISA files, each compiled with its own flags).
#pragma once

#include <array>
#include <utility>

#include "kernels/kernel.hpp"

namespace w4a8moe::detail {
namespace {

// Output rows [n_begin, n_end) of a call in tiles of NP panels of kPanel rows, the rest one
// panel at a time: tile.template operator()<P>(n0) computes P panels from padded row n0.
template <int64_t kPanel, int NP, class Tile>
inline void for_each_panel_tile(const GemmArgs& args, Tile&& tile) {
  int64_t n = args.n_begin;
  for (; n + NP * kPanel <= args.n_end; n += NP * kPanel) tile.template operator()<NP>(n);
  for (; n < args.n_end; n += kPanel) tile.template operator()<1>(n);
}

// The GEMM for calls of m = 1..kTileM rows at index m - 1: pick.template operator()<M>() gives
// the instantiation for M rows (each row count its own register tile).
template <int kTileM, class Pick>
consteval std::array<GemmFn, kTileM> gemm_by_rows(Pick pick) {
  return [&]<int... Ms>(std::integer_sequence<int, Ms...>) {
    return std::array<GemmFn, kTileM>{pick.template operator()<Ms + 1>()...};
  }
  (std::make_integer_sequence<int, kTileM>());
}

// The GEMM of a set whose register tile is tile.template operator()<M, NP, kFormat>(args, n0) (M
// rows x NP panels of kPanel rows from padded row n0; kFormat: the weights' WeightFormat), for
// calls of m = 1..kTileM rows: one instantiation per row count and weight format, its output rows
// in tiles of kPanelsOneRow panels for one row, kPanels for more.
template <int kTileM, int64_t kPanel, int kPanelsOneRow, int kPanels, class Tile>
inline void gemm_panel_tiles(const GemmArgs& args, Tile) {
  constexpr auto by_rows = []<WeightFormat kFormat>() {
    return gemm_by_rows<kTileM>([]<int M>() -> GemmFn {
      return [](const GemmArgs& a) {
        for_each_panel_tile<kPanel, M == 1 ? kPanelsOneRow : kPanels>(
            a, [&]<int NP>(int64_t n0) { Tile{}.template operator()<M, NP, kFormat>(a, n0); });
      };
    });
  };
  static constexpr auto kInt4 = by_rows.template operator()<WeightFormat::int4_symmetric>();
  static constexpr auto kZeros = by_rows.template operator()<WeightFormat::int4_zero_point>();
  static constexpr auto kMxfp4 = by_rows.template operator()<WeightFormat::mxfp4>();
  const WeightFormat format = args.geometry->weight_format;
  (format == WeightFormat::mxfp4             ? kMxfp4
   : format == WeightFormat::int4_zero_point ? kZeros
                                             : kInt4)[static_cast<size_t>(args.m - 1)](args);
}

}  // namespace
}  // namespace w4a8moe::detail
