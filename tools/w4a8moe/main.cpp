// The w4a8moe program: bench, run, pack, layer, check. Command-line parsing with CLI11: one
// function per command registers its options, in the order its --help lists them.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <string>

#include "w4a8moe/commands.hpp"
#include "w4a8moe/synthetic.hpp"

namespace {

using namespace w4a8moe::cli;

// The options of ExecutionOptions, the same for every command that runs forward(): a new one is
// its field there and its line here.
void add_execution_options(CLI::App* command, ExecutionOptions& options) {
  command->add_option("--threads", options.threads, "threads (0: all hardware threads)")
      ->capture_default_str();
  command->add_option("--spin-us", options.spin_us,
                      "how long idle worker threads poll before they sleep, in microseconds "
                      "(default: the library's, 200)");
  command->add_option("--expert-parallel", options.expert_parallel,
                      "under mpirun: all-reduce or dispatch; each process holds its share of "
                      "the experts");
  command->add_option("--ep-results", options.ep_results,
                      "dispatch: f32, bf16, or exact (a row per slot: the one-process bits "
                      "whatever N); default exact for run, f32 for bench");
}

// --packed W.w4a8 and --skip-checksum (run and bench).
CLI::Option* add_packed_file_options(CLI::App* command, std::string& packed, bool& skip_checksum,
                                     const std::string& packed_help) {
  CLI::Option* option = command->add_option("--packed", packed, packed_help);
  command->add_flag("--skip-checksum", skip_checksum, "do not hash the packed file's payload");
  return option;
}

// The required --input CASE.safetensors and --output file (run and pack).
void add_case_in_file_out(CLI::App* command, std::string& input, const std::string& input_help,
                          std::string& output, const std::string& output_help) {
  command->add_option("--input", input, input_help)->required();
  command->add_option("--output", output, output_help)->required();
}

CLI::App* add_bench(CLI::App& app, BenchOptions& o) {
  std::string preset_names;
  for (const Preset& p : presets())
    preset_names += (preset_names.empty() ? "" : ", ") + std::string(p.name);
  CLI::App* c = app.add_subcommand("bench", "time a real model's MoE layer (synthetic weights)");
  c->add_option("--preset", o.preset, "model shape: " + preset_names)->capture_default_str();
  c->add_option("--tokens", o.tokens, "tokens per forward (T)")->capture_default_str();
  add_execution_options(c, o.execution);
  c->add_option("--group", o.group, "weight group size, -1 for channelwise")->capture_default_str();
  c->add_option("--dtype", o.dtype, "activation dtype: f32, bf16 or f16")->capture_default_str();
  c->add_option("--scales", o.scales, "scale dtype: f32, bf16 or f16")->capture_default_str();
  c->add_option("--weights", o.weights,
                "weight format: int4, int4_zp (int4 with zero points), or mxfp4 (e2m1 codes, "
                "e8m0 scales; group 32)")
      ->capture_default_str();
  c->add_flag("--act-order", o.act_order,
              "w13 with a random input order per expert, gathered per (token, expert) as for "
              "act-order checkpoints");
  c->add_option("--routing", o.routing, "uniform or skewed (a few hot experts)")
      ->capture_default_str();
  c->add_option("--repeat", o.repeat, "timed runs; the median is reported")->capture_default_str();
  c->add_option("--seed", o.seed, "seed of the synthetic data")->capture_default_str();
  c->add_flag("--json", o.json, "print one JSON object on stdout");
  c->add_flag("!--no-check", o.check, "skip the check against the reference");
  // The file gives the shapes, the group size and the scales.
  add_packed_file_options(c, o.packed, o.skip_checksum,
                          "W.w4a8 (from `w4a8moe pack`): time its experts")
      ->excludes(c->get_option("--preset"))
      ->excludes(c->get_option("--group"))
      ->excludes(c->get_option("--scales"))
      ->excludes(c->get_option("--weights"))
      ->excludes(c->get_option("--act-order"));
  return c;
}

CLI::App* add_run(CLI::App& app, RunOptions& o) {
  CLI::App* c = app.add_subcommand("run", "run one layer from a safetensors case file");
  add_case_in_file_out(c, o.input, "CASE.safetensors with x, topk_ids, topk_weights, w13, ...",
                       o.output, "OUT.safetensors to write tensor `out` to");
  add_execution_options(c, o.execution);
  add_packed_file_options(c, o.packed, o.skip_checksum,
                          "W.w4a8 (from `w4a8moe pack`): its experts, not the case's");
  return c;
}

CLI::App* add_pack(CLI::App& app, PackCommandOptions& o) {
  CLI::App* c = app.add_subcommand("pack", "pack a case's experts into a file for later runs");
  add_case_in_file_out(c, o.input, "CASE.safetensors with w13, w13_scale, w2, w2_scale, ...",
                       o.output, "W.w4a8 to write");
  c->add_option("--kernel-set", o.kernel_set,
                "pack for this kernel set (default: the best one this machine runs)");
  c->add_option("--scales", o.scales, "stored scales: as_given or bf16")->capture_default_str();
  return c;
}

CLI::App* add_layer(CLI::App& app, LayerOptions& o) {
  CLI::App* c = app.add_subcommand(
      "layer",
      "run one MoE layer of a GGUF file or compressed-tensors folder, routed by its router");
  c->add_option("--model", o.model, "PATH: a .gguf file or a checkpoint folder")->required();
  c->add_option("--layer", o.layer, "layer index N")->required();
  CLI::Option* tokens =
      c->add_option("--tokens", o.tokens, "random hidden states: T tokens")->capture_default_str();
  c->add_option("--input", o.input, "X.safetensors with tensor x [T, H] (F32/BF16/F16)")
      ->excludes(tokens);
  c->add_option("--output", o.output, "OUT.safetensors: out [T, H], topk_ids, topk_weights");
  add_execution_options(c, o.execution);
  c->add_option("--repeat", o.repeat, "timed runs; the median is reported")->capture_default_str();
  c->add_option("--seed", o.seed, "seed of the random hidden states")->capture_default_str();
  c->add_option("--group", o.group, "group size for weights converted to int4 (-1: per row)")
      ->capture_default_str();
  c->add_flag("--exact", o.exact, "refuse weights that do not map exactly onto int4");
  c->add_flag("--compare", o.compare, "also run the float reference and print the error");
  c->add_flag("--shared-experts", o.shared_experts,
              "include the layer's shared expert in out (DeepSeek, Qwen2-MoE, Llama-4)");
  return c;
}

// check's options, and what main needs after parsing: whether a configuration was given.
struct CheckCommand {
  CheckOptions options;
  std::string preset;  // --preset: H, I, E, K and the activation from it
  CLI::Option* hidden = nullptr;

  void add(CLI::App& app) {
    CLI::App* c =
        app.add_subcommand("check", "show CPU features and kernel sets; check a configuration");
    hidden = c->add_option("--hidden", options.hidden, "hidden size H");
    auto* inter = c->add_option("--inter", options.inter, "intermediate size I");
    auto* experts = c->add_option("--experts", options.experts, "number of experts E");
    auto* top_k = c->add_option("--top-k", options.top_k, "experts per token K");
    c->add_option("--group", options.group, "group size, -1 for channelwise")
        ->capture_default_str();
    c->add_option("--dtype", options.dtype, "activation dtype: f32, bf16 or f16")
        ->capture_default_str();
    c->add_option("--activation", options.activation,
                  "silu, swigluoai, swiglustep, gelu, gelu_tanh")
        ->capture_default_str();
    auto* preset_option =
        c->add_option("--preset", preset, "take H, I, E, K and the activation from a preset");
    hidden->needs(inter, experts, top_k);
    preset_option->excludes(hidden);
  }

  int run() {
    if (!preset.empty()) {
      const Preset& p = find_preset(preset);
      options.hidden = p.hidden;
      options.inter = p.inter;
      options.experts = p.experts;
      options.top_k = p.top_k;
      options.activation = w4a8moe::activation_name(p.activation);
    }
    options.has_config = !preset.empty() || hidden->count() > 0;
    return check_command(options);
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"w4a8moe: the Mixture-of-Experts layer with int4 weights and int8 activations"};
  app.require_subcommand(1);
  BenchOptions bench;
  RunOptions run;
  PackCommandOptions pack;
  LayerOptions layer;
  CheckCommand check;
  CLI::App* const bench_app = add_bench(app, bench);
  CLI::App* const run_app = add_run(app, run);
  CLI::App* const pack_app = add_pack(app, pack);
  CLI::App* const layer_app = add_layer(app, layer);
  check.add(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  try {
    if (bench_app->parsed()) return bench_command(bench);
    if (run_app->parsed()) return run_command(run);
    if (pack_app->parsed()) return pack_command(pack);
    if (layer_app->parsed()) return layer_command(layer);
    return check.run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "w4a8moe %s: %s\n", app.get_subcommands().front()->get_name().c_str(),
                 e.what());
    return 1;
  }
}
