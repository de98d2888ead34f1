// The w4a8moe program end to end: `w4a8moe run` on generated case files, checked against the
// independent reference (tests/reference), the library's reference_forward, and an in-process
// forward() call (bit for bit); and its failures: exit code 1 with one line on stderr.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "io/safetensors_file.hpp"
#include "io/safetensors_writer.hpp"
#include "program_runner.hpp"
#include "reference/reference.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
namespace fs = std::filesystem;

constexpr int kThreads = 2;

// ---------------------------------------------------------------------------------------------
// Generated cases

// One tensor as it goes into the file and into the library's views.
struct Blob {
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  TensorView view() const {
    TensorView v;
    v.data = bytes.data();
    v.dtype = dtype;
    v.rank = static_cast<int>(shape.size());
    std::copy(shape.begin(), shape.end(), v.shape.begin());
    return v;
  }
};

template <class T>
Blob blob_of(DType dtype, std::vector<int64_t> shape, const std::vector<T>& values) {
  Blob b{dtype, std::move(shape), std::vector<uint8_t>(values.size() * sizeof(T))};
  std::memcpy(b.bytes.data(), values.data(), b.bytes.size());
  return b;
}

// Encodes `values` in a float dtype and replaces them by the values the encoding holds.
Blob float_blob(DType dtype, std::vector<int64_t> shape, std::vector<float>& values) {
  if (dtype == DType::f32) return blob_of(dtype, std::move(shape), values);
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    bits[i] =
        dtype == DType::bf16 ? moe_ref::f32_to_bf16(values[i]) : moe_ref::f32_to_f16(values[i]);
    values[i] = dtype == DType::bf16 ? moe_ref::bf16_to_f32(bits[i]) : moe_ref::f16_to_f32(bits[i]);
  }
  return blob_of(dtype, std::move(shape), bits);
}

std::vector<float> decode_floats(DType dtype, std::span<const uint8_t> bytes) {
  std::vector<float> out(bytes.size() / dtype_bytes(dtype));
  for (size_t i = 0; i < out.size(); ++i) {
    if (dtype == DType::f32) {
      std::memcpy(&out[i], bytes.data() + 4 * i, 4);
    } else {
      uint16_t bits;
      std::memcpy(&bits, bytes.data() + 2 * i, 2);
      out[i] = dtype == DType::bf16 ? moe_ref::bf16_to_f32(bits) : moe_ref::f16_to_f32(bits);
    }
  }
  return out;
}

struct CaseSpec {
  int64_t tokens = 7, hidden = 96, inter = 64, experts = 4, top_k = 2;
  int group_size = -1;
  DType x_dtype = DType::f32;
  DType float_dtype = DType::f32;  // topk_weights, scales and biases
  DType ids_dtype = DType::i32;
  bool nibble_packed = false;
  bool interleaved = false;
  bool bias = false;
  Activation activation = Activation::silu;
  const char* alpha = nullptr;  // metadata text, when given
  const char* limit = nullptr;
  bool on_input = false;
  unsigned seed = 1;
};

struct GeneratedCase {
  CaseSpec spec;
  moe_ref::Problem problem;  // the exact values stored in the file
  Blob x, ids, topk_weights, w13, w13_scale, w13_bias, w2, w2_scale, w2_bias;
  std::vector<std::pair<std::string, std::string>> metadata;

  LogicalWeights weights() const {
    LogicalWeights w;
    w.w13 = w13.view();
    w.w13_scale = w13_scale.view();
    if (spec.bias) w.w13_bias = w13_bias.view();
    w.w2 = w2.view();
    w.w2_scale = w2_scale.view();
    if (spec.bias) w.w2_bias = w2_bias.view();
    w.group_size = spec.group_size;
    w.gate_up_layout = spec.interleaved ? GateUpLayout::interleaved : GateUpLayout::halves;
    return w;
  }
  MoeParams params() const {
    MoeParams p;
    p.activation = spec.activation;
    p.alpha = problem.alpha;
    p.limit = problem.limit;
    p.apply_router_weight_on_input = spec.on_input;
    return p;
  }

  SafetensorsWriter writer() const {
    SafetensorsWriter w;
    const auto add = [&](const char* name, const Blob& b) {
      w.add(name, b.dtype, b.shape, b.bytes.data(), b.bytes.size());
    };
    add("x", x);
    add("topk_ids", ids);
    add("topk_weights", topk_weights);
    add("w13", w13);
    add("w13_scale", w13_scale);
    add("w2", w2);
    add("w2_scale", w2_scale);
    if (spec.bias) {
      add("w13_bias", w13_bias);
      add("w2_bias", w2_bias);
    }
    for (const auto& [key, value] : metadata) w.set_metadata(key, value);
    return w;
  }
};

// int4 values [E, N, K] as I8, or nibble-packed U8 [E, N, K/2] (low nibble first, value + 8).
Blob int4_blob(const std::vector<int8_t>& values, std::vector<int64_t> shape, bool packed) {
  if (!packed) return blob_of(DType::i8, std::move(shape), values);
  std::vector<uint8_t> bytes(values.size() / 2);
  for (size_t j = 0; j < bytes.size(); ++j)
    bytes[j] = static_cast<uint8_t>((values[2 * j] + 8) | ((values[2 * j + 1] + 8) << 4));
  shape[2] /= 2;
  return blob_of(DType::u8, std::move(shape), bytes);
}

// Data whose outputs are of order one: x ~ N(0, 1), int4 weights uniform in [-8, 7] (rms 4.6),
// scales (1.5 to 3.5) / (8 sqrt(K)), so each dot product has a standard deviation near 1.
GeneratedCase generate(const CaseSpec& spec) {
  GeneratedCase c;
  c.spec = spec;
  std::mt19937 rng(spec.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  const int64_t T = spec.tokens, H = spec.hidden, I = spec.inter, E = spec.experts, K = spec.top_k;
  c.problem = {.tokens = T,
               .hidden = H,
               .inter = I,
               .experts = E,
               .top_k = K,
               .group_size = spec.group_size,
               .interleaved = spec.interleaved,
               .activation = static_cast<int>(spec.activation)};
  moe_ref::Problem& p = c.problem;
  if (spec.alpha) p.alpha = std::stof(spec.alpha);
  if (spec.limit) p.limit = std::stof(spec.limit);
  p.apply_router_weight_on_input = spec.on_input;

  p.x.resize(static_cast<size_t>(T * H));
  for (float& v : p.x) v = normal(rng);
  c.x = float_blob(spec.x_dtype, {T, H}, p.x);

  p.ids.resize(static_cast<size_t>(T * K));
  for (int64_t& id : p.ids) id = static_cast<int64_t>(rng() % static_cast<uint32_t>(E));
  if (spec.ids_dtype == DType::i64) {
    c.ids = blob_of(DType::i64, {T, K}, p.ids);
  } else {
    c.ids = blob_of(DType::i32, {T, K}, std::vector<int32_t>(p.ids.begin(), p.ids.end()));
  }
  p.topk_weights.resize(static_cast<size_t>(T * K));
  for (float& v : p.topk_weights) v = 0.2f + 0.8f * uniform(rng);
  c.topk_weights = float_blob(spec.float_dtype, {T, K}, p.topk_weights);

  const auto weights = [&](int64_t rows, int64_t cols, std::vector<int8_t>& w,
                           std::vector<float>& s, std::vector<float>& b, Blob& w_blob, Blob& s_blob,
                           Blob& b_blob) {
    w.resize(static_cast<size_t>(E * rows * cols));
    for (int8_t& v : w) v = static_cast<int8_t>(static_cast<int>(rng() % 16) - 8);
    w_blob = int4_blob(w, {E, rows, cols}, spec.nibble_packed);
    const int64_t groups = spec.group_size < 0 ? 1 : cols / spec.group_size;
    s.resize(static_cast<size_t>(E * rows * groups));
    const float base = 1.0f / (8.0f * std::sqrt(static_cast<float>(cols)));
    for (float& v : s) v = (1.5f + 2.0f * uniform(rng)) * base;
    if (spec.group_size < 0) {
      s_blob = float_blob(spec.float_dtype, {E, rows}, s);
    } else {
      s_blob = float_blob(spec.float_dtype, {E, rows, groups}, s);
    }
    if (spec.bias) {
      b.resize(static_cast<size_t>(E * rows));
      for (float& v : b) v = uniform(rng) - 0.5f;
      b_blob = float_blob(spec.float_dtype, {E, rows}, b);
    }
  };
  weights(2 * I, H, p.w13, p.w13_scale, p.w13_bias, c.w13, c.w13_scale, c.w13_bias);
  weights(H, I, p.w2, p.w2_scale, p.w2_bias, c.w2, c.w2_scale, c.w2_bias);

  c.metadata = {{"group_size", std::to_string(spec.group_size)},
                {"activation", activation_name(spec.activation)},
                {"gate_up_layout", spec.interleaved ? "interleaved" : "halves"},
                {"apply_router_weight_on_input", spec.on_input ? "true" : "false"}};
  if (spec.alpha) c.metadata.emplace_back("alpha", spec.alpha);
  if (spec.limit) c.metadata.emplace_back("limit", spec.limit);
  return c;
}

// ---------------------------------------------------------------------------------------------
// Running the program

using RunResult = moe_test::ProgramResult;

class CliTest : public moe_test::ProgramTest {
 protected:
  RunResult run_case(const std::string& input, const std::string& output) {
    return run(
        {"run", "--input", input, "--output", output, "--threads", std::to_string(kThreads)});
  }

  // Runs a case that must fail: exit code 1, one line on stderr starting "w4a8moe run: ",
  // nothing on stdout, no output file. Returns stderr.
  std::string expect_failure(const std::string& input) {
    const std::string output = path("out_failed.safetensors");
    const RunResult r = run_case(input, output);
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_THAT(r.err, StartsWith("w4a8moe run: "));
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.out, "");
    EXPECT_FALSE(fs::exists(output));
    return r.err;
  }

  // Writes the case, runs the program on it and checks `out` three ways.
  void check_case(const GeneratedCase& c);
};

// Rounding of the output dtype, relative: half a unit in the last place, doubled for safety.
double output_rounding(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return std::ldexp(1.0, -8);
    case DType::f16:
      return std::ldexp(1.0, -11);
    default:
      return 0.0;
  }
}

void CliTest::check_case(const GeneratedCase& c) {
  const CaseSpec& spec = c.spec;
  const int64_t T = spec.tokens, H = spec.hidden;
  const std::string input = path("case.safetensors"), output = path("out.safetensors");
  c.writer().write(input);

  const RunResult r = run_case(input, output);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "") << "run prints nothing on stdout";
  EXPECT_THAT(r.err, StartsWith("w4a8moe run: "));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;

  const SafetensorsFile result = SafetensorsFile::read(output);
  ASSERT_TRUE(result.contains("out"));
  const TensorEntry& e = result.entry("out");
  ASSERT_EQ(e.dtype, spec.x_dtype);
  ASSERT_EQ(e.shape, (std::vector<int64_t>{T, H}));
  EXPECT_EQ(result.metadata().at("kernel_set"), active_kernel_set());
  const std::span<const uint8_t> out_bytes = result.bytes("out");
  const std::vector<float> out = decode_floats(e.dtype, out_bytes);

  // 1. The library in this process, same inputs and thread count: the same bits.
  {
    PackOptions options;
    options.group_size = spec.group_size;
    options.gate_up_layout = spec.interleaved ? GateUpLayout::interleaved : GateUpLayout::halves;
    const LogicalWeights w = c.weights();
    const PackedWeights w13 = pack_w13(w.w13, w.w13_scale, w.w13_bias, options);
    const PackedWeights w2 = pack_w2(w.w2, w.w2_scale, w.w2_bias, options);
    Context context(kThreads);
    std::vector<uint8_t> expected(out_bytes.size());
    forward(context, c.x.view(), c.ids.view(), c.topk_weights.view(), w13.bytes(), w2.bytes(),
            c.params(), MutableTensorView::of(expected.data(), spec.x_dtype, {T, H}));
    EXPECT_TRUE(std::equal(expected.begin(), expected.end(), out_bytes.begin()))
        << "the program's output differs from forward() in this process";
  }

  // 2. The independent exact reference (accumulation in double, before output rounding). Its
  // allowance covers one-step flips of requantized intermediate values near a rounding boundary.
  const moe_ref::ExactResult ref = moe_ref::exact_forward(c.problem);
  double max_ref = 0.0;
  for (const double v : ref.out) max_ref = std::max(max_ref, std::fabs(v));
  ASSERT_GT(max_ref, 0.1) << "test data must give outputs of order one";
  ASSERT_LT(max_ref, 100.0) << "test data must give outputs of order one";
  const double rounding = output_rounding(spec.x_dtype);
  const auto tolerance = [&](size_t i) {
    return 1e-4 * max_ref + ref.allowance[i] + rounding * std::fabs(ref.out[i]);
  };
  double worst = 0.0;
  size_t bad = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double err = std::fabs(static_cast<double>(out[i]) - ref.out[i]);
    worst = std::max(worst, err / max_ref);
    if (!(err <= tolerance(i))) {
      if (bad++ < 5)
        ADD_FAILURE() << "out[" << i / static_cast<size_t>(H) << ", " << i % static_cast<size_t>(H)
                      << "] = " << out[i] << ", reference " << ref.out[i] << ", tolerance "
                      << tolerance(i) << " (seed " << spec.seed << ")";
    }
  }
  EXPECT_EQ(bad, 0u) << "worst error / max|ref| = " << worst;

  // 3. The library's own reference_forward, in the output dtype.
  {
    std::vector<uint8_t> lib_bytes(out_bytes.size());
    reference_forward(c.x.view(), c.ids.view(), c.topk_weights.view(), c.weights(), c.params(),
                      MutableTensorView::of(lib_bytes.data(), spec.x_dtype, {T, H}));
    const std::vector<float> lib = decode_floats(spec.x_dtype, lib_bytes);
    for (size_t i = 0; i < out.size(); ++i)
      ASSERT_LE(std::fabs(static_cast<double>(out[i]) - static_cast<double>(lib[i])),
                2.0 * tolerance(i))
          << "vs reference_forward at " << i << " (seed " << spec.seed << ")";
  }

  // 4. The check can tell: references with the wrong activation, the wrong gate/up layout or the
  // router weight on the wrong side are far from the output.
  const auto distance = [&](const std::vector<double>& other) {
    double d = 0.0;
    for (size_t i = 0; i < out.size(); ++i)
      d = std::max(d, std::fabs(static_cast<double>(out[i]) - other[i]));
    return d / max_ref;
  };
  moe_ref::Problem wrong = c.problem;
  wrong.activation =
      static_cast<int>(spec.activation == Activation::silu ? Activation::gelu : Activation::silu);
  EXPECT_GT(distance(moe_ref::exact_forward(wrong).out), 2e-2) << "wrong activation";
  wrong = c.problem;
  wrong.interleaved = !wrong.interleaved;
  EXPECT_GT(distance(moe_ref::exact_forward(wrong).out), 2e-2) << "wrong gate/up layout";
  wrong = c.problem;
  wrong.apply_router_weight_on_input = !wrong.apply_router_weight_on_input;
  EXPECT_GT(distance(moe_ref::exact_forward(wrong).out), 2e-2) << "router weight side";
}

// ---------------------------------------------------------------------------------------------
// Results

TEST_F(CliTest, F32ChannelwiseSilu) { check_case(generate({.seed = 101})); }

TEST_F(CliTest, Bf16NibblePackedGroupwiseGelu) {
  check_case(generate({.group_size = 32,
                       .x_dtype = DType::bf16,
                       .float_dtype = DType::bf16,
                       .ids_dtype = DType::i64,
                       .nibble_packed = true,
                       .activation = Activation::gelu,
                       .seed = 202}));
}

TEST_F(CliTest, F32InterleavedSwigluoaiBiasRouterOnInput) {
  check_case(generate({.hidden = 128,
                       .group_size = 64,
                       .interleaved = true,
                       .bias = true,
                       .activation = Activation::swigluoai,
                       .alpha = "1.5",
                       .limit = "5",
                       .on_input = true,
                       .seed = 303}));
}

TEST_F(CliTest, F16NibblePackedInterleavedSwiglustepTopKEqualsE) {
  check_case(generate({.tokens = 1,
                       .top_k = 4,  // = experts
                       .group_size = 32,
                       .x_dtype = DType::f16,
                       .float_dtype = DType::f16,
                       .nibble_packed = true,
                       .interleaved = true,
                       .bias = true,
                       .activation = Activation::swiglustep,
                       .limit = "1.25",  // small enough that the clamps act on this data
                       .seed = 404}));
}

TEST_F(CliTest, GeluTanhBf16ScalesF32X) {
  check_case(generate({.tokens = 33,
                       .group_size = 32,
                       .float_dtype = DType::bf16,
                       .activation = Activation::gelu_tanh,
                       .seed = 505}));
}

// ---------------------------------------------------------------------------------------------
// Failures

TEST_F(CliTest, MissingInputFile) {
  const std::string input = path("absent.safetensors");
  const std::string err = expect_failure(input);
  EXPECT_THAT(err, HasSubstr(input));
  EXPECT_THAT(err, HasSubstr("does not exist"));
}

TEST_F(CliTest, MalformedInputFile) {
  const std::string input = path("garbage.safetensors");
  {
    std::ofstream f(input, std::ios::binary);
    f << "this is not a safetensors file at all";
  }
  const std::string err = expect_failure(input);
  EXPECT_THAT(err, HasSubstr(input));
  EXPECT_THAT(err, HasSubstr("header length"));

  // A valid file truncated in its data region.
  CaseSpec spec;
  const std::vector<uint8_t> bytes = generate(spec).writer().serialize();
  {
    std::ofstream f(input, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size() - 100));
  }
  EXPECT_THAT(expect_failure(input), HasSubstr("past the end of the data region"));
}

TEST_F(CliTest, IdsOutOfRange) {
  for (const int64_t bad_id : {int64_t{4}, int64_t{-1}, int64_t{1} << 40}) {
    SCOPED_TRACE(bad_id);
    const CaseSpec spec{.ids_dtype = DType::i64};
    GeneratedCase c = generate(spec);
    std::vector<int64_t> ids = c.problem.ids;
    ids[5] = bad_id;  // E = 4
    c.ids = blob_of(DType::i64, {spec.tokens, spec.top_k}, ids);
    const std::string input = path("bad_ids.safetensors");
    c.writer().write(input);
    EXPECT_THAT(expect_failure(input), HasSubstr("topk_ids"));
  }
}

TEST_F(CliTest, UnknownActivation) {
  GeneratedCase c = generate(CaseSpec{});
  for (auto& [key, value] : c.metadata)
    if (key == "activation") value = "relu";
  const std::string input = path("relu.safetensors");
  c.writer().write(input);
  const std::string err = expect_failure(input);
  EXPECT_THAT(err, HasSubstr("activation"));
  EXPECT_THAT(err, HasSubstr("relu"));
}

TEST_F(CliTest, GroupSizeTheLibraryRejects) {
  GeneratedCase c = generate(CaseSpec{});  // channelwise scales; 48 is no valid group size
  for (auto& [key, value] : c.metadata)
    if (key == "group_size") value = "48";
  const std::string input = path("g48.safetensors");
  c.writer().write(input);
  expect_failure(input);
}

TEST_F(CliTest, UnwritableOutput) {
  const std::string input = path("case.safetensors");
  generate(CaseSpec{}).writer().write(input);
  const RunResult r = run_case(input, path("no_such_dir/out.safetensors"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, StartsWith("w4a8moe run: "));
  EXPECT_THAT(r.err, HasSubstr("cannot create"));
}

TEST_F(CliTest, SpinUsSetsTheWaitPolicyOrNamesTheBound) {
  const RunResult ok =
      run({"bench", "--preset", "tiny", "--tokens", "2", "--repeat", "1", "--spin-us", "0"});
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  for (const char* bad : {"-5", "100001"}) {
    SCOPED_TRACE(bad);
    const RunResult r = run({"bench", "--preset", "tiny", "--repeat", "1", "--spin-us", bad});
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_THAT(r.err, HasSubstr("--spin-us: expected 0 to 100000 microseconds, got "));
    EXPECT_THAT(r.err, HasSubstr(bad));
  }
}

TEST_F(CliTest, BenchWeightFormatsAndActOrderPassTheirCheck) {
  // each format, and w13 with an input order, against the reference before timing
  for (const std::vector<std::string>& extra : {std::vector<std::string>{"--weights", "int4_zp"},
                                                {"--weights", "mxfp4"},
                                                {"--act-order"},
                                                {"--act-order", "--weights", "int4_zp"}}) {
    std::vector<std::string> args = {"bench", "--preset", "tiny", "--tokens",  "3", "--group",
                                     "32",    "--repeat", "1",    "--spin-us", "0"};
    args.insert(args.end(), extra.begin(), extra.end());
    const RunResult r = run(args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_THAT(r.out, HasSubstr("against the reference"));
    EXPECT_THAT(r.out, HasSubstr("(ok, bound"));
  }
}

TEST_F(CliTest, HelpAndUnknownSubcommand) {
  const RunResult help = run({"--help"});
  EXPECT_EQ(help.exit_code, 0) << help.err;
  EXPECT_THAT(help.out + help.err, HasSubstr("run"));
  const RunResult unknown = run({"frobnicate"});
  EXPECT_NE(unknown.exit_code, 0);
  EXPECT_GT(unknown.exit_code, 0) << "must exit, not crash";
  const RunResult no_input = run({"run", "--output", path("o.safetensors")});
  EXPECT_GT(no_input.exit_code, 0);
}

}  // namespace
}  // namespace w4a8moe::io
