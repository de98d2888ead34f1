// `w4a8moe layer` end to end: GGUF files and compressed-tensors folders written by the
// suite, the report it prints, its output file against forward() in this process (bit for bit),
// streaming (the peak resident memory stays far below the file's size), and its failures: exit
// code 1 with one line on stderr.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "checkpoint_families.hpp"
#include "checkpoint_test_util.hpp"
#include "checkpoint_writers.hpp"
#include "io/safetensors_file.hpp"
#include "io/safetensors_writer.hpp"
#include "program_runner.hpp"

namespace {

using namespace ckpt_test;
using namespace w4a8moe;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

using moe_test::kCliPath;

using Result = moe_test::ProgramResult;

class LayerCli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kCliPath == nullptr) GTEST_SKIP() << "the w4a8moe program is not part of this build";
  }
  Result run(const std::vector<std::string>& args) {
    std::vector<std::string> command = {"layer"};
    command.insert(command.end(), args.begin(), args.end());
    return moe_test::run_program(command, dir_.path().string());
  }
  // A run that must fail: exit code 1, one line on stderr starting "w4a8moe layer: ".
  std::string failure(const std::vector<std::string>& args) {
    const Result r = run(args);
    EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
    EXPECT_THAT(r.err, StartsWith("w4a8moe layer: "));
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    return r.err;
  }
  // Layer 0 of `model` (one token): the packed layer is over 14 MiB and the peak resident
  // memory stays within 30 MiB of it, whatever the file's size.
  void expect_streams(std::vector<std::string> model) {
    model.insert(model.end(), {"--layer", "0", "--tokens", "1", "--threads", "2", "--repeat", "1"});
    const Result r = run(model);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    const size_t at_packed = r.out.find("(packed "), at_peak = r.out.find("peak resident memory ");
    ASSERT_NE(at_packed, std::string::npos) << r.out;
    ASSERT_NE(at_peak, std::string::npos) << r.out;
    const double packed = std::stod(r.out.substr(at_packed + 8));
    const double peak = std::stod(r.out.substr(at_peak + 21));
    EXPECT_GT(packed, 14.0);
    EXPECT_LT(peak, packed + 30.0) << "the loader held more than the packed layer and a chunk";
  }
  TempDir dir_;
};

TEST_F(LayerCli, GgufLayerOutputIsForwardsBitForBit) {
  GgufSpec spec{.H = 128, .I = 64, .E = 16, .K = 4};
  make_gguf(spec).writer.write(dir_ / "qwen.gguf");
  // bf16 hidden states from a file
  const int64_t T = 7, H = spec.H, E = spec.E, K = spec.K;
  std::vector<float> x(static_cast<size_t>(T * H));
  std::mt19937_64 rng(4);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : x) v = from_bf16(bf16_bits(normal(rng)));
  io::SafetensorsWriter in;
  in.add("x", DType::bf16, {T, H}, bf16_of(x));
  in.write(dir_ / "x.safetensors");

  const Result r =
      run({"--model", dir_ / "qwen.gguf", "--layer", "1", "--input", dir_ / "x.safetensors",
           "--output", dir_ / "out.safetensors", "--threads", "2", "--repeat", "2", "--compare"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("(gguf), layer 1: H 128, I 64, E 16, top-k 4, silu"));
  EXPECT_THAT(r.out, HasSubstr("architecture: qwen3moe; routing: softmax, renormalised"));
  EXPECT_THAT(r.out, HasSubstr("weights: blk.1.ffn_gate_exps.weight: Q4_0 -> int4 exactly"));
  EXPECT_THAT(r.out, HasSubstr("weights: blk.1.ffn_down_exps.weight: Q4_0 -> int4 exactly"));
  EXPECT_THAT(r.out, HasSubstr("load: "));
  EXPECT_THAT(r.out, HasSubstr("forward: 7 tokens, 2 threads: "));
  EXPECT_THAT(r.out, HasSubstr("tokens/s"));
  EXPECT_THAT(r.out, HasSubstr("compare: relative RMS error "));

  // The same layer in this process: route the file's x, forward, compare the bytes.
  const auto source = io::open_layer(dir_ / "qwen.gguf", 1, {});
  const io::Router router = source->router();
  const io::PackedLayer packed = io::pack_layer(*source, 1);
  const std::vector<uint16_t> xb = bf16_of(x);
  const TensorView xv = TensorView::of(xb.data(), DType::bf16, {T, H});
  std::vector<float> logits(static_cast<size_t>(T * E));
  router_logits(xv, TensorView::of(router.weight.data(), DType::f32, {E, H}), {},
                MutableTensorView::of(logits.data(), DType::f32, {T, E}));
  std::vector<int32_t> ids(static_cast<size_t>(T * K));
  std::vector<float> w(static_cast<size_t>(T * K));
  route(TensorView::of(logits.data(), DType::f32, {T, E}), {}, source->info().routing,
        MutableTensorView::of(ids.data(), DType::i32, {T, K}),
        MutableTensorView::of(w.data(), DType::f32, {T, K}));
  std::vector<uint16_t> expected(static_cast<size_t>(T * H));
  Context context(1);
  forward(context, xv, TensorView::of(ids.data(), DType::i32, {T, K}),
          TensorView::of(w.data(), DType::f32, {T, K}), packed.w13.bytes(), packed.w2.bytes(),
          source->info().params, MutableTensorView::of(expected.data(), DType::bf16, {T, H}));

  const io::SafetensorsFile out = io::SafetensorsFile::read(dir_ / "out.safetensors");
  ASSERT_EQ(out.entry("out").dtype, DType::bf16);
  ASSERT_EQ(out.entry("out").shape, (std::vector<int64_t>{T, H}));
  EXPECT_EQ(std::memcmp(out.bytes("out").data(), expected.data(), expected.size() * 2), 0)
      << "the program's output differs from forward() in this process";
  EXPECT_EQ(std::memcmp(out.bytes("topk_ids").data(), ids.data(), ids.size() * 4), 0);
  EXPECT_EQ(std::memcmp(out.bytes("topk_weights").data(), w.data(), w.size() * 4), 0);
}

// `mpirun -np N w4a8moe layer --expert-parallel`: each process loads its share of the experts
// alone; with dispatch (exact results, the command's default) `out` is the one-process bytes for
// 2 and 3 processes, with all-reduce within f32 summation-order error.
TEST_F(LayerCli, ExpertParallelLayerIsTheOneProcessLayer) {
#ifndef W4A8MOE_MPIEXEC
  GTEST_SKIP() << "this build has no MPI";
#else
  // Under AddressSanitizer, no leak check in the processes mpirun starts (see tests/CMakeLists.txt,
  // the MPI suites).
#ifdef __SANITIZE_ADDRESS__
  const std::string kNoLeakCheck = "ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 ";
#else
  const std::string kNoLeakCheck;
#endif
  GgufSpec spec;
  spec.H = 128;
  spec.I = 64;
  spec.E = 10;  // uneven shares over 3 processes
  spec.K = 3;
  make_gguf(spec).writer.write(dir_ / "qwen.gguf");
  const std::vector<std::string> common = {
      "--model", dir_ / "qwen.gguf", "--layer", "1",        "--tokens",
      "9",       "--threads",        "1",       "--repeat", "1"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = common;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  ASSERT_EQ(run(with({"--output", dir_ / "one.safetensors"})).exit_code, 0);
  const io::SafetensorsFile one = io::SafetensorsFile::read(dir_ / "one.safetensors");
  const auto want = one.bytes("out");
  for (const char* np : {"2", "3"}) {
    const std::string mpirun =
        kNoLeakCheck + W4A8MOE_MPIEXEC + " -np " + np + " --oversubscribe --allow-run-as-root ";
    for (const char* way : {"dispatch", "all-reduce"}) {
      const std::string file = dir_ / (std::string(way) + np + ".safetensors");
      std::vector<std::string> command = {"layer"};
      for (const std::string& a : with({"--output", file, "--expert-parallel", way}))
        command.push_back(a);
      const Result r = moe_test::run_program(command, dir_.path().string(), mpirun);
      ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
      EXPECT_THAT(r.out,
                  HasSubstr(std::string("expert-parallel ") + way + " over " + np + " processes"));
      const io::SafetensorsFile got = io::SafetensorsFile::read(file);
      const auto bytes = got.bytes("out");
      ASSERT_EQ(bytes.size(), want.size());
      if (std::string(way) == "dispatch") {
        EXPECT_EQ(std::memcmp(bytes.data(), want.data(), want.size()), 0) << np << " processes";
      } else {
        const auto* g = reinterpret_cast<const float*>(bytes.data());
        const auto* w = reinterpret_cast<const float*>(want.data());
        float top = 0;
        for (size_t i = 0; i < want.size() / 4; ++i) top = std::max(top, std::fabs(w[i]));
        ASSERT_GT(top, 0.1f);
        for (size_t i = 0; i < want.size() / 4; ++i)
          ASSERT_LE(std::fabs(g[i] - w[i]), 1e-6f * top) << "element " << i;
      }
    }
  }
  std::vector<std::string> shared = {"layer"};
  for (const std::string& a : with({"--expert-parallel", "dispatch", "--shared-experts"}))
    shared.push_back(a);
  const Result r = moe_test::run_program(
      shared, dir_.path().string(),
      kNoLeakCheck + W4A8MOE_MPIEXEC + " -np 1 --oversubscribe --allow-run-as-root ");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--shared-experts: expected no shared expert with "
                               "--expert-parallel"));
#endif
}

TEST_F(LayerCli, ConvertedWeightsReportTheirErrorOrAreRefused) {
  GgufSpec spec;
  spec.layers = 1;
  spec.types[2] = kTF16;
  make_gguf(spec).writer.write(dir_ / "f16.gguf");
  const Result r = run({"--model", dir_ / "f16.gguf", "--layer", "0", "--tokens", "3", "--threads",
                        "2", "--repeat", "1", "--compare"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("weights: blk.0.ffn_down_exps.weight: F16 -> int4 g32 (converted): "
                               "relative RMS error "));
  EXPECT_THAT(r.out, HasSubstr("forward: 3 tokens"));
  const std::string err = failure({"--model", dir_ / "f16.gguf", "--layer", "0", "--exact"});
  EXPECT_THAT(err, HasSubstr("tensor 'blk.0.ffn_down_exps.weight' has type F16, which w4a8moe "
                             "does not take exactly"));
}

TEST_F(LayerCli, CompressedTensorsFolder) {
  CtSpec spec = family("DeepSeekV3").ct.value();
  spec.shards = 2;
  CtModel c = make_ct(spec);
  family("DeepSeekV3").config(c.writer.config);
  c.writer.write(dir_ / "ckpt");
  const Result r = run({"--model", dir_ / "ckpt", "--layer", "1", "--tokens", "9", "--threads", "2",
                        "--repeat", "1", "--compare", "--output", dir_ / "o.safetensors"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("(compressed-tensors), layer 1: H 64, I 64, E 16, top-k 4"));
  EXPECT_THAT(r.out, HasSubstr("routing: sigmoid, renormalised, 2 of 4 groups (top-2 sum), "
                               "scaled by 2.5, selection bias"));
  EXPECT_THAT(r.out, HasSubstr("pack-quantized int4 g32, BF16 scales -> int4 exactly"));
  const io::SafetensorsFile out = io::SafetensorsFile::read(dir_ / "o.safetensors");
  EXPECT_EQ(out.entry("out").shape, (std::vector<int64_t>{9, 64}));
  EXPECT_EQ(out.entry("out").dtype, DType::f32);
}

TEST_F(LayerCli, ZeroPointFoldersAreTakenExactly) {
  // compressed-tensors symmetric: false, GPTQ (asymmetric and sym) and AWQ folders: exact (also
  // with --exact), compared against the float reference of the file's own weights
  struct Case {
    CtSpec spec;
    const char* source;
    const char* format;
  };
  const Case cases[] = {
      {{.scheme = "packed", .layers = 1, .asymmetric = true},
       "pack-quantized int4 g32, BF16 scales, zero points",
       "int4 with zero points"},
      {{.scheme = "gptq", .layers = 1, .asymmetric = true},
       "GPTQ int4 g32, F16 scales, zero points",
       "int4 with zero points"},
      {{.scheme = "gptq", .layers = 1}, "GPTQ int4 g32, F16 scales", "int4"},
      {{.scheme = "gptq", .layers = 1, .asymmetric = true, .act_order = true},
       "GPTQ int4 g32, F16 scales, zero points",
       "int4 with zero points"},
      {{.scheme = "awq", .strategy = "channel", .layers = 1, .asymmetric = true},
       "AWQ int4 channelwise, F16 scales, zero points",
       "int4 with zero points"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.source);
    const std::string folder = dir_ / (c.spec.scheme + std::to_string(c.spec.asymmetric) +
                                       std::to_string(c.spec.act_order));
    make_ct(c.spec).writer.write(folder);
    const Result r = run({"--model", folder, "--layer", "0", "--tokens", "7", "--threads", "2",
                          "--repeat", "1", "--exact", "--compare"});
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr(std::string("weights: model.layers.0.mlp.experts.*.down_proj: ") +
                                 c.source + " -> " + c.format + " exactly"));
    EXPECT_THAT(r.out, HasSubstr("compare: relative RMS error "));
    if (c.spec.act_order) {
      EXPECT_THAT(r.out, HasSubstr("act-order (desc_act)"));
    }
  }
}

TEST_F(LayerCli, LoadingStreams) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "resident memory says nothing under AddressSanitizer (shadow memory, quarantine)";
#endif
  // One layer of 32 BF16 experts: 48 MiB in the file, 15 MiB packed. The loader maps the file and
  // releases each expert's pages once packed: the process never holds the tensors (without the
  // release, the peak would be about 85 MiB).
  GgufSpec spec{.layers = 1, .H = 512, .I = 512, .E = 32};
  spec.types[0] = spec.types[1] = spec.types[2] = kTBF16;
  make_gguf(spec).writer.write(dir_ / "big.gguf");
  const double file_mib =
      static_cast<double>(std::filesystem::file_size(dir_ / "big.gguf")) / (1 << 20);
  ASSERT_GT(file_mib, 45.0);
  SCOPED_TRACE(::testing::Message() << file_mib << " MiB file");
  expect_streams({"--model", dir_ / "big.gguf"});
}

TEST_F(LayerCli, SharedExpertIsIncludedOnlyWhenAsked) {
  // Qwen2-MoE: routed experts plus the shared expert scaled by sigmoid(x . gate); both parts run
  // in f32 on the bf16 input and their sum is rounded once to bf16
  GgufSpec spec{.arch = "qwen2moe", .H = 64, .I = 64, .E = 8, .K = 2, .Is = 128};
  spec.shared_expert = spec.shared_gate = true;
  make_gguf(spec).writer.write(dir_ / "q2.gguf");
  const int64_t T = 5, H = spec.H, K = spec.K;
  std::vector<float> x = random_x(T, H, 9);
  for (float& v : x) v = from_bf16(bf16_bits(v));
  io::SafetensorsWriter in;
  in.add("x", DType::bf16, {T, H}, bf16_of(x));
  in.write(dir_ / "x.safetensors");

  const Result without = run({"--model", dir_ / "q2.gguf", "--layer", "1", "--input",
                              dir_ / "x.safetensors", "--repeat", "1", "--threads", "2"});
  ASSERT_EQ(without.exit_code, 0) << without.out << without.err;
  EXPECT_THAT(without.out, HasSubstr("note: the file's shared expert is not included in `out` "
                                     "(routed experts only; --shared-experts adds it)"));
  EXPECT_THAT(without.out, Not(HasSubstr("shared expert: I")));

  const Result r = run({"--model", dir_ / "q2.gguf", "--layer", "1", "--input",
                        dir_ / "x.safetensors", "--output", dir_ / "out.safetensors", "--threads",
                        "2", "--repeat", "2", "--compare", "--shared-experts"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("shared expert: I 128, silu, output scaled by sigmoid(x . gate)"));
  EXPECT_THAT(r.out, HasSubstr("weights: blk.1.ffn_gate_shexp.weight: Q4_0 -> int4 exactly"));
  EXPECT_THAT(r.out, HasSubstr("out: the routed experts plus the shared expert"));
  EXPECT_THAT(r.out, Not(HasSubstr("not included")));
  EXPECT_THAT(r.out, HasSubstr("routed and shared experts"));
  EXPECT_THAT(r.out, HasSubstr("activations not quantized; shared expert included)"));

  // The same in this process.
  const std::vector<uint16_t> xb = bf16_of(x);
  const TensorView xbv = TensorView::of(xb.data(), DType::bf16, {T, H});
  std::vector<float> sum(static_cast<size_t>(T * H), 0.0f), shared_weights;
  Context context(1);
  for (const bool shared : {false, true}) {
    io::LoadOptions options;
    options.shared_expert = shared;
    const auto source = io::open_layer(dir_ / "q2.gguf", 1, options);
    const io::PackedLayer packed = io::pack_layer(*source, 1);
    std::vector<int32_t> ids;
    std::vector<float> w;
    io::route_tokens(*source, source->router(), xbv, ids, w);
    const int64_t k = source->info().top_k;
    std::vector<float> part(static_cast<size_t>(T * H));
    forward(context, TensorView::of(x.data(), DType::f32, {T, H}),
            TensorView::of(ids.data(), DType::i32, {T, k}),
            TensorView::of(w.data(), DType::f32, {T, k}), packed.w13.bytes(), packed.w2.bytes(),
            source->info().params, MutableTensorView::of(part.data(), DType::f32, {T, H}));
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
    if (shared) shared_weights = w;
  }
  const io::SafetensorsFile out = io::SafetensorsFile::read(dir_ / "out.safetensors");
  ASSERT_EQ(out.entry("out").dtype, DType::bf16);
  EXPECT_EQ(std::memcmp(out.bytes("out").data(), bf16_of(sum).data(), sum.size() * 2), 0)
      << "the program's output differs from routed + shared forward() in this process";
  ASSERT_EQ(out.entry("shared_weights").shape, (std::vector<int64_t>{T}));
  EXPECT_EQ(std::memcmp(out.bytes("shared_weights").data(), shared_weights.data(), T * 4), 0);
  EXPECT_EQ(out.metadata().at("shared_expert"), "included");
  EXPECT_EQ(out.entry("topk_ids").shape, (std::vector<int64_t>{T, K}));

  // a model without a shared expert: said, and `out` is the routed experts
  GgufSpec plain;
  plain.layers = 1;
  make_gguf(plain).writer.write(dir_ / "plain.gguf");
  const Result none = run({"--model", dir_ / "plain.gguf", "--layer", "0", "--tokens", "2",
                           "--repeat", "1", "--shared-experts"});
  ASSERT_EQ(none.exit_code, 0) << none.out << none.err;
  EXPECT_THAT(none.out,
              HasSubstr("note: layer 0 has no shared expert: `out` is its routed experts"));
}

TEST_F(LayerCli, FusedExpertsAndSharedExpertOfAHuggingFaceFolder) {
  // Llama-4 as transformers saves it: fused bf16 experts (converted), the shared expert
  CtSpec spec = family("Llama4").ct.value();
  spec.fused = "bf16";
  spec.shared = "shared_expert";
  spec.Is = 64;
  make_ct(spec).writer.write(dir_ / "l4");
  const Result r = run({"--model", dir_ / "l4", "--layer", "0", "--tokens", "6", "--threads", "2",
                        "--repeat", "1", "--compare", "--shared-experts"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("architecture: llama4_text; routing: sigmoid; router weight on the "
                               "input"));
  EXPECT_THAT(r.out, HasSubstr("weights: language_model.model.layers.0.feed_forward.experts."
                               "gate_up_proj (gate, halves): BF16 -> int4 g32 (converted): "
                               "relative RMS error "));
  EXPECT_THAT(r.out, HasSubstr("shared expert: I 64, silu, output added as is"));
  EXPECT_THAT(r.out, HasSubstr("weights: language_model.model.layers.0.feed_forward.shared_expert."
                               "down_proj: BF16 -> int4 g32 (converted)"));
  EXPECT_THAT(r.out, HasSubstr("compare: relative RMS error "));
  // gpt-oss's MXFP4 experts, taken exactly (--exact too)
  CtSpec oss = family("GptOss").ct.value();
  oss.fused = "mxfp4";
  oss.H = oss.I = 64;
  oss.E = 4;
  make_ct(oss).writer.write(dir_ / "oss");
  const Result o =
      run({"--model", dir_ / "oss", "--layer", "0", "--tokens", "4", "--repeat", "1", "--compare"});
  ASSERT_EQ(o.exit_code, 0) << o.out << o.err;
  EXPECT_THAT(o.out, HasSubstr("top-k 2, swigluoai"));
  EXPECT_THAT(o.out, HasSubstr("routing: softmax_topk, router bias"));
  EXPECT_THAT(o.out, HasSubstr("gate_up_proj_blocks (up, interleaved): MXFP4 -> mxfp4 exactly"));
  EXPECT_THAT(o.out, HasSubstr("down_proj_blocks: MXFP4 -> mxfp4 exactly"));
  const Result exact = run({"--model", dir_ / "oss", "--layer", "0", "--tokens", "2", "--repeat",
                            "1", "--exact", "--compare"});
  EXPECT_EQ(exact.exit_code, 0) << exact.out << exact.err;
  EXPECT_THAT(exact.out, HasSubstr("compare: relative RMS error "));
}

TEST_F(LayerCli, LoadingHuggingFaceFoldersStreams) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "resident memory says nothing under AddressSanitizer (shadow memory, quarantine)";
#endif
  // 32 BF16 experts (48 MiB), per-expert tensors or fused in two tensors: each expert's bytes
  // are released once packed (for fused tensors, the expert's part of each)
  for (const char* fused : {"bf16", ""}) {
    SCOPED_TRACE(*fused ? "fused" : "per expert");
    CtSpec spec{.model_type = "llama4", .scheme = "bf16", .H = 512, .I = 512, .E = 32, .K = 1};
    spec.layers = 1;
    spec.fused = fused;
    const std::string folder = dir_ / (*fused ? "fused" : "experts");
    make_ct(spec).writer.write(folder);
    expect_streams({"--model", folder});
  }
}

TEST_F(LayerCli, Failures) {
  GgufSpec spec;
  spec.layers = 1;
  make_gguf(spec).writer.write(dir_ / "m.gguf");
  EXPECT_THAT(failure({"--model", dir_ / "absent.gguf", "--layer", "0"}),
              HasSubstr("absent.gguf': no such file or folder"));
  EXPECT_THAT(failure({"--model", dir_ / "m.gguf", "--layer", "4"}),
              HasSubstr("layer 4 does not exist: the model has 1 blocks"));
  EXPECT_THAT(failure({"--model", dir_ / "m.gguf", "--layer", "0", "--tokens", "0"}),
              HasSubstr("--tokens: expected at least 1, got 0"));
  io::SafetensorsWriter in;
  in.add("x", DType::f32, {2, 32}, std::vector<float>(64, 1.0f));
  in.write(dir_ / "x.safetensors");
  EXPECT_THAT(
      failure({"--model", dir_ / "m.gguf", "--layer", "0", "--input", dir_ / "x.safetensors"}),
      HasSubstr("tensor 'x' must be F32, BF16 or F16 [T, 64] with T >= 1, got F32 of rank 2 "
                "[2, 32]"));
  std::vector<uint8_t> bytes = make_gguf(spec).writer.serialize();
  bytes.resize(bytes.size() / 2);
  write_file(dir_ / "cut.gguf", bytes);
  EXPECT_THAT(failure({"--model", dir_ / "cut.gguf", "--layer", "0"}),
              HasSubstr("runs past the end of the file"));
}

}  // namespace
