// Building one-sentence error messages from pieces.
#pragma once

#include <sstream>
#include <string>

namespace w4a8moe::detail {

template <class... Parts>
std::string cat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

}  // namespace w4a8moe::detail
