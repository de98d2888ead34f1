// The compressed-tensors models of the checkpoint writers (checkpoint_writers.hpp): checkpoint
// folders of the MoE truths in every scheme (pack-quantized, int-quantized, dense, GPTQ, AWQ),
// experts fused as gpt-oss and Llama-4 store them (bf16 or MXFP4), shared experts, zero points
// and act-order, with the config.json that describes them.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "checkpoint_writers.hpp"

using nlohmann::json;
using w4a8moe::DType;

namespace ckpt_test {

namespace {

// Values of unit-ish variance scaled by `scale`, exact in `dtype` (bf16, f16 or f32).
std::vector<float> random_dense(int64_t n, float scale, DType dtype, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(static_cast<size_t>(n));
  for (float& x : w) {
    x = normal(rng) * scale;
    if (dtype == DType::bf16) x = from_bf16(bf16_bits(x));
    if (dtype == DType::f16) x = from_f16(f16_bits(x));
  }
  return w;
}

void add_dense(CtWriter& writer, const std::string& name, DType dtype, std::vector<int64_t> shape,
               const std::vector<float>& values) {
  if (dtype == DType::f32) {
    writer.add(name, dtype, std::move(shape), values);
  } else {
    std::vector<uint16_t> bits(values.size());
    for (size_t i = 0; i < values.size(); ++i)
      bits[i] = dtype == DType::bf16 ? bf16_bits(values[i]) : f16_bits(values[i]);
    writer.add(name, dtype, std::move(shape), bits);
  }
}

// The experts of layer m fused as transformers' GptOssExperts / Llama4TextExperts hold them:
// gate_up_proj [E, H, 2I] (x @ W; column 2j / 2j + 1 for gpt-oss, j / I + j for Llama-4),
// down_proj [E, I, H], as bf16 or MXFP4 blocks and scales [E, out, in/32, (16)].
void write_fused(CtModel& c, const CtSpec& s, Moe& m, const std::string& block,
                 std::mt19937_64& rng) {
  const int64_t H = s.H, I = s.I, E = s.E;
  const bool interleaved = s.model_type == "gpt_oss";
  const auto column = [&](int which, int64_t r) {
    return which == 2 ? r : interleaved ? 2 * r + which : which * I + r;
  };
  const std::string experts = block + "experts.";
  if (s.fused == "bf16") {
    std::vector<float> gate_up(static_cast<size_t>(E * H * 2 * I)),
        down(static_cast<size_t>(E * I * H));
    for (int64_t e = 0; e < E; ++e)
      for (int which = 0; which < 3; ++which) {
        const int64_t rows = which == 2 ? H : I, cols = which == 2 ? I : H;
        const std::vector<float> w =
            random_dense(rows * cols, 1.5f / std::sqrt(static_cast<float>(cols)), DType::bf16, rng);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < cols; ++k) {
            const float v = w[static_cast<size_t>(r * cols + k)];
            if (which == 2)
              down[static_cast<size_t>((e * I + k) * H + r)] = v;
            else
              gate_up[static_cast<size_t>((e * H + k) * 2 * I + column(which, r))] = v;
          }
        c.dense.push_back(w);
      }
    add_dense(c.writer, experts + "gate_up_proj", DType::bf16, {E, H, 2 * I}, gate_up);
    add_dense(c.writer, experts + "down_proj", DType::bf16, {E, I, H}, down);
  } else {
    // MXFP4: per output row, blocks of 32 inputs: 16 bytes (element 2b low nibble, 2b + 1 high)
    // and a scale byte (2^(scale - 127)), around 0.5 / sqrt(in) per element
    std::vector<uint8_t> blocks[2], scales[2];
    blocks[0].resize(static_cast<size_t>(E * 2 * I * H / 2));
    scales[0].resize(static_cast<size_t>(E * 2 * I * H / 32));
    blocks[1].resize(static_cast<size_t>(E * H * I / 2));
    scales[1].resize(static_cast<size_t>(E * H * I / 32));
    for (int64_t e = 0; e < E; ++e)
      for (int which = 0; which < 3; ++which) {
        const int64_t rows = which == 2 ? H : I, cols = which == 2 ? I : H;
        const int64_t outs = which == 2 ? H : 2 * I, G = cols / 32;
        const int base =
            127 +
            static_cast<int>(std::lround(std::log2(0.5 / std::sqrt(static_cast<double>(cols)))));
        std::vector<uint8_t>& bl = blocks[which == 2 ? 1 : 0];
        std::vector<uint8_t>& sc = scales[which == 2 ? 1 : 0];
        std::vector<float> w(static_cast<size_t>(rows * cols));
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t row = e * outs + column(which, r);
          for (int64_t g = 0; g < G; ++g) {
            const int scale = base - 1 + static_cast<int>(rng() % 3);
            sc[static_cast<size_t>(row * G + g)] = static_cast<uint8_t>(scale);
            for (int64_t b = 0; b < 16; ++b) {
              const int lo = static_cast<int>(rng() % 16), hi = static_cast<int>(rng() % 16);
              bl[static_cast<size_t>((row * G + g) * 16 + b)] = static_cast<uint8_t>(lo | hi << 4);
              w[static_cast<size_t>(r * cols + g * 32 + 2 * b)] =
                  static_cast<float>(std::ldexp(e2m1_value(lo), scale - 127));
              w[static_cast<size_t>(r * cols + g * 32 + 2 * b + 1)] =
                  static_cast<float>(std::ldexp(e2m1_value(hi), scale - 127));
            }
          }
        }
        c.dense.push_back(w);
      }
    c.writer.add(experts + "gate_up_proj_blocks", DType::u8, {E, 2 * I, H / 32, 16}, blocks[0]);
    c.writer.add(experts + "gate_up_proj_scales", DType::u8, {E, 2 * I, H / 32}, scales[0]);
    c.writer.add(experts + "down_proj_blocks", DType::u8, {E, H, I / 32, 16}, blocks[1]);
    c.writer.add(experts + "down_proj_scales", DType::u8, {E, H, I / 32}, scales[1]);
  }
  if (s.expert_bias) {
    const std::vector<float> b13 = random_dense(E * 2 * I, 0.5f, DType::bf16, rng);
    const std::vector<float> b2 = random_dense(E * H, 0.5f, DType::bf16, rng);
    std::vector<float> gate_up_bias(b13.size());
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < 2 * I; ++r)  // b13 rows: gate then up
        gate_up_bias[static_cast<size_t>(e * 2 * I + column(r < I ? 0 : 1, r % I))] =
            b13[static_cast<size_t>(e * 2 * I + r)];
    add_dense(c.writer, experts + "gate_up_proj_bias", DType::bf16, {E, 2 * I}, gate_up_bias);
    add_dense(c.writer, experts + "down_proj_bias", DType::bf16, {E, H}, b2);
    m.b13 = b13;
    m.b2 = b2;
  }
}

}  // namespace

CtModel make_ct(const CtSpec& s) {
  CtModel c;
  const bool llama4 = s.model_type == "llama4", gpt_oss = s.model_type == "gpt_oss";
  json cfg = json::object();
  cfg["model_type"] = llama4 ? "llama4_text" : s.model_type;
  cfg["hidden_size"] = s.H;
  cfg["num_experts_per_tok"] = s.K;
  cfg["num_hidden_layers"] = s.layers;
  cfg["hidden_act"] = "silu";
  const int64_t Is = s.Is != 0 ? s.Is : 2 * s.I;
  if (s.model_type == "mixtral" || s.model_type == "olmoe" || gpt_oss || llama4) {
    cfg["intermediate_size"] = s.I;
  } else {
    cfg["moe_intermediate_size"] = s.I;
    cfg["intermediate_size"] = 4 * s.I;  // the dense layers' size: must not be taken
  }
  if (s.model_type == "mixtral" || gpt_oss || llama4) {
    cfg["num_local_experts"] = s.E;
  } else if (s.model_type.rfind("deepseek", 0) == 0) {
    cfg["n_routed_experts"] = s.E;
  } else {
    cfg["num_experts"] = s.E;
  }
  if (gpt_oss) cfg["swiglu_limit"] = 7.0;
  if (s.shared == "shared_experts") cfg["n_shared_experts"] = Is / s.I;
  if (s.shared == "shared_expert" && !llama4) cfg["shared_expert_intermediate_size"] = Is;
  if (s.model_type == "qwen3_moe") cfg["norm_topk_prob"] = true;
  const bool dense = s.scheme == "bf16" || s.scheme == "f16" || s.scheme == "f32";
  if (s.fused == "mxfp4") {
    cfg["quantization_config"] = {{"quant_method", "mxfp4"},
                                  {"modules_to_not_convert", {"model.layers.*.self_attn"}}};
  } else if (s.scheme == "gptq") {
    cfg["quantization_config"] = {{"quant_method", "gptq"},
                                  {"bits", 4},
                                  {"group_size", s.strategy == "group" ? 32 : -1},
                                  {"desc_act", s.act_order},
                                  {"sym", !s.asymmetric},
                                  {"static_groups", false},
                                  {"true_sequential", true},
                                  {"damp_percent", 0.01},
                                  {"checkpoint_format", s.gptq_format}};
  } else if (s.scheme == "awq") {
    cfg["quantization_config"] = {{"quant_method", "awq"},
                                  {"bits", 4},
                                  {"group_size", s.strategy == "group" ? 32 : -1},
                                  {"zero_point", true},
                                  {"version", "gemm"},
                                  {"modules_to_not_convert", nullptr}};
  } else if (!dense) {
    json weights = {{"num_bits", 4},
                    {"type", "int"},
                    {"symmetric", !s.asymmetric},
                    {"strategy", s.strategy},
                    {"dynamic", false},
                    {"actorder", s.act_order ? json("group") : json(nullptr)}};
    weights["group_size"] = s.strategy == "group" ? json(32) : json(nullptr);
    cfg["quantization_config"] = {
        {"quant_method", "compressed-tensors"},
        {"format", s.scheme == "packed" ? "pack-quantized" : "int-quantized"},
        {"config_groups",
         {{"group_0",
           {{"targets", {"Linear"}},
            {"weights", weights},
            {"input_activations",
             {{"num_bits", 8},
              {"type", "int"},
              {"symmetric", false},
              {"dynamic", true},
              {"strategy", "token"}}}}}}},
        {"ignore", {"lm_head", "re:.*mlp.gate$"}}};
  }
  if (llama4) {  // the multimodal config: the language model's keys in text_config
    json root = {{"model_type", "llama4"}, {"text_config", cfg}};
    if (cfg.contains("quantization_config")) {
      root["quantization_config"] = cfg["quantization_config"];
      root["text_config"].erase("quantization_config");
    }
    c.writer.config = root;
  } else {
    c.writer.config = cfg;
  }
  c.writer.shards = s.shards;
  const char* const hf[3] = {"gate_proj", "up_proj", "down_proj"};
  const char* const mx[3] = {"w1", "w3", "w2"};
  for (int l = 0; l < s.layers; ++l) {
    Moe m = make_moe(s.H, s.I, s.E, s.K, 500 + static_cast<uint64_t>(l));
    Moe sh = make_moe(s.H, Is, 1, 1, 800 + static_cast<uint64_t>(l));
    if (s.strategy == "channel") {  // one scale per row: the first group's
      for (Moe* t : {&m, &sh}) {
        std::vector<float> r13, r2;
        for (size_t r = 0; r < t->w13_s.size(); r += static_cast<size_t>(t->H / 32))
          r13.push_back(t->w13_s[r]);
        for (size_t r = 0; r < t->w2_s.size(); r += static_cast<size_t>(t->I / 32))
          r2.push_back(t->w2_s[r]);
        t->w13_s = r13;
        t->w2_s = r2;
      }
    }
    if (s.asymmetric || s.scheme == "awq") {  // zero points over [-8, 7], the extremes included
      // ("gptq" stores zero - 1 in four bits: a zero of 0, -8 here, does not fit)
      const int lowest = s.scheme == "gptq" && s.gptq_format == "gptq" ? -7 : -8;
      std::mt19937_64 zrng(700 + static_cast<uint64_t>(l));
      std::uniform_int_distribution<int> z(lowest, 7);
      for (Moe* t : {&m, &sh}) {
        t->w13_z.resize(t->w13_s.size());
        t->w2_z.resize(t->w2_s.size());
        for (std::vector<int8_t>* v : {&t->w13_z, &t->w2_z})
          for (size_t i = 0; i < v->size(); ++i)
            (*v)[i] = static_cast<int8_t>(i < 2 ? (i == 0 ? lowest : 7) : z(zrng));
      }
    }
    if (s.act_order) {  // GPTQ's: a random order of the inputs, g consecutive ones per group
      std::mt19937_64 orng(900 + static_cast<uint64_t>(l));
      for (Moe* t : {&m, &sh})
        for (auto [g_idx, cols] : {std::pair{&t->g13, t->H}, std::pair{&t->g2, t->I}}) {
          g_idx->resize(static_cast<size_t>(t->E * cols));
          std::vector<int32_t> perm(static_cast<size_t>(cols));
          for (int64_t e = 0; e < t->E; ++e) {
            std::iota(perm.begin(), perm.end(), 0);
            std::shuffle(perm.begin(), perm.end(), orng);
            for (int64_t i = 0; i < cols; ++i)
              (*g_idx)[static_cast<size_t>(e * cols + perm[static_cast<size_t>(i)])] =
                  static_cast<int32_t>(i / 32);
          }
        }
    }
    const std::string block = (llama4 ? "language_model.model.layers." : "model.layers.") +
                              std::to_string(l) +
                              (s.mixtral_names ? ".block_sparse_moe."
                               : llama4        ? ".feed_forward."
                                               : ".mlp.");
    const std::string router = block + (gpt_oss || llama4 ? "router." : "gate.");
    for (float& v : m.router) v = from_bf16(bf16_bits(v));
    c.writer.add(router + "weight", DType::bf16, {s.E, s.H}, bf16_of(m.router));
    std::mt19937_64 rng(9 + static_cast<uint64_t>(l));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    if (s.model_type == "deepseek_v3") {
      for (int64_t e = 0; e < s.E; ++e) m.selection_bias.push_back(normal(rng) * 0.1f);
      c.writer.add(block + "gate.e_score_correction_bias", DType::f32, {s.E}, m.selection_bias);
    }
    if (s.router_bias) {
      m.router_bias = random_dense(s.E, 0.5f, DType::bf16, rng);
      add_dense(c.writer, router + "bias", DType::bf16, {s.E}, m.router_bias);
    }
    // One module (an expert's or the shared expert's projection) in the checkpoint's scheme.
    const auto write_module = [&](const std::string& p, const Moe& t, int64_t e, int which,
                                  const std::string& scheme, std::vector<std::vector<float>>& out) {
      const int64_t rows = which == 2 ? t.H : t.I, cols = which == 2 ? t.I : t.H;
      const std::vector<int8_t> v = rows_of(t, which, e);
      if (scheme == "bf16" || scheme == "f16" || scheme == "f32") {
        const DType d = scheme == "f16" ? DType::f16 : scheme == "f32" ? DType::f32 : DType::bf16;
        const std::vector<float> w =
            random_dense(rows * cols, 1.5f / std::sqrt(static_cast<float>(cols)), d, rng);
        add_dense(c.writer, p + "weight", d, {rows, cols}, w);
        out.push_back(w);
        return;
      }
      std::vector<float> sc;
      if (s.strategy == "channel") {
        const std::vector<float>& src = which == 2 ? t.w2_s : t.w13_s;
        const int64_t first = which == 2 ? e * t.H : e * 2 * t.I + (which == 1 ? t.I : 0);
        sc.assign(src.begin() + first, src.begin() + first + rows);
      } else {
        sc = scales_of(t, which, e);
      }
      if (scheme == "gptq" || scheme == "awq") {
        const int64_t groups = s.strategy == "channel" ? 1 : cols / 32;
        const std::vector<int8_t> z =
            t.w13_z.empty() ? std::vector<int8_t>(static_cast<size_t>(rows * groups), 0)
                            : zero_points_of(t, which, e);
        std::vector<int32_t> g_idx;
        if (s.act_order) {
          const std::vector<int32_t>& all = which == 2 ? t.g2 : t.g13;
          g_idx.assign(all.begin() + e * cols, all.begin() + (e + 1) * cols);
        }
        add_gptq_module(c.writer, p, scheme == "awq", scheme == "gptq" && s.gptq_format == "gptq",
                        v, sc, z, rows, cols, groups, g_idx);
        return;
      }
      if (scheme == "packed") {
        c.writer.add(p + "weight_packed", DType::i32, {rows, cols / 8},
                     pack_int4_words(v, rows, cols));
        c.writer.add(p + "weight_shape", DType::i64, {2}, std::vector<int64_t>{rows, cols});
      } else {
        c.writer.add(p + "weight", DType::i8, {rows, cols}, v);
      }
      const std::vector<int64_t> sshape = s.strategy == "channel"
                                              ? std::vector<int64_t>{rows, 1}
                                              : std::vector<int64_t>{rows, cols / 32};
      c.writer.add(p + "weight_scale", DType::bf16, sshape, bf16_of(sc));
      if (s.act_order) {  // compressed-tensors' weight_g_idx: GPTQ's g_idx
        const std::vector<int32_t>& all = which == 2 ? t.g2 : t.g13;
        c.writer.add(p + "weight_g_idx", DType::i32, {cols},
                     std::vector<int32_t>(all.begin() + e * cols, all.begin() + (e + 1) * cols));
      }
      if (s.asymmetric) {
        const std::vector<int8_t> z = zero_points_of(t, which, e);
        const int64_t groups = sshape[1];
        if (scheme == "packed") {  // pack_to_int32 along dim 0: eight rows a word
          std::vector<int32_t> words(static_cast<size_t>((rows + 7) / 8 * groups), 0);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t g = 0; g < groups; ++g) {
              const auto u = static_cast<uint32_t>(z[static_cast<size_t>(r * groups + g)] + 8);
              reinterpret_cast<uint32_t&>(words[static_cast<size_t>((r / 8) * groups + g)]) |=
                  u << (4 * (r % 8));
            }
          c.writer.add(p + "weight_zero_point", DType::i32, {(rows + 7) / 8, groups}, words);
        } else {
          c.writer.add(p + "weight_zero_point", DType::i8, sshape, z);
        }
      }
    };
    if (!s.fused.empty()) {
      write_fused(c, s, m, block, rng);
    } else {
      for (int64_t e = 0; e < s.E; ++e)
        for (int which = 0; which < 3; ++which)
          write_module(block + "experts." + std::to_string(e) + "." +
                           (s.mixtral_names ? mx : hf)[which] + ".",
                       m, e, which, s.scheme, c.dense);
    }
    if (!s.shared.empty()) {
      for (int which = 0; which < 3; ++which)
        write_module(block + s.shared + "." + hf[which] + ".", sh, 0, which,
                     s.fused.empty() ? s.scheme : "bf16", c.shared_dense);
      if (s.shared_gate) {
        for (float& v : sh.router) v = from_bf16(bf16_bits(v));
        c.writer.add(block + "shared_expert_gate.weight", DType::bf16, {1, s.H},
                     bf16_of(sh.router));
      }
    }
    c.layers.push_back(std::move(m));
    c.shared.push_back(std::move(sh));
  }
  return c;
}

}  // namespace ckpt_test
