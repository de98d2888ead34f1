// The program with packed weight files: `w4a8moe pack` writes a case's experts to a
// file; `run --packed` and `bench --packed` map it. Same bits as packing in the run; a file of
// another case, a damaged file or a bad argument ends with exit code 1 and one line on stderr.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "io/safetensors_file.hpp"
#include "io/safetensors_writer.hpp"
#include "program_runner.hpp"
#include "test_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace {

namespace fs = std::filesystem;
using moe_test::CaseSpec;
using moe_test::DType;

using Result = moe_test::ProgramResult;

// Writes the inputs of one forward call as a case file (README, "The program": run).
void write_case(const moe_test::Case& c, const std::string& path) {
  w4a8moe::io::SafetensorsWriter w;
  const CaseSpec& s = c.spec;
  const int64_t E = s.experts, H = s.hidden, I = s.inter, T = s.tokens, K = s.top_k;
  w.add("x", c.x.dtype, {T, H}, c.x.bytes);
  w.add("topk_ids", s.ids_dtype, {T, K}, c.ids);
  w.add("topk_weights", c.topk_weights.dtype, {T, K}, c.topk_weights.bytes);
  w.add("w13", DType::i8, {E, 2 * I, H}, c.w13);
  w.add("w2", DType::i8, {E, H, I}, c.w2);
  const int64_t g = s.group_size;
  if (g < 0) {
    w.add("w13_scale", c.w13_scale.dtype, {E, 2 * I}, c.w13_scale.bytes);
    w.add("w2_scale", c.w2_scale.dtype, {E, H}, c.w2_scale.bytes);
  } else {
    w.add("w13_scale", c.w13_scale.dtype, {E, 2 * I, H / g}, c.w13_scale.bytes);
    w.add("w2_scale", c.w2_scale.dtype, {E, H, I / g}, c.w2_scale.bytes);
  }
  if (s.bias) {
    w.add("w13_bias", c.w13_bias.dtype, {E, 2 * I}, c.w13_bias.bytes);
    w.add("w2_bias", c.w2_bias.dtype, {E, H}, c.w2_bias.bytes);
  }
  w.set_metadata("group_size", std::to_string(g));
  w.set_metadata("activation", w4a8moe::activation_name(s.activation));
  w.set_metadata("apply_router_weight_on_input", s.apply_router_weight_on_input ? "true" : "false");
  w.write(path);
}

CaseSpec cli_spec(uint64_t seed) {
  CaseSpec s{11, 128, 64, 6, 3, 32, DType::bf16};  // T, H, I, E, K, group size, x dtype
  s.activation = w4a8moe::Activation::swigluoai;
  s.bias = true;
  s.seed = seed;
  return s;
}

class CliPacked : public moe_test::ProgramTest {
 protected:
  void SetUp() override {
    ProgramTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    write_case(moe_test::make_case(cli_spec(801)), path("case.safetensors"));
  }

  std::vector<uint8_t> out_bytes(const std::string& file) {
    const auto f = w4a8moe::io::SafetensorsFile::read(file);
    const auto b = f.bytes("out");
    return {b.begin(), b.end()};
  }

  // Exit code 1 and one line on stderr that starts with the command's name.
  static void expect_failure(const Result& r, const std::string& command,
                             const std::string& fragment) {
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_EQ(r.err.rfind("w4a8moe " + command + ": ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find(fragment), std::string::npos) << r.err;
  }
};

TEST_F(CliPacked, RunWithAPackedFileGivesTheSameBits) {
  const Result p = run({"pack", "--input", path("case.safetensors"), "--output", path("w.w4a8")});
  ASSERT_EQ(p.exit_code, 0) << p.err;
  EXPECT_NE(p.err.find("wrote 6 experts"), std::string::npos) << p.err;
  const Result plain = run({"run", "--input", path("case.safetensors"), "--output",
                            path("plain.safetensors"), "--threads", "2"});
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  for (const bool skip : {false, true}) {
    std::vector<std::string> args = {"run",
                                     "--input",
                                     path("case.safetensors"),
                                     "--output",
                                     path("packed.safetensors"),
                                     "--packed",
                                     path("w.w4a8"),
                                     "--threads",
                                     "2"};
    if (skip) args.push_back("--skip-checksum");
    const Result r = run(args);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(out_bytes(path("packed.safetensors")), out_bytes(path("plain.safetensors")));
  }
}

TEST_F(CliPacked, PackForTheScalarSetRunsAsTheScalarSet) {
  ASSERT_EQ(run({"pack", "--input", path("case.safetensors"), "--output", path("s.w4a8"),
                 "--kernel-set", "scalar", "--scales", "bf16"})
                .exit_code,
            0);
  const Result a = run({"run", "--input", path("case.safetensors"), "--output", path("a.out"),
                        "--packed", path("s.w4a8")});
  ASSERT_EQ(a.exit_code, 0) << a.err;
  EXPECT_NE(a.err.find("kernel set scalar"), std::string::npos) << a.err;
}

TEST_F(CliPacked, RunRefusesTheFileOfAnotherCase) {
  ASSERT_EQ(
      run({"pack", "--input", path("case.safetensors"), "--output", path("w.w4a8")}).exit_code, 0);
  CaseSpec other = cli_spec(802);
  other.hidden = 96;
  write_case(moe_test::make_case(other), path("other.safetensors"));
  const Result r = run({"run", "--input", path("other.safetensors"), "--output", path("o.out"),
                        "--packed", path("w.w4a8")});
  expect_failure(r, "run", "--packed: expected experts matching the case (6 experts, H 96");
  EXPECT_FALSE(fs::exists(path("o.out")));
}

TEST_F(CliPacked, RunRefusesADamagedFile) {
  ASSERT_EQ(
      run({"pack", "--input", path("case.safetensors"), "--output", path("w.w4a8")}).exit_code, 0);
  {
    std::fstream f(path("w.w4a8"), std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(5000);
    f.put('\x7f');
  }
  expect_failure(run({"run", "--input", path("case.safetensors"), "--output", path("o.out"),
                      "--packed", path("w.w4a8")}),
                 "run", "payload checksum");
  fs::resize_file(path("w.w4a8"), fs::file_size(path("w.w4a8")) - 1);
  expect_failure(run({"run", "--input", path("case.safetensors"), "--output", path("o.out"),
                      "--packed", path("w.w4a8"), "--skip-checksum"}),
                 "run", "truncated");
  expect_failure(run({"bench", "--packed", path("case.safetensors")}), "bench", "magic");
}

TEST_F(CliPacked, BenchTimesAPackedFileAtItsShapes) {
  ASSERT_EQ(
      run({"pack", "--input", path("case.safetensors"), "--output", path("w.w4a8")}).exit_code, 0);
  const Result r = run({"bench", "--packed", path("w.w4a8"), "--tokens", "5", "--repeat", "1",
                        "--threads", "2", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["packed_file"], path("w.w4a8"));
  EXPECT_EQ(j["tokens"], 5);
  EXPECT_EQ(j["group"], 32);
  EXPECT_TRUE(j["check_max_rel_err"].is_null());
  // top-k 3 and swigluoai from the file: 5 tokens x 3 slots x 3 x H x I multiply-accumulates
  EXPECT_EQ(j["macs"].get<double>(), 5.0 * 3 * 3 * 128 * 64);
  // the cold read of the same bytes, timed in the same run
  EXPECT_GT(j["cold_read_ms"].get<double>(), 0.0);
  EXPECT_GT(j["cold_read_fraction"].get<double>(), 0.0);
  const Result both = run({"bench", "--packed", path("w.w4a8"), "--preset", "tiny"});
  EXPECT_NE(both.exit_code, 0);
}

TEST_F(CliPacked, PackFailuresAreOneLine) {
  expect_failure(run({"pack", "--input", path("missing.safetensors"), "--output", path("w.w4a8")}),
                 "pack", "missing.safetensors");
  expect_failure(
      run({"pack", "--input", path("case.safetensors"), "--output", path("no_dir/w.w4a8")}), "pack",
      "no_dir");
  expect_failure(run({"pack", "--input", path("case.safetensors"), "--output", path("w.w4a8"),
                      "--kernel-set", "nonesuch"}),
                 "pack", "nonesuch");
  expect_failure(run({"pack", "--input", path("case.safetensors"), "--output", path("w.w4a8"),
                      "--scales", "f8"}),
                 "pack", "--scales");
  EXPECT_FALSE(fs::exists(path("w.w4a8")));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"case.safetensors", "stderr.txt", "stdout.txt"}));
}

}  // namespace
