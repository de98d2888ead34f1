// The independent routing reference of the checkpoint suites (checkpoint_writers.hpp): gating,
// selection bias, grouped top-k and renormalisation in double, with a stable sort; and the
// router's logits in double.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>

#include "checkpoint_writers.hpp"

namespace ckpt_test {

// ---------------------------------------------------------------------------------------------
// Routing reference

void route_reference(const std::vector<float>& logits, int64_t T, int64_t E, int64_t K,
                     const std::vector<float>& selection_bias, const RouteSpec& spec,
                     std::vector<int64_t>& ids, std::vector<double>& weights) {
  ids.assign(static_cast<size_t>(T * K), 0);
  weights.assign(static_cast<size_t>(T * K), 0.0);
  const double inf = std::numeric_limits<double>::infinity();
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> l(static_cast<size_t>(E)), score(static_cast<size_t>(E)), sel;
    for (int64_t e = 0; e < E; ++e)
      l[static_cast<size_t>(e)] = static_cast<double>(logits[static_cast<size_t>(t * E + e)]);
    if (spec.gating == "softmax") {
      double mx = -inf, sum = 0;
      for (const double v : l) mx = std::max(mx, v);
      for (size_t e = 0; e < l.size(); ++e) sum += (score[e] = std::exp(l[e] - mx));
      for (double& v : score) v /= sum;
    } else if (spec.gating == "sigmoid") {
      for (size_t e = 0; e < l.size(); ++e) score[e] = 1.0 / (1.0 + std::exp(-l[e]));
    } else {
      score = l;
    }
    sel = score;
    if (!selection_bias.empty())
      for (size_t e = 0; e < sel.size(); ++e) sel[e] += static_cast<double>(selection_bias[e]);
    // NaN -> below everything
    for (double& v : sel)
      if (std::isnan(v)) v = -inf;
    if (spec.groups > 1) {
      const int64_t per = E / spec.groups;
      std::vector<std::pair<double, int64_t>> gs;
      for (int64_t g = 0; g < spec.groups; ++g) {
        std::vector<double> v(sel.begin() + g * per, sel.begin() + (g + 1) * per);
        std::sort(v.begin(), v.end(), std::greater<>());
        gs.push_back({spec.top2 ? v[0] + v[1] : v[0], g});
      }
      std::stable_sort(gs.begin(), gs.end(),
                       [](const auto& a, const auto& b) { return a.first > b.first; });
      std::vector<bool> keep(static_cast<size_t>(spec.groups), false);
      for (int64_t i = 0; i < spec.groups_used; ++i)
        keep[static_cast<size_t>(gs[static_cast<size_t>(i)].second)] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[static_cast<size_t>(e / per)]) sel[static_cast<size_t>(e)] = -inf;
    }
    std::vector<int64_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return sel[static_cast<size_t>(a)] > sel[static_cast<size_t>(b)];
    });
    std::vector<double> w(static_cast<size_t>(K));
    for (int64_t k = 0; k < K; ++k)
      w[static_cast<size_t>(k)] = score[static_cast<size_t>(order[static_cast<size_t>(k)])];
    if (spec.gating == "softmax_topk") {
      double mx = -inf, sum = 0;
      for (const double v : w) mx = std::max(mx, v);
      for (double& v : w) sum += (v = std::exp(v - mx));
      for (double& v : w) v /= sum;
    }
    if (spec.renormalize) {
      double sum = 0;
      for (const double v : w) sum += v;
      for (double& v : w) v /= sum;
    }
    for (int64_t k = 0; k < K; ++k) {
      ids[static_cast<size_t>(t * K + k)] = order[static_cast<size_t>(k)];
      weights[static_cast<size_t>(t * K + k)] = w[static_cast<size_t>(k)] * spec.scaling;
    }
  }
}

std::vector<double> logits_reference(const std::vector<float>& x, const std::vector<float>& router,
                                     const std::vector<float>& bias, int64_t T, int64_t H,
                                     int64_t E) {
  std::vector<double> out(static_cast<size_t>(T * E));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      double acc = bias.empty() ? 0.0 : static_cast<double>(bias[static_cast<size_t>(e)]);
      for (int64_t h = 0; h < H; ++h)
        acc += static_cast<double>(x[static_cast<size_t>(t * H + h)]) *
               static_cast<double>(router[static_cast<size_t>(e * H + h)]);
      out[static_cast<size_t>(t * E + e)] = acc;
    }
  return out;
}

}  // namespace ckpt_test
