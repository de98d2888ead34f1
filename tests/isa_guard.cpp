// When the suite runs under an ISA cap (W4A8MOE_ISA=<set>, as CTest does once per kernel set),
// skip everything with a message if this CPU lacks that set, instead of silently testing a
// lower one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "w4a8moe/w4a8moe.hpp"

namespace {

class IsaGuard : public testing::Environment {
 public:
  void SetUp() override {
    const char* isa = std::getenv("W4A8MOE_ISA");
    if (isa == nullptr || *isa == '\0') return;
    const auto sets = w4a8moe::available_kernel_sets();
    if (std::find(sets.begin(), sets.end(), std::string(isa)) == sets.end())
      GTEST_SKIP() << "kernel set " << isa << " is not usable on this CPU ("
                   << w4a8moe::cpu_features().summary() << "); skipping its run";
    if (w4a8moe::active_kernel_set() != isa)
      FAIL() << "W4A8MOE_ISA=" << isa << " but the active set is " << w4a8moe::active_kernel_set();
  }
};

const auto* const kGuard = testing::AddGlobalTestEnvironment(new IsaGuard);

}  // namespace
