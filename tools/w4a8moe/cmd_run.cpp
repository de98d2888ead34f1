// w4a8moe run CASE.safetensors OUT.safetensors: one forward call on the inputs of a case file.
//
// Packs w13 and w2 for the active kernel set (or, with --packed W.w4a8, maps the experts of a
// file written by `w4a8moe pack` after checking they are the case's), runs forward() and writes
// `out` [T, H] in the dtype of x, with the kernel set and the thread count in the metadata.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "io/case_file.hpp"
#include "io/safetensors_writer.hpp"
#include "w4a8moe/commands.hpp"
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

}  // namespace

int run_command(const RunOptions& options) {
  try {
    const io::LoadedCase c = io::load_case(options.input);
    const PackOptions pack_options = c.pack_options();
    const LogicalWeights& w = c.weights;
    // The experts come from a packed file (mapped, verified), or are packed here.
    PackedFile file;
    PackedWeights w13_packed, w2_packed;
    std::span<const uint8_t> w13, w2;
    if (!options.packed.empty()) {
      PackedFileOptions file_options;
      file_options.verify_checksum = !options.skip_checksum;
      file = PackedFile::open(options.packed, file_options);
      check_packed_matches_case(file, c);
      w13 = file.w13();
      w2 = file.w2();
    } else {
      w13_packed = pack_w13(w.w13, w.w13_scale, w.w13_bias, pack_options);
      w2_packed = pack_w2(w.w2, w.w2_scale, w.w2_bias, pack_options);
      w13 = w13_packed.bytes();
      w2 = w2_packed.bytes();
    }

    Context context(options.threads);
    const int64_t tokens = c.x.shape[0];
    const int64_t hidden = c.x.shape[1];
    // x's shape came from a checked file, so this product matches bytes that exist in memory.
    const size_t out_bytes =
        static_cast<size_t>(tokens) * static_cast<size_t>(hidden) * dtype_bytes(c.x.dtype);
    std::vector<uint64_t> out_storage(out_bytes / sizeof(uint64_t) + 1);  // 8-byte aligned
    const MutableTensorView out =
        MutableTensorView::of(out_storage.data(), c.x.dtype, {tokens, hidden});
    forward(context, c.x, c.topk_ids, c.topk_weights, w13, w2, c.params, out);

    const std::string kernel_set = options.packed.empty()
                                       ? active_kernel_set()
                                       : kernel_set_for_layout(file.info().w13.layout);
    io::SafetensorsWriter writer;
    writer.add("out", c.x.dtype, {tokens, hidden}, out_storage.data(), out_bytes);
    writer.set_metadata("kernel_set", kernel_set);
    writer.set_metadata("threads", std::to_string(context.threads()));
    writer.set_metadata("activation", activation_name(c.params.activation));
    writer.write(options.output);

    std::fprintf(
        stderr, "w4a8moe run: wrote out [%lld, %lld] %s to %s (kernel set %s, %d threads)\n",
        static_cast<long long>(tokens), static_cast<long long>(hidden), dtype_name(c.x.dtype),
        options.output.c_str(), kernel_set.c_str(), context.threads());
    return 0;
  } catch (const std::exception& e) {
    // w4a8moe::Error and anything else (bad_alloc, filesystem errors) end the same way.
    std::fprintf(stderr, "w4a8moe run: %s\n", e.what());
    return 1;
  }
}

}  // namespace w4a8moe::cli
