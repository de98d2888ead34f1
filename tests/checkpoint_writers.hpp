// Test-only writers of GGUF files and compressed-tensors checkpoint folders, written
// from the formats' specifications without the library's readers, plus the small MoE models the
// checkpoint suites store in them and an independent routing reference. Defined by
// checkpoint_gguf_writer.cpp (16-bit floats, GGUF, ggml blocks), checkpoint_ct_writer.cpp
// (compressed-tensors folders, GPTQ and AWQ modules), checkpoint_models.cpp (the MoE truths and
// their GGUF files), checkpoint_ct_model.cpp (their compressed-tensors folders) and
// checkpoint_routing.cpp (the routing reference).
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "w4a8moe/w4a8moe.hpp"

namespace ckpt_test {

// ---------------------------------------------------------------------------------------------
// Bytes

class Bytes {
 public:
  std::vector<uint8_t> data;
  template <class T>
  void put(T v) {
    const size_t at = data.size();
    data.resize(at + sizeof(T));
    std::memcpy(data.data() + at, &v, sizeof(T));
  }
  void str(const std::string& s) {
    put<uint64_t>(s.size());
    const size_t at = data.size();
    data.resize(at + s.size());
    if (!s.empty()) std::memcpy(data.data() + at, s.data(), s.size());
  }
  size_t size() const { return data.size(); }
};

// Appends src to dst. (vector::insert trips a false -Wnonnull in aarch64 GCC 12 under -Werror.)
inline void append_bytes(std::vector<uint8_t>& dst, const std::vector<uint8_t>& src) {
  if (src.empty()) return;
  const size_t at = dst.size();
  dst.resize(at + src.size());
  std::memcpy(dst.data() + at, src.data(), src.size());
}

uint16_t f16_bits(float v);   // round to nearest even
uint16_t bf16_bits(float v);  // round to nearest even
float from_f16(uint16_t h);
float from_bf16(uint16_t h);

// ---------------------------------------------------------------------------------------------
// GGUF

// GGUF value types (the specification's numbering).
enum : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};
// ggml types used by the tests.
enum : uint32_t {
  kTF32 = 0,
  kTF16 = 1,
  kTQ4_0 = 2,
  kTQ4_1 = 3,
  kTQ5_0 = 6,
  kTQ8_0 = 8,
  kTQ4_K = 12,
  kTQ5_K = 13,
  kTQ6_K = 14,
  kTIQ2_XXS = 16,
  kTBF16 = 30,
  kTMXFP4 = 39,
};

class GgufWriter {
 public:
  uint32_t version = 3;
  uint64_t alignment = 32;  // the padding used; general.alignment is written only via kv_u32

  // value: the encoded value (after the type), e.g. from Bytes.
  void kv_raw(const std::string& key, uint32_t type, const std::vector<uint8_t>& value);
  void kv_u32(const std::string& key, uint32_t v);
  void kv_i32(const std::string& key, int32_t v);
  void kv_u64(const std::string& key, uint64_t v);
  void kv_f32(const std::string& key, float v);
  void kv_bool(const std::string& key, bool v);
  void kv_string(const std::string& key, const std::string& v);
  void kv_strings(const std::string& key, const std::vector<std::string>& v);  // array of string

  // ne: innermost first (GGUF order). data: the encoded bytes.
  void tensor(const std::string& name, uint32_t type, std::vector<int64_t> ne,
              std::vector<uint8_t> data);

  // Byte positions in the serialized file, for corrupting it.
  struct Layout {
    size_t tensor_count = 0, kv_count = 0;  // positions of the two u64 counts
    std::vector<size_t> info_begin;         // per tensor: its name length field
    std::vector<size_t> type_field, offset_field;
    size_t data_begin = 0;
    std::vector<size_t> data_at;  // per tensor: file position of its data
  };
  std::vector<uint8_t> serialize(Layout* layout = nullptr) const;
  void write(const std::string& path) const;
  // As llama.cpp's gguf-split: `count` writers, the first with all the metadata, every one with
  // split.no, split.count and split.tensors.count, the tensors dealt round-robin.
  std::vector<GgufWriter> split(int count) const;

 private:
  template <class T>
  void kv_scalar(const std::string& key, uint32_t type, T v) {
    Bytes b;
    b.put(v);
    kv_raw(key, type, b.data);
  }
  struct Kv {
    std::string key;
    uint32_t type;
    std::vector<uint8_t> value;
  };
  struct Tensor {
    std::string name;
    uint32_t type;
    std::vector<int64_t> ne;
    std::vector<uint8_t> data;
  };
  std::vector<Kv> kvs_;
  std::vector<Tensor> tensors_;
};

void write_file(const std::string& path, const std::vector<uint8_t>& bytes);

// Encoders (rows of n elements, n a multiple of the block). Q4_0: q in [0, 15] (value q - 8) and
// one f16 scale per 32; Q8_0: q in [-128, 127] and one f16 scale per 32.
std::vector<uint8_t> encode_q4_0(const std::vector<uint8_t>& q, const std::vector<uint16_t>& d);
std::vector<uint8_t> encode_q8_0(const std::vector<int8_t>& q, const std::vector<uint16_t>& d);
std::vector<uint8_t> encode_f32(const std::vector<float>& v);
std::vector<uint8_t> encode_f16(const std::vector<float>& v);   // v must be f16-exact
std::vector<uint8_t> encode_bf16(const std::vector<float>& v);  // v must be bf16-exact

// Random blocks of a block type (any bytes are valid blocks; scales kept finite and small), and
// their values decoded here from the format's definition, element by element.
std::vector<uint8_t> random_blocks(uint32_t type, int64_t elements, uint64_t seed);
std::vector<float> decode_blocks(uint32_t type, const std::vector<uint8_t>& bytes,
                                 int64_t elements);

// ---------------------------------------------------------------------------------------------
// compressed-tensors

// compressed-tensors' pack_to_int32 for 4 bits: value + 8, element 8w + i in bits 4i.
std::vector<int32_t> pack_int4_words(const std::vector<int8_t>& values, int64_t rows, int64_t cols);

struct StTensor {
  w4a8moe::DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// A folder: config.json, and the tensors in `shards` files (1: model.safetensors; more:
// model-0000k-of-0000n.safetensors with model.safetensors.index.json).
class CtWriter {
 public:
  nlohmann::json config = nlohmann::json::object();
  int shards = 1;
  template <class T>
  void add(const std::string& name, w4a8moe::DType dtype, std::vector<int64_t> shape,
           const std::vector<T>& values) {
    StTensor t{dtype, std::move(shape), std::vector<uint8_t>(values.size() * sizeof(T))};
    std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
    tensors[name] = std::move(t);
  }
  std::map<std::string, StTensor> tensors;
  void write(const std::string& folder) const;
};

// One module's GPTQ (awq false) or AWQ tensors, M.{qweight, qzeros, scales} and GPTQ's g_idx, from
// int4 values v [rows, cols] in [-8, 7], scales sc and zero points z (in [-8, 7]; symmetric: all
// 0) [rows, groups], as AutoGPTQ's and AutoAWQ's pack() lay them out; zeros_minus_one: GPTQ's
// "gptq" checkpoint format.
// g_idx (GPTQ): input k's group, [cols]; empty: k / group size. The values v stay in the
// inputs' order; input k's scale and zero point are those of group g_idx[k].
void add_gptq_module(CtWriter& w, const std::string& prefix, bool awq, bool zeros_minus_one,
                     const std::vector<int8_t>& v, const std::vector<float>& sc,
                     const std::vector<int8_t>& z, int64_t rows, int64_t cols, int64_t groups,
                     const std::vector<int32_t>& g_idx = {});

// ---------------------------------------------------------------------------------------------
// Models

// A small MoE layer's truth: int4 values and scales (exact in f16 and bf16), router, biases.
struct Moe {
  int64_t H = 64, I = 64, E = 8, K = 2;
  int group = 32;
  std::vector<int8_t> w13;    // [E, 2I, H] halves: gate rows then up rows
  std::vector<float> w13_s;   // [E, 2I, H/g]
  std::vector<int8_t> w2;     // [E, H, I]
  std::vector<float> w2_s;    // [E, H, I/g]
  std::vector<float> router;  // [E, H]
  std::vector<float> router_bias, selection_bias, b13, b2;  // empty unless set
  // Asymmetric checkpoints: zero points in [-8, 7] shaped like w13_s / w2_s (element
  // (value - z) * scale); empty: symmetric.
  std::vector<int8_t> w13_z, w2_z;
  // GPTQ act-order: each expert's g_idx, [E, H] (its gate and up share it) and [E, I] (down);
  // empty: input k in group k / g.
  std::vector<int32_t> g13, g2;
};
// Outputs of order one for x ~ N(0, 1): scales (1.5 to 3.5) / (8 sqrt(K)), bf16- and f16-exact.
Moe make_moe(int64_t H, int64_t I, int64_t E, int64_t K, uint64_t seed);

// Expert e's rows of the gate (which 0), up (1) or down (2) projection: [rows, cols] values and
// [rows, cols/g] scales.
std::vector<int8_t> rows_of(const Moe& m, int which, int64_t e);
std::vector<float> scales_of(const Moe& m, int which, int64_t e);
// Expert e's zero points of a projection, [rows, groups] (groups 1: channel), as w13_z / w2_z.
std::vector<int8_t> zero_points_of(const Moe& m, int which, int64_t e);

// The whole [E, rows, cols] tensor of a projection as Q4_0 (the Moe's own values and scales).
std::vector<uint8_t> q4_0_tensor(const Moe& m, int which);

// ---------------------------------------------------------------------------------------------
// Model files: small MoE models stored as GGUF files and compressed-tensors folders

struct GgufSpec {
  std::string arch = "qwen3moe";
  int layers = 2;
  int64_t H = 64, I = 64, E = 8, K = 2;
  uint32_t types[3] = {kTQ4_0, kTQ4_0, kTQ4_0};  // gate, up, down
  bool expert_bias = false, router_bias = false, selection_bias = false;
  int64_t expert_count_meta = 0;  // <arch>.expert_count; 0: E
  // A shared expert of intermediate size Is (0: 2 I): ffn_{gate,up,down}_shexp, and with
  // shared_gate Qwen2-MoE's ffn_gate_inp_shexp [H].
  bool shared_expert = false, shared_gate = false;
  int64_t Is = 0;
  uint32_t shared_types[3] = {kTQ4_0, kTQ4_0, kTQ4_0};
};

struct GgufModel {
  GgufWriter writer;
  std::vector<Moe> layers;
  std::vector<std::vector<float>> floats[3];  // per layer: the file's values of non-Q4_0 tensors
  // Shared experts: per layer, the truth as a one-expert Moe (router: the gate [1, H]) and the
  // file's values of non-Q4_0 tensors.
  std::vector<Moe> shared;
  std::vector<std::vector<float>> shared_floats[3];
};

// A GGUF file of `layers` MoE layers (tensors of the spec's types; Q4_0 from the Moe truths,
// others random in their format), with the architecture's metadata.
GgufModel make_gguf(const GgufSpec& spec);

struct CtSpec {
  std::string model_type = "qwen3_moe";  // also gpt_oss, llama4 (config.json with text_config)
  // packed, int, bf16 (f16, f32: dense in that dtype), gptq or awq (F16 scales; awq always with
  // zero points, gptq with them when asymmetric)
  std::string scheme = "packed";
  std::string strategy = "group";  // group or channel
  int shards = 1;
  int64_t H = 64, I = 64, E = 8, K = 2;
  int layers = 2;
  bool mixtral_names = false;
  // The experts fused in experts.gate_up_proj [E, H, 2I] and experts.down_proj [E, I, H]: "bf16",
  // or "mxfp4" (gpt-oss's _blocks / _scales). gpt_oss interleaves gate and up, llama4 concatenates.
  std::string fused{};
  bool expert_bias = false, router_bias = false;  // gpt-oss: experts' and router's biases
  // A shared expert module in the block: "shared_experts" (DeepSeek), "shared_expert" (Qwen2-MoE,
  // Llama-4), stored like one expert of `scheme` (bf16 when the experts are fused), of intermediate
  // size Is (0: 2 I); shared_gate: Qwen2-MoE's shared_expert_gate [1, H].
  std::string shared{};
  bool shared_gate = false;
  int64_t Is = 0;
  // symmetric: false, with weight_zero_point tensors (pack-quantized: I32 packed along the rows;
  // int-quantized: I8) whose values span [-8, 7].
  bool asymmetric = false;
  std::string gptq_format = "gptq";  // gptq's checkpoint_format: "gptq" (zeros less one), "gptq_v2"
  // Act-order (gptq: desc_act; packed / int: actorder "group" with weight_g_idx): every
  // module's g_idx a random assignment of g inputs to each group (as GPTQ's act-order makes
  // them), shared by an expert's gate and up (Moe::g13, g2)
  bool act_order = false;
};

struct CtModel {
  CtWriter writer;
  std::vector<Moe> layers;  // channel strategy: w13_s / w2_s hold one scale per row
  // Dense and fused schemes: the file's values per layer, expert and projection (gate, up, down),
  // as [N, K] matrices (rows = outputs), whatever the file's layout.
  std::vector<std::vector<float>> dense;
  std::vector<Moe> shared;                       // per layer: the shared expert's truth (E = 1)
  std::vector<std::vector<float>> shared_dense;  // dense shared experts: per layer and projection
};

// A checkpoint folder's config.json and tensors (pack-quantized / int-quantized int4 from the Moe
// truths with bf16 scales, dense weights, or fused bf16 / MXFP4 experts), with a bf16 router.
CtModel make_ct(const CtSpec& spec);

// The value of an FP4 (e2m1) code: sign bit 8, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
double e2m1_value(int code);

std::vector<uint16_t> bf16_of(const std::vector<float>& v);

// ---------------------------------------------------------------------------------------------
// Independent routing (double math, stable sort)

struct RouteSpec {
  std::string gating = "softmax";  // softmax, sigmoid, softmax_topk
  bool renormalize = false;
  double scaling = 1.0;
  int64_t groups = 1, groups_used = 1;
  bool top2 = true;  // group score: sum of the best two (else the best one)
};
void route_reference(const std::vector<float>& logits, int64_t T, int64_t E, int64_t K,
                     const std::vector<float>& selection_bias, const RouteSpec& spec,
                     std::vector<int64_t>& ids, std::vector<double>& weights);

// f32 logits in double: x [T, H] times router [E, H]^T + bias.
std::vector<double> logits_reference(const std::vector<float>& x, const std::vector<float>& router,
                                     const std::vector<float>& bias, int64_t T, int64_t H,
                                     int64_t E);

}  // namespace ckpt_test
