// w4a8moe pack --input CASE.safetensors --output W.w4a8: packs a case's experts once, into a file
// that `run --packed` and `bench --packed` map instead of repacking.
//
// The file records the layout (of the kernel set packed for), the shapes, the group size and a
// checksum, and the case's activation settings and top-k for the tools. It is written to an
// unnamed or temporary file, fsynced and renamed, so a crash never leaves a partial W.w4a8.
#include <cstdio>
#include <string>

#include "io/case_file.hpp"
#include "w4a8moe/commands.hpp"
#include "w4a8moe/forward_parts.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::cli {

int pack_command(const PackCommandOptions& options) {
  PackOptions pack_options;
  if (options.scales == "bf16") {
    pack_options.scale_storage = ScaleStorage::bf16;
  } else if (options.scales != "as_given") {
    throw Error("--scales: expected as_given or bf16, got '" + options.scales + "'");
  }
  const io::LoadedCase c = io::load_case(options.input);
  const PackOptions from_case = c.pack_options();
  pack_options.group_size = from_case.group_size;
  pack_options.gate_up_layout = from_case.gate_up_layout;
  pack_options.kernel_set = options.kernel_set;
  const PackedExperts experts = PackedExperts::pack(c.weights, pack_options);

  PackedFileMeta meta;
  meta.has_params = true;
  meta.params = c.params;
  meta.top_k = c.topk_ids.shape[1];
  save_packed(options.output, experts.w13, experts.w2, meta);

  const PackedInfo info = experts.w13_packed.info();
  std::fprintf(stderr,
               "w4a8moe pack: wrote %lld experts (H %lld, I %lld, group %d, layout %s), %zu "
               "bytes, to %s\n",
               static_cast<long long>(info.experts), static_cast<long long>(info.cols),
               static_cast<long long>(info.rows / 2), info.group_size, info.layout.c_str(),
               experts.w13.size() + experts.w2.size(), options.output.c_str());
  return 0;
}

}  // namespace w4a8moe::cli
