// The zero points of int4_zero_point weights (kernels/layout.hpp: one byte per output row and
// group) where the zmm and AMX kernels need them: in every byte of their row's dword lane, as
// layout qu4_p16k8 places a row's 4 weight bytes per chunk. Plain data, shared by their files.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace w4a8moe::detail {

// Byte i of a register belongs to dword lane i / 4: `vpshufb` by this table spreads a panel's
// zero points, broadcast to each 128-bit lane, over the 4 bytes of their lanes.
alignas(64) inline constexpr std::array<uint8_t, 64> kSpreadZeros = [] {
  std::array<uint8_t, 64> t{};
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<uint8_t>(i / 4);
  return t;
}();

}  // namespace w4a8moe::detail
