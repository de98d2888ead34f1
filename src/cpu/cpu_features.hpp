// Internals of CPU feature detection, for its tests.
#pragma once

#include <string>

namespace w4a8moe::detail {

// CpuFeatures::amx_status from the three conditions, in the order they are checked: the CPU's
// AMX-TILE and AMX-INT8, the OS enabling the tile state, the process's tile data permission.
std::string amx_status(bool cpu_has_amx, bool os_enables_tiles, bool permission_granted);

}  // namespace w4a8moe::detail
