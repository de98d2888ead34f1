// One MoE layer of a Hugging Face checkpoint folder: compressed-tensors int4
// ("pack-quantized" or "int-quantized"), GPTQ or AWQ int4, or plain F16/BF16/F32 weights, in one
// safetensors file or sharded with model.safetensors.index.json, plus config.json.
//
// Per expert J of layer N (prefix "model.layers.N.mlp.experts.J." for Qwen/OLMoE/DeepSeek,
// "model.layers.N.block_sparse_moe.experts.J." with w1/w3/w2 for Mixtral,
// "...layers.N.feed_forward.experts.J." for Llama-4 as llm-compressor saves it):
//   {gate,up,down}_proj.weight_packed  I32 [N, K/8]: eight 4-bit values per word, element 8w + i
//                                      in bits 4i..4i+3 (least significant first), stored as
//                                      value + 8 (offset binary); little-endian words, so the
//                                      bytes are exactly w4a8moe's nibble-packed layout
//   {gate,up,down}_proj.weight_shape   I64/I32 [2] = [N, K]
//   {gate,up,down}_proj.weight_scale   [N, K/g] (strategy group) or [N, 1] (channel); value =
//                                      q * scale (symmetric), or (q - z) * scale with
//   {gate,up,down}_proj.weight_zero_point  (symmetric: false) I32 [ceil(N/8), K/g], z + 8 packed
//                                      eight rows a word like the weights' columns, or I8 [N, K/g]
//   or .weight I8 [N, K] with values in [-8, 7] ("int-quantized"), or .weight F16/BF16/F32 (not
//   quantized: converted on load).
// This follows compressed-tensors' pack_to_int32 / unpack_from_int32 (pack-quantized compressor):
// offset = 1 << (num_bits - 1) is added before packing, shifts are 4 * i for i = 0..7.
//
// Experts fused in two tensors for all E (transformers' GptOssExperts and Llama4TextExperts), in
// the x @ W orientation [E, in, out], converted on load:
//   experts.gate_up_proj [E, H, 2I]    gpt-oss: gate and up INTERLEAVED along the last dimension
//                                      (column 2j gate j, 2j + 1 up j); Llama-4: CONCATENATED
//                                      halves (columns [0, I) gate, [I, 2I) up)
//   experts.down_proj [E, I, H]
//   experts.gate_up_proj_bias [E, 2I], experts.down_proj_bias [E, H]   gpt-oss (same columns)
//   or, as gpt-oss ships them, MXFP4 "<name>_blocks" U8 [E, out, in/32, 16] and "<name>_scales"
//   U8 [E, out, in/32] (one row per output, decode_mxfp4_row).
// Or GPTQ / AWQ modules "{gate,up,down}_proj.{qweight,qzeros,scales,g_idx}" (gptq_scheme.hpp),
// taken exactly: int4 with zero points, or symmetric int4 for GPTQ's sym.
// Routers: "<block>gate.weight" [E, H] (gpt-oss, Llama-4: "<block>router.weight", gpt-oss with
// "router.bias" [E] added to the logits); DeepSeek-V3's "gate.e_score_correction_bias" [E].
// Shared experts (LoadOptions::shared_expert): "<block>shared_experts.{gate,up,down}_proj"
// (DeepSeek), "<block>shared_expert.*" with "<block>shared_expert_gate.weight" [1, H] (Qwen2-MoE),
// "feed_forward.shared_expert.*" (Llama-4), each stored like one routed expert.
//
// The layer source is one class whose parts are in three files by job: opening (hf_layer.cpp:
// where the experts are, their scheme, sizes and checks), routing (hf_routing.cpp: config.json's
// routing, the router tensors) and reading experts (hf_expert_rows.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "io/checkpoint.hpp"
#include "io/compressed_tensors_scheme.hpp"
#include "io/gptq_scheme.hpp"
#include "io/hf_config.hpp"
#include "io/hf_tensors.hpp"
#include "io/model_family.hpp"
#include "pack/checkpoint_rows.hpp"

namespace w4a8moe::io {

// How the layer's experts are stored.
enum class HfScheme { packed, int8, dense, fused_float, fused_mxfp4, gptq, awq };
const char* hf_scheme_name(HfScheme s);

class HfLayer final : public LayerSource {
 public:
  HfLayer(const std::string& folder, int layer, const LoadOptions& options);
  Router router() const override;
  void load_expert(int64_t e, const ExpertSlot& slot) const override;
  void release_expert(int64_t e) const override;

 private:
  [[noreturn]] void fail(const std::string& problem) const { hf_fail(folder_, problem); }
  // The module of projection `which` of expert e (or of the shared expert).
  std::string module(int64_t e, int which) const;
  std::string tensor_name(int64_t e, int which, const char* suffix) const;
  // A fused tensor of the layer: "gate_up_proj", "down_proj_bias", "gate_up_proj_blocks", ...
  std::string fused(int which, const char* suffix) const;
  bool is_fused() const {
    return scheme_ == HfScheme::fused_float || scheme_ == HfScheme::fused_mxfp4;
  }
  bool is_gptq() const { return scheme_ == HfScheme::gptq || scheme_ == HfScheme::awq; }
  bool has(const std::string& name) const { return tensors_.has(name); }
  // A tensor's bytes after checking its dtype and shape; Error naming it otherwise.
  std::span<const uint8_t> require(const std::string& name, DType dtype,
                                   const std::vector<int64_t>& shape) const;
  // The same for a float tensor of any float dtype.
  const TensorEntry& require_float(const std::string& name,
                                   const std::vector<int64_t>& shape) const;
  const TensorEntry& entry(const std::string& name) const { return tensors_.entry(name); }
  std::span<const uint8_t> bytes(const std::string& name) const { return tensors_.bytes(name); }

  // hf_layer.cpp
  void locate_block(int layer);
  void read_sizes();
  void check_modules();       // per-expert (or shared) tensors: shapes, group size, scale dtypes
  void check_fused();         // fused tensors: shapes and dtypes
  void check_gptq_modules();  // GPTQ / AWQ modules: the same as check_modules
  // hf_routing.cpp
  void read_activation();
  void read_routing();
  // hf_expert_rows.cpp
  std::vector<int32_t> load_rows(int which, int64_t e, uint8_t* nibbles, uint8_t* scales,
                                 DType scale_dtype, int8_t* zero_points) const;
  void load_zero_points(int which, int64_t e, int8_t* out) const;
  std::vector<int32_t> load_gptq_rows(int which, int64_t e, uint8_t* nibbles, uint8_t* scales,
                                      DType scale_dtype, int8_t* zero_points) const;
  detail::CheckpointProjection projection(int which, int64_t e, const char* g_idx) const;
  void check_order(int which, int64_t e, const char* g_idx,
                   const std::vector<int32_t>& order) const;
  void decoded(const std::function<void()>& decode) const;
  void load_dense_rows(int which, int64_t e, uint8_t* nibbles, uint8_t* scales,
                       DType scale_dtype) const;
  void load_fused_rows(int which, int64_t e, uint8_t* nibbles, uint8_t* scales, DType scale_dtype,
                       float* bias) const;
  // The column of the fused [in, out] matrix holding output row r of projection `which`.
  int64_t fused_column(int which, int64_t r) const {
    if (which == 2) return r;
    return family_->fused == FusedGateUp::interleaved ? 2 * r + which : which * info_.inter + r;
  }

  std::string folder_;
  LoadOptions options_;
  HfConfig config_;
  HfTensors tensors_;
  const ModelFamily* family_;  // nullptr: a model_type the table does not know
  std::string block_;          // e.g. "model.layers.3.mlp."
  std::string shared_;  // the shared expert's module in the block ("shared_experts"), if opened
  const HfNaming* naming_ = nullptr;
  HfScheme scheme_ = HfScheme::dense;
  std::string router_name_, router_bias_name_, selection_bias_name_;
  std::string topk_method_ = "greedy";
  CompressedTensorsScheme quantization_;  // pack-quantized / int-quantized experts
  GptqScheme gptq_;                       // GPTQ / AWQ experts
};

}  // namespace w4a8moe::io
