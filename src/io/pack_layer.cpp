// Streaming a layer's experts into the packer (checkpoint.hpp, pack_layer).
#include <algorithm>

#include "io/checkpoint.hpp"
#include "thread_pool.hpp"
#include "w4a8moe/expert_packer.hpp"

namespace w4a8moe::io {

PackedLayer pack_layer(const LayerSource& source, int threads,
                       const std::function<void(double)>& progress) {
  const LayerInfo& info = source.info();
  threads = loader_threads(threads);
  const int64_t first = source.experts().first, count = source.experts().count;
  const int64_t chunk = std::min<int64_t>(threads, count);
  ExpertChunk buffers(info, chunk);
  PackOptions options;
  options.group_size = info.group_size;
  options.weight_format = info.w13_format;
  ExpertPacker p13(WeightRole::w13, count, options);
  options.weight_format = info.w2_format;
  ExpertPacker p2(WeightRole::w2, count, options);
  for (int64_t done = 0; done < count; done += chunk) {
    const int64_t n = std::min(chunk, count - done), e0 = first + done;
    detail::parallel_for(n, threads, [&](int64_t i) {
      source.load_expert(e0 + i, buffers.slot(i));
      source.release_expert(e0 + i);
    });
    p13.append(buffers.w13(n), buffers.w13_scale(n), buffers.w13_zero_point(n), buffers.w13_bias(n),
               buffers.w13_input_order(n));
    p2.append(buffers.w2(n), buffers.w2_scale(n), buffers.w2_zero_point(n), buffers.w2_bias(n));
    if (progress) progress(static_cast<double>(done + n) / static_cast<double>(count));
  }
  return {std::move(p13).finish(), std::move(p2).finish()};
}

}  // namespace w4a8moe::io
