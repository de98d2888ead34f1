// The subcommands of the w4a8moe program. Each returns the process exit code and reports errors
// on stderr as one sentence; main.cpp parses the command line (CLI11) and dispatches.
#pragma once

#include <string>

namespace w4a8moe::cli {

struct BenchOptions {
  std::string preset = "qwen3-30b-a3b";
  int tokens = 1;
  int threads = 0;  // 0: hardware
  int group = 32;
  std::string dtype = "f32";
  std::string routing = "uniform";
  std::string scales = "bf16";
  int repeat = 10;
  bool json = false;
  bool check = true;
  unsigned seed = 1;
};

struct RunOptions {
  std::string input;   // CASE.safetensors
  std::string output;  // OUT.safetensors
  int threads = 0;
};

struct CheckOptions {
  bool has_config = false;
  std::string dtype = "f32";
  long long hidden = 0, inter = 0, experts = 0, top_k = 0, group = -1;
  std::string activation = "silu";
};

int bench_command(const BenchOptions& options);
int run_command(const RunOptions& options);
int check_command(const CheckOptions& options);

}  // namespace w4a8moe::cli
