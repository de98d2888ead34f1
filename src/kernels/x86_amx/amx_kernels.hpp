// Kernel sets "amx" and "amxemu": the avx512vnni set's quantizer, activation and layout
// (qu4_p16k8), with a second GEMM for calls of many rows built on AMX tiles (`tdpbssd`).
//
// "amx" runs the tile instructions; "amxemu" is the same kernel source compiled against a
// software model of the tile operations (ModelTiles, tile_ops.hpp), so that the kernel's layout,
// unpacking, indexing and scaling are tested on every AVX-512 machine, AMX or not. The model is
// chosen only when the ISA cap names it (W4A8MOE_ISA=amxemu).
#pragma once

#include "kernels/kernel.hpp"

namespace w4a8moe::detail {

// Rows per call of the AMX GEMM, at most: every row of an expert's task up to this many shares
// one unpacking of each weight panel.
inline constexpr int64_t kAmxTileM = 128;
// Calls of up to this many rows always go to the zmm `vpdpbusd` GEMM (a 16-row tile would be
// mostly empty).
inline constexpr int64_t kAmxSmallMaxM = 4;

// The fewest rows a 16-row tile of the tile GEMM must hold to be worth it against the zmm GEMM
// on those rows, by scale group length (cols_padded when channelwise) and whether it is the
// call's only tile (which pays the unpacking of the weights alone), measured on a Xeon with AMX
// (docs/amx.md): a tile costs about the same whatever its rows, the zmm GEMM a row at a time, and
// the f32 scaling of every group's sums makes short groups' tiles dear.
int64_t amx_min_tile_rows(int64_t group_len, bool channelwise, bool only_tile);

namespace amx {
// The set's GEMM for calls of more than kAmxSmallMaxM rows: the tile GEMM on every full 16-row
// tile and on a last partial tile of at least amx_min_tile_rows(...) rows, the zmm GEMM (in calls
// of at most 16 rows) on the rows left. Same bits either way.
void gemm_qa8_qu4p16k8(const GemmArgs& args);
// The tile GEMM alone, for any number of rows up to kAmxTileM (for the tests and the benchmark:
// no set calls it directly).
void gemm_tiles(const GemmArgs& args);
void thread_begin();
void thread_end();
}  // namespace amx

namespace amxemu {
// The tile GEMM alone on the software model (the set uses it from kAmxSmallMaxM + 1 rows, so
// that the suites exercise it at every group size).
void gemm_qa8_qu4p16k8(const GemmArgs& args);
void thread_begin();
void thread_end();
}  // namespace amxemu

}  // namespace w4a8moe::detail
