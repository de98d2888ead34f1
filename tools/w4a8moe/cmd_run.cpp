// w4a8moe run CASE.safetensors OUT.safetensors: one forward call on the inputs of a case file.
//
// Packs w13 and w2 for the active kernel set, runs forward() and writes `out` [T, H] in the dtype
// of x, with the kernel set and the thread count recorded in the metadata.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "io/safetensors.hpp"
#include "w4a8moe/commands.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::cli {

int run_command(const RunOptions& options) {
  try {
    const io::LoadedCase c = io::load_case(options.input);
    const PackOptions pack_options = c.pack_options();
    const LogicalWeights& w = c.weights;
    const PackedWeights w13 = pack_w13(w.w13, w.w13_scale, w.w13_bias, pack_options);
    const PackedWeights w2 = pack_w2(w.w2, w.w2_scale, w.w2_bias, pack_options);

    Context context(options.threads);
    const int64_t tokens = c.x.shape[0];
    const int64_t hidden = c.x.shape[1];
    // x's shape came from a checked file, so this product matches bytes that exist in memory.
    const size_t out_bytes =
        static_cast<size_t>(tokens) * static_cast<size_t>(hidden) * dtype_bytes(c.x.dtype);
    std::vector<uint64_t> out_storage(out_bytes / sizeof(uint64_t) + 1);  // 8-byte aligned
    const MutableTensorView out =
        MutableTensorView::of(out_storage.data(), c.x.dtype, {tokens, hidden});
    forward(context, c.x, c.topk_ids, c.topk_weights, w13.bytes(), w2.bytes(), c.params, out);

    const std::string kernel_set = active_kernel_set();
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
