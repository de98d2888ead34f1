// Kernel sets "amx" and "amxemu": the avx512vnni set's quantizer, activation and layout
// (qu4_p16k8), with a second GEMM for calls of many rows built on AMX tiles (`tdpbusd`).
//
// "amx" runs the tile instructions; "amxemu" is the same kernel source compiled against a
// software model of the tile operations (tile_ops_model.hpp), so that the kernel's layout,
// unpacking, indexing and scaling are tested on every AVX-512 machine, AMX or not. The model is
// chosen only when the ISA cap names it (W4A8MOE_ISA=amxemu).
#pragma once

#include "kernels/kernel.hpp"

namespace w4a8moe::detail {

// Rows per call of the AMX GEMM, at most: every row of an expert's task up to this many shares
// one unpacking of each weight panel.
inline constexpr int64_t kAmxTileM = 64;
// Calls of up to this many rows go to the zmm `vpdpbusd` GEMM (faster there: a 16-row tile
// would be mostly empty; see docs/kernels.md for the measured crossover).
inline constexpr int64_t kAmxSmallMaxM = 4;

namespace amx {
void gemm_qa8_qu4p16(const GemmArgs& args);
void thread_begin();
void thread_end();
}  // namespace amx

namespace amxemu {
void gemm_qa8_qu4p16(const GemmArgs& args);
void thread_begin();
void thread_end();
}  // namespace amxemu

}  // namespace w4a8moe::detail
