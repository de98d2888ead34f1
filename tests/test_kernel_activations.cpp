// Each kernel set's activation (gate x up, docs/operator.md "Activations") against the tests'
// double-precision formula, NaN propagation, and the same bits for an element wherever it falls
// in a call: the ISA sets' loops run vectorised bodies and scalar tails, which must agree.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernel_set_test.hpp"
#include "reference/reference.hpp"

namespace {

using namespace w4a8moe;

W4A8MOE_KERNEL_SET_SUITE(KernelActivation);

constexpr Activation kActivations[] = {Activation::swiglustep, Activation::swigluoai,
                                       Activation::silu, Activation::gelu, Activation::gelu_tanh};

MoeParams params_for(Activation a) {
  MoeParams p;
  p.activation = a;
  p.alpha = 1.702f;
  p.limit = 7.0f;
  return p;
}

// gate and up of order one to ten, both signs, and the edges of the math: the clamps at +-limit,
// exp's range ends, zeros, denormals. An odd count, so every vector width leaves a tail.
struct Inputs {
  std::vector<float> gate, up;
};
Inputs make_inputs(int64_t n, uint32_t seed) {
  Inputs in{std::vector<float>(static_cast<size_t>(n)), std::vector<float>(static_cast<size_t>(n))};
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> wide(-12.0f, 12.0f);
  for (int64_t i = 0; i < n; ++i) {
    in.gate[static_cast<size_t>(i)] = wide(rng);
    in.up[static_cast<size_t>(i)] = wide(rng);
  }
  const float edges[] = {0.0f,  -0.0f,  7.0f,   -7.0f,   6.9999995f, 7.0000005f, 1e-40f, -1e-40f,
                         88.5f, -88.5f, 100.0f, -100.0f, 40.0f,      -40.0f,     0.5f,   -0.5f};
  size_t k = 0;
  for (float g : edges)
    for (float u : {1.0f, -3.0f, 7.5f, -7.5f}) {
      in.gate[k % in.gate.size()] = g;  // spread over vector lanes and tails
      in.up[k % in.up.size()] = u;
      k += 7;
    }
  return in;
}

std::vector<float> run(const detail::KernelSet& set, const MoeParams& p, const float* gate,
                       const float* up, int64_t n) {
  std::vector<float> m(static_cast<size_t>(n), -12345.0f);
  set.activate(p, gate, up, m.data(), n);
  return m;
}

bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof a) == 0 || (std::isnan(a) && std::isnan(b));
}

TEST_P(KernelActivation, MatchesTheDoubleFormula) {
  constexpr int64_t n = 2053;
  const Inputs in = make_inputs(n, 11);
  for (Activation a : kActivations) {
    const MoeParams p = params_for(a);
    const std::vector<float> m = run(*GetParam(), p, in.gate.data(), in.up.data(), n);
    double worst = 0, largest = 0;
    int64_t worst_at = -1;
    for (int64_t i = 0; i < n; ++i) {
      const auto s = static_cast<size_t>(i);
      const double g = in.gate[s], u = in.up[s], got = m[s];
      const double want = moe_ref::activation(static_cast<int>(a), g, u, p.alpha, p.limit);
      ASSERT_TRUE(std::isfinite(m[s])) << activation_name(a) << " at " << i;
      largest = std::max(largest, std::abs(want));
      // f32 products of a few ulp each and exp to 2 ulp (the relative term, 30x what the sets
      // reach), erf to 1.5e-7 absolute times |g u| / 2 (gelu and gelu_tanh reach 0.7 of it)
      const double bound = 2e-6 * std::abs(want) + 2e-7 * (1.0 + std::abs(g * u));
      const double err = std::abs(got - want) / bound;
      if (err > worst) worst = err, worst_at = i;
    }
    EXPECT_LE(worst, 1.0) << activation_name(a) << ": worst at element " << worst_at;
    EXPECT_GT(largest, 5.0) << "the data must reach outputs of order one and more";
  }
}

TEST_P(KernelActivation, NanPropagates) {
  constexpr int64_t n = 37;
  Inputs in = make_inputs(n, 12);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t i = 0; i < n; i += 3) in.gate[static_cast<size_t>(i)] = nan;
  for (int64_t i = 1; i < n; i += 5) in.up[static_cast<size_t>(i)] = nan;
  for (Activation a : kActivations) {
    const std::vector<float> m = run(*GetParam(), params_for(a), in.gate.data(), in.up.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const auto s = static_cast<size_t>(i);
      const bool nan_in = std::isnan(in.gate[s]) || std::isnan(in.up[s]);
      EXPECT_EQ(std::isnan(m[s]), nan_in) << activation_name(a) << " at " << i;
    }
  }
}

TEST_P(KernelActivation, EveryElementGetsTheSameBitsWhereverItFalls) {
  constexpr int64_t n = 301;
  const Inputs in = make_inputs(n, 13);
  for (Activation a : kActivations) {
    const MoeParams p = params_for(a);
    const std::vector<float> whole = run(*GetParam(), p, in.gate.data(), in.up.data(), n);
    for (int64_t start = 0; start < 9; ++start)
      for (int64_t len = 1; len <= 40 && start + len <= n; ++len) {
        const auto s = static_cast<size_t>(start);
        const std::vector<float> part = run(*GetParam(), p, &in.gate[s], &in.up[s], len);
        for (int64_t i = 0; i < len; ++i)
          ASSERT_TRUE(same_bits(part[static_cast<size_t>(i)], whole[s + static_cast<size_t>(i)]))
              << activation_name(a) << ": element " << start + i << " of a call of " << len
              << " from " << start << " gives " << part[static_cast<size_t>(i)]
              << ", the whole row " << whole[s + static_cast<size_t>(i)];
      }
  }
}

}  // namespace
