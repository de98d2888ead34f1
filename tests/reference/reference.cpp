// The independent reference of the w4a8moe operator. Plain loops over the unpacked tensors;
// nothing here is shared with src/ (see reference.hpp).
#include "reference/reference.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

namespace moe_ref {

namespace {

// Exact for |v| < 2^52 (every value this file rounds).
double round_half_even(double v) {
  const double f = std::floor(v);
  const double d = v - f;
  if (d > 0.5) return f + 1.0;
  if (d < 0.5) return f;
  return std::fmod(f, 2.0) == 0.0 ? f : f + 1.0;
}

double round_half_away(double v) { return v >= 0.0 ? std::floor(v + 0.5) : -std::floor(-v + 0.5); }

// Rounds |value| (finite, non-negative) to a float format with `mantissa_bits` stored mantissa
// bits whose smallest normal exponent is `min_exp`, by scaling to the unit in the last place.
double round_to_format(double magnitude, int mantissa_bits, int min_exp) {
  if (magnitude == 0.0) return 0.0;
  const int e = std::max(std::ilogb(magnitude), min_exp);
  const double ulp = std::ldexp(1.0, e - mantissa_bits);
  return round_half_even(magnitude / ulp) * ulp;
}

}  // namespace

// ---- 16-bit floats ----------------------------------------------------------------------------

float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t f32_to_bf16(float value) {
  const uint16_t sign = std::signbit(value) ? 0x8000 : 0;
  if (std::isnan(value)) return sign | 0x7fc0;
  if (std::isinf(value)) return sign | 0x7f80;
  const double r = round_to_format(std::fabs(static_cast<double>(value)), 7, -126);
  if (r >= 0x1p128) return sign | 0x7f80;
  const uint32_t f = std::bit_cast<uint32_t>(static_cast<float>(r));  // exact: r fits bf16
  return static_cast<uint16_t>(sign | (f >> 16));
}

float f16_to_f32(uint16_t bits) {
  const bool negative = (bits & 0x8000) != 0;
  const int exp = (bits >> 10) & 0x1f;
  const int man = bits & 0x3ff;
  double v;
  if (exp == 0x1f) {
    v = man != 0 ? std::numeric_limits<double>::quiet_NaN()
                 : std::numeric_limits<double>::infinity();
  } else if (exp == 0) {
    v = std::ldexp(static_cast<double>(man), -24);
  } else {
    v = std::ldexp(static_cast<double>(1024 + man), exp - 25);
  }
  return static_cast<float>(negative ? -v : v);
}

uint16_t f32_to_f16(float value) {
  const uint16_t sign = std::signbit(value) ? 0x8000 : 0;
  if (std::isnan(value)) return sign | 0x7e00;
  if (std::isinf(value)) return sign | 0x7c00;
  const double r = round_to_format(std::fabs(static_cast<double>(value)), 10, -14);
  if (r >= 65536.0) return sign | 0x7c00;  // 65504 is the largest finite f16
  if (r < 0x1p-14) {  // subnormal (1024 * 2^-24 = 2^-14 encodes as the smallest normal)
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r * 0x1p24));
  }
  const int e = std::ilogb(r);
  const int man = static_cast<int>(r / std::ldexp(1.0, e - 10)) - 1024;
  return static_cast<uint16_t>(sign | ((e + 15) << 10) | man);
}

// ---- activations ------------------------------------------------------------------------------

namespace {

double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }
double silu(double z) { return z * sigmoid(z); }

}  // namespace

double activation(int code, double gate, double up, double alpha, double limit) {
  switch (static_cast<Act>(code)) {
    case Act::swiglustep:
      return std::min(silu(gate), limit) * std::clamp(up, -limit, limit);
    case Act::swigluoai: {
      const double gc = std::min(gate, limit);
      const double uc = std::clamp(up, -limit, limit);
      return (uc + 1.0) * gc * sigmoid(alpha * gc);
    }
    case Act::silu:
      return silu(gate) * up;
    case Act::gelu:
      return 0.5 * gate * (1.0 + std::erf(gate / std::sqrt(2.0))) * up;
    case Act::gelu_tanh: {
      const double c = std::sqrt(2.0 / 3.14159265358979323846);
      return 0.5 * gate * (1.0 + std::tanh(c * (gate + 0.044715 * gate * gate * gate))) * up;
    }
  }
  throw std::invalid_argument("moe_ref::activation: unknown code " + std::to_string(code));
}

// ---- quant_row (docs/operator.md, "Activation quantization"), in f32 ------------------------

QuantRow quant_row(std::span<const float> a) {
  QuantRow r;
  r.q.assign(a.size(), 0);
  float mn = 0.0f, mx = 0.0f;
  for (const float v : a) {
    if (!std::isfinite(v)) {
      r.finite = false;
      return r;
    }
    mn = std::min(mn, v);
    mx = std::max(mx, v);
  }
  float s = (mx == mn) ? 1.0f : 255.0f / (mx - mn);
  // The spec leaves a range below 255 / FLT_MAX (infinite scale) open; use scale 1 to stay
  // defined, as the library does. The tests never produce such a row.
  if (!std::isfinite(s)) s = 1.0f;
  r.scale = s;
  r.recip = 1.0f / s;
  const float lo = mn * s;
  const float hi = mx * s;
  const float zf = ((-128.0f + lo) + (127.0f + hi) > 0.0f) ? (-128.0f - lo) : (127.0f - hi);
  r.zero_point_f = zf;
  r.zp =
      static_cast<int32_t>(round_half_even(static_cast<double>(std::clamp(zf, -128.0f, 127.0f))));
  for (size_t k = 0; k < a.size(); ++k) {
    const float scaled = a[k] * s;  // one f32 product
    const int64_t q = static_cast<int64_t>(round_half_away(static_cast<double>(scaled))) + r.zp;
    r.q[k] = static_cast<int32_t>(std::clamp<int64_t>(q, -128, 127));
  }
  return r;
}

// ---- the problem ------------------------------------------------------------------------------

void check_problem(const Problem& p) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("moe_ref: " + what); };
  if (p.tokens < 1 || p.hidden < 1 || p.inter < 1 || p.experts < 1 || p.top_k < 1)
    fail("every dimension must be positive");
  const int64_t g = p.group_size;
  if (g != -1 && (g < 1 || p.hidden % g != 0 || p.inter % g != 0))
    fail("group size must be -1 or divide H and I");
  const auto T = static_cast<size_t>(p.tokens), H = static_cast<size_t>(p.hidden),
             I = static_cast<size_t>(p.inter), E = static_cast<size_t>(p.experts),
             K = static_cast<size_t>(p.top_k);
  const size_t g13 = g < 0 ? 1 : H / static_cast<size_t>(g);
  const size_t g2 = g < 0 ? 1 : I / static_cast<size_t>(g);
  if (p.x.size() != T * H) fail("x must be [T, H]");
  if (p.ids.size() != T * K || p.topk_weights.size() != T * K) fail("topk must be [T, K]");
  if (p.w13.size() != E * 2 * I * H || p.w13_scale.size() != E * 2 * I * g13)
    fail("w13 or its scale has the wrong size");
  if (p.w2.size() != E * H * I || p.w2_scale.size() != E * H * g2)
    fail("w2 or its scale has the wrong size");
  if (!p.w13_bias.empty() && p.w13_bias.size() != E * 2 * I) fail("w13_bias must be [E, 2I]");
  if (!p.w2_bias.empty() && p.w2_bias.size() != E * H) fail("w2_bias must be [E, H]");
  for (const int64_t id : p.ids)
    if (id < 0 || id >= p.experts) fail("topk id " + std::to_string(id) + " out of range");
  const int lo = p.mxfp4_values ? -12 : p.zero_point_values ? -15 : -8;
  const int hi = p.mxfp4_values ? 12 : p.zero_point_values ? 15 : 7;
  for (const int8_t w : p.w13)
    if (w < lo || w > hi) fail("w13 value out of its format's range");
  for (const int8_t w : p.w2)
    if (w < lo || w > hi) fail("w2 value out of its format's range");
  if (p.activation < 0 || p.activation > 4) fail("unknown activation code");
  if (!p.w13_input_order.empty()) {
    if (p.w13_input_order.size() != E * H) fail("w13_input_order must be [E, H]");
    for (size_t e = 0; e < E; ++e) {
      std::vector<bool> seen(H, false);
      for (size_t c = 0; c < H; ++c) {
        const int32_t i = p.w13_input_order[e * H + c];
        if (i < 0 || static_cast<size_t>(i) >= H || seen[static_cast<size_t>(i)])
          fail("w13_input_order rows must be permutations of [0, H)");
        seen[static_cast<size_t>(i)] = true;
      }
    }
  }
}

namespace {

// The input that column c of expert e's w13 multiplies.
int64_t w13_input(const Problem& p, int64_t e, int64_t c) {
  return p.w13_input_order.empty() ? c : p.w13_input_order[static_cast<size_t>(e * p.hidden + c)];
}

}  // namespace

namespace {

// The stored w13 row of logical row n (gate rows [0, I), up rows [I, 2I)).
int64_t w13_row(const Problem& p, int64_t n) {
  if (!p.interleaved) return n;
  return n < p.inter ? 2 * n : 2 * (n - p.inter) + 1;
}

// SUM d[k] * w[k], exact. |d| <= 255 and |w| <= 8, so a chunk of 2^16 fits int32.
int64_t int_dot(const int16_t* d, const int8_t* w, int64_t n) {
  int64_t total = 0;
  for (int64_t begin = 0; begin < n; begin += 65536) {
    const int64_t end = std::min(n, begin + 65536);
    int32_t s = 0;
    for (int64_t k = begin; k < end; ++k) s += int32_t{d[k]} * int32_t{w[k]};
    total += s;
  }
  return total;
}

// docs/operator.md, "Weights and the dot product": recip * SUM_b s[b] * SUM_{k in b} d[k] * w[k],
// sums in double.
double dq_dot(const int16_t* d, float recip, const int8_t* w, const float* scale, int64_t cols,
              int64_t group_size) {
  if (group_size < 0) {
    return static_cast<double>(recip) * static_cast<double>(scale[0]) *
           static_cast<double>(int_dot(d, w, cols));
  }
  double acc = 0.0;
  for (int64_t b = 0; b < cols / group_size; ++b)
    acc += static_cast<double>(scale[b]) *
           static_cast<double>(int_dot(d + b * group_size, w + b * group_size, group_size));
  return static_cast<double>(recip) * acc;
}

// Float dot of a double row with dequantized weights, four partial sums.
double float_dot(const double* a, const int8_t* w, const float* scale, int64_t cols,
                 int64_t group_size) {
  const int64_t len = group_size < 0 ? cols : group_size;
  double acc = 0.0;
  for (int64_t b = 0; b < cols / len; ++b) {
    const double* ab = a + b * len;
    const int8_t* wb = w + b * len;
    double s[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t k = 0;
    for (; k + 4 <= len; k += 4)
      for (int j = 0; j < 4; ++j) s[j] += ab[k + j] * static_cast<double>(wb[k + j]);
    for (; k < len; ++k) s[0] += ab[k] * static_cast<double>(wb[k]);
    acc += static_cast<double>(scale[b]) * ((s[0] + s[1]) + (s[2] + s[3]));
  }
  return acc;
}

float qm_min(std::span<const float> m) {
  float mn = 0.0f;
  for (const float v : m) mn = std::min(mn, v);
  return mn;
}
float qm_max(std::span<const float> m) {
  float mx = 0.0f;
  for (const float v : m) mx = std::max(mx, v);
  return mx;
}

// True when v lies within `margin` of a half-integer (a round-half-away boundary).
bool near_half(double v, double margin) {
  const double a = std::fabs(v);
  return std::fabs(a - std::floor(a) - 0.5) < margin;
}

// Indices of intermediate elements whose quantized value may differ by one step in an
// implementation that computes m (and so the row's scale and zero point) with f32 rounding.
//
// `exact[k]` says that m[k] is the activation's value exactly (no rounding to f32 happened, as for
// products of clamped limits like L * L). Elements that are exact in a row whose extremes are
// exact are computed identically by any implementation, however close to a boundary they sit.
std::vector<int64_t> near_boundary_elements(std::span<const float> m,
                                            const std::vector<uint8_t>& exact, const QuantRow& qm,
                                            double margin) {
  const float mn = qm_min(m), mx = qm_max(m);
  bool row_exact = true;  // the elements that set min and max are exact (0 always is)
  for (size_t k = 0; k < m.size(); ++k)
    if ((m[k] == mn || m[k] == mx) && !exact[k]) row_exact = false;
  std::vector<int64_t> out;
  const float zc = std::clamp(qm.zero_point_f, -128.0f, 127.0f);
  const bool zp_near = !row_exact && near_half(static_cast<double>(zc), margin);
  const int32_t zp_alt =
      std::clamp(zc >= static_cast<float>(qm.zp) ? qm.zp + 1 : qm.zp - 1, -128, 127);
  for (size_t k = 0; k < m.size(); ++k) {
    if (row_exact && exact[k]) continue;
    const double v = static_cast<double>(m[k]) * static_cast<double>(qm.scale);
    bool near = near_half(v, margin);
    if (!near && zp_near) {  // a zero point one off changes q - zp only where q clamps
      const auto r = static_cast<int64_t>(round_half_away(static_cast<double>(m[k] * qm.scale)));
      const int64_t alt = std::clamp<int64_t>(r + zp_alt, -128, 127) - zp_alt;
      near = alt != qm.q[k] - qm.zp;
    }
    if (near) out.push_back(static_cast<int64_t>(k));
  }
  return out;
}

}  // namespace

ExactResult exact_forward(const Problem& p, const ExactOptions& options) {
  check_problem(p);
  const int64_t T = p.tokens, H = p.hidden, I = p.inter, K = p.top_k;
  const int64_t g = p.group_size;
  const int64_t groups13 = g < 0 ? 1 : H / g;
  const int64_t groups2 = g < 0 ? 1 : I / g;

  ExactResult res;
  res.out.assign(static_cast<size_t>(T * H), 0.0);
  res.recip_m.assign(static_cast<size_t>(T * K), 0.0f);
  res.near_boundary.assign(static_cast<size_t>(T * K), 0);
  res.allowance.assign(static_cast<size_t>(T * H), 0.0);
  res.intermediate_elements = T * K * I;
  res.token_finite.assign(static_cast<size_t>(T), 1);

  std::vector<float> a(static_cast<size_t>(H)), m(static_cast<size_t>(I));
  std::vector<int16_t> da(static_cast<size_t>(H)), dm(static_cast<size_t>(I));
  std::vector<double> h(static_cast<size_t>(2 * I));
  std::vector<uint8_t> exact(static_cast<size_t>(I));
  std::vector<std::pair<uint32_t, uint32_t>> events;  // (m, scale) of near elements
  for (int64_t t = 0; t < T; ++t) {
    double* out = res.out.data() + t * H;
    for (int64_t k = 0; k < K && res.token_finite[t]; ++k) {
      const int64_t e = p.ids[t * K + k];
      const float r = p.topk_weights[t * K + k];
      for (int64_t j = 0; j < H; ++j) {
        const float v = p.x[t * H + w13_input(p, e, j)];
        a[j] = p.apply_router_weight_on_input ? v * r : v;
      }
      const QuantRow qa = quant_row(a);
      if (!qa.finite) {
        res.token_finite[t] = 0;
        break;
      }
      for (int64_t j = 0; j < H; ++j) da[j] = static_cast<int16_t>(qa.q[j] - qa.zp);

      for (int64_t n = 0; n < 2 * I; ++n) {
        const int64_t row = e * 2 * I + w13_row(p, n);
        h[n] = dq_dot(da.data(), qa.recip, p.w13.data() + row * H,
                      p.w13_scale.data() + row * groups13, H, g);
        if (!p.w13_bias.empty()) h[n] += static_cast<double>(p.w13_bias[row]);
      }
      for (int64_t i = 0; i < I; ++i) {
        double gate = h[i], up = h[I + i];
        if (options.swap_gate_up) std::swap(gate, up);
        const double v = activation(p.activation, gate, up, static_cast<double>(p.alpha),
                                    static_cast<double>(p.limit));
        m[i] = static_cast<float>(v);
        exact[i] = static_cast<double>(m[i]) == v;
      }

      const QuantRow qm = quant_row(m);
      if (!qm.finite) {
        res.token_finite[t] = 0;
        break;
      }
      for (int64_t i = 0; i < I; ++i) dm[i] = static_cast<int16_t>(qm.q[i] - qm.zp);
      const double weight = p.apply_router_weight_on_input ? 1.0 : static_cast<double>(r);
      for (int64_t n = 0; n < H; ++n) {
        const int64_t row = e * H + n;
        double y = dq_dot(dm.data(), qm.recip, p.w2.data() + row * I,
                          p.w2_scale.data() + row * groups2, I, g);
        if (!p.w2_bias.empty()) y += static_cast<double>(p.w2_bias[row]);
        out[n] += weight * y;
      }

      const std::vector<int64_t> near =
          near_boundary_elements(m, exact, qm, options.boundary_margin);
      res.recip_m[t * K + k] = qm.recip;
      res.near_boundary[t * K + k] = static_cast<int64_t>(near.size());
      for (const int64_t j : near)
        events.emplace_back(std::bit_cast<uint32_t>(m[static_cast<size_t>(j)]),
                            std::bit_cast<uint32_t>(qm.scale));
      for (int64_t n = 0; n < H && !near.empty(); ++n) {
        const int64_t row = e * H + n;
        double step = 0.0;
        for (const int64_t j : near)
          step += std::fabs(static_cast<double>(p.w2_scale[row * groups2 + (g < 0 ? 0 : j / g)])) *
                  std::fabs(static_cast<double>(p.w2[row * I + j]));
        res.allowance[t * H + n] += std::fabs(weight) * static_cast<double>(qm.recip) * step;
      }
    }
    if (!res.token_finite[t]) std::fill(out, out + H, std::numeric_limits<double>::quiet_NaN());
  }
  std::sort(events.begin(), events.end());
  res.near_boundary_events = std::unique(events.begin(), events.end()) - events.begin();
  return res;
}

std::vector<double> float_forward(const Problem& p) {
  check_problem(p);
  const int64_t T = p.tokens, H = p.hidden, I = p.inter, K = p.top_k;
  const int64_t g = p.group_size;
  const int64_t groups13 = g < 0 ? 1 : H / g;
  const int64_t groups2 = g < 0 ? 1 : I / g;

  std::vector<double> res(static_cast<size_t>(T * H), 0.0);
  std::vector<double> a(static_cast<size_t>(H)), h(static_cast<size_t>(2 * I)),
      m(static_cast<size_t>(I));
  for (int64_t t = 0; t < T; ++t) {
    double* out = res.data() + t * H;
    bool finite = true;
    for (int64_t j = 0; j < H; ++j) finite &= std::isfinite(p.x[t * H + j]);
    if (!finite) {
      std::fill(out, out + H, std::numeric_limits<double>::quiet_NaN());
      continue;
    }
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = p.ids[t * K + k];
      const auto r = static_cast<double>(p.topk_weights[t * K + k]);
      for (int64_t j = 0; j < H; ++j)
        a[j] = static_cast<double>(p.x[t * H + w13_input(p, e, j)]) *
               (p.apply_router_weight_on_input ? r : 1.0);
      for (int64_t n = 0; n < 2 * I; ++n) {
        const int64_t row = e * 2 * I + w13_row(p, n);
        h[n] =
            float_dot(a.data(), p.w13.data() + row * H, p.w13_scale.data() + row * groups13, H, g);
        if (!p.w13_bias.empty()) h[n] += static_cast<double>(p.w13_bias[row]);
      }
      for (int64_t i = 0; i < I; ++i)
        m[i] = activation(p.activation, h[i], h[I + i], static_cast<double>(p.alpha),
                          static_cast<double>(p.limit));
      for (int64_t n = 0; n < H; ++n) {
        const int64_t row = e * H + n;
        double y =
            float_dot(m.data(), p.w2.data() + row * I, p.w2_scale.data() + row * groups2, I, g);
        if (!p.w2_bias.empty()) y += static_cast<double>(p.w2_bias[row]);
        out[n] += p.apply_router_weight_on_input ? y : r * y;
      }
    }
  }
  return res;
}

std::vector<double> exact_linear(std::span<const float> x, int64_t tokens, int64_t cols,
                                 std::span<const int8_t> w, std::span<const float> scale,
                                 int64_t rows, int group_size, std::span<const float> bias) {
  const int64_t g = group_size < 0 ? cols : group_size;
  const int64_t groups = cols / g;
  if (g < 1 || cols % g != 0 || static_cast<int64_t>(x.size()) != tokens * cols ||
      static_cast<int64_t>(w.size()) != rows * cols ||
      static_cast<int64_t>(scale.size()) != rows * groups ||
      (!bias.empty() && static_cast<int64_t>(bias.size()) != rows))
    throw std::invalid_argument("moe_ref: exact_linear: sizes do not fit");
  std::vector<double> out(static_cast<size_t>(tokens * rows));
  for (int64_t t = 0; t < tokens; ++t) {
    const QuantRow r = quant_row(x.subspan(static_cast<size_t>(t * cols), static_cast<size_t>(cols)));
    for (int64_t n = 0; n < rows; ++n) {
      double y = 0.0;
      for (int64_t b = 0; b < groups; ++b) {
        int64_t sum = 0;  // exact
        for (int64_t k = b * g; k < (b + 1) * g; ++k)
          sum += static_cast<int64_t>(r.q[static_cast<size_t>(k)] - r.zp) * w[static_cast<size_t>(n * cols + k)];
        y += static_cast<double>(scale[static_cast<size_t>(n * groups + b)]) * static_cast<double>(sum);
      }
      y = y * static_cast<double>(r.recip) + (bias.empty() ? 0.0 : static_cast<double>(bias[static_cast<size_t>(n)]));
      out[static_cast<size_t>(t * rows + n)] = r.finite ? y : std::nan("");
    }
  }
  return out;
}

}  // namespace moe_ref
