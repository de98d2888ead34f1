// The table of kernel sets: each pairs a quantizer, GEMM micro-kernels and the packed layout
// they read, so that packing and compute can never disagree. Chosen once, by preference, from
// the CPU's features and the ISA cap (W4A8MOE_ISA or set_isa_cap()).
#pragma once

#include <span>
#include <string_view>

#include "cpu/isa.hpp"
#include "kernels/kernel.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

// A GEMM serving calls of up to max_m activation rows (max_m 0: no GEMM).
struct GemmRange {
  int64_t max_m = 0;
  GemmFn fn = nullptr;
};

// Runs on each thread of the forward pass, before its first and after its last kernel call of
// the pass (a set whose kernels keep per-thread hardware state: AMX tile configuration).
using ThreadHook = void (*)();

struct KernelSet {
  const char* name;  // also the ISA cap level: "scalar", "avx2", "avx512vnni", ...
  LayoutId layout;
  // The layout of a linear layer's int8 weights: `layout` (two int4 planes, Geometry::int8_cols)
  // or a layout of bytes its GEMM reads as well (LayoutInfo::int8_bytes).
  LayoutId int8_layout;
  int64_t tile_m;    // activation rows per GEMM call at most (<= kMaxTileM)
  bool group_terms;  // the quantizer writes QuantRow::group_terms after the row
  // int4_zero_point: the GEMM multiplies the offset nibbles w + 8 as int4's and starts each
  // scale group's sums of a lane at (z + 8) times the row's group term, which the quantizer
  // then writes as -SUM q (group_term_offset). Otherwise the GEMM multiplies w - z + 15 from
  // terms -15 * SUM q (kernels/layout.hpp, kZeroPointOffset).
  bool zero_points_at_group_start;
  // The CPU features its kernels are compiled for: those of the ISA cluster named after the set
  // (cpu/isa.hpp; 0 for the portable set), which include those of any lower cluster whose
  // kernels it reuses.
  uint32_t isa;
  QuantizeFn quantize;
  // By rows per call, ascending max_m; the last covers tile_m. The GEMMs of one set give every
  // row the same bits (the kernel contract of kernel.hpp holds across them).
  GemmRange gemms[2];
  ActivateFn activate;
  ThreadHook thread_begin = nullptr, thread_end = nullptr;
  // Chosen only when the ISA cap names it (a software model of an ISA, for tests).
  bool model_only = false;

  bool usable(const CpuFeatures& f) const { return cpu_has(f, isa); }
  // The layout this set packs weights of `format` in.
  LayoutId layout_for(WeightFormat format) const {
    return format == WeightFormat::int8 ? int8_layout : layout;
  }
  bool reads(LayoutId l) const { return l == layout || l == int8_layout; }
  // The offset of the weights this set's GEMM multiplies for packed weights g: the quantizer's
  // group terms for rows meeting them are -offset * SUM q (QuantizeArgs::group_term_offset).
  int32_t group_term_offset(const Geometry& g) const {
    return g.has_zeros() && zero_points_at_group_start ? 1 : g.group_term_offset();
  }
  GemmFn gemm_for(int64_t m) const {
    return gemms[1].max_m > 0 && m > gemms[0].max_m ? gemms[1].fn : gemms[0].fn;
  }
  void gemm(const GemmArgs& args) const { gemm_for(args.m)(args); }
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
