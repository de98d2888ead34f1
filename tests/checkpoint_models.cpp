// The models of the checkpoint writers (checkpoint_writers.hpp): the small MoE layers' truths
// (int4 values, scales, router) and their GGUF files, with the architecture's metadata and every
// expert tensor in the spec's type.
#include <cmath>
#include <random>

#include "checkpoint_writers.hpp"

namespace ckpt_test {

// ---------------------------------------------------------------------------------------------
// Models

Moe make_moe(int64_t H, int64_t I, int64_t E, int64_t K, uint64_t seed) {
  Moe m;
  m.H = H;
  m.I = I;
  m.E = E;
  m.K = K;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> s(1.5, 3.5);
  std::normal_distribution<double> normal(0.0, 1.0);
  const auto scale = [&](int64_t k) {
    return from_bf16(
        bf16_bits(static_cast<float>(s(rng) / (8.0 * std::sqrt(static_cast<double>(k))))));
  };
  // int4 values from a cheap generator (splitmix64, 16 values per draw): large models stay quick
  uint64_t state = seed;
  const auto fill = [&](std::vector<int8_t>& values) {
    uint64_t bits = 0;
    for (size_t i = 0; i < values.size(); ++i) {
      if (i % 16 == 0) {
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        bits = z ^ (z >> 31);
      }
      values[i] = static_cast<int8_t>(static_cast<int>(bits & 15) - 8);
      bits >>= 4;
    }
  };
  m.w13.resize(static_cast<size_t>(E * 2 * I * H));
  fill(m.w13);
  m.w13_s.resize(static_cast<size_t>(E * 2 * I * (H / m.group)));
  for (float& v : m.w13_s) v = scale(H);
  m.w2.resize(static_cast<size_t>(E * H * I));
  fill(m.w2);
  m.w2_s.resize(static_cast<size_t>(E * H * (I / m.group)));
  for (float& v : m.w2_s) v = scale(I);
  m.router.resize(static_cast<size_t>(E * H));
  for (float& v : m.router)
    v = static_cast<float>(normal(rng) * 1.5 / std::sqrt(static_cast<double>(H)));
  return m;
}

std::vector<int8_t> rows_of(const Moe& m, int which, int64_t e) {
  const int64_t rows = which == 2 ? m.H : m.I, cols = which == 2 ? m.I : m.H;
  const std::vector<int8_t>& src = which == 2 ? m.w2 : m.w13;
  const int64_t first = which == 2 ? e * m.H : e * 2 * m.I + (which == 1 ? m.I : 0);
  return std::vector<int8_t>(src.begin() + first * cols, src.begin() + (first + rows) * cols);
}

std::vector<float> scales_of(const Moe& m, int which, int64_t e) {
  const int64_t rows = which == 2 ? m.H : m.I, cols = which == 2 ? m.I : m.H;
  const int64_t groups = cols / m.group;
  const std::vector<float>& src = which == 2 ? m.w2_s : m.w13_s;
  const int64_t first = which == 2 ? e * m.H : e * 2 * m.I + (which == 1 ? m.I : 0);
  return std::vector<float>(src.begin() + first * groups, src.begin() + (first + rows) * groups);
}

std::vector<int8_t> zero_points_of(const Moe& m, int which, int64_t e) {
  const int64_t rows = which == 2 ? m.H : m.I;
  const std::vector<int8_t>& src = which == 2 ? m.w2_z : m.w13_z;
  const int64_t groups = static_cast<int64_t>(src.size()) / (m.E * (which == 2 ? m.H : 2 * m.I));
  const int64_t first = which == 2 ? e * m.H : e * 2 * m.I + (which == 1 ? m.I : 0);
  return std::vector<int8_t>(src.begin() + first * groups, src.begin() + (first + rows) * groups);
}

std::vector<uint8_t> q4_0_tensor(const Moe& m, int which) {
  std::vector<uint8_t> out;
  for (int64_t e = 0; e < m.E; ++e) {
    const std::vector<int8_t> v = rows_of(m, which, e);
    const std::vector<float> s = scales_of(m, which, e);
    std::vector<uint8_t> q(v.size());
    for (size_t i = 0; i < v.size(); ++i) q[i] = static_cast<uint8_t>(v[i] + 8);
    std::vector<uint16_t> d(s.size());
    for (size_t i = 0; i < s.size(); ++i) d[i] = f16_bits(s[i]);
    const std::vector<uint8_t> blocks = encode_q4_0(q, d);
    append_bytes(out, blocks);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Model files

namespace {

// Expert tensor `which` of layer m as `type`; records the values the file holds.
std::vector<uint8_t> expert_tensor(const Moe& m, int which, uint32_t type, uint64_t seed,
                                   std::vector<float>& values) {
  const int64_t rows = which == 2 ? m.H : m.I, cols = which == 2 ? m.I : m.H;
  const int64_t n = m.E * rows * cols;
  if (type == kTQ4_0) return q4_0_tensor(m, which);
  if (type == kTF32 || type == kTF16 || type == kTBF16) {
    // uniform in [-sqrt(3), sqrt(3)) (unit variance) from a cheap generator: the large files of
    // the streaming test stay quick to make
    uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
    values.resize(static_cast<size_t>(n));
    const float scale = 0.25f / std::sqrt(static_cast<float>(cols));
    for (float& v : values) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const float u = static_cast<float>(state >> 40) * 0x1p-24f;  // [0, 1)
      v = (u * 2.0f - 1.0f) * 1.7320508f * scale;
    }
    if (type == kTF32) return encode_f32(values);
    for (float& v : values) v = type == kTF16 ? from_f16(f16_bits(v)) : from_bf16(bf16_bits(v));
    return type == kTF16 ? encode_f16(values) : encode_bf16(values);
  }
  if (type == kTIQ2_XXS) return std::vector<uint8_t>(static_cast<size_t>(n / 256 * 66), 0);
  std::vector<uint8_t> bytes = random_blocks(type, n, seed);
  values = decode_blocks(type, bytes, n);
  return bytes;
}

}  // namespace

GgufModel make_gguf(const GgufSpec& s) {
  GgufModel g;
  GgufWriter& w = g.writer;
  const std::string a = s.arch;
  w.kv_string("general.architecture", a);
  w.kv_string("general.name", "w4a8moe test model");
  w.kv_u32(a + ".block_count", static_cast<uint32_t>(s.layers));
  w.kv_u32(a + ".expert_count",
           static_cast<uint32_t>(s.expert_count_meta != 0 ? s.expert_count_meta : s.E));
  w.kv_u32(a + ".expert_used_count", static_cast<uint32_t>(s.K));
  w.kv_u32(a + ".embedding_length", static_cast<uint32_t>(s.H));
  w.kv_u32(a + ".expert_feed_forward_length", static_cast<uint32_t>(s.I));
  w.kv_strings("tokenizer.ggml.tokens", {"<s>", "</s>", "hello", ""});
  for (int l = 0; l < s.layers; ++l) {
    Moe m = make_moe(s.H, s.I, s.E, s.K, 100 + static_cast<uint64_t>(l));
    const std::string blk = "blk." + std::to_string(l) + ".";
    w.tensor(blk + "ffn_gate_inp.weight", kTF32, {s.H, s.E}, encode_f32(m.router));
    std::mt19937_64 rng(7 + static_cast<uint64_t>(l));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    if (s.router_bias) {
      for (int64_t e = 0; e < s.E; ++e) m.router_bias.push_back(normal(rng) * 0.5f);
      w.tensor(blk + "ffn_gate_inp.bias", kTF32, {s.E}, encode_f32(m.router_bias));
    }
    if (s.selection_bias) {
      for (int64_t e = 0; e < s.E; ++e) m.selection_bias.push_back(normal(rng) * 0.1f);
      w.tensor(blk + "exp_probs_b.bias", kTF32, {s.E}, encode_f32(m.selection_bias));
    }
    static const char* const names[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
    for (int which = 0; which < 3; ++which) {
      std::vector<float> values;
      const std::vector<int64_t> ne =
          which == 2 ? std::vector<int64_t>{s.I, s.H, s.E} : std::vector<int64_t>{s.H, s.I, s.E};
      w.tensor(
          blk + names[which] + ".weight", s.types[which], ne,
          expert_tensor(m, which, s.types[which],
                        1000 * static_cast<uint64_t>(l) + static_cast<uint64_t>(which), values));
      g.floats[which].push_back(values);
    }
    if (s.expert_bias) {
      std::vector<float> b13, b2;
      for (int64_t i = 0; i < s.E * 2 * s.I; ++i) b13.push_back(normal(rng) * 0.5f);
      for (int64_t i = 0; i < s.E * s.H; ++i) b2.push_back(normal(rng) * 0.5f);
      std::vector<float> gate, up;
      for (int64_t e = 0; e < s.E; ++e)
        for (int64_t r = 0; r < 2 * s.I; ++r)
          (r < s.I ? gate : up).push_back(b13[static_cast<size_t>(e * 2 * s.I + r)]);
      w.tensor(blk + "ffn_gate_exps.bias", kTF32, {s.I, s.E}, encode_f32(gate));
      w.tensor(blk + "ffn_up_exps.bias", kTF32, {s.I, s.E}, encode_f32(up));
      w.tensor(blk + "ffn_down_exps.bias", kTF32, {s.H, s.E}, encode_f32(b2));
      m.b13 = b13;
      m.b2 = b2;
    }
    if (s.shared_expert) {
      const int64_t Is = s.Is != 0 ? s.Is : 2 * s.I;
      Moe sh = make_moe(s.H, Is, 1, 1, 300 + static_cast<uint64_t>(l));
      static const char* const shexp[3] = {"ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"};
      for (int which = 0; which < 3; ++which) {
        std::vector<float> values;
        const std::vector<int64_t> ne =
            which == 2 ? std::vector<int64_t>{Is, s.H} : std::vector<int64_t>{s.H, Is};
        w.tensor(
            blk + shexp[which] + ".weight", s.shared_types[which], ne,
            expert_tensor(sh, which, s.shared_types[which],
                          5000 + 1000 * static_cast<uint64_t>(l) + static_cast<uint64_t>(which),
                          values));
        g.shared_floats[which].push_back(values);
      }
      if (s.shared_gate)
        w.tensor(blk + "ffn_gate_inp_shexp.weight", kTF32, {s.H}, encode_f32(sh.router));
      g.shared.push_back(std::move(sh));
    }
    g.layers.push_back(std::move(m));
  }
  if (s.shared_expert)
    w.kv_u32(a + ".expert_shared_feed_forward_length",
             static_cast<uint32_t>(s.Is != 0 ? s.Is : 2 * s.I));
  return g;
}

}  // namespace ckpt_test
