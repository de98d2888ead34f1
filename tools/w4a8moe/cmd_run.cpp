// w4a8moe run CASE.safetensors OUT.safetensors: one forward call on the inputs of a case file.
//
// Packs w13 and w2 for the active kernel set (or, with --packed W.w4a8, maps the experts of a
// file written by `w4a8moe pack` after checking they are the case's), runs forward() and writes
// `out` [T, H] in the dtype of x, with the kernel set and the thread count in the metadata.
#include <cstdio>
#include <cstring>
#include <string>

#include "io/case_file.hpp"
#include "io/safetensors_writer.hpp"
#include "w4a8moe/commands.hpp"
#include "w4a8moe/forward_parts.hpp"
#include "w4a8moe/parallel.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::cli {

namespace {

// ---- --packed W.w4a8 ----
// The file's experts must be the case's: same E, H, I, group size and biases.
void check_packed_matches_case(const PackedFile& file, const io::LoadedCase& c) {
  const PackedFileInfo& f = file.info();
  const TensorView& w13 = c.weights.w13;
  const int64_t experts = w13.shape[0], inter = w13.shape[1] / 2;
  const int64_t hidden = w13.dtype == DType::u8 ? w13.shape[2] * 2 : w13.shape[2];
  const bool b13 = !c.weights.w13_bias.empty(), b2 = !c.weights.w2_bias.empty();
  if (f.experts != experts || f.hidden != hidden || f.inter != inter ||
      f.group_size != c.weights.group_size || f.w13.has_bias != b13 || f.w2.has_bias != b2) {
    auto describe = [](int64_t e, int64_t h, int64_t i, int g, bool bias13, bool bias2) {
      return std::to_string(e) + " experts, H " + std::to_string(h) + ", I " + std::to_string(i) +
             ", group " + std::to_string(g) + ", biases " + (bias13 ? "w13" : "-") + "/" +
             (bias2 ? "w2" : "-");
    };
    throw Error(
        "--packed: expected experts matching the case (" +
        describe(experts, hidden, inter, c.weights.group_size, b13, b2) + "), got '" + file.path() +
        "' with " +
        describe(f.experts, f.hidden, f.inter, f.group_size, f.w13.has_bias, f.w2.has_bias));
  }
}

// The experts of the case: mapped from --packed (verified to be the case's), or packed here
// (under --expert-parallel: this process's share).
PackedExperts case_experts(const RunOptions& options, const io::LoadedCase& c,
                           const Parallel& parallel) {
  if (parallel.on() && !options.packed.empty())
    throw Error(
        "--packed: expected no packed file with --expert-parallel (each process packs "
        "its share of the case's experts), got '" +
        options.packed + "'");
  if (options.packed.empty()) {
    PackOptions po = c.pack_options();
    po.experts = parallel.local_experts(c.weights.w13.shape[0]);
    return PackedExperts::pack(c.weights, po);
  }
  PackedExperts experts = PackedExperts::open(options.packed, options.skip_checksum);
  check_packed_matches_case(experts.file, c);
  return experts;
}

// Writes `out` with the kernel set, the thread count and the activation in the metadata.
void write_run_output(const std::string& path, const OutputTensor& out,
                      const std::string& kernel_set, const Context& context,
                      const MoeParams& params, const Parallel& parallel) {
  io::SafetensorsWriter writer;
  out.add_to(writer, "out");
  if (parallel.on()) {
    writer.set_metadata("expert_parallel", parallel.way());
    writer.set_metadata("processes", std::to_string(parallel.ranks()));
  }
  writer.set_metadata("kernel_set", kernel_set);
  writer.set_metadata("threads", std::to_string(context.threads()));
  writer.set_metadata("activation", activation_name(params.activation));
  writer.write(path);
}

// Under --expert-parallel: this process's share of the forward, then out whole on process 0.
void run_parallel(Parallel& parallel, Context& context, const io::LoadedCase& c,
                  const PackedExperts& experts, OutputTensor& out) {
  const int64_t K = c.topk_ids.shape[1], H = c.x.shape[1];
  parallel.setup(c.weights.w13.shape[0], experts.w13, experts.w2, K, c.params);
  const int64_t n = parallel.token_run(c.x.shape[0]).second;  // this process's tokens
  OutputTensor mine(c.x.dtype, n, H);
  parallel.forward(context, parallel.rows_of(c.x), parallel.rows_of(c.topk_ids),
                   parallel.rows_of(c.topk_weights), mine.view);
  const std::vector<uint8_t> all =
      parallel.gather_rows({reinterpret_cast<const uint8_t*>(mine.storage.data()), mine.bytes});
  if (parallel.rank() == 0) std::memcpy(out.storage.data(), all.data(), out.bytes);
}

}  // namespace

int run_command(const RunOptions& options) {
  Parallel parallel(options.execution, "exact");
  const io::LoadedCase c = io::load_case(options.input);
  const PackedExperts experts = case_experts(options, c, parallel);

  Context context(options.execution.threads);
  configure_context(context, options.execution);
  const int64_t tokens = c.x.shape[0];
  const int64_t hidden = c.x.shape[1];
  OutputTensor out(c.x.dtype, tokens, hidden);
  if (parallel.on()) {
    run_parallel(parallel, context, c, experts, out);
    if (parallel.rank() != 0) return 0;  // process 0 writes the output
  } else {
    forward(context, c.x, c.topk_ids, c.topk_weights, experts.w13, experts.w2, c.params, out.view);
  }

  const std::string kernel_set = options.packed.empty()
                                     ? active_kernel_set()
                                     : kernel_set_for_layout(experts.file.info().w13.layout);
  write_run_output(options.output, out, kernel_set, context, c.params, parallel);
  std::fprintf(
      stderr, "w4a8moe run: wrote out [%lld, %lld] %s to %s (kernel set %s, %d threads%s)\n",
      static_cast<long long>(tokens), static_cast<long long>(hidden), dtype_name(c.x.dtype),
      options.output.c_str(), kernel_set.c_str(), context.threads(),
      parallel.on()
          ? (", " + parallel.way() + " over " + std::to_string(parallel.ranks()) + " processes")
                .c_str()
          : "");
  return 0;
}

}  // namespace w4a8moe::cli
