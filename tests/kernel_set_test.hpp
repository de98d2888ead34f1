// The fixture of the kernel-level suites: one instantiation per kernel set of the registry's
// table, named by the set (`KernelGemm.IntegerSumsAreExactAtTheExtremes/avx2`); a set this CPU
// lacks skips with a message.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "registry.hpp"

namespace w4a8moe::kernel_tests {

class KernelSetTest : public ::testing::TestWithParam<const detail::KernelSet*> {
 protected:
  void SetUp() override {
    if (!GetParam()->usable(cpu_features()))
      GTEST_SKIP() << "kernel set " << GetParam()->name << " is not usable on this CPU ("
                   << cpu_features().summary() << ")";
  }
};

inline std::vector<const detail::KernelSet*> table_sets() {
  std::vector<const detail::KernelSet*> out;
  for (const detail::KernelSet& k : detail::kernel_table()) out.push_back(&k);
  return out;
}

inline std::string set_name(const ::testing::TestParamInfo<const detail::KernelSet*>& info) {
  return info.param->name;
}

}  // namespace w4a8moe::kernel_tests
