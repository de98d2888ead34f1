// Case files: the inputs of one forward call, in a safetensors file.
//
// Tensors: x [T, H] (F32/BF16/F16); topk_ids [T, K] (I32/I64); topk_weights [T, K];
// w13 (I8 [E, 2I, H] or U8 [E, 2I, H/2] nibble-packed), w13_scale, optional w13_bias [E, 2I];
// w2 (I8 [E, H, I] or U8 [E, H, I/2]), w2_scale, optional w2_bias [E, H].
// Metadata: group_size (required: "-1" or an integer), activation (required: silu, swigluoai,
// swiglustep, gelu, gelu_tanh), alpha and limit (optional numbers),
// apply_router_weight_on_input (optional: "true"/"false"), gate_up_layout (optional: "halves" or
// "interleaved"). Other metadata keys are ignored. Cross-tensor shapes are checked by the
// library's pack and forward calls, not here.
#pragma once

#include <string>

#include "io/safetensors_file.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io {

struct LoadedCase {
  LoadedCase() = default;
  LoadedCase(const LoadedCase&) = delete;  // the views point into `file`
  LoadedCase& operator=(const LoadedCase&) = delete;
  LoadedCase(LoadedCase&&) = default;  // moving keeps the tensor buffers in place
  LoadedCase& operator=(LoadedCase&&) = default;

  SafetensorsFile file;  // owns the bytes of every view below
  TensorView x, topk_ids, topk_weights;
  LogicalWeights weights;  // includes group_size and gate_up_layout
  MoeParams params;

  PackOptions pack_options() const {
    PackOptions options;
    options.group_size = weights.group_size;
    options.gate_up_layout = weights.gate_up_layout;
    return options;
  }
};

// Reads and checks a case file; throws Error naming the file and the tensor or metadata key.
LoadedCase load_case(const std::string& path);

}  // namespace w4a8moe::io
