// The table of kernel sets: each pairs a quantizer, a GEMM micro-kernel and the packed layout
// they read, so that packing and compute can never disagree. Chosen once, by preference, from
// the CPU's features and the ISA cap (W4A8MOE_ISA or set_isa_cap()).
#pragma once

#include <span>
#include <string_view>

#include "kernels/kernel.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

struct KernelSet {
  const char* name;  // also the ISA cap level: "scalar", later "avx2", "avx512vnni", ...
  LayoutId layout;
  int64_t tile_m;    // activation rows per GEMM call (<= kMaxTileM)
  bool group_terms;  // the quantizer writes QuantRow::group_terms after the row
  bool (*usable)(const CpuFeatures&);
  QuantizeFn quantize;
  GemmFn gemm;
  ActivateFn activate;
};

// All sets compiled into this build, best first.
std::span<const KernelSet> kernel_table();
// The best usable set at or below the cap.
const KernelSet& active_set();
// The set for a packed layout, among the usable ones (throws Error naming `argument` if none).
const KernelSet& set_for_layout(LayoutId layout, std::string_view argument);
// A set by name (throws Error if unknown or unusable on this CPU).
const KernelSet& set_by_name(std::string_view name, std::string_view argument);

}  // namespace w4a8moe::detail
