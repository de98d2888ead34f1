// The subcommands of the w4a8moe program. Each returns the process exit code, or throws for bad
// input: main.cpp parses the command line (CLI11), dispatches, and reports what a command threw
// on stderr as one sentence, `w4a8moe COMMAND: message`.
#pragma once

#include <string>

namespace w4a8moe::cli {

// How the forward calls of bench, run and layer run: main.cpp registers these options for the
// three commands (add_execution_options) and each command makes its Context from them
// (configure_context in forward_parts.hpp). An option of the forward calls themselves goes here.
struct ExecutionOptions {
  int threads = 0;   // 0: the hardware's thread count
  int spin_us = -1;  // Context::set_spin_wait in microseconds; -1: the library's default
  // Under mpirun: "all-reduce" or "dispatch" (parallel.hpp); empty: one process.
  std::string expert_parallel;
  // dispatch: how results travel back: f32, bf16, or exact (f32 rows per slot: forward()'s
  // bits whatever the process count); empty: the command's default (run exact, bench f32)
  std::string ep_results;
};

struct BenchOptions {
  std::string preset = "qwen3-30b-a3b";
  int tokens = 1;
  ExecutionOptions execution;
  int group = 32;
  std::string dtype = "f32";
  std::string routing = "uniform";
  std::string scales = "bf16";
  std::string weights = "int4";  // int4, int4_zp or mxfp4 (group 32)
  bool act_order = false;        // w13 with a random input order per expert
  int repeat = 10;
  bool json = false;
  bool check = true;
  unsigned seed = 1;
  std::string packed;          // W.w4a8 to take the experts from (the file's shapes)
  bool skip_checksum = false;  // open it without hashing the payload
};

struct RunOptions {
  std::string input;   // CASE.safetensors
  std::string output;  // OUT.safetensors
  ExecutionOptions execution;
  std::string packed;          // W.w4a8 to take the experts from instead of packing
  bool skip_checksum = false;  // open it without hashing the payload
};

// ---- w4a8moe pack: a case's experts packed into a W.w4a8 file ----
struct PackCommandOptions {
  std::string input;       // CASE.safetensors
  std::string output;      // W.w4a8
  std::string kernel_set;  // empty: the set forward() picks on this machine
  std::string scales = "as_given";
};
int pack_command(const PackCommandOptions& options);

struct CheckOptions {
  bool has_config = false;
  std::string dtype = "f32";
  long long hidden = 0, inter = 0, experts = 0, top_k = 0, group = -1;
  std::string activation = "silu";
};

// ---- w4a8moe layer: one MoE layer of a GGUF file or compressed-tensors folder ----
struct LayerOptions {
  std::string model;  // PATH: a .gguf file or a checkpoint folder
  int layer = 0;
  int tokens = 8;              // random hidden states when there is no input file
  std::string input;           // X.safetensors with x [T, H]
  std::string output;          // OUT.safetensors: out [T, H], topk_ids, topk_weights
  ExecutionOptions execution;  // its threads also load, pack and run the float reference
  int repeat = 5;
  unsigned seed = 1;
  int group = 32;      // group size of converted (not exactly mapped) weights
  bool exact = false;  // refuse conversions
  bool compare = false;
  bool shared_experts = false;  // add the layer's shared expert (if it has one) to `out`
};
int layer_command(const LayerOptions& options);

int bench_command(const BenchOptions& options);
int run_command(const RunOptions& options);
int check_command(const CheckOptions& options);

}  // namespace w4a8moe::cli
