// The fixture of the kernel-level suites: one instantiation per kernel set of the registry's
// table, named by the set (`KernelGemm.IntegerSumsAreExactAtTheExtremes/avx2`); a set this CPU
// lacks skips with a message. W4A8MOE_KERNEL_SET_SUITE declares and instantiates such a suite.
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

// Declares the suite `suite` (a KernelSetTest) and instantiates it once per kernel set of the
// table, named by the set: adding a set to the table adds its tests.
#define W4A8MOE_KERNEL_SET_SUITE(suite)                                                         \
  class suite : public ::w4a8moe::kernel_tests::KernelSetTest {};                               \
  INSTANTIATE_TEST_SUITE_P(, suite, ::testing::ValuesIn(::w4a8moe::kernel_tests::table_sets()), \
                           ::w4a8moe::kernel_tests::set_name)
