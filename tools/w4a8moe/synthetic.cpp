#include "w4a8moe/synthetic.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "thread_pool.hpp"

namespace w4a8moe::cli {

namespace {

// splitmix64: fast, deterministic, good enough for test data.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1p-53; }
  double normal() {  // Box-Muller
    const double u1 = std::max(uniform(), 1e-300), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

uint16_t to_f16(float f) {  // finite, normal-range positive values only (scales)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t v = (u & 0x7fffffffu) - (112u << 23);
  v += 0xfffu + ((v >> 13) & 1u);
  return static_cast<uint16_t>(v >> 13);
}

void store_scale(std::vector<uint8_t>& dst, DType dtype, size_t i, float v) {
  if (dtype == DType::f32) {
    std::memcpy(dst.data() + i * 4, &v, 4);
  } else {
    const uint16_t h = dtype == DType::bf16 ? to_bf16(v) : to_f16(v);
    std::memcpy(dst.data() + i * 2, &h, 2);
  }
}

}  // namespace

const std::vector<Preset>& presets() {
  static const std::vector<Preset> table = {
      {"qwen3-30b-a3b", 2048, 768, 128, 8, Activation::silu, false, false},
      {"qwen3-235b-a22b", 4096, 1536, 128, 8, Activation::silu, false, false},
      {"mixtral-8x7b", 4096, 14336, 8, 2, Activation::silu, false, false},
      {"deepseek-v2-lite", 2048, 1408, 64, 6, Activation::silu, false, false},
      {"deepseek-v3", 7168, 2048, 256, 8, Activation::silu, false, false},
      {"deepseek-v4-flash", 4096, 2048, 256, 6, Activation::silu, false, false},
      {"qwen3.6-35b-a3b", 2048, 512, 256, 8, Activation::silu, false, false},
      {"gpt-oss-20b", 2880, 2880, 32, 4, Activation::swigluoai, true, false},
      {"gpt-oss-120b", 2880, 2880, 128, 4, Activation::swigluoai, true, false},
      {"olmoe-1b-7b", 2048, 1024, 64, 8, Activation::silu, false, false},
      {"llama4-scout", 5120, 8192, 16, 1, Activation::silu, false, true},
      {"tiny", 256, 128, 8, 2, Activation::silu, false, false},  // for tests and smoke runs
  };
  return table;
}

const Preset& find_preset(const std::string& name) {
  std::string names;
  for (const Preset& p : presets()) {
    if (name == p.name) return p;
    names += names.empty() ? "" : ", ";
    names += p.name;
  }
  throw Error("--preset: expected one of " + names + ", got '" + name + "'");
}

LogicalWeights SyntheticLayer::view() const {
  const Preset& p = preset;
  const int64_t E = p.experts, H = p.hidden, I = p.inter;
  LogicalWeights w;
  w.group_size = group_size;
  w.weight_format = format;
  w.gate_up_layout = p.interleaved_bias ? GateUpLayout::interleaved : GateUpLayout::halves;
  w.w13 = TensorView::of(w13.data(), DType::u8, {E, 2 * I, H / 2});
  w.w2 = TensorView::of(w2.data(), DType::u8, {E, H, I / 2});
  if (group_size < 0) {
    w.w13_scale = TensorView::of(s13.data(), scale_dtype, {E, 2 * I});
    w.w2_scale = TensorView::of(s2.data(), scale_dtype, {E, H});
  } else {
    w.w13_scale = TensorView::of(s13.data(), scale_dtype, {E, 2 * I, H / group_size});
    w.w2_scale = TensorView::of(s2.data(), scale_dtype, {E, H, I / group_size});
  }
  if (format == WeightFormat::int4_zero_point) {  // shaped like the scales
    w.w13_zero_point = w.w13_scale;
    w.w13_zero_point.data = z13.data();
    w.w13_zero_point.dtype = DType::i8;
    w.w2_zero_point = w.w2_scale;
    w.w2_zero_point.data = z2.data();
    w.w2_zero_point.dtype = DType::i8;
  }
  if (!order13.empty()) w.w13_input_order = TensorView::of(order13.data(), DType::i32, {E, H});
  if (!b13.empty()) {
    w.w13_bias = TensorView::of(b13.data(), DType::f32, {E, 2 * I});
    w.w2_bias = TensorView::of(b2.data(), DType::f32, {E, H});
  }
  return w;
}

SyntheticLayer make_layer(const Preset& preset, int group_size, DType scale_dtype, uint64_t seed,
                          void (*progress)(double, void*), void* progress_ctx, WeightFormat format,
                          bool act_order) {
  const int64_t E = preset.experts, H = preset.hidden, I = preset.inter;
  if (!group_size_fits(group_size, H) || !group_size_fits(group_size, I))
    throw Error("--group: expected -1 or a multiple of 32 dividing " + std::to_string(H) + " and " +
                std::to_string(I) + " for preset " + preset.name + ", got " +
                std::to_string(group_size));
  const bool mxfp4 = format == WeightFormat::mxfp4;
  if (mxfp4 && group_size != 32)
    throw Error("--group: expected 32 for --weights mxfp4 (one e8m0 scale per 32), got " +
                std::to_string(group_size));
  if (mxfp4) scale_dtype = DType::u8;
  SyntheticLayer L;
  L.preset = preset;
  L.group_size = group_size;
  L.scale_dtype = scale_dtype;
  L.format = format;
  L.w13.resize(static_cast<size_t>(E * 2 * I * H / 2));
  L.w2.resize(static_cast<size_t>(E * H * I / 2));
  const int64_t g13 = group_size < 0 ? 1 : H / group_size;
  const int64_t g2 = group_size < 0 ? 1 : I / group_size;
  const size_t sb = dtype_bytes(scale_dtype);
  L.s13.resize(static_cast<size_t>(E * 2 * I * g13) * sb);
  L.s2.resize(static_cast<size_t>(E * H * g2) * sb);
  if (format == WeightFormat::int4_zero_point) {
    L.z13.resize(static_cast<size_t>(E * 2 * I * g13));
    L.z2.resize(static_cast<size_t>(E * H * g2));
  }
  if (act_order) L.order13.resize(static_cast<size_t>(E * H));
  if (preset.interleaved_bias) {
    L.b13.resize(static_cast<size_t>(E * 2 * I));
    L.b2.resize(static_cast<size_t>(E * H));
  }
  // Scales make every stage of order one: h = SUM_k x w s has sd ~ 4.6 c for s = c / sqrt(K).
  const double c13 = 0.3 / std::sqrt(static_cast<double>(H));
  const double c2 = 0.4 / std::sqrt(static_cast<double>(I));
  std::atomic<int64_t> next{0}, done{0};
  const int workers = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto work = [&](int wid) {
    for (int64_t e; (e = next.fetch_add(1)) < E;) {
      Rng r{seed * 0x100000001b3ull + static_cast<uint64_t>(e)};
      uint8_t* a = L.w13.data() + e * 2 * I * H / 2;
      for (int64_t i = 0; i < 2 * I * H / 2; i += 8) {
        const uint64_t v = r.next();
        std::memcpy(a + i, &v, std::min<int64_t>(8, 2 * I * H / 2 - i));
      }
      uint8_t* b = L.w2.data() + e * H * I / 2;
      for (int64_t i = 0; i < H * I / 2; i += 8) {
        const uint64_t v = r.next();
        std::memcpy(b + i, &v, std::min<int64_t>(8, H * I / 2 - i));
      }
      // mxfp4: every byte holds two valid codes; the exponent of the power of two nearest the
      // scale int4 would have (2 * e2m1 has an RMS of 5.9 against int4's 4.6: close enough)
      const auto scale = [&](std::vector<uint8_t>& dst, int64_t i, double c) {
        const double v = c * (0.5 + r.uniform());
        if (mxfp4)
          dst[static_cast<size_t>(i)] = static_cast<uint8_t>(std::lround(std::log2(v)) + 128);
        else
          store_scale(dst, scale_dtype, static_cast<size_t>(i), static_cast<float>(v));
      };
      for (int64_t i = 0; i < 2 * I * g13; ++i) scale(L.s13, e * 2 * I * g13 + i, c13);
      for (int64_t i = 0; i < H * g2; ++i) scale(L.s2, e * H * g2 + i, c2);
      const auto zero = [&] { return static_cast<int8_t>(static_cast<int>(r.next() % 5) - 2); };
      for (size_t i = 0; i < (L.z13.empty() ? 0 : static_cast<size_t>(2 * I * g13)); ++i)
        L.z13[static_cast<size_t>(e * 2 * I * g13) + i] = zero();
      for (size_t i = 0; i < (L.z2.empty() ? 0 : static_cast<size_t>(H * g2)); ++i)
        L.z2[static_cast<size_t>(e * H * g2) + i] = zero();
      if (!L.order13.empty()) {  // Fisher-Yates
        int32_t* order = L.order13.data() + e * H;
        for (int64_t i = 0; i < H; ++i) order[i] = static_cast<int32_t>(i);
        for (int64_t i = H - 1; i > 0; --i)
          std::swap(order[i], order[r.next() % static_cast<uint64_t>(i + 1)]);
      }
      for (size_t i = 0; i < (L.b13.empty() ? 0 : static_cast<size_t>(2 * I)); ++i)
        L.b13[static_cast<size_t>(e * 2 * I) + i] = static_cast<float>(0.1 * r.normal());
      for (size_t i = 0; i < (L.b2.empty() ? 0 : static_cast<size_t>(H)); ++i)
        L.b2[static_cast<size_t>(e * H) + i] = static_cast<float>(0.1 * r.normal());
      const int64_t d = done.fetch_add(1) + 1;
      if (wid == 0 && progress)
        progress(static_cast<double>(d) / static_cast<double>(E), progress_ctx);
    }
  };
  detail::ThreadPool pool(workers);
  pool.run(work);
  if (progress) progress(1.0, progress_ctx);
  return L;
}

Routing make_routing(int64_t tokens, int64_t experts, int64_t top_k, bool skewed, uint64_t seed) {
  Rng r{seed ^ 0x5bd1e995ull};
  Routing out;
  out.ids.resize(static_cast<size_t>(tokens * top_k));
  out.weights.resize(static_cast<size_t>(tokens * top_k));
  // Popularity: uniform, or Zipf (p ~ 1 / rank^1.2) over a fixed random permutation.
  std::vector<double> pop(static_cast<size_t>(experts), 1.0);
  std::vector<int32_t> perm(static_cast<size_t>(experts));
  std::iota(perm.begin(), perm.end(), 0);
  for (int64_t i = experts - 1; i > 0; --i)
    std::swap(perm[static_cast<size_t>(i)], perm[r.next() % static_cast<uint64_t>(i + 1)]);
  if (skewed)
    for (int64_t i = 0; i < experts; ++i)
      pop[static_cast<size_t>(perm[static_cast<size_t>(i)])] = 1.0 / std::pow(i + 1.0, 1.2);
  std::vector<double> w(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    w = pop;
    double logits_max = -1e300;
    std::vector<double> logits(static_cast<size_t>(top_k));
    for (int64_t k = 0; k < top_k; ++k) {  // weighted sampling without replacement
      double total = 0.0;
      for (double v : w) total += v;
      double u = r.uniform() * total;
      int64_t e = 0;
      while (e < experts - 1 && (u -= w[static_cast<size_t>(e)]) >= 0.0) ++e;
      while (w[static_cast<size_t>(e)] == 0.0) e = (e + 1) % experts;
      w[static_cast<size_t>(e)] = 0.0;
      out.ids[static_cast<size_t>(t * top_k + k)] = static_cast<int32_t>(e);
      logits[static_cast<size_t>(k)] = r.normal();
      logits_max = std::max(logits_max, logits[static_cast<size_t>(k)]);
    }
    double sum = 0.0;
    for (double& l : logits) sum += (l = std::exp(l - logits_max));
    for (int64_t k = 0; k < top_k; ++k)
      out.weights[static_cast<size_t>(t * top_k + k)] =
          static_cast<float>(logits[static_cast<size_t>(k)] / sum);
  }
  return out;
}

std::vector<float> make_activations(int64_t tokens, int64_t hidden, uint64_t seed) {
  Rng r{seed ^ 0xa0761d6478bd642full};
  std::vector<float> x(static_cast<size_t>(tokens * hidden));
  for (float& v : x) v = static_cast<float>(r.normal());
  return x;
}

}  // namespace w4a8moe::cli
