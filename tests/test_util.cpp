#include "test_util.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <iterator>
#include <numeric>
#include <sstream>

namespace moe_test {

using w4a8moe::TensorView;

// ---- Rng --------------------------------------------------------------------------------------

Rng::Rng(uint64_t seed) {
  uint64_t z = seed;
  for (uint64_t& s : state_) {  // splitmix64
    z += 0x9e3779b97f4a7c15ull;
    uint64_t v = z;
    v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ull;
    v = (v ^ (v >> 27)) * 0x94d049bb133111ebull;
    s = v ^ (v >> 31);
  }
}

uint64_t Rng::next() {  // xoshiro256**
  const auto rotl = [](uint64_t x, int k) { return (x << k) | (x >> (64 - k)); };
  const uint64_t result = rotl(state_[1] * 5, 7) * 9;
  const uint64_t t = state_[1] << 17;
  state_[2] ^= state_[0];
  state_[3] ^= state_[1];
  state_[1] ^= state_[2];
  state_[0] ^= state_[3];
  state_[2] ^= t;
  state_[3] = rotl(state_[3], 45);
  return result;
}

double Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1p-53; }

double Rng::uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }

double Rng::normal() {                // Box-Muller
  const double u1 = 1.0 - uniform();  // (0, 1]
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * 3.14159265358979323846 * u2);
}

int64_t Rng::integer(int64_t lo, int64_t hi) {
  return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1));
}

// ---- description ------------------------------------------------------------------------------

namespace {

const char* routing_name(Routing r) {
  static constexpr const char* kNames[] = {"random", "repeated", "skewed", "sparse",
                                           "all_experts"};  // by Routing code
  const auto code = static_cast<size_t>(r);
  return code < std::size(kNames) ? kNames[code] : "?";
}

}  // namespace

std::string describe(const CaseSpec& s) {
  std::ostringstream o;
  o << "T=" << s.tokens << " H=" << s.hidden << " I=" << s.inter << " E=" << s.experts
    << " K=" << s.top_k << " g=" << s.group_size << " x=" << w4a8moe::dtype_name(s.x_dtype)
    << " scale=" << w4a8moe::dtype_name(s.scale_dtype)
    << " topk_w=" << w4a8moe::dtype_name(s.topk_weights_dtype)
    << " ids=" << w4a8moe::dtype_name(s.ids_dtype)
    << " act=" << w4a8moe::activation_name(s.activation);
  if (s.alpha != 1.702f || s.limit != 7.0f)
    o << "(alpha=" << s.alpha << ",limit=" << s.limit << ")";
  if (s.bias) o << " bias=" << w4a8moe::dtype_name(s.bias_dtype);
  if (s.apply_router_weight_on_input) o << " on_input";
  if (s.interleaved) o << " interleaved";
  if (s.nibbles) o << " nibbles";
  if (s.mxfp4) o << " mxfp4";
  if (s.zero_points) o << " zero_points";
  if (s.input_order) o << " input_order";
  if (s.weight_values == WeightValues::extremes) o << " w=extremes";
  if (s.x_stride_extra != 0) o << " x_stride=H+" << s.x_stride_extra;
  o << " routing=" << routing_name(s.routing) << " seed=" << s.seed;
  return o.str();
}

// ---- tensors ----------------------------------------------------------------------------------

FloatTensor make_float_tensor(const std::vector<float>& values, DType dtype) {
  FloatTensor t;
  t.dtype = dtype;
  if (dtype == DType::f32) {
    t.values = values;
    t.bytes.resize(values.size() * 4);
    std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
    return t;
  }
  t.bytes.resize(values.size() * 2);
  t.values.reserve(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t h =
        dtype == DType::bf16 ? moe_ref::f32_to_bf16(values[i]) : moe_ref::f32_to_f16(values[i]);
    std::memcpy(t.bytes.data() + 2 * i, &h, 2);
    t.values.push_back(dtype == DType::bf16 ? moe_ref::bf16_to_f32(h) : moe_ref::f16_to_f32(h));
  }
  return t;
}

float to_float(const void* data, DType dtype, int64_t i) {
  const auto* p = static_cast<const uint8_t*>(data);
  if (dtype == DType::f32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return dtype == DType::bf16 ? moe_ref::bf16_to_f32(h) : moe_ref::f16_to_f32(h);
}

std::vector<uint8_t> to_nibbles(const std::vector<int8_t>& values) {
  std::vector<uint8_t> out(values.size() / 2);
  for (size_t j = 0; j < out.size(); ++j)
    out[j] = static_cast<uint8_t>((values[2 * j] + 8) | ((values[2 * j + 1] + 8) << 4));
  return out;
}

// ---- cases ------------------------------------------------------------------------------------

namespace {

std::vector<int64_t> make_ids(const CaseSpec& s, Rng& rng) {
  const int64_t T = s.tokens, K = s.top_k, E = s.experts;
  std::vector<int64_t> ids(static_cast<size_t>(T * K));
  std::vector<int64_t> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    int64_t* row = ids.data() + t * K;
    // pool of candidates for distinct draws, and the slots already fixed
    int64_t pool = E, first = 0;
    std::iota(perm.begin(), perm.end(), 0);
    switch (s.routing) {
      case Routing::repeated:
        for (int64_t k = 0; k < K; ++k) row[k] = rng.integer(0, E - 1);
        if (t == 0) std::fill(row, row + K, row[0]);
        continue;
      case Routing::skewed:
        row[0] = E - 1;
        pool = E - 1;
        first = 1;
        break;
      case Routing::sparse:
        pool = E / 2;
        break;
      case Routing::random:
      case Routing::all_experts:
        break;
    }
    for (int64_t k = first; k < K; ++k) {  // partial Fisher-Yates over perm[0, pool)
      const int64_t pick = rng.integer(k - first, pool - 1);
      std::swap(perm[k - first], perm[pick]);
      row[k] = perm[k - first];
    }
  }
  return ids;
}

std::vector<int8_t> make_int4(size_t n, WeightValues kind, Rng& rng) {
  std::vector<int8_t> w(n);
  for (int8_t& v : w)
    v = static_cast<int8_t>(kind == WeightValues::extremes ? (rng.next() & 1 ? 7 : -8)
                                                           : rng.integer(-8, 7));
  return w;
}

// Scales ~ U(0.5, 1.5) / (4 sqrt(K)): with x ~ N(0, 1) and int4 uniform (rms 4.6) the dot
// products, the intermediate and the output are all of order one.
std::vector<float> make_scales(size_t n, int64_t cols, Rng& rng) {
  std::vector<float> s(n);
  const double base = 1.0 / (4.0 * std::sqrt(static_cast<double>(cols)));
  for (float& v : s) v = static_cast<float>(rng.uniform(0.5, 1.5) * base);
  return s;
}

// 2 * e2m1(code) for the 16 codes of OCP MX FP4 (0, 0.5, 1, 1.5, 2, 3, 4, 6, then negated).
constexpr int8_t kE2m1Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Random codes for as many elements as `values` holds, nibble-packed (element 2j low); `values`
// becomes their meaning, 2 * e2m1 (an integer in [-12, 12]).
std::vector<uint8_t> make_mxfp4(std::vector<int8_t>& values, Rng& rng) {
  std::vector<uint8_t> codes(values.size() / 2, 0);
  for (size_t i = 0; i < values.size(); ++i) {
    const auto code = static_cast<uint8_t>(rng.integer(0, 15));
    codes[i / 2] |= static_cast<uint8_t>(i % 2 == 0 ? code : code << 4);
    values[i] = kE2m1Doubled[code];
  }
  return codes;
}

// e8m0 exponents e with 2^(e - 128) (the scale of the doubled values) the power of two nearest
// the drawn scale; the scales become exactly those powers of two (in f32, the reference's).
std::vector<uint8_t> mxfp4_exponents(FloatTensor& scales) {
  std::vector<uint8_t> e(scales.values.size());
  for (size_t i = 0; i < e.size(); ++i) {
    const int ex = std::clamp(
        static_cast<int>(std::lround(std::log2(static_cast<double>(scales.values[i])))) + 128, 0,
        254);
    e[i] = static_cast<uint8_t>(ex);
    scales.values[i] = std::ldexp(1.0f, ex - 128);
  }
  return e;
}

// Zero points in [-8, 7], one per row and group of `values` [rows, cols]; `values` becomes
// w - z, what the weights mean without their scales.
std::vector<int8_t> make_zero_points(std::vector<int8_t>& values, size_t rows, size_t groups,
                                     Rng& rng) {
  std::vector<int8_t> z(rows * groups);
  for (int8_t& v : z) v = static_cast<int8_t>(rng.integer(-8, 7));
  const size_t cols = values.size() / rows, group_len = cols / groups;
  for (size_t i = 0; i < values.size(); ++i)
    values[i] = static_cast<int8_t>(values[i] - z[i / cols * groups + i % cols / group_len]);
  return z;
}

std::vector<float> make_uniform(size_t n, double lo, double hi, Rng& rng) {
  std::vector<float> v(n);
  for (float& f : v) f = static_cast<float>(rng.uniform(lo, hi));
  return v;
}

}  // namespace

Case make_case(const CaseSpec& spec) {
  Case c;
  c.spec = spec;
  CaseSpec& s = c.spec;
  if (s.routing == Routing::all_experts) s.top_k = s.experts;
  const int64_t T = s.tokens, H = s.hidden, I = s.inter, E = s.experts, K = s.top_k;
  const int64_t g = s.group_size;
  Rng rng(s.seed);

  // x [T, H] ~ N(0, 1), stored with row stride H + extra; the padding holds NaN
  c.x_stride = H + s.x_stride_extra;
  std::vector<float> x(static_cast<size_t>(T * c.x_stride), std::nanf(""));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < H; ++j) x[t * c.x_stride + j] = static_cast<float>(rng.normal());
  c.x = make_float_tensor(x, s.x_dtype);

  // routing: ids and positive weights that sum to one per token
  const std::vector<int64_t> ids = make_ids(s, rng);
  if (s.ids_dtype == DType::i64) {
    c.ids.resize(ids.size() * 8);
    std::memcpy(c.ids.data(), ids.data(), c.ids.size());
  } else {
    c.ids.resize(ids.size() * 4);
    for (size_t i = 0; i < ids.size(); ++i) {
      const auto v = static_cast<int32_t>(ids[i]);
      std::memcpy(c.ids.data() + 4 * i, &v, 4);
    }
  }
  std::vector<float> tw(static_cast<size_t>(T * K));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> raw(static_cast<size_t>(K));
    for (double& v : raw) v = rng.uniform(0.2, 1.0);
    const double sum = std::accumulate(raw.begin(), raw.end(), 0.0);
    for (int64_t k = 0; k < K; ++k) tw[t * K + k] = static_cast<float>(raw[k] / sum);
  }
  c.topk_weights = make_float_tensor(tw, s.topk_weights_dtype);

  // weights, scales, biases
  const size_t g13 = g < 0 ? 1 : static_cast<size_t>(H / g);
  const size_t g2 = g < 0 ? 1 : static_cast<size_t>(I / g);
  const auto rows13 = static_cast<size_t>(E * 2 * I), rows2 = static_cast<size_t>(E * H);
  c.w13 = make_int4(rows13 * static_cast<size_t>(H), s.weight_values, rng);
  c.w2 = make_int4(rows2 * static_cast<size_t>(I), s.weight_values, rng);
  c.w13_scale = make_float_tensor(make_scales(rows13 * g13, H, rng), s.scale_dtype);
  c.w2_scale = make_float_tensor(make_scales(rows2 * g2, I, rng), s.scale_dtype);
  if (s.bias) {
    c.w13_bias = make_float_tensor(make_uniform(rows13, -0.5, 0.5, rng), s.bias_dtype);
    c.w2_bias = make_float_tensor(make_uniform(rows2, -0.5, 0.5, rng), s.bias_dtype);
  }
  if (s.nibbles) {
    c.w13_nibbles = to_nibbles(c.w13);
    c.w2_nibbles = to_nibbles(c.w2);
  }
  // the views give the values and the zero points, the reference their meaning w - z
  std::vector<int8_t> w13_meaning = c.w13, w2_meaning = c.w2;
  if (s.zero_points) {
    c.w13_zero_point = make_zero_points(w13_meaning, rows13, g13, rng);
    c.w2_zero_point = make_zero_points(w2_meaning, rows2, g2, rng);
  }
  if (s.mxfp4) {
    c.w13_nibbles = make_mxfp4(c.w13, rng);
    c.w2_nibbles = make_mxfp4(c.w2, rng);
    c.w13_exponents = mxfp4_exponents(c.w13_scale);
    c.w2_exponents = mxfp4_exponents(c.w2_scale);
  }

  const int group = static_cast<int>(g);
  c.problem = {.tokens = T, .hidden = H, .inter = I, .experts = E, .top_k = K, .group_size = group};
  moe_ref::Problem& p = c.problem;
  p.x.resize(static_cast<size_t>(T * H));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < H; ++j) p.x[t * H + j] = c.x.values[t * c.x_stride + j];
  p.ids = ids;
  p.topk_weights = c.topk_weights.values;
  p.interleaved = s.interleaved;
  p.mxfp4_values = s.mxfp4;
  p.zero_point_values = s.zero_points;
  p.w13 = s.zero_points ? w13_meaning : c.w13;
  p.w13_scale = c.w13_scale.values;
  p.w13_bias = c.w13_bias.values;
  p.w2 = s.zero_points ? w2_meaning : c.w2;
  p.w2_scale = c.w2_scale.values;
  p.w2_bias = c.w2_bias.values;
  p.activation = static_cast<int>(s.activation);
  p.alpha = s.alpha;
  p.limit = s.limit;
  p.apply_router_weight_on_input = s.apply_router_weight_on_input;
  if (s.input_order) {  // a generator of its own: the other tensors are those of the same spec
    Rng order_rng(s.seed ^ 0x5eedu);
    c.w13_input_order.resize(static_cast<size_t>(E * H));
    for (int64_t e = 0; e < E; ++e) {  // Fisher-Yates
      int32_t* row = c.w13_input_order.data() + e * H;
      std::iota(row, row + H, 0);
      for (int64_t i = H - 1; i > 0; --i) std::swap(row[i], row[order_rng.integer(0, i)]);
    }
    p.w13_input_order = c.w13_input_order;
  }
  return c;
}

void Case::set_x(int64_t t, int64_t j, float value) {
  const FloatTensor one = make_float_tensor({value}, x.dtype);
  const size_t bytes = w4a8moe::dtype_bytes(x.dtype);
  const auto i = static_cast<size_t>(t * x_stride + j);
  std::memcpy(x.bytes.data() + i * bytes, one.bytes.data(), bytes);
  x.values[i] = one.values[0];
  problem.x[static_cast<size_t>(t * spec.hidden + j)] = one.values[0];
}

TensorView Case::x_view() const {
  return TensorView::of(x.bytes.data(), x.dtype, {spec.tokens, spec.hidden}, x_stride);
}
TensorView Case::ids_view() const {
  return TensorView::of(ids.data(), spec.ids_dtype, {spec.tokens, spec.top_k});
}
TensorView Case::topk_weights_view() const {
  return TensorView::of(topk_weights.bytes.data(), topk_weights.dtype, {spec.tokens, spec.top_k});
}
TensorView Case::w13_view() const {
  const int64_t E = spec.experts, I = spec.inter, H = spec.hidden;
  if (spec.nibbles || spec.mxfp4)
    return TensorView::of(w13_nibbles.data(), DType::u8, {E, 2 * I, H / 2});
  return TensorView::of(w13.data(), DType::i8, {E, 2 * I, H});
}
TensorView Case::w2_view() const {
  const int64_t E = spec.experts, I = spec.inter, H = spec.hidden;
  if (spec.nibbles || spec.mxfp4)
    return TensorView::of(w2_nibbles.data(), DType::u8, {E, H, I / 2});
  return TensorView::of(w2.data(), DType::i8, {E, H, I});
}
TensorView Case::w13_zero_point_view() const {
  if (!spec.zero_points) return {};
  const int64_t E = spec.experts, I = spec.inter, H = spec.hidden, g = spec.group_size;
  if (g < 0) return TensorView::of(w13_zero_point.data(), DType::i8, {E, 2 * I});
  return TensorView::of(w13_zero_point.data(), DType::i8, {E, 2 * I, H / g});
}
TensorView Case::w2_zero_point_view() const {
  if (!spec.zero_points) return {};
  const int64_t E = spec.experts, I = spec.inter, H = spec.hidden, g = spec.group_size;
  if (g < 0) return TensorView::of(w2_zero_point.data(), DType::i8, {E, H});
  return TensorView::of(w2_zero_point.data(), DType::i8, {E, H, I / g});
}
TensorView Case::w13_scale_view() const {
  const int64_t E = spec.experts, I = spec.inter, H = spec.hidden, g = spec.group_size;
  if (spec.mxfp4) return TensorView::of(w13_exponents.data(), DType::u8, {E, 2 * I, H / 32});
  if (g < 0) return TensorView::of(w13_scale.bytes.data(), w13_scale.dtype, {E, 2 * I});
  return TensorView::of(w13_scale.bytes.data(), w13_scale.dtype, {E, 2 * I, H / g});
}
TensorView Case::w2_scale_view() const {
  const int64_t E = spec.experts, I = spec.inter, H = spec.hidden, g = spec.group_size;
  if (spec.mxfp4) return TensorView::of(w2_exponents.data(), DType::u8, {E, H, I / 32});
  if (g < 0) return TensorView::of(w2_scale.bytes.data(), w2_scale.dtype, {E, H});
  return TensorView::of(w2_scale.bytes.data(), w2_scale.dtype, {E, H, I / g});
}
TensorView Case::w13_bias_view() const {
  if (!spec.bias) return {};
  return TensorView::of(w13_bias.bytes.data(), w13_bias.dtype, {spec.experts, 2 * spec.inter});
}
TensorView Case::w2_bias_view() const {
  if (!spec.bias) return {};
  return TensorView::of(w2_bias.bytes.data(), w2_bias.dtype, {spec.experts, spec.hidden});
}

namespace {

w4a8moe::GateUpLayout gate_up_layout(const CaseSpec& s) {
  return s.interleaved ? w4a8moe::GateUpLayout::interleaved : w4a8moe::GateUpLayout::halves;
}

}  // namespace

w4a8moe::PackOptions Case::pack_options() const {
  w4a8moe::PackOptions o;
  o.group_size = spec.group_size;
  o.gate_up_layout = gate_up_layout(spec);
  if (spec.mxfp4) o.weight_format = w4a8moe::WeightFormat::mxfp4;
  if (spec.zero_points) o.weight_format = w4a8moe::WeightFormat::int4_zero_point;
  if (spec.input_order)
    o.input_order = TensorView::of(w13_input_order.data(), DType::i32, {spec.experts, spec.hidden});
  return o;
}

w4a8moe::LogicalWeights Case::logical() const {
  return {.w13 = w13_view(),
          .w13_scale = w13_scale_view(),
          .w13_bias = w13_bias_view(),
          .w2 = w2_view(),
          .w2_scale = w2_scale_view(),
          .w2_bias = w2_bias_view(),
          .w13_zero_point = w13_zero_point_view(),
          .w2_zero_point = w2_zero_point_view(),
          .w13_input_order = pack_options().input_order,
          .group_size = spec.group_size,
          .gate_up_layout = gate_up_layout(spec),
          .weight_format = pack_options().weight_format};
}

w4a8moe::MoeParams Case::params() const {
  w4a8moe::MoeParams m;
  m.activation = spec.activation;
  m.alpha = spec.alpha;
  m.limit = spec.limit;
  m.apply_router_weight_on_input = spec.apply_router_weight_on_input;
  return m;
}

PackedPair pack(const Case& c, const std::string& kernel_set) {
  PackedPair p;
  w4a8moe::PackOptions o = c.pack_options();
  o.kernel_set = kernel_set;
  p.w13 = w4a8moe::pack_w13(c.w13_view(), c.w13_scale_view(), c.w13_zero_point_view(),
                            c.w13_bias_view(), o);
  o.gate_up_layout = w4a8moe::GateUpLayout::halves;
  o.input_order = {};  // w13's only
  p.w2 =
      w4a8moe::pack_w2(c.w2_view(), c.w2_scale_view(), c.w2_zero_point_view(), c.w2_bias_view(), o);
  return p;
}

// ---- outputs ----------------------------------------------------------------------------------

w4a8moe::MutableTensorView Output::view() {
  return w4a8moe::MutableTensorView::of(bytes.data(), dtype, {rows, cols});
}

std::vector<float> Output::to_float() const {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = moe_test::to_float(bytes.data(), dtype, static_cast<int64_t>(i));
  return out;
}

Output make_output(const Case& c) {
  Output o;
  o.dtype = c.spec.x_dtype;
  o.rows = c.spec.tokens;
  o.cols = c.spec.hidden;
  // all-ones bytes are NaN in f32, bf16 and f16
  o.bytes.assign(static_cast<size_t>(o.rows * o.cols) * w4a8moe::dtype_bytes(o.dtype), 0xff);
  return o;
}

Output run_forward(const Case& c, const PackedPair& packed, w4a8moe::Context& context) {
  Output o = make_output(c);
  w4a8moe::forward(context, c.x_view(), c.ids_view(), c.topk_weights_view(), packed.w13.bytes(),
                   packed.w2.bytes(), c.params(), o.view());
  return o;
}

Output run_library_reference(const Case& c) { return run_library_reference(c, c.logical()); }

Output run_library_reference(const Case& c, const w4a8moe::LogicalWeights& weights) {
  Output o = make_output(c);
  w4a8moe::reference_forward(c.x_view(), c.ids_view(), c.topk_weights_view(), weights, c.params(),
                             o.view());
  return o;
}

// ---- comparisons ------------------------------------------------------------------------------

testing::AssertionResult matches_exact(const Case& c, const std::vector<float>& got,
                                       const moe_ref::ExactResult& ref, const ExactCheck& check) {
  const int64_t T = c.spec.tokens, H = c.spec.hidden, I = c.spec.inter;
  if (got.size() != ref.out.size())
    return testing::AssertionFailure() << "size " << got.size() << " vs " << ref.out.size();

  const int64_t near =
      std::accumulate(ref.near_boundary.begin(), ref.near_boundary.end(), int64_t{0});
  const int64_t events = ref.near_boundary_events;
  const double max_events =
      kMaxNearFraction * static_cast<double>(ref.intermediate_elements) + kNearSlack;
  if (static_cast<double>(events) > max_events)
    return testing::AssertionFailure()
           << events << " distinct intermediate values of " << ref.intermediate_elements
           << " elements are near a rounding boundary (more than " << kMaxNearFraction
           << " of them + " << kNearSlack
           << "): the data would make the requantization allowance meaningless";

  double max_abs = 0.0;
  for (int64_t t = 0; t < T; ++t)
    if (ref.token_finite[t])
      for (int64_t n = 0; n < H; ++n) max_abs = std::max(max_abs, std::fabs(ref.out[t * H + n]));
  if (check.check_magnitude && !(max_abs >= 0.1 && max_abs <= 100.0))
    return testing::AssertionFailure()
           << "the reference output has max |ref| = " << max_abs
           << ", outside [0.1, 100]: the test data must give outputs of order one";

  const DType dt = c.spec.x_dtype;
  const double u = dt == DType::bf16 ? 0x1p-8 : dt == DType::f16 ? 0x1p-11 : 0.0;
  const double u_abs = dt == DType::f16 ? 0x1p-25 : 0.0;
  const double rtol = check.rtol_per_sqrt_k * std::sqrt(static_cast<double>(H + I));

  int64_t failures = 0, used_allowance = 0;
  int64_t worst_t = -1, worst_n = -1;
  double worst_ratio = 0.0, worst_bound = 0.0, max_err = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    if (!ref.token_finite[t]) continue;
    double row_max = 0.0;
    for (int64_t n = 0; n < H; ++n) row_max = std::max(row_max, std::fabs(ref.out[t * H + n]));
    for (int64_t n = 0; n < H; ++n) {
      const size_t i = static_cast<size_t>(t * H + n);
      const double r = ref.out[i];
      const double err = std::fabs(static_cast<double>(got[i]) - r);
      const double strict = rtol * row_max * (1.0 + u) + u * std::fabs(r) + u_abs;
      const double bound = strict + ref.allowance[i] * (1.0 + u);
      max_err = std::isnan(err) ? err : std::max(max_err, err);
      if (err <= strict) continue;
      if (err <= bound) {
        ++used_allowance;
        continue;
      }
      ++failures;  // also counts NaN
      const double ratio = err / bound;
      if (worst_t < 0 || !(ratio <= worst_ratio)) {
        worst_ratio = ratio;
        worst_t = t;
        worst_n = n;
        worst_bound = bound;
      }
    }
  }
  if (failures > 0) {
    const size_t i = static_cast<size_t>(worst_t * H + worst_n);
    return testing::AssertionFailure()
           << failures << " of " << T * H << " elements exceed the tolerance; worst at token "
           << worst_t << ", column " << worst_n << ": got " << got[i] << ", reference "
           << ref.out[i] << ", |error| " << std::fabs(static_cast<double>(got[i]) - ref.out[i])
           << " > bound " << worst_bound << " (allowance " << ref.allowance[i] << "); rtol " << rtol
           << ", max |ref| " << max_abs << ", " << used_allowance
           << " elements needed the requantization allowance, " << near
           << " intermediate elements near a boundary";
  }
  return testing::AssertionSuccess()
         << "max |error| " << max_err << ", max |ref| " << max_abs << ", " << used_allowance
         << " elements within the requantization allowance";
}

testing::AssertionResult matches_float(const std::vector<float>& got,
                                       const std::vector<double>& ref, double max_nrmse,
                                       double* nrmse_out) {
  if (got.size() != ref.size())
    return testing::AssertionFailure() << "size " << got.size() << " vs " << ref.size();
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  const double nrmse = std::sqrt(num / den);
  if (nrmse_out != nullptr) *nrmse_out = nrmse;
  if (!(nrmse <= max_nrmse))
    return testing::AssertionFailure() << "normalised RMS error " << nrmse << " > " << max_nrmse;
  return testing::AssertionSuccess() << "normalised RMS error " << nrmse;
}

void expect_non_finite_only_in_row(const std::vector<float>& out, int64_t cols, int64_t bad_row) {
  for (size_t i = 0; i < out.size(); ++i) {
    const auto row = static_cast<int64_t>(i) / cols, n = static_cast<int64_t>(i) % cols;
    if (row == bad_row)
      EXPECT_TRUE(std::isnan(out[i])) << "row " << row << " element " << n;
    else
      EXPECT_TRUE(std::isfinite(out[i])) << "row " << row << " element " << n;
  }
}

testing::AssertionResult throws_error(const std::function<void()>& f,
                                      std::initializer_list<std::string_view> fragments) {
  try {
    f();
  } catch (const w4a8moe::Error& e) {
    const std::string message = e.what();
    for (const std::string_view fragment : fragments)
      if (message.find(fragment) == std::string::npos)
        return testing::AssertionFailure()
               << "the message \"" << message << "\" does not mention \"" << fragment << "\"";
    return testing::AssertionSuccess() << "threw \"" << message << "\"";
  } catch (const std::exception& e) {
    return testing::AssertionFailure() << "threw a non-w4a8moe exception: " << e.what();
  } catch (...) {
    return testing::AssertionFailure() << "threw something that is not an exception";
  }
  return testing::AssertionFailure() << "did not throw";
}

}  // namespace moe_test
