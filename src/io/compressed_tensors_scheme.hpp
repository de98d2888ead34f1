// The quantization_config of a compressed-tensors checkpoint: which config group quantizes the
// experts, and that its weights are what w4a8moe reads exactly (int4, symmetric or with zero
// points, group, channel or tensor strategy, with or without actorder "group").
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace w4a8moe::io {

struct CompressedTensorsScheme {
  std::string format;      // "pack-quantized", "int-quantized", ... ("" when not given)
  std::string strategy;    // group, channel or tensor
  int group_size = 0;      // 0: not given
  bool symmetric = true;   // false: weight_zero_point tensors, element (q - z) * scale
  bool act_order = false;  // actorder "group": weight_g_idx tensors (as GPTQ's g_idx)
};

// Reads config.json's quantization_config `q` for the experts whose first projection is
// `module` (e.g. "model.layers.0.mlp.experts.0.gate_proj"). The experts' group: the only group
// with weights; else the first whose targets name "Linear" or `module`; else, when every group
// with weights says the same about them, any ("re:" targets are not evaluated). Throws Error
// naming the folder for anything else.
CompressedTensorsScheme read_compressed_tensors_scheme(const std::string& folder,
                                                       const nlohmann::json& q,
                                                       const std::string& module);

}  // namespace w4a8moe::io
