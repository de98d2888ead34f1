// Deterministic synthetic MoE layers of real model shapes, for the bench command.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::cli {

struct Preset {
  const char* name;
  int64_t hidden, inter, experts, top_k;
  Activation activation;
  bool interleaved_bias;  // gpt-oss: interleaved gate/up rows and biases
  bool router_on_input;   // llama4: router weight applied on the input
};

const std::vector<Preset>& presets();
const Preset& find_preset(const std::string& name);  // throws Error listing the names

// Logical weights of one layer: nibble-packed int4 (u8, value + 8), scales, optional biases.
struct SyntheticLayer {
  Preset preset;
  int group_size;
  DType scale_dtype;  // mxfp4: u8 (the e8m0 exponents)
  WeightFormat format = WeightFormat::int4_symmetric;
  std::vector<uint8_t> w13, w2;  // [E, 2I, H/2], [E, H, I/2]: int4 nibbles or mxfp4 codes
  std::vector<uint8_t> s13, s2;  // raw scale bytes in scale_dtype
  std::vector<float> b13, b2;    // empty, or [E, 2I], [E, H]
  std::vector<int8_t> z13, z2;   // int4_zero_point: zero points shaped like the scales
  std::vector<int32_t> order13;  // act-order: w13's input order [E, H], a permutation each
  LogicalWeights view() const;   // views over the above
};

// progress(fraction) is called from the generating thread now and then.
// format mxfp4: group_size 32, random codes and e8m0 exponents (scale_dtype is ignored: u8);
// int4_zero_point: zero points in [-2, 2], near the middle as asymmetric quantizers find them.
// act_order: a random input order per expert for w13 (PackOptions::input_order).
SyntheticLayer make_layer(const Preset& preset, int group_size, DType scale_dtype, uint64_t seed,
                          void (*progress)(double, void*), void* progress_ctx,
                          WeightFormat format = WeightFormat::int4_symmetric,
                          bool act_order = false);

struct Routing {
  std::vector<int32_t> ids;    // [T, K]
  std::vector<float> weights;  // [T, K], softmax over the chosen K
};

// uniform: K distinct experts per token, uniformly; skewed: Zipf-like popularity (a few hot
// experts take most tokens), still K distinct per token.
Routing make_routing(int64_t tokens, int64_t experts, int64_t top_k, bool skewed, uint64_t seed);

// Activations of order one (normal), f32.
std::vector<float> make_activations(int64_t tokens, int64_t hidden, uint64_t seed);

}  // namespace w4a8moe::cli
