// Fuzz target: the safetensors readers (io::MappedSafetensors; io::SafetensorsFile and
// io::load_case), then what `w4a8moe run` does with a case it accepted: pack both tensors and run
// forward() and reference_forward(), under memory limits. Input: the bytes of a file.
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_common.hpp"
#include "io/case_file.hpp"
#include "io/mapped_safetensors.hpp"

namespace {

using namespace w4a8moe;

void run_case(const io::LoadedCase& c) {
  PackOptions options = c.pack_options();
  options.memory_limit = size_t{64} << 20;
  const LogicalWeights& w = c.weights;
  const PackedWeights w13 = pack_w13(w.w13, w.w13_scale, w.w13_bias, options);
  const PackedWeights w2 = pack_w2(w.w2, w.w2_scale, w.w2_bias, options);
  const int64_t T = c.x.shape[0], H = c.x.shape[1];
  std::vector<uint8_t> out(static_cast<size_t>(T * H) * dtype_bytes(c.x.dtype));
  static Context context(1);
  context.set_memory_limit(size_t{64} << 20);
  const MutableTensorView ov = MutableTensorView::of(out.data(), c.x.dtype, {T, H});
  forward(context, c.x, c.topk_ids, c.topk_weights, w13.bytes(), w2.bytes(), c.params, ov);
  reference_forward(c.x, c.topk_ids, c.topk_weights, w, c.params, ov);
}

}  // namespace

W4A8MOE_FUZZ_TARGET(safetensors) {
  const w4a8moe::fuzz::MemFile file({data, size});
  try {  // the memory-mapped reader of checkpoints: same checks, data left in the file
    const w4a8moe::io::MappedSafetensors mapped = w4a8moe::io::MappedSafetensors::open(file.path());
    uint64_t sum = 0;
    for (const std::string& name : mapped.names()) {
      const std::span<const uint8_t> bytes = mapped.bytes(name);
      if (bytes.size() != mapped.entry(name).size_bytes) w4a8moe::fuzz::finding("tensor size");
      for (const uint8_t b : bytes) sum = sum * 31 + b;  // every byte it hands out is readable
    }
    if (sum == 0x5eed5eed5eed5eedull) w4a8moe::fuzz::finding("(keeps the reads)");
  } catch (const w4a8moe::Error&) {
  }
  try {
    const w4a8moe::io::LoadedCase c = w4a8moe::io::load_case(file.path());
    run_case(c);
  } catch (const w4a8moe::Error&) {
  }
  return 0;
}
