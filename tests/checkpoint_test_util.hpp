// Helpers of the checkpoint suites: a temporary folder, the logical weights a loader
// hands to the packer (decoded back to int4 values and float scales), and the end-to-end check of
// one layer: route with the library, route independently, run forward(), compare with the
// independent exact and float references (tests/reference).
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "checkpoint_writers.hpp"
#include "common/numeric.hpp"
#include "io/checkpoint.hpp"
#include "pack/packed_format.hpp"
#include "reference/reference.hpp"
#include "w4a8moe/routing.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace ckpt_test {

class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "w4a8moe_ckpt_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// The message of the Error `f` throws ("(no error)" if none).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const w4a8moe::Error& e) {
    return e.what();
  }
  return "(no error)";
}

// The message of opening layer `layer` of `path` with `options` and require_exact set.
inline std::string exact_error(const std::string& path, int layer,
                               w4a8moe::io::LoadOptions options = {}) {
  options.require_exact = true;
  return error_of([&] { w4a8moe::io::open_layer(path, layer, options); });
}

// Layer `layer` of `path` opened with require_exact set (what `layer --exact` asks for).
inline std::unique_ptr<w4a8moe::io::LayerSource> open_exact(const std::string& path, int layer) {
  w4a8moe::io::LoadOptions options;
  options.require_exact = true;
  return w4a8moe::io::open_layer(path, layer, options);
}

// Every expert as loaded: int4 values [E, 2I, H] / [E, H, I], scales as floats, biases.
struct Loaded {
  std::vector<int8_t> w13, w2;
  std::vector<float> w13_s, w2_s, b13, b2;
  std::vector<uint8_t> w13_nibbles, w2_nibbles;  // as loaded
  std::vector<uint8_t> w13_scale_bytes, w2_scale_bytes;
  // int4 with zero points: the zero points as loaded, and w13 / w2 above hold value - z (the
  // reference's form, moe_ref::Problem::zero_point_values)
  std::vector<int8_t> w13_z, w2_z;
  std::vector<int32_t> w13_order;  // act-order: [E, H] as loaded (w13 columns' inputs)
};

inline Loaded load_all(const w4a8moe::io::LayerSource& source) {
  const w4a8moe::io::LayerInfo& info = source.info();
  const int64_t E = info.experts;
  w4a8moe::io::ExpertChunk chunk(info, E);
  for (int64_t e = 0; e < E; ++e) source.load_expert(e, chunk.slot(e));
  Loaded out;
  // int4: nibble - 8 with float scales; mxfp4 (the codes and e8m0 exponents as loaded): the
  // integers 2 * e2m1(code) with scales 2^(e - 128), the reference's form of them
  // (moe_ref::Problem::mxfp4_values), from the writers' own e2m1 decoding
  const auto value_of = [](w4a8moe::WeightFormat format, int nibble) {
    return static_cast<int8_t>(format == w4a8moe::WeightFormat::mxfp4 ? 2 * e2m1_value(nibble)
                                                                      : nibble - 8);
  };
  const auto unpack = [&](const w4a8moe::TensorView& v, w4a8moe::WeightFormat format,
                          std::vector<int8_t>& values, std::vector<uint8_t>& bytes) {
    const int64_t n = v.shape[0] * v.shape[1] * v.shape[2];
    const auto* p = static_cast<const uint8_t*>(v.data);
    bytes.assign(p, p + n);
    values.resize(static_cast<size_t>(2 * n));
    for (int64_t j = 0; j < n; ++j) {
      values[static_cast<size_t>(2 * j)] = value_of(format, p[j] & 15);
      values[static_cast<size_t>(2 * j + 1)] = value_of(format, p[j] >> 4);
    }
  };
  const auto floats = [](const w4a8moe::TensorView& v, w4a8moe::WeightFormat format,
                         std::vector<float>& values, std::vector<uint8_t>* bytes) {
    if (v.empty()) return;
    const int64_t n = v.numel();
    values.resize(static_cast<size_t>(n));
    const auto* p = static_cast<const uint8_t*>(v.data);
    for (int64_t i = 0; i < n; ++i)
      values[static_cast<size_t>(i)] = format == w4a8moe::WeightFormat::mxfp4
                                           ? std::ldexp(1.0f, p[i] - 128)
                                           : w4a8moe::detail::load_float(v.data, v.dtype, i);
    if (bytes) bytes->assign(p, p + n * static_cast<int64_t>(w4a8moe::dtype_bytes(v.dtype)));
  };
  const w4a8moe::WeightFormat int4 = w4a8moe::WeightFormat::int4_symmetric;
  unpack(chunk.w13(E), info.w13_format, out.w13, out.w13_nibbles);
  unpack(chunk.w2(E), info.w2_format, out.w2, out.w2_nibbles);
  floats(chunk.w13_scale(E), info.w13_format, out.w13_s, &out.w13_scale_bytes);
  floats(chunk.w2_scale(E), info.w2_format, out.w2_s, &out.w2_scale_bytes);
  const auto less_zero_points = [](const w4a8moe::TensorView& z, std::vector<int8_t>& values,
                                   std::vector<int8_t>& zero_points) {
    if (z.empty()) return;
    const auto* p = static_cast<const int8_t*>(z.data);
    zero_points.assign(p, p + z.numel());
    const size_t per_group = values.size() / zero_points.size();  // one zero point per scale
    for (size_t i = 0; i < values.size(); ++i)
      values[i] = static_cast<int8_t>(values[i] - zero_points[i / per_group]);
  };
  less_zero_points(chunk.w13_zero_point(E), out.w13, out.w13_z);
  less_zero_points(chunk.w2_zero_point(E), out.w2, out.w2_z);
  if (const w4a8moe::TensorView o = chunk.w13_input_order(E); !o.empty())
    out.w13_order.assign(static_cast<const int32_t*>(o.data),
                         static_cast<const int32_t*>(o.data) + o.numel());
  floats(chunk.w13_bias(E), int4, out.b13, nullptr);
  floats(chunk.w2_bias(E), int4, out.b2, nullptr);
  return out;
}

struct LayerRun {
  std::vector<float> x, logits, weights, out;
  std::vector<int32_t> ids;
  moe_ref::Problem problem;
};

inline std::vector<float> random_x(int64_t T, int64_t H, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T * H));
  for (float& v : x) v = normal(rng);
  return x;
}

// Runs forward() on the source's packed experts for run.x, run.ids and run.weights, and checks
// run.out against the independent exact and float references over the weights as loaded, and the
// library's streaming float reference (what `layer --compare` prints) against the independent one.
inline void check_forward(const w4a8moe::io::LayerSource& source,
                          const w4a8moe::io::PackedLayer& packed, LayerRun& run) {
  using namespace w4a8moe;
  const io::LayerInfo& info = source.info();
  const int64_t H = info.hidden, K = info.top_k;
  const int64_t T = static_cast<int64_t>(run.x.size()) / H;
  Context context(2);
  run.out.assign(static_cast<size_t>(T * H), 0.0f);
  forward(context, TensorView::of(run.x.data(), DType::f32, {T, H}),
          TensorView::of(run.ids.data(), DType::i32, {T, K}),
          TensorView::of(run.weights.data(), DType::f32, {T, K}), packed.w13.bytes(),
          packed.w2.bytes(), info.params,
          MutableTensorView::of(run.out.data(), DType::f32, {T, H}));

  Loaded w = load_all(source);
  run.problem = moe_ref::Problem{
      .tokens = T,
      .hidden = info.hidden,
      .inter = info.inter,
      .experts = info.experts,
      .top_k = info.top_k,
      .group_size = info.group_size,
      .x = run.x,
      .ids = std::vector<int64_t>(run.ids.begin(), run.ids.end()),
      .topk_weights = run.weights,
      .w13 = std::move(w.w13),
      .w13_scale = std::move(w.w13_s),
      .w13_bias = std::move(w.b13),
      .w2 = std::move(w.w2),
      .w2_scale = std::move(w.w2_s),
      .w2_bias = std::move(w.b2),
      .w13_input_order = std::move(w.w13_order),
      .activation = static_cast<int>(info.params.activation),
      .alpha = info.params.alpha,
      .limit = info.params.limit,
      .apply_router_weight_on_input = info.params.apply_router_weight_on_input,
  };
  run.problem.mxfp4_values =
      info.w13_format == WeightFormat::mxfp4 || info.w2_format == WeightFormat::mxfp4;
  run.problem.zero_point_values = info.w13_format == WeightFormat::int4_zero_point ||
                                  info.w2_format == WeightFormat::int4_zero_point;
  const moe_ref::Problem& p = run.problem;
  const moe_ref::ExactResult exact = moe_ref::exact_forward(p);
  double max_ref = 0;
  for (const double v : exact.out) max_ref = std::max(max_ref, std::fabs(v));
  EXPECT_GT(max_ref, 0.1) << "test data must give outputs of order one";
  EXPECT_LT(max_ref, 100.0) << "test data must give outputs of order one";
  size_t bad = 0;
  for (size_t i = 0; i < run.out.size(); ++i) {
    const double err = std::fabs(static_cast<double>(run.out[i]) - exact.out[i]);
    if (!(err <= 1e-5 * max_ref + exact.allowance[i]) && bad++ < 5)
      ADD_FAILURE() << "out[" << i / static_cast<size_t>(H) << ", " << i % static_cast<size_t>(H)
                    << "] = " << run.out[i] << ", exact reference " << exact.out[i];
  }
  EXPECT_EQ(bad, 0u);
  const std::vector<double> fref = moe_ref::float_forward(p);
  const std::vector<double> lib = io::float_reference(source, run.x, run.ids, run.weights, 2);
  double err_sq = 0, ref_sq = 0;
  for (size_t i = 0; i < fref.size(); ++i) {
    EXPECT_NEAR(lib[i], fref[i], 1e-9 * max_ref) << i;
    const double d = static_cast<double>(run.out[i]) - fref[i];
    err_sq += d * d;
    ref_sq += fref[i] * fref[i];
  }
  // random int4 weights and N(0, 1) inputs give about 1.2e-2 (the intermediate's heavy tails)
  EXPECT_LT(std::sqrt(err_sq / ref_sq), 3e-2) << "relative RMS error against the float reference";
}

// Loads layer `layer` of `path`, routes T random tokens and runs forward(); checks the routing
// against the independent reference and the output against the exact and float references.
inline LayerRun check_layer(const std::string& path, int layer, const RouteSpec& route_spec,
                            int64_t T = 13, uint64_t seed = 1) {
  using namespace w4a8moe;
  LayerRun run;
  const std::unique_ptr<io::LayerSource> source = io::open_layer(path, layer, {});
  const io::LayerInfo& info = source->info();
  const int64_t H = info.hidden, E = info.experts, K = info.top_k;
  const io::Router router = source->router();
  const io::PackedLayer packed = io::pack_layer(*source, 2);

  run.x = random_x(T, H, seed);
  run.logits.resize(static_cast<size_t>(T * E));
  router_logits(
      TensorView::of(run.x.data(), DType::f32, {T, H}),
      TensorView::of(router.weight.data(), DType::f32, {E, H}),
      router.bias.empty() ? TensorView{} : TensorView::of(router.bias.data(), DType::f32, {E}),
      MutableTensorView::of(run.logits.data(), DType::f32, {T, E}));
  run.ids.resize(static_cast<size_t>(T * K));
  run.weights.resize(static_cast<size_t>(T * K));
  route(TensorView::of(run.logits.data(), DType::f32, {T, E}),
        router.selection_bias.empty()
            ? TensorView{}
            : TensorView::of(router.selection_bias.data(), DType::f32, {E}),
        info.routing, MutableTensorView::of(run.ids.data(), DType::i32, {T, K}),
        MutableTensorView::of(run.weights.data(), DType::f32, {T, K}));
  std::vector<int64_t> want_ids;
  std::vector<double> want_w;
  route_reference(run.logits, T, E, K, router.selection_bias, route_spec, want_ids, want_w);
  for (int64_t i = 0; i < T * K; ++i) {
    EXPECT_EQ(run.ids[static_cast<size_t>(i)], want_ids[static_cast<size_t>(i)]) << "slot " << i;
    EXPECT_NEAR(run.weights[static_cast<size_t>(i)], want_w[static_cast<size_t>(i)],
                2e-6 * (1.0 + std::fabs(want_w[static_cast<size_t>(i)])))
        << "slot " << i;
  }
  // route_tokens (what `layer` uses) routes the same
  std::vector<int32_t> ids;
  std::vector<float> weights;
  io::route_tokens(*source, router, TensorView::of(run.x.data(), DType::f32, {T, H}), ids, weights);
  EXPECT_EQ(ids, run.ids);
  EXPECT_EQ(weights, run.weights);
  check_forward(*source, packed, run);
  return run;
}

// Opens the shared expert of layer `layer`: one expert, every token, with weight
// sigmoid(x . gate) (gated: checked against `gate` in double) or 1; runs it and checks it like
// check_layer. `gate` empty: no gate expected.
inline LayerRun check_shared(const std::string& path, int layer, const std::vector<float>& gate,
                             int64_t T = 11, uint64_t seed = 2) {
  using namespace w4a8moe;
  LayerRun run;
  io::LoadOptions options;
  options.shared_expert = true;
  const std::unique_ptr<io::LayerSource> source = io::open_layer(path, layer, options);
  const io::LayerInfo& info = source->info();
  EXPECT_EQ(info.experts, 1);
  EXPECT_EQ(info.top_k, 1);
  EXPECT_EQ(info.shared_gate, !gate.empty());
  EXPECT_FALSE(info.params.apply_router_weight_on_input);
  const int64_t H = info.hidden;
  const io::Router router = source->router();
  EXPECT_EQ(router.weight, gate);
  run.x = random_x(T, H, seed);
  io::route_tokens(*source, router, TensorView::of(run.x.data(), DType::f32, {T, H}), run.ids,
                   run.weights);
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_EQ(run.ids[static_cast<size_t>(t)], 0);
    double want = 1.0;
    if (!gate.empty()) {
      double dot = 0;
      for (int64_t h = 0; h < H; ++h)
        dot += static_cast<double>(run.x[static_cast<size_t>(t * H + h)]) *
               static_cast<double>(gate[static_cast<size_t>(h)]);
      want = 1.0 / (1.0 + std::exp(-dot));
    }
    EXPECT_NEAR(run.weights[static_cast<size_t>(t)], want, 1e-6) << "token " << t;
  }
  check_forward(*source, io::pack_layer(*source, 2), run);
  return run;
}

// Packing the experts [range.first, range.first + range.count) of layer `layer` (range.count -1:
// to the last) gives, byte for byte, those expert blocks of the whole layer's packed weights, in
// ascending order, and converts only their rows.
inline void check_expert_range(const std::string& path, int layer, w4a8moe::io::ExpertRange range,
                               const w4a8moe::io::LoadOptions& base = {}) {
  using namespace w4a8moe;
  SCOPED_TRACE(::testing::Message() << "experts [" << range.first << ", +" << range.count << ")");
  const std::unique_ptr<io::LayerSource> whole = io::open_layer(path, layer, base);
  const io::PackedLayer all = io::pack_layer(*whole, 2);
  io::LoadOptions options = base;
  options.experts = range;
  const std::unique_ptr<io::LayerSource> part = io::open_layer(path, layer, options);
  const int64_t E = whole->info().experts;
  const int64_t count = range.count == -1 ? E - range.first : range.count;
  EXPECT_EQ(part->experts().first, range.first);
  EXPECT_EQ(part->experts().count, count);
  EXPECT_EQ(part->info().experts, E) << "the source stays the whole layer's";
  const io::PackedLayer some = io::pack_layer(*part, 2);
  for (const auto& [mine, full, role] :
       {std::tuple{&some.w13, &all.w13, "w13"}, std::tuple{&some.w2, &all.w2, "w2"}}) {
    const detail::Geometry g = detail::read_geometry(mine->bytes(), role);
    const detail::Geometry f = detail::read_geometry(full->bytes(), role);
    EXPECT_EQ(g.experts, count) << role;
    ASSERT_EQ(g.expert_bytes, f.expert_bytes) << role;
    ASSERT_EQ(mine->size(), detail::kHeaderBytes + static_cast<size_t>(count) * g.expert_bytes)
        << role;
    EXPECT_EQ(std::memcmp(mine->bytes().data() + detail::kHeaderBytes,
                          full->bytes().data() + detail::kHeaderBytes +
                              static_cast<size_t>(range.first) * f.expert_bytes,
                          static_cast<size_t>(count) * g.expert_bytes),
              0)
        << role << ": the range's expert blocks differ from the whole layer's";
  }
  const std::vector<io::Conversion> mine = part->conversions(), full = whole->conversions();
  for (size_t i = 0; i < mine.size(); ++i)
    EXPECT_EQ(mine[i].elements, full[i].elements / E * count)
        << mine[i].tensor << ": only the range's rows are converted";
}

}  // namespace ckpt_test
