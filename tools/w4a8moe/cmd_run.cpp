// w4a8moe run CASE.safetensors OUT.safetensors: one forward call on the inputs of a case file.
//
// Packs w13 and w2 for the active kernel set (or, with --packed W.w4a8, maps the experts of a
// file written by `w4a8moe pack` after checking they are the case's), runs forward() and writes
// `out` [T, H] in the dtype of x, with the kernel set and the thread count in the metadata.
#include <cstdio>
#include <string>

#include "io/safetensors.hpp"
#include "w4a8moe/commands.hpp"
#include "w4a8moe/forward_parts.hpp"
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

// The experts of the case: mapped from --packed (verified to be the case's), or packed here.
PackedExperts case_experts(const RunOptions& options, const io::LoadedCase& c) {
  if (options.packed.empty()) return PackedExperts::pack(c.weights, c.pack_options());
  PackedExperts experts = PackedExperts::open(options.packed, options.skip_checksum);
  check_packed_matches_case(experts.file, c);
  return experts;
}

// Writes `out` with the kernel set, the thread count and the activation in the metadata.
void write_run_output(const std::string& path, const OutputTensor& out,
                      const std::string& kernel_set, const Context& context,
                      const MoeParams& params) {
  io::SafetensorsWriter writer;
  out.add_to(writer, "out");
  writer.set_metadata("kernel_set", kernel_set);
  writer.set_metadata("threads", std::to_string(context.threads()));
  writer.set_metadata("activation", activation_name(params.activation));
  writer.write(path);
}

}  // namespace

int run_command(const RunOptions& options) {
  const io::LoadedCase c = io::load_case(options.input);
  const PackedExperts experts = case_experts(options, c);

  Context context = make_context(options.execution);
  const int64_t tokens = c.x.shape[0];
  const int64_t hidden = c.x.shape[1];
  OutputTensor out(c.x.dtype, tokens, hidden);
  forward(context, c.x, c.topk_ids, c.topk_weights, experts.w13, experts.w2, c.params, out.view);

  const std::string kernel_set = options.packed.empty()
                                     ? active_kernel_set()
                                     : kernel_set_for_layout(experts.file.info().w13.layout);
  write_run_output(options.output, out, kernel_set, context, c.params);
  std::fprintf(stderr, "w4a8moe run: wrote out [%lld, %lld] %s to %s (kernel set %s, %d threads)\n",
               static_cast<long long>(tokens), static_cast<long long>(hidden),
               dtype_name(c.x.dtype), options.output.c_str(), kernel_set.c_str(),
               context.threads());
  return 0;
}

}  // namespace w4a8moe::cli
