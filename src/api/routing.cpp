// Routing: router logits in f32, then the gating rules of real MoE models.
#include "w4a8moe/routing.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <iterator>
#include <limits>
#include <numeric>
#include <vector>

#include "api/validate.hpp"
#include "common/format.hpp"
#include "common/numeric.hpp"

namespace w4a8moe {

namespace {

using detail::cat;
using detail::shape_string;

std::string shape_of(const TensorView& t) { return shape_string(t.rank, t.shape); }
std::string shape_of(const MutableTensorView& t) { return shape_string(t.rank, t.shape); }

void require_float(DType d, const char* name) {
  if (!detail::is_float_dtype(d))
    throw Error(cat(name, ": expected dtype f32, bf16 or f16, got ", dtype_name(d)));
}

// a [T, E] row of floats (row stride may exceed E) as f32.
void load_row(const TensorView& t, int64_t row, std::vector<float>& out) {
  const int64_t n = t.shape[1];
  out.resize(static_cast<size_t>(n));
  const int64_t base = row * t.stride();
  for (int64_t i = 0; i < n; ++i)
    out[static_cast<size_t>(i)] = detail::load_float(t.data, t.dtype, base + i);
}

// Dot product in f32 with eight partial sums (lane j % 8), combined pairwise: a fixed order.
float dot_f32(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  for (int j = 0; i < n; ++i, ++j) acc[j] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// a is chosen before b: larger value first, NaN last, then the lower index.
struct Better {
  const float* v;
  bool operator()(int64_t a, int64_t b) const {
    const bool na = std::isnan(v[a]), nb = std::isnan(v[b]);
    if (na != nb) return nb;
    if (!na && v[a] != v[b]) return v[a] > v[b];
    return a < b;
  }
};

}  // namespace

const char* gating_name(Gating gating) noexcept {
  static constexpr const char* kNames[] = {"softmax", "sigmoid", "softmax_topk"};  // by code
  const auto code = static_cast<size_t>(gating);
  return code < std::size(kNames) ? kNames[code] : "?";
}

void check_routing_config(const RoutingConfig& c) {
  if (c.experts < 1 || c.experts > std::numeric_limits<int32_t>::max())
    throw Error(cat("routing experts: expected 1 to 2^31 - 1, got ", c.experts));
  if (c.top_k < 1 || c.top_k > c.experts)
    throw Error(cat("routing top_k: expected 1 to ", c.experts, " (the experts), got ", c.top_k));
  if (c.gating != Gating::softmax && c.gating != Gating::sigmoid &&
      c.gating != Gating::softmax_topk)
    throw Error(cat("routing gating: expected softmax, sigmoid or softmax_topk, got code ",
                    static_cast<int>(c.gating)));
  if (!std::isfinite(c.scaling))
    throw Error(cat("routing scaling: expected a finite number, got ", c.scaling));
  if (c.groups < 1 || c.experts % c.groups != 0)
    throw Error(
        cat("routing groups: expected a divisor of ", c.experts, " (the experts), got ", c.groups));
  if (c.groups_used < 1 || c.groups_used > c.groups)
    throw Error(
        cat("routing groups_used: expected 1 to ", c.groups, " (the groups), got ", c.groups_used));
  if (c.groups_used * (c.experts / c.groups) < c.top_k)
    throw Error(cat("routing groups_used: ", c.groups_used, " groups of ", c.experts / c.groups,
                    " experts hold fewer than top_k = ", c.top_k, " experts"));
  if (c.group_score != GroupScore::top2_sum && c.group_score != GroupScore::max)
    throw Error(cat("routing group_score: expected top2_sum or max, got code ",
                    static_cast<int>(c.group_score)));
  if (c.groups > 1 && c.group_score == GroupScore::top2_sum && c.experts / c.groups < 2)
    throw Error(cat("routing group_score: top2_sum needs at least 2 experts per group, got ",
                    c.experts / c.groups));
}

void router_logits(const TensorView& x, const TensorView& weight, const TensorView& bias,
                   const MutableTensorView& logits) {
  require_float(x.dtype, "x");
  if (x.rank != 2 || x.shape[0] < 0 || x.shape[1] < 1)
    throw Error(cat("x: expected shape [T, H] with H >= 1, got ", shape_of(x)));
  if (x.row_stride != 0 && x.row_stride < x.shape[1])
    throw Error(cat("x: expected a row stride >= ", x.shape[1], ", got ", x.row_stride));
  const int64_t T = x.shape[0], H = x.shape[1];
  require_float(weight.dtype, "router weight");
  if (weight.rank != 2 || weight.shape[0] < 1 || weight.shape[1] != H)
    throw Error(
        cat("router weight: expected shape [E, ", H, "] (H from x), got ", shape_of(weight)));
  if (weight.row_stride != 0 && weight.row_stride != H)
    throw Error(
        cat("router weight: expected a contiguous tensor, got row stride ", weight.row_stride));
  const int64_t E = weight.shape[0];
  if (!bias.empty()) {
    require_float(bias.dtype, "router bias");
    if (bias.rank != 1 || bias.shape[0] != E)
      throw Error(
          cat("router bias: expected shape [", E, "] (E from the weight), got ", shape_of(bias)));
  }
  if (logits.dtype != DType::f32)
    throw Error(cat("logits: expected dtype f32, got ", dtype_name(logits.dtype)));
  if (logits.rank != 2 || logits.shape[0] != T || logits.shape[1] != E)
    throw Error(cat("logits: expected shape [", T, ", ", E, "], got ", shape_of(logits)));
  if (logits.row_stride != 0 && logits.row_stride < E)
    throw Error(cat("logits: expected a row stride >= ", E, ", got ", logits.row_stride));
  if (T == 0) return;
  if (x.data == nullptr) throw Error("x: expected a data pointer, got null");
  if (weight.data == nullptr) throw Error("router weight: expected a data pointer, got null");
  if (logits.data == nullptr) throw Error("logits: expected a data pointer, got null");

  std::vector<float> w(static_cast<size_t>(E * H));
  for (int64_t i = 0; i < E * H; ++i)
    w[static_cast<size_t>(i)] = detail::load_float(weight.data, weight.dtype, i);
  std::vector<float> b(static_cast<size_t>(E), 0.0f);
  if (!bias.empty())
    for (int64_t e = 0; e < E; ++e)
      b[static_cast<size_t>(e)] = detail::load_float(bias.data, bias.dtype, e);
  std::vector<float> row;
  auto* out = static_cast<float*>(logits.data);
  const int64_t out_stride = logits.stride();
  for (int64_t t = 0; t < T; ++t) {
    load_row(x, t, row);
    for (int64_t e = 0; e < E; ++e)
      out[t * out_stride + e] =
          dot_f32(row.data(), w.data() + e * H, H) + b[static_cast<size_t>(e)];
  }
}

void route(const TensorView& logits, const TensorView& selection_bias, const RoutingConfig& config,
           const MutableTensorView& topk_ids, const MutableTensorView& topk_weights) {
  check_routing_config(config);
  const int64_t E = config.experts, K = config.top_k;
  require_float(logits.dtype, "logits");
  if (logits.rank != 2 || logits.shape[0] < 0 || logits.shape[1] != E)
    throw Error(
        cat("logits: expected shape [T, ", E, "] (E from the config), got ", shape_of(logits)));
  if (logits.row_stride != 0 && logits.row_stride < E)
    throw Error(cat("logits: expected a row stride >= ", E, ", got ", logits.row_stride));
  const int64_t T = logits.shape[0];
  if (!selection_bias.empty()) {
    require_float(selection_bias.dtype, "selection_bias");
    if (selection_bias.rank != 1 || selection_bias.shape[0] != E)
      throw Error(cat("selection_bias: expected shape [", E, "], got ", shape_of(selection_bias)));
  }
  if (topk_ids.dtype != DType::i32 && topk_ids.dtype != DType::i64)
    throw Error(cat("topk_ids: expected dtype i32 or i64, got ", dtype_name(topk_ids.dtype)));
  if (topk_ids.rank != 2 || topk_ids.shape[0] != T || topk_ids.shape[1] != K ||
      (topk_ids.row_stride != 0 && topk_ids.row_stride != K))
    throw Error(
        cat("topk_ids: expected a contiguous [", T, ", ", K, "], got ", shape_of(topk_ids)));
  require_float(topk_weights.dtype, "topk_weights");
  if (topk_weights.rank != 2 || topk_weights.shape[0] != T || topk_weights.shape[1] != K ||
      (topk_weights.row_stride != 0 && topk_weights.row_stride != K))
    throw Error(cat("topk_weights: expected a contiguous [", T, ", ", K, "], got ",
                    shape_of(topk_weights)));
  if (T == 0) return;
  if (logits.data == nullptr) throw Error("logits: expected a data pointer, got null");
  if (topk_ids.data == nullptr) throw Error("topk_ids: expected a data pointer, got null");
  if (topk_weights.data == nullptr) throw Error("topk_weights: expected a data pointer, got null");

  std::vector<float> bias;
  if (!selection_bias.empty()) {
    bias.resize(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e)
      bias[static_cast<size_t>(e)] =
          detail::load_float(selection_bias.data, selection_bias.dtype, e);
  }
  const int64_t per_group = E / config.groups;
  std::vector<float> l, s(static_cast<size_t>(E)), v(static_cast<size_t>(E));
  std::vector<int64_t> order(static_cast<size_t>(E)),
      group_order(static_cast<size_t>(config.groups));
  std::vector<float> group_value(static_cast<size_t>(config.groups));
  std::vector<float> w(static_cast<size_t>(K));
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  for (int64_t t = 0; t < T; ++t) {
    load_row(logits, t, l);
    // scores
    if (config.gating == Gating::softmax) {
      float m = kNegInf;
      for (const float x : l)
        if (x > m) m = x;  // NaN never compares greater
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) {
        s[static_cast<size_t>(e)] = std::exp(l[static_cast<size_t>(e)] - m);
        sum += s[static_cast<size_t>(e)];
      }
      for (float& x : s) x /= sum;
    } else if (config.gating == Gating::sigmoid) {
      for (int64_t e = 0; e < E; ++e)
        s[static_cast<size_t>(e)] = 1.0f / (1.0f + std::exp(-l[static_cast<size_t>(e)]));
    } else {
      s = l;
    }
    // selection values: the scores (+ bias); sigmoid without a bias or groups chooses on the
    // logits (the same order, without the ties that saturation of the sigmoid would make)
    const bool on_logits = config.gating == Gating::sigmoid && bias.empty() && config.groups == 1;
    for (int64_t e = 0; e < E; ++e) {
      const size_t i = static_cast<size_t>(e);
      v[i] = on_logits ? l[i] : (bias.empty() ? s[i] : s[i] + bias[i]);
    }
    // groups: keep the best groups_used groups, mask the others
    if (config.groups > 1) {
      for (int64_t g = 0; g < config.groups; ++g) {
        const float* gv = v.data() + g * per_group;
        std::vector<int64_t> idx(static_cast<size_t>(per_group));
        std::iota(idx.begin(), idx.end(), int64_t{0});
        const int64_t take = config.group_score == GroupScore::top2_sum ? 2 : 1;
        std::partial_sort(idx.begin(), idx.begin() + take, idx.end(), Better{gv});
        float score = gv[idx[0]];
        if (take == 2) score += gv[idx[1]];
        group_value[static_cast<size_t>(g)] = score;
      }
      std::iota(group_order.begin(), group_order.end(), int64_t{0});
      std::partial_sort(group_order.begin(), group_order.begin() + config.groups_used,
                        group_order.end(), Better{group_value.data()});
      std::vector<uint8_t> keep(static_cast<size_t>(config.groups), 0);
      for (int64_t i = 0; i < config.groups_used; ++i)
        keep[static_cast<size_t>(group_order[static_cast<size_t>(i)])] = 1;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[static_cast<size_t>(e / per_group)]) v[static_cast<size_t>(e)] = kNegInf;
    }
    // top-k, best first, ties to the lowest index
    std::iota(order.begin(), order.end(), int64_t{0});
    std::partial_sort(order.begin(), order.begin() + K, order.end(), Better{v.data()});
    // weights
    if (config.gating == Gating::softmax_topk) {
      float m = kNegInf;
      for (int64_t k = 0; k < K; ++k)
        m = std::max(m, l[static_cast<size_t>(order[static_cast<size_t>(k)])]);
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        w[static_cast<size_t>(k)] =
            std::exp(l[static_cast<size_t>(order[static_cast<size_t>(k)])] - m);
        sum += w[static_cast<size_t>(k)];
      }
      for (float& x : w) x /= sum;
    } else {
      for (int64_t k = 0; k < K; ++k)
        w[static_cast<size_t>(k)] = s[static_cast<size_t>(order[static_cast<size_t>(k)])];
    }
    if (config.renormalize) {
      float sum = 0.0f;
      for (const float x : w) sum += x;
      for (float& x : w) x /= sum;
    }
    for (int64_t k = 0; k < K; ++k) {
      const int64_t id = order[static_cast<size_t>(k)];
      if (topk_ids.dtype == DType::i64) {
        static_cast<int64_t*>(topk_ids.data)[t * K + k] = id;
      } else {
        static_cast<int32_t*>(topk_ids.data)[t * K + k] = static_cast<int32_t>(id);
      }
      detail::store_float(topk_weights.data, topk_weights.dtype, t * K + k,
                          w[static_cast<size_t>(k)] * config.scaling);
    }
  }
}

}  // namespace w4a8moe
