// One MoE layer of a real checkpoint: a GGUF file or a compressed-tensors (Hugging Face)
// folder, read in place and handed to the packer one expert at a time.
//
//   auto source = open_layer("model.gguf", 12, {});      // checks the file, reads the metadata
//   Router router = source->router();                    // f32 [E, H] and biases
//   PackedLayer packed = pack_layer(*source, threads);   // streams the experts into the packer
//
// LoadOptions::experts restricts the packed weights to a contiguous range of experts (expert
// parallelism: each rank packs its share).
//
// A layer's shared expert (DeepSeek, Qwen2-MoE, Llama-4: an MLP every token goes through) is a
// source of its own, opened with LoadOptions::shared_expert: one expert (E = K = 1) of its own
// intermediate size, run by the same W4A8 path with weight 1 (DeepSeek, Llama-4 add its output
// as is) or sigmoid(x . gate) (Qwen2-MoE's shared_expert_gate, the source's router).
//
// Expert weights reach the packer as int4 values (nibble-packed, value + 8, element 2j in the low
// nibble) with scales in the dtype the file holds them in when the file's format maps exactly
// (GGUF Q4_0: f16 scales, group 32; compressed-tensors int4: its scales and group size). Any other
// type is dequantized and requantized (QuantRule, group size of LoadOptions), and the error that
// adds is measured (conversions()), or, with require_exact, refused with a message naming the
// tensor and its type.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "w4a8moe/routing.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io {

// A contiguous range [first, first + count) of a layer's global expert indices.
struct ExpertRange {
  int64_t first = 0;
  int64_t count = -1;  // -1: every expert from `first` on
};

struct LoadOptions {
  int group_size = 32;  // for converted tensors (an exact source's own group size wins)
  QuantRule rule = QuantRule::q4_0;
  bool require_exact = false;  // refuse any conversion
  bool shared_expert = false;  // open the layer's shared expert instead of its routed experts
  // The experts pack_layer() loads (default: all), e.g. one rank's share under expert
  // parallelism: the packed w13 and w2 then hold only these, in ascending global order, and only
  // their rows are read and converted. open_layer() throws Error unless 0 <= first and
  // 1 <= count <= E - first (count -1: E - first). The source's info(), router() and routing
  // stay the whole layer's (E experts, global ids); load_expert() takes any global index.
  ExpertRange experts;
};

// How one of the layer's weight tensors (gate, up, down) became int4.
struct Conversion {
  std::string tensor;  // e.g. "blk.3.ffn_down_exps.weight"
  std::string source;  // e.g. "Q4_0", "BF16", "pack-quantized int4"
  bool exact = true;
  // Converted tensors: over the elements converted so far.
  double err_sq = 0, ref_sq = 0, max_abs_err = 0;
  int64_t elements = 0;
  double relative_rms() const { return ref_sq > 0 ? std::sqrt(err_sq / ref_sq) : 0.0; }
};

struct LayerInfo {
  std::string format;  // "gguf" or "compressed-tensors"
  std::string model;   // GGUF architecture or config.json model_type
  int layer = 0;
  int64_t hidden = 0, inter = 0, experts = 0, top_k = 0;
  int group_size = -1;  // of the packed weights
  // The slots' format per role: int4 (nibbles w + 8, float scales), int4 with zero points (the
  // same plus int8 zero points in [-8, 7] shaped like the scales), or mxfp4 (the e2m1 codes,
  // e8m0 exponents as u8 scales, group 32), as pack_w13 / pack_w2 take them.
  WeightFormat w13_format = WeightFormat::int4_symmetric, w2_format = WeightFormat::int4_symmetric;
  DType w13_scale_dtype = DType::f32, w2_scale_dtype = DType::f32;
  // Act-order checkpoints (GPTQ desc_act): each expert's w13 comes with its input order
  // (ExpertSlot::w13_input_order, PackOptions::input_order), its columns sorted by group.
  bool w13_input_order = false;
  bool expert_bias = false;  // gpt-oss: biases of the gate/up and down projections
  // Routed sources: the layer also has a shared expert (LoadOptions::shared_expert opens it).
  bool has_shared_expert = false;
  // Shared-expert sources (experts = top_k = 1): the output is scaled per token by
  // sigmoid(x . gate), the router's weight [1, H] (routing: sigmoid); else it is added as is.
  bool shared_gate = false;
  RoutingConfig routing;
  MoeParams params;                // activation, alpha/limit, router weight on the input
  std::vector<std::string> notes;  // what the loader decided and the user should know
};

struct Router {
  std::vector<float> weight;          // [E, H] (a shared expert: its gate [1, H], or empty)
  std::vector<float> bias;            // [E] or empty: added to the logits (gpt-oss)
  std::vector<float> selection_bias;  // [E] or empty: added to scores for choosing (DeepSeek-V3)
};

// Where load_expert writes one expert (buffers sized by the caller from LayerInfo).
struct ExpertSlot {
  uint8_t* w13 = nullptr;        // [2I, H/2] nibble-packed (LayerInfo's format), gate then up
  uint8_t* w13_scale = nullptr;  // [2I, H/g] (or [2I]) in w13_scale_dtype
  float* w13_bias = nullptr;     // [2I] when expert_bias
  uint8_t* w2 = nullptr;         // [H, I/2]
  uint8_t* w2_scale = nullptr;   // [H, I/g] (or [H]) in w2_scale_dtype
  float* w2_bias = nullptr;      // [H] when expert_bias
  // int4_zero_point formats only: int8 in [-8, 7], one per scale
  int8_t* w13_zero_point = nullptr;  // [2I, H/g] (or [2I])
  int8_t* w2_zero_point = nullptr;   // [H, I/g] (or [H])
  // LayerInfo::w13_input_order only: [H], the input that column c of w13's rows multiplies
  int32_t* w13_input_order = nullptr;
};

class LayerSource {
 public:
  virtual ~LayerSource() = default;
  const LayerInfo& info() const noexcept { return info_; }
  virtual Router router() const = 0;
  // Decodes expert e into the slot. Safe to call from several threads for different experts.
  virtual void load_expert(int64_t e, const ExpertSlot& slot) const = 0;
  // The file bytes of expert e are no longer needed (drops them from resident memory).
  virtual void release_expert(int64_t e) const = 0;
  // The gate, up and down tensors, with the error of converted ones so far.
  std::vector<Conversion> conversions() const;
  // The experts pack_layer() loads: LoadOptions::experts, checked, count resolved.
  const ExpertRange& experts() const noexcept { return experts_; }

 protected:
  // Adds converted rows' statistics (thread-safe); index 0 gate, 1 up, 2 down.
  void add_conversion(int index, const Conversion& delta) const;
  LayerInfo info_;
  mutable std::mutex mutex_;
  mutable std::vector<Conversion> conversions_;  // set by the subclass

 private:
  friend std::unique_ptr<LayerSource> open_layer(const std::string&, int, const LoadOptions&);
  ExpertRange experts_;
};

// A .gguf file (or any file starting with the GGUF magic), or a folder with config.json (and
// model.safetensors or model.safetensors.index.json). Throws Error naming the path and the
// problem (missing tensors, unsupported types, layer without experts, ...).
std::unique_ptr<LayerSource> open_layer(const std::string& path, int layer,
                                        const LoadOptions& options);
// The two loaders open_layer() dispatches to (gguf_layer.cpp, hf_layer.cpp).
std::unique_ptr<LayerSource> open_gguf_layer(const std::string& path, int layer,
                                             const LoadOptions& options);
std::unique_ptr<LayerSource> open_hf_layer(const std::string& folder, int layer,
                                           const LoadOptions& options);

// The experts and weights of T tokens x [T, H] (f32/bf16/f16): the router's logits in f32, then
// route() with the source's routing. A shared-expert source gives id 0 and weight
// sigmoid(x . gate), or 1 without a gate.
void route_tokens(const LayerSource& source, const Router& router, const TensorView& x,
                  std::vector<int32_t>& ids, std::vector<float>& weights);

// Sizes of one expert's slot buffers.
struct SlotSizes {
  size_t w13 = 0, w13_scale = 0, w13_bias = 0, w2 = 0, w2_scale = 0, w2_bias = 0;  // bytes
  size_t w13_zero_point = 0, w2_zero_point = 0;  // bytes (int4_zero_point formats)
  size_t w13_input_order = 0;                    // bytes (LayerInfo::w13_input_order)
};
SlotSizes slot_sizes(const LayerInfo& info);

// Owns the buffers of `count` consecutive expert slots (contiguous, so a chunk is one view).
class ExpertChunk {
 public:
  ExpertChunk(const LayerInfo& info, int64_t count);
  ExpertSlot slot(int64_t i);
  // Views of the first n experts as the packer takes them.
  TensorView w13(int64_t n) const;
  TensorView w13_scale(int64_t n) const;
  TensorView w13_bias(int64_t n) const;  // empty without expert biases
  TensorView w2(int64_t n) const;
  TensorView w2_scale(int64_t n) const;
  TensorView w2_bias(int64_t n) const;
  // Empty unless the role's format is int4_zero_point.
  TensorView w13_zero_point(int64_t n) const;
  TensorView w2_zero_point(int64_t n) const;
  TensorView w13_input_order(int64_t n) const;  // empty unless LayerInfo::w13_input_order

 private:
  LayerInfo info_;
  SlotSizes sizes_;
  int64_t count_;
  std::vector<uint8_t> w13_, w13_scale_, w2_, w2_scale_;
  std::vector<float> w13_bias_, w2_bias_;
  std::vector<int8_t> w13_zero_point_, w2_zero_point_;
  std::vector<int32_t> w13_input_order_;
};

struct PackedLayer {
  PackedWeights w13, w2;
};

// Streams the source's experts (source.experts(): all, or the range LoadOptions::experts chose)
// into the packer, `threads` experts at a time (decoded in parallel; threads <= 0: one per
// hardware thread). Peak memory: the packed layer plus one chunk of unpacked experts.
// `progress` (optional) is called with the fraction of experts done after each chunk.
PackedLayer pack_layer(const LayerSource& source, int threads,
                       const std::function<void(double)>& progress = {});

// `threads`, or one per hardware thread when threads <= 0.
int loader_threads(int threads);

// The float reference of the layer (docs/testing.md, "The references") over the int4 weights as
// loaded (dequantized w * s), without activation quantization, in double: out [T, H]. x [T, H] f32;
// ids and weights [T, K]. Streams the experts that some token chose, `threads` at a time.
std::vector<double> float_reference(const LayerSource& source, const std::vector<float>& x,
                                    const std::vector<int32_t>& ids,
                                    const std::vector<float>& weights, int threads);

}  // namespace w4a8moe::io
