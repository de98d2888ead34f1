#include "kernels/layout.hpp"

#include <string>

#include "common/format.hpp"

namespace w4a8moe::detail {

namespace {

constexpr LayoutInfo kLayouts[] = {
    {LayoutId::qs4_b32_rowmajor, "qs4_b32_rowmajor", 1, false, false},
    {LayoutId::qu4_p16k8, "qu4_p16k8", 16, true, false},
    {LayoutId::qu4_p8k8, "qu4_p8k8", 8, true, false},
    {LayoutId::qu4_p8k16, "qu4_p8k16", 8, true, false},   // Arm i8mm
    {LayoutId::qu8_p16k4, "qu8_p16k4", 16, false, true},  // int8 bytes (AVX-512 VNNI)
};

}  // namespace

const LayoutInfo& layout_info(uint32_t id, std::string_view argument) {
  for (const LayoutInfo& l : kLayouts)
    if (static_cast<uint32_t>(l.id) == id) return l;
  std::string known;
  for (const LayoutInfo& l : kLayouts)
    known += cat(known.empty() ? "" : ", ", static_cast<uint32_t>(l.id), " (", l.name, ")");
  throw Error(cat(argument, ": unknown packed layout id ", id, "; this build knows ", known));
}

const char* layout_name(LayoutId id) noexcept {
  for (const LayoutInfo& l : kLayouts)
    if (l.id == id) return l.name;
  return "unknown";
}

}  // namespace w4a8moe::detail
