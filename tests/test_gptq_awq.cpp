// GPTQ and AWQ checkpoint folders, written by the suite's own writer from AutoGPTQ's and
// AutoAWQ's packing (checkpoint_writers.hpp, add_gptq_module): the word layouts pinned by hand,
// values, scales and zero points read back exactly (GPTQ sym and asymmetric in both checkpoint
// formats, AWQ; group and channel), whole layers against the independent references, and
// malformed folders (act-order, zeros that contradict sym, a "gptq" zero of 16) refused with a
// message naming the tensor.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "checkpoint_test_util.hpp"
#include "checkpoint_writers.hpp"

namespace {

using namespace ckpt_test;
using namespace w4a8moe;
using ::testing::HasSubstr;

uint32_t word(const CtWriter& w, const std::string& name, size_t i) {
  uint32_t v = 0;
  std::memcpy(&v, w.tensors.at(name).bytes.data() + 4 * i, 4);
  return v;
}

TEST(GptqAwq, WordLayouts) {
  // 8 x 8 values v[n, k] = (n + k) % 16 - 8 (unsigned q = (n + k) % 16), one group, zeros q 3 + n
  std::vector<int8_t> v(64), z(8);
  for (int n = 0; n < 8; ++n) {
    for (int k = 0; k < 8; ++k)
      v[static_cast<size_t>(n * 8 + k)] = static_cast<int8_t>((n + k) % 16 - 8);
    z[static_cast<size_t>(n)] = static_cast<int8_t>(3 + n - 8);
  }
  const std::vector<float> s(8, 0.5f);
  CtWriter w;
  add_gptq_module(w, "g.", false, true, v, s, z, 8, 8, 1);
  // GPTQ qweight [1, 8]: output n's inputs 0..7 in bits 0..31 (input 0 least significant)
  EXPECT_EQ(word(w, "g.qweight", 0), 0x76543210u);
  EXPECT_EQ(word(w, "g.qweight", 1), 0x87654321u);
  // qzeros [1, 1]: outputs 0..7 in bits 0..31, stored zero - 1 = 2 + n
  EXPECT_EQ(word(w, "g.qzeros", 0), 0x98765432u);
  add_gptq_module(w, "a.", true, false, v, s, z, 8, 8, 1);
  // AWQ qweight [8, 1]: input k's outputs in the order 0 2 4 6 1 3 5 7, q = n + k
  EXPECT_EQ(word(w, "a.qweight", 0), 0x75316420u);
  EXPECT_EQ(word(w, "a.qweight", 1), 0x86427531u);
  EXPECT_EQ(word(w, "a.qzeros", 0), 0xa8649753u);
}

struct Case {
  const char* scheme;
  bool asymmetric;
  const char* format;
  const char* strategy;
};

TEST(GptqAwq, ReadBackExactlyAndRun) {
  for (const Case c :
       {Case{"gptq", false, "gptq", "group"}, Case{"gptq", true, "gptq", "group"},
        Case{"gptq", true, "gptq_v2", "channel"}, Case{"gptq", false, "gptq_v2", "channel"},
        Case{"awq", true, "", "group"}, Case{"awq", true, "", "channel"}}) {
    SCOPED_TRACE(::testing::Message() << c.scheme << " asymmetric " << c.asymmetric << " "
                                      << c.format << " " << c.strategy);
    TempDir dir;
    CtSpec spec{.scheme = c.scheme,
                .strategy = c.strategy,
                .H = 128,
                .I = 96,
                .layers = 1,
                .asymmetric = c.asymmetric};
    if (*c.format != '\0') spec.gptq_format = c.format;
    const CtModel m = make_ct(spec);
    m.writer.write(dir / "ckpt");
    const auto source = open_exact(dir / "ckpt", 0);
    const io::LayerInfo& info = source->info();
    const bool zero_points = c.asymmetric;
    EXPECT_EQ(info.w13_format,
              zero_points ? WeightFormat::int4_zero_point : WeightFormat::int4_symmetric);
    EXPECT_EQ(info.w2_format, info.w13_format);
    EXPECT_EQ(info.group_size, std::string(c.strategy) == "group" ? 32 : -1);
    EXPECT_EQ(info.w13_scale_dtype, DType::f16);
    for (const io::Conversion& conv : source->conversions()) {
      EXPECT_TRUE(conv.exact);
      EXPECT_THAT(conv.source,
                  HasSubstr(std::string(c.scheme) == "awq" ? "AWQ int4" : "GPTQ int4"));
      EXPECT_EQ(conv.source.find("zero points") != std::string::npos, zero_points) << conv.source;
    }
    const Loaded w = load_all(*source);
    const Moe& t = m.layers[0];
    EXPECT_EQ(w.w13_s, t.w13_s);
    EXPECT_EQ(w.w2_s, t.w2_s);
    EXPECT_EQ(w.w13_z, t.w13_z);
    EXPECT_EQ(w.w2_z, t.w2_z);
    // the loaded values are value - z with zero points
    std::vector<int8_t> w13 = t.w13, w2 = t.w2;
    if (zero_points)
      for (auto [v, z] : {std::pair{&w13, &t.w13_z}, std::pair{&w2, &t.w2_z}})
        for (size_t i = 0; i < v->size(); ++i)
          (*v)[i] = static_cast<int8_t>((*v)[i] - (*z)[i / (v->size() / z->size())]);
    EXPECT_EQ(w.w13, w13);
    EXPECT_EQ(w.w2, w2);
    check_layer(dir / "ckpt", 0, RouteSpec{"softmax", true});
  }
}

// The layer of truth `m` in float, its weights dequantized as GPTQ defines them, input k with
// the scale and zero point of group g_idx[k] (k / 32 when `by_g_idx` is false or there is none),
// on the routing of `run`: SUM_slots w * W2 (silu(W1 x) * W3 x).
std::vector<double> dense_layer(const Moe& m, const LayerRun& run, bool by_g_idx) {
  const int64_t H = m.H, I = m.I, K = m.K;
  const auto T = static_cast<int64_t>(run.x.size()) / H;
  const auto weight = [&](int which, int64_t e, int64_t n, int64_t k) {
    const int64_t rows = which == 2 ? H : I, cols = which == 2 ? I : H, groups = cols / 32;
    const std::vector<int32_t>& gi = which == 2 ? m.g2 : m.g13;
    const int64_t b = by_g_idx && !gi.empty() ? gi[static_cast<size_t>(e * cols + k)] : k / 32;
    const int64_t row = (which == 2 ? e * H : e * 2 * I + (which == 1 ? I : 0)) + n;
    const std::vector<int8_t>& v = which == 2 ? m.w2 : m.w13;
    const std::vector<float>& sc = which == 2 ? m.w2_s : m.w13_s;
    const std::vector<int8_t>& z = which == 2 ? m.w2_z : m.w13_z;
    (void)rows;
    const double zero = z.empty() ? 0.0 : z[static_cast<size_t>(row * groups + b)];
    return (v[static_cast<size_t>(row * cols + k)] - zero) *
           static_cast<double>(sc[static_cast<size_t>(row * groups + b)]);
  };
  std::vector<double> out(static_cast<size_t>(T * H), 0.0), h(static_cast<size_t>(I));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < K; ++s) {
      const int64_t e = run.ids[static_cast<size_t>(t * K + s)];
      for (int64_t j = 0; j < I; ++j) {
        double gate = 0, up = 0;
        for (int64_t k = 0; k < H; ++k) {
          const double x = run.x[static_cast<size_t>(t * H + k)];
          gate += weight(0, e, j, k) * x;
          up += weight(1, e, j, k) * x;
        }
        h[static_cast<size_t>(j)] = gate / (1.0 + std::exp(-gate)) * up;
      }
      for (int64_t n = 0; n < H; ++n) {
        double y = 0;
        for (int64_t j = 0; j < I; ++j) y += weight(2, e, n, j) * h[static_cast<size_t>(j)];
        out[static_cast<size_t>(t * H + n)] +=
            static_cast<double>(run.weights[static_cast<size_t>(t * K + s)]) * y;
      }
    }
  return out;
}

double relative_rms(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    err += d * d;
    ref += want[i] * want[i];
  }
  return std::sqrt(err / ref);
}

TEST(GptqAwq, ActOrderRunsAsTheFileSays) {
  // desc_act: each module's g_idx scatters its groups over the inputs. The gate and up columns
  // are sorted by group with the order that gathers their inputs, down's order moves the gate and
  // up rows; the layer then runs as the file's weights dequantized by g_idx, and not as the
  // same weights read as if g_idx were k / g.
  // compressed-tensors' actorder "group" (weight_g_idx) is the same
  for (const auto& [scheme, asymmetric] : {std::pair{"gptq", true}, std::pair{"gptq", false},
                                           std::pair{"packed", true}, std::pair{"int", false}}) {
    SCOPED_TRACE(::testing::Message() << scheme << (asymmetric ? " asymmetric" : " symmetric"));
    TempDir dir;
    const CtModel m = make_ct(CtSpec{.scheme = scheme,
                                     .H = 128,
                                     .I = 96,
                                     .layers = 1,
                                     .asymmetric = asymmetric,
                                     .act_order = true});
    m.writer.write(dir / "ckpt");
    const auto source = open_exact(dir / "ckpt", 0);
    EXPECT_TRUE(source->info().w13_input_order);
    ASSERT_FALSE(source->info().notes.empty());
    EXPECT_THAT(source->info().notes.back(), HasSubstr("act-order"));
    const LayerRun run = check_layer(dir / "ckpt", 0, RouteSpec{"softmax", true});
    const double err = relative_rms(run.out, dense_layer(m.layers[0], run, true));
    EXPECT_LT(err, 3e-2) << "against the file's weights in float";
    EXPECT_GT(relative_rms(run.out, dense_layer(m.layers[0], run, false)), 0.3)
        << "the comparison must see g_idx";
  }
}

// The message of opening and packing `c`'s layer 0 after `edit`, which must name the folder.
std::string error(CtModel c, const std::function<void(CtModel&)>& edit = {}) {
  if (edit) edit(c);
  TempDir dir;
  const std::string folder = dir / "ckpt";
  c.writer.write(folder);
  std::string m = error_of([&] { io::pack_layer(*io::open_layer(folder, 0, {}), 1); });
  if (m != "(no error)") {
    EXPECT_THAT(m, HasSubstr(folder)) << "the message must name the checkpoint";
  }
  return m;
}

CtModel model(const char* scheme, bool asymmetric) {
  return make_ct(CtSpec{.scheme = scheme, .E = 4, .layers = 1, .asymmetric = asymmetric});
}

TEST(GptqAwq, MalformedFoldersAreRefused) {
  const std::string p = "model.layers.0.mlp.experts.3.down_proj.";
  EXPECT_EQ(error(model("gptq", false)), "(no error)");
  EXPECT_EQ(error(model("awq", true)), "(no error)");
  // act-order: a g_idx that is not k / group size, without desc_act or with unequal groups
  const auto g_idx = [&](const std::string& name, int mod) {
    return [name, mod](CtModel& c) {
      std::vector<int32_t> g(64);
      for (int k = 0; k < 64; ++k) g[static_cast<size_t>(k)] = k % mod;
      c.writer.add(name, DType::i32, {64}, g);
    };
  };
  const std::string gate = "model.layers.0.mlp.experts.3.gate_proj.";
  CtModel desc_act = make_ct(CtSpec{
      .scheme = "gptq", .H = 64, .E = 4, .layers = 1, .asymmetric = true, .act_order = true});
  EXPECT_EQ(error(desc_act), "(no error)");
  EXPECT_THAT(error(model("gptq", true), g_idx(gate + "g_idx", 2)),
              HasSubstr("tensor '" + gate +
                        "g_idx' permutes the inputs (act-order) but "
                        "config.json quantization_config says desc_act: false"));
  EXPECT_THAT(error(desc_act, g_idx(gate + "g_idx", 2)),
              HasSubstr("model.layers.0.mlp.experts.3.gate_proj.g_idx' and "
                        "'model.layers.0.mlp.experts.3.up_proj.g_idx' order the inputs "
                        "differently"));
  EXPECT_THAT(error(desc_act,
                    [&](CtModel& c) {
                      std::vector<int32_t> g(64, 0);
                      g[5] = 1;
                      c.writer.add(p + "g_idx", DType::i32, {64}, g);
                    }),
              HasSubstr("tensor '" + p +
                        "g_idx' puts 63 inputs in group 0, expected the group "
                        "size 32"));
  EXPECT_THAT(error(desc_act, g_idx(p + "g_idx", 3)),
              HasSubstr("tensor '" + p + "g_idx' puts input 2 in group 2, outside [0, 2)"));
  // sym: every zero 8 (stored 7 in "gptq")
  EXPECT_THAT(
      error(
          model("gptq", false),
          [&](CtModel& c) {
            c.writer.add(p + "qzeros", DType::i32, {2, 8}, std::vector<uint32_t>(16, 0x77777776u));
          }),
      HasSubstr("tensor '" + p +
                "qzeros' holds zero 7 at [0, 0] but config.json "
                "quantization_config says sym: true (every zero 8)"));
  // "gptq" stores zero - 1: a stored 15 would be 16
  EXPECT_THAT(
      error(
          model("gptq", true),
          [&](CtModel& c) {
            c.writer.add(p + "qzeros", DType::i32, {2, 8}, std::vector<uint32_t>(16, 0x7777777fu));
          }),
      HasSubstr("tensor '" + p + "qzeros' stores 15 at [0, 0]: zero 16"));
  EXPECT_THAT(
      error(model("awq", true),
            [&](CtModel& c) {
              c.writer.add(p + "qweight", DType::i32, {8, 64}, std::vector<int32_t>(512, 0));
            }),
      HasSubstr("tensor '" + p + "qweight' must be I32 [64, 8], got I32 [8, 64]"));
  EXPECT_THAT(error(model("gptq", true), [&](CtModel& c) { c.writer.tensors.erase(p + "qzeros"); }),
              HasSubstr("tensor '" + p + "qzeros' is missing"));
  EXPECT_THAT(error(model("gptq", true),
                    [&](CtModel& c) {
                      c.writer.add(p + "bias", DType::f16, {64}, std::vector<uint16_t>(64, 0));
                    }),
              HasSubstr("tensor '" + p + "bias' exists"));
  EXPECT_THAT(error(model("gptq", true),
                    [](CtModel& c) { c.writer.config["quantization_config"]["bits"] = 8; }),
              HasSubstr("quantization_config (gptq): bits must be 4, got 8"));
  EXPECT_THAT(error(model("gptq", true),
                    [](CtModel& c) {
                      c.writer.config["quantization_config"]["checkpoint_format"] = "marlin";
                    }),
              HasSubstr("GPTQ checkpoint_format \"marlin\" is not read"));
  EXPECT_THAT(error(model("awq", true),
                    [](CtModel& c) { c.writer.config["quantization_config"]["version"] = "gemv"; }),
              HasSubstr("AWQ version \"gemv\" is not read"));
  EXPECT_THAT(error(model("gptq", true),
                    [](CtModel& c) { c.writer.config["quantization_config"]["group_size"] = 16; }),
              HasSubstr("group_size 16 is not supported"));
  EXPECT_THAT(error(model("gptq", true),
                    [](CtModel& c) { c.writer.config["quantization_config"]["sym"] = "yes"; }),
              HasSubstr("quantization_config sym must be true or false, got \"yes\""));
  EXPECT_THAT(
      error(model("gptq", true),
            [](CtModel& c) { c.writer.config["quantization_config"]["quant_method"] = "exl2"; }),
      HasSubstr("quant_method \"exl2\", not \"gptq\" or \"awq\""));
}

}  // namespace
