// The quantization_config of a GPTQ or AutoAWQ checkpoint, and the layouts of their tensors, as
// transformers loads them (per linear module M):
//
// GPTQ (AutoGPTQ / GPTQModel, checkpoint_format "gptq", or "gptq_v2"):
//   M.qweight  I32 [K/8, N]   packed along the input: element (k, n) unsigned in bits 4 (k % 8)
//                             of word [k / 8, n]
//   M.qzeros   I32 [G, N/8]   packed along the output: zero (g, n) in bits 4 (n % 8) of word
//                             [g, n / 8], stored as zero - 1 ("gptq"; "gptq_v2": as is)
//   M.scales   F16 [G, N]
//   M.g_idx    I32 [K]        the group of input k: k / group_size unless act-order (desc_act)
//   element (k, n) = (q - zero) * scale of group g_idx[k]; sym: zero is 8
// AWQ (AutoAWQ "gemm"):
//   M.qweight  I32 [K, N/8]   packed along the output in the order 0 2 4 6 1 3 5 7: output
//                             8w + j in bits 4 kAwqNibble[j] of word [k, w]
//                             (w4a8moe/checkpoint.hpp)
//   M.qzeros   I32 [G, N/8]   the same order, zeros as is
//   M.scales   F16 [G, N]
//   element (k, n) = (q - zero) * scale of group k / group_size
// G = K / group_size (1 for group_size -1). w4a8moe holds q - 8 and zero - 8 (both in [-8, 7]).
#pragma once

#include <array>
#include <nlohmann/json.hpp>
#include <string>

namespace w4a8moe::io {

struct GptqScheme {
  bool awq = false;              // AutoAWQ; else GPTQ
  int group_size = -1;           // -1: one group per row
  bool symmetric = false;        // GPTQ sym: every zero is 8 (then plain symmetric int4)
  bool desc_act = false;         // GPTQ act-order: g_idx may permute the groups
  bool zeros_minus_one = false;  // GPTQ "gptq" (v1) checkpoints store zero - 1
};

// Reads config.json's quantization_config `q` (quant_method "gptq" or "awq"); throws Error naming
// the folder unless the weights are 4-bit in a layout above.
GptqScheme read_gptq_scheme(const std::string& folder, const nlohmann::json& q);

}  // namespace w4a8moe::io
