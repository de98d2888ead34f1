#include "registry.hpp"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include "common/format.hpp"
#include "kernels/ref/ref_kernels.hpp"
#if defined(W4A8MOE_X86)
#include "kernels/x86_amx/amx_kernels.hpp"
#include "kernels/x86_avx2/avx2_kernels.hpp"
#include "kernels/x86_avx512vnni/avx512vnni_kernels.hpp"
#include "kernels/x86_avxvnni/avxvnni_kernels.hpp"
#endif
#if defined(__aarch64__)  // Arm kernel sets
#include "kernels/arm_neon/neon_kernels.hpp"
#include "kernels/arm_neondot/neondot_kernels.hpp"
#include "kernels/arm_neoni8mm/neoni8mm_kernels.hpp"
#endif

namespace w4a8moe::detail {

namespace {

// Best first. ISA-specific sets go above the portable one.
constexpr KernelSet kTable[] = {
#if defined(W4A8MOE_X86)
    {.name = "amx",
     .layout = LayoutId::qu4_p16k8,
     .int8_layout = LayoutId::qu4_p16k8,
     .tile_m = kAmxTileM,
     .group_terms = true,
     .zero_points_at_group_start = false,
     .isa = cluster_features("amx"),
     .quantize = avx512vnni::quantize_qa8,
     .gemms = {{kAmxSmallMaxM, avx512vnni::gemm_qa8_qu4p16k8}, {kAmxTileM, amx::gemm_qa8_qu4p16k8}},
     .activate = avx512vnni::activate,
     .thread_begin = amx::thread_begin,
     .thread_end = amx::thread_end},
    {.name = "avx512vnni",
     .layout = LayoutId::qu4_p16k8,
     .int8_layout = LayoutId::qu8_p16k4,
     .tile_m = avx512vnni::kTileM,
     .group_terms = true,
     .zero_points_at_group_start = false,
     .isa = cluster_features("avx512vnni"),
     .quantize = avx512vnni::quantize_qa8,
     .gemms = {{avx512vnni::kTileM, avx512vnni::gemm_qa8_qu4p16k8}},
     .activate = avx512vnni::activate},
    {.name = "avxvnni",
     .layout = LayoutId::qu4_p8k8,
     .int8_layout = LayoutId::qu4_p8k8,
     .tile_m = avxvnni::kTileM,
     .group_terms = true,
     .zero_points_at_group_start = true,
     .isa = cluster_features("avxvnni"),
     .quantize = avx2::quantize_qa8,
     .gemms = {{avxvnni::kTileM, avxvnni::gemm_qa8_qu4p8k8}},
     .activate = avx2::activate},
    {.name = "avx2",
     .layout = LayoutId::qu4_p8k8,
     .int8_layout = LayoutId::qu4_p8k8,
     .tile_m = avx2::kTileM,
     .group_terms = true,
     .zero_points_at_group_start = true,
     .isa = cluster_features("avx2"),
     .quantize = avx2::quantize_qa8,
     .gemms = {{avx2::kTileM, avx2::gemm_qa8_qu4p8k8}},
     .activate = avx2::activate},
#endif
#if defined(__aarch64__)  // Arm kernel sets; one quantizer and one activation for the three
    {.name = "neoni8mm",
     .layout = LayoutId::qu4_p8k16,
     .int8_layout = LayoutId::qu4_p8k16,
     .tile_m = neoni8mm::kTileM,
     .group_terms = true,
     .zero_points_at_group_start = false,
     .isa = cluster_features("neoni8mm"),
     .quantize = neon::quantize_qa8,
     .gemms = {{neoni8mm::kTileM, neoni8mm::gemm_qa8_qu4p8k16}},
     .activate = neon::activate},
    {.name = "neondot",
     .layout = LayoutId::qu4_p8k8,
     .int8_layout = LayoutId::qu4_p8k8,
     .tile_m = neondot::kTileM,
     .group_terms = true,
     .zero_points_at_group_start = false,
     .isa = cluster_features("neondot"),
     .quantize = neon::quantize_qa8,
     .gemms = {{neondot::kTileM, neondot::gemm_qa8_qu4p8k8}},
     .activate = neon::activate},
    {.name = "neon",
     .layout = LayoutId::qu4_p8k8,
     .int8_layout = LayoutId::qu4_p8k8,
     .tile_m = neon::kTileM,
     .group_terms = true,
     .zero_points_at_group_start = false,
     .isa = cluster_features("neon"),
     .quantize = neon::quantize_qa8,
     .gemms = {{neon::kTileM, neon::gemm_qa8_qu4p8k8}},
     .activate = neon::activate},
#endif
#if defined(W4A8MOE_X86) && defined(W4A8MOE_MODEL_SETS)
    // The software models, built with the tests (W4A8MOE_MODEL_SETS of CMakeLists.txt).
    // the AMX set on the software model of the tiles: only when the cap names it
    {.name = "amxemu",
     .layout = LayoutId::qu4_p16k8,
     .int8_layout = LayoutId::qu4_p16k8,
     .tile_m = kAmxTileM,
     .group_terms = true,
     .zero_points_at_group_start = false,
     .isa = cluster_features("amxemu"),
     .quantize = avx512vnni::quantize_qa8,
     .gemms = {{kAmxSmallMaxM, avx512vnni::gemm_qa8_qu4p16k8},
               {kAmxTileM, amxemu::gemm_qa8_qu4p16k8}},
     .activate = avx512vnni::activate,
     .thread_begin = amxemu::thread_begin,
     .thread_end = amxemu::thread_end,
     .model_only = true},
    // the avxvnni GEMM on the model of `vpdpbusd`: only when the cap names it
    {.name = "avxvnniemu",
     .layout = LayoutId::qu4_p8k8,
     .int8_layout = LayoutId::qu4_p8k8,
     .tile_m = avxvnni::kTileM,
     .group_terms = true,
     .zero_points_at_group_start = true,
     .isa = cluster_features("avxvnniemu"),
     .quantize = avx2::quantize_qa8,
     .gemms = {{avxvnni::kTileM, avxvnniemu::gemm_qa8_qu4p8k8}},
     .activate = avx2::activate,
     .model_only = true},
#endif
    {.name = "scalar",
     .layout = LayoutId::qs4_b32_rowmajor,
     .int8_layout = LayoutId::qs4_b32_rowmajor,
     .tile_m = ref::kTileM,
     .group_terms = false,
     .zero_points_at_group_start = false,
     .isa = 0,
     .quantize = ref::quantize_qa8,
     .gemms = {{ref::kTileM, ref::gemm_qa8_qs4b32rowmajor}},
     .activate = ref::activate},
};

consteval bool tiles_fit() {
  for (const KernelSet& k : kTable) {
    if (k.tile_m < 1 || k.tile_m > kMaxTileM || k.gemms[0].max_m < 1) return false;
    const GemmRange& last = k.gemms[1].max_m > 0 ? k.gemms[1] : k.gemms[0];
    if (last.max_m != k.tile_m) return false;
    if (k.gemms[1].max_m > 0 && k.gemms[0].max_m >= k.tile_m) return false;
  }
  return true;
}
static_assert(tiles_fit(), "a kernel set's GEMM ranges must end at its tile_m <= kMaxTileM");

// A set packs int8 weights in its own layout (as two int4 planes) or in a layout of bytes its
// GEMMs read: only avx512vnni's zmm tile reads qu8_p16k4.
consteval bool int8_layouts_read() {
  for (const KernelSet& k : kTable) {
    if (k.int8_layout == k.layout) continue;
#if defined(W4A8MOE_X86)
    if (k.int8_layout == LayoutId::qu8_p16k4 && k.gemms[0].fn == avx512vnni::gemm_qa8_qu4p16k8 &&
        (k.gemms[1].max_m == 0 || k.gemms[1].fn == avx512vnni::gemm_qa8_qu4p16k8))
      continue;
#endif
    return false;
  }
  return true;
}
static_assert(int8_layouts_read(), "a kernel set's int8 layout must be one its GEMMs read");

// Every set but the portable one requires the features of the ISA cluster named after it.
consteval bool sets_require_their_clusters() {
  for (const KernelSet& k : kTable)
    if (std::string_view(k.name) != "scalar" && k.isa != cluster_features(k.name)) return false;
  return true;
}
static_assert(sets_require_their_clusters(), "a kernel set must require its cluster's features");

constexpr size_t kNone = ~size_t{0};

std::string known_names() {
  std::string s;
  for (const KernelSet& k : kTable) (s += s.empty() ? "" : ", ") += k.name;
  return s;
}

size_t index_of(std::string_view name) {
  for (size_t i = 0; i < std::size(kTable); ++i)
    if (name == kTable[i].name) return i;
  return kNone;
}

// Index of the best set the cap allows (0 = no cap).
std::atomic<size_t> g_cap{kNone};
std::once_flag g_env_once;

size_t cap_index() {
  std::call_once(g_env_once, [] {
    const char* env = std::getenv("W4A8MOE_ISA");
    if (env == nullptr || *env == '\0') {
      size_t expected = kNone;
      g_cap.compare_exchange_strong(expected, 0);
      return;
    }
    const size_t i = index_of(env);
    if (i == kNone)
      throw Error(cat("W4A8MOE_ISA: expected one of ", known_names(), ", got '", env, "'"));
    size_t expected = kNone;
    g_cap.compare_exchange_strong(expected, i);
  });
  return g_cap.load();
}

}  // namespace

std::span<const KernelSet> kernel_table() { return kTable; }

// Set i may be chosen under the cap: usable, and not a model unless the cap names it.
static bool eligible(size_t i, size_t cap, const CpuFeatures& f) {
  return kTable[i].usable(f) && (!kTable[i].model_only || i == cap);
}

const KernelSet& active_set() {
  const CpuFeatures& f = cpu_features();
  const size_t cap = cap_index();
  for (size_t i = cap; i < std::size(kTable); ++i)
    if (eligible(i, cap, f)) return kTable[i];
  return kTable[std::size(kTable) - 1];  // the portable set is always usable
}

const KernelSet& set_for_layout(LayoutId layout, std::string_view argument) {
  const CpuFeatures& f = cpu_features();
  const size_t cap = cap_index();
  for (size_t i = cap; i < std::size(kTable); ++i)
    if (kTable[i].reads(layout) && eligible(i, cap, f)) return kTable[i];
  throw Error(cat(argument, ": the packed layout ", layout_name(layout),
                  " has no kernel set usable on this CPU (", f.summary(),
                  ") within the ISA cap (active set: ", active_set().name,
                  "); repack the weights for this machine"));
}

const KernelSet& set_by_name(std::string_view name, std::string_view argument) {
  const size_t i = index_of(name);
  if (i == kNone)
    throw Error(
        cat(argument, ": expected a kernel set among ", known_names(), ", got '", name, "'"));
  if (!kTable[i].usable(cpu_features()))
    throw Error(cat(argument, ": kernel set ", name, " is not usable on this CPU (",
                    cpu_features().summary(), ")"));
  return kTable[i];
}

}  // namespace w4a8moe::detail

namespace w4a8moe {

std::vector<std::string> available_kernel_sets() {
  std::vector<std::string> out;
  for (const detail::KernelSet& k : detail::kernel_table())
    if (k.usable(cpu_features())) out.emplace_back(k.name);
  return out;
}

std::string active_kernel_set() { return detail::active_set().name; }

void set_isa_cap(std::string_view name) {
  detail::cap_index();  // read the environment first so it cannot override this call later
  if (name.empty()) {
    detail::g_cap.store(0);
    return;
  }
  const size_t i = detail::index_of(name);
  if (i == detail::kNone)
    throw Error(
        detail::cat("isa cap: expected one of ", detail::known_names(), ", got '", name, "'"));
  detail::g_cap.store(i);
}

}  // namespace w4a8moe
