// The public reference forward: docs/operator.md written plainly over the logical (unpacked)
// weights, with integer dot products and double accumulation. It shares no code with the packer
// or the kernels (only the argument checks and the scalar f32/bf16/f16 conversions).
#include <algorithm>
#include <cmath>
#include <vector>

#include "api/validate.hpp"
#include "common/activation.hpp"
#include "common/format.hpp"
#include "common/numeric.hpp"

namespace w4a8moe {

namespace {

using detail::load_float;

struct Quantized {
  std::vector<int32_t> q;
  int32_t zp = 0;
  float recip = 1.0f;
  bool finite = true;
};

float half_even(float v) {
  const float f = std::floor(v);
  const float d = v - f;
  if (d != 0.5f) return d < 0.5f ? f : f + 1.0f;
  return std::fmod(f, 2.0f) == 0.0f ? f : f + 1.0f;
}

// quant_row (docs/operator.md, "Activation quantization"), in f32.
Quantized quant_row(const std::vector<float>& a) {
  Quantized r;
  float mn = 0.0f, mx = 0.0f;
  for (float v : a) {
    if (!std::isfinite(v)) r.finite = false;
    mn = std::min(mn, v);
    mx = std::max(mx, v);
  }
  r.q.assign(a.size(), 0);
  if (!r.finite) {
    r.recip = NAN;
    return r;
  }
  float s = (mx == mn) ? 1.0f : 255.0f / (mx - mn);
  if (!(s <= 3.4028234e38f)) s = 1.0f;  // denormal-size range: quantize to zero, no NaN
  r.recip = 1.0f / s;
  const float zf0 =
      (-128.0f + mn * s) + (127.0f + mx * s) > 0.0f ? (-128.0f - mn * s) : (127.0f - mx * s);
  const float zf = std::min(127.0f, std::max(-128.0f, zf0));
  r.zp = static_cast<int32_t>(half_even(zf));
  for (size_t k = 0; k < a.size(); ++k) {
    const float v = std::round(a[k] * s) + static_cast<float>(r.zp);
    r.q[k] = static_cast<int32_t>(std::min(127.0f, std::max(-128.0f, v)));
  }
  return r;
}

struct Matrix {  // one role's logical weights
  const TensorView* w;
  const TensorView* scale;
  const TensorView* zero_point;  // int4_zero_point only
  const TensorView* bias;
  detail::WeightInput in;
  int group_size;
  WeightFormat format;

  // OCP MX FP4 (E2M1): sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is
  // subnormal (0 or 0.5).
  static double e2m1(uint8_t code) {
    const int exponent = (code >> 1) & 3, mantissa = code & 1;
    const double magnitude =
        exponent == 0 ? 0.5 * mantissa : std::ldexp(1.0 + 0.5 * mantissa, exponent - 1);
    return (code & 8) != 0 ? -magnitude : magnitude;
  }

  // The element's value without its scale: int4, the integer; mxfp4, e2m1 of the code.
  double value(int64_t e, int64_t n, int64_t k) const {
    if (format == WeightFormat::mxfp4) {
      const uint8_t byte =
          static_cast<const uint8_t*>(w->data)[(e * in.rows + n) * (in.cols / 2) + k / 2];
      return e2m1(k % 2 == 0 ? (byte & 0x0f) : (byte >> 4));
    }
    if (in.nibbles) {
      const uint8_t byte =
          static_cast<const uint8_t*>(w->data)[(e * in.rows + n) * (in.cols / 2) + k / 2];
      return (k % 2 == 0 ? (byte & 0x0f) : (byte >> 4)) - 8;
    }
    return static_cast<const int8_t*>(w->data)[(e * in.rows + n) * in.cols + k];
  }

  // recip * SUM_b s[n,b] * SUM_{k in b} (q[k] - zp) * w[n,k] + bias[n]
  double dq_dot(const Quantized& a, int64_t e, int64_t n) const {
    const int64_t g = group_size < 0 ? in.cols : group_size;
    double sum = 0.0;
    for (int64_t b = 0; b < in.cols / g; ++b) {
      const int64_t index = (e * in.rows + n) * in.groups + b;
      double z = 0.0;  // (w - z) * s: the zero point of the group
      if (format == WeightFormat::int4_zero_point) {
        z = static_cast<const int8_t*>(zero_point->data)[index];
        if (z < -8 || z > 7)
          throw Error(detail::cat("weight zero points: expected int4 values in [-8, 7], got ", z,
                                  " at [", e, ", ", n, ", ", b, "]"));
      }
      double dot = 0.0;  // exact: integers, or mxfp4's halves, below 2^53
      for (int64_t k = b * g; k < (b + 1) * g; ++k) dot += (a.q[k] - a.zp) * (value(e, n, k) - z);
      double s;
      if (format == WeightFormat::mxfp4) {  // e8m0: 2^(e - 127), 255 is NaN
        const int exponent = static_cast<const uint8_t*>(scale->data)[index];
        if (exponent == 255)
          throw Error(
              detail::cat("weight scales: expected e8m0 exponents in [0, 254], got 255 "
                          "(NaN) at [",
                          e, ", ", n, ", ", b, "]"));
        s = std::ldexp(1.0, exponent - 127);
      } else {
        s = static_cast<double>(load_float(scale->data, scale->dtype, index));
      }
      sum += s * dot;
    }
    double out = static_cast<double>(a.recip) * sum;
    if (!bias->empty())
      out += static_cast<double>(load_float(bias->data, bias->dtype, e * in.rows + n));
    return out;
  }
};

}  // namespace

void reference_forward(const TensorView& x, const TensorView& topk_ids,
                       const TensorView& topk_weights, const LogicalWeights& lw,
                       const MoeParams& params, const MutableTensorView& out) {
  using detail::cat;
  detail::require_expert_format(lw.weight_format, "LogicalWeights::weight_format");
  Matrix w13{&lw.w13, &lw.w13_scale, &lw.w13_zero_point, &lw.w13_bias,
             {},      lw.group_size, lw.weight_format};
  Matrix w2{&lw.w2, &lw.w2_scale,  &lw.w2_zero_point, &lw.w2_bias,
            {},     lw.group_size, lw.weight_format};
  w13.in = detail::check_weight_input(lw.w13, lw.w13_scale, lw.w13_zero_point, lw.w13_bias,
                                      lw.group_size, "w13", "w13_scale", "w13_zero_point",
                                      "w13_bias", lw.weight_format);
  w2.in =
      detail::check_weight_input(lw.w2, lw.w2_scale, lw.w2_zero_point, lw.w2_bias, lw.group_size,
                                 "w2", "w2_scale", "w2_zero_point", "w2_bias", lw.weight_format);
  if (!is_valid_w13_rows(w13.in.rows))
    throw Error(cat("w13: expected an even number of rows (2I), got ", w13.in.rows));
  const int64_t E = w13.in.experts, H = w13.in.cols, I = w13.in.rows / 2;
  if (w2.in.experts != E || w2.in.rows != H || w2.in.cols != I)
    throw Error(cat("w2: expected ", E, " experts of [", H, ", ", I, "] to match w13, got ",
                    w2.in.experts, " experts of [", w2.in.rows, ", ", w2.in.cols, "]"));
  const detail::ForwardShape s =
      detail::check_forward_logical(x, topk_ids, topk_weights, E, H, I, params, out);
  const bool interleaved = lw.gate_up_layout == GateUpLayout::interleaved;
  detail::check_input_order(lw.w13_input_order, WeightRole::w13, E, H, "w13_input_order");
  const auto* order = static_cast<const int32_t*>(lw.w13_input_order.data);

  std::vector<float> a(static_cast<size_t>(H)), m(static_cast<size_t>(I));
  std::vector<double> acc(static_cast<size_t>(H));
  for (int64_t t = 0; t < s.tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t k = 0; k < s.top_k; ++k) {
      const int64_t e = detail::load_index(topk_ids.data, topk_ids.dtype, t * s.top_k + k);
      const float r = load_float(topk_weights.data, topk_weights.dtype, t * s.top_k + k);
      for (int64_t h = 0; h < H; ++h) {  // column h of w13 multiplies input order[e, h]
        const int64_t input = order != nullptr ? order[e * H + h] : h;
        const float v = load_float(x.data, x.dtype, t * x.stride() + input);
        a[static_cast<size_t>(h)] = params.apply_router_weight_on_input ? v * r : v;
      }
      const Quantized qa = quant_row(a);
      for (int64_t i = 0; i < I; ++i) {
        const int64_t gate_row = interleaved ? 2 * i : i;
        const int64_t up_row = interleaved ? 2 * i + 1 : I + i;
        m[static_cast<size_t>(i)] = static_cast<float>(
            detail::activation_f64(params, w13.dq_dot(qa, e, gate_row), w13.dq_dot(qa, e, up_row)));
      }
      const Quantized qm = quant_row(m);
      const double weight = params.apply_router_weight_on_input ? 1.0 : static_cast<double>(r);
      for (int64_t h = 0; h < H; ++h) acc[static_cast<size_t>(h)] += weight * w2.dq_dot(qm, e, h);
    }
    for (int64_t h = 0; h < H; ++h)
      detail::store_float(out.data, out.dtype, t * out.stride() + h,
                          static_cast<float>(acc[static_cast<size_t>(h)]));
  }
}

}  // namespace w4a8moe
