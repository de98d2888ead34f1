// A value read from an address that need not be aligned for its type (activation bytes and group
// terms addressed from a row's data), without undefined behaviour. Internal linkage: included by
// ISA files, each compiled with its own flags.
#pragma once

#include <cstring>

namespace w4a8moe::detail {
namespace {

template <class T>
inline T load_unaligned(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace
}  // namespace w4a8moe::detail
