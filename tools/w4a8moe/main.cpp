// The w4a8moe program: bench, run, layer, check. Command-line parsing with CLI11.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "w4a8moe/commands.hpp"
#include "w4a8moe/synthetic.hpp"

namespace {

// The options of ExecutionOptions, the same for every command that runs forward(): a new one is
// its field there and its line here.
void add_execution_options(CLI::App* command, w4a8moe::cli::ExecutionOptions& options) {
  command->add_option("--threads", options.threads, "threads (0: all hardware threads)")
      ->capture_default_str();
  command->add_option("--expert-parallel", options.expert_parallel,
                      "under mpirun: all-reduce or dispatch; each process holds its share of "
                      "the experts");
  command->add_option("--ep-results", options.ep_results,
                      "dispatch: f32, bf16, or exact (a row per slot: the one-process bits "
                      "whatever N); default exact for run, f32 for bench");
}

}  // namespace

int main(int argc, char** argv) {
  using namespace w4a8moe::cli;
  CLI::App app{"w4a8moe: the Mixture-of-Experts layer with int4 weights and int8 activations"};
  app.require_subcommand(1);

  std::string preset_names;
  for (const Preset& p : presets())
    preset_names += (preset_names.empty() ? "" : ", ") + std::string(p.name);

  BenchOptions bench;
  CLI::App* b = app.add_subcommand("bench", "time a real model's MoE layer (synthetic weights)");
  b->add_option("--preset", bench.preset, "model shape: " + preset_names)->capture_default_str();
  b->add_option("--tokens", bench.tokens, "tokens per forward (T)")->capture_default_str();
  add_execution_options(b, bench.execution);
  b->add_option("--group", bench.group, "weight group size, -1 for channelwise")
      ->capture_default_str();
  b->add_option("--dtype", bench.dtype, "activation dtype: f32, bf16 or f16")
      ->capture_default_str();
  b->add_option("--scales", bench.scales, "scale dtype: f32, bf16 or f16")->capture_default_str();
  b->add_option("--routing", bench.routing, "uniform or skewed (a few hot experts)")
      ->capture_default_str();
  b->add_option("--repeat", bench.repeat, "timed runs; the median is reported")
      ->capture_default_str();
  b->add_option("--seed", bench.seed, "seed of the synthetic data")->capture_default_str();
  b->add_flag("--json", bench.json, "print one JSON object on stdout");
  b->add_flag("!--no-check", bench.check, "skip the check against the reference");

  RunOptions run;
  CLI::App* r = app.add_subcommand("run", "run one layer from a safetensors case file");
  r->add_option("--input", run.input, "CASE.safetensors with x, topk_ids, topk_weights, w13, ...")
      ->required();
  r->add_option("--output", run.output, "OUT.safetensors to write tensor `out` to")->required();
  add_execution_options(r, run.execution);
  // ---- packed weight files: run --packed, bench --packed, pack ----
  r->add_option("--packed", run.packed,
                "W.w4a8 (from `w4a8moe pack`): its experts, not the case's");
  r->add_flag("--skip-checksum", run.skip_checksum, "do not hash the packed file's payload");
  b->add_option("--packed", bench.packed, "W.w4a8 (from `w4a8moe pack`): time its experts")
      ->excludes(b->get_option("--preset"))
      ->excludes(b->get_option("--group"))
      ->excludes(b->get_option("--scales"));
  b->add_flag("--skip-checksum", bench.skip_checksum, "do not hash the packed file's payload");
  PackCommandOptions pack;
  CLI::App* pk = app.add_subcommand("pack", "pack a case's experts into a file for later runs");
  pk->add_option("--input", pack.input, "CASE.safetensors with w13, w13_scale, w2, w2_scale, ...")
      ->required();
  pk->add_option("--output", pack.output, "W.w4a8 to write")->required();
  pk->add_option("--kernel-set", pack.kernel_set,
                 "pack for this kernel set (default: the best one this machine runs)");
  pk->add_option("--scales", pack.scales, "stored scales: as_given or bf16")->capture_default_str();

  // ---- w4a8moe layer ----
  LayerOptions layer;
  CLI::App* l = app.add_subcommand(
      "layer",
      "run one MoE layer of a GGUF file or compressed-tensors folder, routed by its router");
  l->add_option("--model", layer.model, "PATH: a .gguf file or a checkpoint folder")->required();
  l->add_option("--layer", layer.layer, "layer index N")->required();
  auto* layer_tokens = l->add_option("--tokens", layer.tokens, "random hidden states: T tokens")
                           ->capture_default_str();
  l->add_option("--input", layer.input, "X.safetensors with tensor x [T, H] (F32/BF16/F16)")
      ->excludes(layer_tokens);
  l->add_option("--output", layer.output, "OUT.safetensors: out [T, H], topk_ids, topk_weights");
  add_execution_options(l, layer.execution);
  l->add_option("--repeat", layer.repeat, "timed runs; the median is reported")
      ->capture_default_str();
  l->add_option("--seed", layer.seed, "seed of the random hidden states")->capture_default_str();
  l->add_option("--group", layer.group, "group size for weights converted to int4 (-1: per row)")
      ->capture_default_str();
  l->add_flag("--exact", layer.exact, "refuse weights that do not map exactly onto int4");
  l->add_flag("--compare", layer.compare, "also run the float reference and print the error");
  l->add_flag("--shared-experts", layer.shared_experts,
              "include the layer's shared expert in out (DeepSeek, Qwen2-MoE, Llama-4)");

  CheckOptions check;
  CLI::App* c =
      app.add_subcommand("check", "show CPU features and kernel sets; check a configuration");
  auto* hidden = c->add_option("--hidden", check.hidden, "hidden size H");
  auto* inter = c->add_option("--inter", check.inter, "intermediate size I");
  auto* experts = c->add_option("--experts", check.experts, "number of experts E");
  auto* top_k = c->add_option("--top-k", check.top_k, "experts per token K");
  c->add_option("--group", check.group, "group size, -1 for channelwise")->capture_default_str();
  c->add_option("--dtype", check.dtype, "activation dtype: f32, bf16 or f16")
      ->capture_default_str();
  c->add_option("--activation", check.activation, "silu, swigluoai, swiglustep, gelu, gelu_tanh")
      ->capture_default_str();
  std::string check_preset;
  auto* preset_opt =
      c->add_option("--preset", check_preset, "take H, I, E, K and the activation from a preset");
  hidden->needs(inter, experts, top_k);
  preset_opt->excludes(hidden);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  try {
    if (b->parsed()) return bench_command(bench);
    if (r->parsed()) return run_command(run);
    if (pk->parsed()) return pack_command(pack);
    if (l->parsed()) return layer_command(layer);
    if (!check_preset.empty()) {
      const Preset& p = find_preset(check_preset);
      check.hidden = p.hidden;
      check.inter = p.inter;
      check.experts = p.experts;
      check.top_k = p.top_k;
      check.activation = w4a8moe::activation_name(p.activation);
    }
    check.has_config = !check_preset.empty() || hidden->count() > 0;
    return check_command(check);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "w4a8moe %s: %s\n", app.get_subcommands().front()->get_name().c_str(),
                 e.what());
    return 1;
  }
}
